"""``PipelineSpec``: what one kind of pipeline on a torchrec-rewritten model gives the
shared machinery (``base.SparseDistBase``) -- its tasks, its rewrite of the model on
the first batch, the check a batch must pass, and what it does when a source ends.

The generic sparse-dist pipelines (``pipeline.py``) and the HSTU pipeline
(``hstu_tasks/pipeline.py``) each build one and pass it to the base's constructor;
neither overrides the base's internals.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec.streamable import Pipelineable

from aiopipe import Task
from aiopipe.sources import Source

from .sources import SourceWrappers, agreement_groups, ended_together, without_last_two

__all__ = ("SHARED_REWRITE", "PipelineSpec", "check_pipelineable", "with_source_wrappers")

#: Why the pipelines of one model take turns, when they share its rewrite.
SHARED_REWRITE = " (the pipelines of one model take turns: they share its torchrec rewrite)"


def check_pipelineable(batch: object) -> None:
    """torchrec pipelines ``Pipelineable`` batches (``to``, ``record_stream``,
    ``pin_memory``) and tensors."""
    if not isinstance(batch, (Pipelineable, torch.Tensor)):
        raise TypeError(f"expected a torchrec Pipelineable batch (to, record_stream, "
                        f"pin_memory) or a tensor, got {type(batch).__name__}")  # fmt: skip


def _same_source(source: Source) -> Source:
    return source


def _source_ended(source: Source) -> None:
    pass


def _nothing() -> None:
    pass


def _no_wrapper(source: Source | None) -> int:
    return 0


@dataclass(frozen=True)
class PipelineSpec:
    """One kind of pipeline, as the base runs it.  The callables close over the
    pipeline's own state; the base calls them, never the other way round."""

    #: Names the pipeline in its error messages ("sparse-dist pipeline").
    what: str
    #: The task list, in the declaration order that breaks topological ties (called
    #: for every engine the pipeline builds).
    build_tasks: Callable[[], list[Task]]
    #: Let torchrec rewrite the model on the first batch (``PipelinedModel.rewrite``):
    #: what the first ring slot is seeded with.
    rewrite_and_seed: Callable[[Any], dict[str, Any]]
    #: The lanes on a CUDA device when no ``thread_map`` is given (one "compute" lane
    #: on any other device).
    default_thread_map: Mapping[str, str]
    #: Raises ``TypeError`` or ``ValueError`` for a batch the tasks cannot run.
    check_batch: Callable[[Any], None] = check_pipelineable
    #: Why the pipelines of one model take turns, appended to the refusal ("" when
    #: the pipeline's rewrite is its own).
    turns: str = SHARED_REWRITE
    #: The source ``progress`` reads, given the one passed (``execute_all_batches=False``
    #: and ``end_together`` wrap it).
    adapt: Callable[[Source], Source] = _same_source
    #: ``progress`` reported the end of this (adapted) source.
    ended: Callable[[Source], None] = _source_ended
    #: ``reset()``: forget the wrapper of every source; how many items the wrapper of
    #: the source given had read and not handed on (dropped with it).
    forget_sources: Callable[[Source | None], int] = _no_wrapper
    #: No batch is in flight any more: the source ended, or ``drain()``.
    finished: Callable[[], None] = _nothing
    #: What ``shutdown()`` frees besides the engine, once.
    release: Callable[[], None] = _nothing
    #: Where the end of each bootstrap is reported (at INFO), if anywhere.
    log: logging.Logger | None = None


def _ends_together(requested: bool | None) -> bool:
    """Whether every rank's sources end on the same step (by default with more than
    one rank)."""
    if requested is not None:
        return requested
    return dist.is_initialized() and dist.get_world_size() > 1


def with_source_wrappers(spec: PipelineSpec, end_together: bool | None,
                         drop_last_two: bool = False) -> PipelineSpec:  # fmt: skip
    """``spec`` reading each source through the wrappers the options ask for (the
    agreement on the end first: every rank then drops the same last two)."""
    together = _ends_together(end_together)
    if not (together or drop_last_two):
        return spec

    group: list[Any] = []  # [(the default group, this pipeline's agreement group)]

    def wrap(source: Source) -> Source:
        if together:
            if not group or group[0][0] is not dist.group.WORLD:
                group[:] = [(dist.group.WORLD, agreement_groups.take())]
            source = ended_together(source, group[0][1])
        return without_last_two(source) if drop_last_two else source

    def release() -> None:
        spec.release()
        if group:
            agreement_groups.give_back(group[0][1], group[0][0])
            group.clear()

    wrappers = SourceWrappers(wrap)
    return dataclasses.replace(spec, adapt=wrappers.adapt, ended=wrappers.ended,
                               forget_sources=wrappers.clear, release=release)  # fmt: skip
