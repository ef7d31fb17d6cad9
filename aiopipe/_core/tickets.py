"""``TicketLock``: collectives issued in one agreed order on every rank.

Tasks marked ``nccl=True`` take tickets 0, 1, 2, ... in topological order, which is
the same on every rank.  Ticket ``k`` is admitted only after ticket ``k - 1`` was
released, i.e. after its task finished submitting.  Each waiting ticket has its own
waiter (a future for coroutines on the loop, an event for lane threads), and a
release wakes only the next ticket's waiter -- never all of them.

``release(failed=True)`` and ``abort()`` wake every waiter with
:class:`TicketAbortedError`: a rank that stops issuing collectives must not leave
its own lanes hanging.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

from ..errors import CollectiveOrderError, TicketAbortedError
from .flags import Latch
from .waker import LoopWaker

__all__ = ("TicketLock", "TicketStatistics")

_Waiter = Union["asyncio.Future[None]", Latch]


@dataclass(frozen=True)
class TicketStatistics:
    next_ticket: int
    waiting: tuple[int, ...]
    aborted: bool


class TicketLock:
    """Admits tickets strictly in order; awaitable from the loop, blockable from lanes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._waiters: dict[int, _Waiter] = {}
        self._aborted: TicketAbortedError | None = None
        self._waker: LoopWaker | None = None

    def reset(self, waker: LoopWaker | None = None) -> None:
        """Start a new sequence at ticket 0 (once per iteration)."""
        with self._lock:
            if self._waiters:
                raise CollectiveOrderError(
                    f"ticket lock reset while tickets {sorted(self._waiters)} still wait"
                )
            self._next = 0
            self._aborted = None
            self._waker = waker

    def _check(self, ticket: int) -> bool:
        """Under the lock: True if ``ticket`` may go now; raise if it never can."""
        if self._aborted is not None:
            raise self._aborted
        if ticket < self._next:
            raise CollectiveOrderError(f"ticket {ticket} was already used (next is {self._next})")
        if ticket in self._waiters:
            raise CollectiveOrderError(f"ticket {ticket} is already being waited for")
        return ticket == self._next

    async def acquire(
        self, ticket: int, slow_s: float | None = None, on_slow: Callable[[int], None] | None = None
    ) -> None:
        """Wait (without blocking the loop) until ``ticket`` is next; ``on_slow(ticket)``
        is called if that takes more than ``slow_s`` seconds (the wait goes on)."""
        with self._lock:
            if self._check(ticket):
                return
            loop = asyncio.get_running_loop()
            if self._waker is None or self._waker.loop is not loop:
                self._waker = LoopWaker(loop)
            future = loop.create_future()
            self._waiters[ticket] = future
        timer = None
        if on_slow is not None and slow_s is not None:
            timer = loop.call_later(slow_s, on_slow, ticket)
        try:
            await future
        except asyncio.CancelledError:
            with self._lock:
                if self._waiters.get(ticket) is future:
                    del self._waiters[ticket]
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def acquire_blocking(
        self, ticket: int, slow_s: float | None = None, on_slow: Callable[[int], None] | None = None
    ) -> None:
        """From a lane thread: block until ``ticket`` is next (``on_slow`` as for
        :meth:`acquire`)."""
        with self._lock:
            if self._check(ticket):
                return
            event = Latch()
            self._waiters[ticket] = event
        if on_slow is None or slow_s is None:
            event.wait()
        elif not event.wait(slow_s):
            on_slow(ticket)
            event.wait()
        if self._aborted is not None:
            raise self._aborted

    def release(self, ticket: int, *, failed: bool = False) -> None:
        """Hand the turn to ``ticket + 1``; with ``failed=True`` abort the sequence."""
        if failed:
            self.abort(f"the task holding ticket {ticket} failed")
            return
        with self._lock:
            if self._aborted is not None:
                return
            if ticket != self._next:
                raise CollectiveOrderError(f"release of ticket {ticket} while {self._next} holds")
            self._next += 1
            waiter = self._waiters.pop(self._next, None)
        if waiter is not None:
            self._wake(waiter, None)

    def abort(self, reason: str = "the progress was aborted") -> None:
        """Fail every current and future acquire until ``reset()``."""
        with self._lock:
            if self._aborted is not None:
                return
            self._aborted = TicketAbortedError(f"collective ticket sequence aborted: {reason}")
            waiters, self._waiters = list(self._waiters.values()), {}
        for waiter in waiters:
            self._wake(waiter, self._aborted)

    def _wake(self, waiter: _Waiter, exc: BaseException | None) -> None:
        if isinstance(waiter, Latch):
            waiter.set()
        else:
            assert self._waker is not None  # set by the acquire that created the future
            self._waker.resolve(waiter, exc)

    def statistics(self) -> TicketStatistics:
        with self._lock:
            return TicketStatistics(self._next, tuple(sorted(self._waiters)), self._aborted is not None)
