"""The fourteen tasks of the HSTU ranking step, and the state they share.

=========================  =========  =========  =====  ==============================
task                       lookahead  stream     nccl   does
=========================  =========  =========  =====  ==============================
h2d                        K+1        memcpy            copy to device, new context
start_shuffle              K+1        memcpy     (1)    balance phase 1 (workloads)
finish_shuffle             K+1        memcpy     (1)    balance phase 2 (exchange)
start_input_dist           K          data_dist  yes    torchrec splits all-to-all
wait_input_dist            K          data_dist  yes    torchrec tensors all-to-all
prefetch_embeddings (2)    K          prefetch          embedding cache prefetch
zero_grad                  0          default           optimizer.zero_grad()
global_tokens_allreduce    0          default    yes    all-reduce the loss tokens
nccl_safety_barrier        0          default           default waits for the shuffle
forward                    0          default    yes    set module contexts, model(batch)
backward                   0          default    yes    (loss_sum*dp/tokens).backward()
finalize_model_grads       0          default    (3)    finish gradient reduction
optimizer_step             0          default           optimizer.step(), step_result
watchdog_step              0          default           non-finite loss / memory check
=========================  =========  =========  =====  ==============================

K is ``prefetch_depth`` (1 without prefetch).  As in torchrec's
``TrainPipelineSparseDist``, the next batch's input distribution starts before this
progress's ``forward`` and is waited for after it, so its splits all-to-all has the
whole forward to arrive.  (1) only when a real shuffler is used.  (3) only with
Megatron DDP, whose reduction finishes (or, without overlap, happens) there; torch
DDP completes it inside backward.  Every task that issues a
collective is marked ``nccl``: forward runs the embedding output all-to-all and
backward its gradient plus DDP's all-reduce, so with any thread map that splits them
from the input-dist tasks, the ticket order keeps every rank's collectives in one
order (without it, gloo reports mismatched collectives and NCCL hangs).  (2) prefetch
variant only; it runs after this progress's ``forward`` and before its ``backward``
(a cache's outstanding-key count is decremented by forward and incremented by
prefetch).  ``h2d``, the input-dist tasks and ``forward`` are the generic sparse-dist
step's (``sparse.tasks.pipelined_step_tasks``), here with HSTU's slots and depth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torchrec.distributed.train_pipeline.pipeline_context import (
    PrefetchTrainPipelineContext,
    TrainPipelineContext,
)

from aiopipe import Task, TaskContext

from .megatron import finalize_grads, grad_buffer_chunks, zero_grad_buffers
from .parallel import global_loss, global_tokens
from .shuffler import BatchShuffler
from .sparse.tasks import StepLayout, pipelined_step_tasks, prefetch_embeddings_task
from .watchdog import LossWatch

__all__ = ("PipelineState", "build_tasks")


@dataclass
class PipelineState:
    """What the tasks share: the model, its optimizer and torchrec's bookkeeping."""

    model: torch.nn.Module
    optimizer: Any
    device: torch.device
    shuffler: BatchShuffler
    prefetch: bool = False
    prefetch_depth: int = 1
    memory_limit_bytes: int | None = None
    streams: dict[str, Any] = field(default_factory=dict)
    watch: LossWatch = field(default_factory=LossWatch)
    pipelined_modules: list[Any] = field(default_factory=list)
    #: Megatron DDP modules in the model (empty with torch DDP).
    grad_chunks: list[torch.nn.Module] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.grad_chunks = grad_buffer_chunks(self.model)

    def create_context(self, index: int) -> TrainPipelineContext:
        """A per-batch torchrec context (version 1: one per batch, never shared)."""
        context_type = PrefetchTrainPipelineContext if self.prefetch else TrainPipelineContext
        return context_type(index=index, version=1)

    @property
    def training(self) -> bool:
        return bool(self.model.training)

    def run_model(self, batch: Any) -> tuple[torch.Tensor, Any]:
        return self.model(batch)  # type: ignore[no-any-return]


def build_tasks(state: PipelineState) -> list[Task]:
    """The task list, in the declaration order that breaks topological ties."""
    depth = state.prefetch_depth if state.prefetch else 1
    step = pipelined_step_tasks(state, StepLayout(
        depth=depth, device_batch="batch_gpu", model_batch="shuffled_batch",
        forward_input="prefetched" if state.prefetch else "dist_ready",
    ))  # fmt: skip
    io, dist_la = depth + 1, depth
    shuffles = not state.shuffler.is_identity

    def start_shuffle(ctx: TaskContext) -> None:
        if "shuffled_batch" in ctx.slots:
            return
        ctx.slots.set("shuffle_work", state.shuffler.start_shuffle_async(ctx.slots["batch_gpu"]))

    def finish_shuffle(ctx: TaskContext) -> None:
        if "shuffled_batch" in ctx.slots:
            return
        ctx.slots.set("shuffled_batch", state.shuffler.finish_shuffle(ctx.slots["shuffle_work"]))

    def zero_grad(ctx: TaskContext) -> None:
        if state.training:
            zero_grad_buffers(state.grad_chunks)
            state.optimizer.zero_grad()

    def global_tokens_allreduce(ctx: TaskContext) -> None:
        ctx.slots.set("global_tokens", global_tokens(ctx.slots["shuffled_batch"]))

    def nccl_safety_barrier(ctx: TaskContext) -> None:
        # The work is the declared wait: the default stream waits for this progress's
        # shuffle collectives on the memcpy stream, so collectives on the two streams
        # run on the device in the order they were issued (a no-op on CPU).
        return None

    def backward(ctx: TaskContext) -> None:
        losses = ctx.slots["losses"]
        loss_sum = losses.sum()
        if state.training:
            global_loss(loss_sum, ctx.slots["global_tokens"]).backward()
        ctx.slots.set("loss_sum", loss_sum.detach())

    def finalize_model_grads(ctx: TaskContext) -> None:
        # Megatron DDP: wait for (or issue) the bucket all-reduces.  torch DDP has
        # finished its all-reduce inside backward(): there are no chunks.
        if state.training:
            finalize_grads(state.grad_chunks)

    def optimizer_step(ctx: TaskContext) -> None:
        if state.training:
            state.optimizer.step()
        ctx.slots.set(
            "step_result",
            (ctx.slots["loss_sum"], ctx.slots["global_tokens"], ctx.slots["output"]),
        )

    def watchdog_step(ctx: TaskContext) -> None:
        # No float(loss) here: on a GPU that is a host sync per step (watchdog.py).
        state.watch.submit(ctx.slots["loss_sum"], ctx.batch_index)
        limit = state.memory_limit_bytes
        if limit is not None and state.device.type == "cuda":
            used = torch.cuda.memory_allocated(state.device)
            if used > limit:
                raise MemoryError(f"{used} bytes allocated on {state.device}, limit {limit}")

    # Without prefetch, forward consumes the input dist directly; with it, the
    # prefetched inputs, and backward waits for this progress's prefetch.
    # wait_input_dist is declared after forward, so the tie-break runs it (and issues
    # its collective ticket) after this progress's forward, torchrec's host order, with
    # no device wait on forward; run before forward it waited 1-2 ms per step on gloo.
    backward_sync = ("prefetch_embeddings",) if state.prefetch else ()
    tasks = [
        step["h2d"],
        Task.from_fn("start_shuffle", start_shuffle, lookahead=io, stream="memcpy", nccl=shuffles,
                     reads=("batch_gpu",), writes=("shuffle_work",)),
        Task.from_fn("finish_shuffle", finish_shuffle, lookahead=io, stream="memcpy",
                     nccl=shuffles, reads=("shuffle_work",), writes=("shuffled_batch",)),
        step["start_input_dist"],
        Task.from_fn("zero_grad", zero_grad),
        Task.from_fn("global_tokens_allreduce", global_tokens_allreduce, nccl=True,
                     reads=("shuffled_batch",), writes=("global_tokens",),
                     depends_on=("nccl_safety_barrier",)),
        Task.from_fn("nccl_safety_barrier", nccl_safety_barrier,
                     same_progress_sync=("finish_shuffle",)),
        step["forward"],
        step["wait_input_dist"],
        Task.from_fn("backward", backward, nccl=True, reads=("losses", "global_tokens"),
                     writes=("loss_sum",), same_progress_sync=backward_sync),
        Task.from_fn("finalize_model_grads", finalize_model_grads, nccl=bool(state.grad_chunks),
                     depends_on=("backward",)),
        Task.from_fn("optimizer_step", optimizer_step, reads=("loss_sum", "global_tokens", "output"),
                     writes=("step_result",), depends_on=("finalize_model_grads",)),
        Task.from_fn("watchdog_step", watchdog_step, reads=("loss_sum",),
                     depends_on=("optimizer_step",)),
    ]  # fmt: skip
    if state.prefetch:  # declared after forward: it must follow forward in every progress
        after_wait = [task.name for task in tasks].index("wait_input_dist") + 1
        tasks.insert(after_wait, prefetch_embeddings_task(
            state, lambda: state.streams["default"], lookahead=dist_la))  # fmt: skip
    return tasks
