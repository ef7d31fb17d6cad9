"""``LoopWaker``: how other threads hand calls to the event loop.

Lane threads finish their work off the loop; each end they report (a step's last
chain, a result for a coroutine, a collective ticket) is queued on the waker and the
loop is woken through a descriptor written without the GIL, so the loop thread does
not wait for the lane to let go of it (docs/performance.md).  ``settle_future`` and
``wait_settled`` complete and await futures without cancelling what a cancelled
caller leaves running.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ("LoopWaker", "mark_retrieved", "settle_future", "wait_settled")


class LoopWaker:
    """Resolves futures of one event loop from any thread.  Built on the loop's thread."""

    __slots__ = ("_channel", "loop", "loop_thread")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.loop_thread = threading.get_ident()
        self._channel = _WakeChannel.of(loop)

    @classmethod
    def for_running_loop(cls, last: LoopWaker | None = None) -> LoopWaker:
        """A waker for the loop running on this thread: ``last`` if it is one (a
        waker holds nothing else; building one is a measurable part of a no-op step)."""
        loop = asyncio.get_running_loop()
        if last is not None and last.loop is loop and last.loop_thread == threading.get_ident():
            return last
        return cls(loop)

    def resolve(
        self, future: asyncio.Future[Any], exc: BaseException | None = None, result: Any = None
    ) -> None:
        """Complete ``future`` on its loop; harmless if it was cancelled meanwhile."""
        self.call(settle_future, future, exc, result)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop (now, if this is the loop's thread); dropped
        if the loop has closed."""
        if threading.get_ident() == self.loop_thread:
            fn(*args)
        elif self.post(fn, *args):
            self.wake()

    def post(self, fn: Callable[..., Any], *args: Any) -> bool:
        """From another thread: queue ``fn(*args)`` for the loop, to run once
        :meth:`wake` has been called; ``False`` if no wake is needed (the loop has
        the call already, or it closed).  Whatever the thread still does before it
        waits goes between the two: the loop thread, once woken, needs the GIL."""
        if self._channel is not None:
            if self.loop.is_closed():
                return False
            self._channel.calls.append((fn, args))
            return True
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed under us (interpreter shutdown, Ctrl-C)
            pass
        return False

    def wake(self) -> None:
        """Wake the loop for the calls :meth:`post` queued."""
        if self._channel is not None:
            self._channel.wake()


class _WakeChannel:
    """Calls queued for one loop by other threads; the loop wakes through a file
    descriptor it watches.

    ``call_soon_threadsafe`` would do the same, but uvloop's writes its wake-up while
    the calling thread holds the GIL: the loop thread, woken on the lane's core,
    then blocks on the GIL until the lane lets go of it, and a step's end reached
    the loop 121-138 us after the lane finished, against 69-89 us this way on the
    2-core machine of docs/performance.md.  ``os.write`` releases the GIL around the
    system call.  Each call runs in an empty context (``call_soon_threadsafe`` would
    use a copy of the lane thread's)."""

    __slots__ = ("__weakref__", "_read_fd", "_write_fd", "calls")

    _of_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _WakeChannel | None] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.calls: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._read_fd, self._write_fd = read_fd, write_fd

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _WakeChannel | None:
        """``loop``'s channel, opened on first use (from the loop's thread); ``None``
        where the loop cannot watch a descriptor (Windows' proactor loop): the caller
        then uses ``call_soon_threadsafe``."""
        try:
            return cls._of_loop[loop]
        except KeyError:
            pass
        read_fd, write_fd = _wake_fds()
        channel = cls(read_fd, write_fd)
        try:
            # In an empty context: the reader would keep the current one (the first
            # caller's variables, and what they reference) for the loop's life.
            contextvars.Context().run(loop.add_reader, read_fd, channel._drain)
        except (NotImplementedError, RuntimeError):  # no readers here, or closed
            _close_fds(read_fd, write_fd)
            cls._of_loop[loop] = None
            return None
        # The descriptors live as long as the loop, but are not closed at exit:
        # daemon lanes may still wake a loop then, and a number closed and reused by
        # a file would get the wake-up written into it.
        weakref.finalize(loop, _close_fds, read_fd, write_fd).atexit = False
        cls._of_loop[loop] = channel
        return channel

    def wake(self) -> None:
        try:
            os.write(self._write_fd, _ONE)
        except (BlockingIOError, OSError):  # full: the loop has a wake-up pending; closed
            pass

    def _drain(self) -> None:
        calls = self.calls
        try:
            self._consume_wake()
            while calls:
                fn, args = calls.popleft()
                contextvars.Context().run(fn, *args)  # no call sees another's variables
        finally:  # an error (the loop reports it) or a KeyboardInterrupt, wherever it lands
            if calls:
                self.wake()  # the rest run on the next loop cycle

    def _consume_wake(self) -> None:
        try:
            os.read(self._read_fd, 1 << 12)  # an eventfd resets; a pipe empties
        except (BlockingIOError, OSError):
            pass


_ONE = (1).to_bytes(8, "little")  # an eventfd takes an 8-byte count; a pipe any bytes


def _wake_fds() -> tuple[int, int]:
    """A non-blocking eventfd (Linux: read and written alike) or pipe."""
    if hasattr(os, "eventfd"):
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return fd, fd
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    return read_fd, write_fd


def _close_fds(read_fd: int, write_fd: int) -> None:
    for fd in {read_fd, write_fd}:
        try:
            os.close(fd)
        except OSError:
            pass


def settle_future(future: asyncio.Future[Any], exc: BaseException | None, result: Any) -> None:
    """Complete ``future`` (on its loop's thread) unless it was cancelled meanwhile."""
    if future.done():  # the awaiting coroutine was cancelled
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)


async def wait_settled(future: asyncio.Future[Any]) -> None:
    """Wait until ``future`` is done without cancelling it when the waiter is
    cancelled (``await future`` would; ``asyncio.shield`` costs twice as much)."""
    if future.done():
        return
    waiter = future.get_loop().create_future()

    def wake(_: object) -> None:
        if not waiter.done():
            waiter.set_result(None)

    future.add_done_callback(wake)
    await waiter


def mark_retrieved(future: asyncio.Future[Any]) -> None:
    """Mark ``future``'s exception as seen (a done callback, say): raised to a caller
    some other way, or owed to nobody, it is not reported "never retrieved" too."""
    if not future.cancelled():
        future.exception()
