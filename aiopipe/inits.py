"""``TaskInits``: every task's ``init`` run once per pipeline, before its first
iteration, cancel-safe."""

from __future__ import annotations

import asyncio
import contextlib
import inspect

from ._core.log import pipeline_log
from ._core.loops import close_if_unstarted, task_quiet_if_left
from ._core.waker import wait_settled
from .context import CURRENT, Running, TaskContext
from .plan import ExecutionPlan

__all__ = ("TaskInits",)


class TaskInits:
    """The tasks' ``init`` calls, in topological order."""

    def __init__(self, plan: ExecutionPlan, ctx: TaskContext, pipeline: str) -> None:
        self._plan, self._ctx, self._pipeline = plan, ctx, pipeline
        self.done = False
        self._done_tasks: set[str] = set()  # tasks whose init() has run
        self._running: asyncio.Future[None] | None = None  # the task running them
        # Whether a caller was handed the running task's failure: a caller cancelled
        # while the inits ran leaves it to the next call, which raises it, not retries.
        self._failure_told = False

    async def run(self) -> None:
        """Run the inits not run yet, in a task of its own: a cancelled caller leaves
        it running (the next call waits for it, never runs an init twice); a failure
        is raised -- by the next call if its caller was cancelled -- and the call
        after that retries the inits not yet done."""
        running = self._running
        if running is not None and not running.done() and running.get_loop().is_closed():
            self._left_on_a_closed_loop(running)
            running = None
        if running is not None and running.done() and not running.cancelled():
            if running.exception() is not None and not self._failure_told:
                self._failure_told = True
                running.result()  # raises; the call after this one retries
        if running is None or (running.done() and (running.cancelled() or running.exception())):
            running = self._running = task_quiet_if_left(self._init_tasks())
            self._failure_told = False
        await wait_settled(running)
        self._failure_told = True
        running.result()

    def _left_on_a_closed_loop(self, running: asyncio.Future[None]) -> None:
        """The loop running the inits was closed under them: those not done run again
        (an ``async def init`` stopped at an ``await`` there starts over)."""
        if not close_if_unstarted(running):
            pipeline_log.warning(
                "%s: init() was left unfinished on an event loop that was closed; the "
                "inits not done run again", self._pipeline,
            )  # fmt: skip
        self._running = None

    async def _init_tasks(self) -> None:
        for task in self._plan.order:
            if task.name in self._done_tasks:  # an earlier call failed after it
                continue
            token = CURRENT.set(Running(task, None, -1, -1, None))
            try:
                result = task.init(self._ctx)
                if inspect.isawaitable(result):
                    await result
            finally:
                # An init left on a closed loop is closed later, in another context.
                with contextlib.suppress(ValueError):
                    CURRENT.reset(token)
            self._done_tasks.add(task.name)
        self.done = True
        pipeline_log.info("%s: init() of %d tasks done; up to %d batches will be in flight",
                          self._pipeline, len(self._plan), self._plan.max_lookahead + 1)  # fmt: skip
