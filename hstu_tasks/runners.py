"""Training loops over the same model and data, for comparison: aiopipe (both
variants), torchrec's ``TrainPipelineSparseDist`` and the plain loop.

Each returns the per-step local loss sums and global token counts; every rank must
call the same runner with the same number of batches.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from aiopipe import Tracer, run
from aiopipe.lanes import ThreadMap

from .data import HSTUBatch
from .factory import HSTUPipelineFactory
from .parallel import TrainingSetup, global_loss, global_tokens, plain_train_step
from .shuffler import BatchShuffler
from .sparse.sources import StepsPerCall, results_by_call
from .sparse.sources import torchrec_results as torchrec_results

__all__ = (
    "PIPELINES",
    "RunResult",
    "parameter_checksum",
    "parameter_digest",
    "run_pipeline",
    "torchrec_results",
)

Mode = Literal["aiopipe", "aiopipe-prefetch", "torchrec", "none"]
PIPELINES: tuple[Mode, ...] = ("aiopipe", "aiopipe-prefetch", "torchrec", "none")
Progress = Callable[[int], None]


@dataclass
class RunResult:
    loss_sums: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time over the run, every thread counted
    # Steps whose values are still on the device, in order after those above: reading
    # one per step would make the host wait for the device every step.
    unread: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)

    @property
    def steps(self) -> int:
        return len(self.loss_sums) + len(self.unread)

    def record(self, loss_sum: torch.Tensor, tokens: torch.Tensor) -> None:
        if loss_sum.device.type == "cpu" and not self.unread:
            self.loss_sums.append(float(loss_sum))
            self.tokens.append(float(tokens))
        else:
            self.unread.append((loss_sum.detach(), tokens.detach()))

    def read(self) -> None:
        """Bring the values still on the device to the host (one wait for the device)."""
        if self.unread and torch.cuda.is_available():
            torch.cuda.synchronize()  # every stream: a lane's, not only the caller's
        for loss_sum, tokens in self.unread:
            self.loss_sums.append(float(loss_sum))
            self.tokens.append(float(tokens))
        self.unread.clear()

    def global_losses(self) -> list[float]:
        """Per-step mean loss over every rank's tokens (one all-reduce, after the run)."""
        self.read()
        sums = torch.tensor(self.loss_sums, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        return [float(s) / t for s, t in zip(sums, self.tokens)]


def _local(value: Any) -> Any:
    """This rank's part of a state-dict value: a sharded table's local shards (none,
    one or several: row-wise or table-wise), flattened into one tensor."""
    if hasattr(value, "local_shards"):
        shards = [shard.tensor.flatten() for shard in value.local_shards()]
        return torch.cat(shards) if shards else torch.empty(0)
    return value


def parameter_checksum(model: torch.nn.Module) -> float:
    """Sum of every parameter and optimizer-relevant weight, over all ranks (sharded
    tables contribute their local shards)."""
    total = torch.zeros((), dtype=torch.float64)
    for value in model.state_dict().values():
        local = _local(value)
        if isinstance(local, torch.Tensor) and local.is_floating_point():
            total += local.detach().double().sum().cpu()
    if dist.is_initialized() and dist.get_world_size() > 1:
        # dense weights are replicated: count them once per rank, tables once overall
        dist.all_reduce(total)
    return float(total)


def parameter_digest(model: torch.nn.Module) -> str:
    """SHA-256 over the exact bytes of every rank's parameters and buffers: equal
    digests mean bit-identical models."""
    local = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        tensor = _local(value)
        if isinstance(tensor, torch.Tensor):
            local.update(name.encode())
            local.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    digests = [local.hexdigest()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, digests[0])
        digests = gathered
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def _aiopipe(setup: TrainingSetup, data: Iterable[HSTUBatch], prefetch: bool,
             result: RunResult, on_step: Progress, thread_map: ThreadMap,
             shuffler: BatchShuffler | None, tracer: Tracer | None,
             steps_per_call: StepsPerCall) -> None:  # fmt: skip
    name = "hstu_prefetch_sparse_dist" if prefetch else "hstu_sparse_dist"
    pipe = HSTUPipelineFactory.create(
        name, model=setup.model, optimizer=setup.optimizer, device=setup.device,
        thread_map=thread_map, batch_shuffler=shuffler, trace=tracer,
    )  # fmt: skip

    async def train() -> None:
        async with pipe:
            calls = results_by_call(pipe, data, steps_per_call, lambda: result.steps)
            async for results in calls:
                for loss_sum, tokens, _ in results:
                    result.record(loss_sum, tokens)
                on_step(result.steps)

    run(train())


def torchrec_pipeline(setup: TrainingSetup) -> TrainPipelineSparseDist:
    """torchrec's ``TrainPipelineSparseDist`` on the HSTU step: each ``progress``
    returns ``(local_loss_sum, global_tokens, output)``, as ``HSTUPipeline``'s does."""

    def forward(batch: HSTUBatch) -> tuple[torch.Tensor, Any]:
        tokens = global_tokens(batch)
        losses, output = setup.model(batch)
        loss_sum = losses.sum()
        return global_loss(loss_sum, tokens).reshape(1), (loss_sum.detach(), tokens, output)

    return TrainPipelineSparseDist(
        setup.model, setup.optimizer, setup.device, custom_model_fwd=forward  # type: ignore[arg-type]
    )


def _torchrec(setup: TrainingSetup, data: Iterable[HSTUBatch], result: RunResult,
              on_step: Progress) -> None:  # fmt: skip
    pipe = torchrec_pipeline(setup)
    for loss_sum, tokens, _ in torchrec_results(pipe, data):
        result.record(loss_sum, tokens)
        on_step(result.steps)


def run_pipeline(
    mode: Mode,
    setup: TrainingSetup,
    data: Iterable[HSTUBatch],
    on_step: Progress = lambda step: None,
    thread_map: ThreadMap = None,
    shuffler: BatchShuffler | None = None,
    tracer: Tracer | None = None,
    result: RunResult | None = None,
    steps_per_call: StepsPerCall = 1,
) -> RunResult:
    """Train ``data`` with ``mode``; ``thread_map``, ``shuffler``, ``tracer`` and
    ``steps_per_call`` apply to the aiopipe modes (defaults: ``HSTUPipeline``'s lanes,
    no shuffling, no tracing, one step a call).  ``on_step(n)`` runs after the n-th
    step, at a progress boundary (a checkpoint may be taken there); pass ``result`` to
    read the losses so far in it.  ``steps_per_call=k`` asks for ``k`` steps a call
    (``progress_many``: the lanes chain them), and ``on_step(n)`` then runs once a
    call, after its last step; a function of the steps done so far may say how many
    each call asks for (to end calls on checkpoints: ``ResumableJob.steps_for_call``)."""
    if isinstance(steps_per_call, int) and steps_per_call < 1:
        raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
    result = result if result is not None else RunResult()
    start, cpu_start = time.perf_counter(), time.process_time()
    if mode in ("aiopipe", "aiopipe-prefetch"):
        _aiopipe(setup, data, mode == "aiopipe-prefetch", result, on_step, thread_map, shuffler,
                 tracer, steps_per_call)  # fmt: skip
    elif mode == "torchrec":
        if setup.data_parallel == "megatron":
            raise ValueError(
                "torchrec's TrainPipelineSparseDist has no finalize_model_grads step for "
                "Megatron DDP; build the setup with data_parallel='torch' to compare with it"
            )
        if not setup.sharded:
            raise ValueError("torchrec's TrainPipelineSparseDist needs sharded embeddings "
                             "(build the setup with shard_embeddings=True)")  # fmt: skip
        _torchrec(setup, data, result, on_step)
    elif mode == "none":
        for batch in data:
            loss_sum, tokens, _ = plain_train_step(setup, batch)
            result.record(loss_sum, tokens)
            on_step(result.steps)
    else:
        raise ValueError(f"unknown pipeline {mode!r}; choose from {PIPELINES}")
    result.read()  # the device's last steps belong to the run's time
    result.seconds = time.perf_counter() - start
    result.cpu_seconds = time.process_time() - cpu_start
    return result
