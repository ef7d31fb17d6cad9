"""``SparseDistBase``: what every pipeline on a torchrec-rewritten model shares --
the progress contract, the bootstrap that traces the model on the first batch, and
the lifetime (detach / attach / reset / shutdown).

A pipeline gives its state and a :class:`~.spec.PipelineSpec` (its task list, the
check a batch must pass, the first ring slot's contents, ...); the generic
sparse-dist pipelines (``pipeline.py``) and the HSTU pipeline
(``hstu_tasks/pipeline.py``) are built so.  The engine is built on the first
``progress``, because torchrec must see one real batch to trace the model: that batch
is copied, the model rewritten and its input distribution started, then seeded into
the ring (trained like any other; none is lost).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, Iterable, Iterator
from typing import Any, Generic, Self, TypeVar

import torch

from aiopipe import Executor, PipelineStateError
from aiopipe import PipelineStatistics, Schedule, SchedulablePipeline, StreamPool, Tracer
from aiopipe.protocols import Results
from aiopipe.interop import needs_event_loop
from aiopipe.lanes import ThreadMap
from aiopipe.sources import Source
from aiopipe.trace import resolve_tracer

from .blocking import BlockingSparseDist
from .counts import CountsAcrossResets
from .engine_executors import EngineExecutors
from .first_batch import FirstBatch
from .model import STREAMS, PipelinedModel
from .spec import PipelineSpec

__all__ = ("SparseDistBase",)

#: What one step of a pipeline returns (``progress``, ``results``, ``drain``).
ResultT = TypeVar("ResultT")


class SparseDistBase(Generic[ResultT]):
    """The progress contract, bootstrap and lifetime of a pipeline on ``shared``'s
    model; ``state`` is what its tasks share, ``spec`` what the pipeline's kind gives,
    ``ResultT`` what a step returns.  ``executor`` and ``thread_map`` are resolved by
    :func:`aiopipe.executors.resolve_executor` (with ``spec.default_thread_map``)."""

    def __init__(self, shared: PipelinedModel, state: Any, spec: PipelineSpec, *,
                 thread_map: ThreadMap, executor: str | Executor | None,
                 trace: bool | Tracer | None, name: str | None = None) -> None:  # fmt: skip
        self.name = name
        self._shared, self._state, self._spec = shared, state, spec
        self._executors = EngineExecutors(
            executor, thread_map, device=shared.device, what=spec.what, tasks=spec.build_tasks,
            default_thread_map=spec.default_thread_map,
        )  # fmt: skip
        # One tracer for the pipeline's lifetime: detach/attach rebuilds keep adding to it.
        self._tracer = resolve_tracer(trace)
        self._closed = False
        self._ended_source: Source | None = None  # the source whose end progress() reported
        self._fed: Source | None = None  # the source the engine was last given
        self._counts = CountsAcrossResets()  # the same source going on after reset()
        # What the bootstrap takes before the engine exists.
        self._first = FirstBatch(spec.check_batch, self._counts.discard)
        shared.pipelines.add(self)  # built: it has the model until shut down or detached

    # -- the progress contract ---------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        return self._state.model  # type: ignore[no-any-return]

    @property
    def tracer(self) -> Tracer | None:
        """The tracer collecting task spans (``trace=`` at construction), if any."""
        return self._tracer

    @property
    def engine(self) -> SchedulablePipeline | None:
        """The underlying engine, once the first progress has built it."""
        return self._shared.engines.get(self)

    @property
    def schedule(self) -> Schedule:
        """The schedule the engine runs (``aiopipe validate`` and ``aiopipe graph`` take
        the pipeline, or a function that returns it)."""
        engine = self.engine
        return engine.schedule if engine is not None else self._new_schedule()

    @property
    def executor(self) -> Executor:
        """The engine's executor, or the one the next engine gets."""
        engine = self.engine
        return engine.executor if engine is not None else self._executors.next

    @property
    def stream_pool(self) -> StreamPool:
        """The streams of the model's pipelines (torchrec's)."""
        return self._shared.pool

    def statistics(self) -> PipelineStatistics:
        """Where the pipeline stands in its current source: the engine's
        :meth:`~aiopipe.SchedulablePipeline.statistics`.  Before the first ``progress``
        has built the engine (and after ``detach()`` or ``reset()``), nothing is in
        flight; ``refused`` counts the source's first items refused before then."""
        engine = self.engine
        return self._counts.shown(
            engine.statistics() if engine is not None else self._before_engine()
        )  # fmt: skip

    def _before_engine(self, taken: int = 0) -> PipelineStatistics:
        """This pipeline's own counts while no engine is built: the items a bootstrap
        refused (and ``taken``, for ``reset()``: those it took and holds)."""
        refused = self._first.refused
        return PipelineStatistics(
            pulled=0, returned=0, in_flight=taken, iteration=0, exhausted=False,
            broken=None, closed=self._closed, refused=refused, position=refused,
            read_ahead=taken,
        )  # fmt: skip

    @needs_event_loop
    async def progress(self, source: Source) -> ResultT:
        """One batch's result; ``StopAsyncIteration`` once ``source`` has ended."""
        if self._closed:
            raise PipelineStateError(f"the {self._spec.what} has been shut down")
        if not self._shared.attached:
            raise PipelineStateError("the model is detached; call attach() first")
        with self._taking_turn("progress()"):
            self._counts.passed(source)
            return await self._progress(self._spec.adapt(source))

    @needs_event_loop
    async def progress_many(self, source: Source, steps: int) -> list[ResultT]:
        """Up to ``steps`` results in one call, ``[]`` once ``source`` has ended: the
        engine's :meth:`~aiopipe.SchedulablePipeline.progress_many` (the lanes chain
        the steps asked for)."""
        if self._closed:
            raise PipelineStateError(f"the {self._spec.what} has been shut down")
        if not self._shared.attached:
            raise PipelineStateError("the model is detached; call attach() first")
        with self._taking_turn("progress_many()"):
            self._counts.passed(source)
            results: list[ResultT] = await self._progress(self._spec.adapt(source), steps)
            return results

    @needs_event_loop
    def results(self, source: Iterable[Any] | AsyncIterable[Any]) -> Results[ResultT]:
        """``async for result in pipe.results(loader)``: ``progress`` until the end (an
        iterable gets a fresh iterator, an iterator continues where it stands)."""
        return Results(self, source)

    def abandon_source(self, source: Source, *, fresh: bool = False) -> None:
        """The caller is done with ``source`` although batches of it are in flight
        (``results()`` calls it when its loop is left early): if another source comes
        next, they are discarded untrained (``statistics().discarded``), as the
        engine's :meth:`~aiopipe.SchedulablePipeline.abandon_source` says."""
        engine = self.engine
        if engine is not None:
            engine.abandon_source(self._spec.adapt(source), fresh=fresh)

    @contextlib.contextmanager
    def _taking_turn(self, call: str) -> Iterator[None]:
        """The pipelines of one model run one call at a time."""
        shared = self._shared
        if shared.busy is not None:
            raise PipelineStateError(
                f"another progress() or drain() is running on this model; await it before "
                f"calling {call}{self._spec.turns}"
            )
        shared.busy = self
        try:
            yield
        finally:
            shared.busy = None

    async def _progress(self, source: Source, steps: int | None = None) -> Any:
        """One result (``steps`` None), or up to ``steps`` of them in a list."""
        try:
            engine = self.engine
            built = engine is None
            if engine is None:
                await self._bootstrap(source)  # a source with no batch left ends here
                engine = self.engine
                assert engine is not None
            await self._finish_others(engine)
            if self._fed is not source:
                self._end_unreported(engine)
                self._fed = source
            if source is self._ended_source and not built:
                # The source that ended, passed again: read it afresh (a persistent-worker
                # loader hands out one iterator object, reset by every iter(loader)).
                await engine.drain()
            self._ended_source = None
            if steps is None:
                return await engine.progress(source)
            results = await engine.progress_many(source, steps)
            if not results:
                raise StopAsyncIteration
            return results
        except StopAsyncIteration:
            self._ended_source = source  # the engine keeps its statistics until then
            self._counts.end_reported()
            self._spec.ended(source)
            self._spec.finished()
            if steps is not None:
                return []
            raise

    def _end_unreported(self, engine: SchedulablePipeline) -> None:
        """Another source comes after one read to its end, every result returned, but
        never told (a loop of exactly as many calls as batches): that pass ends here,
        a partial accumulation group stepping, as when a call reports the end."""
        stats, previous = engine.statistics(), self._fed
        if (previous is not None and previous is not self._ended_source and stats.exhausted
                and not stats.in_flight):  # fmt: skip
            self._spec.ended(previous)
            self._spec.finished()

    @needs_event_loop
    async def drain(self) -> list[ResultT]:
        """Finish the batches in flight and return their results; the source is then
        forgotten (pass it again to go on with its next batch)."""
        results: list[ResultT] = []
        engine = self.engine
        if engine is not None:
            with self._taking_turn("drain()"):
                await self._finish_others(engine)
                results = await engine.drain()
        self._spec.finished()
        return results

    async def _finish_others(self, engine: SchedulablePipeline) -> None:
        """Wait for an iteration of another pipeline on the model whose caller was
        cancelled (it runs on; two engines must not run on one model at once)."""
        engines = self._shared.engines
        if len(engines) < 2:  # this one alone, as in most steps: skip the weak-dict walk
            return
        for other in list(engines.values()):
            if other is not engine and not other.idle:
                await other.wait_idle()

    async def aclose(self) -> None:
        """Wait for an iteration whose caller was cancelled, then shut down
        (``async with`` calls it)."""
        engine = self.engine
        if engine is not None:
            await engine.aclose()
        self.shutdown()

    def blocking(self) -> BlockingSparseDist:
        """The torchrec-style blocking form: ``progress(it)`` raises ``StopIteration``;
        ``detach()``, ``attach()`` and a training pipeline's ``eval_pipeline()`` too."""
        return BlockingSparseDist(self)

    # -- attach / detach / reset / shutdown ---------------------------------------------

    def detach(self) -> torch.nn.Module:
        """Give the model back with its original forwards, to every pipeline on it.
        Refused while any of them has batches in flight (``drain()`` first)."""
        taken = self._shared.taken_by()
        if taken is not None:
            raise PipelineStateError(f"{taken.owner} has the model now (this pipeline was "
                                     f"detached before it took it): detach() that one")  # fmt: skip
        in_flight = self._shared.in_flight()
        if in_flight:
            raise PipelineStateError(
                f"{in_flight} batch(es) are in flight in the pipelines on this model; "
                f"drain() them first (or reset(), after a failed progress)"
            )
        self._ended_source = None
        for pipeline, engine in self._shared.engines.items():  # every one builds a new one
            stats = engine.statistics()
            engine.shutdown()
            pipeline._counts.engine_gone(stats)
        self._shared.engines.clear()
        self._shared.restore()
        self._shared.attached = False
        return self.model

    def attach(self, model: torch.nn.Module | None = None) -> None:
        """Go on after ``detach()``; the next ``progress`` traces the model again.
        ``model`` swaps in another one, stepped by the same optimizer (so it must hold
        that optimizer's parameters); refused while the pipeline runs."""
        if model is not None:
            if self._shared.engines:
                raise PipelineStateError(
                    "the pipeline is running on its model: detach() before attaching another"
                )
            if model is not self._state.model:
                self._shared.replace_model(model)
                self._state.model = model
        self._shared.claim()  # another kind may have had the model meanwhile
        self._shared.attached = True

    def reset(self) -> None:
        """After a failed progress (the engine then refuses to go on; a cancelled one
        needs nothing, its iteration finishes and the next call returns its result):
        drop this pipeline's batches in flight (those read ahead too); the next
        ``progress`` starts afresh on whatever source it gets.  The same source goes
        on from where it stands, and ``statistics()`` counts on, past the batches
        dropped -- those ``end_together`` or ``execute_all_batches=False`` had read
        ahead too (:class:`~hstu_tasks.sparse.counts.CountsAcrossResets`).  The failed
        step may have applied part of its update: resume from a checkpoint when the
        run must stay exact.  In a multi-rank job every rank resets together."""
        if self._closed:
            raise PipelineStateError(f"the {self._spec.what} has been shut down")
        engine = self._shared.engines.get(self)
        if engine is not None:
            engine.reset()  # refused, naming reset(), while a step runs on: nothing changes
        source = self._counts.source
        wrapped = self._spec.forget_sources(source)
        if engine is not None:
            self._counts.reset(engine.statistics(), wrapped)
        elif (taken := self._first.taken_of(source)) or wrapped:
            # No engine since the last reset: the first batch a bootstrap took (kept, or
            # its pull's) is dropped with what the wrapper read; the source goes on past.
            self._counts.reset(self._before_engine(taken), wrapped)
        self._teardown()
        self._first.drop()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._teardown()
        self._first.drop_pull()
        self._closed = True
        self._shared.pipelines.discard(self)
        self._spec.release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _teardown(self) -> None:
        """Shut this pipeline's engine down; the last engine on the model gives the
        model its own forwards back (a failed step may have left torchrec's state
        half-way)."""
        engine = self._shared.engines.get(self)
        if engine is not None:
            # Refused while a step runs: the engine, its batches in flight and the
            # model's rewritten forwards are all left as they were.
            stats = engine.statistics()
            engine.shutdown()
            self._counts.engine_gone(stats)
            del self._shared.engines[self]
        self._ended_source = self._fed = None
        if not self._shared.engines:
            self._shared.restore()

    # -- bootstrap ---------------------------------------------------------------------

    async def _bootstrap(self, source: Source) -> None:
        """Build the engine; on a model not traced yet, take the source's first batch,
        rewrite the model on it and seed it.  A failure leaves the model as it was and
        keeps the batch (seeded as it is once another pipeline has traced the model)."""
        spec = self._spec
        engine = SchedulablePipeline(
            self._new_schedule(), self._shared.pool,
            self._executors.take(type(self).__name__), trace=self._tracer,
            check_batch=spec.check_batch, name=self.name,
        )  # fmt: skip
        try:
            seed: dict[str, Any] | None = None
            first = self._first
            if not self._shared.installed:
                seed = spec.rewrite_and_seed(await first.take(source, self._counts.source))
            elif first.waits(source):
                # Another pipeline traced the model since this one's bootstrap failed
                # or was cancelled: the batch it kept, the one its pull is taking (or
                # the one after those it refused) is still next.
                seed = {"batch_cpu": await first.take(source, self._counts.source)}
            else:
                first.drop_other_pull()  # another source's, as take() would
            if seed is not None:
                engine.seed_first_batch(seed, refused=first.refused_from(source))
            if numbered := self._counts.batches_before():  # the same source after reset()
                engine.continue_numbering(source, numbered)
        except BaseException:
            engine.shutdown()
            if not self._shared.engines:
                self._shared.restore()
            raise
        self._first.trained()
        self._shared.engines[self] = engine
        if spec.log is not None:
            spec.log.info("%s: bootstrap done: the engine is built and the source's first "
                          "batch seeded", self.name)  # fmt: skip

    def _new_schedule(self) -> Schedule:
        """A schedule of fresh tasks of this pipeline's kind."""
        return Schedule.of(self._spec.build_tasks(), stream_slots=STREAMS)
