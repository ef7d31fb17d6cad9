"""hstu_tasks.SparseDistPipeline: torchrec's sparse-dist pipelines for any sharded
model (torchrec's DLRM here), on 2 ranks with gloo."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
import torch
from torchrec.datasets.utils import Batch

import sparse_workers
from sparse_workers import spawn
from aiopipe import AsyncExecutor, BadBatchError, PipelineStateError
from aiopipe.lanes import thread_map_for_device
from conftest import cancelled, collect
from hstu_tasks import DLRMConfig, HSTUPipeline, SparseDistPipeline, SyntheticDLRMData
from hstu_tasks import SparseDistEvalPipeline, SyntheticHSTUData, build_dlrm_training
from hstu_tasks.runners import parameter_digest
from hstu_tasks.sparse.dlrm_runs import evaluate_plainly, run_dlrm
from hstu_tasks.sparse.model import input_dist_pipelined
from hstu_tasks.sparse.sources import ended_together, without_last_two
from hstu_tasks.sparse.tasks import SPARSE_DIST_THREAD_MAP
from one_rank import TINY_DATA, one_rank_group, tiny_training

pytestmark = pytest.mark.distributed


def test_trains_like_torchrec_and_the_plain_loop_bit_for_bit() -> None:
    """SGD and Adagrad (tables and dense part), per-step losses and final parameters:
    the plain loop, torchrec's TrainPipelineSparseDist, the pipeline's async and
    blocking forms; and, against torchrec, custom_model_fwd with
    execute_all_batches=False."""
    spawn(sparse_workers.equality_worker)


def test_train_and_eval_interleave_and_share_one_model() -> None:
    """Evaluation between training steps over three persistent-worker epochs; then
    the contract of a train and an eval pipeline on one model (refusals, detach and
    attach)."""
    spawn(sparse_workers.eval_worker)


def test_the_collective_order_check_stops_ranks_with_different_numbers_of_batches() -> None:
    spawn(sparse_workers.uneven_batches_worker)


def test_ranks_with_different_numbers_of_batches_end_the_epoch_together() -> None:
    """torchrec #1014: every schedule, train and eval, ends on the shortest rank's
    step on every rank, by default (the order check's test above turns it off)."""
    spawn(sparse_workers.end_together_worker)


@pytest.mark.parametrize("wrap", [without_last_two, lambda source: ended_together(source, None)])
def test_the_source_wrappers_refuse_an_iterable_as_the_engine_does(wrap: Any) -> None:
    """A list of batches: the hint to make an iterator, not the batches' repr."""
    with pytest.raises(TypeError, match="got the iterable list: create it once") as refused:
        wrap([torch.zeros(1000)] * 50)
    assert len(str(refused.value)) < 300


@pytest.mark.parametrize("items", [0, 1, 2, 3, 5])
def test_execute_all_batches_false_drops_the_last_two_batches_after_reading_them(items: int) -> None:
    source = iter(range(items))
    assert list(without_last_two(source)) == list(range(max(items - 2, 0)))
    assert next(source, "read") == "read"


async def test_execute_all_batches_false_with_an_async_source() -> None:
    async def numbers() -> AsyncIterator[int]:
        for number in range(4):
            yield number

    wrapped = without_last_two(numbers())
    assert isinstance(wrapped, AsyncIterator) and not isinstance(wrapped, Iterator)
    assert [n async for n in wrapped] == [0, 1]


SMALL = DLRMConfig(num_embeddings=200, batch_size=16)


def plain_run_and_an_untrained_twin(batches: list[Any]) -> tuple[list[float], Any, Any]:
    """The plain loop's losses on ``batches``, its trained setup, and a fresh one
    built the same way."""
    plain = build_dlrm_training(SMALL, "sgd", seed=3)
    losses = run_dlrm("none", plain, [batches]).losses
    return losses, plain, build_dlrm_training(SMALL, "sgd", seed=3)


@pytest.mark.parametrize("pipelined", [None, True, False])
def test_on_one_cpu_rank_the_model_keeps_its_own_forwards_unless_told(pipelined: bool | None) -> None:
    """One rank on a CPU distributes nothing, so by default the model's own forward
    runs the input distribution; pipelined_input_dist=True rewrites the model as on
    more ranks.  Either way training is the plain loop's, bit for bit, and the eval
    pipeline on the model shares the choice."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 4))
        expected, plain, setup = plain_run_and_an_untrained_twin(batches)
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                  pipelined_input_dist=pipelined)  # fmt: skip
        with pytest.raises(ValueError, match="pipelined_input_dist"):
            SparseDistEvalPipeline(setup.model, None, setup.device,
                                   pipelined_input_dist=pipelined is not True)  # fmt: skip

        async def run() -> tuple[list[Any], bool]:
            async with pipe, pipe.eval_pipeline() as evaluator:
                trained = await collect(pipe, iter(batches[:2]))
                await collect(evaluator, iter(batches[:1]))
                trained += await collect(pipe, iter(batches[2:]))
                return trained, sparse_workers.runs_rewritten(setup.model)

        trained, rewritten = asyncio.run(run())
        assert rewritten is (pipelined is True)
        assert [float(loss.detach()) for loss, _, _ in trained] == expected
        assert parameter_digest(setup.model) == parameter_digest(plain.model)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert (input_dist_pipelined(None, cpu), input_dist_pipelined(None, gpu)) == (False, True)
    assert input_dist_pipelined(False, gpu) is False


@pytest.mark.parametrize("pipelined", [False, True])
def test_progress_many_trains_like_the_plain_loop_and_ends_with_an_empty_list(
    pipelined: bool,
) -> None:
    """Steps asked for several at a time (the lanes chain them) train what the plain
    loop trains, bit for bit; after the source's end, ``[]``."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 7))
        expected, plain, setup = plain_run_and_an_untrained_twin(batches)
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                  pipelined_input_dist=pipelined)  # fmt: skip

        async def run() -> list[Any]:
            async with pipe:
                source = iter(batches)
                trained = await pipe.progress_many(source, 3)
                trained += await pipe.progress_many(source, 10)
                assert await pipe.progress_many(source, 2) == []
                return trained

        trained = asyncio.run(run())
        assert [float(loss.detach()) for loss, _, _ in trained] == expected
        assert parameter_digest(setup.model) == parameter_digest(plain.model)


def test_after_torchrec_s_own_pipeline_the_model_runs_on_the_rewrite_it_left() -> None:
    """torchrec's pipelines leave their rewrite installed, so on one CPU rank a
    sparse-dist pipeline that follows one on the model rewrites it too (its own
    forwards are gone), and training goes on as the plain loop's."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 6))
        expected, plain, setup = plain_run_and_an_untrained_twin(batches)
        losses = run_dlrm("torchrec", setup, [batches[:3]]).losses
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device)

        async def run() -> list[Any]:
            async with pipe:
                return await collect(pipe, iter(batches[3:]))

        losses += [float(loss.detach()) for loss, _, _ in asyncio.run(run())]
        assert losses == expected
        assert parameter_digest(setup.model) == parameter_digest(plain.model)


def test_a_refused_first_batch_counts_in_the_source_position() -> None:
    config = DLRMConfig(num_embeddings=200, batch_size=16)
    with one_rank_group():
        setup = build_dlrm_training(config, "sgd", seed=3)
        source = iter([None, *SyntheticDLRMData(config, 3)])
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device)

        async def run() -> tuple[int, int, int]:
            async with pipe:
                with pytest.raises(BadBatchError, match="Pipelineable"):  # before tracing
                    await pipe.progress(source)
                assert pipe.engine is None and pipe.statistics().refused == 1
                results = await collect(pipe, source)  # the same source goes on
                stats = pipe.statistics()
                assert pipe.engine is not None and stats == pipe.engine.statistics()
                return len(results), stats.returned, stats.refused

        assert asyncio.run(run()) == (3, 3, 1)  # position: returned + refused items
        assert pipe.statistics().closed


class CopyFailsOnce(Batch):
    """``batch`` whose first copy to the device fails (a transient error)."""

    def __init__(self, batch: Batch) -> None:
        super().__init__(batch.dense_features, batch.sparse_features, batch.labels)
        self.copies = 0

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        self.copies += 1
        if self.copies == 1:
            raise RuntimeError("the copy to the device failed")
        return super().to(device, non_blocking)


@pytest.mark.parametrize("failure", ["copy", "refused", "refused, copy"])
def test_a_failed_bootstrap_loses_nothing_when_another_pipeline_traces_the_model_meanwhile(
    failure: str,
) -> None:
    """The training pipeline's first bootstrap fails (its first item refused, or the
    copy of its first batch failing once), the eval pipeline on the same model then
    traces and rewrites it, and training goes on with the same source: every batch is
    trained once, as the plain loop trains it, and the refused item still counts."""
    config = DLRMConfig(num_embeddings=200, batch_size=16)
    with one_rank_group():
        batches = list(SyntheticDLRMData(config, 4))
        eval_batches = list(SyntheticDLRMData(config, 2, seed=8))
        plain = build_dlrm_training(config, "sgd", seed=3)
        expected_eval = evaluate_plainly(plain.model, eval_batches, plain.device)
        expected_losses = run_dlrm("none", plain, [batches]).losses
        refused = int("refused" in failure)
        first = CopyFailsOnce(batches[0]) if "copy" in failure else batches[0]
        source = iter([*[None] * refused, first, *batches[1:]])
        setup = build_dlrm_training(config, "sgd", seed=3)

        async def run() -> None:
            pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                      pipelined_input_dist=True)  # as on two ranks
            async with pipe, pipe.eval_pipeline() as evaluator:
                if refused:
                    with pytest.raises(BadBatchError, match="Pipelineable"):
                        await pipe.progress(source)
                if "copy" in failure:
                    with pytest.raises(RuntimeError, match="copy to the device failed"):
                        await pipe.progress(source)
                assert pipe.engine is None
                evaluated = await collect(evaluator, iter(eval_batches))  # traces the model
                assert all(torch.equal(a, b) for got, expected in zip(evaluated, expected_eval)
                           for a, b in zip(got, expected))  # fmt: skip
                results = await collect(pipe, source)
                assert [float(loss.detach()) for loss, _, _ in results] == expected_losses
                assert pipe.engine is not None
                stats = pipe.engine.statistics()
                assert (stats.returned, stats.refused) == (len(batches), refused)

        asyncio.run(run())
        assert parameter_digest(setup.model) == parameter_digest(plain.model)


@pytest.mark.parametrize("library", ["asyncio", "trio"])
def test_the_eval_pipeline_waits_for_a_train_step_whose_caller_was_cancelled(library: str) -> None:
    """A train progress() cancelled in the middle of its step leaves the step running;
    the eval pipeline on the model waits for it before it runs the model, under
    asyncio and trio alike (under trio the step runs on the train pipeline's bridge
    loop).  The next train call returns that step's result: the training is the plain
    loop's, and the evaluation sees the model after the two steps it followed."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 4))
        expected, _, setup = plain_run_and_an_untrained_twin(batches)
        after_two = build_dlrm_training(SMALL, "sgd", seed=3)
        run_dlrm("none", after_two, [batches[:2]])
        reference = evaluate_plainly(after_two.model, batches[:1], after_two.device)
        entered, gate = threading.Event(), threading.Event()
        forwards: list[tuple[str, str]] = []

        def gated(batch: Any) -> tuple[torch.Tensor, Any]:
            mode = "train" if setup.model.training else "eval"
            forwards.append((mode, "begins"))
            if forwards.count(("train", "begins")) == 2 and mode == "train":
                entered.set()  # the second step's forward: the test cancels its caller now
                gate.wait()
            try:
                return setup.model(batch)  # type: ignore[no-any-return]
            finally:
                forwards.append((mode, "ends"))

        train = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                   custom_model_fwd=gated)  # fmt: skip
        evaluator = train.eval_pipeline()

        async def open_the_gate_once_everything_waits() -> None:
            await anyio.wait_all_tasks_blocked()
            gate.set()

        async def run(library: str) -> tuple[list[Any], list[Any]]:
            source = iter(batches)
            async with train, evaluator:
                try:
                    trained = [await train.progress(source)]
                    with anyio.CancelScope() as scope:
                        async with anyio.create_task_group() as group:
                            group.start_soon(train.progress, source)
                            await anyio.to_thread.run_sync(entered.wait, abandon_on_cancel=True)
                            scope.cancel()
                    assert scope.cancelled_caught
                    async with anyio.create_task_group() as group:
                        group.start_soon(open_the_gate_once_everything_waits)
                        evaluated = await collect(evaluator, iter(batches[:1]))
                finally:
                    gate.set()  # a failure above must not leave the step blocked: aclose waits
                trained += await collect(train, source)
            return trained, evaluated

        trained, evaluated = anyio.run(run, library, backend=library)
        assert forwards.index(("train", "ends"), 2) < forwards.index(("eval", "begins"))
        assert [float(loss.detach()) for loss, _, _ in trained] == expected
        assert len(evaluated) == 1
        assert all(torch.equal(a, b) for a, b in zip(evaluated[0], reference[0], strict=True))


@pytest.mark.parametrize("pipelined", [True, None])
def test_a_model_holds_one_rewrite_at_a_time_so_another_pipeline_kind_is_refused(
    pipelined: bool | None,
) -> None:
    """An HSTUPipeline's rewrite of a model is its own: a sparse-dist pipeline (or a
    second HSTUPipeline) on that model is refused at its first step, before it
    rewrites anything, and keeps the batch it took; once the model is given back it
    runs, and then an HSTUPipeline is refused in turn.  The refusals leave the
    running pipeline's training as it is without them.  The same holds where the
    pipelines leave the model its own forwards (one CPU rank, by default)."""
    kinds = {"pipelined_input_dist": pipelined}
    with one_rank_group():
        data = SyntheticHSTUData(TINY_DATA, 3, seed=1, rank=0)
        alone = tiny_training()
        pipe = HSTUPipeline(alone.model, alone.optimizer, alone.device)
        expected = [float(loss_sum) for loss_sum, _, _ in asyncio.run(collect(pipe, iter(data)))]
        pipe.shutdown()

        setup = tiny_training()
        hstu = HSTUPipeline(setup.model, setup.optimizer, setup.device, **kinds)
        second = HSTUPipeline(setup.model, setup.optimizer, setup.device, **kinds)

        def summed_losses(batch: Any) -> tuple[torch.Tensor, Any]:
            losses, output = setup.model(batch)
            return losses.reshape(-1), output  # torchrec's backward sums dim 0

        sparse = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                    custom_model_fwd=summed_losses, **kinds)  # fmt: skip

        async def run() -> None:
            hstu_source, sparse_source = iter(data), iter(data)
            async with hstu, second, sparse:
                trained = [await hstu.progress(hstu_source)]  # traces and rewrites the model
                assert sparse_workers.runs_rewritten(setup.model) is (pipelined is True)
                for other, source in ((sparse, sparse_source), (second, iter(data))):
                    with pytest.raises(PipelineStateError, match="an HSTUPipeline already runs"):
                        await other.progress(source)
                    assert other.engine is None
                trained += await collect(hstu, hstu_source)
                assert [float(loss_sum) for loss_sum, _, _ in trained] == expected
                hstu.detach()  # gives the model its own forwards back
                assert len(await collect(sparse, sparse_source)) == len(data)  # the kept one too
                hstu.attach()
                hstu_source = iter(data)
                with pytest.raises(PipelineStateError, match="a sparse-dist pipeline already runs"):
                    await hstu.progress(hstu_source)
                sparse.shutdown()
                assert len(await collect(hstu, hstu_source)) == len(data)

        asyncio.run(run())


def test_on_a_cpu_every_task_defaults_to_the_compute_lane() -> None:
    """A CPU has no copy engine for the io lane to overlap with; a GPU keeps the
    io/compute pair, and a thread map given by the user is used as it is."""
    config = DLRMConfig(num_embeddings=200, batch_size=16)
    with one_rank_group():
        setup = build_dlrm_training(config, "sgd", seed=3)
        default = SparseDistPipeline(setup.model, setup.optimizer, setup.device)
        hstu = tiny_training()

        async def lanes_after_one_step(pipe: Any, source: Iterator[Any]) -> set[str]:
            async with pipe:
                await pipe.progress(source)
                assert pipe.engine is not None
                return {pipe.engine.executor.lane_of(t.name) for t in pipe.engine.schedule.tasks}

        assert asyncio.run(lanes_after_one_step(default, iter(SyntheticDLRMData(config, 2)))) == {
            "compute"}  # fmt: skip
        named = SparseDistPipeline(setup.model, setup.optimizer, setup.device, executor="async")
        assert asyncio.run(lanes_after_one_step(named, iter(SyntheticDLRMData(config, 2)))) == {
            "compute"}  # fmt: skip
        hstu_pipe = HSTUPipeline(hstu.model, hstu.optimizer, hstu.device)
        assert asyncio.run(lanes_after_one_step(
            hstu_pipe, iter(SyntheticHSTUData(TINY_DATA, 2, seed=1, rank=0)))) == {"compute"}  # fmt: skip
        chosen = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                    thread_map=SPARSE_DIST_THREAD_MAP)  # fmt: skip
        assert asyncio.run(lanes_after_one_step(chosen, iter(SyntheticDLRMData(config, 2)))) == {
            "io", "compute"}  # fmt: skip
    for gpu in ("cuda", "cuda:1"):
        assert thread_map_for_device(SPARSE_DIST_THREAD_MAP, torch.device(gpu)) is SPARSE_DIST_THREAD_MAP


def test_hstu_defaults_to_one_lane_on_a_gpu_too() -> None:
    """A launch-bound HSTU step ran slower with a second lane on a GPU
    (docs/performance.md); the io/compute pair is kept under its own name."""
    from hstu_tasks import HSTU_DEFAULT_THREAD_MAP, HSTU_IO_LANE_THREAD_MAP

    on_gpu = thread_map_for_device(HSTU_DEFAULT_THREAD_MAP, torch.device("cuda"))
    assert isinstance(on_gpu, dict) and set(on_gpu.values()) == {"compute"}
    assert set(on_gpu) == set(HSTU_IO_LANE_THREAD_MAP)  # every HSTU task named
    io = {name for name, lane in HSTU_IO_LANE_THREAD_MAP.items() if lane == "io"}
    assert io == {"h2d", "start_shuffle", "finish_shuffle"}


def test_an_executor_given_without_a_thread_map_keeps_the_default_lanes() -> None:
    """``executor=AsyncExecutor(check_collective_order=1)`` sets the check, not the lanes."""
    config = DLRMConfig(num_embeddings=200, batch_size=16)
    with one_rank_group():
        setup = build_dlrm_training(config, "sgd", seed=3)
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                  executor=AsyncExecutor(check_collective_order=1))  # fmt: skip

        async def run() -> tuple[int, set[str]]:
            async with pipe:
                results = await collect(pipe, iter(SyntheticDLRMData(config, 3)))
                assert pipe.engine is not None
                lanes = {pipe.engine.executor.lane_of(t.name) for t in pipe.engine.schedule.tasks}
                return len(results), lanes

        assert asyncio.run(run()) == (3, {"compute"})


@pytest.mark.parametrize("execute_all_batches", [True, False])
def test_a_generator_function_passed_uncalled_asks_did_you_mean(execute_all_batches: bool) -> None:
    config = DLRMConfig(num_embeddings=200, batch_size=16)

    def batches() -> Iterator[Any]:
        yield from SyntheticDLRMData(config, 2)

    with one_rank_group():
        setup = build_dlrm_training(config, "sgd", seed=3)
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device, execute_all_batches)

        async def run() -> int:
            async with pipe:
                with pytest.raises(TypeError, match=r"did you mean batches\(\)\?"):
                    await pipe.progress(batches)  # type: ignore[arg-type]
                with pytest.raises(TypeError, match=r"did you mean batches\(\)\?"):
                    [r async for r in pipe.results(batches)]  # type: ignore[arg-type]
                return len(await collect(pipe, batches()))

        assert asyncio.run(run()) == (2 if execute_all_batches else 0)


def test_a_forward_returning_a_bare_loss_is_told_what_the_pipeline_expects() -> None:
    config = DLRMConfig(num_embeddings=200, batch_size=16)
    with one_rank_group():
        setup = build_dlrm_training(config, "sgd", seed=3)
        model = setup.model
        pipe = SparseDistPipeline(model, setup.optimizer, setup.device,
                                  custom_model_fwd=lambda batch: model(batch)[0])  # fmt: skip

        async def run() -> None:
            async with pipe:
                with pytest.raises(TypeError) as info:
                    await collect(pipe, iter(SyntheticDLRMData(config, 3)))
                pipe.reset()
            message = str(info.value)
            assert message.startswith("custom_model_fwd(batch) returned a tensor of shape (); the "
                                      "sparse-dist pipeline expects (losses, output)")  # fmt: skip
            assert "custom_model_fwd=lambda batch: (model(batch), None)" in message
            assert "on batch 0 of the source" in info.value.__notes__[0]

        asyncio.run(run())


@pytest.mark.parametrize("form", ["async", "blocking"])
def test_leaving_results_early_trains_nothing_more(form: str) -> None:
    """A ``results()`` loop left at a step limit: the batches in flight are discarded
    untrained when the next pass starts (counted), not refused, and the training is
    the plain loop's over the batches whose results came out."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 8))
        expected, _, setup = plain_run_and_an_untrained_twin(batches[:2] + batches[5:])
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device)
        losses: list[float] = []
        if form == "blocking":
            blocking = pipe.blocking()
            for result in blocking.results(iter(batches[:5])):
                losses.append(float(result[0].detach()))
                if len(losses) == 2:
                    break
            losses += [float(loss.detach()) for loss, _, _ in blocking.results(iter(batches[5:]))]
            discarded = blocking.statistics().discarded
            blocking.shutdown()
        else:

            async def run() -> int:
                async with pipe:
                    async for loss, _, _ in pipe.results(iter(batches[:5])):
                        losses.append(float(loss.detach()))
                        if len(losses) == 2:
                            break
                    async for loss, _, _ in pipe.results(iter(batches[5:])):
                        losses.append(float(loss.detach()))
                    return pipe.statistics().discarded

            discarded = asyncio.run(run())
        assert losses == expected
        assert discarded == 3  # batches 2 and 3 (copied, input-distributed) and 4 (read ahead)


def test_reset_and_shutdown_refused_mid_step_leave_every_batch_in_flight() -> None:
    """``reset()`` or ``shutdown()`` called while a step runs (its caller cancelled)
    is refused, and the refusal changes nothing: the step's result and the batches in
    flight behind it all come back, as in the plain loop."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 4))
        expected, _, setup = plain_run_and_an_untrained_twin(batches)
        entered, gate = threading.Event(), threading.Event()
        calls = {"forward": 0}

        def gated(batch: Any) -> tuple[torch.Tensor, Any]:
            calls["forward"] += 1
            if calls["forward"] == 2:  # the second step: the test cancels its caller
                entered.set()
                gate.wait()
            return setup.model(batch)  # type: ignore[no-any-return]

        async def run() -> list[Any]:
            source = iter(batches)
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                          custom_model_fwd=gated) as pipe:  # fmt: skip
                try:
                    results = [await pipe.progress(source)]
                    second = asyncio.ensure_future(pipe.progress(source))
                    await asyncio.to_thread(entered.wait)
                    second.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await second
                    for refused in (pipe.reset, pipe.shutdown):  # each names itself
                        match = rf"cannot call {refused.__name__}\(\) while .* still running"
                        with pytest.raises(PipelineStateError, match=match):
                            refused()
                finally:
                    gate.set()
                return results + await collect(pipe, source)

        results = asyncio.run(run())
        assert [float(loss.detach()) for loss, _, _ in results] == expected


@pytest.mark.parametrize("schedule, wrapper", [
    ("sparse-dist", None), ("base", None), ("sparse-dist", "end together"),
    ("sparse-dist", "last two dropped"), ("sparse-dist", "both"),
])  # fmt: skip
def test_after_reset_the_same_source_counts_on_past_the_batches_dropped(
    schedule: str, wrapper: str | None
) -> None:
    """reset() after 3 steps drops the batches in flight (those read ahead too, by the
    engine or by a wrapper of the source: ``end_together``, ``execute_all_batches=
    False``); the same source goes on.  The counts go on too: the position is past
    every item the source gave, so a checkpoint there trains nothing twice (it counted
    from 0: the position said 3 of 9 items at the end; the wrappers' items were not
    counted: it said 8 for "end together", 6 for "last two dropped")."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 9))
        setup = build_dlrm_training(SMALL, "sgd", seed=3)
        options = {"end_together": wrapper in ("end together", "both"),
                   "execute_all_batches": wrapper not in ("last two dropped", "both")}
        # Dropping the last two alone: the reset dropped all but one of the source's
        # items (the wrapper reads two beyond the one it hands on), and that one is
        # then a last, read and dropped uncounted.  With the agreement on the end
        # beneath it, one more was read ahead: the reset dropped them all.
        last_two = 1 if wrapper == "last two dropped" else 0

        async def run() -> tuple[Any, Any, int]:
            source = iter(batches)
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                          schedule=schedule, **options) as pipe:  # fmt: skip
                for _ in range(3):
                    await pipe.progress(source)
                pipe.reset()
                after_reset = pipe.statistics()
                steps = len(await collect(pipe, source))
                return after_reset, pipe.statistics(), steps

        after_reset, at_end, steps = asyncio.run(run())
        assert (after_reset.position, after_reset.applied) == (3, 3)  # resumed here: 3 again
        dropped = 9 - 3 - steps - last_two
        assert (at_end.position, at_end.applied, at_end.discarded) == (
            9 - last_two, 3 + steps, dropped,
        )  # fmt: skip


def test_an_item_refused_ahead_and_dropped_by_reset_counts_as_refused_not_discarded() -> None:
    """reset() drops the engine's read-ahead, which ``check_batch`` refused (not
    raised yet): as aiopipe's own pipelines count it, it is refused, not a batch
    discarded (it was counted in ``discarded``); the position still passes it."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 10))
        setup = build_dlrm_training(SMALL, "sgd", seed=3)

        async def run() -> tuple[Any, Any, Any]:
            source = iter([*batches[:5], None, *batches[5:]])  # the 6th item is refused
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device) as pipe:
                for _ in range(3):
                    await pipe.progress(source)
                before = pipe.statistics()
                pipe.reset()
                after_reset = pipe.statistics()
                await collect(pipe, source)
                return before, after_reset, pipe.statistics()

        before, after_reset, at_end = asyncio.run(run())
        # Two batches taken ahead into the ring and the refused item read ahead of them.
        assert (before.pulled, before.read_ahead, before.read_ahead_refused) == (5, 1, 1)
        assert (after_reset.refused, after_reset.discarded, after_reset.position) == (1, 2, 3)
        assert (at_end.applied, at_end.refused, at_end.discarded, at_end.position) == (8, 1, 2, 11)


@pytest.mark.parametrize("steps", [4, 5])
def test_a_reset_after_the_end_was_read_ahead_keeps_the_source_s_counts(steps: int) -> None:
    """The source's end read ahead, not yet reported, when reset() comes: the same
    source goes on (to its end at once) with its counts, as after aiopipe's own
    reset().  They were dropped as if the end had been reported: the position said 0
    after 4 or 5 steps, and a checkpoint there would train the epoch again."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 5))
        setup = build_dlrm_training(SMALL, "sgd", seed=3)

        async def run() -> tuple[Any, int, int]:
            source = iter(batches)
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device) as pipe:
                for _ in range(steps):
                    await pipe.progress(source)
                assert pipe.statistics().exhausted  # read ahead, not reported
                pipe.reset()
                after = len(await collect(pipe, source))
                at_end = pipe.statistics()
                # Reported now: passed again, it starts afresh (and ends at once).
                again = len(await collect(pipe, source))
                return at_end, after, again

        at_end, after, again = asyncio.run(run())
        assert (after, again) == (0, 0)
        assert (at_end.applied, at_end.position, at_end.discarded) == (steps, 5, 5 - steps)


class Passes:
    """One iterator object for every pass, as a persistent-worker loader hands out:
    after its end, the next ``next()`` starts a new pass over ``batches``."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches, self.at = batches, 0

    def __iter__(self) -> Passes:
        return self

    def __next__(self) -> Any:
        if self.at == len(self.batches):
            self.at = 0
            raise StopIteration
        self.at += 1
        return self.batches[self.at - 1]


def test_a_reset_in_a_second_pass_of_one_iterator_keeps_that_pass_s_counts() -> None:
    """The first pass's end reported, then a reset() three steps into the second pass
    of the same iterator object: that pass goes on with its counts (they restarted,
    as if the first pass's end had been the last word on the source)."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 8))
        setup = build_dlrm_training(SMALL, "sgd", seed=3)

        async def run() -> Any:
            source = Passes(batches)
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device) as pipe:
                assert len(await collect(pipe, source)) == 8  # the first pass, its end told
                for _ in range(3):
                    await pipe.progress(source)
                pipe.reset()
                await collect(pipe, source)
                return pipe.statistics()

        at_end = asyncio.run(run())
        assert at_end.position == 8 and at_end.applied + at_end.discarded == 8


def test_discarded_counts_on_across_detach_and_attach() -> None:
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 8))
        setup = build_dlrm_training(SMALL, "sgd", seed=3)

        async def run() -> tuple[int, int]:
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device) as pipe:
                async for _ in pipe.results(iter(batches[:5])):
                    break  # left early: its batches in flight are dropped by the next
                await collect(pipe, iter(batches[5:6]))
                before = pipe.statistics().discarded
                pipe.detach()
                pipe.attach()
                await collect(pipe, iter(batches[6:]))
                return before, pipe.statistics().discarded

        before, after = asyncio.run(run())
        assert before > 0 and after == before  # it went back to 0 with the engine


def test_counts_go_on_across_detach_and_attach_and_stay_after_shutdown() -> None:
    """statistics() showed zeros after detach() and after the pipeline was shut down,
    and the same source passed again after attach() counted from 0."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 8))
        setup = build_dlrm_training(SMALL, "sgd", seed=3)

        async def run() -> tuple[Any, Any, Any]:
            source = iter(batches)
            pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device)
            for _ in range(3):
                await pipe.progress(source)
            await pipe.drain()  # detach() needs nothing in flight
            drained = pipe.statistics()
            pipe.detach()
            detached = pipe.statistics()
            pipe.attach()
            await collect(pipe, source)
            await pipe.aclose()
            return drained, detached, pipe.statistics()

        drained, detached, closed = asyncio.run(run())
        assert (detached.applied, detached.position) == (drained.applied, drained.position)
        assert (closed.applied, closed.position, closed.closed) == (8, 8, True)


def test_progress_many_on_a_source_with_no_batch_returns_an_empty_list() -> None:
    with one_rank_group():
        setup = build_dlrm_training(SMALL, "sgd", seed=3)

        async def run() -> list[Any]:
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device) as pipe:
                return await pipe.progress_many(iter([]), 3)

        assert asyncio.run(run()) == []


def failing_forward(model: Any, batches: list[Any]) -> tuple[dict[str, Any], Any]:
    """A ``custom_model_fwd`` that raises once ``failing["on"]`` is set, recording in
    ``failing["at"]`` the index in ``batches`` of the batch it failed on."""
    failing: dict[str, Any] = {"on": False, "at": None}

    def forward(batch: Any) -> Any:
        if failing["on"]:
            failing["at"] = next(i for i, b in enumerate(batches)
                                 if torch.equal(b.dense_features, batch.dense_features))
            raise RuntimeError("the forward failed")
        return model(batch)

    return failing, forward


@pytest.mark.parametrize("wrapper", [None, "end together"])
def test_after_reset_nothing_shows_in_flight_and_the_source_s_batches_are_numbered_on(
    wrapper: str | None,
) -> None:
    """reset() tears the engine down with what it read ahead: statistics() shows none
    of it in flight (drain() has nothing to return) but discarded at once; and as the
    same source goes on, a failure names its batch by its index in the source, not
    by a count restarted at 0 by the new engine (the agreement on the end reads a
    window of up to 16 items ahead: 60 leave some after the reset)."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 60))
        setup = build_dlrm_training(SMALL, "sgd", seed=3)
        failing, forward = failing_forward(setup.model, batches)

        async def run() -> tuple[Any, list[Any], Any, Any]:
            source = iter(batches)
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                          custom_model_fwd=forward,
                                          end_together=wrapper is not None) as pipe:  # fmt: skip
                for _ in range(3):
                    await pipe.progress(source)
                before = pipe.statistics()
                pipe.reset()
                after_reset, drained = pipe.statistics(), await pipe.drain()
                failing["on"] = True
                with pytest.raises(RuntimeError, match="the forward failed") as info:
                    await pipe.progress(source)
                pipe.reset()
                return before, drained, after_reset, info.value

        before, drained, after_reset, error = asyncio.run(run())
        held = before.in_flight  # read ahead by the engine; the wrapper's are not counted
        assert held >= 1
        assert (after_reset.in_flight, drained) == (0, [])
        assert after_reset.discarded >= before.discarded + held
        # The batch that failed comes after the 3 trained and those reset() dropped.
        assert failing["at"] >= 3 + held
        assert f"on batch {failing['at']} of the source" in error.__notes__[0]


def test_a_reset_after_a_cancelled_bootstrap_counts_the_batch_its_pull_took() -> None:
    """reset(), then a progress whose bootstrap (no engine yet) is cancelled while it
    pulls the source's next batch; the pull runs on and takes it; reset() again
    drops that batch: it is counted in ``discarded``, and the source goes on past it
    -- the next failure names its own batch (it named the dropped one's number)."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 12))
        setup = build_dlrm_training(SMALL, "sgd", seed=3)
        failing, forward = failing_forward(setup.model, batches)

        async def run() -> tuple[Any, Any, int, Any]:
            armed, reached, gate, took = (False,), asyncio.Event(), asyncio.Event(), asyncio.Event()
            given: list[int] = []

            async def items() -> AsyncIterator[Any]:
                for index, batch in enumerate(batches):
                    if armed[0] and not given:
                        reached.set()
                        await gate.wait()  # the bootstrap's pull waits here
                        given.append(index)
                        took.set()  # the waiter wakes after the pull has taken it
                    yield batch

            source = items()
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                          custom_model_fwd=forward) as pipe:  # fmt: skip
                for _ in range(2):
                    await pipe.progress(source)
                pipe.reset()
                before = pipe.statistics()
                armed = (True,)
                call = asyncio.ensure_future(pipe.progress(source))
                await reached.wait()
                call.cancel()  # the bootstrap's caller leaves; its pull runs on
                with pytest.raises(asyncio.CancelledError):
                    await call
                gate.set()
                await took.wait()  # the pull took the batch, in its own task
                pipe.reset()  # drops it
                after = pipe.statistics()
                failing["on"] = True
                with pytest.raises(RuntimeError, match="the forward failed") as info:
                    await pipe.progress(source)
                pipe.reset()
                return before, after, given[0], info.value

        before, after, dropped, error = asyncio.run(run())
        assert (after.discarded, after.in_flight) == (before.discarded + 1, 0)
        assert failing["at"] == dropped + 1
        assert f"on batch {dropped + 1} of the source" in error.__notes__[0]


def test_a_cancelled_bootstrap_s_batch_dropped_for_another_source_is_counted() -> None:
    """The first progress() on source A is cancelled while its bootstrap pulls; the
    pull runs on and takes A's first batch.  Another source passed next drops that
    batch untrained: it is counted in ``discarded``, as aiopipe's own pipelines count
    a batch read ahead of a source left for another (it was not counted), and that
    count stays, pipeline-wide, after a later reset() and source."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 8))
        setup = build_dlrm_training(SMALL, "sgd", seed=3)

        async def run() -> tuple[Any, Any]:
            reached, gate, took = asyncio.Event(), asyncio.Event(), asyncio.Event()

            async def first_source() -> AsyncIterator[Any]:
                reached.set()
                await gate.wait()  # the bootstrap's pull waits here
                took.set()  # the waiter wakes after the pull has taken the batch
                yield batches[0]

            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device) as pipe:
                call = asyncio.ensure_future(pipe.progress(first_source()))
                await reached.wait()
                call.cancel()  # the bootstrap's caller leaves; its pull runs on
                with pytest.raises(asyncio.CancelledError):
                    await call
                gate.set()
                await took.wait()
                other = iter(batches[1:])
                await pipe.progress(other)  # drops the first source's batch
                on_other = pipe.statistics()
                pipe.reset()
                await pipe.progress(iter(batches[1:]))
                return on_other, pipe.statistics()

        on_other, later = asyncio.run(run())
        assert (on_other.discarded, on_other.applied, on_other.position) == (1, 1, 1)
        # reset() dropped the other source's batches read ahead: counted on top.
        assert later.discarded > on_other.discarded


def test_a_reset_after_a_call_cancelled_past_its_bootstrap_counts_the_seeded_batch() -> None:
    """The first progress() is cancelled once its bootstrap has built and seeded the
    engine, before the engine pulled the seeded first batch; reset() drops that
    batch: it is counted in ``discarded`` and the position counts past it (it was
    dropped uncounted, the position one short at the end of the epoch)."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 6))
        setup = build_dlrm_training(SMALL, "sgd", seed=3)

        async def run() -> tuple[Any, int, Any]:
            source = iter(batches)
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device) as pipe:
                call = asyncio.ensure_future(pipe.progress(source))
                await asyncio.sleep(0)  # one loop cycle: built and seeded, not pulled
                await cancelled(call)
                engine = pipe.engine
                assert engine is not None and engine.statistics().pulled == 0  # the window
                pipe.reset()
                dropped = pipe.statistics()
                steps = len(await collect(pipe, source))
                return dropped, steps, pipe.statistics()

        dropped, steps, at_end = asyncio.run(run())
        assert (dropped.discarded, dropped.in_flight, steps) == (1, 0, 5)
        assert (at_end.position, at_end.discarded, at_end.applied) == (6, 1, 5)


class HeldSource:
    """Batches from an async iterator (not a generator: a cancelled ``__anext__``
    loses nothing; ``generator=True``: an async generator, which it finishes); once
    ``hold`` is set, the next read waits for ``gate`` (``waiting`` says it does)."""

    def __init__(self, batches: list[Any], *, generator: bool = False) -> None:
        self.batches, self.given, self.hold = batches, 0, False
        self.waiting, self.gate = asyncio.Event(), asyncio.Event()
        self.reads: AsyncIterator[Any] = self._generate() if generator else self

    def __aiter__(self) -> HeldSource:
        return self

    async def __anext__(self) -> Any:
        if self.hold:
            self.waiting.set()
            await self.gate.wait()
        if self.given == len(self.batches):
            raise StopAsyncIteration
        self.given += 1
        return self.batches[self.given - 1]

    async def _generate(self) -> AsyncIterator[Any]:
        while True:
            try:
                yield await self.__anext__()
            except StopAsyncIteration:
                return


def test_a_reset_while_the_engine_s_read_waits_drops_only_what_the_source_gave() -> None:
    """reset() while the engine's read-ahead still waits in the source: that read
    gave no batch, so it is not counted in ``discarded`` nor skipped by the numbers
    (a failure named the batch after its own)."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 12))
        setup = build_dlrm_training(SMALL, "sgd", seed=3)
        failing, forward = failing_forward(setup.model, batches)

        async def run() -> tuple[Any, Any, int]:
            source = HeldSource(batches)
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                          custom_model_fwd=forward) as pipe:  # fmt: skip
                await pipe.progress(source)
                source.hold = True
                await pipe.progress(source)
                await source.waiting.wait()  # the read-ahead of the next batch waits
                given = source.given
                pipe.reset()
                after = pipe.statistics()
                source.hold = False
                source.gate.set()
                failing["on"] = True
                with pytest.raises(RuntimeError, match="the forward failed") as info:
                    await pipe.progress(source)
                pipe.reset()
                return after, info.value, given

        after, error, given = asyncio.run(run())
        assert (after.applied, after.discarded, after.in_flight) == (2, given - 2, 0)
        assert failing["at"] == given
        assert f"on batch {given} of the source" in error.__notes__[0]


@pytest.mark.parametrize("reading", ["bootstrap", "engine"])
def test_an_async_generator_whose_read_reset_cancelled_is_refused_not_ended(
    reading: str,
) -> None:
    """reset() cancels a read still under way (the bootstrap's, left by a cancelled
    first progress, or the engine's read-ahead), which finishes an async generator:
    passed again, it is refused, naming why, instead of ending the epoch with
    batches never read."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 12))
        setup = build_dlrm_training(SMALL, "sgd", seed=3)

        async def run() -> str:
            source = HeldSource(batches, generator=True)
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device) as pipe:
                if reading == "engine":
                    await pipe.progress(source.reads)
                    source.hold = True
                    await pipe.progress(source.reads)
                else:
                    source.hold = True
                    call = asyncio.ensure_future(pipe.progress(source.reads))
                    await source.waiting.wait()
                    call.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await call
                await source.waiting.wait()
                pipe.reset()
                source.hold = False
                source.gate.set()
                with pytest.raises(PipelineStateError) as info:
                    await pipe.progress(source.reads)
                return str(info.value)

        message = asyncio.run(run())
        assert "this async generator was closed by aiopipe" in message
        assert message.endswith("the rest of its items cannot be read")


@pytest.mark.parametrize("eval_pass", [None, "pull done", "pull waiting"])
def test_a_first_progress_cancelled_while_the_bootstrap_pulls_loses_no_batch(
    eval_pass: str | None,
) -> None:  # fmt: skip
    """The bootstrap takes the source's first batch (torchrec traces the model on it);
    a caller cancelled while that pull waits leaves it running, and the next call
    takes its batch: the epoch keeps all its batches -- also when an eval pipeline
    traced the model meanwhile, the pull done or still waiting (the batch was lost,
    or the engine pulled the source beside that pull: "already running")."""
    with one_rank_group():
        batches = list(SyntheticDLRMData(SMALL, 4))
        expected, _, setup = plain_run_and_an_untrained_twin(batches)

        async def run() -> list[Any]:
            reached, release = asyncio.Event(), asyncio.Event()

            async def items() -> AsyncIterator[Any]:
                reached.set()
                await release.wait()  # a cancellation thrown in here would end the epoch
                for batch in batches:
                    yield batch

            source = items()
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device) as pipe:
                first = asyncio.ensure_future(pipe.progress(source))
                await reached.wait()
                first.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await first
                if eval_pass == "pull done":
                    release.set()
                async with pipe.eval_pipeline() as evaluator:  # open: the model stays traced
                    if eval_pass is not None:  # traces the model; changes no parameter
                        assert len(await collect(evaluator, iter(batches[:2]))) == 2
                    release.set()
                    return await collect(pipe, source)

        results = asyncio.run(run())
        assert [float(loss.detach()) for loss, _, _ in results] == expected


def test_a_results_loop_left_early_leaves_its_partial_group_to_the_next_source() -> None:
    """grad_accumulation=3: a results() loop left after 4 steps (the 4th a group of
    one), then a new source of 7: its first two batches complete that group, as the
    docs say (torchrec's wrapper counts on the same way); its in-flight batches are
    not trained."""
    k, first, second = 3, list(SyntheticDLRMData(SMALL, 9, seed=1)), list(
        SyntheticDLRMData(SMALL, 7, seed=2))  # fmt: skip
    with one_rank_group():
        plain = build_dlrm_training(SMALL, "sgd", seed=3)
        for i, batch in enumerate(first[:4] + second):  # one stream of groups of 3
            if i % k == 0:
                plain.optimizer.zero_grad()
            loss, _ = plain.model(batch)
            loss.backward()
            if (i + 1) % k == 0 or i == 4 + len(second) - 1:
                plain.optimizer.step()
        setup = build_dlrm_training(SMALL, "sgd", seed=3)

        async def run() -> Any:
            async with SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                          grad_accumulation=k) as pipe:  # fmt: skip
                steps = 0
                async for _ in pipe.results(first):
                    steps += 1
                    if steps == 4:
                        break
                assert len(await collect(pipe, iter(second))) == len(second)
                return pipe.statistics()

        stats = asyncio.run(run())
        # the first loop's batches in flight (two in the ring, one read ahead), untrained
        assert (stats.discarded, stats.applied) == (3, len(second))
        assert parameter_digest(setup.model) == parameter_digest(plain.model)


def test_wrong_arguments_are_refused_when_the_pipeline_is_built() -> None:
    """Before any batch is taken: a misspelt task in thread_map (it ran on lane
    "default"), an optimizer that is none, a forward that is no function, a model
    that is no module, a device no step can run on, and flags given as strings ("no"
    counted as true)."""
    with one_rank_group():
        setup = build_dlrm_training(SMALL, "sgd", seed=3)
        model, optimizer, device = setup.model, setup.optimizer, setup.device
        with pytest.raises(ValueError, match=r"names task\(s\) \['forwrd'\].*did you mean 'forward'"):
            SparseDistPipeline(model, optimizer, device, thread_map={"forwrd": "compute"})
        with pytest.raises(TypeError, match="steps an optimizer"):
            SparseDistPipeline(model, None, device)
        with pytest.raises(TypeError, match="custom_model_fwd must be a function"):
            SparseDistPipeline(model, optimizer, device, custom_model_fwd=5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="model must be a torch.nn.Module, got object$"):
            SparseDistEvalPipeline(object(), None, device)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="a torch.nn.Module, got CombinedOptimizer$"):
            SparseDistPipeline(optimizer, optimizer, device)  # type: ignore[arg-type]
        for bad, message in [(None, "device must be a torch.device, a str.*got NoneType"),
                             ("cpuu", "'cpuu' is not a device torch knows"),
                             ("meta", "'meta' holds no data")]:  # fmt: skip
            with pytest.raises((TypeError, ValueError), match=message):
                SparseDistPipeline(model, optimizer, bad)  # type: ignore[arg-type]
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="torch sees no CUDA device here"):
                SparseDistPipeline(model, optimizer, "cuda")
        for flag in ("execute_all_batches", "strict", "end_together"):
            with pytest.raises(TypeError, match=f"{flag} must be True or False, got 'no'"):
                SparseDistPipeline(model, optimizer, device, **{flag: "no"})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="fused must be True or False"):
            SparseDistEvalPipeline(model, None, device, fused="yes")  # type: ignore[arg-type]
        # the family's shared maps name tasks some schedules lack: still accepted
        SparseDistPipeline(model, optimizer, device, schedule="base",
                           thread_map=SPARSE_DIST_THREAD_MAP).shutdown()  # fmt: skip


def test_a_pipeline_shut_down_gives_its_agreement_group_to_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An evaluation pipeline made per pass, each ending together with the others:
    one gloo group for all of them (each made its own, never freed: connections and
    threads piling up over a long job)."""
    import torch.distributed as dist

    made: list[Any] = []
    new_group = dist.new_group

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(new_group(*args, **kwargs))
        return made[-1]

    with one_rank_group():
        setup = build_dlrm_training(SMALL, "sgd", seed=3)
        setup.model.eval()
        monkeypatch.setattr(dist, "new_group", counted)
        for _ in range(3):
            evaluator = SparseDistEvalPipeline(setup.model, None, setup.device, end_together=True)
            assert len(asyncio.run(collect(evaluator, iter(SyntheticDLRMData(SMALL, 2))))) == 2
            evaluator.shutdown()
        assert len(made) == 1


@pytest.mark.parametrize("options", [{}, {"execute_all_batches": False}],
                         ids=["all", "last two dropped"])  # fmt: skip
def test_an_async_generator_a_switch_closed_is_refused_under_the_adapter_s_wrappers(
    options: dict[str, Any],
) -> None:
    """A results() loop over an async generator left with its next fetch under way,
    another source, then the generator again: cancelling that fetch finished the
    generator, and with the last two batches dropped the engine reads it through a
    wrapper; either way it is refused by name, not ended as if it had run dry."""
    batches = list(SyntheticDLRMData(SMALL, 8))
    # The fetch under way as the loop is left: the ring's three batches and the one
    # read ahead are in (and the wrapper's two more, when it drops the last two).
    held_at = 3 if not options else 5

    async def run(setup: Any) -> None:
        started, gate = asyncio.Event(), asyncio.Event()

        async def items() -> AsyncIterator[Any]:
            for index, batch in enumerate(batches):
                if index == held_at:
                    started.set()
                    await gate.wait()
                yield batch

        generator = items()
        async with SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                      **options) as pipe:  # fmt: skip
            async for _ in pipe.results(generator):
                break
            await asyncio.wait_for(started.wait(), 30)  # its next fetch is under way
            assert len(await collect(pipe, iter(batches[:4]))) == (2 if options else 4)
            assert generator.ag_frame is None
            with pytest.raises(PipelineStateError, match="closed by aiopipe"):
                await collect(pipe, generator)

    with one_rank_group():
        asyncio.run(run(build_dlrm_training(SMALL, "sgd", seed=3)))
