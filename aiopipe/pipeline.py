"""``SchedulablePipeline``: drives a schedule over a stream of batches.

Each ``await progress(source)`` runs internal iterations -- pull one batch into the
top of the ring, run the tasks whose lookahead fires, advance the ring -- until the
batch at offset 0 is complete, and returns its ``step_result``.  The first call
absorbs the prefill; M batches give exactly M results; the call after the last
result raises ``StopAsyncIteration``.
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._nvtx import Annotator, resolve_annotator
from .context import CURRENT, Running, TaskContext
from .errors import BadBatchError, PipelineStateError
from .executors import Executor, make_executor
from .executors.base import Step
from .interop import TrioBridge, in_trio
from .plan import ExecutionPlan
from .ring import BatchRing, SlotStore
from .schedule import Schedule
from .source import END, Feed, Source
from .streams import StreamPool
from .task import BATCH_SLOT, RESULT_SLOT
from .trace import Tracer, resolve_tracer
from .validate import validate_schedule

if TYPE_CHECKING:
    from .blocking import BlockingPipeline
    from .presets import BasicPipeline

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

    ``executor`` is ``"sequential"``, ``"async"`` (:class:`AsyncExecutor` with the
    default ``by_stream`` lanes) or an executor instance.  ``stream_pool`` defaults
    to CPU null streams for every name in ``schedule.stream_slots``.  ``trace=True``
    (or a shared :class:`~aiopipe.trace.Tracer`) records a span per task run.
    ``check_batch(batch)`` may raise to refuse a malformed batch before it enters the
    ring (``None`` batches are always refused): progress then raises
    :class:`~aiopipe.errors.BadBatchError` and the batches in flight stay intact.
    """

    def __init__(
        self,
        schedule: Schedule,
        stream_pool: StreamPool | None = None,
        executor: str | Executor = "sequential",
        *,
        nvtx: bool | Annotator | None = None,
        trace: bool | Tracer | None = None,
        check_batch: Callable[[Any], None] | None = None,
    ) -> None:
        if stream_pool is None:
            stream_pool = StreamPool({name: None for name in schedule.stream_slots})
        validate_schedule(schedule, stream_pool)
        self._plan = ExecutionPlan(schedule, stream_pool)
        self._executor = make_executor(executor)
        self._executor.bind(self._plan)
        self._ring = BatchRing(self._plan.max_lookahead + 1)
        self._ctx = TaskContext(stream_pool)
        self._annotator = resolve_annotator(nvtx)
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
        # Evicted slot stores stay referenced until the device work queued so far
        # completes: their tensors may still be read by another stream.
        self._retiring: collections.deque[tuple[SlotStore, list[Any]]] = collections.deque()
        # Runs the calls of trio callers on a private asyncio loop; idle until one comes.
        self._trio = TrioBridge()

    # -- introspection ----------------------------------------------------------------

    @property
    def schedule(self) -> Schedule:
        """The schedule, its single-stage tasks in execution (topological) order."""
        return self._plan.schedule

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

    async def progress(self, source: Source) -> Any:
        """Advance until the oldest batch in flight completes; return its
        ``step_result``.  Raises ``StopAsyncIteration`` once every batch of ``source``
        has been returned."""
        if in_trio():  # the engine needs asyncio: hand the call to the bridge (interop.py)
            feed = self._feed
            source = self._trio.source_for(source, feed.source if feed is not None else None)
            return await self._trio.call(SchedulablePipeline.progress, self, source)
        self._begin_call()
        try:
            return await self._progress(source)
        finally:
            self._busy = False

    async def step(self, batch: Any) -> Any:
        """Process one batch to completion and return its result.

        Convenient for feeding batches one at a time; successive calls do not overlap
        (nothing is known about the next batch yet).  Pass an iterator to
        ``progress`` to keep several batches in flight."""
        return await self.progress(iter((batch,)))

    async def results(self, source: Source) -> AsyncIterator[Any]:
        """``async for result in pipe.results(it)``: every remaining result."""
        while True:
            try:
                result = await self.progress(source)
            except StopAsyncIteration:
                return
            yield result

    async def drain(self) -> list[Any]:
        """Stop pulling from the current source and finish the batches in flight;
        return their results.  The source is then forgotten: passing it again
        continues with its next batch, passing another one starts afresh."""
        if in_trio():  # as in progress()
            return await self._trio.call(SchedulablePipeline.drain, self)
        self._begin_call()
        try:
            results: list[Any] = []
            feed = self._feed
            if feed is not None:
                feed.exhausted = True
                while not feed.finished:
                    results.append(await self._progress(feed.source))
            self._feed = None
            return results
        finally:
            self._busy = False

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
        self._retire_all(self._ring.reset())
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
        self._closed = True
        self._executor.shutdown()
        self._trio.close()
        self._retiring.clear()

    async def __aenter__(self) -> SchedulablePipeline:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.shutdown()

    @staticmethod
    def basic(model: Any, optimizer: Any, **options: Any) -> BasicPipeline:
        """The standard training-step preset; see :func:`aiopipe.presets.basic`."""
        from .presets import basic

        return basic(model, optimizer, **options)

    def blocking(self) -> BlockingPipeline:
        """A blocking view for ordinary scripts (``progress`` raises ``StopIteration``)."""
        from .blocking import BlockingPipeline

        return BlockingPipeline(self)

    # -- internals ---------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise PipelineStateError("the pipeline has been shut down")
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

    def _adopt(self, source: Source) -> Feed:
        feed = self._feed
        if feed is not None and source is feed.source:
            return feed
        if feed is not None and feed.in_flight:
            raise PipelineStateError(
                f"a new iterator was passed while {feed.in_flight} batch(es) of the previous "
                f"one are in flight; none of its batches was taken. Keep passing the same "
                f"iterator until StopAsyncIteration, or call drain() first."
            )
        new_feed = Feed(source)
        new_feed.refused, self._seed_refused = self._seed_refused, 0
        self._retire_all(self._ring.reset())
        self._top_pulled = False
        self._feed = new_feed
        return new_feed

    async def _progress(self, source: Source) -> Any:
        feed = self._adopt(source)
        if feed.lost is not None and not feed.exhausted:
            raise PipelineStateError(
                f"{feed.lost}: the rest of its items cannot be read. drain() finishes the "
                f"{feed.in_flight} batch(es) in flight; then pass a new source (a cancel-safe "
                f"one, e.g. a queue or memory channel, survives cancellation)"
            )
        if not self._initialised:
            await self._init_tasks()
        plan, ring = self._plan, self._ring
        while True:
            if not feed.exhausted and not self._top_pulled:
                await self._pull(feed)
            if feed.finished:
                raise StopAsyncIteration
            iteration = feed.iteration
            step = Step(
                plan, ring, self._ctx, iteration, plan.active(iteration, feed.pulled),
                self._annotator, self._tracer, self._lanes,
            )  # fmt: skip
            try:
                await self._executor.run_step(step)
            except BaseException as exc:
                if step.started:
                    self._broken = (
                        f"iteration {iteration} was interrupted by "
                        f"{type(exc).__name__} after some of its tasks ran"
                    )
                raise  # before any task ran: the next call runs this step, batch and all
            self._top_pulled = False
            produced = 0 <= iteration - plan.max_lookahead < feed.pulled
            result = ring.at(0).get(RESULT_SLOT) if produced else None
            self._retire(ring.advance())
            feed.iteration += 1
            if produced:
                feed.returned += 1
                return result

    async def _pull(self, feed: Feed) -> None:
        top = self._ring.top
        if self._seed is not None:
            seed, self._seed = self._seed, None
            for name, value in seed.items():
                top.set(name, value)
        else:
            batch = await feed.next()
            if batch is END:
                feed.exhausted = True
                return
            self._refuse_bad(batch, feed)
            top.set(BATCH_SLOT, batch)
        top.batch_index = feed.pulled
        feed.pulled += 1
        self._top_pulled = True

    def _refuse_bad(self, batch: Any, feed: Feed) -> None:
        """Refuse ``batch`` before it enters the ring; it is dropped, nothing else is."""
        problem: BaseException | None = None
        if batch is None:
            problem = TypeError("the source yielded None")
        elif self._check_batch is not None:
            try:
                self._check_batch(batch)
            except Exception as exc:
                problem = exc
        if problem is None:
            return
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

    def _retire(self, store: SlotStore) -> None:
        pool = self._plan.stream_pool
        retiring = self._retiring
        while retiring and all(ev is None or ev.query() for ev in retiring[0][1]):
            retiring.popleft()
        if pool.is_null:
            return
        retiring.append((store, [pool.record_event(name) for name in pool.names()]))

    def _retire_all(self, stores: list[SlotStore]) -> None:
        for store in stores:
            self._retire(store)

    def __repr__(self) -> str:
        stats = self.statistics()
        return (
            f"<SchedulablePipeline tasks={len(self._plan)} in_flight={stats.in_flight} "
            f"executor={self._executor!r}>"
        )
