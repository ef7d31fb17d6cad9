"""``SparseDistPipeline`` and ``SparseDistEvalPipeline``: torchrec's
``TrainPipelineSparseDist`` and ``EvalPipelineSparseDist`` for any sharded model,
on aiopipe's engine (and, by ``schedule=``, the other members of torchrec's family,
``schedules.py``: one pipeline class runs every task list).

Each pipeline has its own engine, ring and source; the pipelines of one model share
its torchrec rewrite (``model.py``).  So training and evaluation interleave
on one model without a drain: an evaluation pass leaves the training batches in
flight where they are, and training goes on with them afterwards -- every output
belongs to its own pipeline's batch, and the training is the one a run without the
evaluation passes does.  The first batch a model sees traces it: that batch is
copied, the model rewritten and its input distribution started, then seeded into the
ring (trained like any other).

A source that has ended stays described by ``statistics()`` until it is passed
again: then the same iterator object is read afresh (a ``DataLoader`` with
``persistent_workers=True`` hands out one iterator object, reset by every
``iter(loader)``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torchrec.distributed.train_pipeline.runtime_forwards import InSyncEmbeddingPipelinedForward

from aiopipe import ConfigurationTypeError, PipelineStateError, Task, Tracer
from aiopipe.lanes import ThreadMap
from aiopipe.sources import Source

from .accumulation import GradAccumulation
from .base import SparseDistBase
from .checks import check_flags, pipeline_device
from .model import PipelinedModel
from .schedules import TRAIN_SCHEDULES, TrainSchedule, train_schedule
from .spec import PipelineSpec, with_source_wrappers
from .tasks import SPARSE_DIST_THREAD_MAP, ModelForward, SparseDistState
from .tasks import build_sparse_dist_tasks

__all__ = ("SparseDistEvalPipeline", "SparseDistPipeline")


def _on_shared_rewrite(
    model: torch.nn.Module, optimizer: Any, device: torch.device | str,
    model_fwd: ModelForward | None, evaluation: bool, pipelined_input_dist: bool | None,
    forward_type: type[Any] | None = None, *, owner: str,
) -> tuple[PipelinedModel, SparseDistState]:  # fmt: skip
    """The model's shared rewrite (installing ``forward_type``, or whatever the model's
    other pipelines install; ``owner`` names the pipeline asking, in refusals), and
    the state of a pipeline's tasks on it."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigurationTypeError(f"model must be a torch.nn.Module, got "
                                     f"{type(model).__name__}")  # fmt: skip
    if not evaluation and not all(
        callable(getattr(optimizer, name, None)) for name in ("step", "zero_grad")
    ):  # fmt: skip
        raise ConfigurationTypeError(
            f"a training pipeline steps an optimizer (step() and zero_grad()), got "
            f"{type(optimizer).__name__}; evaluate with SparseDistEvalPipeline or "
            f"eval_pipeline()"
        )
    if model_fwd is not None and not callable(model_fwd):
        raise ConfigurationTypeError(
            f"custom_model_fwd must be a function batch -> (losses, output), got {model_fwd!r}"
        )
    device = pipeline_device(device)
    shared = PipelinedModel.of(model, device, pipelined_input_dist, forward_type, owner=owner)
    state = SparseDistState(
        model=model, optimizer=optimizer, device=device, model_fwd=model_fwd,
        evaluation=evaluation, pipelined_modules=shared.modules,
        default_stream=shared.streams["default"], looks_up_embeddings=shared.looks_up_embeddings,
        prefetches=shared.prefetches,
    )  # fmt: skip
    return shared, state


def _spec(what: str, shared: PipelinedModel, state: SparseDistState,
          builder: Callable[[SparseDistState], list[Task]] = build_sparse_dist_tasks,
          strict: bool = False) -> PipelineSpec:  # fmt: skip
    """``builder``'s step on the model's shared rewrite (a step returns the model's
    ``output``, whatever ``model_fwd`` makes it); ``strict``: the rewrite refuses a
    model whose sharded modules it cannot all pipeline."""

    def build_tasks() -> list[Task]:
        return builder(state)

    def rewrite_and_seed(peek: Any) -> dict[str, Any]:
        context = state.create_context(0)
        batch = shared.rewrite(peek, context, strict=strict)
        return {"batch_cpu": peek, "batch": batch, "torchrec_ctx": context, "dist_started": True}

    return PipelineSpec(what=what, build_tasks=build_tasks, rewrite_and_seed=rewrite_and_seed,
                        default_thread_map=SPARSE_DIST_THREAD_MAP)  # fmt: skip


def _with_training_hooks(spec: PipelineSpec, state: SparseDistState) -> PipelineSpec:
    """``spec`` stepping a partial accumulation group when a source ends, and counting
    steps and groups afresh on ``reset()`` (after what the spec already does then)."""
    ended, forget_sources = spec.ended, spec.forget_sources

    def ended_and_stepped(source: Source) -> None:
        ended(source)
        state.accumulation.finish(state.optimizer)

    def forget_and_restart(source: Source | None) -> int:
        wrapped = forget_sources(source)
        state.restart()
        return wrapped

    return dataclasses.replace(spec, ended=ended_and_stepped, forget_sources=forget_and_restart)


class SparseDistPipeline(SparseDistBase[Any]):
    """torchrec's ``TrainPipelineSparseDist(model, optimizer, device,
    execute_all_batches=..., custom_model_fwd=...)`` on aiopipe; with ``schedule="lite"``
    its ``TrainPipelineSparseDistLite``, with ``schedule="base"`` its
    ``TrainPipelineBase``, with ``schedule="fused"`` (or
    :func:`~hstu_tasks.sparse.schedules.fused` and its knobs) its
    ``TrainPipelineFusedSparseDist``, with ``schedule="semi-sync"`` (or
    :func:`~hstu_tasks.sparse.schedules.semi_sync`) its ``TrainPipelineSemiSync``, with
    ``schedule="pt2"`` (or :func:`~hstu_tasks.sparse.schedules.pt2`) its
    ``TrainPipelinePT2``, with ``schedule="prefetch"`` its
    ``PrefetchTrainPipelineSparseDist`` (:data:`~hstu_tasks.sparse.schedules.TRAIN_SCHEDULES`).

    ``await progress(it)`` trains one batch and returns the ``output`` of
    ``model_fwd(batch) -> (losses, output)`` (the model, or ``custom_model_fwd``);
    backward differentiates ``torch.sum(losses, dim=0)``.  With the model in eval mode
    a step runs forward only, as in torchrec; :meth:`eval_pipeline` evaluates without
    touching the training batches in flight.  ``execute_all_batches=False`` drops the
    last two batches of each source, as torchrec does.  ``thread_map`` defaults to
    :data:`~hstu_tasks.sparse.tasks.SPARSE_DIST_THREAD_MAP` on a CUDA device and to
    every task on lane ``"compute"`` on any other; ``executor`` may be
    ``"sequential"`` or an executor instance; ``trace=True`` records task spans.
    ``pipelined_input_dist``: whether torchrec's input distribution runs as tasks (a
    batch ahead on sparse-dist), on its rewrite of the model; by default yes, except on
    a CPU with one rank, where it distributes nothing
    (:func:`~hstu_tasks.sparse.model.input_dist_pipelined`).  The pipelines on one
    model share the choice.  The ``"base"`` and ``"pt2"`` schedules never pipeline it
    (the model's own forward distributes its input), ``"semi-sync"`` always does (its
    step is computed on the rewrite), and ``"lite"``, ``"base"`` and ``"pt2"`` refuse
    ``execute_all_batches=False``, as torchrec's classes have no such option
    (``"prefetch"`` takes it and drops the last two batches, as sparse-dist does;
    torchrec's prefetch class takes the flag too, but with it its ``fill_pipeline``
    runs again at every step that has fewer than three batches queued, so its end
    differs).

    A sharded module whose input distribution torchrec's rewrite cannot take out of
    forward (its input is computed in forward, the trace never reaches it, or forward
    calls it more than once: then it keeps its own forward) is named at the first
    ``progress`` with an
    :class:`~hstu_tasks.sparse.InputDistNotPipelinedWarning`; ``strict=True`` raises
    :class:`~hstu_tasks.sparse.InputDistNotPipelinedError` instead, also on one CPU
    rank, where the model keeps its own forwards (it is traced once to check).

    ``end_together`` (by default on with more than one rank): every rank's source ends
    on the same step, the shortest one's, instead of the longer ranks waiting in a
    collective for a batch the others never have (:func:`~hstu_tasks.sparse.ended_together`:
    one gloo all-reduce of one number per batch, off the step's critical path).

    ``grad_accumulation=k``: the optimizer steps after every k-th batch of a source
    and after its last one (gradients zeroed at the start of each group), on every
    schedule, as torchrec's ``GradientAccumulationWrapper`` does for its classes
    (:mod:`~hstu_tasks.sparse.accumulation`: the loss is not divided by k).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        device: torch.device | str,
        execute_all_batches: bool = True,
        *,
        schedule: str | TrainSchedule = "sparse-dist",
        custom_model_fwd: ModelForward | None = None,
        thread_map: ThreadMap = None,
        executor: str | Any = None,
        trace: bool | Tracer | None = None,
        pipelined_input_dist: bool | None = None,
        strict: bool = False,
        end_together: bool | None = None,
        grad_accumulation: int = 1,
    ) -> None:
        check_flags(execute_all_batches=execute_all_batches, strict=strict,
                    end_together=end_together, pipelined_input_dist=pipelined_input_dist)
        accumulation = GradAccumulation(grad_accumulation)
        chosen = train_schedule(schedule)
        if not execute_all_batches and not chosen.drops_last_two:
            raise ValueError(f"execute_all_batches=False is TrainPipelineSparseDist's option; "
                             f"torchrec's {chosen.torchrec_class} (schedule={chosen.name!r}) "
                             f"trains every batch; the schedules that take it: "
                             f"{_names_of(lambda s: s.drops_last_two)}")  # fmt: skip
        if chosen.rewrites == "always":
            if pipelined_input_dist is False:
                raise ValueError(
                    f"schedule={chosen.name!r} computes its step on torchrec's rewrite of the "
                    f"model (its embeddings come from a lookup of their own): "
                    f"pipelined_input_dist=False cannot run it"
                )  # fmt: skip
            pipelined_input_dist = True
        elif not chosen.rewrites:
            if pipelined_input_dist:
                raise ValueError(f"schedule={chosen.name!r} runs the model's own forward, which "
                                 f"distributes its input itself: pipelined_input_dist=True "
                                 f"needs one of "
                                 f"{_names_of(lambda s: bool(s.rewrites))}")  # fmt: skip
            pipelined_input_dist = False
        shared, state = _on_shared_rewrite(model, optimizer, device, custom_model_fwd, False,
                                           pipelined_input_dist, chosen.forward_type,
                                           owner=f"a {chosen.name} pipeline")  # fmt: skip
        state.accumulation = accumulation
        spec = with_source_wrappers(
            _spec(f"{chosen.name} pipeline", shared, state, chosen.build_tasks, strict),
            end_together, drop_last_two=not execute_all_batches,
        )  # fmt: skip
        spec = _with_training_hooks(spec, state)
        super().__init__(shared, state, spec, thread_map=thread_map, executor=executor,
                         trace=trace)  # fmt: skip

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
        if not self._shared.attached:
            raise PipelineStateError("the model is detached; call attach() first")
        self._shared.claim()  # it shares this pipeline's rewrite
        return SparseDistEvalPipeline(
            state.model, None, state.device, custom_model_fwd=custom_model_fwd or state.model_fwd,
            thread_map=thread_map, executor=executor, trace=trace,
        )  # fmt: skip


class SparseDistEvalPipeline(SparseDistBase[Any]):
    """torchrec's ``EvalPipelineSparseDist(model, optimizer, device)`` on aiopipe:
    ``await progress(it)`` returns ``model_fwd(batch)[1]`` computed in eval mode
    (every module's own mode is restored after each forward) and without autograd;
    there is no backward and no optimizer step (``optimizer`` may be ``None``).

    Built on a model that a :class:`SparseDistPipeline` runs (or via its
    :meth:`~SparseDistPipeline.eval_pipeline`), it shares that pipeline's rewrite of
    the model (and its ``pipelined_input_dist``) and leaves its batches in flight
    alone.  ``strict`` (when it traces the model) and ``end_together`` as for
    :class:`SparseDistPipeline`.

    ``fused=True``: torchrec's ``EvalPipelineFusedSparseDist``, on the fused
    schedule's rewrite (a model a ``schedule="fused"`` training pipeline runs has it
    already): each batch's embeddings are looked up by a task of their own before its
    forward, or with ``enable_embedding_lookup_prefetch=True`` those of the next batch
    right after this one's forward, so that on a GPU the two overlap (two batches'
    embeddings alive at once)."""

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
        pipelined_input_dist: bool | None = None,
        strict: bool = False,
        end_together: bool | None = None,
        fused: bool = False,
        enable_embedding_lookup_prefetch: bool = False,
    ) -> None:
        check_flags(strict=strict, end_together=end_together, fused=fused,
                    pipelined_input_dist=pipelined_input_dist,
                    enable_embedding_lookup_prefetch=enable_embedding_lookup_prefetch)
        forward_type = InSyncEmbeddingPipelinedForward if fused else None
        shared, state = _on_shared_rewrite(
            model, optimizer, device, custom_model_fwd, True, pipelined_input_dist, forward_type,
            owner="a fused eval pipeline" if fused else "a sparse-dist eval pipeline",
        )  # fmt: skip
        if enable_embedding_lookup_prefetch and not state.looks_up_embeddings:
            raise ValueError("enable_embedding_lookup_prefetch=True looks embeddings up a batch "
                             "ahead, on the fused schedule's rewrite: pass fused=True, or "
                             "evaluate a model a schedule='fused' pipeline runs")  # fmt: skip
        builder = functools.partial(build_sparse_dist_tasks,
                                    lookup_ahead=enable_embedding_lookup_prefetch)  # fmt: skip
        what = "fused eval pipeline" if state.looks_up_embeddings else "sparse-dist eval pipeline"
        spec = with_source_wrappers(_spec(what, shared, state, builder, strict=strict),
                                    end_together, drop_last_two=False)  # fmt: skip
        super().__init__(shared, state, spec,
                         thread_map=thread_map, executor=executor, trace=trace)  # fmt: skip


def _names_of(member: Callable[[TrainSchedule], bool]) -> str:
    """The schedules ``member`` holds for, quoted, for a message."""
    return ", ".join(repr(name) for name, s in TRAIN_SCHEDULES.items() if member(s))
