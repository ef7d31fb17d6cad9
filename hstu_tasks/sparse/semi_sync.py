"""The tasks of torchrec's ``TrainPipelineSemiSync`` (``schedule=semi_sync(...)``,
``schedules.py``).

Semi-synchronous training looks the embeddings of batch i+1 up before batch i's
backward has updated the tables, so the embedding all-to-all of i+1 overlaps the dense
forward and backward of i; each batch's embeddings are then one update stale.  The
embeddings reach the dense part detached: ``backward`` stops at them, and
``embedding_backward`` sends their gradients on into the tables (whose optimizer is
fused into that backward).  Steps before ``start_batch`` (counted from the pipeline's
construction or ``reset()``) are synchronous: the next batch is looked up after the
optimizer step.  ``stash_gradients`` makes the dense part one step stale too: each
step applies the previous batch's gradients.

======================  =========  =========  ==============================================
task                    lookahead  stream     does (torchrec's ``progress`` line)
======================  =========  =========  ==============================================
start_input_dist        2          data_dist  ``start_sparse_data_dist`` (batch i+2)
forward                 0          default    ``_mlp_forward`` of batch i
h2d                     3          memcpy     ``enqueue_batch`` (batch i+3)
embedding_lookup_early  1          default    ``start_embedding_lookup`` of i+1, semi-sync
wait_input_dist         2          data_dist  ``wait_sparse_data_dist`` (batch i+2)
backward                0          default    ``torch.sum(losses, dim=0).backward()``
embedding_backward      0          default    ``embedding_backward``: into the tables
optimizer_step          0          default    grad swap, ``_mlp_optimizer_step``, zero_grad
embedding_lookup        1          default    the lookup of i+1 before ``start_batch``
======================  =========  =========  ==============================================
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.train_pipeline.pipeline_context import EmbeddingTrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import EmbeddingPipelinedForward
from torchrec.sparse.jagged_tensor import KeyedTensor

from aiopipe import Task, TaskContext

from .tasks import SparseDistState, StepLayout, look_up_embeddings, pipelined_step_tasks
from .tasks import training_tasks

__all__ = ("DetachedEmbeddingForward", "backward_into_tables", "build_semi_sync_tasks",
           "swap_gradients")  # fmt: skip


class DetachedEmbeddingForward(EmbeddingPipelinedForward):  # type: ignore[misc]
    """torchrec's semi-sync forward (it returns the looked-up embeddings detached, and
    keeps them for ``embedding_backward``), on a CPU too: for pooled embeddings it
    records their use on the current stream, which a CPU tensor refuses."""

    def detach_embeddings(self, embeddings: Any, cur_stream: Any) -> None:
        if isinstance(embeddings, KeyedTensor) and not embeddings.values().is_cuda:
            embeddings.record_stream = _nothing_to_record  # this object only
        super().detach_embeddings(embeddings, cur_stream)


def _nothing_to_record(stream: Any) -> None:
    pass


def backward_into_tables(context: EmbeddingTrainPipelineContext) -> None:
    """Send the gradients ``backward`` left on the detached embeddings on into the
    lookups that made them (torchrec's ``embedding_backward``); an embedding no loss
    reached has no gradient and is left out."""
    for looked_up, detached in zip(context.embedding_tensors, context.detached_embedding_tensors):
        reached = [(tensor, copy.grad) for tensor, copy in zip(looked_up, detached, strict=True)
                   if copy.grad is not None or tensor.numel() == 1]  # fmt: skip
        if reached:
            tensors, grads = zip(*reached)
            torch.autograd.backward(list(tensors), list(grads))


def swap_gradients(model: torch.nn.Module, stash: dict[str, torch.Tensor]) -> None:
    """``stash_gradients``: the dense optimizer steps with the previous batch's
    gradients, while this batch's wait in ``stash`` for the next step (torchrec's
    ``_grad_swap``)."""
    for name, param in model.named_parameters():
        previous = stash.get(name)
        if param.grad is not None:
            stash[name] = param.grad.clone()
        param.grad = previous


def build_semi_sync_tasks(state: SparseDistState, start_batch: int,
                          stash_gradients: bool) -> list[Task]:  # fmt: skip
    """The semi-sync step's tasks, in torchrec's host order (the table above); steps
    from ``start_batch`` on are semi-synchronous."""
    step = pipelined_step_tasks(state, StepLayout(depth=2, forward_input="looked_up",
                                                  forward_after=()))  # fmt: skip
    backward = training_tasks(state)["backward"]

    def semi_synchronous(ctx: TaskContext) -> bool:
        """Whether batch i+1 (this task's) is looked up before batch i's update: batch
        i is the step this progress trains, none for a source's first batch.  (A
        source going on after ``drain()`` counts on: its next batch is looked up
        early with no update between, which gives the same embeddings.)"""
        return ctx.batch_index > 0 and state.steps_trained >= start_batch

    def lookup_early(ctx: TaskContext) -> None:
        early = semi_synchronous(ctx)
        if early:
            look_up_embeddings(state, ctx.slots["torchrec_ctx"])
        ctx.slots.set("looked_up_early", early)

    def lookup(ctx: TaskContext) -> None:
        if not ctx.slots["looked_up_early"]:
            look_up_embeddings(state, ctx.slots["torchrec_ctx"])
        ctx.slots.set("looked_up", True)

    def embedding_backward(ctx: TaskContext) -> None:
        if state.training:
            backward_into_tables(ctx.slots["torchrec_ctx"])

    def optimizer_step(ctx: TaskContext) -> None:
        if state.training:
            index = state.steps_trained
            if stash_gradients and index >= start_batch:
                swap_gradients(state.model, state.stashed_gradients)
            if not (stash_gradients and index == start_batch):  # no gradients stashed yet
                state.accumulation.step(state.optimizer)
            state.accumulation.zero_grad(state.optimizer)
            state.steps_trained += 1
        ctx.slots.set("step_result", ctx.slots["output"])

    return [
        step["start_input_dist"], step["forward"], step["h2d"],
        Task.from_fn("embedding_lookup_early", lookup_early, lookahead=1, nccl=True,
                     reads=("dist_ready",), writes=("looked_up_early",),
                     same_progress_sync=("forward",)),
        step["wait_input_dist"], backward,
        Task.from_fn("embedding_backward", embedding_backward, nccl=True,
                     depends_on=("backward",)),
        Task.from_fn("optimizer_step", optimizer_step, reads=("output",),
                     writes=("step_result",), depends_on=("embedding_backward",)),
        Task.from_fn("embedding_lookup", lookup, lookahead=1, nccl=True,
                     reads=("looked_up_early",), writes=("looked_up",),
                     same_progress_sync=("optimizer_step",)),
    ]  # fmt: skip
