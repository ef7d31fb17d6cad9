"""torchrec's train pipelines as aiopipe schedules (``SparseDistPipeline(...,
schedule=NAME)``): ``base`` equals torchrec's ``TrainPipelineBase`` and ``lite`` its
``TrainPipelineSparseDistLite``, bit for bit, on one rank and on two gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import sparse_workers
from hstu_tasks import DLRMConfig, SparseDistPipeline, SyntheticDLRMData, build_dlrm_training
from hstu_tasks.runners import parameter_digest
from hstu_tasks.sparse.dlrm import run_dlrm
from hstu_tasks.sparse.schedules import TRAIN_SCHEDULES, train_schedule
from hstu_tasks.sparse.tasks import SparseDistState
from one_rank import one_rank_group
from sparse_workers import spawn

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[1]


def test_base_and_lite_train_like_torchrec_s_classes_on_two_ranks() -> None:
    """Per-step losses and parameters of each rank over three passes, the async and
    the blocking form against torchrec's TrainPipelineBase / TrainPipelineSparseDistLite."""
    spawn(sparse_workers.family_worker)


@pytest.mark.parametrize("schedule", ["base", "lite"])
def test_on_one_rank_the_schedule_trains_like_torchrec_s_class(schedule: str) -> None:
    with one_rank_group():
        sparse_workers.check_family_member(0, schedule)


def host_order(schedule: str) -> list[tuple[str, int, str | None]]:
    model = torch.nn.Linear(2, 1)  # no sharded module: the builders only look
    state = SparseDistState(model=model, optimizer=None, device=torch.device("cpu"))
    return [(task.name, task.lookahead, task.stream)
            for task in TRAIN_SCHEDULES[schedule].build_tasks(state)]  # fmt: skip


def test_each_schedule_declares_its_torchrec_class_s_host_order() -> None:
    """What each torchrec class's progress() does, in its order: Lite zero_grad, input
    dist (on the default stream), forward, backward, the next batch's copy, the
    optimizer step; Base the same without the input dist."""
    assert host_order("lite") == [
        ("zero_grad", 0, "default"), ("start_input_dist", 0, "default"),
        ("wait_input_dist", 0, "default"), ("forward", 0, "default"),
        ("backward", 0, "default"), ("h2d", 1, "memcpy"), ("optimizer_step", 0, "default"),
    ]  # fmt: skip
    assert host_order("base") == [
        ("zero_grad", 0, "default"), ("forward", 0, "default"), ("backward", 0, "default"),
        ("h2d", 1, "memcpy"), ("optimizer_step", 0, "default"),
    ]  # fmt: skip
    assert [name for name, _, _ in host_order("sparse-dist")] == [
        "h2d", "start_input_dist", "zero_grad", "forward", "wait_input_dist", "backward",
        "optimizer_step",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"schedule": "semi-sync"}, "unknown schedule 'semi-sync'; choose one of 'sparse-dist'"),
        ({"schedule": "lite", "execute_all_batches": False}, "TrainPipelineSparseDistLite"),
        ({"schedule": "base", "execute_all_batches": False}, "trains every batch"),
        ({"schedule": "base", "pipelined_input_dist": True}, "model's own forward"),
    ],
)
def test_a_schedule_refuses_what_its_torchrec_class_does_not_do(
    options: dict[str, Any], message: str
) -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=message):
        SparseDistPipeline(model, None, "cpu", **options)
    assert train_schedule("base").torchrec_class == "TrainPipelineBase"


SMALL = DLRMConfig(num_embeddings=200, batch_size=16)


@pytest.mark.parametrize("schedule", ["base", "lite"])
def test_evaluation_between_steps_and_a_model_torchrec_left_rewritten(schedule: str) -> None:
    """The schedule goes on with a model torchrec's own pipeline left rewritten (base:
    on Lite's tasks, as its own forwards are gone), evaluates between steps without a
    drain, and trains and evaluates as the plain loop does."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 6))
        eval_batches = list(SyntheticDLRMData(SMALL, 2, seed=8))

        def eval_after(step: int) -> Any:
            return eval_batches if step == 4 else None

        plain = build_dlrm_training(SMALL, "sgd", seed=3)
        expected = run_dlrm("none", plain, [batches], eval_after)
        setup = build_dlrm_training(SMALL, "sgd", seed=3)
        losses = run_dlrm("torchrec", setup, [batches[:2]]).losses  # leaves its rewrite
        pipelined = run_dlrm(f"aiopipe-{schedule}", setup, [batches[2:]],  # type: ignore[arg-type]
                             lambda step: eval_after(step + 2))  # fmt: skip
        assert losses + pipelined.losses == expected.losses
        assert parameter_digest(setup.model) == parameter_digest(plain.model)
        assert sparse_workers.runs_rewritten(setup.model)
        [evaluated], [reference] = pipelined.evaluations, expected.evaluations
        assert all(torch.equal(a, b) for got, want in zip(evaluated, reference, strict=True)
                   for a, b in zip(got, want, strict=True))  # fmt: skip


def test_base_calls_custom_model_fwd_which_torchrec_s_base_ignores() -> None:
    with one_rank_group():
        setup = build_dlrm_training(SMALL, "sgd", seed=3)
        calls = []

        def model_fwd(batch: Any) -> tuple[torch.Tensor, Any]:
            calls.append(batch)
            return setup.model(batch)  # type: ignore[no-any-return]

        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device, schedule="base",
                                  custom_model_fwd=model_fwd).blocking()  # fmt: skip
        assert len(list(pipe.results(SyntheticDLRMData(SMALL, 3)))) == len(calls) == 3
        pipe.shutdown()


@pytest.mark.parametrize("schedule", ["lite", "base"])
def test_the_guide_draws_the_schedule_as_aiopipe_graph_does(
    schedule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiopipe.cli import main

    target = f"{ROOT / 'examples' / 'schedules.py'}:{schedule}"
    assert main(["graph", target, "--format", "mermaid", "--title", schedule]) == 0
    drawn = capsys.readouterr().out
    assert f"```mermaid\n{drawn}```" in (ROOT / "docs" / "sparse-dist.md").read_text()
