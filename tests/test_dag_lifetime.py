"""A TaskGraph's block and its scopes, left in every way: once per graph, cancelled
(by a timeout, in the block or while it waits for its tasks), raising, and what the
tasks' handles and failures then say.  Interleavings forced with events."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import warnings

import pytest
import torch

from aiopipe import GraphError, PoisonedError, TaskDefinitionError
from aiopipe.dag import INPUT, OUTPUT, TaskGraph


async def in_a_thread(event: threading.Event) -> None:
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, 10)


def held_writer(  # type: ignore[no-untyped-def]
    started: threading.Event, release: threading.Event, fails: bool = False
):
    """A lane body that writes ones into its tensor once ``release`` is set."""

    def produce(y: torch.Tensor) -> None:
        started.set()
        assert release.wait(10)
        if fails:
            raise ValueError("produce failed")
        y.fill_(1.0)

    return produce


def let_go(release: threading.Event) -> None:
    """Release a lane body the cancelled block left running; its lane stops after it
    (the block told it to, without joining it)."""
    release.set()
    for thread in threading.enumerate():
        if thread.name.startswith("aiopipe-lane-"):
            thread.join(10)


def total(y: torch.Tensor) -> float:
    return float(y.sum())


async def test_a_graph_serves_one_block() -> None:
    graph = TaskGraph()
    async with graph:
        assert await (await graph.submit(total, torch.ones(2))) == 2.0
        with pytest.raises(GraphError, match="entered already"):
            async with graph:
                pass
    with pytest.raises(GraphError, match="entered already"):  # it hung before: lanes stopped
        async with graph:
            pass


async def test_a_cancelled_block_cancels_the_tasks_left_and_comes_back_at_once() -> None:
    # The block is cancelled (a timeout, say) while a lane body runs and its reader
    # and an async task wait: the waiting ones are cancelled, their handles say so
    # (they stayed pending for good before), and the block returns without waiting
    # for the lane's body, which runs to its end.
    started, release, forever = threading.Event(), threading.Event(), asyncio.Event()
    handles = {}

    async def waits_forever() -> None:
        await forever.wait()

    async def block() -> None:
        async with TaskGraph() as graph:
            y = torch.zeros(4)
            await graph.submit(held_writer(started, release), OUTPUT(y), lane="a")
            handles["reader"] = await graph.submit(total, INPUT(y), lane="b")
            handles["async"] = await graph.submit(waits_forever)
            await asyncio.Event().wait()  # the block waits here when it is cancelled

    user = asyncio.ensure_future(block())
    await in_a_thread(started)
    user.cancel()
    with pytest.raises(asyncio.CancelledError):
        await user
    try:
        for handle in handles.values():
            with pytest.raises(GraphError, match="cancelled with its TaskGraph's block"):
                await handle
    finally:
        let_go(release)


async def test_a_block_cancelled_while_it_waits_for_its_tasks_settles_every_handle() -> None:
    started, release = threading.Event(), threading.Event()
    left, handles = asyncio.Event(), {}

    async def block() -> None:
        async with TaskGraph() as graph:
            y = torch.zeros(4)
            await graph.submit(held_writer(started, release), OUTPUT(y), lane="a")
            handles["reader"] = await graph.submit(total, INPUT(y), lane="b")
            left.set()  # leaves the block at once, in this step: its exit waits

    user = asyncio.ensure_future(block())
    await left.wait()
    await in_a_thread(started)
    user.cancel()
    with pytest.raises(asyncio.CancelledError):
        await user
    let_go(release)
    with pytest.raises(GraphError, match="cancelled"):  # it stayed pending for good before
        await handles["reader"]


@pytest.mark.parametrize("fails", [False, True])
async def test_a_scope_left_by_cancellation_hands_its_tasks_to_the_scope_around_it(
    fails: bool,
) -> None:  # fmt: skip
    # A scope's exit waits for a lane body writing y and is cancelled: the body's
    # task goes to the graph's scope, so a reader there still waits for it, and its
    # failure is still reported (the reader saw zeros, and the failure was lost).
    started, release, waiting = threading.Event(), threading.Event(), asyncio.Event()
    y = torch.zeros(4)

    async def run() -> float | None:
        async with TaskGraph() as graph:

            async def worker() -> None:
                async with graph.scope():
                    await graph.submit(held_writer(started, release, fails), OUTPUT(y), lane="a")
                    waiting.set()  # the scope's exit waits for it, in this step

            task = asyncio.ensure_future(worker())
            await waiting.wait()
            await in_a_thread(started)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            reader = await graph.submit(total, INPUT(y), lane="b")
            release.set()
            if not fails:
                return await reader  # type: ignore[no-any-return]
            with pytest.raises(PoisonedError, match="'produce' it depends on failed"):
                await reader
            return None

    if not fails:
        assert await run() == 4.0
        return
    with pytest.raises(BaseExceptionGroup) as caught:  # the graph's exit reports it
        await run()
    assert [str(exc) for exc in caught.value.exceptions] == ["produce failed"]


async def test_the_block_s_own_error_comes_with_the_tasks_failures() -> None:
    def fails() -> None:
        raise ValueError("task failed")

    with pytest.raises(BaseExceptionGroup) as caught:
        async with TaskGraph() as graph:
            handle = await graph.submit(fails)
            with pytest.raises(ValueError):
                await handle
            raise KeyError("block failed")
    assert [type(exc) for exc in caught.value.exceptions] == [KeyError, ValueError]


async def test_a_failure_awaited_again_and_again_keeps_its_traceback() -> None:
    def fails() -> None:
        raise ValueError("task failed")

    def depth(exc: BaseException) -> int:
        tb, n = exc.__traceback__, 0
        while tb is not None:
            tb, n = tb.tb_next, n + 1
        return n

    with pytest.raises(BaseExceptionGroup):
        async with TaskGraph() as graph:
            handle = await graph.submit(fails)
            depths = []
            for _ in range(50):
                with pytest.raises(ValueError) as caught:
                    await handle
                depths.append(depth(caught.value))
            assert len(set(depths)) == 1  # it grew by a frame or two each time


async def test_async_callables_run_on_the_loop_and_a_hidden_one_is_refused() -> None:
    class Scorer:
        async def __call__(self, x: int) -> int:
            await asyncio.sleep(0)
            return x * 2

    async def double(x: int) -> int:
        return x * 2

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine ... was never awaited"
        with pytest.raises(BaseExceptionGroup) as caught:
            async with TaskGraph() as graph:
                assert await (await graph.submit(Scorer(), 21)) == 42  # was a coroutine
                hidden = await graph.submit(lambda x: double(x), 21)
                with pytest.raises(TaskDefinitionError, match="returned an awaitable"):
                    await hidden
    assert [type(exc) for exc in caught.value.exceptions] == [TaskDefinitionError]


INTERRUPTED = """
import asyncio
from aiopipe.dag import TaskGraph

def interrupted():
    raise KeyboardInterrupt

async def block(lane, group):
    async with TaskGraph() as graph:
        if group:
            await graph.submit_group(interrupted, [(), ()], lane=lane)
        else:
            await graph.submit(interrupted, lane=lane)
        await asyncio.Event().wait()  # the interrupt leaves the loop first

for lane in ("loop", "a"):
    for group in (False, True):
        try:
            asyncio.run(block(lane, group))
        except KeyboardInterrupt:
            print(lane, group, "left the loop")
"""


def test_a_keyboard_interrupt_in_a_task_leaves_the_loop_at_once() -> None:
    # It was recorded as the task's failure and the program went on (here: for good).
    # In a subprocess: an interrupt must not reach the test runner.
    done = subprocess.run([sys.executable, "-c", INTERRUPTED], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.stdout.splitlines() == [
        f"{lane} {group} left the loop" for lane in ("loop", "a") for group in (False, True)
    ], done.stderr
