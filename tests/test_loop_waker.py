"""``LoopWaker``: calls from lane threads reach the loop in order, through a descriptor
the loop watches (the wake-up written without the GIL), or ``call_soon_threadsafe``
where a loop cannot watch one."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import uvloop

from aiopipe import Pipeline, Task, TaskContext
from aiopipe._core.waker import LoopWaker, _WakeChannel

LOOPS = [asyncio.new_event_loop, uvloop.new_event_loop]


def from_thread(fn: Any) -> None:
    """Run ``fn`` on a thread of its own; re-raise what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


async def test_calls_from_a_thread_run_on_the_loop_in_order() -> None:
    loop = asyncio.get_running_loop()
    waker = LoopWaker(loop)
    seen: list[tuple[int, int]] = []
    done = loop.create_future()

    def record(n: int) -> None:
        seen.append((n, threading.get_ident()))
        if n == 99:
            done.set_result(None)

    from_thread(lambda: [waker.call(record, n) for n in range(100)])
    await done
    assert [n for n, _ in seen] == list(range(100))
    assert {thread for _, thread in seen} == {threading.get_ident()}


async def test_posted_calls_wait_for_the_wake() -> None:
    """``post`` queues, ``wake`` wakes: a lane finishes its own bookkeeping between
    the two, so the woken loop does not wait for its GIL."""
    loop = asyncio.get_running_loop()
    waker = LoopWaker(loop)
    ran = threading.Event()
    queued = threading.Event()
    release = threading.Event()

    def lane() -> None:
        if waker.post(ran.set):
            queued.set()
            release.wait()
            waker.wake()
        else:  # a loop without descriptors: call_soon_threadsafe has it already
            queued.set()

    thread = threading.Thread(target=lane)
    thread.start()
    await asyncio.to_thread(queued.wait)
    for _ in range(5):  # loop cycles: nothing woke the loop for the call
        await asyncio.sleep(0)
    assert not ran.is_set()
    release.set()
    await asyncio.to_thread(ran.wait)
    thread.join()


async def test_a_failing_call_is_reported_and_the_rest_still_run() -> None:
    loop = asyncio.get_running_loop()
    waker = LoopWaker(loop)
    reported: list[BaseException] = []
    loop.set_exception_handler(lambda _, context: reported.append(context["exception"]))
    done = loop.create_future()

    def fail() -> None:
        raise ValueError("a callback's own error")

    def lane() -> None:
        waker.post(fail)
        waker.post(done.set_result, "after")
        waker.wake()

    from_thread(lane)
    assert await asyncio.wait_for(done, 30) == "after"
    assert [type(exc) for exc in reported] == [ValueError]


@pytest.mark.parametrize("new_loop", LOOPS)
def test_calls_after_the_loop_closed_are_dropped(new_loop: Any) -> None:
    loop = new_loop()
    try:
        waker = loop.run_until_complete(_make_waker())
    finally:
        loop.close()
    queued: list[bool] = []
    from_thread(lambda: queued.append(waker.post(print, "never")))
    from_thread(lambda: waker.call(print, "never"))  # raises nothing on the closed loop
    assert queued == [False]


async def _make_waker() -> LoopWaker:
    return LoopWaker(asyncio.get_running_loop())


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/fd")
@pytest.mark.parametrize("new_loop", LOOPS)
def test_a_loops_descriptor_is_closed_with_the_loop(new_loop: Any) -> None:
    gc.collect()
    before = _open_fds()
    for _ in range(20):
        loop = new_loop()
        loop.run_until_complete(_make_waker())
        loop.close()
        del loop
    gc.collect()
    assert _open_fds() == before


class NoReaders(asyncio.SelectorEventLoop):
    """A loop that cannot watch descriptors (as Windows' proactor loop)."""

    def add_reader(self, *args: Any) -> None:
        raise NotImplementedError


def test_a_loop_without_readers_is_woken_with_call_soon_threadsafe() -> None:
    loop = NoReaders()
    threadsafe = 0
    original = loop.call_soon_threadsafe

    def counting(*args: Any) -> Any:
        nonlocal threadsafe
        threadsafe += 1
        return original(*args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

    async def main() -> str:
        running = asyncio.get_running_loop()
        waker = LoopWaker(running)
        done = running.create_future()
        from_thread(lambda: waker.resolve(done, None, "resolved"))
        return await done

    try:
        assert loop.run_until_complete(main()) == "resolved"
    finally:
        loop.close()
    assert threadsafe == 1


REQUEST: contextvars.ContextVar[object] = contextvars.ContextVar("request", default=None)


class Held:
    """What a caller's context variable refers to."""


@pytest.mark.parametrize("new_loop", LOOPS)
def test_calls_from_threads_neither_see_nor_keep_the_first_callers_context(
    new_loop: Any,
) -> None:
    loop = new_loop()
    try:
        held = Held()
        ref = weakref.ref(held)

        async def first_caller() -> None:
            REQUEST.set(held)
            LoopWaker(asyncio.get_running_loop())  # opens the loop's channel

        loop.run_until_complete(first_caller())
        del held
        gc.collect()
        assert ref() is None

        async def later() -> object:
            running = asyncio.get_running_loop()
            waker, seen = LoopWaker(running), running.create_future()
            from_thread(lambda: waker.call(lambda: seen.set_result(REQUEST.get())))
            return await seen

        assert loop.run_until_complete(later()) is None
    finally:
        loop.close()


def echo(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])


@pytest.mark.parametrize("new_loop", LOOPS)
def test_a_ctrl_c_after_the_wake_was_read_strands_no_call(
    new_loop: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interrupt lands in the loop's reader after the wake-up was consumed and
    before the step's end ran: the same loop, run again, still finishes the step."""
    consume = _WakeChannel._consume_wake
    armed = False

    def interrupted(channel: _WakeChannel) -> None:
        nonlocal armed
        consume(channel)
        if armed:
            armed = False
            raise KeyboardInterrupt

    monkeypatch.setattr(_WakeChannel, "_consume_wake", interrupted)
    loop = new_loop()
    pipe = Pipeline([Task.from_fn("echo", echo, writes=("step_result",))])
    source = iter(range(10))

    async def progress() -> Any:
        return await pipe.progress(source)

    try:
        assert loop.run_until_complete(progress()) == 0
        armed = True
        task = loop.create_task(progress())
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(task)
        assert loop.run_until_complete(asyncio.wait_for(asyncio.shield(task), 60)) == 1
        loop.run_until_complete(pipe.aclose())
    finally:
        loop.close()


AT_EXIT = """
    import atexit, os, sys
    write_fd = []
    # Registered before anything else: runs after every other exit hook.
    atexit.register(lambda: print("open" if os.path.exists(f"/proc/self/fd/{write_fd[0]}")
                                  else "closed"))
    import asyncio
    from aiopipe._core.waker import LoopWaker
    loop = asyncio.new_event_loop()  # alive until exit, as a runner's loop may be
    async def make(): return LoopWaker(asyncio.get_running_loop())
    write_fd.append(loop.run_until_complete(make())._channel._write_fd)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
def test_a_live_loops_descriptor_stays_open_through_exit() -> None:
    """Daemon lanes may still wake a loop while the interpreter exits: a descriptor
    closed then, and its number reused by a file, would get the wake-up."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(AT_EXIT)], check=True,
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])  # fmt: skip
    assert done.stdout.strip() == "open"
