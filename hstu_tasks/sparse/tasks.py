"""The tasks of torchrec's ``TrainPipelineSparseDist`` step for any sharded model.

================  =========  =========  =====  =============================================
task              lookahead  stream     nccl   does (torchrec's ``progress`` line)
================  =========  =========  =====  =============================================
h2d               2          memcpy            ``copy_batch_to_gpu`` (batch i+2), new context
start_input_dist  1          data_dist  yes    ``start_sparse_data_dist`` (splits all-to-all)
zero_grad (t)     0          default           ``optimizer.zero_grad()``
forward           0          default    yes    set module contexts, ``model_fwd(batch)``
wait_input_dist   1          data_dist  yes    ``wait_sparse_data_dist`` (tensors all-to-all)
backward (t)      0          default    yes    ``torch.sum(losses, dim=0).backward()``
optimizer_step    0          default           ``optimizer.step()``; the step's ``output``
================  =========  =========  =====  =============================================

(t): training only -- the eval schedule is h2d, the two input-dist tasks and a
forward that returns the output, in eval mode and without autograd.  As in torchrec,
the training schedule checks ``model.training`` per step: a model put in eval mode
runs forward only.  The declaration order is torchrec's host order; ``forward``
consumes the input dist that ``wait_input_dist`` finished one progress earlier, and
the next batch's ``wait_input_dist`` is declared after ``forward`` so its tensors
all-to-all is issued once this batch's forward has issued its own collectives.

``h2d``, the two input-dist tasks and ``forward`` (:func:`pipelined_step_tasks`)
are also the HSTU pipeline's, placed among its own tasks (``tasks.py``), and, with
``zero_grad``, ``backward`` and ``optimizer_step`` (:func:`training_tasks`), the
other members of torchrec's family (``schedules.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torchrec.distributed.train_pipeline.pipeline_context import EmbeddingTrainPipelineContext
from torchrec.distributed.train_pipeline.pipeline_context import PrefetchTrainPipelineContext
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext

from aiopipe import ConfigurationTypeError, Task, TaskContext
from aiopipe.lanes import copies_on_io

from ._torchrec import start_data_dist, start_embedding_lookup
from .accumulation import GradAccumulation

__all__ = (
    "SPARSE_DIST_THREAD_MAP",
    "ModelForward",
    "SparseDistState",
    "StepLayout",
    "build_sparse_dist_tasks",
    "embedding_lookup_task",
    "finish_input_dist_splits",
    "look_up_embeddings",
    "pipelined_step_tasks",
    "prefetch_embeddings_task",
    "training_tasks",
)

#: ``model_fwd(batch) -> (losses, output)``: the model itself, or torchrec's
#: ``custom_model_fwd``.
ModelForward = Callable[[Any], "tuple[torch.Tensor, Any]"]

#: The default on a CUDA device: copies on the "io" lane, everything that touches the
#: model on "compute" (the only writer of the pipelined modules' context is forward,
#: on that lane).  On a CPU every task defaults to "compute".
SPARSE_DIST_THREAD_MAP: dict[str, str] = copies_on_io(
    ("h2d",),
    ("start_input_dist", "zero_grad", "forward", "wait_input_dist", "backward", "optimizer_step",
     "embedding_lookup", "embedding_lookup_early", "embedding_backward", "prefetch_embeddings"),
)


@dataclass
class SparseDistState:
    """What the tasks of one pipeline share."""

    model: torch.nn.Module
    optimizer: Any
    device: torch.device
    #: torchrec's ``custom_model_fwd``; ``None``: the model itself.
    model_fwd: ModelForward | None = None
    #: The eval schedule: forward only, in eval mode, without autograd.
    evaluation: bool = False
    #: The sharded modules whose forwards torchrec replaced (empty: nothing to distribute).
    pipelined_modules: list[Any] = field(default_factory=list)
    #: The stream ``forward`` runs on (``None`` on a CPU): an embedding lookup made on
    #: another stream records its tensors' use there.
    default_stream: Any = None
    #: The installed forwards read an embedding lookup a task started (the fused
    #: schedule's rewrite): every schedule on the model runs that task.
    looks_up_embeddings: bool = False
    #: The installed forwards read inputs a prefetch task kept (the prefetch schedule's
    #: rewrite): every schedule on the model runs that task.
    prefetches: bool = False
    #: When ``zero_grad`` clears and ``optimizer_step`` steps (every batch by default).
    accumulation: GradAccumulation = field(default_factory=GradAccumulation)
    #: Training steps since the pipeline was built or ``reset()`` (torchrec's batch
    #: index: semi-sync starts at its ``start_batch``).
    steps_trained: int = 0
    #: Semi-sync's ``stash_gradients``: the gradients the next step applies, by name.
    stashed_gradients: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def training(self) -> bool:
        return not self.evaluation and bool(self.model.training)

    def restart(self) -> None:
        """``reset()``: count steps from 0 again, drop the gradients left and start a
        new accumulation group, and forget stashed gradients."""
        self.steps_trained = 0
        self.accumulation.restart(self.optimizer)
        self.stashed_gradients.clear()

    def run_model(self, batch: Any) -> tuple[torch.Tensor, Any]:
        forward = self.model_fwd if self.model_fwd is not None else self.model
        return _losses_and_output(forward(batch), custom=self.model_fwd is not None)

    def create_context(self, index: int) -> TrainPipelineContext:
        """A per-batch torchrec context (version 1: one per batch, never shared), with
        room for an embedding lookup (the fused schedule's forwards read it there) or
        for the prefetched inputs (the prefetch schedule's)."""
        if self.prefetches:
            return PrefetchTrainPipelineContext(index=index, version=1)
        return EmbeddingTrainPipelineContext(index=index, version=1)


def _losses_and_output(returned: Any, *, custom: bool) -> tuple[torch.Tensor, Any]:
    """``model_fwd``'s ``(losses, output)``, as torchrec unpacks it; anything else
    raises a ``TypeError`` that says what the pipeline expects and how to adapt."""
    if not isinstance(returned, torch.Tensor):  # a bare loss tensor would unpack by rows
        try:
            losses, output = returned
        except (TypeError, ValueError):
            pass
        else:
            return losses, output
    what = "custom_model_fwd(batch)" if custom else "the model's forward(batch)"
    got = (f"a tensor of shape {tuple(returned.shape)}" if isinstance(returned, torch.Tensor)
           else type(returned).__name__)  # fmt: skip
    raise ConfigurationTypeError(
        f"{what} returned {got}; the sparse-dist pipeline expects (losses, output), "
        f"as torchrec's does: backward runs on torch.sum(losses, dim=0) and progress() "
        f"returns output. Return both from the forward, or adapt it with "
        f"custom_model_fwd, e.g. custom_model_fwd=lambda batch: (model(batch), None)"
    )


def finish_input_dist_splits(context: TrainPipelineContext) -> None:
    """torchrec's ``wait_sparse_data_dist``: wait for the splits all-to-alls and keep
    the tensors all-to-all requests they started, for the pipelined forward."""
    for names, awaitable in context.fused_splits_awaitables:
        for name, request in zip(names, awaitable.wait()):
            context.input_dist_tensors_requests[name] = request
    context.input_dist_splits_requests.clear()
    context.fused_splits_awaitables.clear()


@contextlib.contextmanager
def evaluation_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model.eval()`` for the duration, then every module's own mode back."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


class StepState(Protocol):
    """What :func:`pipelined_step_tasks` needs of a pipeline's state."""

    model: torch.nn.Module
    device: torch.device
    pipelined_modules: list[Any]

    @property
    def training(self) -> bool: ...

    def run_model(self, batch: Any) -> tuple[torch.Tensor, Any]: ...

    def create_context(self, index: int) -> TrainPipelineContext: ...


@dataclass(frozen=True)
class StepLayout:
    """Where the pipelined step's tasks keep the batch, and how far ahead they run."""

    #: The input distribution runs ``depth`` batches ahead, the copy one more.
    depth: int = 1
    #: The slot ``h2d`` writes the device copy to.
    device_batch: str = "batch"
    #: The slot the input distribution and ``forward`` read (a task in between may
    #: make it from the copy: the HSTU shuffle).
    model_batch: str = "batch"
    #: What ``forward`` waits for besides the batch (the HSTU prefetch: "prefetched");
    #: ``None``: the batch alone (no input-dist tasks: the model's own forward
    #: distributes its input).
    forward_input: str | None = "dist_ready"
    #: The stream of the input-dist tasks (torchrec's Lite runs them on the default one).
    dist_stream: str = "data_dist"
    #: ``start_input_dist`` runs at the copy's lookahead, one more than
    #: ``wait_input_dist`` (torchrec's prefetch class starts it at the end of a step).
    start_with_copy: bool = False
    #: The tasks of the same batch ``forward`` follows in training (semi-sync zeroes
    #: the gradients after its optimizer step instead).
    forward_after: tuple[str, ...] = ("zero_grad",)


def pipelined_step_tasks(state: StepState, layout: StepLayout = StepLayout(), *,
                         evaluation: bool = False) -> dict[str, Task]:  # fmt: skip
    """``h2d``, ``start_input_dist``, ``forward`` and ``wait_input_dist`` by name; the
    caller declares them, in its order, among its other tasks.  ``forward`` writes
    ``losses`` and ``output`` after ``zero_grad`` (``evaluation``: the step's result,
    in eval mode, without autograd)."""
    batch_slot = layout.model_batch

    def h2d(ctx: TaskContext) -> None:
        if layout.device_batch in ctx.slots:  # seeded by the bootstrap
            return
        batch = ctx.slots["batch_cpu"]
        ctx.slots.set(layout.device_batch, batch.to(state.device, non_blocking=True))
        ctx.slots.set("torchrec_ctx", state.create_context(ctx.batch_index))

    def start_input_dist(ctx: TaskContext) -> None:
        if "dist_started" not in ctx.slots:  # the bootstrap started the seeded batch's
            batch, context = ctx.slots[batch_slot], ctx.slots["torchrec_ctx"]
            start_data_dist(state.pipelined_modules, batch, context)
        ctx.slots.set("dist_started", True)

    def wait_input_dist(ctx: TaskContext) -> None:
        finish_input_dist_splits(ctx.slots["torchrec_ctx"])
        ctx.slots.set("dist_ready", True)

    def forward(ctx: TaskContext) -> None:
        for module in state.pipelined_modules:
            module.forward.set_context(ctx.slots["torchrec_ctx"])
        batch = ctx.slots[batch_slot]
        if evaluation:
            with torch.no_grad(), evaluation_mode(state.model):
                ctx.slots.set("step_result", state.run_model(batch)[1])
            return
        with torch.set_grad_enabled(state.training):
            losses, output = state.run_model(batch)
        ctx.slots.set("losses", losses)
        ctx.slots.set("output", output)

    io, dist = layout.depth + 1, layout.depth
    start = io if layout.start_with_copy else dist
    waits_for = () if layout.forward_input is None else (layout.forward_input,)
    return {
        "h2d": Task.from_fn("h2d", h2d, lookahead=io, stream="memcpy", reads=("batch_cpu",),
                            writes=(layout.device_batch, "torchrec_ctx")),
        "start_input_dist": Task.from_fn(
            "start_input_dist", start_input_dist, lookahead=start, stream=layout.dist_stream,
            nccl=True, reads=(batch_slot, "torchrec_ctx"), writes=("dist_started",)),
        "forward": Task.from_fn(
            "forward", forward, nccl=True, reads=(batch_slot, *waits_for),
            writes=("step_result",) if evaluation else ("losses", "output"),
            depends_on=() if evaluation else layout.forward_after),
        "wait_input_dist": Task.from_fn(
            "wait_input_dist", wait_input_dist, lookahead=dist, stream=layout.dist_stream,
            nccl=True, reads=("dist_started",), writes=("dist_ready",)),
    }  # fmt: skip


def training_tasks(state: SparseDistState) -> dict[str, Task]:
    """``zero_grad``, ``backward`` and ``optimizer_step`` by name: the part of a
    training step every torchrec train pipeline shares.  Each checks
    ``model.training`` per step, as torchrec does (a model in eval mode runs forward
    only); ``zero_grad`` and the optimizer's step go through the state's gradient
    accumulation; ``optimizer_step`` makes the step's result the model's ``output``."""

    def zero_grad(ctx: TaskContext) -> None:
        if state.training:
            state.accumulation.zero_grad(state.optimizer)

    def backward(ctx: TaskContext) -> None:
        if state.training:
            torch.sum(ctx.slots["losses"], dim=0).backward()

    def optimizer_step(ctx: TaskContext) -> None:
        if state.training:
            state.accumulation.step(state.optimizer)
            state.steps_trained += 1
        ctx.slots.set("step_result", ctx.slots["output"])

    return {
        "zero_grad": Task.from_fn("zero_grad", zero_grad),
        "backward": Task.from_fn("backward", backward, nccl=True, reads=("losses",),
                                 depends_on=("forward",)),
        "optimizer_step": Task.from_fn("optimizer_step", optimizer_step, reads=("output",),
                                       writes=("step_result",), depends_on=("backward",)),
    }  # fmt: skip


def _no_stream(stream: Any) -> contextlib.nullcontext[None]:
    return contextlib.nullcontext()  # the input dist is waited for on the task's stream


def look_up_embeddings(state: SparseDistState, context: TrainPipelineContext) -> None:
    """Start each pipelined module's embedding lookup and output distribution of the
    batch of ``context`` (its input distribution finished), into ``context``; with
    autograd as ``forward`` has it (none when evaluating)."""
    with torch.set_grad_enabled(state.training):
        for module in state.pipelined_modules:
            start_embedding_lookup(module, context, source_stream=None,
                                   target_stream=state.default_stream,
                                   stream_context=_no_stream)  # fmt: skip


def embedding_lookup_task(state: SparseDistState, *, stream: str = "data_dist",
                          lookahead: int = 0) -> Task:  # fmt: skip
    """torchrec's fused ``start_embedding_lookup``: wait for a batch's input
    distribution, then start each pipelined module's embedding lookup and output
    distribution into the batch's context, where the fused forwards read them.  With
    autograd as ``forward`` has it (none when evaluating).

    A training step's lookup must see the tables its predecessor's backward updated
    (a fused optimizer).  At ``lookahead=1`` it looks batch i+1 up at the end of step
    i, after step i's ``backward``: on a GPU its ``stream`` overlaps the optimizer
    step.  At ``lookahead=0`` the previous step is out of reach of a stream wait, so
    it follows this step's ``zero_grad``."""

    def embedding_lookup(ctx: TaskContext) -> None:
        look_up_embeddings(state, ctx.slots["torchrec_ctx"])
        ctx.slots.set("looked_up", True)

    training = not state.evaluation
    return Task.from_fn(
        "embedding_lookup", embedding_lookup, stream=stream, lookahead=lookahead, nccl=True,
        reads=("dist_ready",), writes=("looked_up",),
        depends_on=("zero_grad",) if training and lookahead == 0 else (),
        cross_iter_depends_on=(("backward", -1),) if training and lookahead else (),
    )  # fmt: skip


def prefetch_embeddings_task(state: StepState, forward_stream: Callable[[], Any], *,
                             lookahead: int = 1) -> Task:  # fmt: skip
    """torchrec's ``_prefetch``: take each pipelined module's distributed input (its
    tensors all-to-all waited for), start its embedding-cache prefetch on a GPU
    (``forward_stream()``: the stream the lookup will run on), and keep the input and
    the module's context where ``PrefetchPipelinedForward`` reads them.  On a CPU there
    are no caching kernels, and torchrec's own ``prefetch_embeddings`` does nothing
    there, leaving its forwards nothing to read: this keeps the inputs anyway."""

    def prefetch_embeddings(ctx: TaskContext) -> None:
        context = ctx.slots["torchrec_ctx"]
        for module in state.pipelined_modules:
            name = module.forward.name
            dist_input = context.input_dist_tensors_requests.pop(name).wait()
            module_context = context.module_contexts.pop(name)
            if state.device.type == "cuda":  # caching kernels exist on a GPU only
                module.prefetch(dist_input=dist_input, forward_stream=forward_stream(),
                                ctx=module_context)  # fmt: skip
            context.module_input_post_prefetch[name] = dist_input
            context.module_contexts_post_prefetch[name] = module_context
        ctx.slots.set("prefetched", True)

    # declared after forward, and following this progress's forward on the device
    return Task.from_fn(
        "prefetch_embeddings", prefetch_embeddings, lookahead=lookahead, stream="prefetch",
        reads=("dist_ready", "torchrec_ctx"), writes=("prefetched",),
        same_progress_sync=("forward",),
    )  # fmt: skip


def build_sparse_dist_tasks(state: SparseDistState, *, lookup_ahead: bool = False) -> list[Task]:
    """torchrec's ``TrainPipelineSparseDist`` step (its ``EvalPipelineSparseDist``'s
    for an evaluation state), in the declaration order that breaks topological ties.
    On a model the fused schedule rewrote, evaluation looks the embeddings up first
    (torchrec's ``EvalPipelineFusedSparseDist``), or with ``lookup_ahead`` those of
    the next batch after this one's forward (its ``enable_embedding_lookup_prefetch``)."""
    if state.evaluation and state.looks_up_embeddings:
        step = pipelined_step_tasks(state, StepLayout(forward_input="looked_up"),
                                    evaluation=True)  # fmt: skip
        lookup = embedding_lookup_task(state, lookahead=1 if lookup_ahead else 0)
        if lookup_ahead:
            return [step["h2d"], step["start_input_dist"], step["forward"],
                    step["wait_input_dist"], lookup]  # fmt: skip
        return [step["h2d"], step["start_input_dist"], lookup, step["forward"],
                step["wait_input_dist"]]  # fmt: skip
    if state.evaluation and state.prefetches:  # the prefetch schedule's forwards
        step = pipelined_step_tasks(state, StepLayout(forward_input="prefetched"),
                                    evaluation=True)  # fmt: skip
        return [step["h2d"], step["start_input_dist"], step["forward"], step["wait_input_dist"],
                prefetch_embeddings_task(state, lambda: state.default_stream)]  # fmt: skip
    step = pipelined_step_tasks(state, evaluation=state.evaluation)
    if state.evaluation:
        return [step["h2d"], step["start_input_dist"], step["forward"], step["wait_input_dist"]]
    train = training_tasks(state)
    return [step["h2d"], step["start_input_dist"], train["zero_grad"], step["forward"],
            step["wait_input_dist"], train["backward"], train["optimizer_step"]]  # fmt: skip
