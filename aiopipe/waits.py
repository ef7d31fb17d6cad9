"""``IterationWaits``: how callers wait for the running iteration of an
:class:`~aiopipe.driver.IterationDriver` (mixed into the driver; its state is the
driver's): woken by the iteration's end, and, when a caller leaves before it, the
iteration guarded so that a loop shutting down waits for it -- saying what it waits
for, and stopping at a second Ctrl-C (:mod:`aiopipe._core.watch`)."""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING

from ._core.watch import LaneWatch, describe_wait
from .errors import PipelineStateError

if TYPE_CHECKING:
    from .chain import StepChain
    from .executors import Iteration, IterationHandle
    from .source import Feed

__all__ = ("IterationWaits",)


class IterationWaits:
    """The driver's waits for its running iteration."""

    # The driver's state (set by IterationDriver.__init__).
    running: asyncio.Future[None] | None
    _current: tuple[Feed, Iteration] | None
    _handle: IterationHandle | None
    _chain: StepChain
    _pipeline: str
    _lane_names: tuple[str, ...]

    def _init_waits(self) -> None:
        # The iteration last guarded, and its watch.
        self._guarded: asyncio.Future[None] | None = None
        self._watch: LaneWatch | None = None
        self._guards: set[asyncio.Task[None]] = set()
        self._waiters: list[asyncio.Future[None]] = []  # woken by the iteration's end

    async def _finish_orphan(self) -> None:
        raise NotImplementedError  # OrphanedIterations'

    def wake_waiters(self) -> None:
        """Wake the callers waiting for the iteration that just ended, from the
        iteration itself: one loop cycle sooner than a done-callback would."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done() and not waiter.get_loop().is_closed():  # else no caller
                waiter.set_result(None)

    async def wait_ended(self) -> None:
        """Wait for the iteration under way to end; cancelling the caller leaves it
        running (and its lanes guarded)."""
        running = self.running
        if running is None or running.done():  # it ended already (it may never suspend)
            return
        if running.get_loop() is not asyncio.get_running_loop():
            if running.get_loop().is_closed():
                await self._finish_orphan()
                return
            raise PipelineStateError(
                "the iteration under way runs on another event loop (a call there was "
                "cancelled or timed out, and its iteration runs on); finish it on that "
                "loop ('await pipe.aclose()' or another progress() there)"
            )
        waiter = running.get_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            self.guard_lanes()
            raise

    async def wait_idle(self) -> None:
        """Wait until no iteration runs.  Cancelling the caller stops the wait at once
        (the iteration runs on, its lanes guarded) and raises ``CancelledError``.  For
        an iteration whose caller left, a wait of over a second says what it waits
        for, and a Ctrl-C stops waiting for it for good (:meth:`LaneWatch.telling`)."""
        while self.running is not None:
            if self._watch is None or self._guarded is not self.running:
                await self.wait_ended()
                continue
            with self._watch.telling():
                await self.wait_ended()

    def guard_lanes(self) -> None:
        """A fast-path iteration's caller left early (cancelled): make a loop shutting
        down wait for the iteration (:meth:`LaneWatch.guard`)."""
        running, handle, current = self.running, self._handle, self._current
        # The steps queued for the caller who left:
        self._chain.drop(current[0] if current is not None else None)
        if handle is None or running is None or current is None or self._guarded is running:
            return  # a task's iteration, none, or guarded already (by an earlier caller)
        if running.get_loop().is_closed():
            return  # nothing to guard on a closed loop; the next call ends it (_finish_orphan)
        self._guarded = running
        describe = functools.partial(describe_wait, self._pipeline, current[1], self._lane_names)
        self._watch = LaneWatch(handle, describe)
        self._watch.guard(running, self._guards)
