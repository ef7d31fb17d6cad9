"""``AwaitClock``: how long a coroutine spends suspended, from its own steps.

A coroutine's wall span mixes two kinds of time: its *steps* (the stretches between
two ``await``s that actually run, holding the loop's thread) and the time it sits
suspended at an ``await`` (a network fetch, a sleep, a queue), when the loop is free
for other work.  Tracing needs them apart: only the steps are host work.

The clock drives the coroutine itself, forwarding every ``send``/``throw`` and every
value it yields (the futures the event loop waits on), and adds up the time from each
suspension to the next resumption.  It is used only with tracing on; nothing wraps a
coroutine otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar

__all__ = ("AwaitClock",)

T = TypeVar("T")


class AwaitClock(Generic[T]):
    """``await AwaitClock(coro)`` is ``await coro``; afterwards ``awaited_ns`` holds
    the nanoseconds ``coro`` spent suspended (``time.perf_counter_ns``)."""

    __slots__ = ("_coro", "awaited_ns")

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self._coro = coro
        self.awaited_ns = 0

    def __await__(self) -> Generator[Any, Any, T]:
        coro, clock = self._coro, time.perf_counter_ns
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                if error is None:
                    yielded = coro.send(value)
                else:
                    # Drop the reference before the throw: a traceback kept in this
                    # frame would hold the coroutine's frames alive.
                    thrown, error = error, None
                    yielded = coro.throw(thrown)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            suspended = clock()
            try:
                value = yield yielded
            except GeneratorExit:  # the awaiting task was closed: close the body too
                coro.close()
                raise
            except BaseException as exc:  # cancellation and the like: the body decides
                value, error = None, exc
            finally:
                self.awaited_ns += clock() - suspended
