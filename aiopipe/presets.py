"""Presets: a plain PyTorch training loop as a pipeline, in a few lines.

``basic(model, optimizer, loss_fn=...)`` builds the tasks of::

    for batch in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(batch))        # or taken from the model's output
        backward_fn(loss)                   # default: loss.backward()
        optimizer_step_fn(optimizer)        # default: optimizer.step()

as ``zero_grad -> forward -> backward -> optimizer_step`` (preset T1).  With
``prefetch=True`` an ``h2d`` task moves each batch to the device one batch ahead, and
with ``memcpy_stream=True`` it does so on its own stream (preset T2) and, on a CUDA
device, its own lane, so the copy of batch K+1 overlaps the step of batch K.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ._core.log import pipeline_log
from .context import TaskContext
from .errors import ConfigurationError, ConfigurationTypeError
from .executors import Executor, resolve_executor
from .facade import Pipeline
from .lanes import ThreadMap, check_thread_map_names, copies_on_io
from .losses import check_step_parts, compute_loss, detach_result, loss_tensor
from .options import check_option_names, checked_count, checked_flag
from .task import Task

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; only read by type checkers

    from .options import PipelineOptions

__all__ = (
    "BackwardFn",
    "BasicPipeline",
    "ForwardFn",
    "LossFn",
    "OptimizerStepFn",
    "basic",
    "move_to_device",
)

ModelT = TypeVar("ModelT", bound=torch.nn.Module)
OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)

#: ``loss_fn(output)`` or ``loss_fn(output, target_or_batch)``: the loss tensor, or a
#: tuple whose first item is the loss.
LossFn = Callable[..., Any]
#: ``forward(model, batch) -> output``.
ForwardFn = Callable[[ModelT, Any], Any]

#: ``backward_fn(loss)``: back-propagates the loss (``loss.backward()`` by default).
BackwardFn = Callable[[torch.Tensor], object]
#: ``optimizer_step_fn(optimizer)``: applies the gradients (``optimizer.step()`` by
#: default).
OptimizerStepFn = Callable[[OptimizerT], object]


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor on ``device``: tensors, mappings, lists, tuples,
    named tuples, dataclasses and objects with ``.to(device, non_blocking=...)``.

    For a CUDA device and ``non_blocking=True``, CPU tensors are pinned first (unless
    the loader already pinned them) so the copy is truly asynchronous.
    """
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        if non_blocking and device.type == "cuda" and batch.device.type == "cpu":
            if not batch.is_pinned():
                batch = batch.pin_memory()
        return batch.to(device, non_blocking=non_blocking)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: move_to_device(getattr(batch, f.name), device, non_blocking)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    if isinstance(batch, Mapping):
        moved = {k: move_to_device(v, device, non_blocking) for k, v in batch.items()}
        if isinstance(batch, MutableMapping):  # keeps the type and its state (defaultdict)
            result = copy.copy(batch)
            result.update(moved)
            return result
        return type(batch)(moved)  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(move_to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device, non_blocking) for v in batch)
    to = getattr(batch, "to", None)
    if callable(to):
        return to(device, non_blocking=non_blocking)
    return batch


def _checked_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``, refused now if this machine has no such
    device (torch's own error, later, is a bare ``AssertionError``)."""
    try:
        device = torch.device(device)
    except RuntimeError as exc:  # an unknown device string
        raise ConfigurationError(f"device {device!r} is not a torch device: {exc}") from None
    except TypeError:
        raise ConfigurationTypeError(
            f"device takes a torch.device or a str such as 'cpu' or 'cuda:0', got {device!r}"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(
            f"device {str(device)!r}: CUDA is not available on this machine "
            f"(torch.cuda.is_available() is False); pass device='cpu', or leave device out "
            f"to use the model's"
        )
    return device


def _backward(loss: torch.Tensor) -> None:
    if loss.numel() != 1:  # torch would say only "grad can be implicitly created..."
        raise ConfigurationError(
            f"the loss is a tensor of shape {tuple(loss.shape)}, not one value: have "
            f"loss_fn reduce it (.mean() or .sum()), or pass a backward_fn that "
            f"back-propagates it"
        )
    loss.backward()


def _optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


class BasicPipeline(Pipeline):
    """The pipeline ``basic()`` builds.  With ``grad_accumulation=k`` the optimizer
    steps after every k-th batch and once more after a trailing partial group, when
    the source ends -- exactly as ``if (i + 1) % k == 0 or i == last: step()`` (its
    end reported, or another source passed after its last result).
    ``drain()`` is not the source's end: a partial group keeps its accumulated
    gradients and is completed by the next batches ``progress`` pulls."""

    def __init__(
        self, *args: Any, finish: Callable[[], None] | None,
        after_reset: Callable[[], tuple[int, int] | None] | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self._finish = finish
        self._after_reset = after_reset

    def _on_source_end(self) -> None:
        if self._finish is not None:
            self._finish()

    def reset(self) -> None:
        """:meth:`SchedulablePipeline.reset`.  With ``grad_accumulation=k``, a batch
        whose ``backward`` ran before its step failed has added to the gradients of
        the group under way, and nothing can take that back out: the group's
        gradients are dropped (a WARNING names the batches) and the next batch starts
        a new group.  A group no failed batch touched is kept."""
        super().reset()
        dropped = self._after_reset() if self._after_reset is not None else None
        if dropped is not None:
            pipeline_log.warning(
                "%s: reset(): batch %d of the source failed after its backward had added to "
                "the gradients of the accumulation group under way; the group's gradients "
                "(of the %d applied batch(es) before it) were dropped, and the next batch "
                "starts a new group", self.name, *dropped,
            )  # fmt: skip


def basic(
    model: ModelT,
    optimizer: OptimizerT,
    *,
    loss_fn: LossFn | None = None,
    forward: ForwardFn[ModelT] | None = None,
    backward_fn: BackwardFn | None = None,
    optimizer_step_fn: OptimizerStepFn[OptimizerT] | None = None,
    prefetch: bool = False,
    memcpy_stream: bool = False,
    device: torch.device | str | None = None,
    grad_accumulation: int = 1,
    executor: str | Executor | None = None,
    thread_map: ThreadMap = None,
    **options: Unpack[PipelineOptions],
) -> BasicPipeline:
    """A pipeline of the standard training step; each result is the loss of that
    batch (what ``loss_fn`` returned, tensors detached).

    The loss: ``loss_fn(output)`` or ``loss_fn(output, batch)`` (chosen by its
    signature).  When no ``forward`` is given and a batch is an ``(inputs, target)``
    tuple or list, a two-argument ``loss_fn`` -- ``torch.nn.CrossEntropyLoss()``,
    say -- gets ``loss_fn(model(inputs), target)``.  Without ``loss_fn`` the loss is
    the model's output when it is a one-element tensor, else its ``.loss``, else its
    first item.  ``forward(model, batch)`` defaults to ``model(batch)``.

    Hooks for AMP and clipping: ``backward_fn(loss)`` (default ``loss.backward()``;
    ``lambda loss: scaler.scale(loss).backward()``) and
    ``optimizer_step_fn(optimizer)`` (default ``optimizer.step()``; unscale, clip,
    ``scaler.step(optimizer)``, ``scaler.update()``).

    ``device`` defaults to the model's.  The executor defaults to an
    :class:`AsyncExecutor` that runs the model's work on lane ``"compute"`` (and,
    with ``memcpy_stream=True`` on a CUDA device, ``h2d`` on lane ``"io"``), so the
    event loop stays free; ``thread_map`` picks other lanes, ``executor="sequential"`` runs
    everything inline on the loop.  The keyword options (``trace``, ``name``, ...)
    are those of every pipeline, :class:`~aiopipe.options.PipelineOptions`.
    """
    check_option_names(options, "basic()", basic)
    check_step_parts(model, optimizer, loss_fn, forward=forward, backward_fn=backward_fn,
                     optimizer_step_fn=optimizer_step_fn)  # fmt: skip
    checked_count("grad_accumulation", grad_accumulation)
    checked_flag("prefetch", prefetch)
    checked_flag("memcpy_stream", memcpy_stream)
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    device = _checked_device(device)
    loss_of = compute_loss(model, loss_fn, forward)
    back_propagate: BackwardFn = backward_fn or _backward
    apply_step: Callable[[OptimizerT], object] = optimizer_step_fn or _optimizer_step
    moves = prefetch or memcpy_stream
    pending = {"batches": 0}  # micro-batches since the last optimizer step
    # The batch whose backward ran last and has not been counted yet (a failure after
    # its backward leaves its gradients mixed into the group's).
    unsettled: dict[str, int | None] = {"batch": None}

    def h2d(ctx: TaskContext) -> None:
        ctx.slots.set("batch_device", move_to_device(ctx.slots["batch_cpu"], device, True))

    def zero_grad(ctx: TaskContext) -> None:
        if pending["batches"] == 0:
            optimizer.zero_grad()

    def forward_task(ctx: TaskContext) -> None:
        # non_blocking: a blocking copy would make the host wait for the GPU every step.
        slots = ctx.slots
        batch = slots["batch_device"] if moves else move_to_device(slots["batch_cpu"], device, True)
        ctx.slots.set("loss", loss_of(batch))

    def backward(ctx: TaskContext) -> None:
        loss = loss_tensor(ctx.slots["loss"])
        if grad_accumulation == 1:
            back_propagate(loss)
            return
        if loss.requires_grad:  # else no backward can add to the gradients
            # Unsettled once the backward reaches the loss, not before: a backward_fn
            # that fails first leaves the group's gradients as they were.
            batch = ctx.batch_index
            began = lambda grad: unsettled.update(batch=batch)  # noqa: E731
            loss.register_hook(began)  # type: ignore[no-untyped-call]
        back_propagate(loss / grad_accumulation)

    def optimizer_step(ctx: TaskContext) -> None:
        if pending["batches"] + 1 == grad_accumulation:
            apply_step(optimizer)
            pending["batches"] = 0
        else:
            pending["batches"] += 1
        unsettled["batch"] = None
        ctx.slots.set("step_result", detach_result(ctx.slots["loss"]))

    def after_reset() -> tuple[int, int] | None:
        """Drop a group whose gradients a failed batch's backward added to: that
        batch and how many batches' gradients were dropped, if so."""
        failed, unsettled["batch"] = unsettled["batch"], None
        if failed is None or not pending["batches"]:
            return None  # clean, or the group's first batch: its zero_grad comes next
        dropped, pending["batches"] = pending["batches"], 0
        optimizer.zero_grad()
        return failed, dropped

    def finish() -> None:  # a trailing partial accumulation group still updates
        if pending["batches"]:
            apply_step(optimizer)
            pending["batches"] = 0

    copy_stream = "memcpy" if memcpy_stream else "default"
    tasks = [
        Task.from_fn("zero_grad", zero_grad),
        Task.from_fn("forward", forward_task, depends_on=("zero_grad",), writes=("loss",),
                     reads=("batch_device",) if moves else ()),
        Task.from_fn("backward", backward, reads=("loss",)),
        Task.from_fn("optimizer_step", optimizer_step, depends_on=("backward",),
                     writes=("step_result",)),
    ]  # fmt: skip
    if moves:
        la = 1 if prefetch else 0
        tasks.insert(0, Task.from_fn("h2d", h2d, lookahead=la, stream=copy_stream,
                                     writes=("batch_device",)))  # fmt: skip
    # The model's work on lane "compute", copies (T2) on lane "io": the event loop
    # stays free, and the lane runs torch at full speed (see aiopipe/_core/openmp.py).
    # On a CPU, one lane (see thread_map_for_device).
    copies = ["h2d"] if moves and copy_stream != "default" else []
    names = [task.name for task in tasks]
    check_thread_map_names(thread_map, names)  # a misspelt name would be ignored
    lanes = copies_on_io(copies, names)
    return BasicPipeline(
        tasks,
        executor=resolve_executor(executor, thread_map, default_thread_map=lanes, device=device),
        device=device,
        finish=finish if grad_accumulation > 1 else None,
        after_reset=after_reset if grad_accumulation > 1 else None,
        **options,
    )
