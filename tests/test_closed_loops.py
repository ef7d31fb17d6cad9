"""A call left waiting on an event loop that was stopped and closed by hand (not
cancelled first): it can never resume.  The next call, on another loop, takes over
from where it stopped -- nothing lost or repeated, nothing warned about later when
the dead call is collected."""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest

import aiopipe.driver
from aiopipe import Pipeline, PipelineStateError, Task, TaskContext, fetch_ahead

EXECUTORS = {"lanes": {}, "sequential": {"executor": "sequential"},
             "loop": {"thread_map": {"train": "loop"}}}  # fmt: skip


def echo(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])


def gated(steps: list[int], gate_at: int, started: threading.Event,
          release: threading.Event) -> Task:  # fmt: skip
    """``train`` records its batch; at batch ``gate_at`` it waits for ``release``."""

    def train(ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        if batch == gate_at and not release.is_set():
            started.set()
            assert release.wait(10)
        steps.append(batch)
        ctx.slots.set("step_result", batch)

    return Task.from_fn("train", train, writes=("step_result",))


def recording_train(
    steps: list[int], started: threading.Event | None = None,
    release: threading.Event | None = None,
) -> Callable[[TaskContext], None]:  # fmt: skip
    """``train``: records its batch and returns it as the step's result; given the
    events, it holds batch 2 (the first time) until ``release`` is set."""

    def train(ctx: TaskContext) -> None:
        batch = ctx.slots["batch"]
        if started is not None and release is not None and batch == 2 and not release.is_set():
            started.set()
            assert release.wait(10)
        steps.append(batch)
        ctx.slots.set("step_result", batch)

    return train


def fetch_and_train(
    fetch: Callable[[TaskContext], Awaitable[None]], train: Callable[[TaskContext], None]
) -> Pipeline:
    """An ``async def`` fetch one batch ahead on stream "io" (the head of its lane's
    chain), then ``train`` on the default lane."""
    return Pipeline(
        [Task.from_fn("fetch", fetch, lookahead=1, stream="io", writes=("batch",)),
         Task.from_fn("train", train, reads=("batch",), writes=("step_result",))],
    )  # fmt: skip


def stop_when(
    call: Callable[[], Coroutine[Any, Any, Any]], ready: Callable[[list[Any]], bool]
) -> list[Any]:
    """Run ``call`` as a task on a loop of its own; stop and close that loop as soon
    as ``ready(returned)`` holds, checked once a loop cycle from the first (after the
    task's first step), without cancelling anything.  What ``call`` returned, if it
    did before."""
    loop, returned = asyncio.new_event_loop(), []

    async def run() -> None:
        returned.append(await call())

    def check() -> None:
        if ready(returned):
            loop.stop()
        else:
            loop.call_soon(check)

    task = loop.create_task(run())
    task._log_destroy_pending = False  # type: ignore[attr-defined]  # left so on purpose
    loop.call_soon(check)
    loop.run_forever()
    loop.close()
    return returned


def the_rest(pipe: Pipeline, source: Any) -> list[Any]:
    async def rest() -> list[Any]:
        async with pipe:
            return [result async for result in pipe.results(source)]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "coroutine ... was never awaited"
        results = asyncio.run(rest())
        gc.collect()  # the dead call and what it held: collected quietly
    return results


@pytest.mark.parametrize(
    ("executor", "when"),
    [*((executor, "at once") for executor in EXECUTORS), ("lanes", "mid-step")],
)
def test_a_progress_left_on_a_closed_loop_lets_the_next_loop_go_on(
    executor: str, when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if executor != "lanes":  # steps run inline: each call yields first, before it takes anything
        monkeypatch.setattr(aiopipe.driver, "INLINE_YIELD_S", 0.0)
    steps: list[int] = []
    started, release = threading.Event(), threading.Event()
    pipe = Pipeline([gated(steps, 1, started, release)], **EXECUTORS[executor])
    source = iter(range(5))
    assert stop_when(lambda: pipe.progress(source), bool) == [0]
    # "at once": right after the call started batch 1's iteration (on the loop, as a
    # task not yet run), or, for steps run inline (every task on the loop's thread),
    # where the call yields before it runs the step; "mid-step": while its body runs.
    stopped = (lambda _: True) if when == "at once" else (lambda _: started.is_set())
    assert stop_when(lambda: pipe.progress(source), stopped) == []
    release.set()
    assert the_rest(pipe, source) == [1, 2, 3, 4]
    assert steps == [0, 1, 2, 3, 4]  # each step once


@pytest.mark.parametrize("executor", ["sequential", "loop"])
def test_a_body_left_mid_await_on_a_closed_loop_asks_for_reset(executor: str) -> None:
    """A body that had begun on the closed loop can never end: the next call says
    so (before, it was refused as "already running" until the dead call was
    collected); reset() then starts afresh."""
    entered = threading.Event()

    async def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 1 and not entered.is_set():
            entered.set()
            await asyncio.Event().wait()  # never set: its loop is closed under it
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    task = Task.from_fn("train", train, writes=("step_result",))
    pipe, source = Pipeline([task], **EXECUTORS[executor]), iter(range(4))
    assert stop_when(lambda: pipe.progress(source), bool) == [0]
    assert stop_when(lambda: pipe.progress(source), lambda _: entered.is_set()) == []

    async def again() -> list[Any]:
        async with pipe:
            with pytest.raises(PipelineStateError, match=r"closed.*reset\(\)"):
                await pipe.progress(source)
            pipe.reset()
            return [result async for result in pipe.results(iter(range(3)))]

    assert asyncio.run(again()) == [0, 1, 2]


@pytest.mark.parametrize("executor", ["lanes"])
def test_a_progress_many_left_on_a_closed_loop_gives_its_results_back(executor: str) -> None:
    steps: list[int] = []
    started, release = threading.Event(), threading.Event()
    pipe = Pipeline([gated(steps, 2, started, release)], **EXECUTORS[executor])
    source = iter(range(5))
    assert stop_when(lambda: pipe.progress_many(source, 4), lambda _: started.is_set()) == []
    release.set()
    assert the_rest(pipe, source) == [0, 1, 2, 3, 4]  # 0 and 1 were collected, not lost
    assert steps == [0, 1, 2, 3, 4]


def test_inits_left_on_a_closed_loop_run_on_the_next_one() -> None:
    inits: list[str] = []
    entered = threading.Event()

    async def init(ctx: TaskContext) -> None:
        inits.append("began")
        entered.set()
        await asyncio.sleep(0)  # the loop stops before this step ends
        inits.append("ended")

    task = Task.from_fn("train", lambda ctx: ctx.slots.set("step_result", ctx.slots["batch_cpu"]),
                        init=init, writes=("step_result",))  # fmt: skip
    pipe, source = Pipeline([task]), iter(range(3))
    assert stop_when(lambda: pipe.progress(source), lambda _: entered.is_set()) == []
    assert inits == ["began"]
    assert the_rest(pipe, source) == [0, 1, 2]
    assert inits == ["began", "began", "ended"]  # started over, ended once


def test_a_busy_call_on_a_live_loop_is_still_refused() -> None:
    started, release = threading.Event(), threading.Event()
    pipe, source = Pipeline([gated([], 0, started, release)]), iter(range(3))

    async def two_calls() -> str:
        first = asyncio.ensure_future(pipe.progress(source))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        try:
            await pipe.progress(source)
        except Exception as exc:  # noqa: BLE001 - the refusal is the point
            return str(exc)
        finally:
            release.set()
            await first
        return "not refused"

    assert "already running" in asyncio.run(two_calls())
    pipe.shutdown()


def test_chained_steps_with_an_async_fetch_left_on_a_closed_loop_go_on() -> None:
    """``progress_many`` with a fetch the loop starts for each step, the step after
    the running one queued: the loop stopped and closed mid-step leaves nothing that
    waits for it; the next loop goes on."""
    steps: list[int] = []
    started, release = threading.Event(), threading.Event()

    async def fetch(ctx: TaskContext) -> None:
        await asyncio.sleep(0)
        ctx.slots.set("batch", ctx.slots["batch_cpu"])

    pipe = fetch_and_train(fetch, recording_train(steps, started, release))
    source = iter(range(6))
    assert stop_when(lambda: pipe.progress_many(source, 6), lambda _: started.is_set()) == []
    release.set()

    async def rest() -> list[Any]:
        async with pipe:
            try:
                return [result async for result in pipe.results(source)]
            except PipelineStateError:  # the step on the closed loop cannot end: reset()
                pipe.reset()
                return [result async for result in pipe.results(iter(range(2)))]

    results = asyncio.run(asyncio.wait_for(rest(), 20))
    if results == [0, 1]:  # reset: a fresh source after the steps that ran
        assert steps == [0, 1, 2, 0, 1]  # the step queued behind batch 2's never ran
    else:
        assert results == [0, 1, 2, 3, 4, 5] and steps == results


@pytest.mark.parametrize("then", ["go on", "reset"])
def test_a_queued_step_whose_fetch_the_closed_loop_never_started_is_taken_back(then: str) -> None:
    """The step queued behind batch 2's waits for its ``async def`` fetch, which the
    loop was to start once batch 2's step ended; the loop closed first, and the lanes
    ended batch 2's step before any other loop ran.  The queued step is taken back
    (its batch runs again), not left holding its lane: the next loop goes on with
    every step, or, reset, runs new steps (it hung before)."""
    steps: list[int] = []
    started, release = threading.Event(), threading.Event()

    async def fetch(ctx: TaskContext) -> None:  # ends in its first step
        ctx.slots.set("batch", ctx.slots["batch_cpu"])

    pipe = fetch_and_train(fetch, recording_train(steps, started, release))
    source = iter(range(6))
    assert stop_when(lambda: pipe.progress_many(source, 6), lambda _: started.is_set()) == []
    handle = pipe._driver.handle  # batch 2's step, with the next one queued behind it
    assert handle is not None and pipe._driver._chain.queued is not None
    release.set()
    assert handle.wait(10)  # the lanes end it, and the queued step's gate opens
    if then == "reset":
        pipe.reset()
        source = iter(range(10, 12))

    async def rest() -> list[Any]:
        async with pipe:
            return [result async for result in pipe.results(source)]

    results = asyncio.run(asyncio.wait_for(rest(), 20))
    if then == "reset":
        assert results == [10, 11] and steps == [0, 1, 2, 10, 11]
    else:
        assert results == [0, 1, 2, 3, 4, 5] and steps == results


class ItemsWaitingOnce:
    """Items 0..n-1 of an async iterator (a class, not a generator); the first pull
    of item 1 waits for an event nobody sets, and ``pulling`` says it does."""

    def __init__(self, n: int) -> None:
        self.n, self.next_item, self.pulling = n, 0, threading.Event()

    def __aiter__(self) -> ItemsWaitingOnce:
        return self

    async def __anext__(self) -> int:
        item = self.next_item
        if item == self.n:
            raise StopAsyncIteration
        if item == 1 and not self.pulling.is_set():
            self.pulling.set()
            await asyncio.Event().wait()  # its loop is stopped and closed meanwhile
        self.next_item += 1
        return item


def test_a_pull_left_on_a_closed_loop_is_pulled_again_by_the_next() -> None:
    """The read-ahead of item 1 waits when the loop is stopped and closed: nothing
    can end that pull.  The next loop closes it and pulls again (every later call
    raised a bare RuntimeError before, and reset() and shutdown() too)."""
    source = ItemsWaitingOnce(4)
    pipe = Pipeline([Task.from_fn("train", echo)])
    ready = lambda returned: bool(returned) and source.pulling.is_set()  # noqa: E731
    assert stop_when(lambda: pipe.progress(source), ready) == [0]
    assert the_rest(pipe, source) == [1, 2, 3]


def test_an_async_generator_whose_pull_a_closed_loop_left_is_said_lost() -> None:
    """The same for an async generator: closing the pull finishes the generator (its
    ``finally`` runs now), so the next call says its items cannot be read;
    ``reset()`` and another source go on, and ``shutdown()`` works."""
    pulling, closed = threading.Event(), []

    async def items() -> AsyncIterator[int]:
        try:
            for item in range(4):
                if item == 1:
                    pulling.set()
                    await asyncio.Event().wait()  # its loop is stopped and closed meanwhile
                yield item
        finally:
            closed.append(True)

    source = items()
    pipe = Pipeline([Task.from_fn("train", echo)])
    ready = lambda returned: bool(returned) and pulling.is_set()  # noqa: E731
    assert stop_when(lambda: pipe.progress(source), ready) == [0]

    async def again() -> list[Any]:
        with pytest.raises(PipelineStateError, match="stopped and closed.*cannot be read"):
            await pipe.progress(source)
        assert closed == [True]
        with pytest.raises(PipelineStateError, match="cannot be read"):
            await pipe.progress(source)  # and so on, until another source
        pipe.reset()
        return [result async for result in pipe.results(iter(range(2)))]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert asyncio.run(again()) == [0, 1]
        pipe.shutdown()
        gc.collect()


def test_fetches_left_on_a_closed_loop_are_closed_and_fetched_again(
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """``fetch_ahead``'s fetch of key 1 waits when the loop is stopped and closed: the
    next loop closes it (its ``finally`` runs then, not at collection with asyncio's
    "Task was destroyed but it is pending!") and fetches the key again."""
    waiting, ended = threading.Event(), []

    async def fetch(key: int) -> int:
        try:
            if key == 1 and not waiting.is_set():
                waiting.set()
                await asyncio.Event().wait()  # its loop is stopped and closed meanwhile
            return key
        finally:
            ended.append(key)

    source = fetch_ahead(range(4), fetch, in_flight=2)
    pipe = Pipeline([Task.from_fn("train", echo)])
    ready = lambda returned: bool(returned) and waiting.is_set()  # noqa: E731
    assert stop_when(lambda: pipe.progress(source), ready) == [0]
    assert the_rest(pipe, source) == [1, 2, 3]
    assert sorted(ended) == [0, 1, 1, 2, 3]  # key 1's first fetch closed, then fetched again
    assert "destroyed but it is pending" not in caplog.text


def test_a_step_whose_async_fetch_the_closed_loop_never_began_starts_again() -> None:
    """The loop is stopped and closed right after the call handed batch 1's step to
    the lanes, before its ``async def`` fetch (a head of lane "io") took a step: the
    other lane waits for that fetch, so nothing of the step ran, and the next loop
    starts it again (it asked for reset() before, as for a fetch left mid-await)."""
    began: list[int] = []
    steps: list[int] = []

    async def fetch(ctx: TaskContext) -> None:
        began.append(ctx.slots["batch_cpu"])
        ctx.slots.set("batch", ctx.slots["batch_cpu"])

    pipe = fetch_and_train(fetch, recording_train(steps))
    source = iter(range(5))
    assert stop_when(lambda: pipe.progress(source), bool) == [0]
    assert stop_when(lambda: pipe.progress(source), lambda _: True) == []
    assert began == [0, 1]  # batch 2's fetch had not begun
    assert the_rest(pipe, source) == [1, 2, 3, 4]
    assert steps == [0, 1, 2, 3, 4] and began == [0, 1, 2, 3, 4]  # each once
