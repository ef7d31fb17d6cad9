"""``async def`` bodies the loop runs for the lanes' chains: ``LoopBody``, and how it
is started, handed over by a lane, and waited for.

Every ``async def`` body runs on the event loop, in a task of its own; a lane whose
chain holds it waits for it, serving its ``ctx.run_on_lane`` calls meanwhile.  A body
at the head of a chain is started by the loop with its stage (:func:`begin_heads`):
started later, by its lane, it would wait for the loop to get a core and the GIL back
from the lanes' compute -- on a busy machine, until the step it should overlap ended
(docs/performance.md, "An async def fetch beside a torch step")."""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING

from .._core.flags import Latch
from .._core.lanes import Lane, call_on_lane
from .._core.loops import task_quiet_if_left
from ..errors import PipelineStateError

if TYPE_CHECKING:
    from .stage import StageRun

__all__ = ("LoopBody", "begin_heads", "hand_to_loop", "start_body", "wait_on_lane")


class LoopBody:
    """An ``async def`` body that runs on the loop for a lane's chain: its task, its
    error, and the lane that waits for it (``None`` for the loop's own chain).  The
    lane blocks in :meth:`Lane.run_pending_until` on this object, serving the body's
    ``run_on_lane`` calls, until :meth:`finish` posts it."""

    __slots__ = ("error", "lane", "posted", "task")

    def __init__(self, lane: Lane | None) -> None:
        self.lane = lane
        self.task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None
        self.posted = False

    def finish(self) -> None:
        """Let the waiting lane go on (once; on the loop's thread)."""
        if self.lane is not None and not self.posted:
            self.posted = True
            self.lane.post(self)

    def abandon(self) -> BaseException | None:
        """The loop that runs the body closed: let the lane go on, with an error if
        the body never ran (closed before its first step, it never reached its own
        ``finish``; its lane must not go on as if it had succeeded).  That error, or
        ``None``."""
        never_ran = None
        if not self.posted and self.error is None:
            never_ran = self.error = PipelineStateError(
                "the event loop closed before this task's async def body started"
            )
        self.finish()
        return never_ran


def begin_heads(run: StageRun, lanes: list[Lane]) -> Latch:
    """On the loop, before the lanes get the stage: a :class:`LoopBody` in
    ``run.heads`` for each body heading a chain (``layout.async_heads``) and the latch
    the other lanes wait on (``run.heads_begun``).  The caller hands the chains over,
    then starts the bodies (:func:`start_body`) and sets the latch once their first
    steps have run."""
    layout = run.layout
    heading = {chain[0]: lane for lane, (_, chain) in zip(lanes, layout.thread_chains)}
    run.heads = {i: LoopBody(heading.get(i)) for i in layout.async_heads}
    begun = run.heads_begun = Latch()
    return begun


def start_body(run: StageRun, index: int, body: LoopBody) -> None:
    """On the loop: run async task ``index`` in a task of its own, as ``body`` (its
    lane, if any, serves its ``run_on_lane`` calls and waits for it)."""
    lane = body.lane
    lane_runner = None if lane is None else functools.partial(call_on_lane, run.waker, lane)

    async def invoke() -> None:
        try:
            if not run.failed:
                await run.iteration.invoke_async(index, lane_runner)
        except BaseException as exc:
            # The loop's chain awaits the task and sees an error there; but an interrupt
            # would leave the loop from this task, not from the iteration's: kept.
            if lane is None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            body.error = exc
        finally:
            body.finish()

    task = body.task = task_quiet_if_left(invoke(), run.waker.loop)
    run.async_tasks.add(task)
    task.add_done_callback(run.async_tasks.discard)


def wait_on_lane(lane: Lane, body: LoopBody) -> None:
    """From ``lane``'s thread: serve ``body``'s ``run_on_lane`` calls until it has
    ended; re-raise its error."""
    lane.run_pending_until(body)
    if body.error is not None:
        raise body.error


def hand_to_loop(run: StageRun, lane: Lane, index: int) -> None:
    """From ``lane``'s thread: run async task ``index`` on the loop, serving its
    ``run_on_lane`` calls here until it finishes; re-raise its error."""
    body = LoopBody(lane)
    try:
        run.waker.loop.call_soon_threadsafe(start_body, run, index, body)
    except RuntimeError as exc:  # loop closed: nothing will ever run the body
        raise PipelineStateError("the event loop closed during the progress") from exc
    wait_on_lane(lane, body)
