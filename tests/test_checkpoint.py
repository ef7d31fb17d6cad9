"""CheckpointManager: complete vs partial checkpoints, pruning, round trips, and
optimizer state made ready for loading."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aiopipe.checkpoint import CheckpointError, CheckpointManager, materialize_optimizer_state
from hstu_tasks import leave_and_exit


def model_and_adam(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x = torch.full((2, 4), float(step))
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def test_round_trip_resumes_exactly(tmp_path: Path) -> None:
    model, optimizer = model_and_adam(0)
    train(model, optimizer, range(3))
    manager = CheckpointManager(tmp_path)
    assert manager.latest() is None
    manager.save(3, state(model, optimizer), meta={"losses": [1.5, 2.5, 3.5]})
    train(model, optimizer, range(3, 6))

    fresh, fresh_optimizer = model_and_adam(1)  # different weights, no Adam state yet
    materialize_optimizer_state(fresh_optimizer)
    target = state(fresh, fresh_optimizer)
    assert manager.latest() == 3
    assert manager.load(3, target) == {"losses": [1.5, 2.5, 3.5]}
    fresh.load_state_dict(target["model"])  # type: ignore[arg-type]
    fresh_optimizer.load_state_dict(target["optimizer"])  # type: ignore[arg-type]
    train(fresh, fresh_optimizer, range(3, 6))
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_partial_checkpoints_are_ignored_and_cleaned(tmp_path: Path) -> None:
    model, optimizer = model_and_adam(0)
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(2, state(model, optimizer))
    # a crash mid-save leaves these behind: a partial directory, a complete-looking
    # name without the metadata file
    (tmp_path / "step-00000009.partial").mkdir()
    (tmp_path / "step-00000009.partial" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "step-00000007").mkdir()
    assert manager.complete_steps() == [2]
    assert manager.latest() == 2
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        manager.load(7, state(model, optimizer))
    manager.save(4, state(model, optimizer))
    manager.save(6, state(model, optimizer))
    assert manager.complete_steps() == [4, 6]  # keep=2 pruned step 2
    assert not (tmp_path / "step-00000009.partial").exists()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)
    with pytest.raises(ValueError, match="step"):
        CheckpointManager(tmp_path).save(-1, {})
    with pytest.raises(ValueError, match="JSON"):
        CheckpointManager(tmp_path).save(1, {}, meta={"when": object()})
    assert not tmp_path.joinpath("step-00000001").exists()


def test_a_checkpoint_from_another_world_size_is_refused_before_loading(tmp_path: Path) -> None:
    model, optimizer = model_and_adam(0)
    manager = CheckpointManager(tmp_path)
    manager.save(1, state(model, optimizer))
    meta_file = tmp_path / "step-00000001" / "aiopipe-meta.json"
    meta_file.write_text(meta_file.read_text().replace('"world_size": 1', '"world_size": 4'))
    fresh, _ = model_and_adam(1)
    before = [p.detach().clone() for p in fresh.parameters()]
    target = {"model": fresh.state_dict()}
    with pytest.raises(CheckpointError, match="written by 4 ranks, this job has 1"):
        manager.load(1, target)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.state_dict().values()))


def test_any_world_size_accepts_a_checkpoint_of_another_world_size(tmp_path: Path) -> None:
    model, optimizer = model_and_adam(0)
    manager = CheckpointManager(tmp_path)
    manager.save(1, state(model, optimizer), meta={"samples_consumed": 64})
    meta_file = tmp_path / "step-00000001" / "aiopipe-meta.json"
    meta_file.write_text(meta_file.read_text().replace('"world_size": 1', '"world_size": 4'))
    assert manager.describe(1)["world_size"] == 4
    fresh, _ = model_and_adam(1)
    target = {"model": fresh.state_dict()}
    assert manager.load(1, target, any_world_size=True) == {"samples_consumed": 64}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), target["model"].values()))


def test_a_checkpoint_of_other_global_shapes_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"model": {"table": torch.zeros(4, 3), "bias": torch.zeros(3)}})
    target = {"model": {"table": torch.ones(5, 3), "bias": torch.ones(3)}}
    with pytest.raises(CheckpointError, match=r"'model.table' has global shape \(4, 3\) there, "
                                              r"\(5, 3\) here"):  # fmt: skip
        manager.load(1, target, any_world_size=True)
    assert torch.equal(target["model"]["bias"], torch.ones(3))  # refused before loading


def test_materialize_optimizer_state_changes_no_parameter() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    for optimizer in (
        torch.optim.Adam(model.parameters(), lr=0.1, weight_decay=0.1),
        torch.optim.AdamW(model.parameters(), lr=0.1),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    ):
        materialize_optimizer_state(optimizer)
        assert len(optimizer.state) == 2  # weight and bias have their state now
        assert all(p.grad is None for p in model.parameters())
        assert optimizer.param_groups[0]["lr"] == 0.1
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)


def two_rank_worker(rank: int, store: str, directory: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip
    manager = CheckpointManager(directory)
    replicated = torch.arange(4.0)
    manager.save(5, {"w": replicated, "rank_note": f"written by {rank}"}, meta={"rank": rank})
    assert manager.latest() == 5
    target = {"w": torch.zeros(4)}
    assert manager.load(5, target) == {"rank": 0}  # rank 0's meta is the one kept
    assert torch.equal(target["w"], replicated)
    leave_and_exit(0)  # no native teardown at exit (leave_and_exit says why)


@pytest.mark.distributed
def test_two_ranks_save_and_agree_on_the_latest(tmp_path: Path) -> None:
    # a file store: no port to pick, so none another process can take meanwhile
    store = tmp_path / "store"
    mp.spawn(two_rank_worker, args=(str(store), str(tmp_path / "ckpt")), nprocs=2, join=True)
    assert (tmp_path / "ckpt" / "step-00000005" / "aiopipe-meta.json").is_file()


def test_a_checkpoint_of_another_optimizer_is_refused_naming_what_it_lacks(
    tmp_path: Path,
) -> None:
    """Written with SGD, resumed with Adam: the checkpoint has no Adam state."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    materialize_optimizer_state(sgd)
    manager = CheckpointManager(tmp_path)
    manager.save(1, state(model, sgd))
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    materialize_optimizer_state(adam)
    with pytest.raises(CheckpointError, match=r"checkpoint step-00000001 does not fit this model: "
                                              r"it has no 'optimizer.state.0.(exp_avg|step)"):  # fmt: skip
        manager.load(1, state(model, adam))


def test_a_checkpoint_of_adam_resumed_with_sgd_is_refused_naming_an_option(
    tmp_path: Path,
) -> None:
    """Written with Adam, resumed with SGD: the checkpoint lacks SGD's options. Only
    tensors were compared, and torch's own traceback said so deep in DCP."""
    model, adam = model_and_adam(0)
    train(model, adam, range(2))
    manager = CheckpointManager(tmp_path)
    manager.save(1, state(model, adam))
    fresh, _ = model_and_adam(0)
    sgd = torch.optim.SGD(fresh.parameters(), lr=0.1)  # no state: only its options differ
    with pytest.raises(CheckpointError, match=r"it has no 'optimizer\.param_groups\.0\.\w+'"):
        manager.load(1, state(fresh, sgd))


def test_a_checkpoint_whose_record_is_truncated_or_a_file_for_a_directory_is_refused(
    tmp_path: Path,
) -> None:
    # A JSONDecodeError traceback; a FileExistsError only at the first save.
    model, optimizer = model_and_adam(0)
    manager = CheckpointManager(tmp_path)
    manager.save(1, state(model, optimizer))
    record = tmp_path / "step-00000001" / "aiopipe-meta.json"
    record.write_text(record.read_text()[:20])
    with pytest.raises(CheckpointError, match="aiopipe-meta.json cannot be read"):
        manager.load(1, state(model, optimizer))
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        CheckpointManager(tmp_path / "a-file")


def test_a_checkpoint_from_before_the_first_step_says_so_and_loads_without_state(
    tmp_path: Path,
) -> None:
    """Saved before the optimizer's first step (every early call cancelled, say): it
    has no optimizer state, so an optimizer given some by materialize_optimizer_state
    cannot take it -- the error says why; one left without state loads it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    manager = CheckpointManager(tmp_path)
    manager.save(0, state(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)))
    fresh = torch.nn.Linear(4, 3)
    materialized = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    materialize_optimizer_state(materialized)
    with pytest.raises(CheckpointError, match="no state yet when it was saved"):
        manager.load(0, state(fresh, materialized))
    manager.load(0, state(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)))
    assert torch.equal(fresh.weight, model.weight)


def test_a_checkpoint_that_cannot_be_read_raises_checkpoint_error(tmp_path: Path) -> None:
    # torch reports it with its CheckpointException, a BaseException: not past our family
    model, optimizer = model_and_adam(0)
    manager = CheckpointManager(tmp_path)
    manager.save(1, state(model, optimizer))
    for data in (tmp_path / "step-00000001").glob("*.distcp"):
        data.write_bytes(b"")  # the tensors' bytes gone, the metadata intact
    with pytest.raises(CheckpointError, match="loading the checkpoint of step 1 failed"):
        manager.load(1, state(model, optimizer))


def test_a_re_save_that_crashes_before_its_commit_keeps_the_older_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = model_and_adam(0)
    train(model, optimizer, range(2))
    manager = CheckpointManager(tmp_path)
    manager.save(1, state(model, optimizer))
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    real_replace = os.replace

    def crash_at_the_commit(source: Any, target: Any) -> None:
        if str(source).endswith(".partial"):
            raise OSError("the machine went down")  # the old copy is already aside
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", crash_at_the_commit)
    with pytest.raises(CheckpointError, match="committing the checkpoint of step 1 failed"):
        manager.save(1, state(model, optimizer))
    monkeypatch.setattr(os, "replace", real_replace)
    assert manager.latest() == 1  # the complete older copy is still there
    fresh, fresh_optimizer = model_and_adam(1)
    materialize_optimizer_state(fresh_optimizer)
    manager.load(1, state(fresh, fresh_optimizer))
    assert all(torch.equal(a, b) for a, b in zip(saved, fresh.parameters()))


def test_saving_a_step_older_than_every_kept_one_is_refused(tmp_path: Path) -> None:
    model, optimizer = model_and_adam(0)
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(5, state(model, optimizer))
    manager.save(6, state(model, optimizer))
    with pytest.raises(CheckpointError, match="older than the 2 checkpoint"):
        manager.save(3, state(model, optimizer))
    assert manager.complete_steps() == [5, 6]


def test_a_training_checkpoint_of_another_optimizer_is_refused_by_its_options(
    tmp_path: Path,
) -> None:
    """DLRM written with Adagrad, resumed with SGD: SGD keeps no state, so no tensor
    was missing and the Adagrad state was dropped without a word.  The checkpoint
    records the dense optimizer's options, and the restore compares them."""
    from hstu_tasks import DLRMConfig, build_dlrm_training, restore_training
    from hstu_tasks.checkpoint import optimizer_options, training_state
    from one_rank import one_rank_group

    config = DLRMConfig(num_embeddings=50, batch_size=4)
    with one_rank_group():
        adagrad = build_dlrm_training(config, "adagrad", seed=0)
        manager = CheckpointManager(tmp_path)
        manager.save(4, training_state(adagrad),
                     meta={"dense_optimizer_options": optimizer_options(adagrad)})  # fmt: skip
        with pytest.raises(CheckpointError, match="written with another optimizer"):
            restore_training(build_dlrm_training(config, "sgd", seed=0), manager)
        assert restore_training(build_dlrm_training(config, "adagrad", seed=0), manager)[0] == 4
