"""The warnings an ``AsyncExecutor`` logs while a task has waited ``slow_wait_s`` for
a task on another lane or for its collective ticket (it goes on waiting)."""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._core.log import executor_log

if TYPE_CHECKING:
    from .stage import StageRun

__all__ = ("DeferredWaits", "slow_ticket_warning", "warn_slow_wait")


def warn_slow_wait(lane_of: tuple[str, ...], run: StageRun, index: int, pred: int,
                   seconds: float | None) -> None:  # fmt: skip
    names = run.iteration.plan.order
    executor_log.warning(
        "%s: task %r (iteration %d, lane %r) has waited %g s for task %r on lane %r; "
        "still waiting", run.iteration.pipeline, names[index].name, run.iteration.number,
        lane_of[index], seconds, names[pred].name, lane_of[pred],
    )  # fmt: skip


def slow_ticket_warning(lane_of: tuple[str, ...], run: StageRun, seconds: float | None
                        ) -> Callable[[int], None] | None:  # fmt: skip
    """What a ticket wait calls once it has lasted ``seconds`` (if anything)."""
    if not run.layout.tickets or seconds is None:
        return None
    return functools.partial(_warn_slow_ticket, lane_of, run, seconds)


def _warn_slow_ticket(lane_of: tuple[str, ...], run: StageRun, seconds: float,
                      ticket: int) -> None:  # fmt: skip
    plan, index = run.iteration.plan, run.layout.collectives[ticket]
    holder = plan.order[run.layout.collectives[ticket - 1]].name if ticket else "none"
    executor_log.warning(
        "%s: task %r (iteration %d, lane %r) has waited %g s for collective ticket %d "
        "(the collective before it, %r, has not finished submitting); still waiting",
        run.iteration.pipeline, plan.order[index].name, run.iteration.number,
        lane_of[index], seconds, ticket, holder,
    )  # fmt: skip


class DeferredWaits:
    """The same warnings for the chains a lane hands over as it finishes a task
    (``StageLayout.deferred``): no lane waits for that task, so one timer on the
    event loop watches the stages started with such chains, oldest first."""

    def __init__(self, lane_of: tuple[str, ...]) -> None:
        self._lane_of = lane_of
        #: (deadline on the loop's clock, the stage, its slow_wait_s), in start order
        self._watched: collections.deque[tuple[float, StageRun, float]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    def watch(self, run: StageRun, seconds: float) -> None:
        """From the loop's thread, as ``run`` starts with chains handed over later."""
        watched = self._watched
        while watched and not watched[0][1].deferred:  # handed over since
            watched.popleft()
        loop = run.waker.loop
        watched.append((loop.time() + seconds, run, seconds))
        if self._timer is None or self._timer_loop is not loop:
            self._arm(loop, watched[0][0])

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        self._timer, self._timer_loop = loop.call_at(when, self._check, loop), loop

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        waiting = [entry for entry in self._watched if entry[1].deferred]
        for deadline, run, seconds in waiting:
            if deadline <= now:
                self._warn(run, seconds)
        self._watched = collections.deque(entry for entry in waiting if entry[0] > now)
        if self._watched:
            self._arm(loop, self._watched[0][0])

    def _warn(self, run: StageRun, seconds: float) -> None:
        layout = run.layout
        for trigger, items in list(run.deferred.items()):
            for _, _, first in items:
                if trigger in layout.cross_preds.get(first, ()):
                    warn_slow_wait(self._lane_of, run, first, trigger, seconds)
                else:
                    _warn_slow_ticket(self._lane_of, run, seconds, layout.tickets[first])
