"""``SchedulablePipeline``: drives a schedule over a stream of batches.

Each ``await progress(source)`` runs internal iterations -- pull one batch into the
top of the ring, run the tasks whose lookahead fires, advance the ring -- until the
batch at offset 0 is complete, and returns its ``step_result``.  The first call
absorbs the prefill; M batches give exactly M results; the call after the last
result raises ``StopAsyncIteration``.

This module holds the public contract.  The source's items cross into the ring
through :class:`~aiopipe.source.Feed`; the life of each iteration (start, end once,
guard the lanes when a caller leaves, a pending failure) is owned by
:class:`~aiopipe.driver.IterationDriver`; the calls that return several results
collect them in :mod:`~aiopipe.collect`; the parts are built by
:mod:`~aiopipe.assembly`, and the batches cancelled ``step()`` calls still owe
training are kept by :mod:`~aiopipe.owed_steps`.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ._core.log import next_pipeline_name
from .assembly import assemble
from ._closing import Closing
from .calls import CallGuard
from .collect import check_steps, collect_drain, collect_steps
from .errors import PipelineStateError
from .executors import Executor
from .interop import TrioBridge, in_trio, needs_event_loop
from .options import check_option_names
from .owed_steps import OwedSteps
from .plan import ExecutionPlan
from .protocols import Results
from .ring import BatchRing
from .schedule import Schedule
from .source import Feed
from .sources import OneBatch, Source
from .statistics import PipelineStatistics
from .streams import StreamPool
from .trace import Tracer

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; only read by type checkers

    from .blocking import BlockingPipeline
    from .options import PipelineOptions

__all__ = ("SchedulablePipeline",)


class SchedulablePipeline(Closing):
    """Runs a validated :class:`Schedule` with an executor.

    ``executor`` is ``"async"`` (the default: :class:`AsyncExecutor` with one lane
    thread per stream, so sync bodies never block the event loop), ``"sequential"``
    (every body inline on the loop) or an executor instance.  ``stream_pool``
    defaults to CPU null streams for every name in ``schedule.stream_slots``.  The
    keyword options (``trace``, ``check_batch``, ``read_ahead``, ``name``, ...) are
    those of every pipeline: :class:`~aiopipe.options.PipelineOptions`.  Any value is
    a batch, ``None`` included (tasks that make their own data run with
    ``step(None)``).

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
        **options: Unpack[PipelineOptions],
    ) -> None:
        check_option_names(options, f"{type(self).__name__}()", type(self).__init__)
        name = options.get("name")
        self.name = name if name is not None else next_pipeline_name()
        parts = assemble(self.name, schedule, stream_pool, executor, options)
        self._plan, self._schedule, self._executor = parts.plan, parts.schedule, parts.executor
        self._ring, self._ctx, self._tracer = parts.ring, parts.ctx, parts.tracer
        self._retired, self._driver, self._feeds = parts.retired, parts.driver, parts.feeds
        self._calls = CallGuard(self.name, self, _CALLS)  # progress, progress_many, drain
        self._owed = OwedSteps(self._feeds)  # of step() calls cancelled early
        self._closed = False
        self._closing = 0  # aclose() calls waiting (closing.py): no new call starts
        # Runs the calls of trio callers on a private asyncio loop; idle until one comes.
        self._trio = TrioBridge()

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
        return self._feeds.statistics(broken=self._driver.failures.broken, closed=self._closed)

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
            source = self._trio_source(source)
            return await self._trio.call(SchedulablePipeline.progress, self, source)
        call = self._calls.begin()  # a second caller is refused, never handed the failure
        try:
            self._check_usable()
            produced, result = await self._next_of(source)
            if not produced:
                self._end_handed()
                raise StopAsyncIteration
            return result
        finally:
            self._calls.end(call)

    @needs_event_loop
    async def progress_many(self, source: Source, steps: int) -> list[Any]:
        """Up to ``steps`` results of ``source`` in one call, as ``steps`` calls of
        :meth:`progress` would return them; fewer once the source ends, ``[]`` after.

        The lanes chain the steps asked for: each one after the first is queued behind
        the running one once its batch is read, and the lane that ends a step starts
        the next without waiting for the event loop (docs/performance.md, "The step
        boundary").  Between two calls exactly the returned steps have been applied.

        Cancel-safe like ``progress``: the step under way runs to its end, a queued
        step not yet started is taken back (its batch is read again next), and the
        finished steps' results, those collected included, come from the next call.
        If a step fails after others finished, their results (and those a failed
        ``drain()`` or an interrupted call left waiting) are returned, and the next
        call raises the failure (or asks for ``reset()``); a refused item or the
        source's own error is raised by the next call on that source (a ``step()``
        of another batch between runs it)."""
        check_steps(steps)
        if in_trio():  # as in progress(): the call runs on the bridge
            many = SchedulablePipeline.progress_many
            return await self._trio.call(many, self, self._trio_source(source), steps)
        call = self._calls.begin()  # a second caller is refused, never handed the failure
        try:
            self._check_usable()
            next_of = functools.partial(self._next_of, source)
            return await collect_steps(next_of, steps, self._driver, self._feeds,
                                       self._end_handed)  # fmt: skip
        finally:
            self._calls.end(call)

    @needs_event_loop
    async def step(self, batch: Any) -> Any:
        """Process one batch to completion and return its result.

        Convenient for feeding batches one at a time; successive calls do not overlap
        (nothing is known about the next batch yet).  Pass an iterator to
        ``progress`` to keep several batches in flight.  A cancelled ``step`` still
        trains its batch, even one cancelled before its batch was taken: the next
        ``step()`` waits for that (or trains it first), drops its result (its caller
        is gone) and then runs its own batch; a ``drain()`` with nothing else in
        flight trains it too (result dropped), ``reset()`` drops it."""
        own = self._owed.queue(batch)  # before any await: a cancelled step still trains it
        if not in_trio():
            return await self._step(own)
        try:  # as in progress(): the step, owed batches first, runs on the bridge
            return await self._trio.call(SchedulablePipeline._step, self, own)
        except Exception:  # refused before it ran (shut down, say): not owed
            self._owed.withdraw(own)
            raise

    async def _step(self, own: OneBatch) -> Any:
        return await self._owed.step(own, self.progress,
                                     lambda: self._drain(take_owed=False))  # fmt: skip

    @needs_event_loop
    def results(self, source: Iterable[Any] | AsyncIterable[Any]) -> Results[Any]:
        """``async for result in pipe.results(loader)``: one result per batch, like
        ``for batch in loader``.  An iterable (a list, a ``DataLoader``) gets a fresh
        iterator, so each call is a new pass over it; an iterator continues where it
        stands (every remaining result).  Leaving the loop early (``break``) trains
        nothing more: see :meth:`abandon_source`."""
        return Results(self, source)

    def abandon_source(self, source: Source, *, fresh: bool = False) -> None:
        """The caller is done with ``source`` although batches of it are in flight
        (``results()`` calls it when its loop is left early).  Those batches have had
        look-ahead work only, which changes no persistent state: if another source
        comes next, they are discarded untrained (``statistics().discarded`` counts
        them) instead of refused; passing ``source`` again continues with them, and
        its counts go on.  ``fresh``: the caller made ``source`` from an iterable
        for its own use (``results(a_list)``), so nobody can pass it again: once
        another source comes, its record is kept only where it takes a weak
        reference (it would keep a list's batches alive)."""
        feed = self._feeds.current
        if feed is not None and feed.source is source and feed.in_flight:
            feed.abandoned, feed.fresh = True, fresh

    @needs_event_loop
    async def drain(self) -> list[Any]:
        """Stop pulling from the current source and finish the batches in flight
        (a batch already read ahead included); return their results.  After
        ``reset()``, the source it kept is taken up again and the item it kept read
        ahead finished too (not for a ``results()`` loop left early).  The source is
        then done with: passed again, it continues with its next batch and
        ``statistics()`` counts on (``position`` stays its position, for a
        checkpoint); another source, or the same after a call was handed its end (a
        new pass), starts afresh.  Cancel-safe like ``progress``: results finished
        by an interrupted ``drain`` come from the next call.  If a task fails,
        ``drain`` raises it; the results of steps applied before it come from the
        next ``drain`` (or ``progress``), and only then is ``reset()`` asked for."""
        if in_trio():  # as in progress()
            return await self._trio.call(SchedulablePipeline.drain, self)
        return await self._drain(take_owed=True)

    async def _drain(self, *, take_owed: bool) -> list[Any]:
        """:meth:`drain`; ``take_owed``: the batches of cancelled ``step()`` calls
        never taken too (``step()`` itself trains them one by one)."""
        call = self._calls.begin()  # a second caller is refused, never handed the failure
        try:
            self._check_usable()
            self._feeds.take_up_parked()
            results = await collect_drain(self._driver, self._feeds, self.name)
            if take_owed and not results:  # else the owed batches: by the next drain()
                failures = self._driver.failures
                await self._owed.train(
                    self._adopt, lambda: collect_drain(self._driver, self._feeds, self.name),
                    lambda: failures.pending or failures.broken is not None,
                )  # fmt: skip
            return results
        finally:
            self._calls.end(call)

    @property
    def idle(self) -> bool:
        """No iteration is running: none whose caller was cancelled runs on."""
        return self._driver.running is None

    async def wait_idle(self) -> None:
        """Wait for an iteration whose caller was cancelled (it runs on to completion),
        from an asyncio or a trio caller; return at once when none runs.  Its result
        is kept for the next ``progress``.  Adapters driving several engines on one
        model call it before switching engines.  Cancelling the caller stops the wait
        (``CancelledError``); the iteration runs on."""
        if in_trio():  # the iteration runs on the bridge's loop
            await self._trio.call(SchedulablePipeline.wait_idle, self)
        else:
            await self._driver.wait_idle()

    def seed_first_batch(self, contents: Mapping[str, Any], *, refused: int = 0) -> None:
        """Pre-populate the store of the next batch to be pulled, for adapters that
        had to fetch (and partly process) one batch before the pipeline existed.  The
        seeded batch counts as the first batch of the next source; none is lost.
        ``refused``: items of that source the adapter refused before it (counted in
        :attr:`PipelineStatistics.refused`, so the source's position stays exact)."""
        self._check_usable()
        self._feeds.seed_first(contents, refused)
        if self._driver.slot_audit is not None:
            self._driver.slot_audit.allow(contents)

    def continue_numbering(self, source: Source, batches_before: int) -> None:
        """``source`` gave ``batches_before`` batches to another pipeline (an adapter's
        engine that ``reset()`` tore down): its batches here are numbered on from there
        (``ctx.batch_index``, failure notes), as after this pipeline's own ``reset()``;
        ``statistics()`` counts only what this pipeline takes.  Before the source's
        first ``progress()`` here."""
        self._feeds.continue_numbering(source, batches_before)

    def reset(self) -> None:
        """Discard every batch in flight and any interrupted state, and go on with
        whatever source comes next.  The batches dropped are counted in
        ``statistics().discarded`` (results of steps applied but not yet returned are
        dropped too; ``applied`` still counts them).  An item read ahead that no task
        touched is kept: the next call on the same source (or ``drain()``) takes it
        first, and that source counts on; its error or refusal a call left for the
        next is raised by it."""
        if self._closed:
            raise PipelineStateError("the pipeline has been shut down: there is nothing to reset")
        if self._calls.in_progress():
            raise PipelineStateError("cannot reset while a progress is running")
        self._driver.refuse_while_running("reset()")
        owed = self._owed.drop()  # before the feeds are: one may be the current feed
        self._driver.failures.clear()
        self._feeds.reset(owed)

    async def __aenter__(self) -> SchedulablePipeline:
        return self

    def blocking(self) -> BlockingPipeline:
        """A blocking view for ordinary scripts (``progress`` raises ``StopIteration``);
        every view of one pipeline runs on one private event loop."""
        from .blocking import BlockingPipeline

        return BlockingPipeline(self)

    # -- internals ---------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._driver.slot_audit is not None:  # the first calls only
            self._driver.warn_of_undeclared_slots()
        if self._closed:
            raise PipelineStateError("the pipeline has been shut down")
        if self._closing:
            raise PipelineStateError(
                "the pipeline is shutting down: aclose() (the end of its 'async with' "
                "block) waits for the call under way, and no other starts"
            )
        feed = self._feeds.current
        if feed is not None and feed.outbox:
            return  # results of applied steps come out first, whatever failed after them
        self._driver.failures.raise_pending()
        self._driver.failures.raise_if_broken()

    def _put_back_results(self, results: list[Any]) -> None:
        """Results a finished call could not hand over (the blocking form raised an
        interrupt as it ended): the next call returns them first (a drain's too)."""
        self._feeds.put_back_results(results)

    def _end_handed(self) -> None:
        """The source's end was handed to the caller (not only read, as by a
        ``progress_many`` returning results first): the same source again is a new pass."""
        self._feeds.end_handed()
        self._on_source_end()

    def _on_source_end(self) -> None:
        """Called once the last result of a source has been returned and its end told,
        or another source comes after that result (presets hook)."""

    async def _next_of(self, source: Source, more: int = 0) -> tuple[bool, Any]:
        """The driver's next result of ``source`` (``more``: see ``next_result``).  An
        interrupted drain() (cancelled, a refused batch) that has now finished the
        batches in flight is done with: the source goes on, as after a whole drain()."""
        self._owed.refuse_another_source(source)
        feed = self._adopt(source)
        produced, result = await self._driver.next_result(feed, more)
        if not produced and feed.draining:
            self._feeds.forget()
            feed = self._adopt(source)
            produced, result = await self._driver.next_result(feed)
        return produced, result

    def _trio_source(self, source: Source) -> Source:
        feed = self._feeds.current
        return self._trio.source_for(source, feed.source if feed is not None else None)

    def _adopt(self, source: Source) -> Feed:
        previous = self._feeds.fed_last  # a drain() between is not the end, nor hides it
        if (previous is not None and previous.source is not source and previous.end_is_next
                and not previous.ended and not previous.in_flight
                and type(previous.source) is not OneBatch):  # fmt: skip
            # (a step()'s one batch is no pass: its group goes on with the next step)
            # Read to its end and every result returned, but never told (a loop of
            # exactly as many calls as batches): its pass ends here, before the next.
            self._on_source_end()
        return self._feeds.adopt(source, idle=self.idle)

    def __repr__(self) -> str:
        stats = self.statistics()
        return (
            f"<SchedulablePipeline tasks={len(self._plan)} in_flight={stats.in_flight} "
            f"executor={self._executor!r}>"
        )


#: The code of the calls that hold the pipeline while they run (:class:`CallGuard`).
_CALLS = frozenset(
    getattr(call, "__wrapped__", call).__code__
    for call in (SchedulablePipeline.progress, SchedulablePipeline.progress_many,
                 SchedulablePipeline._drain)
)  # fmt: skip
