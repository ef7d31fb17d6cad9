"""``IterationDriver``: the life of one internal iteration, owned in one place.

It delivers a source's results one by one (:meth:`IterationDriver.next_result`),
running the tasks' ``init`` once and then iterations as needed.

The driver starts an iteration -- on the executor's fast path when it offers one
(``start_iteration``: the lanes run it all, no asyncio task), else as a task awaiting
``run_iteration`` -- and ends it exactly once, whichever way it ran: the result goes
to the feed's outbox, the ring advances, the callers waiting are woken and evicted
slot stores are freed.  It guards the lanes when a caller leaves early, and holds the
failure of an iteration whose caller was cancelled for the next call.

When a caller has asked for more than one result (``progress_many``), the steps
after the running one are queued behind it on the lanes (:class:`~aiopipe.chain.StepChain`);
each end makes the queued iteration the running one.

Invariant (cancel-safety): an iteration that has started runs to its end whatever
happens to the callers awaiting it; its result is delivered once, by whichever call
comes next.  A queued iteration that cannot have started yet is taken back when its
caller leaves (its batch is read ahead again).  Only a task body that raises breaks
an iteration; if one does after other bodies ran, ``failures.broken`` says so until the
pipeline is reset.
"""

from __future__ import annotations

import asyncio
import functools
from time import monotonic as _monotonic
from collections.abc import Callable
from typing import Any

from ._core.nvtx import Annotator
from ._core.loops import running_task, task_quiet_if_left
from ._core.waker import mark_retrieved
from .chain import StepChain
from .context import TaskContext
from .errors import PipelineStateError, TaskAbortedError
from .failures import IterationFailures, name_the_key
from .executors import Executor, Iteration, IterationHandle
from .executors.stage import StartFast
from .inits import TaskInits
from .orphans import OrphanedIterations
from .plan import ExecutionPlan
from .ring import BatchRing, RetiredStores, SlotStore
from .slot_audit import SlotAudit
from .source import Feed
from .task import RESULT_SLOT
from .trace import Tracer
from .waits import IterationWaits

__all__ = ("INLINE_YIELD_S", "IterationDriver")

#: The longest an executor running iterations inline (the sequential one) keeps the
#: event loop from other coroutines between two steps, in seconds.
INLINE_YIELD_S = 0.005


class IterationDriver(OrphanedIterations, IterationWaits):
    """Starts, ends and guards the internal iterations of one pipeline."""

    def __init__(
        self, plan: ExecutionPlan, ring: BatchRing, ctx: TaskContext, executor: Executor, *,
        annotator: Annotator | None, tracer: Tracer | None, lane_names: tuple[str, ...],
        pipeline: str, retired: RetiredStores,
    ) -> None:  # fmt: skip
        self._plan, self._ring, self._ctx, self._executor = plan, ring, ctx, executor
        self._annotator, self._tracer = annotator, tracer
        self._lane_names, self._pipeline, self._retired = lane_names, pipeline, retired
        self._start_fast: StartFast | None = getattr(executor, "start_iteration", None)
        # An executor that runs an iteration of synchronous bodies in the caller's frame
        # (the sequential one): no task, no loop cycle; the loop is yielded to every
        # INLINE_YIELD_S instead (docs/performance.md).
        inlines = getattr(executor, "inlines", None)
        self._run_inline: Callable[[Iteration], None] | None = (
            getattr(executor, "run_inline") if inlines is not None and inlines(plan) else None
        )
        self._yield_at = 0.0  # the monotonic clock's time at which the inline path yields next
        # The first batches' stores, checked for slots set but declared by no task.
        self.slot_audit: SlotAudit | None = SlotAudit(plan, pipeline)
        # The iteration under way: a task, or a future the lanes' callback completes.
        # Cancelling a caller never cancels it.
        self.running: asyncio.Future[None] | None = None
        self.failures = IterationFailures()
        self._handle: IterationHandle | None = None  # the running fast-path iteration
        self._current: tuple[Feed, Iteration] | None = None  # the running iteration
        self._chain = StepChain(self)  # the steps queued behind the running one
        self._init_waits()
        self._inits = TaskInits(plan, ctx, pipeline)

    # -- delivering results ----------------------------------------------------------------

    async def next_result(self, feed: Feed, more: int = 0) -> tuple[bool, Any]:
        """Deliver the next result of ``feed``, running iterations as needed;
        ``(False, None)`` once every result has been delivered.  Cancelling the
        caller leaves the iteration under way running.  ``more``: how many results the
        caller will ask for after this one (it has asked for them already): the next
        iteration may then be queued behind the running one."""
        if feed.lost is not None and not (feed.exhausted or feed.draining):
            advice = (f"drain() finishes the {feed.in_flight} batch(es) in flight; then pass"
                      if feed.in_flight else "Pass")  # fmt: skip
            hint = (" (keep every call over an async source on one event loop: inside "
                    "one asyncio.run()/aiopipe.run(), or through pipe.blocking(); a queue "
                    "or memory channel survives a cancellation)"
                    if feed.lost.to_its_loop else "")  # fmt: skip
            raise PipelineStateError(
                f"{feed.lost}: the rest of its items cannot be read. {advice} a new "
                f"source{hint}"
            )
        if not self._inits.done:
            await self._inits.run()
        feed.raise_deferred()  # left by a call that returned results first
        yielded = False  # to the loop, by the inline path
        while True:
            if feed.outbox:
                feed.returned += 1
                return True, feed.outbox.popleft()
            self.failures.raise_pending()
            self.failures.raise_if_broken()
            if self.running is None:
                if self._run_inline is not None and not yielded and _monotonic() >= self._yield_at:
                    # Bodies run inline never suspend: let other coroutines run now
                    # and then, before anything of this step is taken.
                    await asyncio.sleep(0)
                    self._yield_at = _monotonic() + INLINE_YIELD_S
                    yielded = True
                    continue  # another call may have run meanwhile
                if not feed.exhausted and not feed.top_pulled:
                    await feed.pull(self._ring.top)
                if feed.finished:
                    return False, None
                if self._run_inline is not None:
                    self._step_inline(feed)
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        # Cancelled while the step ran (Ctrl-C's handler): the caller
                        # leaves here, its result kept for the next call, not dropped
                        # with the return value of a cancelled task.
                        await asyncio.sleep(0)
                    continue
                # The read-ahead starts before the loop goes on to wait for the step:
                # with every core busy, a loop that has slept gets a core only
                # milliseconds later, and the fetch would start that late.
                reads_ahead = feed.can_read_ahead
                in_task = self.start(feed, release_heads=not reads_ahead)
                if reads_ahead:
                    # Read the next batch while this iteration runs.  A task first hands
                    # its work to the lanes (tasks start in FIFO order).
                    handle = None if in_task else self._handle  # a fast-path start
                    stepped = False  # the loop has run a step since the start
                    try:
                        if in_task:
                            await asyncio.sleep(0)
                        feed.read_ahead()
                        if feed.reads_in_a_task and not in_task:
                            await asyncio.sleep(0)  # the pull's first step: the fetch starts
                            stepped = True
                    except BaseException:  # cancelled, or the source raised KeyboardInterrupt
                        self.guard_lanes()
                        raise
                    finally:
                        if handle is not None:
                            handle.release_lanes(stepped=stepped)
            self._chain.ask(feed, more)
            await self.wait_ended()  # guards the lanes too if the caller leaves

    # -- starting ----------------------------------------------------------------------

    def _step_inline(self, feed: Feed) -> None:
        """Run the feed's next iteration now, in this frame, and end it; read the next
        item ahead, as a task's iteration would have it read."""
        iteration = self.new_iteration(feed.iteration, self._ring, feed)
        error: BaseException | None = None
        try:
            self._run_inline(iteration)  # type: ignore[misc]  # set: the caller checked
        except BaseException as exc:
            error = exc
        error = self._end(feed, iteration, error, free_now=True)
        if error is not None and not isinstance(error, Exception):
            raise error  # KeyboardInterrupt, SystemExit: out, its end handled
        feed.read_ahead()

    def start(self, feed: Feed, *, release_heads: bool = True) -> bool:
        """Start the feed's next iteration; whether it runs as a task (which has yet
        to run: the caller yields once before relying on its lanes having started).
        ``release_heads=False``: a fast-path start leaves releasing the lanes that wait
        for its ``async def`` heads to the caller (``IterationHandle.release_lanes``).

        The fast path hands the whole iteration to the lanes now, and its end is
        handled in the callback that wakes the loop: no task to create and wake, two
        loop cycles fewer on every iteration's critical path (docs/performance.md)."""
        iteration = self.new_iteration(feed.iteration, self._ring, feed)
        if self._start_fast is not None:
            started = self.hand_to_lanes(feed, iteration, release_heads=release_heads)
            if started is not None:
                self.running, self._handle = started
                self._current = (feed, iteration)
                return False
        running = task_quiet_if_left(self._run_as_task(feed, iteration))
        if not running.done():  # an eager task factory may have run it to the end
            self.running, self._current = running, (feed, iteration)
        return True

    def new_iteration(self, number: int, ring: BatchRing, feed: Feed) -> Iteration:
        """Iteration ``number`` of ``feed`` on ``ring`` (the ring, or the ring as the
        running iteration will leave it)."""
        plan = self._plan
        return Iteration(
            plan, ring, self._ctx, number, plan.active(number, feed.pulled),
            self._annotator, self._tracer, self._lane_names, self._pipeline,
            feed.batches_before,
        )  # fmt: skip

    def hand_to_lanes(
        self, feed: Feed, iteration: Iteration, *, release_heads: bool,
        after: IterationHandle | None = None,
    ) -> tuple[asyncio.Future[None], IterationHandle] | None:  # fmt: skip
        """Start ``iteration`` on the executor's fast path (behind ``after``, if
        given): ``(done, handle)``, ``done`` resolved once its end is handled; ``None``
        where it cannot start so."""
        assert self._start_fast is not None
        done = asyncio.get_running_loop().create_future()
        on_done = functools.partial(self._lanes_finished, feed, iteration, done)
        handle = self._start_fast(iteration, on_done, release_heads=release_heads, after=after)
        return None if handle is None else (done, handle)

    @property
    def handle(self) -> IterationHandle | None:
        """The running iteration's handle, if it runs on the fast path."""
        return self._handle

    @property
    def current(self) -> tuple[Feed, Iteration] | None:
        """The running iteration and its feed."""
        return self._current

    @property
    def ring(self) -> BatchRing:
        return self._ring

    def runs_here(self) -> bool:
        """The running iteration reports to this event loop (a caller on another loop
        never queues behind it: its end would be reported there)."""
        running = self.running
        return running is not None and running.get_loop() is asyncio.get_running_loop()

    async def _run_as_task(self, feed: Feed, iteration: Iteration) -> None:
        """A task of its own: a cancelled caller stops waiting for it, but it runs on.
        Only shutting the loop down cancels it (the executor then stops cleanly)."""
        error: BaseException | None = None
        me = asyncio.current_task()
        try:
            await self._executor.run_iteration(iteration)
        except GeneratorExit as exc:
            if not getattr(exc, "aiopipe_body_fault", False) or running_task() is not me:
                raise  # collected, left on a closed loop: ended elsewhere
            error = exc  # a body's own: its task's failure
        except BaseException as exc:
            error = exc
        error = self._end(feed, iteration, error)
        if error is not None and not isinstance(error, Exception):
            # The loop shutting down, KeyboardInterrupt: let it through, out of the
            # loop; the end was handled above, nobody needs the task's exception.
            task = asyncio.current_task()
            if task is not None:
                task.add_done_callback(mark_retrieved)
            raise error

    def _lanes_finished(
        self, feed: Feed, iteration: Iteration, done: asyncio.Future[None],
        error: BaseException | None,
    ) -> None:  # fmt: skip
        """On the loop, once the lanes have run every task of a fast-path iteration.
        Never raises, bar a ``KeyboardInterrupt``/``SystemExit`` from a body, let
        through as a task would (after the waiting callers were woken)."""
        current = self._current
        if current is None or current[1] is not iteration:
            return  # a queued iteration taken back before it started (nothing ran)
        error = self._end(feed, iteration, error, done)
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise error  # out of the loop, as from a task (the pipeline now asks for reset)

    # -- ending, exactly once --------------------------------------------------------------

    def _end(
        self, feed: Feed, iteration: Iteration, error: BaseException | None,
        done: asyncio.Future[None] | None = None, *, free_now: bool = False,
    ) -> BaseException | None:  # fmt: skip
        """Deliver the iteration's result, or record its failure; wake its waiters and
        free what it evicted (``free_now``, or with the next step chained: now; else
        at the loop's next cycle).  Returns the failure, if any (the device or this
        bookkeeping may fail too).  An iteration queued behind it becomes the running
        one if the lanes have started it (they do unless this one failed)."""
        guarded = self._guarded is not None and self._guarded is self.running
        if guarded:
            self._watch = None  # it refers to the iteration
        queued = self._chain.take()
        self.running = self._handle = self._current = None
        iteration.stage = None  # it refers back to the iteration: no cycle left to collect
        successor_runs = queued is not None and error is None
        try:
            if error is None:
                iteration.finish()
                self._advance(feed, iteration, queued.store if queued is not None else None)
            else:
                self._keep_applied_result(feed, iteration)
                if queued is not None:  # the lanes skipped it: its batch is read ahead again
                    feed.give_back(queued.store)
        except BaseException as exc:
            error = exc
        if queued is not None and successor_runs:
            self.running, self._handle = queued.done, queued.handle
            self._current = (feed, queued.iteration)
            feed.top_pulled = True
            if guarded:  # its caller left: a loop shutting down waits for this one too
                self.guard_lanes()
        if error is not None:
            name_the_key(error, feed, self._ring)  # a keyed source's batch: its key, too
        if error is not None and getattr(error, "aiopipe_body_fault", False):
            error = TaskAbortedError(error)  # raised as a task's failure, not bare
        if error is not None:
            self.failures.record(iteration.number, iteration.started, error)
        if done is not None and not done.get_loop().is_closed():
            done.set_result(None)
        chained = False
        try:
            chained = error is None and successor_runs and self._chain.after_end(feed)
        finally:  # the source may raise KeyboardInterrupt there
            if free_now or chained:
                # Chained, nobody waits for the next hand-off (the lane made it): free
                # now, not at a loop cycle of its own.
                self._retired.free()
            else:
                self._retired.free_soon()
        if not chained:
            self._chain.stop()
            self.wake_waiters()
        return error

    def warn_of_undeclared_slots(self, *, at_shutdown: bool = False) -> None:
        """At the start of a call, or at shutdown (never raised there): warn of slots
        the first batches set undeclared."""
        audit = self.slot_audit
        if audit is not None:
            audit.warn(raising=not at_shutdown)
            if audit.done or at_shutdown:
                self.slot_audit = None

    def _advance(self, feed: Feed, iteration: Iteration, top: SlotStore | None) -> None:
        feed.top_pulled = False
        if self.slot_audit is not None:
            self.slot_audit.check(self._ring.at(0))
        if self.holds_oldest_batch(feed, iteration):
            feed.outbox.append(self._ring.at(0).get(RESULT_SLOT))
        self._retired.add(self._ring.advance(top))
        feed.iteration += 1

    def holds_oldest_batch(self, feed: Feed, iteration: Iteration) -> bool:
        """Whether the iteration's offset 0 holds a batch of ``feed`` (not prefill)."""
        return 0 <= iteration.number - self._plan.max_lookahead < feed.pulled

    def _keep_applied_result(self, feed: Feed, iteration: Iteration) -> None:
        """The iteration failed, but the batch at offset 0 had every one of its tasks
        run (a later batch's task failed): its step was applied, so its result is
        kept and delivered like any other, before the failure."""
        if self.holds_oldest_batch(feed, iteration) and iteration.oldest_batch_done():
            feed.outbox.append(self._ring.at(0).get(RESULT_SLOT))

    # -- failures ------------------------------------------------------------------------

    def refuse_while_running(self, what: str) -> None:
        if self.running is not None and not self.abandon_orphan():
            raise PipelineStateError(
                f"cannot call {what} while an iteration is still running (the progress() "
                f"that started it was cancelled); 'await pipe.aclose()', or any call that "
                f"awaits it first (progress, drain), finishes it"
            )

