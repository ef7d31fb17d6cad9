"""``SequentialExecutor``: every active task, one after another, on the loop thread."""

from __future__ import annotations

from ..plan import ExecutionPlan
from .base import Iteration

__all__ = ("SequentialExecutor",)


class SequentialExecutor:
    """Runs tasks in topological order on the event-loop thread.

    The reference semantics every other executor must reproduce, and the cheapest
    choice when there is nothing to overlap.  Synchronous bodies block the loop
    while they run.
    """

    def bind(self, plan: ExecutionPlan) -> None:
        self._plan = plan

    async def run_iteration(self, iteration: Iteration) -> None:
        is_async = iteration.plan.is_async
        for index in iteration.active.all:
            if is_async[index]:
                await iteration.invoke_async(index)
            else:
                iteration.invoke(index)

    def shutdown(self) -> None:
        return None

    def __repr__(self) -> str:
        return "SequentialExecutor()"
