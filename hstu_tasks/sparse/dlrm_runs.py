"""The runners of the DLRM set-up (:mod:`~hstu_tasks.sparse.dlrm`): the generic
pipeline on each schedule of :data:`~.schedules.TRAIN_SCHEDULES`, torchrec's class for
that schedule (``TrainPipelineSparseDist``, ``...Lite``, ``TrainPipelineBase``,
``TrainPipelineFusedSparseDist``, ``TrainPipelineSemiSync``, ``TrainPipelinePT2``) and
the plain loop, each recording per-step losses, eval outputs and wall time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline.gradient_accumulation import GradientAccumulationConfig
from torchrec.distributed.train_pipeline.gradient_accumulation import GradientAccumulationWrapper
from torchrec.distributed.train_pipeline.train_pipelines import PrefetchTrainPipelineSparseDist
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineBase
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineFusedSparseDist
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelinePT2
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDistLite

from aiopipe import run

from ..parallel import TrainingSetup
from ._torchrec import torchrec_classes_on_cpu
from .pipeline import SparseDistPipeline
from .schedules import TrainSchedule, train_schedule
from .sources import StepsPerCall, results_by_call, torchrec_results

__all__ = (
    "CUDA_ONLY_CLASSES",
    "DLRM_PIPELINES",
    "DLRMMode",
    "DLRMRun",
    "TORCHREC_PIPELINES",
    "evaluate_plainly",
    "run_dlrm",
)
#: ``aiopipe-S`` / ``torchrec-S``: aiopipe's schedule ``S`` / torchrec's class for it;
#: ``aiopipe`` and ``torchrec`` are sparse-dist; ``none`` the plain loop.
DLRMMode = Literal[
    "aiopipe", "torchrec", "none",
    "aiopipe-sparse-dist", "torchrec-sparse-dist", "aiopipe-lite", "torchrec-lite",
    "aiopipe-base", "torchrec-base", "aiopipe-fused", "torchrec-fused",
    "aiopipe-semi-sync", "torchrec-semi-sync", "aiopipe-pt2", "torchrec-pt2",
    "aiopipe-prefetch", "torchrec-prefetch",
]  # fmt: skip
DLRM_PIPELINES: tuple[DLRMMode, ...] = get_args(DLRMMode)

#: torchrec's class for each schedule of TRAIN_SCHEDULES.
TORCHREC_PIPELINES: dict[str, type[Any]] = {
    "sparse-dist": TrainPipelineSparseDist,
    "lite": TrainPipelineSparseDistLite,
    "base": TrainPipelineBase,
    "fused": TrainPipelineFusedSparseDist,
    "semi-sync": TrainPipelineSemiSync,
    "pt2": TrainPipelinePT2,
    "prefetch": PrefetchTrainPipelineSparseDist,
}
#: torchrec's classes that need CUDA as shipped: on a CPU, their reference runs go
#: through ``torchrec_classes_on_cpu``.
CUDA_ONLY_CLASSES = (TrainPipelineFusedSparseDist, TrainPipelineSemiSync)


@dataclass
class DLRMRun:
    """Per-step training losses (this rank's), the eval outputs of each pass (per
    batch: ``(loss, logits, labels)``), wall time."""

    losses: list[float] = field(default_factory=list)
    evaluations: list[list[tuple[torch.Tensor, ...]]] = field(default_factory=list)
    seconds: float = 0.0

    def global_losses(self) -> list[float]:
        """Per-step loss averaged over the ranks (equal batch sizes)."""
        return _mean_over_ranks(torch.tensor(self.losses, dtype=torch.float64))

    def global_eval_losses(self) -> list[float]:
        """Mean loss per evaluation pass, over the ranks (equal batch sizes)."""
        means = [torch.stack([out[0] for out in outputs]).double().mean()
                 for outputs in self.evaluations if outputs]  # fmt: skip
        return _mean_over_ranks(torch.stack(means)) if means else []


def _mean_over_ranks(values: torch.Tensor) -> list[float]:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
        values /= dist.get_world_size()
    return values.tolist()  # type: ignore[no-any-return]


#: ``eval_passes(step) -> eval batches``: what to evaluate after training step ``step``
#: (1-based), or nothing.
EvalPlan = Callable[[int], "Iterable[Batch] | None"]


def run_dlrm(mode: DLRMMode, setup: TrainingSetup, epochs: list[Iterable[Batch]],
             eval_after: EvalPlan = lambda step: None, *,
             end_together: bool | None = None, grad_accumulation: int = 1,
             knobs: Mapping[str, Any] | None = None,
             result: DLRMRun | None = None,
             steps_per_call: StepsPerCall = 1) -> DLRMRun:  # fmt: skip
    """Train every batch of every epoch with ``mode``; after step ``s`` evaluate the
    batches ``eval_after(s)`` returns (torchrec's classes refuse eval passes: they
    would forward the training batches in flight as evaluation).  ``end_together``
    goes to the aiopipe pipelines.  ``grad_accumulation=k``: the optimizer steps
    after every k-th batch of an epoch and after its last (torchrec's classes in its
    ``GradientAccumulationWrapper``, reset for every epoch).  ``knobs``: torchrec's
    constructor arguments of the schedule's class (``{"start_batch": 2}`` for
    semi-sync), to both its class and aiopipe's schedule.  ``result``: record into
    this one (``eval_after`` may read the losses so far), else a new one.
    ``steps_per_call``: the aiopipe pipelines ask for that many steps a call
    (``progress_many``), or for what it says of the steps done so far, and
    ``eval_after`` runs once a call, for its last step."""
    if mode not in DLRM_PIPELINES:
        raise ValueError(f"unknown pipeline {mode!r}; choose from {DLRM_PIPELINES}")
    runner, _, name = mode.partition("-")
    schedule = train_schedule(name or "sparse-dist", knobs)  # refuses knobs it lacks
    result = DLRMRun() if result is None else result
    start = time.perf_counter()
    if runner == "aiopipe":
        run(_aiopipe(setup, epochs, eval_after, result, schedule, end_together,
                     grad_accumulation, steps_per_call))  # fmt: skip
    elif runner == "torchrec":
        _torchrec(setup, epochs, eval_after, result, TORCHREC_PIPELINES[schedule.name],
                  grad_accumulation, knobs or {})  # fmt: skip
    else:
        _plain(setup, epochs, eval_after, result, grad_accumulation)
    result.seconds = time.perf_counter() - start
    return result


async def _aiopipe(setup: TrainingSetup, epochs: list[Iterable[Batch]], eval_after: EvalPlan,
                   result: DLRMRun, schedule: TrainSchedule, end_together: bool | None,
                   grad_accumulation: int, steps_per_call: StepsPerCall) -> None:  # fmt: skip
    async with SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                  schedule=schedule, end_together=end_together,
                                  grad_accumulation=grad_accumulation) as pipe:  # fmt: skip
        async with pipe.eval_pipeline() as evaluator:
            for epoch in epochs:
                calls = results_by_call(pipe, epoch, steps_per_call, lambda: len(result.losses))
                async for results in calls:
                    result.losses.extend(float(loss.detach()) for loss, _, _ in results)
                    batches = eval_after(len(result.losses))
                    if batches is not None:
                        result.evaluations.append(
                            [output async for output in evaluator.results(batches)]
                        )


def _torchrec(setup: TrainingSetup, epochs: list[Iterable[Batch]], eval_after: EvalPlan,
              result: DLRMRun, pipeline: type[Any], grad_accumulation: int,
              knobs: Mapping[str, Any]) -> None:  # fmt: skip
    if setup.device.type == "cpu" and pipeline is PrefetchTrainPipelineSparseDist:
        raise ValueError(
            "torchrec's PrefetchTrainPipelineSparseDist needs a GPU: on a CPU its prefetch "
            "does nothing and its forwards find no prefetched input (aiopipe-prefetch runs "
            "on a CPU)"
        )
    on_cpu = setup.device.type == "cpu" and issubclass(pipeline, CUDA_ONLY_CLASSES)
    with torchrec_classes_on_cpu() if on_cpu else contextlib.nullcontext():
        pipe = pipeline(setup.model, setup.optimizer, setup.device, **knobs)
        if grad_accumulation > 1:
            pipe = GradientAccumulationWrapper(
                pipe, setup.optimizer, setup.model,
                GradientAccumulationConfig(num_steps=grad_accumulation),
            )  # fmt: skip
        _torchrec_epochs(pipe, epochs, eval_after, result, pipeline)


def _torchrec_epochs(pipe: Any, epochs: list[Iterable[Batch]], eval_after: EvalPlan,
                     result: DLRMRun, pipeline: type[Any]) -> None:  # fmt: skip
    for epoch in epochs:
        for loss, _, _ in torchrec_results(pipe, epoch):
            result.losses.append(float(loss.detach()))
            if eval_after(len(result.losses)) is not None:
                raise ValueError(
                    f"torchrec's {pipeline.__name__} cannot evaluate between training "
                    f"steps: the next training batches are in flight, and its progress() "
                    f"would forward them as evaluation batches"
                )
        _next_epoch(pipe, pipeline)


def _next_epoch(pipe: Any, pipeline: type[Any]) -> None:
    """torchrec's way to a new epoch: ``reset()``.  TrainPipelineBase remembers the end
    of a source until then (the sparse-dist classes forget it when handed another
    iterator), and the accumulation wrapper starts a group.  Semi-sync's would also
    count its steps towards ``start_batch`` from 0 again, which aiopipe's does not on a
    new source: only the wrapper's group starts anew."""
    if not issubclass(pipeline, TrainPipelineSemiSync):
        pipe.reset()
    elif isinstance(pipe, GradientAccumulationWrapper):
        pipe.optimizer_wrapper.reset()


def _plain(setup: TrainingSetup, epochs: list[Iterable[Batch]], eval_after: EvalPlan,
           result: DLRMRun, grad_accumulation: int = 1) -> None:  # fmt: skip
    model, optimizer = setup.model, setup.optimizer
    for epoch in epochs:
        for i, (batch, last) in enumerate(_with_last(epoch)):
            if i % grad_accumulation == 0:
                optimizer.zero_grad()
            loss, _ = model(batch.to(setup.device))
            loss.backward()
            if (i + 1) % grad_accumulation == 0 or last:
                optimizer.step()
            result.losses.append(float(loss.detach()))
            batches = eval_after(len(result.losses))
            if batches is not None:
                result.evaluations.append(evaluate_plainly(model, batches, setup.device))


def _with_last(items: Iterable[Batch]) -> Iterator[tuple[Batch, bool]]:
    """Each item, and whether it is the last."""
    iterator = iter(items)
    for item in iterator:
        for following in iterator:
            yield item, False
            item = following
        yield item, True


def evaluate_plainly(
    model: torch.nn.Module, batches: Iterable[Batch], device: torch.device
) -> list[tuple[torch.Tensor, ...]]:
    """The reference: ``model.eval()``, a forward per batch without autograd, then
    ``model.train()``."""
    model.eval()
    try:
        with torch.no_grad():
            return [model(batch.to(device))[1] for batch in batches]
    finally:
        model.train()
