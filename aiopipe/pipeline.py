"""``SchedulablePipeline``: drives a schedule over a stream of batches.

Each ``await progress(source)`` runs internal iterations -- pull one batch into the
top of the ring, run the tasks whose lookahead fires, advance the ring -- until the
batch at offset 0 is complete, and returns its ``step_result``.  The first call
absorbs the prefill; M batches give exactly M results; the call after the last
result raises ``StopAsyncIteration``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._core.log import lanes_summary, next_pipeline_name, pipeline_log
from ._core.nvtx import Annotator, resolve_annotator
from .context import CURRENT, Running, TaskContext
from .errors import BadBatchError, PipelineStateError
from .executors import Executor, resolve_executor
from .executors.asyncio_executor import StepHandle
from .executors.base import Step
from ._core.waker import wait_settled
from .face import results_of
from .interop import TrioBridge, in_trio, needs_event_loop
from .plan import ExecutionPlan
from .ring import BatchRing, RetiredStores
from .schedule import Schedule
from .source import END, Feed, OneBatch, Source, iterate
from .streams import StreamPool
from .task import BATCH_SLOT, RESULT_SLOT
from .trace import Tracer, resolve_tracer
from .validate import validate_schedule, warn_without_result

if TYPE_CHECKING:
    from .blocking import BlockingPipeline

__all__ = ("PipelineStatistics", "SchedulablePipeline")


@dataclass(frozen=True)
class PipelineStatistics:
    """Where the pipeline stands in its current source.

    ``refused`` counts items refused with ``BadBatchError``: with nothing in flight,
    ``returned + refused`` items of the source have been consumed (the position to
    resume a checkpointed run from)."""

    pulled: int
    returned: int
    in_flight: int
    iteration: int
    exhausted: bool
    broken: str | None
    closed: bool
    refused: int = 0


class SchedulablePipeline:
    """Runs a validated :class:`Schedule` with an executor.

    ``executor`` is ``"async"`` (the default: :class:`AsyncExecutor` with one lane
    thread per stream, so sync bodies never block the event loop), ``"sequential"``
    (every body inline on the loop) or an executor instance.  ``read_ahead=False``
    stops reading the next batch while an iteration runs.  ``stream_pool`` defaults
    to CPU null streams for every name in ``schedule.stream_slots``.  ``trace=True``
    (or a shared :class:`~aiopipe.trace.Tracer`) records a span per task run.
    ``check_batch(batch)`` may raise to refuse a malformed batch before it enters the
    ring: progress then raises :class:`~aiopipe.errors.BadBatchError` and the batches
    in flight stay intact.  Any value is a batch, ``None`` included (tasks that make
    their own data run with ``step(None)``).
    ``name`` labels the pipeline in log records and in the tracks of a shared tracer
    (default ``"pipeline N"``, numbered in the order pipelines are built).

    ``progress`` returns the ``step_result`` slot of each batch.  When no task writes
    it, every result is ``None``: construction warns with
    :class:`~aiopipe.errors.NoStepResultWarning` unless ``expect_result=False``
    says the pipeline runs for its side effects.
    """

    def __init__(
        self,
        schedule: Schedule,
        stream_pool: StreamPool | None = None,
        executor: str | Executor = "async",
        *,
        nvtx: bool | Annotator | None = None,
        trace: bool | Tracer | None = None,
        check_batch: Callable[[Any], None] | None = None,
        read_ahead: bool = True,
        expect_result: bool = True,
        name: str | None = None,
    ) -> None:
        self.name = name if name is not None else next_pipeline_name()
        if stream_pool is None:
            stream_pool = StreamPool({name: None for name in schedule.stream_slots})
        validate_schedule(schedule, stream_pool)
        if expect_result:
            warn_without_result(schedule)
        self._plan = ExecutionPlan(schedule, stream_pool)
        self._schedule = schedule.in_order(self._plan.order)
        self._executor = resolve_executor(executor)
        self._executor.bind(self._plan)
        # The fast path of an executor that can run a step without a coroutine
        # (AsyncExecutor.start_step): no task per iteration, see _start_iteration.
        self._start_step: Callable[..., StepHandle | None] | None = getattr(
            self._executor, "start_step", None
        )
        self._ring = BatchRing(self._plan.max_lookahead + 1)
        self._ctx = TaskContext(stream_pool)
        self._annotator = resolve_annotator(nvtx, gpu_present=torch.cuda.is_available)
        self._tracer = resolve_tracer(trace)
        self._check_batch = check_batch
        lane_of = getattr(self._executor, "lane_of", None)
        self._lanes: tuple[str, ...] = (
            tuple(lane_of(task.name) for task in self._plan.order) if callable(lane_of) else ()
        )
        self._feed: Feed | None = None
        self._seed: dict[str, Any] | None = None
        self._seed_refused = 0  # items refused before the seeded batch (adapters)
        self._initialised = False
        self._init_done: set[str] = set()  # tasks whose init() has run
        # The ring's top store holds a batch pulled for a step that has not run (its
        # progress was cancelled or failed before any task started): run it next.
        self._top_pulled = False
        self._busy = False
        self._broken: str | None = None
        self._closed = False
        self._retired = RetiredStores(self._plan.stream_pool)  # evicted, not yet droppable
        # Runs the calls of trio callers on a private asyncio loop; idle until one comes.
        self._trio = TrioBridge()
        self._read_ahead = read_ahead
        # The iteration under way (a task, or a future the lanes' callback completes:
        # cancelling a caller never cancels it), and the failure of one whose caller
        # was cancelled, raised by the next call.
        self._running: asyncio.Future[None] | None = None
        self._failure: BaseException | None = None
        # For an iteration on the fast path: its handle, and the task that waits for
        # it once its caller was cancelled (so that a loop shutting down waits too).
        self._handle: StepHandle | None = None
        self._guarded: asyncio.Future[None] | None = None  # the iteration last guarded
        self._guards: set[asyncio.Task[None]] = set()
        # Callers waiting for it, woken by the iteration itself when it ends.
        self._iteration_waiters: list[asyncio.Future[None]] = []
        if pipeline_log.isEnabledFor(logging.INFO):
            pipeline_log.info(
                "%s: built with %d tasks (max lookahead %d), %s, lanes %s", self.name,
                len(self._plan), self._plan.max_lookahead, type(self._executor).__name__,
                lanes_summary([task.name for task in self._plan.order], self._lanes),
            )  # fmt: skip

    # -- introspection ----------------------------------------------------------------

    @property
    def schedule(self) -> Schedule:
        """The schedule with each stage's tasks in execution (topological) order, the
        order ``plan.order`` runs them in (the declared schedule is ``plan.schedule``)."""
        return self._schedule

    @property
    def plan(self) -> ExecutionPlan:
        return self._plan

    @property
    def executor(self) -> Executor:
        return self._executor

    @property
    def tracer(self) -> Tracer | None:
        """The :class:`~aiopipe.trace.Tracer` collecting task spans, if tracing is on."""
        return self._tracer

    @property
    def stream_pool(self) -> StreamPool:
        return self._plan.stream_pool

    @property
    def ring(self) -> BatchRing:
        return self._ring

    def statistics(self) -> PipelineStatistics:
        feed = self._feed
        return PipelineStatistics(
            pulled=feed.pulled if feed else 0,
            returned=feed.returned if feed else 0,
            in_flight=feed.in_flight if feed else 0,
            iteration=feed.iteration if feed else 0,
            exhausted=feed.exhausted if feed else False,
            broken=self._broken,
            closed=self._closed,
            refused=feed.refused if feed else 0,
        )

    # -- the progress contract -------------------------------------------------------

    @needs_event_loop
    async def progress(self, source: Source) -> Any:
        """Advance until the oldest batch in flight completes; return its
        ``step_result``.  Raises ``StopAsyncIteration`` once every batch of ``source``
        has been returned.

        Cancel-safe: cancelling the caller (a timeout, a cancel scope) never cancels
        the iteration under way.  It runs to completion, and its result is returned
        by the next call, in order; no batch is lost or repeated."""
        if in_trio():  # the engine needs asyncio: hand the call to the bridge (interop.py)
            feed = self._feed
            source = self._trio.source_for(source, feed.source if feed is not None else None)
            return await self._trio.call(SchedulablePipeline.progress, self, source)
        self._begin_call()
        try:
            feed = self._adopt(source)
            produced, result = await self._next_result(feed)
            if not produced:
                self._on_source_end()
                raise StopAsyncIteration
            return result
        finally:
            self._busy = False

    @needs_event_loop
    async def step(self, batch: Any) -> Any:
        """Process one batch to completion and return its result.

        Convenient for feeding batches one at a time; successive calls do not overlap
        (nothing is known about the next batch yet).  Pass an iterator to
        ``progress`` to keep several batches in flight.  A cancelled ``step`` still
        trains its batch; the next call waits for that, drops its result (its caller
        is gone) and then runs its own batch."""
        feed = self._feed
        if feed is not None and isinstance(feed.source, OneBatch) and not feed.finished:
            await self.drain()
        return await self.progress(OneBatch(batch))

    @needs_event_loop
    async def results(self, source: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
        """``async for result in pipe.results(loader)``: one result per batch, like
        ``for batch in loader``.  An iterable (a list, a ``DataLoader``) gets a fresh
        iterator, so each call is a new pass over it; an iterator continues where it
        stands (every remaining result)."""
        async for result in results_of(self, source):
            yield result

    @needs_event_loop
    async def drain(self) -> list[Any]:
        """Stop pulling from the current source and finish the batches in flight
        (a batch already read ahead included); return their results.  The source is
        then forgotten: passing it again continues with its next batch, passing
        another one starts afresh.  Cancel-safe like ``progress``: results finished
        by an interrupted ``drain`` are returned by the next call."""
        if in_trio():  # as in progress()
            return await self._trio.call(SchedulablePipeline.drain, self)
        self._begin_call()
        try:
            results: list[Any] = []
            feed = self._feed
            if feed is not None:
                if feed.in_flight:  # step() drains an empty feed before each batch: quiet
                    pipeline_log.info("%s: drain, finishing %d batch(es) in flight", self.name,
                                      feed.in_flight)  # fmt: skip
                feed.draining = True
                while True:
                    produced, result = await self._next_result(feed)
                    if not produced:
                        break
                    results.append(result)
            self._feed = None
            return results
        except BaseException:
            if feed is not None:  # what was collected goes back, in front, for the next call
                feed.returned -= len(results)
                feed.outbox.extendleft(reversed(results))
            raise
        finally:
            self._busy = False

    async def aclose(self) -> None:
        """Wait for an iteration still running (its caller was cancelled), then shut
        down.  ``async with pipe:`` calls it on exit."""
        await self.wait_idle()
        self.shutdown()

    @property
    def idle(self) -> bool:
        """No iteration is running: none whose caller was cancelled runs on."""
        return self._running is None

    async def wait_idle(self) -> None:
        """Wait for an iteration whose caller was cancelled (it runs on to completion),
        from an asyncio or a trio caller; return at once when none runs.  Its result
        is kept for the next ``progress``.  Adapters driving several engines on one
        model call it before switching engines."""
        if in_trio():  # the iteration runs on the bridge's loop
            await self._trio.call(SchedulablePipeline._await_running, self)
        else:
            await self._await_running()

    async def _await_running(self) -> None:
        while self._running is not None:
            try:
                await self._iteration_ended()
            except asyncio.CancelledError:  # cancel scopes re-deliver: finish anyway
                continue

    async def _iteration_ended(self) -> None:
        """Wait for the iteration under way to end; cancelling the caller leaves it
        running.  The iteration wakes the waiter as it ends (``_wake_waiters``)."""
        running = self._running
        if running is None or running.done():  # it ended already (it may never suspend)
            return
        if running.get_loop() is not asyncio.get_running_loop():
            raise PipelineStateError(
                "the iteration under way runs on another event loop (a call there was "
                "cancelled or timed out, and its iteration runs on); finish it on that "
                "loop ('await pipe.aclose()' or another progress() there)"
            )
        waiter = running.get_loop().create_future()
        self._iteration_waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            self._guard_lanes()
            raise

    def seed_first_batch(self, contents: Mapping[str, Any], *, refused: int = 0) -> None:
        """Pre-populate the store of the next batch to be pulled, for adapters that
        had to fetch (and partly process) one batch before the pipeline existed.  The
        seeded batch counts as the first batch of the next source; none is lost.
        ``refused``: items of that source the adapter refused before it (counted in
        :attr:`PipelineStatistics.refused`, so the source's position stays exact)."""
        self._check_usable()
        if self._feed is not None and self._feed.in_flight:
            raise PipelineStateError(
                f"cannot seed a batch while {self._feed.in_flight} batch(es) are in flight"
            )
        if self._feed is not None and not self._feed.finished:
            raise PipelineStateError(
                "seed_first_batch seeds the first batch of a source: call it before the "
                "first progress(), after drain(), or once the current source has ended"
            )
        self._seed = dict(contents)
        self._seed_refused = refused

    def reset(self) -> None:
        """Discard every batch in flight and any interrupted state; the next
        ``progress`` starts afresh with whatever source it is given."""
        if self._busy:
            raise PipelineStateError("cannot reset while a progress is running")
        self._refuse_while_running("reset()")
        pipeline_log.info("%s: reset, discarding %d batch(es) in flight", self.name,
                          self._feed.in_flight if self._feed is not None else 0)  # fmt: skip
        if self._feed is not None:
            self._feed.close()
        self._failure = None
        self._retired.add_all(self._ring.reset())
        self._top_pulled = False
        self._feed = None
        self._seed = None
        self._seed_refused = 0
        self._broken = None

    def shutdown(self) -> None:
        """Stop the executor's threads.  Idempotent; the pipeline is unusable after."""
        if self._closed:
            return
        if self._busy:
            raise PipelineStateError("cannot shut down while a progress is running")
        self._refuse_while_running("shutdown()")
        pipeline_log.debug("%s: shut down", self.name)
        if self._feed is not None:
            self._feed.close()
        self._closed = True
        self._executor.shutdown()
        self._trio.close()
        self._retired.clear()

    async def __aenter__(self) -> SchedulablePipeline:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def blocking(self) -> BlockingPipeline:
        """A blocking view for ordinary scripts (``progress`` raises ``StopIteration``)."""
        from .blocking import BlockingPipeline

        return BlockingPipeline(self)

    # -- internals ---------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise PipelineStateError("the pipeline has been shut down")
        self._raise_pending_failure()
        if self._broken is not None:
            raise PipelineStateError(
                f"{self._broken}; the batches in flight are in an unknown state. Call "
                f"reset() to discard them and start again."
            )

    def _begin_call(self) -> None:
        self._check_usable()
        if self._busy:
            raise PipelineStateError(
                "another progress() is already running on this pipeline; await it first"
            )
        self._busy = True

    def _raise_pending_failure(self) -> None:
        """An iteration failed with no caller waiting (it was cancelled): the next
        call reports the original error, once."""
        failure = self._failure
        if failure is not None:
            self._failure = None
            raise failure

    def _refuse_while_running(self, what: str) -> None:
        if self._running is not None:
            raise PipelineStateError(
                f"cannot call {what} while an iteration is still running (the progress() "
                f"that started it was cancelled); 'await pipe.aclose()', or any call that "
                f"awaits it first (progress, drain), finishes it"
            )

    def _on_source_end(self) -> None:
        """Called once the last result of a source has been returned (presets hook)."""

    def _adopt(self, source: Source) -> Feed:
        feed = self._feed
        if feed is not None and source is feed.source:
            return feed
        if feed is not None and feed.in_flight:
            raise PipelineStateError(
                f"a new iterator was passed while {feed.in_flight} batch(es) of the previous "
                f"one are in flight; none of its batches was taken. Keep passing the same "
                f"iterator until progress() reports its end, or call drain() first to "
                f"finish the batches in flight."
            )
        if feed is not None:
            feed.close()
        new_feed = Feed(
            source, read_ahead=self._read_ahead,
            inspect=functools.partial(_problem_of, self._check_batch),  # no cycle via self
        )  # fmt: skip
        new_feed.refused, self._seed_refused = self._seed_refused, 0
        # step() adopts a one-batch source per call: those only at DEBUG
        level = logging.DEBUG if isinstance(source, OneBatch) else logging.INFO
        if pipeline_log.isEnabledFor(level):
            pipeline_log.log(level, "%s: new source %s", self.name, type(source).__name__)
        self._retired.add_all(self._ring.reset())
        self._top_pulled = False
        self._feed = new_feed
        return new_feed

    async def _next_result(self, feed: Feed) -> tuple[bool, Any]:
        """Deliver the next result of ``feed``, running iterations as needed;
        ``(False, None)`` once every result has been delivered.  Cancelling the
        caller leaves the iteration under way running (see ``_start_iteration``)."""
        if feed.lost is not None and not (feed.exhausted or feed.draining):
            raise PipelineStateError(
                f"{feed.lost}: the rest of its items cannot be read. drain() finishes the "
                f"{feed.in_flight} batch(es) in flight; then pass a new source (a cancel-safe "
                f"one, e.g. a queue or memory channel, survives cancellation)"
            )
        if not self._initialised:
            await self._init_tasks()
        while True:
            if feed.outbox:
                feed.returned += 1
                return True, feed.outbox.popleft()
            self._raise_pending_failure()
            if self._running is None:
                if not feed.exhausted and not self._top_pulled:
                    await self._pull(feed)
                if feed.finished:
                    return False, None
                in_task = self._start_iteration(feed)
                if feed.can_read_ahead:
                    # Read the next batch while this iteration runs.  A task first hands
                    # its work to the lanes (tasks start in FIFO order).
                    try:
                        if in_task:
                            await asyncio.sleep(0)
                        feed.read_ahead()
                    except BaseException:  # cancelled, or the source raised KeyboardInterrupt
                        self._guard_lanes()
                        raise
            await self._iteration_ended()  # guards the lanes too if the caller leaves

    def _start_iteration(self, feed: Feed) -> bool:
        """Start the next iteration; whether it runs as a task (which has yet to run).

        The fast path: when the executor can run the step on its lanes alone, it hands
        the step over now and calls ``_lanes_finished`` on the loop when they are
        done: no task to create and wake, two loop cycles fewer on every step's
        critical path (docs/performance.md)."""
        plan = self._plan
        step = Step(
            plan, self._ring, self._ctx, feed.iteration, plan.active(feed.iteration, feed.pulled),
            self._annotator, self._tracer, self._lanes, self.name,
        )  # fmt: skip
        if self._start_step is not None:
            done = asyncio.get_running_loop().create_future()
            finished = functools.partial(self._lanes_finished, feed, step, done)
            handle = self._start_step(step, finished)
            if handle is not None:
                self._running, self._handle = done, handle
                return False
        running = asyncio.ensure_future(self._iterate(feed, step))
        if not running.done():  # an eager task factory may have run it to the end
            self._running = running
        return True

    async def _iterate(self, feed: Feed, step: Step) -> None:
        """One internal iteration, as a task of its own: a cancelled caller stops
        waiting for it, but it runs on, and its result lands in ``feed.outbox``.
        Only shutting the loop down cancels it (the executor then stops cleanly)."""
        try:
            await self._executor.run_step(step)
            step.finish()
            self._iteration_done(feed, step)
        except BaseException as exc:
            self._iteration_failed(step, exc)
            if not isinstance(exc, Exception):
                raise  # the loop shutting down, KeyboardInterrupt: let it through
            self._failure = exc  # raised by the caller, or by the next call
        finally:
            self._running = None
            self._wake_waiters()
            self._retired.free_soon()

    def _lanes_finished(
        self, feed: Feed, step: Step, done: asyncio.Future[None], error: BaseException | None
    ) -> None:
        """On the loop, once the lanes have run every task of a fast-path step.  Never
        raises, bar a ``KeyboardInterrupt``/``SystemExit`` from a body, let through
        as a task would (after the waiting callers were woken)."""
        self._handle = None
        self._running = None
        try:
            if error is None:
                step.finish()
                self._iteration_done(feed, step)
        except BaseException as exc:  # the device or the bookkeeping failed
            error = exc
        if error is not None:
            self._iteration_failed(step, error)
            if isinstance(error, Exception):
                self._failure = error  # raised by the caller, or by the next call
        done.set_result(None)
        self._wake_waiters()
        self._retired.free_soon()
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise error  # out of the loop, as from a task (the pipeline now asks for reset)

    def _iteration_done(self, feed: Feed, step: Step) -> None:
        self._top_pulled = False
        produced = 0 <= step.iteration - self._plan.max_lookahead < feed.pulled
        if produced:
            feed.outbox.append(self._ring.at(0).get(RESULT_SLOT))
        self._retired.add(self._ring.advance())
        feed.iteration += 1

    def _iteration_failed(self, step: Step, exc: BaseException) -> None:
        # Before any task ran, the next call runs this step again, batch and all.
        if step.started:
            self._broken = (
                f"iteration {step.iteration} was interrupted by "
                f"{type(exc).__name__} after some of its tasks ran"
            )

    def _wake_waiters(self) -> None:
        """Wake the callers waiting for the iteration that just ended, from the
        iteration itself: one loop cycle sooner than a done-callback would."""
        waiters, self._iteration_waiters = self._iteration_waiters, []
        for waiter in waiters:
            if not waiter.done():  # else its caller was cancelled
                waiter.set_result(None)

    def _guard_lanes(self) -> None:
        """A fast-path iteration's caller left early (cancelled): make a loop shutting
        down wait for the step, as it would for a task awaiting ``run_step``.

        Two things, since the caller's own cancellation may come from that shutdown.
        A task waits for the step; cancelled (``asyncio.run`` cancels every task
        left), it skips the step's tasks not yet started.  And a thread of the loop's
        default executor waits for the lanes: ``asyncio.run`` (like every runner of
        this package) waits for those threads before it closes the loop, so the
        step's end is still handled on it."""
        running, handle = self._running, self._handle
        if handle is None or running is None or self._guarded is running:
            return  # a task's iteration, none, or guarded already (by an earlier caller)
        self._guarded = running
        guard = asyncio.ensure_future(self._await_lanes(running, handle))
        self._guards.add(guard)  # referenced until done
        guard.add_done_callback(self._guards.discard)
        try:
            asyncio.get_running_loop().run_in_executor(None, handle.wait)
        except RuntimeError:  # the executor is shut down already: the task alone
            pass

    async def _await_lanes(self, done: asyncio.Future[None], handle: StepHandle) -> None:
        while not done.done():
            try:
                await wait_settled(done)
            except asyncio.CancelledError:  # the loop is shutting down
                handle.abort(asyncio.CancelledError())

    async def _pull(self, feed: Feed) -> None:
        top = self._ring.top
        if self._seed is not None:
            seed, self._seed = self._seed, None
            for name, value in seed.items():
                top.set(name, value)
        else:
            if feed.draining and feed.ahead is None:
                feed.exhausted = True  # drain(): nothing new is read
                return
            batch, problem = await feed.take()
            if batch is END:
                feed.exhausted = True
                return
            if problem is not None:
                self._refuse(problem, feed)
            top.set(BATCH_SLOT, batch)
        top.batch_index = feed.pulled
        feed.pulled += 1
        self._top_pulled = True

    def _refuse(self, problem: BaseException, feed: Feed) -> None:
        """Refuse the batch before it enters the ring; it is dropped, nothing else is."""
        feed.refused += 1
        raise BadBatchError(
            f"the source's next batch (after {feed.pulled} taken) was refused: {problem}. "
            f"It was skipped. "
            f"The {feed.in_flight} batch(es) in flight are intact: call progress() again "
            f"with the same iterator to continue, or drain() to finish them"
        ) from problem

    async def _init_tasks(self) -> None:
        for task in self._plan.order:
            if task.name in self._init_done:  # an earlier call failed after it
                continue
            token = CURRENT.set(Running(task, None, -1, -1, None))
            try:
                result = task.init(self._ctx)
                if inspect.isawaitable(result):
                    await result
            finally:
                CURRENT.reset(token)
            self._init_done.add(task.name)
        self._initialised = True
        pipeline_log.info("%s: init() of %d tasks done; up to %d batches will be in flight",
                          self.name, len(self._plan), self._plan.max_lookahead + 1)  # fmt: skip

    def __repr__(self) -> str:
        stats = self.statistics()
        return (
            f"<SchedulablePipeline tasks={len(self._plan)} in_flight={stats.in_flight} "
            f"executor={self._executor!r}>"
        )


def _problem_of(check_batch: Callable[[Any], None] | None, batch: Any) -> BaseException | None:
    """Why ``batch`` must be refused, if it must.  Runs when the batch is read (ahead,
    while an iteration runs), not on the critical path into the ring."""
    if check_batch is not None:
        try:
            check_batch(batch)
        except Exception as exc:
            return exc
    return None
