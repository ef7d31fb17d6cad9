"""The warnings an ``AsyncExecutor`` logs while a task has waited ``slow_wait_s`` for
a task on another lane or for its collective ticket (it goes on waiting)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._core.log import executor_log

if TYPE_CHECKING:
    from .stage import StageRun

__all__ = ("slow_ticket_warning", "warn_slow_wait")


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
