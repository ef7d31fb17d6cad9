"""``SequentialExecutor``: every active task, one after another, on the loop thread."""

from __future__ import annotations

from ..plan import ExecutionPlan
from .base import Iteration, invoke_all

__all__ = ("SequentialExecutor",)


class SequentialExecutor:
    """Runs tasks in topological order on the event-loop thread.

    The reference semantics every other executor must reproduce, and the cheapest
    choice when there is nothing to overlap.  Synchronous bodies block the loop
    while they run; when every task is synchronous, the pipeline runs each step
    inline in its caller's frame (:meth:`run_inline`) and yields to the loop between
    steps at least every ``aiopipe.driver.INLINE_YIELD_S`` seconds.
    """

    def bind(self, plan: ExecutionPlan) -> None:
        self._plan = plan

    def run_inline(self, iteration: Iteration) -> None:
        """Run an iteration whose every task is synchronous, now, in the caller's frame:
        no task to create and no loop cycle to wait for (the pipeline's driver calls it
        when :meth:`inlines` says so)."""
        invoke_all(iteration)

    def inlines(self, plan: ExecutionPlan) -> bool:
        """Whether :meth:`run_inline` may run ``plan``'s iterations: no ``async def``
        body, and ``run_iteration`` not overridden by a subclass (it would be bypassed)."""
        return not any(plan.is_async) and (
            type(self).run_iteration is SequentialExecutor.run_iteration
        )

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
