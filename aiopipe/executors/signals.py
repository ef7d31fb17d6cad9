"""``Signal``: a one-shot completion flag awaited by the loop or waited on by lanes.

Each task with consumers on another lane gets one per iteration.  Lane threads block
on it directly (one thread wake per cross-lane edge, no detour through the loop);
coroutines on the event loop ``await`` it through a future that ``set()`` resolves
with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

__all__ = ("LoopWaker", "Signal", "settle_future", "wait_settled")


class LoopWaker:
    """Resolves futures of one event loop from any thread."""

    __slots__ = ("loop", "loop_thread")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.loop_thread = threading.get_ident()

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
            return
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed under us (interpreter shutdown, Ctrl-C)
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


class Signal:
    """Set once, by any thread; waited on by threads (blocking) or the loop (async)."""

    __slots__ = ("_event", "_futures", "_lock", "_waker")

    def __init__(self, waker: LoopWaker, lock: threading.Lock) -> None:
        self._event = threading.Event()
        self._futures: list[asyncio.Future[None]] | None = None
        self._waker = waker
        self._lock = lock  # shared per iteration: registration and set() must not interleave

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        if self._event.is_set():
            return
        self._event.set()
        with self._lock:
            futures, self._futures = self._futures, None
        if futures:
            for future in futures:
                self._waker.resolve(future)

    def wait_blocking(self, timeout: float | None = None) -> bool:
        """Block until set (``True``) or ``timeout`` seconds have passed (``False``)."""
        return self._event.wait(timeout)

    async def wait(self) -> None:
        if self._event.is_set():
            return
        future = self._waker.loop.create_future()
        with self._lock:
            if self._event.is_set():
                return
            if self._futures is None:
                self._futures = []
            self._futures.append(future)
        await future
