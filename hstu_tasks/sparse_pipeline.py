"""``SparseDistPipeline`` and ``SparseDistEvalPipeline``: torchrec's
``TrainPipelineSparseDist`` and ``EvalPipelineSparseDist`` for any sharded model,
on aiopipe's engine.

Each pipeline has its own engine, ring and source; the pipelines of one model share
its torchrec rewrite (``sparse_model.py``).  So training and evaluation interleave
on one model without a drain: an evaluation pass leaves the training batches in
flight where they are, and training goes on with them afterwards -- every output
belongs to its own pipeline's batch, and the training is the one a run without the
evaluation passes does.  The first batch a model sees traces it: that batch is
copied, the model rewritten and its input distribution started, then seeded into the
ring (trained like any other).

A source that has ended is forgotten: passing the same iterator object again reads it
afresh (a ``DataLoader`` with ``persistent_workers=True`` hands out one iterator
object, reset by every ``iter(loader)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Self

import torch
from torchrec.streamable import Pipelineable

from aiopipe import AsyncExecutor, BadBatchError, BlockingPipeline, PipelineStateError, SchedulablePipeline
from aiopipe import Schedule, Tracer
from aiopipe.executors.lanes import ThreadMap, resolve_lane
from aiopipe.interop import needs_event_loop
from aiopipe.source import END, Feed, Source
from aiopipe.trace import resolve_tracer

from .sparse_model import STREAMS, PipelinedModel
from .sparse_sources import without_last_two
from .sparse_tasks import SPARSE_DIST_THREAD_MAP, ModelForward, SparseDistState
from .sparse_tasks import build_sparse_dist_tasks

__all__ = ("SparseDistEvalPipeline", "SparseDistPipeline")


def check_pipelineable(batch: object) -> None:
    """torchrec pipelines ``Pipelineable`` batches (``to``, ``record_stream``,
    ``pin_memory``) and tensors."""
    if not isinstance(batch, (Pipelineable, torch.Tensor)):
        raise TypeError(f"expected a torchrec Pipelineable batch (to, record_stream, "
                        f"pin_memory) or a tensor, got {type(batch).__name__}")  # fmt: skip


class _SparseDistBase:
    """The progress contract, bootstrap and lifetime the two pipelines share."""

    _what = "sparse-dist pipeline"

    def __init__(self, model: torch.nn.Module, optimizer: Any, device: torch.device | str,
                 model_fwd: ModelForward | None, evaluation: bool, thread_map: ThreadMap,
                 executor: str | Any, trace: bool | Tracer | None) -> None:  # fmt: skip
        device = torch.device(device)
        self._shared = PipelinedModel.of(model, device)
        self._state = SparseDistState(
            model=model, optimizer=optimizer, device=device, model_fwd=model_fwd,
            evaluation=evaluation, pipelined_modules=self._shared.modules,
        )  # fmt: skip
        self._thread_map = thread_map if thread_map is not None else SPARSE_DIST_THREAD_MAP
        if executor is None:  # a bad thread map fails here, not after a batch was taken
            for task in build_sparse_dist_tasks(self._state):
                resolve_lane(task, self._thread_map)
        self._executor_choice = executor
        self._executor_used = False
        self._tracer = resolve_tracer(trace)
        self._closed = False
        # The first batch a failed bootstrap took: the next bootstrap on that source
        # trains it (nothing lost).
        self._kept: tuple[Source, Any] | None = None

    # -- the progress contract ---------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        return self._state.model

    @property
    def tracer(self) -> Tracer | None:
        return self._tracer

    @property
    def engine(self) -> SchedulablePipeline | None:
        """The underlying engine, once the first progress has built it."""
        return self._shared.engines.get(self)

    @needs_event_loop
    async def progress(self, source: Source) -> Any:
        """One batch's ``output``; ``StopAsyncIteration`` once ``source`` has ended."""
        if self._closed:
            raise PipelineStateError(f"the {self._what} has been shut down")
        if not self._shared.attached:
            raise PipelineStateError("the model is detached; call attach() first")
        with self._taking_turn("progress()"):
            return await self._progress(self._adapt(source))

    @contextlib.contextmanager
    def _taking_turn(self, call: str) -> Iterator[None]:
        """The pipelines of one model run one call at a time."""
        shared = self._shared
        if shared.busy is not None:
            raise PipelineStateError(
                f"another progress() or drain() is running on this model; await it before "
                f"calling {call} (the pipelines of one model take turns: they share its "
                f"torchrec rewrite)"
            )
        shared.busy = self
        try:
            yield
        finally:
            shared.busy = None

    async def _progress(self, source: Source) -> Any:
        engine = self.engine
        if engine is None:
            await self._bootstrap(source)
            engine = self.engine
            assert engine is not None
        await self._finish_others(engine)
        try:
            return await engine.progress(source)
        except StopAsyncIteration:
            await engine.drain()  # forget the source: the same object may start anew
            self._ended(source)
            raise

    @needs_event_loop
    async def drain(self) -> list[Any]:
        """Finish the batches in flight and return their outputs; the source is then
        forgotten (pass it again to go on with its next batch)."""
        engine = self.engine
        if engine is None:
            return []
        with self._taking_turn("drain()"):
            await self._finish_others(engine)
            return await engine.drain()

    async def _finish_others(self, engine: SchedulablePipeline) -> None:
        """Wait for an iteration of another pipeline on the model whose caller was
        cancelled (it runs on; two engines must not run on one model at once)."""
        for other in list(self._shared.engines.values()):
            if other is not engine and other._running is not None:
                await other._finish_running()

    async def aclose(self) -> None:
        """Wait for an iteration whose caller was cancelled, then shut down."""
        engine = self.engine
        if engine is not None:
            await engine.aclose()
        self.shutdown()

    def blocking(self) -> BlockingPipeline:
        """The torchrec-style blocking form: ``progress(it)`` raises ``StopIteration``."""
        return BlockingPipeline(self)

    def _adapt(self, source: Source) -> Source:
        return source

    def _ended(self, source: Source) -> None:
        """``source`` ended and was forgotten."""

    # -- attach / detach / reset / shutdown ---------------------------------------------

    def detach(self) -> torch.nn.Module:
        """Give the model back with its original forwards, to every pipeline on it.
        Refused while any of them has batches in flight (``drain()`` first)."""
        in_flight = self._shared.in_flight()
        if in_flight:
            raise PipelineStateError(
                f"{in_flight} batch(es) are in flight in the pipelines on this model; "
                f"drain() them first (or reset(), after a failed progress)"
            )
        for engine in self._shared.engines.values():  # every pipeline builds a new one
            engine.shutdown()
        self._shared.engines.clear()
        self._shared.restore()
        self._shared.attached = False
        return self._state.model

    def attach(self, model: torch.nn.Module | None = None) -> None:
        """Go on after ``detach()``; the next ``progress`` traces the model again.
        ``model`` swaps in another one (stepped by the same optimizer)."""
        if model is not None and model is not self._state.model:
            if self._shared.engines:
                raise PipelineStateError(
                    "the pipeline is running on its model: detach() before attaching another"
                )
            self._shared.replace_model(model)
            self._state.model = model
        self._shared.attached = True

    def reset(self) -> None:
        """After a failed progress: drop this pipeline's batches in flight; the next
        ``progress`` starts afresh on whatever source it gets.  In a multi-rank job
        every rank resets together."""
        if self._closed:
            raise PipelineStateError(f"the {self._what} has been shut down")
        self._teardown()
        self._kept = None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._teardown()
        self._closed = True

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _teardown(self) -> None:
        """Shut this pipeline's engine down; the last engine on the model gives the
        model its own forwards back (a failed step may have left torchrec's state
        half-way)."""
        engine = self._shared.engines.pop(self, None)
        if engine is not None:
            engine.shutdown()
        if not self._shared.engines:
            self._shared.restore()

    # -- bootstrap ---------------------------------------------------------------------

    async def _bootstrap(self, source: Source) -> None:
        """Build the engine; on a model not traced yet, take the source's first batch,
        rewrite the model on it and seed it.  A failure leaves the model as it was and
        keeps the batch."""
        engine = SchedulablePipeline(
            Schedule.of(build_sparse_dist_tasks(self._state), stream_slots=STREAMS),
            self._shared.pool, self._new_executor(), trace=self._tracer,
            check_batch=check_pipelineable,
        )  # fmt: skip
        try:
            if not self._shared.rewritten:
                engine.seed_first_batch(self._shared.rewrite(await self._first_batch(source)))
        except BaseException:
            engine.shutdown()
            if not self._shared.engines:
                self._shared.restore()
            raise
        self._kept = None
        self._shared.engines[self] = engine

    def _new_executor(self) -> Any:
        choice = self._executor_choice
        if choice is None:
            return AsyncExecutor(self._thread_map)
        if not isinstance(choice, str):
            if self._executor_used:
                raise PipelineStateError(
                    f"the executor instance given to the {self._what} served the engine "
                    f"that detach()/reset() tore down, and an executor serves one engine; "
                    f"pass thread_map= instead of an executor instance"
                )
            self._executor_used = True
        return choice

    async def _first_batch(self, source: Source) -> Any:
        if self._kept is not None:
            kept_source, batch = self._kept
            if kept_source is not source:
                raise PipelineStateError(
                    "a batch taken from the previous source is still waiting: pass that "
                    "source again, or reset() to drop the batch"
                )
            return batch
        batch, _ = await Feed(source, read_ahead=False).take()
        if batch is END:
            raise StopAsyncIteration
        try:
            check_pipelineable(batch)
        except TypeError as exc:  # nothing in flight yet: nothing else lost
            raise BadBatchError(f"the source's first batch was refused: {exc}") from exc
        self._kept = (source, batch)
        return batch


class SparseDistPipeline(_SparseDistBase):
    """torchrec's ``TrainPipelineSparseDist(model, optimizer, device,
    execute_all_batches=..., custom_model_fwd=...)`` on aiopipe.

    ``await progress(it)`` trains one batch and returns the ``output`` of
    ``model_fwd(batch) -> (losses, output)`` (the model, or ``custom_model_fwd``);
    backward differentiates ``torch.sum(losses, dim=0)``.  With the model in eval mode
    a step runs forward only, as in torchrec; :meth:`eval_pipeline` evaluates without
    touching the training batches in flight.  ``execute_all_batches=False`` drops the
    last two batches of each source, as torchrec does.  ``thread_map`` defaults to
    :data:`~hstu_tasks.sparse_tasks.SPARSE_DIST_THREAD_MAP`; ``executor`` may be
    ``"sequential"`` or an executor instance; ``trace=True`` records task spans.
    """

    _what = "sparse-dist pipeline"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        device: torch.device | str,
        execute_all_batches: bool = True,
        *,
        custom_model_fwd: ModelForward | None = None,
        thread_map: ThreadMap = None,
        executor: str | Any = None,
        trace: bool | Tracer | None = None,
    ) -> None:
        super().__init__(model, optimizer, device, custom_model_fwd, False, thread_map,
                         executor, trace)  # fmt: skip
        self._execute_all_batches = execute_all_batches
        # execute_all_batches=False: each source's wrapper, kept until the source ends
        # (a wrapper holds the two items it read ahead; drain() may leave one unended)
        self._held: dict[int, tuple[Source, Source]] = {}

    def eval_pipeline(
        self,
        *,
        custom_model_fwd: ModelForward | None = None,
        thread_map: ThreadMap = None,
        executor: str | Any = None,
        trace: bool | Tracer | None = None,
    ) -> SparseDistEvalPipeline:
        """An evaluation pipeline on the same model (``custom_model_fwd`` defaults to
        this pipeline's)."""
        state = self._state
        return SparseDistEvalPipeline(
            state.model, None, state.device, custom_model_fwd=custom_model_fwd or state.model_fwd,
            thread_map=thread_map, executor=executor, trace=trace,
        )  # fmt: skip

    def _adapt(self, source: Source) -> Source:
        if self._execute_all_batches:
            return source
        held = self._held.get(id(source))
        if held is None:
            held = self._held[id(source)] = (source, without_last_two(source))
        return held[1]

    def _ended(self, source: Source) -> None:
        for key, (_, wrapper) in list(self._held.items()):
            if wrapper is source:
                del self._held[key]

    def reset(self) -> None:
        super().reset()
        self._held.clear()


class SparseDistEvalPipeline(_SparseDistBase):
    """torchrec's ``EvalPipelineSparseDist(model, optimizer, device)`` on aiopipe:
    ``await progress(it)`` returns ``model_fwd(batch)[1]`` computed in eval mode
    (every module's own mode is restored after each forward) and without autograd;
    there is no backward and no optimizer step (``optimizer`` may be ``None``).

    Built on a model that a :class:`SparseDistPipeline` runs (or via its
    :meth:`~SparseDistPipeline.eval_pipeline`), it shares that pipeline's rewrite of
    the model and leaves its batches in flight alone."""

    _what = "sparse-dist eval pipeline"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        device: torch.device | str,
        *,
        custom_model_fwd: ModelForward | None = None,
        thread_map: ThreadMap = None,
        executor: str | Any = None,
        trace: bool | Tracer | None = None,
    ) -> None:
        super().__init__(model, optimizer, device, custom_model_fwd, True, thread_map,
                         executor, trace)  # fmt: skip
