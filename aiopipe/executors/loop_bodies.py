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
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._core.flags import Latch
from .._core.lanes import Lane, call_on_lane
from .._core.loops import task_quiet_if_left
from ..errors import PipelineStateError

if TYPE_CHECKING:
    from .stage import StageRun

__all__ = (
    "LoopBody", "begin_heads", "drop_unstarted_heads", "hand_to_loop", "heads_whole_chain",
    "serve_before", "start_body", "start_heads", "start_queued_heads", "wait_on_lane",
)  # fmt: skip


class LoopBody:
    """An ``async def`` body that runs on the loop for a lane's chain: its task, its
    error, and its lane (``None`` for the loop's own chain).  The lane blocks in
    :meth:`Lane.run_pending_until` on this object, serving the body's
    ``run_on_lane`` calls, until :meth:`finish` posts it -- unless the body is the
    lane's whole chain: then the body's end ends the chain, and no lane waits."""

    __slots__ = ("_ends_chain", "error", "lane", "posted", "served", "task")

    def __init__(
        self, lane: Lane | None, ends_chain: Callable[[BaseException | None], None] | None = None
    ) -> None:
        self.lane = lane
        self.task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None
        self.posted = False
        #: For a body that is its lane's whole chain: ends that chain, from the body's
        #: end (``ends_chain(error)``).  No lane waits for such a body: the lane, idle,
        #: runs its ``run_on_lane`` calls as they come, and the stage's end never waits
        #: for it to wake up (on busy cores, 0.3-1 ms a step; docs/performance.md).
        self._ends_chain = ends_chain
        #: Its lane serves its calls all the same (:func:`serve_before`): work queued
        #: there would block it first.  The body's end lets it go.
        self.served = False

    def finish(self) -> None:
        """Let the waiting lane go on (once; on the loop's thread), after ending the
        lane's chain if the body is all of it."""
        if self.lane is not None and not self.posted:
            self.posted = True
            ends_chain, self._ends_chain = self._ends_chain, None  # (it holds the stage)
            if ends_chain is not None:
                ends_chain(self.error)
                if not self.served:
                    return
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
    heading = {chain[0]: (lane, chain) for lane, (_, chain) in zip(lanes, layout.thread_chains)}
    heads = run.heads = {}
    for i in layout.async_heads:
        lane, chain = heading.get(i, (None, ()))
        whole = functools.partial(_end_whole_chain, run, i) if len(chain) == 1 else None
        heads[i] = LoopBody(lane, whole)
    begun = run.heads_begun = Latch()
    return begun


def heads_whole_chain(run: StageRun, chain: tuple[int, ...]) -> bool:
    """Whether ``chain`` is one body the loop began, which ends the chain itself:
    its lane gets no work item for this stage."""
    body = run.heads.get(chain[0]) if len(chain) == 1 else None
    return body is not None and body._ends_chain is not None


def serve_before(run: StageRun, lane: Lane) -> None:
    """On the loop, before queueing work on ``lane`` that may block it until ``run``
    ends (a stage queued behind it): if a body of ``run`` that is ``lane``'s whole
    chain is still running, have the lane serve its ``run_on_lane`` calls first --
    blocked behind that work, the lane would never run them, and ``run`` never end."""
    for body in run.heads.values():
        if body.lane is lane and body._ends_chain is not None and not body.served:
            body.served = True
            lane.submit(functools.partial(_serve_calls, lane, body))


def _serve_calls(lane: Lane, body: LoopBody) -> None:
    try:
        lane.run_pending_until(body)
    except PipelineStateError:  # the lane stops: nothing more to serve
        pass


def _end_whole_chain(run: StageRun, index: int, error: BaseException | None) -> None:
    """What the lane would do after waiting for the body heading its chain, were
    there more: fail the stage, or mark the task done; then the chain's end."""
    if error is not None:
        run.fail(error)
    else:
        run.finish_task(index)
    waker = run.thread_chain_finished()
    if waker is not None:
        waker.wake()


def start_queued_heads(run: StageRun) -> None:
    """On the loop, once the stage before ``run`` (queued behind it by
    ``progress_many``) has ended: start ``run``'s bodies heading a chain, and let
    its other lanes go once their first steps have run, as for a stage begun by the
    loop (``AsyncExecutor._begin_stage``).  Nothing if ``run`` was skipped."""
    if run.heads_started:
        return
    if run.failed:  # skipped meanwhile (the loop shuts down): nothing will run them
        drop_unstarted_heads(run)
        return
    start_heads(run)


def start_heads(run: StageRun, *, release: bool = True) -> None:
    """On the loop: start ``run``'s bodies heading a chain (:func:`begin_heads`) and,
    with ``release``, let its other lanes go once their first steps have run (the
    callback queued behind their tasks: tasks run FIFO)."""
    run.heads_started = True
    for index, body in run.heads.items():
        start_body(run, index, body)
    if release:
        run.waker.loop.call_soon(run.heads_begun.set)  # type: ignore[union-attr]


def drop_unstarted_heads(run: StageRun) -> None:
    """``run`` is skipped before its bodies heading a chain started: nothing will run
    them.  A chain that is one such body ends here; a lane whose chain one heads
    passes it by (``run.failed`` and not ``run.heads_started``); the other lanes stop
    waiting for them."""
    for body in run.heads.values():
        if body.posted:
            continue
        if body._ends_chain is not None:  # (its end, less the failure: skipped already)
            body.posted, body._ends_chain = True, None
            waker = run.thread_chain_finished()
            if waker is not None:
                waker.wake()
            if body.served and body.lane is not None:  # a lane serving its calls goes on
                body.lane.post(body)
        else:  # a lane that waits for it already goes on with the stage's error
            body.error = body.error or run.error
            body.finish()
    if run.heads_begun is not None:
        run.heads_begun.set()


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
