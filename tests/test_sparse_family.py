"""torchrec's train pipelines as aiopipe schedules (``SparseDistPipeline(...,
schedule=NAME)``): ``base`` equals torchrec's ``TrainPipelineBase``, ``lite`` its
``TrainPipelineSparseDistLite`` and ``fused`` its ``TrainPipelineFusedSparseDist``, bit
for bit, on one rank and on two gloo ranks.

torchrec's fused class needs CUDA as shipped; its reference runs here go through
``hstu_tasks.sparse._torchrec.torchrec_classes_on_cpu`` (``run_dlrm`` applies it on a
CPU): ``Tensor.record_stream`` skips CPU tensors, and its pipelined forwards take the
CPU as their device instead of assuming CUDA.  aiopipe's own schedule runs unpatched."""

from __future__ import annotations

import importlib.metadata
import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage
from torchrec.distributed.train_pipeline.train_pipelines import EvalPipelineFusedSparseDist
from torchrec.distributed.train_pipeline.train_pipelines import StagedTrainPipeline
from torchrec.distributed.train_pipeline.train_pipelines import TorchCompileConfig
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineFusedSparseDist

import sparse_workers
from aiopipe import ConfigurationError, ConfigurationTypeError, PipelineStateError
from hstu_tasks import DLRMConfig, SparseDistEvalPipeline, SparseDistPipeline, SyntheticDLRMData
from hstu_tasks import build_dlrm_training
from hstu_tasks.runners import parameter_digest
from hstu_tasks.sparse._torchrec import torchrec_classes_on_cpu
from hstu_tasks.sparse.accumulation import GradAccumulation
from hstu_tasks.sparse.dlrm_runs import evaluate_plainly, run_dlrm
from hstu_tasks.sparse.schedules import TRAIN_SCHEDULES, TrainSchedule, fused, pt2, semi_sync
from hstu_tasks.sparse.schedules import train_schedule
from hstu_tasks.sparse.sources import torchrec_results
from hstu_tasks.sparse.staged import stage_tasks, staged_pipeline
from hstu_tasks.sparse.tasks import SPARSE_DIST_THREAD_MAP, SparseDistState
from one_rank import one_rank_group
from sparse_workers import spawn

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[1]


def test_every_schedule_trains_like_torchrec_s_class_on_two_ranks() -> None:
    """Per-step losses and parameters of each rank over three passes, the async and
    the blocking form against torchrec's TrainPipelineBase / TrainPipelineSparseDistLite /
    TrainPipelineFusedSparseDist / TrainPipelineSemiSync (semi-synchronous from the
    third step, with and without stashed gradients) / TrainPipelinePT2 (compiled with
    aot_eager at the third step)."""
    spawn(sparse_workers.family_worker)


SEMI_SYNC = [{"start_batch": 2, "stash_gradients": False},
             {"start_batch": 2, "stash_gradients": True}]  # fmt: skip
#: torch.compile's ahead-of-time autograd without code generation: what PT2 traces and
#: runs, at a fraction of inductor's compile time (torchrec's class and aiopipe's
#: schedule compile the same model class, so the second hits dynamo's cache).
PT2 = {"compile_configs": TorchCompileConfig(backend="aot_eager", compile_on_iter=2)}


@pytest.mark.parametrize(
    ("schedule", "knobs"),
    [("base", None), ("lite", None), ("fused", None), ("semi-sync", SEMI_SYNC[0]),
     ("semi-sync", SEMI_SYNC[1]), ("pt2", PT2)],
    ids=["base", "lite", "fused", "semi-sync", "semi-sync-stashed", "pt2"],
)
def test_on_one_rank_the_schedule_trains_like_torchrec_s_class(
    schedule: str, knobs: dict[str, Any] | None
) -> None:
    with one_rank_group():
        sparse_workers.check_family_member(0, schedule, knobs=knobs)


def host_order(schedule: str | TrainSchedule) -> list[tuple[str, int, str | None]]:
    model = torch.nn.Linear(2, 1)  # no sharded module: the builders only look
    state = SparseDistState(model=model, optimizer=None, device=torch.device("cpu"))
    return [(task.name, task.lookahead, task.stream)
            for task in train_schedule(schedule).build_tasks(state)]  # fmt: skip


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


def test_prefetch_declares_torchrec_s_host_order() -> None:
    """PrefetchTrainPipelineSparseDist's progress(): zero_grad, the copy of i+2, the
    input dist of i+1 ends, i's forward, the cache prefetch of i+1 (its own stream),
    backward, the optimizer step, the input dist of i+2 starts."""
    assert host_order("prefetch") == [
        ("zero_grad", 0, "default"), ("h2d", 2, "memcpy"), ("wait_input_dist", 1, "data_dist"),
        ("forward", 0, "default"), ("prefetch_embeddings", 1, "prefetch"),
        ("backward", 0, "default"), ("optimizer_step", 0, "default"),
        ("start_input_dist", 2, "data_dist"),
    ]  # fmt: skip


def test_on_one_rank_the_prefetch_schedule_trains_like_the_plain_loop() -> None:
    with one_rank_group():
        sparse_workers.check_prefetch(0)


def test_prefetch_with_execute_all_batches_false_drops_the_last_two_batches() -> None:
    """As sparse-dist does: five batches train three, like the plain loop on those."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 5))
        plain = build_dlrm_training(SMALL, "adagrad", seed=3)
        expected = run_dlrm("none", plain, [batches[:3]]).losses
        setup = build_dlrm_training(SMALL, "adagrad", seed=3)
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device, False,
                                  schedule="prefetch").blocking()  # fmt: skip
        losses = [float(loss) for loss, _, _ in pipe.results(batches)]
        assert pipe.statistics().pulled == 3  # the wrapper read five, handed on three
        pipe.shutdown()
        assert losses == expected
        assert parameter_digest(setup.model) == parameter_digest(plain.model)


def _fbgemm_has_cuda_kernels() -> bool:
    """The CUDA build of fbgemm_gpu is installed (the CPU build is ``fbgemm-gpu-cpu``)."""
    try:
        importlib.metadata.version("fbgemm_gpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.cuda
def test_on_a_gpu_the_prefetch_schedule_trains_like_torchrec_s_class() -> None:
    """The lent-GPU check: UVM-cached tables (rows in host memory, a cache on the GPU
    the prefetch fills), aiopipe's prefetch schedule against torchrec's
    PrefetchTrainPipelineSparseDist, per-step losses and parameters bit for bit."""
    if not _fbgemm_has_cuda_kernels():
        pytest.skip("needs fbgemm_gpu's CUDA kernels (torchrec's sharded tables on a GPU)")
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 8))
        outcomes = []
        for mode in ("torchrec-prefetch", "aiopipe-prefetch"):
            setup = build_dlrm_training(SMALL, "adagrad", seed=3, device="cuda",
                                        compute_kernel="fused_uvm_caching")  # fmt: skip
            run = run_dlrm(mode, setup, [batches, batches])  # type: ignore[arg-type]
            outcomes.append((run.losses, parameter_digest(setup.model)))
        assert outcomes[0] == outcomes[1]


def test_torchrec_s_prefetch_class_is_refused_on_a_cpu_with_the_reason() -> None:
    with one_rank_group():
        setup = build_dlrm_training(DLRMConfig(batch_size=4), "sgd")
        with pytest.raises(ValueError, match="PrefetchTrainPipelineSparseDist needs a GPU"):
            run_dlrm("torchrec-prefetch", setup, [SyntheticDLRMData(DLRMConfig(batch_size=4), 2)])


def test_fused_looks_up_where_torchrec_s_class_does_in_host_order() -> None:
    """torchrec's fused class looks batch i up first in progress i, before zero_grad;
    aiopipe's at the end of step i-1 (lookahead 1), the same host order, so that the
    lookup can wait for step i-1's backward on a GPU.  After the data dist it is a
    task of step i itself, on the stream the knob names."""
    assert host_order("fused") == [
        ("zero_grad", 0, "default"), ("start_input_dist", 1, "data_dist"),
        ("h2d", 2, "memcpy"), ("forward", 0, "default"), ("wait_input_dist", 1, "data_dist"),
        ("backward", 0, "default"), ("optimizer_step", 0, "default"),
        ("embedding_lookup", 1, "data_dist"),
    ]  # fmt: skip
    after = fused(embedding_lookup_after_data_dist=True, emb_lookup_stream="new")
    assert [entry for entry in host_order(after) if entry[0] != "wait_input_dist"][:5] == [
        ("zero_grad", 0, "default"), ("start_input_dist", 1, "data_dist"),
        ("h2d", 2, "memcpy"), ("embedding_lookup", 0, "embedding_lookup"),
        ("forward", 0, "default"),
    ]  # fmt: skip
    assert host_order(fused(emb_lookup_stream="current"))[-1] == ("embedding_lookup", 1,
                                                                  "default")  # fmt: skip


def test_semi_sync_declares_torchrec_s_host_order() -> None:
    """TrainPipelineSemiSync's progress(): the input dist of i+2 starts, i's forward,
    the copy of i+3, the lookup of i+1 (semi-synchronous: before i's backward), the
    input dist of i+2 ends, backward, the embeddings' backward, the optimizer step
    (grad swap, step, zero_grad), the lookup of i+1 (synchronous: after the step)."""
    assert host_order("semi-sync") == [
        ("start_input_dist", 2, "data_dist"), ("forward", 0, "default"),
        ("h2d", 3, "memcpy"), ("embedding_lookup_early", 1, "default"),
        ("wait_input_dist", 2, "data_dist"), ("backward", 0, "default"),
        ("embedding_backward", 0, "default"), ("optimizer_step", 0, "default"),
        ("embedding_lookup", 1, "default"),
    ]  # fmt: skip


@pytest.mark.parametrize("schedule", sorted(TRAIN_SCHEDULES))
def test_every_task_of_a_schedule_has_its_lane_on_a_gpu(schedule: str) -> None:
    """The default thread map names every task: none falls to a lane of its own."""
    names = {name for name, _, _ in host_order(schedule)}
    assert names <= set(SPARSE_DIST_THREAD_MAP)
    assert {SPARSE_DIST_THREAD_MAP[name] for name in names} <= {"io", "compute"}


@pytest.mark.parametrize(
    "knobs",
    [{"embedding_lookup_after_data_dist": True}, {"emb_lookup_stream": "new"}],
    ids=["after-data-dist", "new-stream"],
)
def test_fused_knobs_train_like_torchrec_s_class_with_them(knobs: dict[str, Any]) -> None:
    """One rank, the model rewritten as torchrec's class always does
    (``pipelined_input_dist=True``): two passes, per-step losses and parameters."""
    with one_rank_group():
        epochs = [list(SyntheticDLRMData(SMALL, 4))] * 2
        reference = build_dlrm_training(SMALL, "adagrad", seed=3)
        with torchrec_classes_on_cpu():
            pipe = TrainPipelineFusedSparseDist(reference.model, reference.optimizer,
                                                reference.device, **knobs)  # fmt: skip
            expected = [float(loss) for epoch in epochs
                        for loss, _, _ in torchrec_results(pipe, epoch)]  # fmt: skip
        setup = build_dlrm_training(SMALL, "adagrad", seed=3)
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                  schedule=fused(**knobs), pipelined_input_dist=True)
        ours = pipe.blocking()
        losses = [float(loss) for epoch in epochs for loss, _, _ in ours.results(epoch)]
        assert sparse_workers.runs_rewritten(setup.model)
        ours.shutdown()
        assert losses == expected and len(losses) == 8
        assert parameter_digest(setup.model) == parameter_digest(reference.model)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"schedule": "staged"}, "unknown schedule 'staged'; choose one of 'sparse-dist'"),
        ({"schedule": "pt2", "pipelined_input_dist": True}, "model's own forward"),
        ({"schedule": "semi-sync", "pipelined_input_dist": False}, "computes its step on"),
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


def test_fused_refuses_an_unknown_stream_and_a_model_another_schedule_rewrites() -> None:
    with pytest.raises(ValueError, match="emb_lookup_stream must be one of data_dist"):
        fused(emb_lookup_stream="side")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start_batch must be an int >= 0, got -1"):
        semi_sync(start_batch=-1)
    with pytest.raises(ValueError, match="schedule 'lite' takes no knobs"):
        train_schedule("lite", {"start_batch": 2})
    with pytest.raises(ValueError, match="schedule 'semi-sync': .*unexpected keyword"):
        train_schedule("semi-sync", {"emb_lookup_stream": "new"})
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = SparseDistPipeline(model, optimizer, "cpu", schedule="fused")
    with pytest.raises(ValueError, match="installs InSyncEmbeddingPipelinedForward"):
        SparseDistPipeline(model, optimizer, "cpu")
    assert first.eval_pipeline() is not None  # evaluation follows whatever is installed


def test_a_schedules_knobs_are_checked_kept_and_added_to() -> None:
    # train_schedule adds knobs to those a schedule was made with, not instead of them
    both = train_schedule(semi_sync(start_batch=2), {"stash_gradients": True})
    assert dict(both.knobs) == {"start_batch": 2, "stash_gradients": True}
    assert train_schedule(fused(emb_lookup_stream="new"), {}).knobs["emb_lookup_stream"] == "new"
    with pytest.raises(ConfigurationTypeError, match="stash_gradients must be True or False"):
        semi_sync(stash_gradients="no")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationTypeError, match="embedding_lookup_after_data_dist"):
        fused(embedding_lookup_after_data_dist="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationTypeError, match="compile_configs must be torchrec's"):
        pt2(compile_configs={"backend": "eager"})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationTypeError, match="pre_compile_fn must be callable"):
        pt2(pre_compile_fn="compile")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"schedule=semi_sync: call it, semi_sync\(...\)"):
        train_schedule(semi_sync)  # type: ignore[arg-type]
    unknown = "unknown schedule 'semi_sync' .did you mean 'semi-sync'"
    with pytest.raises(ConfigurationError, match=unknown):  # a ValueError too
        train_schedule("semi_sync")


def test_an_unknown_compile_backend_is_refused_by_the_pipeline_not_at_the_compile() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = pt2(compile_configs=TorchCompileConfig(backend="nope"))
    with pytest.raises(ValueError, match="compile_configs.backend 'nope' is not a torch.compile"):
        SparseDistPipeline(model, optimizer, "cpu", schedule=schedule)


SMALL = DLRMConfig(num_embeddings=200, batch_size=16)


def plain_with_an_evaluation(batches: list[Any], evals: list[Any],
                             after: int) -> tuple[list[float], list[Any], str]:  # fmt: skip
    """The plain loop's losses over ``batches``, the outputs of an evaluation of
    ``evals`` after the first ``after`` of them, and the final parameters' digest."""
    plain = build_dlrm_training(SMALL, "adagrad", seed=3)
    losses = run_dlrm("none", plain, [batches[:after]]).losses
    outputs = evaluate_plainly(plain.model, evals, plain.device)
    losses += run_dlrm("none", plain, [batches[after:]]).losses
    return losses, outputs, parameter_digest(plain.model)


def assert_same_outputs(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for ours, theirs in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_the_blocking_form_evaluates_detaches_and_attaches() -> None:
    """torchrec's lifetime calls on the blocking form: an evaluation between training
    steps (blocking too) equals the plain forward at that point, and training goes on
    after detach() and attach() as one uninterrupted run."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 6))
        evals = list(SyntheticDLRMData(SMALL, 2, seed=9))
        expected, expected_eval, digest = plain_with_an_evaluation(batches, evals, 3)
        setup = build_dlrm_training(SMALL, "adagrad", seed=3)
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device).blocking()
        source = iter(batches)
        losses = [float(pipe.progress(source)[0]) for _ in range(3)]
        evaluation = pipe.eval_pipeline()
        outputs = list(evaluation.results(evals))
        losses += [float(loss) for loss, _, _ in pipe.drain()]
        assert pipe.detach() is setup.model
        pipe.attach()
        losses += [float(loss) for loss, _, _ in pipe.results(source)]
        evaluation.shutdown()
        pipe.shutdown()
        assert losses == expected
        assert parameter_digest(setup.model) == digest
        assert_same_outputs(outputs, expected_eval)


def test_a_model_given_back_goes_to_a_pipeline_of_another_kind() -> None:
    """Schedules tried one after another on one model: once the pipelines on it are
    shut down, or drained and detached, another kind takes it, though the old objects
    are still referenced; the old one cannot attach while the new kind has the model,
    and nothing of it runs."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 9))
        plain = build_dlrm_training(SMALL, "adagrad", seed=3)
        expected = run_dlrm("none", plain, [batches]).losses
        setup = build_dlrm_training(SMALL, "adagrad", seed=3)
        args = (setup.model, setup.optimizer, setup.device)
        first = SparseDistPipeline(*args).blocking()
        losses = [float(loss) for loss, _, _ in first.results(batches[:3])]
        first.shutdown()
        fused_pipe = SparseDistPipeline(*args, schedule="fused")
        blocking = fused_pipe.blocking()
        losses += [float(loss) for loss, _, _ in blocking.results(batches[3:6])]
        blocking.drain()
        fused_pipe.detach()
        third = SparseDistPipeline(*args, schedule="prefetch").blocking()
        source = iter(batches[6:])
        losses.append(float(third.progress(source)[0]))
        with pytest.raises(PipelineStateError, match="a prefetch pipeline has this model now"):
            fused_pipe.attach()  # while the third one has it
        with pytest.raises(PipelineStateError, match="the model is detached"):
            blocking.progress(iter(batches[6:]))
        losses += [float(loss) for loss, _, _ in third.results(source)]
        with pytest.raises(ValueError, match="a prefetch pipeline, whose schedule installs "
                                             "PrefetchPipelinedForward.*give the"):
            SparseDistPipeline(*args, schedule="fused")  # while the third one has it
        third.shutdown()
        assert losses == expected
        assert parameter_digest(setup.model) == parameter_digest(plain.model)


@pytest.mark.parametrize("schedule", ["base", "lite", "fused"])
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


@pytest.mark.parametrize("schedule", ["sparse_dist", "lite", "base", "fused", "semi_sync", "pt2",
                                      "prefetch"])
def test_the_guide_draws_the_schedule_as_aiopipe_graph_does(
    schedule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiopipe.cli import main

    target = f"{ROOT / 'examples' / 'schedules.py'}:{schedule}"
    title = schedule.replace("_", "-")
    assert main(["graph", target, "--format", "mermaid", "--title", title]) == 0
    drawn = capsys.readouterr().out
    assert f"```mermaid\n{drawn}```" in (ROOT / "docs" / "sparse-dist.md").read_text()


def test_a_pipeline_detached_while_another_kind_had_the_model_takes_it_back_after() -> None:
    """Detached, then another kind trains: the first one can neither detach (it has
    nothing to give back) nor attach while the other has the model; once that one is
    shut down it attaches, evaluates and trains on, like one plain run.  A pipeline
    whose construction failed holds nothing, and a new one of the same kind after a
    detach and a shutdown needs no attach()."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 9))
        evals = list(SyntheticDLRMData(SMALL, 2, seed=9))
        expected, expected_eval, digest = plain_with_an_evaluation(batches, evals, 6)
        setup = build_dlrm_training(SMALL, "adagrad", seed=3)
        args = (setup.model, setup.optimizer, setup.device)
        first = SparseDistPipeline(*args).blocking()
        losses = [float(loss) for loss, _, _ in first.results(batches[:3])]
        first.detach()
        assert first.pipeline.executor is first.pipeline.executor  # kept for the next engine
        with pytest.raises(ConfigurationError, match="unknown executor"):
            SparseDistPipeline(*args, schedule="fused", executor="nonsense")
        fused_pipe = SparseDistPipeline(*args, schedule="fused").blocking()
        source = iter(batches[3:6])
        losses.append(float(fused_pipe.progress(source)[0]))
        with pytest.raises(PipelineStateError, match="a fused pipeline has the model now"):
            first.detach()
        with pytest.raises(PipelineStateError, match="a fused pipeline has this model now"):
            first.attach()
        losses += [float(loss) for loss, _, _ in fused_pipe.results(source)]
        fused_pipe.shutdown()
        first.attach()
        evaluation = first.eval_pipeline()
        outputs = list(evaluation.results(evals))
        evaluation.shutdown()
        losses += [float(loss) for loss, _, _ in first.results(batches[6:8])]
        first.drain()
        first.detach()
        first.shutdown()
        last = SparseDistPipeline(*args).blocking()  # the same kind, no attach() needed
        losses += [float(loss) for loss, _, _ in last.results(batches[8:])]
        last.shutdown()
        assert losses == expected
        assert parameter_digest(setup.model) == digest
        assert_same_outputs(outputs, expected_eval)


def test_the_cli_draws_and_validates_a_pipeline_of_the_family_and_refuses_to_run_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A target function may return the configured pipeline itself: its schedule is
    drawn and validated on its lanes; tracing or profiling it is refused, saying why
    (its bodies need the model it traces on the first batch)."""
    from aiopipe.cli import main

    target = tmp_path / "mine.py"
    target.write_text(
        "import torch\n"
        "from hstu_tasks import SparseDistPipeline\n"
        "from hstu_tasks.sparse import semi_sync\n\n"
        "made = []\n\n\n"
        "def pipe():\n"
        "    model = torch.nn.Linear(2, 1)\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    made.append(SparseDistPipeline(model, optimizer, 'cpu',\n"
        "                                   schedule=semi_sync(start_batch=2)))\n"
        "    return made[-1]\n"
    )
    assert main(["graph", f"{target}:pipe", "--format", "mermaid"]) == 0
    loaded = [m for m in list(sys.modules.values())
              if getattr(m, "__file__", None) == str(target.resolve())]  # fmt: skip
    assert loaded[-1].made[-1].statistics().closed  # shut down with the command
    drawn = capsys.readouterr().out
    assert "embedding_lookup" in drawn and 'lane compute' in drawn and "lane io" not in drawn
    assert main(["validate", f"{target}:pipe"]) == 0
    capsys.readouterr()
    for command in (["trace", "-o", str(tmp_path / "t.json")], ["plan", "--batches", "4"]):
        assert main([*command, f"{target}:pipe"]) == 2
        error = capsys.readouterr().err
        assert "SparseDistPipeline prepares its model on the first batch" in error, command


def test_gradient_accumulation_trains_like_the_plain_loop_on_two_ranks() -> None:
    """Every schedule with ``grad_accumulation=3`` over passes of 7 batches (a partial
    group at each end), async and blocking: the plain accumulation loop's per-step
    losses and parameters, bit for bit."""
    spawn(sparse_workers.accumulation_worker)


def test_gradient_accumulation_equals_torchrec_s_wrapper_around_each_class() -> None:
    """One rank: each schedule with ``grad_accumulation=3`` against torchrec's class in
    its ``GradientAccumulationWrapper`` (reset for every pass, as its pipelines are),
    and the plain loop; 7 batches a pass, so each pass ends inside a group.  Not
    torchrec's semi-sync: the wrapper zeroes the gradients at the first ``zero_grad``
    after it starts, expecting it before a forward, and ``TrainPipelineSemiSync``
    calls it after its step, so the first batch's gradients are lost.  Not torchrec's
    prefetch class either: it needs a GPU."""
    with one_rank_group():
        epochs = [list(SyntheticDLRMData(SMALL, 7))] * 2
        plain = build_dlrm_training(SMALL, "adagrad", seed=3)
        expected = run_dlrm("none", plain, epochs, grad_accumulation=3).losses
        for schedule in TRAIN_SCHEDULES:
            knobs = PT2 if schedule == "pt2" else None  # inductor's kernels round otherwise
            alone = schedule in ("semi-sync", "prefetch")
            for runner in ("aiopipe", "torchrec")[: 1 if alone else 2]:
                setup = build_dlrm_training(SMALL, "adagrad", seed=3)
                losses = run_dlrm(f"{runner}-{schedule}", setup, epochs,  # type: ignore[arg-type]
                                  grad_accumulation=3, knobs=knobs).losses  # fmt: skip
                assert losses == expected, (runner, schedule)
                assert parameter_digest(setup.model) == parameter_digest(plain.model)
        unaccumulated = build_dlrm_training(SMALL, "adagrad", seed=3)
        assert run_dlrm("none", unaccumulated, epochs).losses != expected


def test_drain_is_not_the_end_of_an_accumulation_group() -> None:
    """drain() mid-group applies the batches in flight; the source passed again goes
    on in the same group, as one uninterrupted pass does."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 7))
        plain = build_dlrm_training(SMALL, "adagrad", seed=3)
        expected = run_dlrm("none", plain, [batches], grad_accumulation=3).losses
        setup = build_dlrm_training(SMALL, "adagrad", seed=3)
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                  grad_accumulation=3).blocking()  # fmt: skip
        source = iter(batches)
        losses = [float(pipe.progress(source)[0])]
        losses += [float(loss) for loss, _, _ in pipe.drain()]
        losses += [float(loss) for loss, _, _ in pipe.results(source)]
        pipe.shutdown()
        assert losses == expected
        assert parameter_digest(setup.model) == parameter_digest(plain.model)


class CountingSGD(torch.optim.SGD):
    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.calls: list[str] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls.append("zero_grad")
        super().zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.calls.append("step")
        super().step(closure)


@pytest.mark.parametrize("schedule", ["sparse-dist", "semi-sync"])
def test_reset_mid_group_drops_the_partial_group_s_gradients(schedule: str) -> None:
    """reset() two batches into a group of three: the gradients those left are
    dropped, so a zero_grad() of one's own after reset() changes nothing.  Semi-sync
    zeroes after its step, not before the next batch: the next group added to them."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 12))

        def run(zero_grad_after_reset: bool) -> tuple[list[float], Any]:
            setup = build_dlrm_training(SMALL, "adagrad", seed=3)
            with SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                    schedule=schedule, grad_accumulation=3).blocking() as pipe:
                source = iter(batches)
                losses = [float(pipe.progress(source)[0]) for _ in range(2)]
                pipe.reset()
                if zero_grad_after_reset:
                    setup.optimizer.zero_grad()
                losses += [float(loss) for loss, _, _ in pipe.results(source)]
            return losses, parameter_digest(setup.model)

        assert run(zero_grad_after_reset=False) == run(zero_grad_after_reset=True)


@pytest.mark.parametrize("schedule", ["sparse-dist", "base", "semi-sync"])
def test_a_pass_never_told_its_end_steps_its_partial_group_when_the_next_comes(
    schedule: str,
) -> None:
    """Exactly as many calls as batches (the end read, never reported), then the next
    epoch's source: the first epoch's partial group steps before it, as in the plain
    loop (it joined the next epoch's first group)."""
    with one_rank_group():
        first, second = list(SyntheticDLRMData(SMALL, 7)), list(SyntheticDLRMData(SMALL, 3))
        plain = build_dlrm_training(SMALL, "adagrad", seed=3)
        expected = run_dlrm("none", plain, [first, second], grad_accumulation=3).losses
        setup = build_dlrm_training(SMALL, "adagrad", seed=3)
        with SparseDistPipeline(setup.model, setup.optimizer, setup.device, schedule=schedule,
                                grad_accumulation=3).blocking() as pipe:  # fmt: skip
            source = iter(first)
            losses = [float(pipe.progress(source)[0]) for _ in first]
            losses += [float(loss) for loss, _, _ in pipe.results(second)]  # told its end
        assert losses == expected
        assert parameter_digest(setup.model) == parameter_digest(plain.model)


def test_accumulation_groups_finish_at_the_end_and_restart_after_reset() -> None:
    optimizer = CountingSGD(torch.nn.Linear(2, 1).parameters())
    accumulation = GradAccumulation(3)
    for _ in range(4):
        accumulation.zero_grad(optimizer)
        accumulation.step(optimizer)
    accumulation.finish(optimizer)  # the fourth batch's partial group
    accumulation.finish(optimizer)  # nothing pending: no step
    accumulation.zero_grad(optimizer)
    accumulation.step(optimizer)
    accumulation.restart(optimizer)  # reset(): the gradients left go now
    accumulation.zero_grad(optimizer)  # and the next batch starts a group
    assert optimizer.calls == ["zero_grad", "step", "zero_grad", "step", "zero_grad",
                               "zero_grad", "zero_grad", "zero_grad"]  # fmt: skip


@pytest.mark.parametrize("steps", [0, -1, 1.5, True, "3"])
def test_grad_accumulation_must_be_a_positive_int(steps: Any) -> None:
    with pytest.raises(ConfigurationError, match="grad_accumulation must be an int >= 1"):
        SparseDistPipeline(torch.nn.Linear(2, 1), None, "cpu", grad_accumulation=steps)


@pytest.mark.parametrize(
    ("schedule", "options"),
    [(fused(), {"pipelined_input_dist": True}), (semi_sync(start_batch=0), {})],
    ids=["fused", "semi-sync"],
)
def test_batches_looked_up_ahead_and_left_behind_train_nothing(
    schedule: TrainSchedule, options: dict[str, Any]
) -> None:
    """A results() loop left after two steps leaves batches 2-4 in flight, batch 2
    already looked up (fused: at the end of step 1; semi-sync: before step 1's
    update); the next pass discards them.  The training equals a run that never saw
    them: the lookups ahead changed nothing."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 8))

        def train(passes: list[list[Any]], leave_first_after: int | None) -> tuple[Any, ...]:
            setup = build_dlrm_training(SMALL, "adagrad", seed=3)
            pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                      schedule=schedule, **options).blocking()  # fmt: skip
            losses = []
            for number, batches_ in enumerate(passes):
                for loss, _, _ in pipe.results(iter(batches_)):
                    losses.append(float(loss))
                    if number == 0 and len(losses) == leave_first_after:
                        break
            discarded = pipe.statistics().discarded
            pipe.shutdown()
            return losses, parameter_digest(setup.model), discarded

        left = train([batches[:5], batches[5:]], leave_first_after=2)
        never_seen = train([batches[:2], batches[5:]], leave_first_after=None)
        assert left[:2] == never_seen[:2] and len(left[0]) == 5
        assert (left[2], never_seen[2]) == (3, 0)


@pytest.mark.parametrize("ahead", [False, True], ids=["lookup-first", "lookup-prefetch"])
def test_the_fused_eval_pipeline_evaluates_like_torchrec_s(ahead: bool) -> None:
    """SparseDistEvalPipeline(fused=True) against torchrec's EvalPipelineFusedSparseDist,
    with and without ``enable_embedding_lookup_prefetch`` (the lookup of the next batch
    after this one's forward): every output, bit for bit, on the rewritten model."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 5))
        reference = build_dlrm_training(SMALL, "adagrad", seed=3)
        reference.model.eval()
        with torchrec_classes_on_cpu():
            torchrec = EvalPipelineFusedSparseDist(
                reference.model, reference.optimizer, reference.device,
                enable_embedding_lookup_prefetch=ahead,
            )  # fmt: skip
            expected = [output for output in torchrec_results(torchrec, batches)]
        setup = build_dlrm_training(SMALL, "adagrad", seed=3)
        pipe = SparseDistEvalPipeline(setup.model, None, setup.device, fused=True,
                                      enable_embedding_lookup_prefetch=ahead,
                                      pipelined_input_dist=True)  # fmt: skip
        evaluator = pipe.blocking()
        outputs = list(evaluator.results(batches))
        assert sparse_workers.runs_rewritten(setup.model)
        evaluator.shutdown()
        assert len(outputs) == len(expected) == 5
        assert all(torch.equal(a, b) for got, want in zip(outputs, expected, strict=True)
                   for a, b in zip(got, want, strict=True))  # fmt: skip


def test_a_lookup_ahead_needs_the_fused_rewrite() -> None:
    with pytest.raises(ValueError, match="pass fused=True"):
        SparseDistEvalPipeline(torch.nn.Linear(2, 1), None, "cpu",
                               enable_embedding_lookup_prefetch=True)  # fmt: skip


def _stages(log: list[tuple[str, int]]) -> list[PipelineStage]:
    """A copy and a post-processing stage on DLRM batches (CPU streams), logging each
    batch they see by its first label."""

    def copy(batch: Any) -> Any:
        log.append(("data_copy", int(batch.labels[0] * 1000)))
        return batch.to("cpu")

    def postproc(batch: Any) -> Any:
        log.append(("postproc", int(batch.labels[0] * 1000)))
        batch.dense_features = batch.dense_features * 0.5
        return batch

    stream = torch.Stream("cpu")
    return [PipelineStage(name="data_copy", runnable=copy, stream=stream),
            PipelineStage(name="postproc", runnable=postproc, stream=stream)]  # fmt: skip


def test_staged_stages_and_step_train_like_torchrec_s_staged_pipeline_and_loop() -> None:
    """torchrec's ``while batch := pipe.progress(it): step(batch)`` around a
    StagedTrainPipeline against ``staged_pipeline(stages, step)``: the same losses
    and parameters, and every stage sees every batch once, in order."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 6))

        def train_step(setup: Any) -> Any:
            def step(batch: Any) -> float:
                setup.optimizer.zero_grad()
                loss, _ = setup.model(batch)
                loss.backward()
                setup.optimizer.step()
                return float(loss.detach())

            return step

        reference, log_torchrec = build_dlrm_training(SMALL, "adagrad", seed=3), []
        step = train_step(reference)
        with torchrec_classes_on_cpu():  # its stages record CPU tensors on their stream
            staged = StagedTrainPipeline(_stages(log_torchrec),
                                         compute_stream=torch.Stream("cpu"))  # fmt: skip
            source, expected = iter([copy.deepcopy(b) for b in batches]), []
            while (batch := staged.progress(source)) is not None:
                expected.append(step(batch))
        setup, log_ours = build_dlrm_training(SMALL, "adagrad", seed=3), []
        pipe = staged_pipeline(_stages(log_ours), train_step(setup)).blocking()
        losses = list(pipe.results([copy.deepcopy(b) for b in batches]))
        pipe.shutdown()
        assert losses == expected and len(losses) == 6
        assert parameter_digest(setup.model) == parameter_digest(reference.model)
        for name in ("data_copy", "postproc"):
            seen = [label for stage, label in log_ours if stage == name]
            assert seen == [label for stage, label in log_torchrec if stage == name]
            assert len(seen) == 6


def test_stage_tasks_refuse_torchrec_s_input_dist_stages_and_clashing_names() -> None:
    stream = torch.Stream("cpu")
    hooked = PipelineStage(name="sdd", runnable=lambda b: b, stream=stream,
                           fill_callback=lambda: None)  # fmt: skip
    with pytest.raises(ValueError, match=r"stages \['sdd'\] have torchrec's fill"):
        stage_tasks([hooked])
    twice = [PipelineStage(name="a", runnable=lambda b: b, stream=stream)] * 2
    with pytest.raises(ValueError, match="must be distinct"):
        stage_tasks(twice)
    with pytest.raises(ConfigurationTypeError, match="stages must be torchrec's PipelineStage"):
        staged_pipeline([1], lambda batch: batch)  # type: ignore[list-item]
    with pytest.raises(ConfigurationTypeError, match="step must be callable"):
        staged_pipeline(twice[:1], None)  # type: ignore[arg-type]
    tasks, streams = stage_tasks([PipelineStage(name=name, runnable=lambda b: b, stream=stream)
                                  for name in ("a", "b")])  # fmt: skip
    assert [(t.name, t.lookahead, t.stream) for t in tasks] == [("a", 2, "a"), ("b", 1, "b")]
    assert streams == {"a": None, "b": None}  # CPU stages run on no stream
