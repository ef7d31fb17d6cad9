"""CheckpointManager at its edges: steps of nine digits, a save whose write fails (a
full disk), a crash while pruning, a directory that is gone wrong, a step that is
no int, and optimizers materialize_optimizer_state cannot step as usual."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aiopipe.checkpoint import CheckpointError, CheckpointManager, materialize_optimizer_state
from aiopipe.errors import ConfigurationTypeError


def weights(value: float) -> dict[str, Any]:
    return {"w": torch.full((8,), value)}


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.suffix in (".partial", ".pruned"))


# -- steps of nine digits and more --------------------------------------------------------


def test_a_step_past_eight_digits_is_listed_resumed_and_pruned(tmp_path: Path) -> None:
    # ``step-100000000`` was written, then never matched: latest() went back in time
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (99_999_999, 100_000_000, 100_000_001):
        manager.save(step, weights(step))
    assert manager.complete_steps() == [100_000_000, 100_000_001]
    assert manager.latest() == 100_000_001
    assert sorted(os.listdir(tmp_path)) == ["step-100000000", "step-100000001"]
    target = weights(0)
    manager.load(100_000_001, target)
    assert torch.equal(target["w"], weights(100_000_001)["w"])


def test_a_name_padded_past_eight_digits_is_no_checkpoint(tmp_path: Path) -> None:
    # path(5) is step-00000005: step-000000005 would be listed, then found nowhere
    manager = CheckpointManager(tmp_path)
    manager.save(5, weights(5))
    shutil.copytree(tmp_path / "step-00000005", tmp_path / "step-000000006")
    assert manager.complete_steps() == [5]


# -- a save whose write fails -------------------------------------------------------------


class Unwritable:
    """A state value whose serialisation fails as a full disk does, mid-write."""

    def __reduce__(self) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_save_whose_write_fails_removes_its_partial(tmp_path: Path) -> None:
    # The partial kept the space it had taken: on a full disk every later save failed.
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(1, weights(1))
    with pytest.raises(CheckpointError, match=r"saving the checkpoint of step 2 failed, its "
                       r"partial directory removed: rank 0: OSError: .*No space left"):  # fmt: skip
        manager.save(2, {**weights(2), "extra": Unwritable()})
    assert leftovers(tmp_path) == []
    manager.save(3, weights(3))
    assert manager.complete_steps() == [1, 3]


def test_a_save_removes_what_other_saves_left_before_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A crashed save's partial of another step holds disk space the new save needs:
    # removing it only after the new one is written is too late on a full disk.
    import torch.distributed.checkpoint.state_dict_saver as saver

    manager = CheckpointManager(tmp_path)
    manager.save(1, weights(1))
    for name in ("step-00000009.partial", "step-00000001.pruned"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"x" * 1024)
    seen_while_writing: list[str] = []
    real_save = saver.save

    def save(*args: Any, **kwargs: Any) -> Any:
        seen_while_writing.extend(leftovers(tmp_path))
        return real_save(*args, **kwargs)

    monkeypatch.setattr(saver, "save", save)
    manager.save(2, weights(2))
    assert seen_while_writing == []
    assert manager.complete_steps() == [1, 2]


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "-r", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -m -r to mount a small tmpfs")
def test_after_a_save_fails_on_a_full_disk_the_next_smaller_ones_succeed(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    script = textwrap.dedent(f"""
        import os, warnings, torch
        warnings.simplefilter("ignore")
        from aiopipe.checkpoint import CheckpointError, CheckpointManager
        manager = CheckpointManager({str(mount / "ckpt")!r}, keep=2)
        manager.save(1, {{"w": torch.ones(1000)}})
        try:
            manager.save(2, {{"w": torch.ones(600_000)}})  # 2.4 MB on a 2 MiB disk
        except CheckpointError:
            print("step 2 refused")
        for step in (3, 4):
            manager.save(step, {{"w": torch.ones(1000)}})
        print(manager.complete_steps(), sorted(os.listdir({str(mount / "ckpt")!r})))
    """)
    command = (f"mount -t tmpfs -o size=2m tmpfs '{mount}' && "
               f"exec '{sys.executable}' -c \"$0\"")  # fmt: skip
    done = subprocess.run(["unshare", "-m", "-r", "sh", "-c", command, script],
                          capture_output=True, text=True, timeout=100)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "step 2 refused",
        "[3, 4] ['step-00000003', 'step-00000004']",
    ]


# -- a crash while pruning ----------------------------------------------------------------


class Killed(BaseException):
    """The process dying where it is raised (as SIGKILL would, nothing after runs)."""


def test_a_prune_that_fails_after_the_commit_is_no_failed_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A leftover that cannot be cleared (here a file where the aside name goes; on NFS
    # a busy .nfs file): the save had committed, and it was reported failed.
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(1, weights(1))
    (tmp_path / "step-00000001.pruned").write_text("in the way")
    manager.save(2, weights(2))  # committed; pruning step 1 fails and is logged
    assert manager.latest() == 2 and "pruning" in caplog.text
    (tmp_path / "step-00000001.pruned").unlink()
    manager.save(3, weights(3))  # the next save prunes what is left
    assert manager.complete_steps() == [3]


def test_a_crash_while_pruning_never_lists_a_broken_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The oldest checkpoint lost its data, kept its record and stayed listed complete.
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(1, weights(1))
    manager.save(2, weights(2))
    real_rmtree = shutil.rmtree

    def dies_after_the_first_file(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).name.startswith("step-00000001") and Path(path).is_dir():
            os.remove(next(Path(path).glob("*.distcp")))
            raise Killed
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", dies_after_the_first_file)
    with pytest.raises(Killed):
        manager.save(3, weights(3))
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert manager.complete_steps() == [2, 3]
    for step in manager.complete_steps():
        target = weights(0)
        manager.load(step, target)
        assert torch.equal(target["w"], weights(step)["w"])
    manager.save(4, weights(4))  # and what the crash left is cleaned up
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000004"]


# -- a directory gone wrong, a step that is no int ---------------------------------------


def test_a_directory_replaced_by_a_file_is_refused_by_save_and_latest(tmp_path: Path) -> None:
    # save() raised a bare FileExistsError; latest() said None: the job restarted from 0
    directory = tmp_path / "ckpt"
    manager = CheckpointManager(directory)
    directory.write_text("not a directory")
    with pytest.raises(CheckpointError, match="ckpt is a file, not a checkpoint directory"):
        manager.save(1, weights(1))
    with pytest.raises(CheckpointError, match="ckpt is a file, not a checkpoint directory"):
        manager.latest()
    with pytest.raises(CheckpointError, match="is a file"):
        manager.complete_steps()
    assert directory.read_text() == "not a directory"


def test_a_directory_that_cannot_be_created_raises_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot be created: .*Not a directory"):
        CheckpointManager(tmp_path / "a-file" / "ckpt").save(1, weights(1))
    # A read-only parent; made here, since chmod does not stop root.
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).parent == read_only:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(CheckpointError, match="read-only/ckpt cannot be created: .*Permission"):
        CheckpointManager(read_only / "ckpt").save(1, weights(1))


def test_a_step_or_keep_that_is_no_int_is_refused(tmp_path: Path) -> None:
    # save(1.5) wrote nothing and said "Unknown format code 'd' for object of type 'float'"
    manager = CheckpointManager(tmp_path)
    for step in (1.5, True, "3"):
        with pytest.raises(ConfigurationTypeError, match=f"step takes an int >= 0, got {step!r}"):
            manager.save(step, weights(1))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationTypeError, match="keep takes an int >= 1, got 2.5"):
        CheckpointManager(tmp_path, keep=2.5)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []
    manager.save(np.int64(7), weights(7))  # type: ignore[arg-type]
    assert manager.describe(7)["step"] == 7


# -- optimizers materialize_optimizer_state cannot step as usual --------------------------


def test_materialize_refuses_lbfgs_by_name() -> None:
    # torch: "LBFGS.step() missing 1 required positional argument: 'closure'"
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.LBFGS(model.parameters())
    with pytest.raises(CheckpointError, match="cannot prepare LBFGS: its step needs a closure"):
        materialize_optimizer_state(optimizer)
    assert all(p.grad is None for p in model.parameters())


def test_materialize_prepares_sparse_adam_and_a_checkpoint_of_it_loads(tmp_path: Path) -> None:
    # torch: "SparseAdam does not support dense gradients"
    torch.manual_seed(0)
    table = torch.nn.Embedding(10, 3, sparse=True)
    trained = torch.optim.SparseAdam(table.parameters(), lr=0.1)
    table(torch.tensor([1, 4])).sum().backward()
    trained.step()
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"table": table.state_dict(), "optimizer": trained.state_dict()})

    fresh = torch.nn.Embedding(10, 3, sparse=True)
    before = fresh.weight.detach().clone()
    optimizer = torch.optim.SparseAdam(fresh.parameters(), lr=0.1)
    materialize_optimizer_state(optimizer)
    assert torch.equal(fresh.weight, before) and fresh.weight.grad is None
    assert optimizer.param_groups[0]["lr"] == 0.1
    target = {"table": fresh.state_dict(), "optimizer": optimizer.state_dict()}
    manager.load(1, target)
    optimizer.load_state_dict(target["optimizer"])
    saved = trained.state[table.weight]["exp_avg"]
    assert torch.equal(optimizer.state[fresh.weight]["exp_avg"], saved)


def test_materialize_names_an_optimizer_whose_step_fails() -> None:
    class Picky(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            raise RuntimeError("wants a real gradient")

    model = torch.nn.Linear(3, 2)
    optimizer = Picky(model.parameters(), lr=0.5)
    with pytest.raises(CheckpointError, match=r"cannot prepare Picky: a step with zero "
                       r"gradients failed \(RuntimeError: wants a real gradient\)"):  # fmt: skip
        materialize_optimizer_state(optimizer)
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert all(p.grad is None for p in model.parameters())
