"""How ``basic()`` turns a batch into its loss -- ``forward``, ``loss_fn`` (one
argument or two), or the loss taken from the model's output -- and the checks that
refuse, when ``basic()`` is called, step parts that could only fail at the first
step."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from .errors import ConfigurationError, ConfigurationTypeError
from .task import is_async_callable

__all__ = ("check_step_parts", "compute_loss", "detach_result", "loss_tensor")

ModelT = TypeVar("ModelT", bound=torch.nn.Module)


def detach_result(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(detach_result(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(detach_result(v) for v in value)
    if isinstance(value, Mapping):
        return {k: detach_result(v) for k, v in value.items()}
    return value


def check_step_parts(model: object, optimizer: object, loss_fn: object, **hooks: object) -> None:
    """Refuse, when ``basic()`` is called, parts that could only fail at the first
    step (or, ``async def``, leave a coroutine never awaited there: nothing would
    train).  ``hooks``: ``forward=``, ``backward_fn=``, ... (``None``: not given)."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigurationTypeError(f"basic() takes a torch.nn.Module, got {_describe(model)}")
    if not all(callable(getattr(optimizer, name, None)) for name in ("step", "zero_grad")):
        raise ConfigurationTypeError(
            f"basic() takes an optimizer (with step() and zero_grad()) after the model, "
            f"got {_describe(optimizer)}"
        )
    for name, hook in hooks.items():
        if hook is not None:
            _check_plain_callable(name, hook)
    if loss_fn is None:
        return
    if not callable(loss_fn):
        raise ConfigurationTypeError(f"loss_fn must be callable, got {_describe(loss_fn)}")
    if isinstance(loss_fn, type) and issubclass(loss_fn, torch.nn.Module):
        raise ConfigurationTypeError(
            f"loss_fn takes a loss function or module instance, got the class "
            f"{loss_fn.__name__}: pass loss_fn={loss_fn.__module__}.{loss_fn.__name__}()"
        )
    if is_async_callable(loss_fn):
        raise ConfigurationTypeError(
            "loss_fn must be a plain function returning the loss tensor, not async def: "
            "the loss is back-propagated on the lane, where nothing awaits"
        )
    if _required_positional(loss_fn) > 2:
        raise ConfigurationTypeError(
            "loss_fn takes one argument (the output) or two (the output, and the target "
            "or the batch); this one needs more"
        )


def _check_plain_callable(name: str, hook: object) -> None:
    if not callable(hook):
        raise ConfigurationTypeError(
            f"{name} must be callable, got {_describe(hook)}; pass a function or leave "
            f"{name} out for the default"
        )
    if is_async_callable(hook):
        raise ConfigurationTypeError(
            f"{name} must be a plain function, not async def: basic() calls it on a lane "
            f"thread, where nothing awaits, so its coroutine would never run (and nothing "
            f"would train)"
        )


def _required_positional(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` needs (0 where its signature is unknown)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 0
    return sum(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        for p in params
    )


def _loss_arity(loss_fn: Callable[..., Any]) -> int:
    """1: ``loss_fn(output)``; 2: ``loss_fn(output, target_or_batch)``."""
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    takes_any = any(p.kind is p.VAR_POSITIONAL for p in params)
    return 2 if takes_any or _required_positional(loss_fn) >= 2 else 1


def _is_pair(batch: Any) -> bool:
    """A plain ``(inputs, target)`` tuple or list (named tuples are records, not pairs)."""
    return isinstance(batch, (tuple, list)) and len(batch) == 2 and not hasattr(batch, "_fields")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _loss_of_output(output: Any) -> torch.Tensor:
    """``loss_fn=None``: the output when it is a one-element tensor, else its ``.loss``
    (attribute or key, as model outputs that compute their own loss carry it), else
    its first item."""
    if isinstance(output, torch.Tensor):
        loss: Any = output
    elif isinstance(getattr(output, "loss", None), torch.Tensor):
        loss = output.loss
    elif isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        loss = output["loss"]
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    else:
        loss = None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigurationError(
            f"basic() has no loss_fn, so the loss must be the model's output as a "
            f"one-element tensor, its .loss, or its first item; the model returned "
            f"{_describe(output)}. Pass loss_fn=..., e.g. loss_fn=lambda output: "
            f"output.sum(), or loss_fn=torch.nn.CrossEntropyLoss() for batches of "
            f"(inputs, target)"
        )
    return loss


def loss_tensor(value: Any) -> torch.Tensor:
    loss = value[0] if isinstance(value, (tuple, list)) else value
    if not isinstance(loss, torch.Tensor):
        raise ConfigurationTypeError(
            f"loss_fn must return a tensor, or a tuple whose first item is the tensor to "
            f"differentiate; got {type(loss).__name__}"
        )
    return loss


def _note_pair_hint(exc: BaseException) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(
            "aiopipe: basic() called the model with the whole batch, an (inputs, target) "
            "pair. To call model(inputs) and loss_fn(output, target), pass a loss_fn that "
            "takes two arguments, e.g. loss_fn=torch.nn.CrossEntropyLoss(); or pass "
            "forward=lambda model, batch: model(batch[0]) and "
            "loss_fn=lambda output, batch: ..."
        )


def compute_loss(
    model: ModelT, loss_fn: Callable[..., Any] | None,
    forward: Callable[[ModelT, Any], Any] | None,
) -> Callable[[Any], Any]:
    """``batch -> what loss_fn returned`` (or the loss taken from the output)."""
    two_args = loss_fn is not None and _loss_arity(loss_fn) == 2

    def run(batch: Any) -> Any:
        if forward is not None:
            output = forward(model, batch)
        elif loss_fn is not None and two_args and _is_pair(batch):
            inputs, target = batch  # the common (inputs, target) form
            return _call_loss_fn(loss_fn, model(inputs), target)
        else:
            try:
                output = model(batch)
            except TypeError as exc:
                if _is_pair(batch):
                    _note_pair_hint(exc)
                raise
        if loss_fn is None:
            return _loss_of_output(output)
        if not two_args:
            return _call_loss_fn(loss_fn, output)
        return _call_loss_fn(loss_fn, output, batch, hint=None if forward else _WHOLE_BATCH)

    return run


#: Why a two-argument ``loss_fn`` may fail on a batch that is not an (inputs, target) pair.
_WHOLE_BATCH = (
    "aiopipe: the batch is not an (inputs, target) pair, so basic() called loss_fn(output, "
    "batch) with the whole batch as its second argument, not a target. Give batches as "
    "(inputs, target) pairs for loss_fn(model(inputs), target), or pass a loss_fn that "
    "takes (output, batch) and picks the target out of the batch"
)


def _call_loss_fn(loss_fn: Callable[..., Any], *args: Any, hint: str | None = None) -> Any:
    """``loss_fn(*args)``; its error says it came from ``loss_fn``, which the engine
    would otherwise report only as task ``forward``'s (and ``hint``, if given)."""
    try:
        return loss_fn(*args)
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note("aiopipe: raised by loss_fn, which basic() calls in its task 'forward'")
            if hint is not None:
                exc.add_note(hint)
        raise
