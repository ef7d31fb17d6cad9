"""``fetch_ahead``: batches in key order whatever order the fetches finish in, at most
N fetches started and not handed out, a failing fetch named by key and position,
nothing lost or fetched twice when a caller is cancelled, nothing left running when
the source is closed or dropped.  Every interleaving is forced with gates held by the
fake fetch (or, for the sweep over a call's await points, by counting yields of the
single-threaded loop), never by waiting for time to pass."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator
from typing import Any

import pytest
from conftest import cancelled

from aiopipe import (
    AsyncLibraryError, BadBatchError, ConfigurationError, ConfigurationTypeError, FetchAhead,
    FetchError, Pipeline, PipelineStateError, Task, TaskContext, fetch_ahead,
)  # fmt: skip
from aiopipe.keyed import KEYS_KEPT

#: A test fails within this many seconds instead of hanging on a gate never opened.
pytestmark = pytest.mark.timeout(30)


class GatedFetch:
    """A fake ``async def fetch(key)``: each key waits for its own gate (open from the
    start for keys in ``open_keys``), and the fetch records what ran when."""

    def __init__(self, keys: Iterable[int], *, open_keys: Iterable[int] = (), fail: Iterable[int] = ()) -> None:
        keys = list(keys)
        self.started = {key: asyncio.Event() for key in keys}
        self.gate = {key: asyncio.Event() for key in keys}
        for key in open_keys:
            self.gate[key].set()
        self.fail = set(fail)
        self.calls: list[int] = []  # keys, in the order their fetch started
        self.finished: list[int] = []  # keys, in the order their fetch returned
        self.cancelled: list[int] = []
        self.running = self.most_running = 0
        self.ended = {key: asyncio.Event() for key in keys}

    async def __call__(self, key: int) -> int:
        self.calls.append(key)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        self.started[key].set()
        try:
            await self.gate[key].wait()
        except asyncio.CancelledError:
            self.cancelled.append(key)
            raise
        finally:
            self.running -= 1
            self.ended[key].set()
        if key in self.fail:
            raise ValueError(f"no batch for key {key}")
        self.finished.append(key)
        return 10 * key

    async def release(self, order: Iterable[int]) -> None:
        """Open the gates in ``order``, each once its fetch has started, the next once
        that fetch has returned (so a consumer waiting for it would see it first)."""
        for key in order:
            await self.started[key].wait()
            self.gate[key].set()
            await self.ended[key].wait()


def echo(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])


def echo_pipeline(**options: Any) -> Pipeline:
    return Pipeline([Task.from_fn("train", echo)], **options)


# -- order and the bound ------------------------------------------------------------------


async def test_batches_come_out_in_key_order_when_fetches_finish_out_of_order() -> None:
    fetch = GatedFetch(range(12))
    source = fetch_ahead(range(12), fetch, in_flight=4)
    reversed_windows = [k for start in (0, 4, 8) for k in reversed(range(start, start + 4))]
    async with echo_pipeline() as pipe:
        releasing = asyncio.ensure_future(fetch.release(reversed_windows))
        results = [r async for r in pipe.results(source)]
        await releasing
    assert fetch.finished == reversed_windows  # they did finish out of order
    assert results == [10 * k for k in range(12)]
    assert fetch.calls == list(range(12))  # each key fetched once


async def test_never_more_than_n_fetches_started_and_not_handed_out() -> None:
    in_flight, keys = 3, range(12)
    started: list[int] = []
    delivered: list[int] = []
    too_many: list[tuple[int, int]] = []
    fetch = GatedFetch(keys)

    def counting(key: int) -> Awaitable[int]:
        # Called as the fetch starts.  Finished but not handed out still counts: that
        # batch is in memory.  (Key k + N starts as batch k leaves: N + 1 for a moment.)
        started.append(key)
        if len(started) - len(delivered) > in_flight + 1:
            too_many.append((key, len(started) - len(delivered)))
        return fetch(key)

    source = fetch_ahead(keys, counting, in_flight=in_flight)

    async def consume() -> None:
        async for batch in source:
            delivered.append(batch)

    # Later keys first in each window: the head's batch is the last to arrive, so the
    # finished ones wait in the window, and a slot is free only once it leaves.
    order = [k for start in (0, 3, 6, 9) for k in reversed(range(start, start + 3))]
    await asyncio.gather(consume(), fetch.release(order))
    assert delivered == [10 * k for k in keys]
    assert too_many == []
    assert fetch.most_running == in_flight  # the bound was reached, not just kept
    assert source.statistics().in_flight == 0


async def test_a_pipeline_reading_ahead_keeps_at_most_n_fetches_running() -> None:
    fetch = GatedFetch(range(10))

    async def open_gates() -> None:  # two at a time, the later one first
        for first in range(0, 10, 2):
            await fetch.release([first + 1, first])

    async with echo_pipeline() as pipe:
        opening = asyncio.ensure_future(open_gates())
        results = [r async for r in pipe.results(fetch_ahead(range(10), fetch, in_flight=2))]
        await opening
    assert results == [10 * k for k in range(10)]
    assert fetch.most_running == 2


# -- errors -------------------------------------------------------------------------------------


async def test_a_failing_fetch_names_its_key_and_position_and_the_next_key_follows() -> None:
    keys = ["a", "b", "c", "d"]

    async def fetch(key: str) -> str:
        if key == "c":
            raise ValueError("the store has no 'c'")
        return key.upper()

    source = fetch_ahead(keys, fetch, in_flight=2)
    async with echo_pipeline() as pipe:
        assert [await pipe.progress(source), await pipe.progress(source)] == ["A", "B"]
        with pytest.raises(FetchError) as caught:
            await pipe.progress(source)
        assert [r async for r in pipe.results(source)] == ["D"]
    error = caught.value
    assert (error.key, error.index) == ("c", 2)
    assert isinstance(error.__cause__, ValueError)
    assert "fetch('c') failed, the key at position 2 of the keys" in str(error)
    assert "the store has no 'c'" in str(error)
    stats = source.statistics()
    assert (stats.keys_taken, stats.delivered, stats.failed, stats.exhausted) == (4, 3, 1, True)


async def read_through(source: Any) -> list[Any]:
    """Every batch of ``source`` to its end, a ``FetchError`` in the place of a key
    whose fetch failed (the keys after it go on)."""
    got: list[Any] = []
    while True:
        try:
            got.append(await anext(source))
        except FetchError as failure:
            got.append(failure)
        except StopAsyncIteration:
            return got


def test_the_position_counts_failed_keys_as_done() -> None:
    async def main() -> FetchAhead[int]:
        async def fetch(key: int) -> int:
            if key in (1, 3):
                raise KeyError(key)
            return key

        source = fetch_ahead(range(6), fetch, in_flight=3)
        taken = [item for item in await read_through(source) if not isinstance(item, FetchError)]
        assert taken == [0, 2, 4, 5]
        return source

    source = asyncio.run(main())
    # items done -> keys done: a resumed run starts at the key after them
    assert [source.position(items) for items in range(5)] == [0, 2, 4, 5, 6]


async def test_an_error_of_the_keys_comes_out_unchanged_in_its_turn() -> None:
    def keys() -> Iterator[int]:
        yield 0
        yield 1
        raise RuntimeError("the key stream broke")

    async def fetch(key: int) -> int:
        return key

    source = fetch_ahead(keys(), fetch, in_flight=4)
    assert [await anext(source), await anext(source)] == [0, 1]
    with pytest.raises(RuntimeError, match="the key stream broke"):
        await anext(source)
    with pytest.raises(StopAsyncIteration):  # a generator that raised is finished
        await anext(source)


async def test_a_fetch_that_is_not_async_is_refused_with_the_fix() -> None:
    """A programming error, not a failed key: raised as itself, so a loop that skips
    failed keys (``except FetchError: continue``) does not skip every key."""

    called = []

    def fetch(key: int) -> int:
        called.append(key)
        return key

    source = fetch_ahead([7, 8, 9, 10], fetch, in_flight=3)  # type: ignore[arg-type]
    for _ in range(2):
        with pytest.raises(ConfigurationTypeError, match="define fetch with 'async def'") as caught:
            await anext(source)
        assert type(caught.value) is ConfigurationTypeError  # no private class in the traceback
    assert called == [7]  # the first call said it all: no other key was fetched with it
    stats = source.statistics()  # the counts add up
    assert (stats.keys_taken, stats.in_flight, stats.failed) == (1, 0, 1)
    assert stats.keys_taken == stats.in_flight + stats.delivered + stats.failed


async def test_a_fetch_missing_an_await_is_refused_not_handed_on() -> None:
    """``return get(key)`` in an ``async def fetch``: the batch would be a coroutine,
    which the model cannot take; said as such, once and for every call after."""

    async def get(key: int) -> int:
        return key

    async def fetch(key: int) -> Any:
        return get(key)  # the await forgotten

    source = fetch_ahead([7, 8], fetch, in_flight=1)
    for _ in range(2):
        with pytest.raises(ConfigurationTypeError, match=r"fetch\(7\) returned a coroutine"):
            await anext(source)
    stats = source.statistics()
    assert (stats.delivered, stats.failed) == (0, 1)


def test_an_interrupt_in_the_next_key_or_its_fetch_loses_no_batch_and_no_key() -> None:
    """Ctrl-C while ``next(keys)`` blocks, or while a plain ``fetch`` wrapper runs,
    right after a batch finished: that batch comes out next time, the key is fetched."""
    interrupt = {"next": 1, "fetch": 2}  # at the 2nd key's next(), at fetch(2)

    class Keys:  # an iterator an interrupt does not end (a generator would end)
        def __init__(self) -> None:
            self.keys = iter(range(4))

        def __iter__(self) -> Keys:
            return self

        def __next__(self) -> int:
            interrupt["next"] -= 1
            if interrupt["next"] == -1:  # the second call: batch 0 has just finished
                raise KeyboardInterrupt
            return next(self.keys)

    async def fetched(key: int) -> int:
        return 10 * key

    def fetch(key: int) -> Awaitable[int]:
        if key == interrupt["fetch"]:
            interrupt["fetch"] = -1
            raise KeyboardInterrupt
        return fetched(key)

    source = fetch_ahead(Keys(), fetch, in_flight=1)
    loop = asyncio.new_event_loop()
    got: list[Any] = []
    try:
        while True:
            try:
                got.append(loop.run_until_complete(anext(source)))
            except KeyboardInterrupt:
                got.append("interrupt")
            except StopAsyncIteration:
                break
    finally:
        loop.close()
    assert got == ["interrupt", 0, "interrupt", 10, 20, 30]  # batch 0, held back by the first
    stats = source.statistics()
    assert (stats.keys_taken, stats.delivered, stats.in_flight) == (4, 4, 0)


def test_async_keys_closed_by_the_loop_of_an_earlier_call_are_said_lost() -> None:
    """One ``asyncio.run`` per call: the first run's end closes the generator of keys,
    whose remaining keys cannot be read; the next call says so instead of ending."""

    async def keys() -> AsyncIterator[int]:
        for key in range(6):
            yield key

    async def fetch(key: int) -> int:
        return key

    source = fetch_ahead(keys(), fetch, in_flight=2)
    assert asyncio.run(anext(source)) == 0  # its end closes keys() (shutdown_asyncgens)
    taken = source.statistics().keys_taken  # with a fetch running, a key read ahead
    assert taken == 3
    assert [asyncio.run(anext(source)) for _ in range(taken - 1)] == [1, 2]  # keys read before
    with pytest.raises(PipelineStateError, match="closed between two pulls"):
        asyncio.run(anext(source))


async def ten_keys() -> AsyncIterator[int]:
    """Keys 0-9 from an async generator (the end of each ``asyncio.run`` closes it)."""
    for key in range(10):
        yield key


async def fetch_after_a_cycle(key: int) -> int:
    await asyncio.sleep(0)
    return key


def test_every_key_read_before_its_generator_closed_comes_out_once_before_the_error() -> None:
    """Several keys read ahead (in_flight 3) when one ``asyncio.run`` per call closes
    the generator of keys: each of their batches comes out, in order, before the
    error; the error was raised while batches still waited (they never came out, and
    every later call fetched them again)."""

    async def two(source: FetchAhead[int]) -> list[int]:  # a pipeline reads one ahead too
        return [await anext(source), await anext(source)]

    source = fetch_ahead(ten_keys(), fetch_after_a_cycle, in_flight=3)
    got = asyncio.run(two(source))
    while True:
        try:
            got.append(asyncio.run(anext(source)))
        except PipelineStateError as error:
            assert "closed between two pulls" in str(error)
            break
    taken = source.statistics().keys_taken
    assert taken >= 3 and got == list(range(taken))
    with pytest.raises(PipelineStateError, match="closed between two pulls"):
        asyncio.run(anext(source))  # said again, not ended


def test_a_key_pull_run_after_its_loop_closed_the_keys_is_not_their_end() -> None:
    """A call given up after one loop cycle leaves key pulls going; ``asyncio.run``'s
    end closes the generator of keys and still runs a pull started meanwhile, which
    found the generator closed: that was taken for the end of the keys (the epoch
    ended after 4 of 10).  Now the batches of the keys read come out, then the
    closure is said."""

    source = fetch_ahead(ten_keys(), fetch_after_a_cycle, in_flight=5)

    async def given_up() -> None:
        pending = asyncio.ensure_future(anext(source))
        await asyncio.sleep(0)  # one cycle: the fetches and the key pulls start
        await cancelled(pending)

    asyncio.run(given_up())
    out: list[Any] = []
    for _ in range(source.statistics().keys_taken + 2):
        try:
            out.append(asyncio.run(anext(source)))
        except (StopAsyncIteration, PipelineStateError) as exc:
            out.append(type(exc).__name__)
    taken = source.statistics().keys_taken
    assert out == [*range(taken), "PipelineStateError", "PipelineStateError"]


def test_a_key_pull_left_on_a_loop_closed_by_hand_is_said_lost() -> None:
    gate: list[asyncio.Future[None]] = []

    async def keys() -> AsyncIterator[int]:
        for key in range(4):
            if key == 1:
                gate.append(asyncio.get_running_loop().create_future())
                await gate[0]  # the pull of key 1 waits here when its loop is closed
            yield key

    async def fetch(key: int) -> int:
        return key

    source = fetch_ahead(keys(), fetch, in_flight=1)
    loop = asyncio.new_event_loop()
    assert loop.run_until_complete(anext(source)) == 0
    while not gate:  # the pull of key 1 starts
        loop.run_until_complete(asyncio.sleep(0))
    loop.close()  # stopped and closed, not cancelled: the pull is left waiting

    async def rest() -> list[int]:
        return [batch async for batch in source]

    with pytest.raises(PipelineStateError, match="stopped and closed"):
        asyncio.run(rest())


async def test_bad_arguments_are_refused_with_what_to_pass() -> None:
    async def fetch(key: int) -> int:
        return key

    with pytest.raises(ConfigurationError, match="at least 1"):
        fetch_ahead([1], fetch, in_flight=0)
    for wrong in (1.5, True, None):
        with pytest.raises(ConfigurationTypeError, match="takes an int"):
            fetch_ahead([1], fetch, in_flight=wrong)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationTypeError, match="iterable or async iterable of keys"):
        fetch_ahead(5, fetch, in_flight=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationTypeError, match="async def fetch"):
        fetch_ahead([1], None, in_flight=1)  # type: ignore[arg-type]
    called = fetch(1)
    with pytest.raises(ConfigurationTypeError, match="pass fetch, not fetch"):
        fetch_ahead([1], called, in_flight=1)  # type: ignore[arg-type]
    called.close()


def test_under_trio_it_says_what_to_use_instead() -> None:
    trio = pytest.importorskip("trio")

    async def fetch(key: int) -> int:
        return key

    async def main() -> None:
        with pytest.raises(AsyncLibraryError, match="memory channel"):
            await anext(fetch_ahead([1], fetch, in_flight=1))
        with pytest.raises(AsyncLibraryError, match="memory channel"):  # not hidden by the exit
            async with fetch_ahead([1], fetch, in_flight=1) as source:
                await anext(source)

    trio.run(main)


# -- cancellation -------------------------------------------------------------------------------


async def test_anext_cancelled_while_the_head_fetches_loses_and_repeats_nothing() -> None:
    fetch = GatedFetch(range(5), open_keys=range(1, 5))
    source = fetch_ahead(range(5), fetch, in_flight=3)
    call = asyncio.ensure_future(anext(source))
    await fetch.started[0].wait()  # the call waits for key 0's batch
    await cancelled(call)
    fetch.gate[0].set()
    assert [b async for b in source] == [0, 10, 20, 30, 40]
    assert fetch.calls == [0, 1, 2, 3, 4]
    assert fetch.cancelled == []


async def test_anext_cancelled_while_an_async_key_comes_loses_and_repeats_nothing() -> None:
    asked, given = asyncio.Event(), asyncio.Event()

    async def keys() -> AsyncIterator[int]:
        yield 0
        asked.set()
        await given.wait()  # a cancellation thrown in here would end the keys
        for key in (1, 2):
            yield key

    fetch = GatedFetch(range(3), open_keys=range(3))
    source = fetch_ahead(keys(), fetch, in_flight=2)
    assert await anext(source) == 0
    call = asyncio.ensure_future(anext(source))
    await asked.wait()  # the call waits for key 1
    await cancelled(call)
    given.set()
    assert [b async for b in source] == [10, 20]
    assert fetch.calls == [0, 1, 2]


async def test_a_first_progress_cancelled_while_its_batch_is_fetched_loses_nothing() -> None:
    fetch = GatedFetch(range(4), open_keys=range(1, 4))
    source = fetch_ahead(range(4), fetch, in_flight=2)
    async with echo_pipeline() as pipe:
        call = asyncio.ensure_future(pipe.progress(source))
        await fetch.started[0].wait()
        await cancelled(call)
        fetch.gate[0].set()
        assert [r async for r in pipe.results(source)] == [0, 10, 20, 30]
    assert fetch.calls == [0, 1, 2, 3]


async def test_a_progress_cancelled_during_its_step_keeps_the_fetches_in_flight() -> None:
    stepping, step_gate = asyncio.Event(), asyncio.Event()

    async def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 20:
            stepping.set()
            await step_gate.wait()
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    fetch = GatedFetch(range(8))
    source = fetch_ahead(range(8), fetch, in_flight=3)
    async with Pipeline([Task.from_fn("train", train)]) as pipe:
        fetch.gate[0].set()
        fetch.gate[1].set()
        fetch.gate[2].set()
        assert [await pipe.progress(source), await pipe.progress(source)] == [0, 10]
        call = asyncio.ensure_future(pipe.progress(source))
        await stepping.wait()  # batch 2's step runs, keys 3 and 4 are being fetched
        assert fetch.started[3].is_set() and fetch.started[4].is_set()
        await cancelled(call)
        step_gate.set()
        for key in range(3, 8):
            fetch.gate[key].set()
        assert [r async for r in pipe.results(source)] == [20, 30, 40, 50, 60, 70]
    assert fetch.calls == list(range(8))
    assert fetch.cancelled == []


@pytest.mark.parametrize("async_keys", [False, True], ids=["sync keys", "async keys"])
@pytest.mark.parametrize("after_yields", range(12))
async def test_cancelling_progress_at_any_await_loses_and_repeats_nothing(
    after_yields: int, async_keys: bool
) -> None:
    """Each batch's first call is cancelled after ``after_yields`` turns of the loop
    (the loop runs its tasks in a fixed order, so each count stops the call at the
    same await every run), then a second call takes the result.  Fetches finish out
    of order (key k yields 3 - k % 3 times), the step awaits too."""
    calls: list[int] = []

    async def fetch(key: int) -> int:
        calls.append(key)
        for _ in range(3 - key % 3):
            await asyncio.sleep(0)  # a yield to the loop, not a wait for time
        return key

    async def train(ctx: TaskContext) -> None:
        await asyncio.sleep(0)
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    async def async_range(n: int) -> AsyncIterator[int]:
        for key in range(n):
            await asyncio.sleep(0)
            yield key

    keys: Any = async_range(8) if async_keys else range(8)
    source = fetch_ahead(keys, fetch, in_flight=3)
    results: list[int] = []
    async with Pipeline([Task.from_fn("train", train)]) as pipe:
        while True:
            call = asyncio.ensure_future(pipe.progress(source))
            for _ in range(after_yields):
                await asyncio.sleep(0)
            if not call.done():
                await cancelled(call)
            elif call.exception() is None:
                results.append(call.result())
            try:
                results.append(await pipe.progress(source))
            except StopAsyncIteration:
                break
    assert results == list(range(8))
    assert calls == list(range(8))


async def test_a_pull_the_pipeline_gives_up_leaves_the_batch_for_the_next_use() -> None:
    """Leaving a results() loop and passing another source makes the pipeline cancel
    its pull of this one, mid-fetch: the batch is still handed out next time."""
    fetch = GatedFetch(range(6), open_keys=(0, 1, 3, 4, 5))
    source = fetch_ahead(range(6), fetch, in_flight=2)
    async with echo_pipeline() as pipe:
        async for result in pipe.results(source):
            if result == 10:
                break  # key 2's batch is being read ahead, its gate shut
        assert [r async for r in pipe.results([100, 101])] == [100, 101]
        fetch.gate[2].set()
        assert [b async for b in source] == [20, 30, 40, 50]
    assert fetch.calls == list(range(6))


async def test_reset_keeps_the_fetches_for_the_same_source() -> None:
    def prepare(ctx: TaskContext) -> None:
        ctx.slots.set("prepared", ctx.slots["batch_cpu"])

    def train(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", ctx.slots["prepared"])

    tasks = [
        Task.from_fn("prepare", prepare, lookahead=1, writes=("prepared",)),
        Task.from_fn("train", train, reads=("prepared",), writes=("step_result",)),
    ]
    fetch = GatedFetch(range(8), open_keys=range(8))
    source = fetch_ahead(range(8), fetch, in_flight=2)
    async with Pipeline(tasks) as pipe:
        assert [await pipe.progress(source), await pipe.progress(source)] == [0, 10]
        await pipe.wait_idle()
        pipe.reset()  # batch 2 was prepared: dropped; batch 3 was read ahead: kept
        stats = pipe.statistics()
        assert stats.discarded == 1
        assert source.position(stats.position) == 2  # where to resume
        assert [r async for r in pipe.results(source)] == [30, 40, 50, 60, 70]
    assert fetch.calls == list(range(8))


# -- closing ---------------------------------------------------------------------------------------


async def test_closing_cancels_the_fetches_in_flight_and_waits_for_them(caplog: pytest.LogCaptureFixture) -> None:
    fetch = GatedFetch(range(10))
    async with fetch_ahead(range(10), fetch, in_flight=3) as source:
        call = asyncio.ensure_future(anext(source))
        for key in range(3):
            await fetch.started[key].wait()
    assert sorted(fetch.cancelled) == [0, 1, 2]
    assert fetch.running == 0  # waited for: each fetch has ended
    with pytest.raises(StopAsyncIteration):
        await call  # the call waiting for key 0 ends with the source
    with pytest.raises(StopAsyncIteration):
        await anext(source)
    await source.aclose()  # idempotent
    assert source.statistics().closed
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_async_fetch_raising_an_interrupt_is_fetched_again_not_failed(
    interrupt: type[BaseException],
) -> None:
    """asyncio raises a task's ``KeyboardInterrupt`` out of the loop at once: the
    caller has had it, so the key's batch is fetched again, not handed out as a
    ``FetchError`` (a second report of the same interrupt, and a key skipped)."""
    calls: list[int] = []

    async def fetch(key: int) -> int:
        calls.append(key)
        if key == 2 and calls.count(2) == 1:
            raise interrupt()
        return key

    pipe = echo_pipeline(expect_result=False).blocking()
    source = fetch_ahead(range(5), fetch, in_flight=1)
    seen: list[Any] = []
    try:
        while True:
            try:
                pipe.progress(source)
                seen.append("step")
            except StopIteration:
                break
            except interrupt:
                seen.append("interrupt")
    finally:
        pipe.shutdown()
    assert seen.count("interrupt") == 1 and seen.count("step") == 5
    assert calls.count(2) == 2 and sorted(set(calls)) == [0, 1, 2, 3, 4]
    stats = source.statistics()
    assert (stats.delivered, stats.failed, stats.exhausted) == (5, 0, True)


async def test_a_fetch_raising_another_base_exception_fails_its_key_once() -> None:
    """Only ``KeyboardInterrupt`` and ``SystemExit`` leave the loop as the fetch raises
    them (fetched again); any other ``BaseException`` is that key's failure."""

    class Abort(BaseException):
        pass

    calls: list[int] = []

    async def fetch(key: int) -> int:
        calls.append(key)
        if key == 2:
            raise Abort("fetch of key 2 aborted")
        return key

    got = await read_through(fetch_ahead(range(4), fetch, in_flight=1))
    failure = got[2]
    assert isinstance(failure, FetchError) and isinstance(failure.__cause__, Abort)
    assert failure.key == 2 and got[:2] + got[3:] == [0, 1, 3] and calls.count(2) == 1


@pytest.mark.parametrize("closing", ["close()", "aclose() on another loop"])
def test_close_from_sync_code_cancels_the_fetches_when_their_loop_next_runs(
    closing: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """The blocking form has no loop at hand between calls: ``close()`` (or
    ``aclose()`` run on a loop of its own) cancels the fetches without waiting, and
    the next call (or ``shutdown()``) lets them end."""
    fetch = GatedFetch(range(10), open_keys=[0])
    pipe = echo_pipeline(expect_result=False).blocking()
    source = fetch_ahead(range(10), fetch, in_flight=3)
    try:
        pipe.progress(source)
        assert fetch.finished == [0] and source.statistics().in_flight == 3
        if closing == "close()":
            source.close()
            source.close()  # idempotent
        else:
            asyncio.run(source.aclose())
        stats = source.statistics()
        assert stats.closed and stats.in_flight == 0 and stats.delivered == 1
        with pytest.raises(StopIteration):  # the source has ended
            pipe.progress(source)
        assert fetch.running == 0 and sorted(fetch.cancelled) == [1, 2, 3]
        assert pipe.statistics().pulled == 1  # nothing counted for the dropped batches
    finally:
        pipe.shutdown()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("async_keys", [False, True], ids=["sync keys", "async keys"])
async def test_dropping_the_source_cancels_its_fetches(async_keys: bool, caplog: pytest.LogCaptureFixture) -> None:
    never = asyncio.Event()

    async def async_keys_then_wait() -> AsyncIterator[int]:
        for key in range(3):
            yield key
        await never.wait()  # the key pull is pending when the source is dropped
        yield 3

    fetch = GatedFetch(range(4), open_keys=[0])
    keys: Any = async_keys_then_wait() if async_keys else range(4)
    source = fetch_ahead(keys, fetch, in_flight=3)
    assert await anext(source) == 0  # handing it out started the next key's fetch
    running = [1, 2] if async_keys else [1, 2, 3]  # key 3 is not given yet
    for key in running:
        await fetch.started[key].wait()
    del source, keys
    gc.collect()
    for key in running:
        await fetch.ended[key].wait()
    assert sorted(fetch.cancelled) == running
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_second_event_loop_fetches_again_what_the_first_cancelled() -> None:
    calls: list[int] = []
    first_loop = True

    async def fetch(key: int) -> int:
        calls.append(key)
        if first_loop and key > 0:
            await asyncio.get_running_loop().create_future()  # never done on this loop
        return key

    source = fetch_ahead(range(5), fetch, in_flight=3)

    async def first() -> int:
        return await anext(source)

    assert asyncio.run(first()) == 0  # asyncio.run cancels the fetches of keys 1 to 3
    first_loop = False

    async def rest() -> list[int]:
        return [batch async for batch in source]

    assert asyncio.run(rest()) == [1, 2, 3, 4]
    # 1 to 3 started again: none had handed out its batch
    assert calls == [0, 1, 2, 3, 1, 2, 3, 4]


@pytest.mark.parametrize("executor", ["async", "sequential"])
async def test_a_task_failing_on_a_fetched_batch_names_its_key(executor: str) -> None:
    """A task's failure on a batch of ``fetch_ahead`` names the batch's key beside its
    number (a failed fetch before it, skipped, shifts the keys: batch 2 is key "e"),
    as ``exc.aiopipe_source_key`` and a note; the source keeps the keys of what it
    handed out (``aiopipe_recent_key``).  Not named past a refused item (it has no
    number)."""

    async def fetch(key: str) -> str:
        await asyncio.sleep(0)
        if key == "b":
            raise OSError("the store is down")
        return key.upper()

    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] in ("E", "F"):
            raise ValueError(f"cannot train {ctx.slots['batch_cpu']}")
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    def check(batch: str) -> None:
        if batch == "D":
            raise ValueError("D is refused")

    keys = ["a", "b", "c", "e", "d", "f"]
    source = fetch_ahead(keys, fetch, in_flight=2)
    async with Pipeline([Task.from_fn("train", train)], executor=executor,
                        check_batch=check) as pipe:  # fmt: skip
        assert await pipe.progress(source) == "A"
        with pytest.raises(FetchError):
            await pipe.progress(source)
        assert await pipe.progress(source) == "C"
        with pytest.raises(ValueError, match="cannot train E") as info:
            await pipe.progress(source)
        assert info.value.aiopipe_source_key == "e"  # type: ignore[attr-defined]
        assert "aiopipe: batch 2 is the source's batch of key 'e'" in info.value.__notes__
        pipe.reset()
        with pytest.raises(BadBatchError, match="D is refused"):
            await pipe.progress(source)
        with pytest.raises(ValueError, match="cannot train F") as info:
            await pipe.progress(source)
        assert not hasattr(info.value, "aiopipe_source_key")  # numbers past a refusal
        pipe.reset()


@pytest.mark.parametrize("before", ["peeked", "forgotten", "another pipeline", "read ahead 3"])
async def test_the_key_named_is_the_failing_batch_s_whoever_read_the_source_before(
    before: str,
) -> None:
    """The key is counted back from the latest batch the source handed out, not from
    the pipeline's numbers: a batch read from the source by hand before it is passed,
    a pipeline that forgot the source (other sources came after it, and its numbers
    start at 0 again), another pipeline that trained its first batches, or several
    batches read ahead -- the note names "h", the failing batch's key, every time."""

    async def fetch(key: str) -> str:
        await asyncio.sleep(0)
        return key.upper()

    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == "H":
            raise ValueError("cannot train H")
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    def pipeline() -> Pipeline:
        return Pipeline([Task.from_fn("train", train)],
                        read_ahead=3 if before == "read ahead 3" else True)  # fmt: skip

    async with fetch_ahead("abcdefghij", fetch, in_flight=2) as source, pipeline() as pipe:
        if before == "peeked":
            assert await anext(source) == "A"
        elif before == "another pipeline":
            async with pipeline() as first:
                assert [await first.progress(source) for _ in range(3)] == ["A", "B", "C"]
                assert await first.drain() == ["D"]  # read ahead: trained, not lost
        elif before == "forgotten":
            assert [await pipe.progress(source) for _ in range(3)] == ["A", "B", "C"]
            assert await pipe.drain() == ["D"]
            for other in range(5):  # more than the pipeline remembers
                assert await pipe.progress(iter([other])) == other
                assert await pipe.drain() == []
        with pytest.raises(ValueError, match="cannot train H") as info:
            while True:
                await pipe.progress(source)
        assert info.value.aiopipe_source_key == "h"  # type: ignore[attr-defined]
        assert any(note.endswith("is the source's batch of key 'h'")
                   for note in info.value.__notes__)  # fmt: skip
        pipe.reset()


async def test_the_keys_kept_for_the_notes_are_bounded() -> None:
    async def fetch(key: int) -> int:
        return key

    source = fetch_ahead(range(KEYS_KEPT + 10), fetch, in_flight=4)
    got = await read_through(source)
    assert len(got) == KEYS_KEPT + 10
    assert source.aiopipe_recent_key(0, got[-1]) == (True, KEYS_KEPT + 9)
    assert source.aiopipe_recent_key(KEYS_KEPT - 1, got[10]) == (True, 10)
    assert source.aiopipe_recent_key(KEYS_KEPT, got[9]) == (False, None)  # older than kept
    assert source.aiopipe_recent_key(0, got[-2]) == (False, None)  # not the batch there


async def test_a_batch_read_by_hand_between_calls_leaves_the_key_unnamed() -> None:
    """The pipeline read batch b ahead, then the caller took c from the source by
    hand: counting back no longer reaches b's key, and the batch handed out there
    is another: no key is named (it named c's)."""

    async def fetch(key: str) -> list[str]:
        return [key]  # a new object per batch

    def train(ctx: TaskContext) -> None:
        if ctx.batch_index == 1:
            raise ValueError(f"cannot train {ctx.slots['batch_cpu']}")
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    source = fetch_ahead("abcdef", fetch, in_flight=2)
    async with Pipeline([Task.from_fn("train", train)]) as pipe:
        assert await pipe.progress(source) == ["a"]  # b read ahead
        assert await anext(source) == ["c"]
        with pytest.raises(ValueError, match=r"cannot train \['b'\]") as info:
            await pipe.progress(source)
        assert not hasattr(info.value, "aiopipe_source_key")
        pipe.reset()
