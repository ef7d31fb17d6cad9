"""AsyncExecutor placement: lanes, the loop lane, async bodies, parallelism, hand-offs."""

from __future__ import annotations

import asyncio
import sys
import threading
import weakref
from typing import Any

import pytest
from conftest import Recorder, collect

from aiopipe import AsyncExecutor, Pipeline, Task, TaskContext
from aiopipe.executors.asyncio_executor import LOOP_SWITCH_INTERVAL_S
from aiopipe.lanes import resolve_lane
from aiopipe._core.lanes import LanePool
from aiopipe._core.waker import LoopWaker


def noop(ctx: object) -> None:
    return None


def test_resolve_lane_for_every_thread_map_form() -> None:
    task = Task.from_fn("h2d", noop, stream="memcpy")
    assert resolve_lane(task, None) == "memcpy"
    assert resolve_lane(task, "by_stream") == "memcpy"
    assert resolve_lane(task, "per_task") == "h2d"
    assert resolve_lane(task, {"h2d": "io"}) == "io"
    assert resolve_lane(task, {"other": "io"}) == "default"
    assert resolve_lane(task, lambda t: t.stream.upper()) == "MEMCPY"
    with pytest.raises(ValueError, match="unknown thread_map"):
        resolve_lane(task, "by_thread")
    with pytest.raises(TypeError, match="lanes are names"):
        resolve_lane(task, lambda t: 3)  # type: ignore[arg-type,return-value]


async def test_a_stream_or_task_named_loop_gets_a_thread_unless_mapped_by_name(
    recorder: Recorder,
) -> None:
    tasks = [recorder.task("copy", stream="loop"), recorder.task("loop", lookahead=0)]
    assert [resolve_lane(t, "per_task") for t in tasks] == ["copy", "loop-task"]
    assert [resolve_lane(t, None) for t in tasks] == ["loop-stream", "default"]
    async with Pipeline(tasks, thread_map="per_task") as pipe:
        await collect(pipe, iter(range(2)))
    async with Pipeline(tasks) as pipe:  # by stream
        await collect(pipe, iter(range(2)))
    assert recorder.threads_of("copy") == {"aiopipe-lane-copy", "aiopipe-lane-loop-stream"}
    assert recorder.threads_of("loop") == {"aiopipe-lane-loop-task", "aiopipe-lane-default"}
    assert resolve_lane(tasks[0], {"copy": "loop"}) == "loop"  # asked for by name: the loop


async def test_bodies_run_where_their_lane_says(recorder: Recorder) -> None:
    tasks = [
        recorder.task("io_task", lookahead=1, stream="memcpy"),
        recorder.task("compute_task"),
        recorder.task("inline_task"),
        recorder.task("async_task", is_async=True),
    ]
    thread_map = {"io_task": "io", "compute_task": "compute", "inline_task": "loop",
                  "async_task": "compute"}  # fmt: skip
    async with Pipeline(tasks, thread_map=thread_map) as pipe:
        await collect(pipe, iter(range(3)))
    loop_thread = threading.current_thread().name
    assert recorder.threads_of("io_task") == {"aiopipe-lane-io"}
    assert recorder.threads_of("compute_task") == {"aiopipe-lane-compute"}
    assert recorder.threads_of("inline_task") == {loop_thread}
    assert recorder.threads_of("async_task") == {loop_thread}  # coroutines run on the loop


async def test_lanes_really_run_in_parallel() -> None:
    barrier = threading.Barrier(2, timeout=10)

    def meet(ctx: TaskContext) -> None:
        barrier.wait()  # would time out if the two lanes were serialised

    tasks = [Task.from_fn("left", meet, stream="a"), Task.from_fn("right", meet, stream="b")]
    async with Pipeline(tasks, executor="async") as pipe:
        await collect(pipe, iter(range(5)))


async def test_run_on_lane_reaches_the_tasks_lane_thread() -> None:
    seen: list[str] = []

    async def body(ctx: TaskContext) -> None:
        name = await ctx.run_on_lane(lambda: threading.current_thread().name)
        again = await ctx.run_on_lane(threading.current_thread)
        seen.append(name)
        seen.append(again.name)

    tasks = [Task.from_fn("a", body, stream="memcpy"), Task.from_fn("b", body)]
    async with Pipeline(tasks, thread_map={"a": "io", "b": "loop"}) as pipe:
        await collect(pipe, iter(range(2)))
    loop_thread = threading.current_thread().name
    assert seen.count("aiopipe-lane-io") == 4
    assert seen.count(loop_thread) == 4


@pytest.mark.parametrize("thread_map", ["per_task", {"double": "loop"}])
async def test_run_on_lane_sees_the_tasks_context(thread_map: object) -> None:
    async def double(ctx: TaskContext) -> None:
        value = await ctx.run_on_lane(lambda: ctx.slots["batch_cpu"] * 2)
        ctx.slots.set("step_result", value)

    async with Pipeline([Task.from_fn("double", double)], thread_map=thread_map) as pipe:  # type: ignore[arg-type]
        assert await collect(pipe, iter(range(3))) == [0, 2, 4]


async def test_run_on_lane_propagates_errors() -> None:
    async def body(ctx: TaskContext) -> None:
        await ctx.run_on_lane(lambda: 1 / 0)

    async with Pipeline([Task.from_fn("a", body)], executor="async") as pipe:
        with pytest.raises(ZeroDivisionError):
            await pipe.progress(iter(range(1)))


async def test_same_lane_work_does_not_bounce_through_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ten tasks on one lane: one hand-off to the lane and one wake of the loop per
    progress, not one per task (by a waker or by ``call_soon_threadsafe``)."""
    tasks = [Task.from_fn(f"t{i}", noop, lookahead=i % 2) for i in range(10)]
    loop = asyncio.get_running_loop()
    calls = 0
    post, threadsafe = LoopWaker.post, loop.call_soon_threadsafe

    def counting_post(self: LoopWaker, *args: Any) -> bool:
        nonlocal calls
        calls += 1
        return post(self, *args)

    def counting_threadsafe(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return threadsafe(*args, **kwargs)

    monkeypatch.setattr(LoopWaker, "post", counting_post)
    monkeypatch.setattr(loop, "call_soon_threadsafe", counting_threadsafe)
    async with Pipeline(tasks, thread_map=lambda t: "single") as pipe:
        source = iter(range(50))
        await pipe.progress(source)  # prefill
        calls = 0
        for _ in range(20):
            await pipe.progress(source)
    assert calls == 20


async def test_cross_lane_edges_are_honoured(recorder: Recorder) -> None:
    order: list[str] = []
    lock = threading.Lock()

    def body(name: str):  # type: ignore[no-untyped-def]
        def run(ctx: TaskContext) -> None:
            with lock:
                order.append(name)

        return run

    tasks = [
        Task.from_fn("c", body("c"), depends_on=("b",)),
        Task.from_fn("b", body("b"), same_progress_sync=("a",), stream="s2"),
        Task.from_fn("a", body("a"), stream="s1"),
    ]
    async with Pipeline(tasks, thread_map="per_task") as pipe:
        await collect(pipe, iter(range(20)))
    assert order == ["a", "b", "c"] * 20


def test_too_many_lanes_is_refused() -> None:
    tasks = [Task.from_fn(f"t{i}", noop) for i in range(5)]
    with pytest.raises(ValueError, match="max_lanes=3"):
        Pipeline(tasks, executor=AsyncExecutor("per_task", max_lanes=3))


async def test_statistics_name_the_lanes() -> None:
    executor = AsyncExecutor({"a": "io"})
    tasks = [Task.from_fn("a", noop), Task.from_fn("b", noop)]
    async with Pipeline(tasks, executor=executor) as pipe:
        await collect(pipe, iter(range(2)))
        stats = executor.statistics()
        assert set(stats.lanes) == {"io", "default"}
        assert stats.tickets.waiting == ()
        assert executor.lane_of("b") == "default"


async def test_shutdown_joins_every_lane() -> None:
    tasks = [Task.from_fn(f"t{i}", noop) for i in range(4)]
    pipe = Pipeline(tasks, thread_map="per_task")
    await collect(pipe, iter(range(2)))
    assert sum(t.name.startswith("aiopipe-lane") for t in threading.enumerate()) == 4
    pipe.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("aiopipe-lane")]


async def test_a_lane_wakes_the_loop_only_after_dropping_its_work_item() -> None:
    # What the woken loop runs finds the item gone: a caller that drops its pipeline
    # as soon as a step returns is not racing a lane still holding it.
    loop = asyncio.get_running_loop()
    waker, pool = LoopWaker(loop), LanePool(1)
    seen: asyncio.Future[object] = loop.create_future()
    ran = threading.Event()

    def on_the_loop() -> None:
        seen.set_result(held())
        ran.set()

    class Item:
        def __call__(self) -> None:
            waker.post(on_the_loop)
            lane.wake_after_item(waker)
            # A loop woken here would run on_the_loop now, with this item alive; the
            # wait can only end by its timeout when the wake-up waits for the item's end.
            ran.wait(0.2)

    lane, item = pool.get("probe"), Item()
    held = weakref.ref(item)
    lane.submit(item)
    del item
    try:
        assert await seen is None
    finally:
        pool.shutdown()


def test_lanes_lower_the_gil_switch_interval_and_never_raise_it() -> None:
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)  # the interpreter's default
        Pipeline([Task.from_fn("t", noop)], thread_map="per_task").shutdown()
        assert sys.getswitchinterval() == pytest.approx(LOOP_SWITCH_INTERVAL_S)
        sys.setswitchinterval(0.0002)  # a user's own, shorter setting stays
        Pipeline([Task.from_fn("t", noop)], thread_map="per_task").shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        sys.setswitchinterval(0.005)  # the opt-in sequential executor leaves it alone
        Pipeline([Task.from_fn("t", noop)], executor="sequential").shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)


async def test_the_chain_finishing_the_progress_is_handed_over_first() -> None:
    # Declared io-first, as pipelines with a copy stage are: the compute lane, whose
    # chain holds the batch this progress returns, must still be woken first.  (On
    # one stream, train would wait for prep, and the io lane would hand it over:
    # test_deferred_handover.py.)
    tasks = [
        Task.from_fn("h2d", noop, lookahead=2, writes=("dev",), stream="copy"),
        Task.from_fn("prep", noop, lookahead=1, reads=("dev",), writes=("prepped",), stream="copy"),
        Task.from_fn("train", noop, reads=("prepped",), writes=("step_result",)),
    ]
    executor = AsyncExecutor({"h2d": "io", "prep": "io", "train": "compute"})
    handed: dict[int, list[str]] = {}  # iteration -> lanes in the order they got work

    def recording(lane: Any) -> Any:
        def submit(work: Any) -> None:
            handed.setdefault(work.args[0].iteration.number, []).append(lane.name)
            queue_work(work)

        queue_work = lane.submit
        return submit

    async with Pipeline(tasks, executor=executor) as pipe:
        for name in ("io", "compute"):
            lane = executor._lane_pool.get(name)
            lane.submit = recording(lane)  # type: ignore[method-assign]
        assert await collect(pipe, iter(range(5))) == [None] * 5
    assert handed[0] == ["io"]  # prefill: batches ahead only
    assert [handed[i] for i in range(2, 5)] == [["compute", "io"]] * 3  # steady state
    assert handed[6] == ["compute"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_lane_threads_run_at_a_lower_cpu_priority_than_the_loop() -> None:
    """A lane thread (and so the OpenMP workers it starts) is LANE_NICE nicer than the
    thread that made it, so the loop thread wins a busy core when it has work."""
    import os

    from aiopipe._core.lanes import LANE_NICE, LanePool

    seen: list[int] = []
    done = threading.Event()

    def read_own_priority() -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        done.set()

    pool = LanePool(1)
    try:
        pool.get("compute").submit(read_own_priority)
        assert done.wait(10)
    finally:
        pool.shutdown()
    loop_thread = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert LANE_NICE == 5  # the default (AIOPIPE_LANE_NICE unset)
    assert seen == [min(loop_thread + LANE_NICE, 19)]
