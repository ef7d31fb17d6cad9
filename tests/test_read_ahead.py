"""``read_ahead=N``: an async source read up to N batches ahead, its pulls one after
the other.  Each interleaving is forced with events: the source says when it starts
fetching an item, and a task body holds its step until it has seen what it checks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from aiopipe import (
    ConfigurationError, ConfigurationTypeError, Pipeline, PipelineStateError, Task, TaskContext,
)  # fmt: skip
from aiopipe.source import Feed

from gated_source import GatedSource


class Source:
    """An async generator of ``n`` items that says when it starts fetching each."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.started = [threading.Event() for _ in range(n)]
        self.fetched: list[int] = []

    async def items(self) -> AsyncIterator[int]:
        for k in range(self.n):
            self.started[k].set()
            await asyncio.sleep(0)  # the fetch awaits something, as a real one would
            self.fetched.append(k)
            yield k


def echo(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])


async def test_a_slow_source_is_fetched_n_ahead_and_no_further() -> None:
    source = Source(8)
    seen: dict[int, tuple[bool, bool]] = {}

    def train(ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        if batch == 1:
            # Step 1 runs: batches 2 and 3 are read ahead (two), batch 4 is not started
            # until a batch is taken into the ring, which waits for this step.
            seen[batch] = (source.started[3].wait(10), source.started[4].is_set())
        echo(ctx)

    async with Pipeline([Task.from_fn("train", train)], read_ahead=2) as pipe:
        assert [r async for r in pipe.results(source.items())] == list(range(8))
    assert seen == {1: (True, False)}
    assert source.fetched == list(range(8))  # each item read once, in order


async def test_with_one_ahead_the_next_fetch_waits_for_the_ring() -> None:
    source = Source(5)
    seen: list[bool] = []

    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 1:
            # the default, one ahead: batch 2 is being read; batch 3 waits
            seen.append(source.started[2].wait(10) and not source.started[3].is_set())
        echo(ctx)

    async with Pipeline([Task.from_fn("train", train)]) as pipe:
        assert [r async for r in pipe.results(source.items())] == list(range(5))
    assert seen == [True]


async def test_reset_keeps_every_batch_read_ahead_in_order() -> None:
    source = Source(7)
    items = source.items()
    async with Pipeline([Task.from_fn("train", echo)], read_ahead=3) as pipe:
        assert await pipe.progress(items) == 0
        # batch 1 is read ahead at once; the pulls after it follow
        assert await asyncio.get_running_loop().run_in_executor(None, source.started[3].wait, 10)
        pipe.reset()  # nothing is in the ring: every batch read ahead is kept
        assert [r async for r in pipe.results(items)] == list(range(1, 7))
        assert pipe.statistics().discarded == 0
    assert source.fetched == list(range(7))


async def test_drain_finishes_the_batches_read_ahead_and_reads_no_more() -> None:
    source = Source(9)
    items = source.items()
    async with Pipeline([Task.from_fn("train", echo)], read_ahead=3) as pipe:
        assert await pipe.progress(items) == 0
        await asyncio.get_running_loop().run_in_executor(None, source.started[3].wait, 10)
        drained = await pipe.drain()
        # batches 1-3 had been read (or were being read): drained; nothing after
        assert drained == [1, 2, 3]
        assert source.fetched == [0, 1, 2, 3]
        # the source itself goes on where it stands
        assert [r async for r in pipe.results(items)] == list(range(4, 9))


async def test_an_error_of_the_source_ahead_comes_in_its_place() -> None:
    async def items() -> AsyncIterator[int]:
        yield 0
        yield 1
        raise OSError("the feature store went away")

    async with Pipeline([Task.from_fn("train", echo)], read_ahead=4) as pipe:
        source = items()
        assert [await pipe.progress(source), await pipe.progress(source)] == [0, 1]
        with pytest.raises(OSError, match="went away"):
            await pipe.progress(source)


@pytest.mark.parametrize("bad", [-1, -5])
def test_a_negative_depth_is_refused(bad: int) -> None:
    with pytest.raises(ConfigurationError, match="read_ahead must be >= 0"):
        Pipeline([Task.from_fn("train", echo)], read_ahead=bad)


@pytest.mark.parametrize("bad", ["2", 2.0, None])
def test_a_depth_of_another_type_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationTypeError, match="read_ahead takes True, False or a number"):
        Pipeline([Task.from_fn("train", echo)], read_ahead=bad)


async def test_a_pull_a_caller_waits_for_starts_the_next_before_the_caller_wakes() -> None:
    # One ahead, the source slower than the step: once a batch the pipeline waits for
    # has been read, the next fetch starts at once -- before that batch is placed in
    # the ring and its iteration started, not after.
    pipe = Pipeline([Task.from_fn("train", echo)])
    source = GatedSource(4, pipe)
    source.open(0)
    async with pipe:
        assert await pipe.progress(source.items) == 0  # batch 1's fetch waits at its gate
        second = asyncio.create_task(pipe.progress(source.items))
        await asyncio.sleep(0)  # the call now waits for batch 1
        source.open(1)
        assert await second == 1
        source.open(2, 3)
        assert [r async for r in pipe.results(source.items)] == [2, 3]
    # each fetch started while the batch before it was still to be placed: the caller
    # was waiting for that one
    assert (source.placed_when_fetching[1], source.placed_when_fetching[2]) == (0, 1)


async def test_a_call_cancelled_once_its_batch_is_read_and_the_next_fetch_started() -> None:
    # The pull a cancelled caller waited for has read its batch and started the next
    # fetch: both stay in flight; the next calls deliver every batch once, in order.
    source = GatedSource(5)
    source.open(0)
    async with Pipeline([Task.from_fn("train", echo)]) as pipe:
        assert await pipe.progress(source.items) == 0
        waiting = asyncio.create_task(pipe.progress(source.items))
        await source.started[1].wait()
        source.open(1)
        await source.started[2].wait()  # batch 1 read; its pull started batch 2's fetch
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert pipe.statistics().in_flight == 2  # batch 1 and the fetch of batch 2
        source.open(2, 3, 4)
        assert [r async for r in pipe.results(source.items)] == [1, 2, 3, 4]
        assert pipe.statistics().discarded == 0


async def test_after_reset_the_pull_handed_over_reads_on_for_the_new_call() -> None:
    # reset() keeps the pull under way for the same source; the call that then waits
    # for its batch still has the next fetch started before that batch is placed.
    pipe = Pipeline([Task.from_fn("train", echo)])
    source = GatedSource(4, pipe)
    source.open(0)
    async with pipe:
        assert await pipe.progress(source.items) == 0  # batch 1's fetch waits at its gate
        await pipe.wait_idle()
        pipe.reset()  # nothing in the ring: the pull under way is kept
        waiting = asyncio.create_task(pipe.progress(source.items))
        await asyncio.sleep(0)  # the call now waits for batch 1
        source.open(1)
        assert await waiting == 1
        source.open(2, 3)
        assert [r async for r in pipe.results(source.items)] == [2, 3]
    # (counted on from before the reset: batch 0 placed, batch 1 not yet)
    assert source.placed_when_fetching[2] == 1


@pytest.mark.skipif(not hasattr(asyncio, "eager_task_factory"), reason="Python >= 3.12")
async def test_an_eager_task_factory_still_reads_n_ahead() -> None:
    # Under an eager task factory a pull whose item is at hand ends inside its own
    # start: reading goes on from there, to N ahead, as with lazily started tasks.
    loop = asyncio.get_running_loop()
    loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined]
    started: list[int] = []
    gate = asyncio.Event()

    async def items() -> AsyncIterator[int]:
        for k in range(6):
            started.append(k)
            if k >= 3:
                await gate.wait()  # 0-2 at hand (a buffered queue), the rest slow
            yield k

    feed = Feed(items(), read_ahead=3)
    try:
        assert await feed.take() == (0, None)
        feed.read_ahead()  # as the pipeline does while a step runs
        assert started == [0, 1, 2, 3] and feed.held_ahead == 3
        gate.set()
        assert [(await feed.take())[0] for _ in range(5)] == [1, 2, 3, 4, 5]
    finally:
        feed.close()
        loop.set_task_factory(None)


@pytest.mark.parametrize("leave", ["reset()", "results() left early"])
async def test_a_generator_closed_by_a_source_switch_is_refused_not_silently_empty(
    leave: str,
) -> None:
    # Another source replaces an async generator whose next fetch is under way:
    # cancelling that fetch finishes the generator.  Passed again, to this pipeline or
    # another, it is refused with the reason, instead of ending at once as if it had
    # run dry.
    source = GatedSource(4)
    source.open(0)
    async with Pipeline([Task.from_fn("train", echo)]) as pipe:
        if leave == "reset()":
            assert await pipe.progress(source.items) == 0
            await pipe.wait_idle()
            pipe.reset()
        else:
            async for result in pipe.results(source.items):
                assert result == 0
                break
        await source.started[1].wait()  # batch 1's fetch is under way
        assert [r async for r in pipe.results(iter([10, 11]))] == [10, 11]
        assert source.items.ag_frame is None  # the cancelled fetch closed it
        why = "closed by aiopipe.*another source replaced it.*being read"
        with pytest.raises(PipelineStateError, match=why):
            await pipe.progress(source.items)
        async with Pipeline([Task.from_fn("train", echo)]) as other:
            with pytest.raises(PipelineStateError, match=why):
                await other.progress(source.items)
        fresh = GatedSource(2)
        fresh.open(0, 1)
        assert [r async for r in pipe.results(fresh.items)] == [0, 1]  # a new one runs


@pytest.mark.parametrize("fetched", [False, True])
async def test_a_switch_counts_as_discarded_only_an_item_the_source_gave(fetched: bool) -> None:
    # reset(), then another source: the old one's read-ahead is dropped.  An item its
    # generator yielded is a batch lost untrained; a fetch still under way (cancelled
    # by the switch) never gave one, and statistics() must not say it was discarded.
    source = GatedSource(4)
    source.open(0)
    async with Pipeline([Task.from_fn("train", echo)]) as pipe:
        assert await pipe.progress(source.items) == 0  # batch 1's fetch is under way
        await source.started[1].wait()
        if fetched:
            source.open(1)
            await pipe.wait_idle()
            await asyncio.sleep(0)  # the fetch's task returns its item (no gate left)
        pipe.reset()
        assert [r async for r in pipe.results(iter([10]))] == [10]
        assert pipe.statistics().discarded == int(fetched)


@pytest.mark.parametrize("read_ahead", [True, False])
def test_an_async_generator_its_loop_closed_between_calls_is_refused_not_ended(
    read_ahead: bool,
) -> None:
    # One asyncio.run per progress(): each run closes, as it returns, the async
    # generators its loop iterated.  The next call says so, instead of ending the
    # epoch after the first batch or two as if the source had run dry.
    async def items() -> AsyncIterator[int]:
        for k in range(6):
            await asyncio.sleep(0)
            yield k

    pipe = Pipeline([Task.from_fn("train", echo)], read_ahead=read_ahead)
    source, results = items(), []
    try:
        with pytest.raises(PipelineStateError, match="closed"):
            while True:
                results.append(asyncio.run(pipe.progress(source)))
        assert results == list(range(len(results))) and len(results) <= 2
        with pytest.raises(PipelineStateError, match="closed"):  # and on every call after
            asyncio.run(pipe.progress(source))
    finally:
        pipe.shutdown()


class Wrapper:
    """An adapter's wrapper around an async iterator, naming it in ``aiopipe_wraps``."""

    def __init__(self, source: AsyncIterator[int]) -> None:
        self.aiopipe_wraps = source

    def __aiter__(self) -> Wrapper:
        return self

    async def __anext__(self) -> int:
        return await anext(self.aiopipe_wraps)


async def test_a_generator_closed_under_a_wrapper_is_refused_not_silently_empty() -> None:
    source = GatedSource(4)
    source.open(0)
    wrapper = Wrapper(source.items)
    async with Pipeline([Task.from_fn("train", echo)]) as pipe:
        async for result in pipe.results(wrapper):
            break
        await source.started[1].wait()
        assert [r async for r in pipe.results(iter([10]))] == [10]
        assert source.items.ag_frame is None  # the cancelled fetch closed it
        with pytest.raises(PipelineStateError, match="closed by aiopipe"):
            await pipe.progress(wrapper)
        with pytest.raises(PipelineStateError, match="closed by aiopipe"):
            await pipe.progress(Wrapper(source.items))  # another wrapper of it too


class GatedWrapper(Wrapper):
    """A wrapper whose ``__anext__`` waits for ``gate`` before it reads its source, from
    its second item on (as an adapter's agreement across ranks does)."""

    def __init__(self, source: AsyncIterator[int]) -> None:
        super().__init__(source)
        self.gate, self.waiting = asyncio.Event(), asyncio.Event()
        self.reads = 0

    async def __anext__(self) -> int:
        self.reads += 1
        if self.reads > 1 and not self.gate.is_set():
            self.waiting.set()
            await self.gate.wait()
        return await super().__anext__()


async def test_a_wrapper_cancelled_outside_its_generator_leaves_the_generator_readable() -> None:
    source = GatedSource(4)
    source.open(0, 1, 2, 3)
    wrapper = GatedWrapper(source.items)
    async with Pipeline([Task.from_fn("train", echo)]) as pipe:
        async for _ in pipe.results(wrapper):
            break
        await asyncio.wait_for(wrapper.waiting.wait(), 10)  # item 1's read waits in it
        assert [r async for r in pipe.results(iter([10]))] == [10]  # cancels that read
        assert source.items.ag_frame is not None  # the generator was never reached
        wrapper.gate.set()
        assert [r async for r in pipe.results(wrapper)] == [1, 2, 3]  # not refused
        assert source.items.ag_frame is None  # ended as generators end
        assert [r async for r in pipe.results(wrapper)] == []  # a new pass: not refused
