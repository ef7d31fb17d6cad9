"""``OneShotFlag``: a completion flag set once by any thread, awaited by the loop or
waited on by lanes; ``Latch``, the thread-side part of it (a cheaper
``threading.Event`` that is never cleared).

Each task with consumers on another lane gets one per iteration.  Lane threads block
on it directly (one thread wake per cross-lane edge, no detour through the loop);
coroutines on the event loop ``await`` it through a future that ``set()`` resolves
through a :class:`~aiopipe._core.waker.LoopWaker`.
"""

from __future__ import annotations

import asyncio
import threading

from .waker import LoopWaker

__all__ = ("Latch", "OneShotFlag")


class Latch:
    """Set once, waited on by threads: ``threading.Event`` without ``clear()``, for
    the events every iteration makes afresh.  An Event builds a ``Condition`` (about
    3 us on the 2-core machine of docs/performance.md, several per iteration); this
    is two plain locks.  ``_gate`` is held until :meth:`set`; each waiter that gets
    it hands it on at once, so every waiter passes."""

    __slots__ = ("_gate", "_guard", "_set")

    def __init__(self, is_set: bool = False) -> None:
        self._set = is_set
        self._guard = threading.Lock()  # two threads setting it release the gate once
        self._gate = threading.Lock()
        if not is_set:
            self._gate.acquire()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._guard:
            if self._set:
                return
            self._set = True
        self._gate.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set (``True``) or ``timeout`` seconds have passed (``False``)."""
        if self._set:
            return True
        if not self._gate.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            return False
        self._gate.release()
        return True


class OneShotFlag:
    """Set once, by any thread; waited on by threads (blocking) or the loop (async)."""

    __slots__ = ("_event", "_futures", "_lock", "_waker")

    def __init__(self, waker: LoopWaker, lock: threading.Lock) -> None:
        self._event = Latch()
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
