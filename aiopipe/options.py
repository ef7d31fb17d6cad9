"""``PipelineOptions``: the keyword options every pipeline constructor takes, the
check that no other keyword came, and the reading of those that need it
(``read_ahead``, ``check_batch``).

Declared once and passed on as ``**options``, so ``SchedulablePipeline``,
``Pipeline`` and the presets cannot drift apart.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypedDict, overload

from ._core.nvtx import Annotator
from .errors import ConfigurationError, ConfigurationTypeError
from .task import is_async_callable

if TYPE_CHECKING:  # type-only: trace imports this module's checks
    from .trace import Tracer

__all__ = (
    "PipelineOptions", "check_option_names", "checked_batch_check", "checked_count", "checked_flag",
    "checked_seconds", "read_ahead_depth",
)  # fmt: skip


class PipelineOptions(TypedDict, total=False):
    """The keyword options of every pipeline (all optional).

    * ``nvtx``: NVTX ranges around task bodies -- ``None`` (the default) when a GPU
      and the ``nvtx`` package are present, ``True``/``False``, or an annotator.
    * ``trace``: ``True`` (or a shared :class:`~aiopipe.trace.Tracer`) records a
      span per task run.
    * ``check_batch(batch)`` may raise (or, written as a predicate, return ``False``)
      to refuse a malformed batch before it enters the ring: ``progress`` then raises
      :class:`~aiopipe.errors.BadBatchError` and the batches in flight stay intact;
      ``None`` or ``True`` accepts it.  A plain function: one that is not callable,
      or is ``async def``, is refused when the pipeline is built.
    * ``read_ahead`` (default ``True``): read the next batch while an iteration runs.
      A number ``N`` reads an async source up to ``N`` batches ahead (its pulls one
      after the other, each as soon as the one before has its item), for a source
      slower than a step; a sync source is read one ahead whatever ``N``.  A batch
      the pipeline already waits for is not counted: its pull starts the next one as
      soon as it has its item (so ``N + 1`` are in flight if that wait is cancelled
      just then).  ``False`` (or 0) reads only when a batch is needed.
    * ``expect_result`` (default ``True``): warn with
      :class:`~aiopipe.errors.NoStepResultWarning` when no task writes
      ``step_result``; ``False`` says the pipeline runs for its side effects.
    * ``name`` labels the pipeline in log records and in the tracks of a shared
      tracer (default ``"pipeline N"``, numbered in the order pipelines are built).
    """

    nvtx: bool | Annotator | None
    trace: bool | Tracer | None
    check_batch: Callable[[Any], object] | None
    read_ahead: bool | int
    expect_result: bool
    name: str | None


def read_ahead_depth(value: object) -> int:
    """How many items the ``read_ahead`` option reads ahead: ``True`` one, ``False``
    none, or a number."""
    if not isinstance(value, int):  # bool is an int: True is 1, False 0
        raise ConfigurationTypeError(
            f"read_ahead takes True, False or a number of batches, got {value!r}"
        )
    if value < 0:
        raise ConfigurationError(f"read_ahead must be >= 0 batches, got {value}")
    return int(value)


def checked_flag(what: str, value: object) -> bool:
    """``value`` as ``True`` or ``False``; anything else is refused (``prefetch=2``
    would otherwise read as ``True``, not as two batches ahead)."""
    if not isinstance(value, bool):
        raise ConfigurationTypeError(f"{what} takes True or False, got {value!r}")
    return value


def checked_count(what: str, value: object, minimum: int = 1) -> int:
    """``value`` as a whole number ``>= minimum``; a str, float or bool is refused
    (``"2" < 1`` would fail later with a bare ``TypeError``, ``2.5`` count wrongly)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationTypeError(f"{what} takes an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigurationError(f"{what} must be >= {minimum}, got {value}")
    return value


@overload
def checked_seconds(what: str, value: object, *, allow_none: Literal[False] = ...) -> float: ...
@overload
def checked_seconds(what: str, value: object, *, allow_none: bool) -> float | None: ...
def checked_seconds(what: str, value: object, *, allow_none: bool = False) -> float | None:
    """``value`` as a number of seconds ``>= 0`` (or ``None`` where ``allow_none``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        off = " or None to turn it off" if allow_none else ""
        raise ConfigurationTypeError(f"{what} takes a number of seconds{off}, got {value!r}")
    if value < 0:
        raise ConfigurationError(f"{what} must be >= 0 seconds, got {value}")
    return value


def checked_batch_check(value: object) -> Callable[[Any], object] | None:
    """The ``check_batch`` option, refused now if it could not check a batch: not
    callable (each batch would be refused as bad data), or ``async def`` (never
    awaited, it would let every batch through)."""
    if value is None:
        return None
    if not callable(value):
        raise ConfigurationTypeError(
            f"check_batch must be a function check_batch(batch) that raises to refuse a "
            f"batch, got {value!r}"
        )
    if is_async_callable(value):
        raise ConfigurationTypeError(
            "check_batch must be a plain function: it runs as each batch is read, and an "
            "async def one would never be awaited (every batch would pass); check in an "
            "async source, or in a task, instead"
        )
    return value


#: Keywords of the specification aiopipe dropped, and what to do instead (docs/migration.md).
_RETIRED = {
    "threaded": "task bodies run on lane threads by default, so drop it "
    "(executor='sequential' runs every task inline on the loop instead)",
}


def check_option_names(
    options: Mapping[str, object], where: str, function: Callable[..., object]
) -> None:
    """Refuse a keyword that is not a :class:`PipelineOptions` name (a misspelt
    ``read_ahead`` would otherwise be ignored without a word), naming the nearest of
    those and of ``function``'s own keywords (``grad_accumulations`` for ``basic()``'s
    ``grad_accumulation``)."""
    known = PipelineOptions.__annotations__
    for name in options:
        if name in _RETIRED:
            raise ConfigurationTypeError(f"{where} got {name}=, which is gone: {_RETIRED[name]}")
        if name not in known:
            own = _keywords(function)
            close = difflib.get_close_matches(name, [*own, *known], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigurationTypeError(
                f"{where} got an unexpected keyword {name!r}{hint}; its own keywords are "
                f"{', '.join(own)}, and the pipeline options {', '.join(sorted(known))}"
            )


def _keywords(function: Callable[..., object]) -> list[str]:
    """The names ``function`` takes by keyword, in order (``self`` and ``**`` left out)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [name for name, parameter in inspect.signature(function).parameters.items()
            if parameter.kind in kinds and name != "self"]  # fmt: skip
