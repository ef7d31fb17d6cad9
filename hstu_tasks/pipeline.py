"""``HSTUPipeline``: the HSTU ranking step on aiopipe, a drop-in for torchrec's
``TrainPipelineSparseDist`` family with the legacy ``(loss, tokens, output)`` result.

The engine is built lazily on the first ``progress``, because torchrec must see one
real batch to trace the model: streams first; peek one batch; copy it to the device
on the memcpy stream; ``_rewrite_model`` installs the pipelined forwards; the input
distribution of that batch starts on the data_dist stream; the batch (with its copy,
context and started input dist) is seeded into the ring, so it is trained like any
other and none is lost.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import Any

import torch
from torchrec.distributed.train_pipeline.runtime_forwards import (
    PipelinedForward,
    PrefetchPipelinedForward,
)
from torchrec.distributed.train_pipeline.utils import (
    _override_input_dist_forwards,
    _pipeline_detach_model,
    _rewrite_model,
    _start_data_dist,
)
from torchrec.distributed.types import ShardedModule

from aiopipe import (
    AsyncExecutor,
    BadBatchError,
    BlockingPipeline,
    PipelineStateError,
    SchedulablePipeline,
    Schedule,
    StreamPool,
    Tracer,
)
from aiopipe.executors.lanes import ThreadMap, resolve_lane
from aiopipe.interop import needs_event_loop
from aiopipe.source import END, Feed, Source, iterate
from aiopipe.trace import resolve_tracer

from .data import check_batch
from .megatron import grad_buffer_chunks
from .shuffler import BatchShuffler, IdentityShuffler
from .sparse_model import STREAMS
from .sparse_model import stream_pool as _stream_pool
from .tasks import PipelineState, build_tasks

_log = logging.getLogger("aiopipe.hstu")  # under "aiopipe": one logger shows the engine and this

__all__ = ("HSTU_DEFAULT_THREAD_MAP", "HSTU_DIST_LANE_THREAD_MAP", "HSTUPipeline")

#: Two lanes: data movement on "io", everything touching the model on "compute"
#: (the only writer of the pipelined modules' context is forward, on that lane).
HSTU_DEFAULT_THREAD_MAP: dict[str, str] = {
    "h2d": "io",
    "start_shuffle": "io",
    "finish_shuffle": "io",
    **{
        name: "compute"
        for name in (
            "start_input_dist", "wait_input_dist", "prefetch_embeddings", "zero_grad",
            "global_tokens_allreduce", "nccl_safety_barrier", "forward", "backward",
            "finalize_model_grads", "optimizer_step", "watchdog_step",
        )
    },
}  # fmt: skip

#: Three lanes: the input distribution (and prefetch) of the next batch on its own
#: lane, so its waits for the other ranks can overlap this batch's forward and
#: backward where a collective task holds its ticket only while it submits (GPU); on
#: CPU every collective runs inside its task, and the tickets serialise them.
HSTU_DIST_LANE_THREAD_MAP: dict[str, str] = {
    **HSTU_DEFAULT_THREAD_MAP,
    "start_input_dist": "dist",
    "wait_input_dist": "dist",
    "prefetch_embeddings": "dist",
}


class HSTUPipeline:
    """``await progress(it) -> (local_loss_sum, global_tokens, output)``.

    ``model`` is the HSTU model, ``DistributedModelParallel``-wrapped when its tables
    are sharded (otherwise the input-dist tasks have nothing to do).  ``optimizer``
    is its dense optimizer (sharded tables update in backward): ``torch.optim`` with
    torch DDP, Megatron's with Megatron DDP (then ``finalize_model_grads`` finishes
    the gradient reduction).  ``prefetch=True`` adds ``prefetch_embeddings`` and
    keeps ``prefetch_depth + 1`` batches ahead.
    ``thread_map`` defaults to :data:`HSTU_DEFAULT_THREAD_MAP`; ``executor`` may be
    ``"sequential"`` or an executor instance instead.  ``trace=True`` (or a
    :class:`aiopipe.Tracer`) records a span per task run (see ``docs/tracing.md``).
    ``name`` labels its log records and trace tracks (the engines that detach/attach
    rebuild all carry it).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        device: torch.device,
        *,
        prefetch: bool = False,
        prefetch_depth: int = 1,
        batch_shuffler: BatchShuffler | None = None,
        thread_map: ThreadMap = None,
        executor: str | Any = None,
        memory_limit_bytes: int | None = None,
        trace: bool | Tracer | None = None,
        name: str = "hstu",
    ) -> None:
        self.name = name
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        if prefetch_depth != 1 and not prefetch:
            raise ValueError(
                f"prefetch_depth={prefetch_depth} applies to the prefetch variant only: "
                f"pass prefetch=True (or create 'hstu_prefetch_sparse_dist')"
            )
        self._state = PipelineState(
            model=model,
            optimizer=optimizer,
            device=torch.device(device),
            shuffler=batch_shuffler or IdentityShuffler(),
            prefetch=prefetch,
            prefetch_depth=prefetch_depth,
            memory_limit_bytes=memory_limit_bytes,
        )
        self._thread_map = thread_map if thread_map is not None else HSTU_DEFAULT_THREAD_MAP
        if executor is None:  # a bad thread map fails here, not after a batch was taken
            for task in build_tasks(self._state):
                resolve_lane(task, self._thread_map)
            if isinstance(self._thread_map, Mapping):  # a misspelt task would go to "default"
                unknown = sorted(set(self._thread_map) - set(HSTU_DEFAULT_THREAD_MAP))
                if unknown:
                    raise ValueError(f"thread_map names no HSTU task {unknown}; the tasks are "
                                     f"{sorted(HSTU_DEFAULT_THREAD_MAP)}")  # fmt: skip
        self._executor_choice = executor
        self._executor_used = False  # an executor instance serves one engine
        # One tracer for the pipeline's lifetime: detach/attach rebuilds keep adding to it.
        self._tracer = resolve_tracer(trace)
        self._engine: SchedulablePipeline | None = None
        self._original_forwards: list[Any] = []
        self._original_kjt_dist_forwards: list[Any] = []
        self._attached = True
        self._closed = False
        self._bootstrapping = False
        # The source's first batch, taken by a bootstrap that then failed: the next
        # bootstrap on that source trains it (nothing lost); and the items refused.
        self._kept: tuple[Source, Any] | None = None
        self._refused: tuple[Source, int] | None = None

    # -- the progress contract ---------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        return self._state.model

    @property
    def tracer(self) -> Tracer | None:
        """The tracer collecting task spans (``trace=`` at construction), if any."""
        return self._tracer

    @property
    def engine(self) -> SchedulablePipeline | None:
        """The underlying engine, once the first progress has built it."""
        return self._engine

    @needs_event_loop
    async def progress(self, source: Source) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Train (or evaluate, in eval mode) one batch; ``StopAsyncIteration`` at the end."""
        if self._closed:
            raise PipelineStateError("the HSTU pipeline has been shut down")
        if not self._attached:
            raise PipelineStateError("the model is detached; call attach() first")
        if self._engine is None:
            if self._bootstrapping:
                raise PipelineStateError(
                    "another progress() is already running on this pipeline; await it first"
                )
            self._bootstrapping = True
            try:
                await self._bootstrap(source)
            finally:
                self._bootstrapping = False
        assert self._engine is not None
        try:
            return await self._engine.progress(source)  # type: ignore[no-any-return]
        except StopAsyncIteration:
            self._state.watch.flush()  # the last steps' losses, checked before the end
            raise

    @needs_event_loop
    async def results(
        self, source: Iterable[Any] | AsyncIterable[Any]
    ) -> AsyncIterator[tuple[torch.Tensor, torch.Tensor, Any]]:
        """``async for loss_sum, tokens, output in pipe.results(loader)``: one result
        per batch, ``progress`` until the end (so the loss watchdog checks the last
        steps too).  An iterable gets a fresh iterator, an iterator continues where
        it stands."""
        source = iterate(source)
        while True:
            try:
                result = await self.progress(source)
            except StopAsyncIteration:
                return
            yield result

    @needs_event_loop
    async def drain(self) -> list[Any]:
        """Finish the batches in flight (e.g. before switching train -> eval)."""
        results = [] if self._engine is None else await self._engine.drain()
        self._state.watch.flush()
        return results

    async def aclose(self) -> None:
        """Wait for an iteration whose caller was cancelled, then shut down
        (``async with`` calls it)."""
        if self._engine is not None:
            await self._engine.aclose()
        self.shutdown()

    def blocking(self) -> BlockingPipeline:
        """The torchrec-style blocking form: ``progress(it)`` raises ``StopIteration``."""
        return BlockingPipeline(self)

    # -- attach / detach ---------------------------------------------------------------

    def detach(self) -> torch.nn.Module:
        """Give the model back with its original forwards.  Refused while batches are
        in flight (``drain()`` first); ``attach()`` + ``progress`` rebuild cleanly."""
        engine = self._engine
        if engine is not None and engine.statistics().in_flight:
            raise PipelineStateError(
                f"{engine.statistics().in_flight} batch(es) are in flight; drain() first "
                f"(or reset(), after a failed progress)"
            )
        self._teardown()
        self._attached = False
        return self._state.model

    def attach(self, model: torch.nn.Module | None = None) -> None:
        """Train again after ``detach()``; the next ``progress`` rebuilds the pipeline.
        ``model`` swaps in another model, stepped by the same optimizer (so it must
        hold that optimizer's parameters); refused while the pipeline runs."""
        if model is not None:
            if self._engine is not None:
                raise PipelineStateError(
                    "the pipeline is running on its model: detach() before attaching another"
                )
            self._state.model = model
            self._state.grad_chunks = grad_buffer_chunks(model)
        self._attached = True

    def reset(self) -> None:
        """After a failed progress (the engine then refuses to go on; a cancelled one
        needs nothing, its iteration finishes and the next call returns its result):
        drop the batches in flight and give the model its own forwards back; the next
        ``progress`` rebuilds the pipeline on whatever source it gets.  The failed
        step may have applied part of its update: resume from a checkpoint when the
        run must stay exact.  In a multi-rank job every rank resets together."""
        if self._closed:
            raise PipelineStateError("the HSTU pipeline has been shut down")
        self._teardown()
        self._state.watch.discard()
        self._kept = self._refused = None

    # -- lifetime ----------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._teardown()
        close = getattr(self._state.shuffler, "close", None)
        if close is not None:
            close()
        self._closed = True

    async def __aenter__(self) -> HSTUPipeline:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _teardown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._state.pipelined_modules:
            _pipeline_detach_model(
                model=self._state.model,
                pipelined_modules=self._state.pipelined_modules,
                original_forwards=self._original_forwards,
                original_kjt_dist_forwards=self._original_kjt_dist_forwards,
                pipelined_postprocs=[],
            )
            self._state.pipelined_modules = []

    # -- bootstrap ---------------------------------------------------------------------

    async def _bootstrap(self, source: Source) -> None:
        """Build the engine, then take the source's first batch, trace the model on it
        and seed it.  Whatever fails leaves the model as it was and keeps the batch."""
        state = self._state
        pool = _stream_pool(state.device)  # streams first: bootstrap work uses them
        state.streams = {name: pool.get(name) for name in pool.names()}
        engine = SchedulablePipeline(
            Schedule.of(build_tasks(state), stream_slots=STREAMS), pool, self._new_executor(),
            trace=self._tracer, check_batch=check_batch, name=self.name,
        )  # fmt: skip
        try:
            peek = await self._first_batch(source)
            seed = self._rewrite_and_seed(pool, peek)
            engine.seed_first_batch(seed, refused=self._refused_from(source))
        except BaseException:
            engine.shutdown()
            self._teardown()  # the model's own forwards back, if they were replaced
            raise
        self._engine, self._kept, self._refused = engine, None, None
        _log.info("%s: bootstrap done: the engine is built and the source's first batch "
                  "seeded", self.name)  # fmt: skip

    def _new_executor(self) -> Any:
        choice = self._executor_choice
        if choice is None:
            return AsyncExecutor(self._thread_map)
        if not isinstance(choice, str):
            if self._executor_used:
                raise PipelineStateError(
                    "the executor instance given to HSTUPipeline served the pipeline that "
                    "detach()/reset() tore down, and an executor serves one pipeline; build "
                    "a new HSTUPipeline, or pass thread_map= instead of an executor instance"
                )
            self._executor_used = True
        return choice

    async def _first_batch(self, source: Source) -> Any:
        """The source's first batch: the one a failed bootstrap kept, or a new one."""
        if self._kept is not None:
            kept_source, batch = self._kept
            if kept_source is not source:
                raise PipelineStateError(
                    "a batch taken from the previous source is still waiting to be "
                    "trained: pass that source again, or reset() to drop the batch"
                )
            return batch
        batch, _ = await Feed(source, read_ahead=False).take()
        if batch is END:
            raise StopAsyncIteration
        try:
            check_batch(batch)
        except (TypeError, ValueError) as exc:  # nothing in flight yet: nothing else lost
            self._refused = (source, self._refused_from(source) + 1)
            raise BadBatchError(f"the source's first batch was refused: {exc}") from exc
        self._kept = (source, batch)
        return batch

    def _refused_from(self, source: Source) -> int:
        """First batches of ``source`` refused before the engine existed."""
        return self._refused[1] if self._refused and self._refused[0] is source else 0

    def _rewrite_and_seed(self, pool: StreamPool, peek: Any) -> dict[str, Any]:
        """Copy ``peek``, let torchrec rewrite the model on it and start its input
        distribution: what the first ring slot is seeded with."""
        state = self._state
        context = state.create_context(0)
        with pool.use("memcpy"):
            batch = peek.to(state.device, non_blocking=True)
        pool.wait_stream("data_dist", "memcpy")
        modules: list[Any] = []
        self._original_kjt_dist_forwards = []
        if any(isinstance(m, ShardedModule) for m in state.model.modules()):
            forward_type = PrefetchPipelinedForward if state.prefetch else PipelinedForward
            modules, _, originals, _, _ = _rewrite_model(
                model=state.model,
                context=context,
                dist_stream=state.streams["data_dist"],
                default_stream=state.streams["default"],
                batch=batch,
                pipelined_forward=forward_type,
            )
            state.pipelined_modules, self._original_forwards = modules, originals
        # else an unsharded model: nothing to distribute, the input-dist tasks idle
        seed: dict[str, Any] = {"batch_cpu": peek, "batch_gpu": batch, "torchrec_ctx": context}
        with pool.use("data_dist"):
            if state.shuffler.is_identity:
                _start_data_dist(modules, batch, context)  # the seeded batch's input dist
                seed.update(shuffled_batch=batch, dist_started=True)
            else:  # the real batch must be shuffled first: initialise on a throwaway
                _initialise_input_dists(modules, batch, state.create_context(-1))
        self._original_kjt_dist_forwards = _override_input_dist_forwards(modules)
        return seed


def _initialise_input_dists(modules: list[Any], batch: Any, context: Any) -> None:
    """Run one complete input distribution so every input dist exists (torchrec
    creates them lazily), leaving no collective pending."""
    _start_data_dist(modules, batch, context)
    for names, awaitable in context.fused_splits_awaitables:
        for request in awaitable.wait():
            request.wait()

