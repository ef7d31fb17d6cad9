"""``HSTUPipeline``: the HSTU ranking step on aiopipe, a drop-in for torchrec's
``TrainPipelineSparseDist`` family with the legacy ``(loss, tokens, output)`` result.

It is composed from the generic sparse-dist pipeline (``sparse/base.py``: the
progress contract, the bootstrap that traces the model on the first batch and seeds
that batch, the lifetime), given a :class:`~hstu_tasks.sparse.spec.PipelineSpec` with
the HSTU tasks (``tasks.py``) and its own rewrite of the model: the prefetch variant
installs torchrec's prefetch forwards and contexts, and with a real shuffler the
bootstrap only initialises the input distributions (on a throwaway context), since
the batch it took is not yet this rank's batch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torchrec.distributed.train_pipeline.runtime_forwards import (
    PipelinedForward,
    PrefetchPipelinedForward,
)

from aiopipe import Task, Tracer
from aiopipe.lanes import ThreadMap, copies_on_io

from .data import check_batch
from .megatron import grad_buffer_chunks
from .shuffler import BatchShuffler, IdentityShuffler
from .sparse.base import SparseDistBase
from .sparse.checks import pipeline_device
from .sparse.model import PipelinedModel
from .sparse.spec import PipelineSpec, with_source_wrappers
from .tasks import PipelineState, build_tasks
from .watchdog import LossWatch

_log = logging.getLogger("aiopipe.hstu")  # under "aiopipe": one logger shows the engine and this

__all__ = (
    "HSTU_DEFAULT_THREAD_MAP", "HSTU_DIST_LANE_THREAD_MAP", "HSTU_IO_LANE_THREAD_MAP",
    "HSTUPipeline",
)  # fmt: skip

#: Two lanes: data movement on "io", everything touching the model on "compute" (the
#: only writer of the pipelined modules' context is forward, on that lane).  The
#: default on a CUDA device until the first GPU runs: there the HSTU step is bound by
#: the host's launches, and the second Python thread slowed the compute lane's bodies
#: by 17-36 % (GIL hand-offs); over four runs one lane was never measurably slower
#: (docs/performance.md, "The second GPU run").
HSTU_IO_LANE_THREAD_MAP: dict[str, str] = copies_on_io(
    ("h2d", "start_shuffle", "finish_shuffle"),
    (
        "start_input_dist", "wait_input_dist", "prefetch_embeddings", "zero_grad",
        "global_tokens_allreduce", "nccl_safety_barrier", "forward", "backward",
        "finalize_model_grads", "optimizer_step", "watchdog_step",
    ),
)  # fmt: skip

#: The default, on every device: every task on one lane, "compute".  The copies and
#: collectives still overlap on their own CUDA streams; the lane only submits them.
HSTU_DEFAULT_THREAD_MAP: dict[str, str] = dict.fromkeys(HSTU_IO_LANE_THREAD_MAP, "compute")

#: Three lanes: the input distribution (and prefetch) of the next batch on its own
#: lane, so its waits for the other ranks can overlap this batch's forward and
#: backward where a collective task holds its ticket only while it submits (GPU); on
#: CPU every collective runs inside its task, and the tickets serialise them.
HSTU_DIST_LANE_THREAD_MAP: dict[str, str] = {
    **HSTU_IO_LANE_THREAD_MAP,
    "start_input_dist": "dist",
    "wait_input_dist": "dist",
    "prefetch_embeddings": "dist",
}


def _hstu_spec(shared: PipelinedModel, state: PipelineState, strict: bool) -> PipelineSpec:
    """The HSTU step on a rewrite of the model of its own."""

    def build() -> list[Task]:
        return build_tasks(state)  # looked up per engine: a wrapper installed later applies

    def rewrite_and_seed(peek: Any) -> dict[str, Any]:
        """Copy ``peek``, let torchrec rewrite the model on it and start its input
        distribution: what the first ring slot is seeded with."""
        context = state.create_context(0)
        # With a real shuffler the batch must be shuffled before its input dist: the
        # rewrite initialises the input dists on a throwaway context instead.
        warm_up = None if state.shuffler.is_identity else state.create_context(-1)
        batch = shared.rewrite(peek, context, warm_up=warm_up, strict=strict)
        seed: dict[str, Any] = {"batch_cpu": peek, "batch_gpu": batch, "torchrec_ctx": context}
        if warm_up is None:  # the seeded batch's input dist has started
            seed.update(shuffled_batch=batch, dist_started=True)
        return seed

    def finished() -> None:
        state.watch.flush()  # the last steps' losses, checked before the end

    def release() -> None:
        close = getattr(state.shuffler, "close", None)
        if close is not None:
            close()

    return PipelineSpec(
        what="HSTU pipeline", build_tasks=build, rewrite_and_seed=rewrite_and_seed,
        default_thread_map=HSTU_DEFAULT_THREAD_MAP, check_batch=check_batch,
        turns="",  # its rewrite of the model is its own: one call at a time, no more to say
        finished=finished, release=release, log=_log,
    )  # fmt: skip


class HSTUPipeline(SparseDistBase[tuple[torch.Tensor, torch.Tensor, Any]]):
    """``await progress(it) -> (local_loss_sum, global_tokens, output)``.

    ``model`` is the HSTU model, ``DistributedModelParallel``-wrapped when its tables
    are sharded (otherwise the input-dist tasks have nothing to do).  ``optimizer``
    is its dense optimizer (sharded tables update in backward): ``torch.optim`` with
    torch DDP, Megatron's with Megatron DDP (then ``finalize_model_grads`` finishes
    the gradient reduction).  ``prefetch=True`` adds ``prefetch_embeddings`` and
    keeps ``prefetch_depth + 1`` batches ahead.
    ``thread_map`` defaults to :data:`HSTU_DEFAULT_THREAD_MAP`, every task on lane
    ``"compute"`` (:data:`HSTU_IO_LANE_THREAD_MAP` adds an ``"io"`` lane for the
    batch's copy and shuffle); ``executor`` may be
    ``"sequential"`` or an executor instance instead.  ``trace=True`` (or a
    :class:`aiopipe.Tracer`) records a span per task run (see ``docs/tracing.md``).
    ``name`` labels its log records and trace tracks (the engines that detach/attach
    rebuild all carry it).  ``pipelined_input_dist``: whether torchrec's input
    distribution runs as tasks ahead of ``forward``, on its rewrite of the model; by
    default yes, except on a CPU with one rank, where it distributes nothing
    (:func:`~hstu_tasks.sparse.model.input_dist_pipelined`).  A sharded module the
    rewrite cannot pipeline is warned of at the first ``progress``; ``strict=True``
    makes it an error (as for :class:`~hstu_tasks.SparseDistPipeline`).
    ``end_together`` (by default on with more than one rank): every rank's source
    ends on the shortest one's step, as for :class:`~hstu_tasks.SparseDistPipeline`.
    """

    _state: PipelineState

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
        pipelined_input_dist: bool | None = None,
        strict: bool = False,
        end_together: bool | None = None,
    ) -> None:
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        if prefetch_depth != 1 and not prefetch:
            raise ValueError(
                f"prefetch_depth={prefetch_depth} applies to the prefetch variant only: "
                f"pass prefetch=True (or create 'hstu_prefetch_sparse_dist')"
            )
        device = pipeline_device(device)
        # its own: not shared with other pipelines
        shared = PipelinedModel(
            model, device, owner="an HSTUPipeline", pipelined_input_dist=pipelined_input_dist,
            forward_type=PrefetchPipelinedForward if prefetch else PipelinedForward,
        )  # fmt: skip
        state = PipelineState(
            model=model, optimizer=optimizer, device=device,
            shuffler=batch_shuffler or IdentityShuffler(), prefetch=prefetch,
            prefetch_depth=prefetch_depth, memory_limit_bytes=memory_limit_bytes,
            streams=shared.streams, pipelined_modules=shared.modules,
        )  # fmt: skip
        spec = with_source_wrappers(_hstu_spec(shared, state, strict), end_together)
        super().__init__(shared, state, spec, thread_map=thread_map,
                         executor=executor, trace=trace, name=name)  # fmt: skip

    @property
    def loss_watch(self) -> LossWatch:
        """The check of every step's loss for finiteness (``watchdog_step``).  On a GPU
        its ``pending`` counts the losses copied but not checked yet: how many steps
        the host runs ahead of the device (at most its ``max_lag``)."""
        return self._state.watch

    def attach(self, model: torch.nn.Module | None = None) -> None:
        super().attach(model)
        if model is not None:
            self._state.grad_chunks = grad_buffer_chunks(model)

    def reset(self) -> None:
        super().reset()
        self._state.watch.discard()
