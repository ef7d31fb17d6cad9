"""The progress contract of SchedulablePipeline, for both executors."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
from conftest import Recorder, collect

from aiopipe import (
    AsyncExecutor,
    Pipeline,
    PipelineStateError,
    SchedulablePipeline,
    Schedule,
    Task,
    TaskContext,
)

EXECUTORS = ["sequential", "async"]


def three_stage(recorder: Recorder, executor: str, **kwargs: object) -> Pipeline:
    tasks = [
        recorder.task("load", lookahead=2, stream="memcpy", reads=("batch_cpu",), writes=("x",)),
        recorder.task("dist", lookahead=1, stream="data_dist", reads=("x",), writes=("y",)),
        recorder.task("step", reads=("y", "batch_cpu"), writes=("step_result",)),
    ]
    return Pipeline(tasks, executor=executor, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("batches", [0, 1, 2, 3, 7])
async def test_m_batches_give_m_results_then_stop(
    recorder: Recorder, executor: str, batches: int
) -> None:
    async with three_stage(recorder, executor) as pipe:
        source = iter(range(batches))
        assert await collect(pipe, source) == [f"result-{b}" for b in range(batches)]
        for name in ("load", "dist", "step"):
            assert recorder.batches_of(name) == list(range(batches))
        with pytest.raises(StopAsyncIteration):  # and it keeps saying so
            await pipe.progress(source)


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_first_call_absorbs_the_prefill(recorder: Recorder, executor: str) -> None:
    async with three_stage(recorder, executor) as pipe:
        source = iter(range(10))
        assert await pipe.progress(source) == "result-0"
        assert pipe.statistics().pulled == 3  # batches 0, 1, 2 in flight, 0 done
        assert recorder.batches_of("load") == [0, 1, 2]


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_async_iterator_source(recorder: Recorder, executor: str) -> None:
    async def batches() -> AsyncIterator[int]:
        for b in range(4):
            await asyncio.sleep(0)
            yield b

    async with three_stage(recorder, executor) as pipe:
        assert await collect(pipe, batches()) == [f"result-{b}" for b in range(4)]


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_new_iterator_after_drain_starts_afresh(recorder: Recorder, executor: str) -> None:
    async with three_stage(recorder, executor) as pipe:
        assert await collect(pipe, iter(range(2))) == ["result-0", "result-1"]
        assert await collect(pipe, iter(range(3))) == ["result-0", "result-1", "result-2"]


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_new_iterator_while_in_flight_is_refused_and_untouched(
    recorder: Recorder, executor: str
) -> None:
    async with three_stage(recorder, executor) as pipe:
        first = iter(range(5))
        await pipe.progress(first)
        second = iter(range(100, 105))
        # two batches in the ring, and the one read ahead while the first ran
        with pytest.raises(PipelineStateError, match="3 batch"):
            await pipe.progress(second)
        assert next(second) == 100  # none of its batches was taken
        # the first source carries on where it was
        assert await collect(pipe, first) == [f"result-{b}" for b in range(1, 5)]


def echo_pipeline(executor: str) -> Pipeline:
    """Two lookaheads; each result is the batch value itself."""
    tasks = [
        Task.from_fn("load", lambda ctx: ctx.slots.set("x", ctx.slots["batch_cpu"]), lookahead=1,
                     writes=("x",)),
        Task.from_fn("step", lambda ctx: ctx.slots.set("step_result", ctx.slots["x"]),
                     reads=("x",), writes=("step_result",)),
    ]  # fmt: skip
    return Pipeline(tasks, executor=executor)


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_drain_finishes_in_flight_batches_and_forgets_the_source(executor: str) -> None:
    async with echo_pipeline(executor) as pipe:
        source = iter(range(10))
        assert await pipe.progress(source) == 0
        assert await pipe.progress(source) == 1
        assert await pipe.drain() == [2, 3]  # the batch in the ring, the one read ahead
        stats = pipe.statistics()
        assert (stats.in_flight, stats.exhausted) == (0, False)  # items are left
        assert await pipe.drain() == []
        # the same iterator carries on with its next batch, as a fresh source
        assert await collect(pipe, source) == list(range(4, 10))
        assert pipe.statistics().exhausted  # now its end was read


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_lookahead_zero_pipelines_without_read_ahead_may_switch_iterators_any_time(
    recorder: Recorder, executor: str
) -> None:
    task = recorder.task("only", writes=("step_result",))
    async with Pipeline([task], executor=executor, read_ahead=False) as pipe:
        assert await pipe.progress(iter(range(5))) == "result-0"
        assert await pipe.progress(iter(range(5))) == "result-0"


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_the_batch_read_ahead_is_in_flight_until_drained(
    recorder: Recorder, executor: str
) -> None:
    async with Pipeline([recorder.task("only", writes=("step_result",))], executor=executor) as pipe:
        first = iter(range(5))
        assert await pipe.progress(first) == "result-0"
        assert pipe.statistics().in_flight == 1  # batch 1, read while batch 0 ran
        with pytest.raises(PipelineStateError, match="1 batch"):
            await pipe.progress(iter(range(5)))
        assert await pipe.drain() == ["result-1"]
        assert await pipe.progress(iter(range(7, 9))) == "result-0"  # a fresh source


def test_an_iterable_is_not_an_iterator(recorder: Recorder) -> None:
    pipe = three_stage(recorder, "sequential")
    async def main() -> None:
        await pipe.progress([1, 2, 3])  # type: ignore[arg-type]

    with pytest.raises(TypeError, match=r"iter\(\.\.\.\)"):
        asyncio.run(main())


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_seeded_batch_is_the_first_batch_and_none_is_lost(
    recorder: Recorder, executor: str
) -> None:
    async with three_stage(recorder, executor) as pipe:
        source = iter(range(5))
        first = next(source)  # an adapter peeked one batch to bootstrap
        pipe.seed_first_batch({"batch_cpu": first, "x": ("seeded", 0)})
        results = await collect(pipe, source)
        assert results == [f"result-{b}" for b in range(5)]
        assert recorder.batches_of("step") == list(range(5))


async def test_a_seed_is_refused_in_the_middle_of_a_source() -> None:
    async with Pipeline([Task.from_fn("a", lambda ctx: None)]) as pipe:
        source = iter(range(3))
        await pipe.progress(source)  # the source goes on (its next batch read ahead)
        with pytest.raises(PipelineStateError, match="seed"):
            pipe.seed_first_batch({"batch_cpu": 99})
        assert len(await collect(pipe, source)) == 2
        assert pipe.statistics().returned == 3


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_results_async_for(recorder: Recorder, executor: str) -> None:
    async with three_stage(recorder, executor) as pipe:
        assert [r async for r in pipe.results(iter(range(3)))] == ["result-0", "result-1", "result-2"]


async def test_results_of_an_iterable_is_one_pass_per_call(recorder: Recorder) -> None:
    """``results(loader)`` behaves like ``for batch in loader``: each call is a fresh
    pass (a new epoch); an iterator passed instead continues where it stands."""
    loader = [0, 1, 2]

    async def epoch() -> AsyncIterator[int]:
        for b in (0, 1):
            yield b

    class AsyncLoader:  # an async iterable that is not an iterator
        def __aiter__(self) -> AsyncIterator[int]:
            return epoch()

    async with three_stage(recorder, "async") as pipe:
        assert [r async for r in pipe.results(loader)] == ["result-0", "result-1", "result-2"]
        assert [r async for r in pipe.results(loader)] == ["result-0", "result-1", "result-2"]
        assert [r async for r in pipe.results(AsyncLoader())] == ["result-0", "result-1"]
        source = iter(range(4))
        assert await pipe.progress(source) == "result-0"
        assert [r async for r in pipe.results(source)] == ["result-1", "result-2", "result-3"]
        with pytest.raises(TypeError, match="results\\(\\) takes an iterable"):
            [r async for r in pipe.results(5)]  # type: ignore[arg-type]


async def test_progress_refuses_an_iterable_and_names_results(recorder: Recorder) -> None:
    async with three_stage(recorder, "async") as pipe:
        with pytest.raises(TypeError, match="takes an iterator, got the iterable list.*results\\(list\\)"):
            await pipe.progress([1, 2])
        class Batch:  # a batch's repr can run to pages (tensors)
            def __repr__(self) -> str:
                return "tensor(...)" * 10_000

        with pytest.raises(TypeError, match="takes a sync or async iterator, got ") as refused:
            await pipe.progress(Batch())  # type: ignore[arg-type]
        assert len(str(refused.value)) < 200


async def test_a_generator_function_passed_uncalled_asks_did_you_mean(recorder: Recorder) -> None:
    def batches() -> Iterator[int]:
        yield from range(3)

    async def stream() -> AsyncIterator[int]:
        yield 0

    async with three_stage(recorder, "async") as pipe:
        with pytest.raises(TypeError, match=r"progress\(\) .* a generator function: did you mean "
                                            r"batches\(\)\?"):  # fmt: skip
            await pipe.progress(batches)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"results\(\) .* an async generator function: did you "
                                            r"mean stream\(\)\?"):  # fmt: skip
            [r async for r in pipe.results(stream)]  # type: ignore[arg-type]
        assert [r async for r in pipe.results(batches())] == ["result-0", "result-1", "result-2"]


def test_the_blocking_form_asks_did_you_mean_too(recorder: Recorder) -> None:
    def batches() -> Iterator[int]:
        yield from range(3)

    with three_stage(recorder, "async").blocking() as blocking:
        with pytest.raises(TypeError, match=r"did you mean batches\(\)\?"):
            blocking.progress(batches)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"did you mean batches\(\)\?"):
            list(blocking.results(batches))  # type: ignore[arg-type]


async def test_step_result_defaults_to_none(recorder: Recorder) -> None:
    async with Pipeline([recorder.task("a", lookahead=1), recorder.task("b")]) as pipe:
        assert await collect(pipe, iter(range(3))) == [None, None, None]


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_context_reports_iteration_and_batch(executor: str) -> None:
    seen: list[tuple[str, int, int, object]] = []

    def body(ctx: TaskContext) -> None:
        seen.append((ctx.task.name, ctx.iter_count, ctx.batch_index, ctx.slots["batch_cpu"]))

    tasks = [Task.from_fn("deep", body, lookahead=1), Task.from_fn("shallow", body)]
    async with Pipeline(tasks, executor=executor) as pipe:
        await collect(pipe, iter("ab"))
    assert sorted(seen, key=lambda s: (s[1], s[0])) == [
        ("deep", 0, 0, "a"),
        ("deep", 1, 1, "b"),
        ("shallow", 1, 0, "a"),
        ("shallow", 2, 1, "b"),
    ]


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_init_runs_once_before_the_first_iteration(executor: str) -> None:
    calls: list[str] = []

    async def init(ctx: TaskContext) -> None:
        calls.append(f"init {ctx.task.name}")

    task = Task.from_fn("a", lambda ctx: calls.append("run"), init=init)
    async with Pipeline([task], executor=executor) as pipe:
        await collect(pipe, iter(range(2)))
        await collect(pipe, iter(range(1)))
    assert calls == ["init a", "run", "run", "run"]


async def test_a_failed_init_does_not_repeat_the_inits_before_it() -> None:
    calls: list[str] = []

    def init_a(ctx: TaskContext) -> None:
        calls.append("a")

    def init_b(ctx: TaskContext) -> None:
        calls.append("b")
        if calls.count("b") == 1:
            raise RuntimeError("b's resource is not ready yet")

    tasks = [Task.from_fn("a", lambda ctx: None, init=init_a),
             Task.from_fn("b", lambda ctx: None, init=init_b)]  # fmt: skip
    async with Pipeline(tasks) as pipe:
        with pytest.raises(RuntimeError, match="not ready"):
            await pipe.progress(iter(range(2)))
        assert len(await collect(pipe, iter(range(2)))) == 2
    assert calls == ["a", "b", "b"]


async def test_slots_are_unavailable_during_init() -> None:
    def init(ctx: TaskContext) -> None:
        ctx.slots  # noqa: B018

    async with Pipeline([Task.from_fn("a", lambda ctx: None, init=init)]) as pipe:
        with pytest.raises(PipelineStateError, match="init"):
            await pipe.progress(iter(range(1)))


def test_context_outside_a_task_is_an_error() -> None:
    pipe = Pipeline([Task.from_fn("a", lambda ctx: None)])
    with pytest.raises(PipelineStateError, match="inside a running task"):
        pipe._ctx.slots  # noqa: B018


async def test_shutdown_is_idempotent_and_final(recorder: Recorder) -> None:
    pipe = three_stage(recorder, "async")
    await pipe.progress(iter(range(3)))
    pipe.shutdown()
    pipe.shutdown()
    with pytest.raises(PipelineStateError, match="shut down"):
        await pipe.progress(iter(range(3)))
    with pytest.raises(PipelineStateError, match="shut down"):
        pipe.reset()  # as every other call: it said nothing before


async def test_concurrent_progress_calls_are_refused(recorder: Recorder) -> None:
    gate = asyncio.Event()

    async def slow(ctx: TaskContext) -> None:
        await gate.wait()

    async with Pipeline([Task.from_fn("slow", slow)]) as pipe:
        source = iter(range(3))
        first = asyncio.ensure_future(pipe.progress(source))
        await asyncio.sleep(0)
        with pytest.raises(PipelineStateError, match="already running"):
            await pipe.progress(source)
        with pytest.raises(PipelineStateError, match=r"step\(\)\) is already running"):
            await pipe.step(7)  # the message names every call it may be
        gate.set()
        assert await first is None


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_sync_body_returning_a_coroutine_is_a_clear_error(executor: str) -> None:
    async def coro() -> None:
        return None

    async with Pipeline([Task.from_fn("a", lambda ctx: coro())], executor=executor) as pipe:
        with pytest.raises(ValueError, match="async def"):
            await pipe.progress(iter(range(1)))


def test_schedule_is_in_topological_order() -> None:
    tasks = [
        Task.from_fn("reader", lambda ctx: None, reads=("x",)),
        Task.from_fn("writer", lambda ctx: None, writes=("x",)),
    ]
    pipe = SchedulablePipeline(Schedule.of(tasks))
    assert [t.name for t in pipe.plan.order] == ["writer", "reader"]


def test_thread_map_with_a_non_async_executor_is_refused() -> None:
    with pytest.raises(ValueError, match="thread_map"):
        Pipeline([Task.from_fn("a", lambda ctx: None)], executor="sequential", thread_map="per_task")


def test_unknown_executor_name() -> None:
    with pytest.raises(ValueError, match="unknown executor"):
        Pipeline([Task.from_fn("a", lambda ctx: None)], executor="threads")


def test_an_executor_instance_serves_one_pipeline() -> None:
    executor = AsyncExecutor()
    tasks = [Task.from_fn("a", lambda ctx: None)]
    Pipeline(tasks, executor=executor)
    with pytest.raises(ValueError, match="one pipeline"):
        Pipeline(tasks, executor=executor)
    executor.shutdown()


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_the_read_ahead_starts_while_the_step_runs(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """With every core busy, a loop that sleeps before it starts reading the next
    batch gets a core back only milliseconds later: the pull of batch k + 1 (its
    first step, or a sync source's whole ``next()``) starts once step k is handed to
    its lane and before the loop goes to wait for it.  Each step's body, on its
    lane, also holds the step until it sees that pull begun."""
    import aiopipe.driver

    events: list[str] = []
    pulled = [threading.Event() for _ in range(4)]
    wait_ended = aiopipe.driver.IterationDriver.wait_ended

    async def recorded_wait(self: aiopipe.driver.IterationDriver) -> None:
        events.append("wait")
        await wait_ended(self)

    monkeypatch.setattr(aiopipe.driver.IterationDriver, "wait_ended", recorded_wait)

    async def items() -> AsyncIterator[int]:
        for n in range(4):
            events.append(f"pull {n}")  # the pull's first step, before its fetch
            pulled[n].set()
            await asyncio.sleep(0)
            yield n

    def sync_items() -> Iterator[int]:
        for n in range(4):
            events.append(f"pull {n}")
            pulled[n].set()
            yield n

    def body(ctx: TaskContext) -> None:
        n = ctx.slots["batch_cpu"]
        if n + 1 < len(pulled):
            # A bound, not a schedule: the loop sets it long before, or never.
            assert pulled[n + 1].wait(timeout=10), f"batch {n + 1} not pulled during step {n}"
        ctx.slots.set("step_result", n)

    step = Task.from_fn("step", body)
    async with Pipeline([step], executor=AsyncExecutor()) as pipe:
        source = items() if kind == "async" else sync_items()
        assert [r async for r in pipe.results(source)] == [0, 1, 2, 3]
    # pull 0 came before the first iteration; iteration k reads batch k + 1 ahead
    assert events[:7] == ["pull 0", "pull 1", "wait", "pull 2", "wait", "pull 3", "wait"]
