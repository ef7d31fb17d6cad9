"""The cancellation contract, case by case: a caller cancelled anywhere loses no item,
repeats no step and leaves the pipeline usable.  Each interleaving is forced with
events held by the source or a task body."""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from conftest import cancelled

from aiopipe import BadBatchError, Pipeline, PipelineStateError, Task, TaskContext


def echo(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])


def recording(trained: list[Any]) -> Task:
    """A ``train`` task that echoes its batch and appends it to ``trained``."""

    def train(ctx: TaskContext) -> None:
        trained.append(ctx.slots["batch_cpu"])
        echo(ctx)

    return Task.from_fn("train", train)


async def in_a_thread(event: threading.Event) -> None:
    """Wait for a lane body to reach its gate without blocking the loop."""
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, 10)


async def test_without_read_ahead_a_cancelled_pull_keeps_the_async_generator() -> None:
    reached, release = asyncio.Event(), asyncio.Event()

    async def items() -> AsyncIterator[int]:
        for n in range(5):
            if n == 2:
                reached.set()
                await release.wait()  # a cancellation thrown in here would close the generator
            yield n

    source = items()
    async with Pipeline([Task.from_fn("train", echo)], read_ahead=False) as pipe:
        assert [await pipe.progress(source), await pipe.progress(source)] == [0, 1]
        call = asyncio.ensure_future(pipe.progress(source))
        await reached.wait()
        await cancelled(call)
        release.set()
        assert [r async for r in pipe.results(source)] == [2, 3, 4]


async def test_a_cancelled_drain_leaves_the_rest_of_the_source_to_progress() -> None:
    started, release = threading.Event(), threading.Event()

    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 3:
            started.set()
            release.wait(10)
        echo(ctx)

    source = iter(range(10))
    async with Pipeline([Task.from_fn("train", train)]) as pipe:
        assert [await pipe.progress(source) for _ in range(3)] == [0, 1, 2]  # 3 read ahead
        call = asyncio.ensure_future(pipe.drain())
        await in_a_thread(started)
        await cancelled(call)
        release.set()
        # the drain was cancelled, not done: the source goes on, batch 3's result first
        assert [r async for r in pipe.results(source)] == list(range(3, 10))


async def test_progress_after_a_drain_refused_a_batch_goes_on_with_the_source() -> None:
    def check(batch: int) -> None:
        if batch == 3:
            raise ValueError("malformed")

    source = iter(range(10))
    async with Pipeline([Task.from_fn("train", echo)], check_batch=check) as pipe:
        assert [await pipe.progress(source) for _ in range(3)] == [0, 1, 2]  # 3 read ahead
        with pytest.raises(BadBatchError):
            await pipe.drain()
        # BadBatchError's advice: call progress() again with the same iterator
        assert [r async for r in pipe.results(source)] == list(range(4, 10))


async def test_an_async_init_cancelled_half_way_runs_once() -> None:
    reached, release = asyncio.Event(), asyncio.Event()
    runs: list[str] = []

    async def init(ctx: TaskContext) -> None:
        runs.append("init")
        reached.set()
        await release.wait()

    source = iter(range(3))
    async with Pipeline([Task.from_fn("train", echo, init=init)]) as pipe:
        call = asyncio.ensure_future(pipe.progress(source))
        await reached.wait()
        await cancelled(call)
        release.set()
        assert [r async for r in pipe.results(source)] == [0, 1, 2]
    assert runs == ["init"]


def held_echo(started: threading.Event, release: threading.Event) -> Callable[[TaskContext], None]:
    """``echo``, once ``release`` is set; ``started`` says it has begun."""

    def train(ctx: TaskContext) -> None:
        started.set()
        release.wait(10)
        echo(ctx)

    return train


async def test_a_seeded_batch_dropped_by_reset_before_its_pull_is_counted() -> None:
    # An adapter's first batch, seeded, then the first call cancelled before it pulled
    # it (here: in a task's async init): reset() dropped it uncounted, and the same
    # source going on counted its position one short.
    reached, release = asyncio.Event(), asyncio.Event()

    async def init(ctx: TaskContext) -> None:
        reached.set()
        await release.wait()

    source = iter(range(1, 4))  # the adapter took item 0 and seeded it
    async with Pipeline([Task.from_fn("train", echo, init=init)]) as pipe:
        pipe.seed_first_batch({"batch_cpu": 0})
        call = asyncio.ensure_future(pipe.progress(source))
        await reached.wait()
        await cancelled(call)
        release.set()
        pipe.reset()
        dropped = pipe.statistics()
        assert (dropped.discarded, dropped.in_flight) == (1, 0)
        assert [r async for r in pipe.results(source)] == [1, 2, 3]
        assert (pipe.statistics().position, pipe.statistics().discarded) == (4, 1)


async def test_a_cancelled_aclose_raises_and_the_pipeline_closes_later() -> None:
    started, release = threading.Event(), threading.Event()
    pipe = Pipeline([Task.from_fn("train", held_echo(started, release))])
    try:
        call = asyncio.ensure_future(pipe.progress(iter(range(2))))
        await in_a_thread(started)
        await cancelled(call)
        # the body holds its gate until released: the wait cannot end in time
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(pipe.aclose(), 0.05)
        assert not pipe.statistics().closed  # still to be closed
    finally:
        release.set()
    await pipe.aclose()
    assert pipe.statistics().closed


async def test_leaving_async_with_by_an_error_waits_for_another_task_s_call() -> None:
    # The exit waited only for an iteration already running: a call whose first
    # iteration had not begun made shutdown() raise over the body's own error.
    reached, release = asyncio.Event(), asyncio.Event()

    async def init(ctx: TaskContext) -> None:
        reached.set()
        await release.wait()

    with pytest.raises(ValueError, match="the body's own error"):
        async with Pipeline([Task.from_fn("train", echo, init=init)]) as pipe:
            call = asyncio.ensure_future(pipe.progress(iter(range(3))))
            await reached.wait()  # the call is under way, its first iteration not begun
            asyncio.get_running_loop().call_soon(release.set)  # once the exit waits
            raise ValueError("the body's own error")
    assert await call == 0  # finished, its result delivered, then the pipeline closed
    assert pipe.statistics().closed


@pytest.mark.parametrize("closers", [1, 2])
async def test_a_call_started_while_aclose_waits_is_refused(closers: int) -> None:
    # Two: one is cancelled, and the other still waits.  Each cleared the flag on its
    # way out, so new calls were taken again while the other waited.
    started, release = threading.Event(), threading.Event()
    pipe = Pipeline([Task.from_fn("train", held_echo(started, release))])
    source = iter(range(3))
    try:
        call = asyncio.ensure_future(pipe.progress(source))
        await in_a_thread(started)
        await cancelled(call)  # its iteration runs on: aclose() waits for it
        closing = [asyncio.ensure_future(pipe.aclose()) for _ in range(closers)]
        await asyncio.sleep(0)  # they run to their wait
        if closers == 2:
            await cancelled(closing[0])
        with pytest.raises(PipelineStateError, match="shutting down"):
            await pipe.progress(source)
    finally:
        release.set()
    await closing[-1]
    assert pipe.statistics().closed


async def test_aclose_from_inside_the_source_a_call_reads_is_refused_not_a_hang() -> None:
    pipe = Pipeline([Task.from_fn("train", echo)], read_ahead=False)
    refusals: list[str] = []

    async def source() -> AsyncIterator[int]:
        yield 0
        try:
            await pipe.aclose()  # the call under way waits for this very read
        except PipelineStateError as refused:
            refusals.append(str(refused))
        yield 1

    items = source()
    assert [await pipe.progress(items), await pipe.progress(items)] == [0, 1]
    assert len(refusals) == 1 and "while a progress is running" in refusals[0]
    await pipe.aclose()


async def test_closing_says_so_when_another_task_s_call_keeps_it_waiting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A call waiting for a source only the closing task would feed kept aclose()
    # waiting without a word.
    monkeypatch.setattr("aiopipe.calls.SLOW_CALL_S", 0.0)
    queue: asyncio.Queue[int] = asyncio.Queue()

    async def source() -> AsyncIterator[int]:
        while True:
            yield await queue.get()

    pipe = Pipeline([Task.from_fn("train", echo)], name="waiting")
    call = asyncio.ensure_future(pipe.progress(source()))
    await asyncio.sleep(0)  # the call waits for the queue
    closing = asyncio.ensure_future(pipe.aclose())
    said = "waiting: closing waits for a call another task has under way"
    for _ in range(20):  # loop cycles, until its wait's timeout (0 s) has passed
        if said in caplog.text:
            break
        await asyncio.sleep(0)
    assert said in caplog.text and not closing.done()
    queue.put_nowait(7)
    assert await call == 7
    await closing
    assert pipe.statistics().closed


FORKED_CHILD = """
import os
from aiopipe import Pipeline, PipelineStateError, Task

def echo(ctx):
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])

pipe = Pipeline([Task.from_fn("train", echo)]).blocking()
assert list(pipe.results([1, 2])) == [1, 2]  # the lane thread runs
pid = os.fork()
if pid == 0:  # the child: the lane's queue is here, its thread is not
    try:
        pipe.progress(iter([3]))
    except PipelineStateError as exc:
        print("child:", exc, flush=True)
        os._exit(0)
    os._exit(1)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
pipe.shutdown()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_is_told_its_lanes_did_not_come_along() -> None:
    out = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", FORKED_CHILD],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "fork() does not copy threads" in out.stdout
    assert "child exit 0" in out.stdout


class ResumableItems:
    """An async iterator whose pull of item 1 waits on the loop it first runs on;
    cancelled there, it keeps its place (it is not a generator)."""

    def __init__(self, count: int) -> None:
        self.count, self.next_item, self.waited = count, 0, False

    def __aiter__(self) -> ResumableItems:
        return self

    async def __anext__(self) -> int:
        if self.next_item == 1 and not self.waited:
            self.waited = True
            await asyncio.Event().wait()  # never set: this loop ends first
        if self.next_item == self.count:
            raise StopAsyncIteration
        self.next_item += 1
        return self.next_item - 1


def test_a_read_ahead_cancelled_with_its_loop_is_pulled_again_on_the_next() -> None:
    source = ResumableItems(4)
    pipe = Pipeline([Task.from_fn("train", echo)])
    try:
        async def first() -> Any:
            return await pipe.progress(source)

        # item 1 is being read ahead when the first loop ends (asyncio.run cancels it)
        assert asyncio.run(first()) == 0

        async def the_rest() -> list[Any]:
            return [r async for r in pipe.results(source)]

        assert asyncio.run(the_rest()) == [1, 2, 3]  # nothing cancelled this call
    finally:
        pipe.shutdown()


async def test_the_position_counts_steps_finished_for_a_cancelled_caller() -> None:
    started, release = threading.Event(), threading.Event()
    steps: list[int] = []

    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 2:
            started.set()
            release.wait(10)
        steps.append(ctx.slots["batch_cpu"])
        echo(ctx)

    source = iter(range(6))
    async with Pipeline([Task.from_fn("train", train)]) as pipe:
        assert [await pipe.progress(source) for _ in range(2)] == [0, 1]
        call = asyncio.ensure_future(pipe.progress(source))
        await in_a_thread(started)
        await cancelled(call)
        assert not pipe.idle  # batch 2's step runs on
        release.set()
        await pipe.wait_idle()
        stats = pipe.statistics()
        assert (stats.returned, stats.applied) == (2, 3) == (2, len(steps))
        assert stats.position == 3  # a run resumed here does not apply batch 2 twice
        assert [r async for r in pipe.results(source)] == [2, 3, 4, 5]  # 2 comes out first
        assert pipe.statistics().applied == len(steps) == 6


async def test_a_refused_item_ahead_of_batches_in_flight_is_not_in_the_position_yet() -> None:
    """Batches 1 and 2 are in flight (two ahead) when the item after them is refused:
    the position stays at the first unapplied batch, so a run resumed from it trains
    batches 1 and 2 (and skips the bad item again) -- nothing lost, nothing repeated."""
    items: list[Any] = [0, 1, 2, "bad", 3, 4]

    def check(batch: Any) -> None:
        if batch == "bad":
            raise ValueError("malformed")

    def tasks() -> list[Task]:
        return [Task.from_fn("load", lambda ctx: None, lookahead=2), Task.from_fn("train", echo)]

    source = iter(items)
    async with Pipeline(tasks(), check_batch=check) as pipe:
        trained = [await pipe.progress(source)]
        with pytest.raises(BadBatchError):
            await pipe.progress(source)
        stats = pipe.statistics()
        assert (stats.applied, stats.refused, stats.in_flight) == (1, 1, 2)
        assert stats.position == 1  # not applied + refused: batch 1 was never applied
    async with Pipeline(tasks(), check_batch=check) as resumed:
        resumed_source = iter(items[stats.position:])
        while True:
            try:
                trained.append(await resumed.progress(resumed_source))
            except BadBatchError:
                continue
            except StopAsyncIteration:
                break
        assert (resumed.statistics().position, resumed.statistics().refused) == (5, 1)
    assert trained == [0, 1, 2, 3, 4]


async def test_a_results_loop_left_with_applied_results_waiting_keeps_them() -> None:
    """A drain cancelled during batch 2's step leaves results 1 and 2 waiting; a
    ``results()`` loop takes 1 and is left.  Result 2's step was applied, so it is
    owed: another source is refused (nothing taken from it) until ``drain()``
    returns it."""
    started, release = threading.Event(), threading.Event()
    trained: list[int] = []

    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 2:
            started.set()
            release.wait(10)
        trained.append(ctx.slots["batch_cpu"])
        echo(ctx)

    source = iter(range(10))
    async with Pipeline([Task.from_fn("load", lambda ctx: None, lookahead=1),
                         Task.from_fn("train", train)]) as pipe:  # fmt: skip
        assert await pipe.progress(source) == 0
        call = asyncio.ensure_future(pipe.drain())
        await in_a_thread(started)  # the drain holds result 1; batch 2's step waits
        await cancelled(call)
        release.set()
        await pipe.wait_idle()
        results = pipe.results(source)
        assert await anext(results) == 1
        await results.aclose()  # left at a result: the source is abandoned
        other = iter([100, 101])
        with pytest.raises(PipelineStateError, match="1 result.* wait to be returned"):
            await pipe.progress(other)
        assert next(other) == 100  # nothing taken from it
        assert await pipe.drain() == [2]
        assert trained == [0, 1, 2] and pipe.statistics().discarded == 0


def failing_at_batch_3(trained: threading.Event) -> list[Task]:
    """``load`` (one batch ahead, its own lane) fails on batch 3 once ``train`` has
    applied batch 2's step in the same iteration."""

    def load(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 3:
            assert trained.wait(10)
            raise RuntimeError("cannot load batch 3")

    def train(ctx: TaskContext) -> None:
        echo(ctx)
        if ctx.slots["batch_cpu"] == 2:
            trained.set()

    return [Task.from_fn("load", load, lookahead=1, stream="io"), Task.from_fn("train", train)]


async def test_a_drain_failing_on_a_later_batch_keeps_the_applied_steps_result() -> None:
    source = iter(range(6))
    async with Pipeline(failing_at_batch_3(threading.Event())) as pipe:
        assert [await pipe.progress(source) for _ in range(2)] == [0, 1]
        with pytest.raises(RuntimeError, match="cannot load batch 3"):
            await pipe.drain()  # batch 2's step ran in the failed iteration
        assert pipe.statistics().applied == 3
        assert await pipe.drain() == [2]  # the failure first, then what was applied before it
        assert (pipe.statistics().returned, pipe.statistics().applied) == (3, 3)
        with pytest.raises(PipelineStateError, match=r"reset\(\)"):
            await pipe.drain()
        pipe.reset()
        assert [r async for r in pipe.results(iter(range(2)))] == [0, 1]


async def test_progress_returns_the_applied_step_before_the_later_batchs_failure() -> None:
    source = iter(range(6))
    async with Pipeline(failing_at_batch_3(threading.Event())) as pipe:
        assert [await pipe.progress(source) for _ in range(3)] == [0, 1, 2]
        assert pipe.statistics().applied == 3
        with pytest.raises(RuntimeError, match="cannot load batch 3"):
            await pipe.progress(source)  # the call that would return batch 3
        with pytest.raises(PipelineStateError, match=r"reset\(\)"):
            await pipe.progress(source)


def gated_at(batch: int, started: threading.Event, release: threading.Event) -> Task:
    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == batch:
            started.set()
            assert release.wait(10)
        echo(ctx)

    return Task.from_fn("train", train)


def leave_batch_1_on_a_closed_loop(pipe: Pipeline, source: Any, started: threading.Event) -> None:
    """Return batch 0, cancel the call running batch 1's step, close the loop by hand."""
    loop = asyncio.new_event_loop()

    async def first() -> None:
        assert await pipe.progress(source) == 0
        call = asyncio.ensure_future(pipe.progress(source))
        await in_a_thread(started)
        await cancelled(call)

    try:
        loop.run_until_complete(first())
    finally:
        loop.close()  # the step's end is still to come: the lanes' report of it is dropped


async def async_items(count: int) -> AsyncIterator[int]:
    for n in range(count):
        yield n


@pytest.mark.parametrize("source", [lambda: iter(range(4)), lambda: async_items(4)])
def test_an_iteration_left_on_a_closed_loop_is_ended_by_the_next_loop(source: Any) -> None:
    started, release = threading.Event(), threading.Event()
    pipe, items = Pipeline([gated_at(1, started, release)]), source()
    leave_batch_1_on_a_closed_loop(pipe, items, started)
    release.set()

    async def the_rest() -> list[Any]:
        async with pipe:
            return [r async for r in pipe.results(items)]

    assert asyncio.run(the_rest()) == [1, 2, 3]  # batch 1's result comes first


def test_shutdown_after_the_loop_was_closed_by_hand_stops_the_lanes() -> None:
    started, release = threading.Event(), threading.Event()
    pipe = Pipeline([gated_at(1, started, release)])
    leave_batch_1_on_a_closed_loop(pipe, iter(range(4)), started)
    release.set()
    pipe.shutdown()  # not refused: nothing can end that iteration any more
    assert pipe.statistics().closed  # (the lanes are stopped: conftest checks)


def stuck_on_the_loop(batch: int, started: threading.Event, release: threading.Event) -> Task:
    """An ``async def`` on the loop (the iteration runs as a task) that never ends
    ``batch``: only the task's own chain references what it waits for."""

    async def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == batch:
            started.set()
            await asyncio.get_running_loop().create_future()
        echo(ctx)

    return Task.from_fn("train", train, writes=("step_result",))


@pytest.mark.parametrize(
    ("gated", "thread_map"),
    [(gated_at, None), (stuck_on_the_loop, {"train": "loop"})],
    ids=["lanes", "loop"],
)
def test_a_loop_closed_by_hand_leaves_no_pending_task_to_complain_about(
    caplog: pytest.LogCaptureFixture, gated: Any, thread_map: Any
) -> None:
    """What the cancelled call left pending on the closed loop (the guard watching
    the lanes, or the task running the iteration), once collected, must not log
    "Task was destroyed but it is pending!": the pipeline's own warning says it."""
    gc.collect()  # what earlier tests left is not this test's
    caplog.clear()
    started, release = threading.Event(), threading.Event()
    pipe = Pipeline([gated(1, started, release)], thread_map=thread_map)
    leave_batch_1_on_a_closed_loop(pipe, iter(range(4)), started)
    release.set()
    pipe.shutdown()
    del pipe
    gc.collect()
    messages = [r.getMessage() for r in caplog.records]
    assert any("left unfinished on an event loop that was closed" in m for m in messages)
    ours = ("until_done", "_run_as_task")
    assert not [m for m in messages if "Task was destroyed" in m and any(o in m for o in ours)]


def test_reset_after_the_loop_was_closed_by_hand_starts_afresh() -> None:
    started, release = threading.Event(), threading.Event()
    pipe = Pipeline([gated_at(1, started, release)])
    leave_batch_1_on_a_closed_loop(pipe, iter(range(4)), started)
    release.set()
    pipe.reset()

    async def again() -> list[Any]:
        async with pipe:
            return [r async for r in pipe.results(iter(range(3)))]

    assert asyncio.run(again()) == [0, 1, 2]


@pytest.mark.parametrize("lane", ["default", "loop"])  # handed to the loop by a lane, or its own
def test_a_coroutine_iteration_left_on_a_closed_loop_asks_for_reset(lane: str) -> None:
    stuck = asyncio.Event()  # set on the first loop: batch 1's body waits there

    async def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 1 and not stuck.is_set():
            stuck.set()
            await asyncio.Event().wait()  # never set: its loop is closed under it
        echo(ctx)

    pipe = Pipeline([Task.from_fn("train", train)], thread_map={"train": lane})
    source, loop = iter(range(4)), asyncio.new_event_loop()

    async def first() -> None:
        assert await pipe.progress(source) == 0
        call = asyncio.ensure_future(pipe.progress(source))
        await stuck.wait()
        await cancelled(call)

    try:
        loop.run_until_complete(first())
    finally:
        loop.close()

    async def again() -> list[Any]:
        async with pipe:
            with pytest.raises(PipelineStateError, match=r"closed.*reset\(\)"):
                await pipe.progress(source)
            pipe.reset()
            return [r async for r in pipe.results(iter(range(3)))]

    assert asyncio.run(again()) == [0, 1, 2]


def counting(steps: list[int]) -> list[Task]:
    """``load`` one batch ahead, ``train`` (which counts its steps) on the oldest."""

    def load(ctx: TaskContext) -> None:
        ctx.slots.set("x", ctx.slots["batch_cpu"])

    def train(ctx: TaskContext) -> None:
        steps.append(ctx.slots["x"])
        ctx.slots.set("step_result", ctx.slots["x"])

    return [Task.from_fn("load", load, lookahead=1, stream="io", writes=("x",)),
            Task.from_fn("train", train, reads=("x",), writes=("step_result",))]  # fmt: skip


async def test_leaving_results_early_trains_nothing_more_and_the_next_pass_starts() -> None:
    steps: list[int] = []
    loader = list(range(8))
    async with Pipeline(counting(steps)) as pipe:
        async for result in pipe.results(loader):
            if result == 2:
                break  # a step limit: three steps mean three steps
        assert steps == [0, 1, 2]
        assert [r async for r in pipe.results(loader)] == list(range(8))  # a new pass
        assert steps == [0, 1, 2, *range(8)]
        # batch 3 (loaded) and batch 4 (read ahead) were dropped untrained
        assert pipe.statistics().discarded == 2


def test_leaving_the_blocking_results_early_trains_nothing_more() -> None:
    steps: list[int] = []
    loader = list(range(8))
    with Pipeline(counting(steps)).blocking() as pipe:
        for result in pipe.results(loader):
            if result == 2:
                break
        assert list(pipe.results(loader)) == list(range(8))
        assert steps == [0, 1, 2, *range(8)]


async def test_an_iterator_left_early_and_passed_again_goes_on_with_its_batches() -> None:
    steps: list[int] = []
    batches = iter(range(8))
    async with Pipeline(counting(steps)) as pipe:
        async for result in pipe.results(batches):
            if result == 2:
                break
        assert [r async for r in pipe.results(batches)] == [3, 4, 5, 6, 7]  # none lost
        assert (steps, pipe.statistics().discarded) == (list(range(8)), 0)


NOT_WEAKLY_REFERENCED = {
    "iter(list)": lambda: iter(list(range(10))),
    "iter(tuple)": lambda: iter(tuple(range(10))),
    "map": lambda: map(int, range(10)),
    "islice": lambda: itertools.islice(range(100), 10),
}


@pytest.mark.parametrize("make", NOT_WEAKLY_REFERENCED.values(), ids=NOT_WEAKLY_REFERENCED)
@pytest.mark.parametrize("form", ["async", "blocking"])
def test_an_iterator_without_weak_references_left_early_counts_on_after_other_sources(
    make: Any, form: str
) -> None:
    source = make()
    with pytest.raises(TypeError):
        weakref.ref(source)  # the case this is about
    pipe = Pipeline([Task.from_fn("train", echo)])

    async def left_early_then_passed_again() -> list[Any]:
        async for result in pipe.results(source):
            if result == 2:
                break
        assert await pipe.step("other") == "other"  # discards 3, read ahead
        rest = [r async for r in pipe.results(source)]
        await pipe.aclose()
        return rest

    if form == "async":
        rest = asyncio.run(left_early_then_passed_again())
    else:
        blocking = pipe.blocking()
        for result in blocking.results(source):
            if result == 2:
                break
        assert blocking.step("other") == "other"
        rest = list(blocking.results(source))
        blocking.shutdown()
    assert rest == [4, 5, 6, 7, 8, 9]
    assert pipe.statistics().position == 10  # where a resumed run starts


async def test_a_manual_new_source_with_batches_in_flight_names_drain_and_reset() -> None:
    async with Pipeline(counting([])) as pipe:
        assert await pipe.progress(iter(range(4))) == 0
        with pytest.raises(PipelineStateError, match=r"drain\(\).*reset\(\)"):
            await pipe.progress(iter(range(4)))


async def test_reset_after_a_failure_keeps_the_item_read_ahead() -> None:
    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 1:
            raise RuntimeError("bad step")
        echo(ctx)

    source = iter(range(3))
    async with Pipeline([Task.from_fn("train", train)]) as pipe:
        assert await pipe.progress(source) == 0
        with pytest.raises(RuntimeError, match="bad step"):
            await pipe.progress(source)  # batch 2 was read ahead meanwhile; no task saw it
        pipe.reset()
        assert pipe.statistics().discarded == 1  # batch 1, whose step failed
        assert [r async for r in pipe.results(source)] == [2]


@pytest.mark.parametrize("read_ahead", [True, False])
async def test_after_reset_the_same_source_counts_on_past_the_batch_dropped(
    read_ahead: bool,
) -> None:  # fmt: skip
    # 0-3 applied, 4 fails and reset() drops it, 5 and 6 applied: a checkpoint at the
    # position resumes at 7 -- counted from 0 again, it resumed at 2 and trained 2
    # and 3 twice.
    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 4:
            raise RuntimeError("bad step")
        echo(ctx)

    source = iter(range(10))
    async with Pipeline([Task.from_fn("train", train)], read_ahead=read_ahead) as pipe:
        assert [await pipe.progress(source) for _ in range(4)] == [0, 1, 2, 3]
        with pytest.raises(RuntimeError, match="bad step"):
            await pipe.progress(source)
        pipe.reset()
        assert pipe.statistics().position == 4  # resumed here, 4 is trained again
        assert [await pipe.progress(source) for _ in range(2)] == [5, 6]
        await pipe.wait_idle()
        stats = pipe.statistics()
        assert (stats.position, stats.applied, stats.discarded) == (7, 6, 1)
    async with Pipeline([Task.from_fn("train", train)]) as resumed:
        assert [r async for r in resumed.results(iter(range(10)[stats.position:]))] == [7, 8, 9]


async def test_the_same_source_after_a_drain_counts_on_and_another_starts_afresh() -> None:
    def refuse_3(item: Any) -> None:
        if item == 3:
            raise BadBatchError("3 is refused")

    pipe = Pipeline([Task.from_fn("train", echo)], check_batch=refuse_3)
    source = iter(range(8))
    async with pipe:
        assert [await pipe.progress(source) for _ in range(2)] == [0, 1]
        assert await pipe.drain() == [2]  # the batch read ahead, finished
        after = pipe.statistics()
        assert (after.position, after.returned, after.in_flight) == (3, 3, 0)  # shown still
        with pytest.raises(BadBatchError):
            await pipe.progress(source)  # 3 is refused: the position counts it
        assert await pipe.progress(source) == 4
        stats = pipe.statistics()
        assert (stats.position, stats.returned, stats.refused) == (5, 4, 1)
        await pipe.drain()
        assert [r async for r in pipe.results(iter(range(2)))] == [0, 1]
        assert pipe.statistics().position == 2  # another source: afresh


@pytest.mark.parametrize("left", ["drain", "reset", "idle"])
async def test_a_source_passed_again_after_other_sources_counts_on(left: str) -> None:
    """Training left (drained, reset, or idle without read-ahead), a step() and an
    evaluation pass, then the training source again: its position counts on in that
    source (it restarted from 0, and a run resumed there trained its steps twice)."""
    pipe = Pipeline([Task.from_fn("train", echo)], read_ahead=left != "idle")
    source = iter(range(10))
    async with pipe:
        assert [await pipe.progress(source) for _ in range(3)] == [0, 1, 2]
        if left == "drain":
            assert await pipe.drain() == [3]  # the batch read ahead, finished
        elif left == "reset":
            pipe.reset()  # drops the batch read ahead, 3
        assert await pipe.step("other") == "other"
        assert [r async for r in pipe.results(iter(["a", "b"]))] == ["a", "b"]
        assert await pipe.progress(source) == (3 if left == "idle" else 4)
        assert pipe.statistics().position == (4 if left == "idle" else 5)
        if left != "idle":
            assert await pipe.drain() == [5]
        assert await pipe.step("other") == "other"  # step() sources are never remembered
        assert await pipe.progress(source) == (4 if left == "idle" else 6)
        assert pipe.statistics().position == (5 if left == "idle" else 7)


async def test_two_sources_taking_turns_each_count_on() -> None:
    """Training and a long validation stream, each drained in turn: each goes on where
    it stood (one remembered source: leaving one forgot the other's counts)."""
    pipe = Pipeline([Task.from_fn("train", echo)])
    train, validation = iter(range(100)), iter(range(1000, 1100))
    async with pipe:
        for round_no in range(3):
            assert [await pipe.progress(train) for _ in range(3)] == [
                4 * round_no + i for i in range(3)]  # fmt: skip
            await pipe.drain()  # the one read ahead
            assert pipe.statistics().position == 4 * (round_no + 1)
            assert len([await pipe.progress(validation) for _ in range(2)]) == 2
            await pipe.drain()
            assert pipe.statistics().position == 3 * (round_no + 1)


async def test_a_persistent_loaders_next_pass_starts_afresh_after_other_sources() -> None:
    """``iter(loader)`` with persistent workers returns the same iterator object, reset:
    a new pass, counted from 0, whatever came between (the loader's own count of the
    items it gave says so)."""
    import torch.utils.data

    loader = torch.utils.data.DataLoader(
        list(range(10)), batch_size=None, num_workers=1, persistent_workers=True
    )  # fmt: skip
    pipe = Pipeline([Task.from_fn("train", echo)])
    async with pipe:
        for _ in range(2):
            source = iter(loader)
            assert [int(await pipe.progress(source)) for _ in range(4)] == [0, 1, 2, 3]
            await pipe.drain()
            assert pipe.statistics().position == 5
            assert await pipe.step("evaluate") == "evaluate"
        assert iter(loader) is source  # the case this is about


async def test_a_results_loop_left_early_keeps_no_reference_to_its_batches() -> None:
    class Batch:
        pass

    batches = [Batch() for _ in range(6)]
    last = weakref.ref(batches[-1])
    pipe = Pipeline([Task.from_fn("train", echo)])
    async with pipe:
        async for _ in pipe.results(batches):
            break
        assert await pipe.step("other") == "other"  # the loop's batches are discarded
        del batches
        gc.collect()
        assert last() is None


async def test_an_iterator_whose_results_loop_was_left_counts_on_after_other_sources() -> None:
    """A results() loop over a generator left early, a step() (the loop's batches in
    flight are discarded), then the generator again: it counts on, past them."""

    def batches() -> Iterator[int]:
        yield from range(10)

    source = batches()
    pipe = Pipeline([Task.from_fn("train", echo)])
    async with pipe:
        async for result in pipe.results(source):
            if result == 2:
                break
        assert await pipe.step("other") == "other"  # discards 3, read ahead
        assert await pipe.progress(source) == 4
        assert pipe.statistics().position == 5


async def test_a_refusal_left_for_the_next_call_survives_reset_whatever_comes_next() -> None:
    # reset() discards batches in flight; a refusal of the source's is no batch, and
    # its next call raises it (counted once), before going on.
    for between in (False, True):
        pipe = Pipeline([Task.from_fn("train", echo)], check_batch=lambda item: item != 3)
        source = iter(range(8))
        async with pipe:
            assert await pipe.progress_many(source, 5) == [0, 1, 2]  # 3 refused, left
            pipe.reset()
            if between:
                assert await pipe.step("other") == "other"
            with pytest.raises(BadBatchError, match="after 3 taken"):  # of the source
                await pipe.progress(source)
            assert await pipe.progress(source) == 4
            assert pipe.statistics().refused == 1


async def test_a_refusal_progress_many_left_for_later_is_raised_on_its_own_source() -> None:
    """progress_many returns the steps before a refused item and leaves the refusal
    to the next call: a step() of another batch between runs its batch (it raised the
    old source's refusal, and its own batch was skipped), and the source's next call
    raises it."""
    pipe = Pipeline([Task.from_fn("train", echo)], check_batch=lambda item: item != 3)
    source = iter(range(6))
    async with pipe:
        assert await pipe.progress_many(source, 5) == [0, 1, 2]
        assert await pipe.step("eval") == "eval"
        with pytest.raises(BadBatchError, match="after 3 taken"):
            await pipe.progress(source)
        assert await pipe.progress_many(source, 5) == [4, 5]
        stats = pipe.statistics()
        assert (stats.position, stats.refused) == (6, 1)


async def test_a_source_error_read_ahead_is_no_batch_and_waits_for_its_source() -> None:
    """The source raises once while its next item is read ahead: that is no batch in
    flight (it was counted one: another source was refused, and then counted a
    discarded batch); a step() of another batch runs, and the error is raised by the
    source's next call, which then goes on with the item it had not given."""

    class Flaky:
        def __init__(self) -> None:
            self.items, self.raised = iter(range(4)), False

        def __iter__(self) -> Flaky:
            return self

        def __next__(self) -> int:
            if not self.raised and self.items.__length_hint__() == 3:  # before item 1
                self.raised = True
                raise OSError("transient")
            return next(self.items)

    pipe = Pipeline([Task.from_fn("train", echo)])
    source = Flaky()
    async with pipe:
        assert await pipe.progress(source) == 0
        assert pipe.statistics().in_flight == 0  # the error read ahead is no batch
        assert await pipe.step("other") == "other"
        with pytest.raises(OSError, match="transient"):
            await pipe.progress(source)
        assert [r async for r in pipe.results(source)] == [1, 2, 3]
        stats = pipe.statistics()
        assert (stats.position, stats.discarded) == (4, 0)


@pytest.mark.parametrize("read_ahead", [True, False])
async def test_a_source_whose_end_only_a_drain_saw_counts_on(read_ahead: bool) -> None:
    # Every item trained, then drain(): with the read-ahead on, the end was read ahead
    # and taken by the drain, but no call was handed it.  Passed again, the source
    # counts on either way: a checkpoint of the position there resumes at its end.
    async with Pipeline([Task.from_fn("train", echo)], read_ahead=read_ahead) as pipe:
        source = iter(range(5))
        assert [await pipe.progress(source) for _ in range(5)] == list(range(5))
        assert await pipe.drain() == []
        with pytest.raises(StopAsyncIteration):
            await pipe.progress(source)
        stats = pipe.statistics()
        assert (stats.position, stats.returned) == (5, 5)


async def test_an_iterator_passed_again_after_its_end_and_a_drain_counts_afresh() -> None:
    class Epochs:
        """One iterator object for every pass, reset by ``iter()`` (as a persistent
        DataLoader's is)."""

        def __init__(self) -> None:
            self.items: list[int] = []

        def __iter__(self) -> Epochs:
            self.items = [0, 1, 2]
            return self

        def __next__(self) -> int:
            if not self.items:
                raise StopIteration
            return self.items.pop(0)

    epochs = Epochs()
    async with Pipeline([Task.from_fn("train", echo)]) as pipe:
        for _ in range(2):
            assert [r async for r in pipe.results(iter(epochs))] == [0, 1, 2]
            await pipe.drain()
            assert pipe.statistics().position == 3  # each pass from 0


def test_one_asyncio_run_per_call_over_an_async_generator(caplog: pytest.LogCaptureFixture) -> None:
    # Each run closes the generator it iterated: the next call still returns the batch
    # read ahead, the one after says the generator was closed -- and a script ending
    # after the second call is not told "Task exception was never retrieved" (it was).
    async def items() -> AsyncIterator[int]:
        for item in range(5):
            await asyncio.sleep(0)
            yield item

    def two_calls() -> Pipeline:
        pipe = Pipeline([Task.from_fn("train", echo)], executor="sequential")
        assert asyncio.run(pipe.progress(source)) == 0
        assert asyncio.run(pipe.progress(source)) == 1
        return pipe

    source = items()
    pipe = two_calls()
    with pytest.raises(PipelineStateError, match="closed between two pulls"):
        asyncio.run(pipe.progress(source))
    assert asyncio.run(pipe.drain()) == []  # nothing in flight; nothing read on
    with pytest.raises(PipelineStateError, match="closed between two pulls"):
        asyncio.run(pipe.progress(source))  # passed again: said again, not an empty epoch
    source = items()
    two_calls()  # dropped, as at the end of a script, with the failed pull it holds
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_an_asyncio_run_that_returns_mid_pull_says_so_and_drains_nothing() -> None:
    # The pull of batch 1 is under way when the first run returns: asyncio.run cancels
    # it, and that closes the generator.  The next call says what closed it, with no
    # drain() to suggest (nothing is in flight); drain() reads no further; a new
    # source goes on.
    async def items() -> AsyncIterator[int]:
        yield 0
        await asyncio.Event().wait()  # batch 1 never comes on that loop
        yield 1

    pipe = Pipeline([Task.from_fn("train", echo)])
    source = items()
    assert asyncio.run(pipe.progress(source)) == 0
    with pytest.raises(PipelineStateError, match="shut down mid-pull") as raised:
        asyncio.run(pipe.progress(source))
    assert "drain()" not in str(raised.value) and "one event loop" in str(raised.value)
    assert pipe.statistics().in_flight == 0
    assert asyncio.run(pipe.drain()) == []
    with pytest.raises(PipelineStateError, match="shut down mid-pull"):
        asyncio.run(pipe.progress(source))  # passed again: said again, not an empty epoch
    assert asyncio.run(pipe.progress(iter([7]))) == 7
    pipe.shutdown()


def test_a_new_blocking_view_per_call_reads_on_where_the_last_one_left() -> None:
    # pipe.blocking() on every line: the pull of batch 1, begun by the first call, is
    # still under way when that call returns (its gate is shut), and the next call --
    # another view -- takes it on the same loop.
    gate = threading.Event()

    async def items() -> AsyncIterator[int]:
        yield 0
        await asyncio.to_thread(gate.wait, 30)
        yield 1

    pipe = Pipeline([Task.from_fn("train", echo)])
    source = items()
    assert pipe.blocking().progress(source) == 0
    gc.collect()  # the first view is gone
    gate.set()
    assert pipe.blocking().progress(source) == 1
    with pytest.raises(StopIteration):
        pipe.blocking().progress(source)
    pipe.blocking().shutdown()


class OwnPipeline:
    """A pipeline of the user's own: ``progress`` echoes its source's items, and its
    ``abandon_source`` takes no ``fresh``."""

    def __init__(self) -> None:
        self.abandoned: list[Any] = []

    async def progress(self, source: Iterator[Any]) -> Any:
        for item in source:
            return item
        raise StopAsyncIteration

    def abandon_source(self, source: Any) -> None:
        self.abandoned.append(source)


async def test_results_tells_a_pipeline_of_ones_own_it_was_left_without_fresh() -> None:
    from aiopipe.protocols import Results

    own = OwnPipeline()
    batches = iter(range(5))
    for source in ([0, 1, 2], batches):  # made by results(), and the caller's own
        async for _ in Results(own, source):
            break
    assert len(own.abandoned) == 2 and own.abandoned[1] is batches


@pytest.mark.parametrize("options", [{}, {"executor": "sequential"}], ids=["lanes", "sequential"])
async def test_an_item_refused_ahead_and_left_counts_as_refused_not_discarded(
    options: dict[str, Any]
) -> None:
    source = (x for x in range(6))
    async with Pipeline([Task.from_fn("train", echo)], check_batch=lambda b: b != 2,
                        **options) as pipe:  # fmt: skip
        async for result in pipe.results(source):
            if result == 1:
                break  # item 2 is read ahead, and refused
        await pipe.wait_idle()
        ahead = pipe.statistics()
        assert (ahead.read_ahead, ahead.read_ahead_refused) == (1, 1)
        assert await pipe.step("other") == "other"
        assert pipe.statistics().discarded == 0  # no batch was dropped untrained
        assert [r async for r in pipe.results(source)] == [3, 4, 5]
        assert (pipe.statistics().refused, pipe.statistics().position) == (1, 6)


@pytest.mark.parametrize("kind", ["refused", "source error"])
async def test_an_error_progress_many_left_for_the_next_call_survives_reset(kind: str) -> None:
    # progress_many returns the steps before the error and leaves it for the next
    # call on the source; reset() (nothing in flight) does not drop it.
    def failing() -> Iterator[Any]:
        yield 0
        yield 1
        raise OSError("disk read failed")

    source = iter([0, 1, "bad", 3]) if kind == "refused" else failing()
    expected = BadBatchError if kind == "refused" else OSError
    async with Pipeline([Task.from_fn("train", echo)], check_batch=lambda b: b != "bad") as pipe:
        assert await pipe.progress_many(source, 5) == [0, 1]
        pipe.reset()
        with pytest.raises(expected):
            await pipe.progress_many(source, 5)
        assert [r async for r in pipe.results(source)] == ([3] if kind == "refused" else [])


async def test_drain_after_reset_finishes_the_item_reset_kept_before_another_source() -> None:
    trained: list[Any] = []
    source = iter(range(5))
    async with Pipeline([recording(trained)]) as pipe:
        assert await pipe.progress(source) == 0  # item 1 is read ahead
        await pipe.wait_idle()
        pipe.reset()  # keeps item 1 for the same source
        assert await pipe.drain() == [1]  # finished, not left for the next source to drop
        assert [r async for r in pipe.results(iter(["a"]))] == ["a"]
        assert pipe.statistics().discarded == 0
        assert [r async for r in pipe.results(source)] == [2, 3, 4]
    assert trained == [0, 1, "a", 2, 3, 4]


async def test_drain_after_reset_waits_for_an_async_generator_s_fetch_under_way() -> None:
    reading, gate = asyncio.Event(), asyncio.Event()

    async def items() -> AsyncIterator[int]:
        yield 0
        reading.set()
        await gate.wait()
        for item in range(1, 4):
            yield item

    source = items()
    async with Pipeline([Task.from_fn("train", echo)]) as pipe:
        assert await pipe.progress(source) == 0
        await reading.wait()  # item 1's fetch is under way
        pipe.reset()
        drain = asyncio.ensure_future(pipe.drain())
        await asyncio.sleep(0)
        assert not drain.done()  # it waits for the fetch, which it does not cancel
        gate.set()
        assert await drain == [1]
        assert [r async for r in pipe.results(iter(["a"]))] == ["a"]
        assert [r async for r in pipe.results(source)] == [2, 3]  # not closed


@pytest.mark.parametrize("pause", ["drain()", "reset()", "reset(), another source"])
async def test_a_source_that_goes_on_keeps_its_batch_indices(pause: str) -> None:
    # ctx.batch_index (and a task failure's note) is the batch's index in its source,
    # also when the source goes on after drain() or reset() (the batch read ahead
    # and dropped by another source keeps its index: the next one is not renumbered).
    seen: list[tuple[Any, int]] = []

    def train(ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        seen.append((batch, ctx.batch_index))
        if batch == 5:
            raise ValueError("bad step")
        echo(ctx)

    source = iter(range(6))
    async with Pipeline([Task.from_fn("train", train)]) as pipe:
        assert await pipe.progress_many(source, 3) == [0, 1, 2]
        if pause == "drain()":
            assert await pipe.drain() == [3]  # the batch read ahead
        else:
            await pipe.wait_idle()
            pipe.reset()  # keeps item 3, read ahead
            if pause == "reset(), another source":
                assert await pipe.step("other") == "other"  # drops item 3
                seen.remove(("other", 0))
        with pytest.raises(ValueError, match="bad step") as failure:
            while await pipe.progress_many(source, 5):
                pass
        assert any("on batch 5 of the source" in note for note in failure.value.__notes__)
        pipe.reset()
    dropped = {3} if pause == "reset(), another source" else set()
    assert seen == [(batch, batch) for batch in range(6) if batch not in dropped]


async def test_drain_after_reset_trains_nothing_more_of_a_results_loop_left_early() -> None:
    trained: list[Any] = []
    source = iter(range(5))
    async with Pipeline([recording(trained)]) as pipe:
        async for _ in pipe.results(source):
            break  # N results, N steps: item 1 is read ahead only
        await pipe.wait_idle()
        pipe.reset()
        assert await pipe.drain() == []
        assert trained == [0]
        assert [r async for r in pipe.results(source)] == [1, 2, 3, 4]  # passed again


async def test_drain_after_reset_leaves_a_seeded_batch_to_the_next_source() -> None:
    trained: list[Any] = []
    source = iter(range(5))
    async with Pipeline([recording(trained)]) as pipe:
        assert await pipe.progress(source) == 0
        await pipe.wait_idle()
        pipe.reset()
        pipe.seed_first_batch({"batch_cpu": "seed"})  # for the next source, not this one
        assert await pipe.drain() == []
        assert [r async for r in pipe.results(iter(["a"]))] == ["seed", "a"]
    assert trained == [0, "seed", "a"]
