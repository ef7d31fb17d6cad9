"""The public async API driven from anyio, on its asyncio and trio backends.

The tests run on each backend with the same assertions (but for the trio-only
boundary): under asyncio (plain and uvloop) the engine runs natively, under trio
each call goes through ``aiopipe.interop`` to a private asyncio loop.  Sources are
anyio memory streams, trio-native under trio: only the trio caller can read them,
never the bridge loop.

The tests are plain functions that call ``anyio.run`` themselves: with
``asyncio_mode = "auto"`` pytest-asyncio claims every ``async def`` test, marked
``anyio`` or not, and would run the trio cases on an asyncio loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import anyio
import pytest
import torch

from aiopipe import Pipeline, PipelineStateError, SchedulablePipeline, Task, TaskContext
from aiopipe.dag import TaskGraph
from aiopipe.errors import AsyncLibraryError
from aiopipe.gpu import wait_for_event
from aiopipe import interop
from aiopipe.interop import current_trio

BACKENDS = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def run_on(backend: str, body: Callable[[str], Awaitable[None]]) -> None:
    """``await body(library)`` under ``anyio.run`` on ``backend``."""
    library, options = BACKENDS[backend]
    anyio.run(body, library, backend=library, backend_options=options)


def on_each_backend(body: Callable[[str], Awaitable[None]]) -> Callable[[str], None]:
    """A test that runs ``await body(library)`` on each backend."""

    def test(backend: str) -> None:
        run_on(backend, body)

    test.__name__ = test.__qualname__ = body.__name__
    test.__doc__ = body.__doc__
    return test


@pytest.fixture(autouse=True)
def no_bridge_thread_left() -> Iterable[None]:
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith("aiopipe-trio")]
    assert not left, f"bridge threads still alive after the test: {left}"


THREAD_MAP = {"double": "io", "add": "loop", "record": "compute"}


class Gate:
    """Holds the ``record`` body: ``started`` is set as it begins, then it waits for
    ``release``, at most ``timeout_s``."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.timeout_s = timeout_s

    def hold(self) -> None:
        self.started.set()
        self.release.wait(self.timeout_s)

    async def until_started(self) -> None:
        while not self.started.is_set():
            await anyio.sleep(0.001)


async def cancel_once_started(gate: Gate, call: Callable[[], Awaitable[Any]]) -> bool:
    """``await call()``, cancelled from a cancel scope as soon as the gated body runs;
    whether the cancellation was caught."""
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def cancel() -> None:
                await gate.until_started()
                scope.cancel()

            tg.start_soon(cancel)
            await call()
    return scope.cancelled_caught


def three_tasks(gate: Gate | None = None, log: list[int] | None = None) -> Pipeline:
    """double (lookahead 1, lane io) -> add (async, anyio inside, on the loop) ->
    record (lane compute; held by ``gate`` when given)."""

    def double(ctx: TaskContext) -> None:
        ctx.slots.set("doubled", ctx.slots["batch_cpu"] * 2)

    async def add(ctx: TaskContext) -> None:
        await anyio.sleep(0)  # anyio in a task body: it must see the loop the body runs on
        ctx.slots.set("plus_one", ctx.slots["doubled"] + 1)

    def record(ctx: TaskContext) -> None:
        if gate is not None:
            gate.hold()
        if log is not None:
            log.append(ctx.batch_index)
        ctx.slots.set("step_result", ctx.slots["plus_one"])

    return Pipeline(
        [
            Task.from_fn("double", double, lookahead=1, writes=("doubled",)),
            Task.from_fn("add", add, reads=("doubled",), writes=("plus_one",)),
            Task.from_fn("record", record, reads=("plus_one",), writes=("step_result",)),
        ],
        thread_map=THREAD_MAP,
    )


async def feed(send: Any, items: Iterable[Any]) -> None:
    async with send:
        for item in items:
            await send.send(item)


@on_each_backend
async def test_m_batches_give_m_results_in_order_then_the_end(library: str) -> None:
    assert (current_trio() is not None) == (library == "trio")
    send, receive = anyio.create_memory_object_stream[int](0)
    async with three_tasks() as pipe, anyio.create_task_group() as tg, receive:
        tg.start_soon(feed, send, range(7))
        results = [result async for result in pipe.results(receive)]
        assert results == [2 * i + 1 for i in range(7)]
        with pytest.raises(StopAsyncIteration):  # and again on every further call
            await pipe.progress(receive)
        stats = pipe.statistics()
        assert (stats.pulled, stats.returned, stats.exhausted) == (7, 7, True)
        # a sync iterator after the end starts afresh
        assert [r async for r in pipe.results(iter(range(3)))] == [1, 3, 5]


@on_each_backend
async def test_progress_many_gives_the_results_in_order_then_an_empty_list(library: str) -> None:
    """Several steps a call: chained on the lanes under asyncio, one by one through the
    bridge under trio; the same results either way."""
    send, receive = anyio.create_memory_object_stream[int](0)
    async with three_tasks() as pipe, anyio.create_task_group() as tg, receive:
        tg.start_soon(feed, send, range(7))
        assert await pipe.progress_many(receive, 3) == [1, 3, 5]
        assert await pipe.progress_many(receive, 9) == [7, 9, 11, 13]
        assert await pipe.progress_many(receive, 9) == []
        assert await pipe.progress_many(iter(range(5)), 2) == [1, 3]


@on_each_backend
async def test_drain_step_and_errors_of_task_bodies(library: str) -> None:
    send, receive = anyio.create_memory_object_stream[int](10)
    for i in range(6):
        send.send_nowait(i)
    async with three_tasks() as pipe, send, receive:
        assert await pipe.progress(receive) == 1
        # a second source while batches are in flight is refused, none of it taken
        with pytest.raises(PipelineStateError, match="new iterator"):
            await pipe.progress(iter(range(100)))
        assert await pipe.progress(receive) == 3  # the stand-in is recognised again
        if library == "asyncio":  # the batch in the ring, and the one read ahead
            assert await pipe.drain() == [5, 7]
        else:  # a trio caller's source is read during its calls only: nothing ahead
            assert await pipe.drain() == [5]
        assert await pipe.step(10) == 21
        next_item = 9 if library == "asyncio" else 7
        assert await pipe.progress(receive) == next_item  # a drained source continues

    def fail(ctx: TaskContext) -> None:
        raise ValueError(f"bad batch {ctx.batch_index}")

    async with Pipeline([Task.from_fn("fail", fail, writes=("step_result",))]) as failing:
        with pytest.raises(ValueError, match="bad batch 0"):  # unchanged, as under asyncio
            await failing.progress(iter(range(2)))
        with pytest.raises(PipelineStateError, match="reset"):
            await failing.progress(iter(range(2)))


@on_each_backend
async def test_cancelled_mid_iteration_runs_on_and_results_continue(library: str) -> None:
    gate = Gate()
    async with three_tasks(gate) as pipe:
        source = iter(range(4))
        assert await cancel_once_started(gate, lambda: pipe.progress(source))
        gate.release.set()
        assert pipe.statistics().broken is None  # a cancelled caller is not a failure
        # the interrupted iteration's result comes first: every batch once, in order
        assert [r async for r in pipe.results(source)] == [1, 3, 5, 7]


@on_each_backend
async def test_a_step_cancelled_mid_body_is_trained_before_the_next_step(library: str) -> None:
    gate, log = Gate(), []
    async with three_tasks(gate, log) as pipe:
        assert await cancel_once_started(gate, lambda: pipe.step(0))
        gate.release.set()
        assert await pipe.step(1) == 3  # step(0)'s batch first, its result dropped
        assert len(log) == 2  # step(0)'s owed batch, then step(1)'s (each batch 0 of its own)
        assert await pipe.drain() == []


def test_under_trio_a_step_cancelled_before_the_bridge_runs_it_is_still_trained() -> None:
    # The batch is owed from the moment step() is called, on the trio side: a cancel
    # that reaches the bridge before the step's task has run leaves it owed.
    trio = pytest.importorskip("trio")
    trio_testing = pytest.importorskip("trio.testing")
    trained: list[Any] = []

    def train(ctx: TaskContext) -> None:
        trained.append(ctx.slots["batch_cpu"])
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    async def main() -> None:
        async with Pipeline([Task.from_fn("train", train)]) as pipe:
            assert await pipe.step("a") == "a"
            busy, release = threading.Event(), threading.Event()  # the bridge loop, held
            pipe._trio._loop.call_soon_threadsafe(lambda: (busy.set(), release.wait(10)))
            await trio.to_thread.run_sync(busy.wait)
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:

                    async def cancel_once_step_waits() -> None:
                        await trio.lowlevel.checkpoint()  # step("b") has begun and waits
                        scope.cancel()
                        with trio.CancelScope(shield=True):
                            # step("b") has handed its cancel to the bridge, and waits
                            # for it there: only now may the bridge loop run (freed at
                            # once, it could finish the step before the cancel came).
                            await trio_testing.wait_all_tasks_blocked()
                        release.set()

                    nursery.start_soon(cancel_once_step_waits)
                    await pipe.step("b")
            assert scope.cancelled_caught
            assert await pipe.step("c") == "c"

    trio.run(main)
    assert trained == ["a", "b", "c"]


# anyio's cancel scopes re-deliver the cancellation at every await: the caller returns
# at once, and the interrupted iteration finishes on its own, even under trio.
@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
def test_cancellation_returns_at_once_and_the_iteration_finishes_on_its_own(
    backend: str,
) -> None:
    async def body(library: str) -> None:
        gate, log = Gate(), []
        async with three_tasks(gate, log) as pipe:
            try:
                assert await cancel_once_started(gate, lambda: pipe.progress(iter(range(4))))
                assert log == []  # record (batch 0) is still held by the gate
            finally:
                gate.release.set()
            # leaving 'async with' waits for the iteration: record ran to its end
        assert log == [0]

    run_on(backend, body)


@on_each_backend
async def test_cancelled_while_waiting_for_a_batch_stays_usable(library: str) -> None:
    send, receive = anyio.create_memory_object_stream[int](0)
    async with three_tasks() as pipe, send, receive:
        with anyio.move_on_after(0.05) as scope:
            await pipe.progress(receive)  # nothing arrives: waits in the pull
        assert scope.cancelled_caught
        assert pipe.statistics().broken is None  # no task had run: nothing to discard
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed, send, range(3))
            assert [r async for r in pipe.results(receive)] == [1, 3, 5]


@on_each_backend
async def test_a_cancelled_pull_closes_an_async_generator_only_under_trio(library: str) -> None:
    release = anyio.Event()
    scope = anyio.CancelScope()

    async def slow() -> AsyncIterator[int]:
        yield 0
        scope.cancel()  # the caller gives up while the source has yet to answer
        await release.wait()  # a cancellation thrown in here finishes the generator
        for n in range(1, 4):
            yield n

    async with three_tasks() as pipe:
        source = slow()
        with scope:
            await pipe.progress(source)
        assert scope.cancelled_caught
        release.set()
        if library != "trio":  # asyncio pulls in a task of its own: nothing is lost
            assert [r async for r in pipe.results(source)] == [1, 3, 5, 7]
            return
        # a trio caller pulls its own source, and trio cancelled that pull
        with pytest.raises(PipelineStateError, match="closed this async generator"):
            await pipe.progress(source)  # not a silent end of the epoch
        assert await pipe.drain() == [1]  # batch 0, already pulled, still comes out


@on_each_backend
async def test_a_concurrent_call_is_refused_and_the_first_completes(library: str) -> None:
    gate = Gate()
    results: list[Any] = []
    async with three_tasks(gate) as pipe:
        source = iter(range(2))

        async def first() -> None:
            results.append(await pipe.progress(source))

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await gate.until_started()
            with pytest.raises(PipelineStateError, match="already running"):
                await pipe.progress(source)
            gate.release.set()
        assert results == [1]
        assert await pipe.progress(source) == 3


@on_each_backend
async def test_shutdown_stops_the_bridge_and_refuses_later_calls(library: str) -> None:
    pipe = three_tasks()
    assert await pipe.step(1) == 3
    bridge_threads = [t for t in threading.enumerate() if t.name == "aiopipe-trio-bridge"]
    assert len(bridge_threads) == (1 if library == "trio" else 0)
    pipe.shutdown()
    assert not any(t.is_alive() for t in bridge_threads)
    with pytest.raises(PipelineStateError, match="shut down"):
        await pipe.step(1)


@on_each_backend
async def test_a_dropped_pipeline_lets_its_bridge_thread_end(library: str) -> None:
    pipe: SchedulablePipeline | None = three_tasks()
    assert pipe is not None and await pipe.step(2) == 5
    threads = [t for t in threading.enumerate() if t.name == "aiopipe-trio-bridge"]
    pipe.executor.shutdown()  # lanes: their own finalizer is not under test here
    pipe = None
    for thread in threads:
        thread.join(5.0)
        assert not thread.is_alive()


@on_each_backend
async def test_asyncio_only_apis_say_so_under_trio(library: str) -> None:
    class Pending:  # an event that has not completed
        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            pass

    if library == "asyncio":
        await wait_for_event(None)
        async with TaskGraph() as graph:
            assert await (await graph.submit(lambda: 5)) == 5
        return
    with pytest.raises(AsyncLibraryError, match="trio"):
        await wait_for_event(Pending())  # type: ignore[arg-type]
    with pytest.raises(AsyncLibraryError, match="TaskGraph"):
        async with TaskGraph():
            pass


def test_an_item_a_trio_caller_took_just_before_its_cancellation_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The trio caller takes item 1 from its source, and its call is cancelled before
    # the bridge loop's task resumes with it: the bridge loop is held until the
    # cancellation is queued there behind the item.  Item 1 comes out next, after a
    # drain() too (the source passed again is the same one).
    cancel_queued = threading.Event()
    queue_cancel = interop._Call.cancel

    def cancel(call: Any) -> None:
        queue_cancel(call)
        cancel_queued.set()

    monkeypatch.setattr(interop._Call, "cancel", cancel)

    async def main(library: str) -> None:
        trio = current_trio()
        assert trio is not None
        loops: list[asyncio.AbstractEventLoop] = []
        trained: list[int] = []
        on_item_1: list[Callable[[], None]] = []

        class Source:
            def __init__(self) -> None:
                self.items = [0, 1, 2, 3]

            def __aiter__(self) -> Source:
                return self

            async def __anext__(self) -> int:
                await trio.lowlevel.checkpoint()
                if not self.items:
                    raise StopAsyncIteration
                item = self.items.pop(0)
                if item == 1:
                    on_item_1[0]()
                return item

        async def step(ctx: TaskContext) -> None:
            loops.append(asyncio.get_running_loop())  # the bridge's loop
            trained.append(ctx.slots["batch_cpu"])
            ctx.slots.set("step_result", ctx.slots["batch_cpu"])

        source = Source()
        async with Pipeline([Task.from_fn("step", step, writes=("step_result",))]) as pipe:
            assert await pipe.progress(source) == 0
            with trio.CancelScope() as scope:

                def hold_the_loop_and_cancel() -> None:
                    loops[0].call_soon_threadsafe(cancel_queued.wait, 10)
                    scope.cancel()

                on_item_1.append(hold_the_loop_and_cancel)
                await pipe.progress(source)
            assert scope.cancelled_caught
            assert await pipe.drain() == []  # nothing in flight; the source is let go
            assert [r async for r in pipe.results(source)] == [1, 2, 3]  # passed again
        assert trained == [0, 1, 2, 3]

    run_on("trio", main)


def test_trio_inside_a_task_body_is_a_clear_error() -> None:
    async def main(library: str) -> None:
        trio = current_trio()
        assert trio is not None

        async def body(ctx: TaskContext) -> None:
            await trio.sleep(0)  # runs on the bridge's asyncio loop: cannot work

        async with Pipeline([Task.from_fn("uses_trio", body, writes=("step_result",))]) as pipe:
            with pytest.raises(AsyncLibraryError, match="task body awaited trio"):
                await pipe.step(torch.zeros(1))

    run_on("trio", main)


@on_each_backend
async def test_aclose_is_idempotent(library: str) -> None:
    pipe = three_tasks()
    assert [r async for r in pipe.results(range(2))] == [1, 3]
    await pipe.aclose()
    await pipe.aclose()  # under trio too: the bridge is gone, nothing is left to wait for
    assert pipe.statistics().closed
