"""The exception hierarchy: one root, a few families.

Everything aiopipe raises on its own account derives from :class:`PipelineError`,
and from the built-in exception it would otherwise be (``ValueError`` for a value it
cannot use, ``TypeError`` for a type, ``RuntimeError`` for a state), so ``except
ValueError`` keeps working.  Python's protocol exceptions stay what they are:
``KeyError`` for a name looked up that is not there (a stream, a task; a slot's is
the ``KeyError`` :class:`SlotNotSetError`),
``AttributeError`` for a read-only ``Task`` field, ``NotImplementedError`` from a
``Task.run`` not overridden, ``StopIteration`` / ``StopAsyncIteration`` at the end
of a source.  Exceptions raised by task bodies are re-raised unchanged (annotated with the task
name and iteration), so ``except ValueError`` around ``progress()`` still catches a
``ValueError`` raised inside ``forward``.
"""

from __future__ import annotations

from typing import Any

__all__ = (
    "BadBatchError",
    "AsyncLibraryError",
    "BackPressureTimeout",
    "CollectiveOrderError",
    "ConfigurationError",
    "ConfigurationTypeError",
    "FetchError",
    "GraphError",
    "NoRunningLoopError",
    "IgnoredReturnWarning",
    "NoStepResultWarning",
    "SerializedAwaitWarning",
    "PipelineError",
    "PipelineStateError",
    "PoisonedError",
    "ScheduleValidationError",
    "SlotNotSetError",
    "TaskDefinitionError",
    "TicketAbortedError",
    "UndeclaredSlotWarning",
    "attach_origin",
)


class PipelineError(Exception):
    """Root of every error aiopipe raises itself."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled or copied from its args and attributes, not by calling __init__
        # again: many build their message from other arguments (FetchError's key,
        # index and the error it wraps, which may not pickle).
        return _rebuilt, (type(self), self.args, self.__dict__)


class ConfigurationError(PipelineError, ValueError):
    """An argument or option (or what a callback given as one returned) has a value
    aiopipe cannot use: out of range, an unknown choice, or one that contradicts
    another.  The message names it and what to pass instead."""


class ConfigurationTypeError(PipelineError, TypeError):
    """An argument or option (or what a callback given as one returned) has a type
    aiopipe cannot use, or is a keyword it does not know.  The message names it and
    what it expects."""


class TaskDefinitionError(PipelineError, ValueError):
    """A ``Task`` was declared with contradictory or malformed fields."""


class ScheduleValidationError(PipelineError, ValueError):
    """A schedule breaks one of the eight validation rules.

    ``rule`` is the rule number (1-8, see ``docs/concepts.md``); the message names the
    tasks, slots or streams involved and what to change.
    """

    def __init__(self, rule: int, message: str) -> None:
        super().__init__(f"[rule {rule}] {message}")
        self.rule = rule


class PipelineStateError(PipelineError, RuntimeError):
    """The pipeline cannot do what was asked in its current state.

    Raised for a new iterator while batches are in flight, use after ``shutdown()``,
    use after a failed progress (until ``reset()``), the blocking API called from
    inside a running event loop, an executor used before it was bound to a pipeline,
    or the event loop closing under a running call.
    """


class TaskAbortedError(PipelineError, RuntimeError):
    """A task body raised a ``BaseException`` that is neither an ``Exception`` nor an
    interrupt -- a ``CancelledError`` out of an ``await`` that another component
    cancelled, a ``BaseException`` of its own -- chained as ``__cause__``.  Raised as a
    task's failure is (once; the pipeline then needs ``reset()``), never as the bare
    ``CancelledError``, which would tell an awaiting caller it was cancelled."""

    def __init__(self, error: BaseException) -> None:
        task = getattr(error, "aiopipe_task", None)
        said = f": {error}" if str(error) else ""
        super().__init__(
            f"task {task!r} raised {type(error).__name__}{said}, which is not an Exception "
            f"(chained as the cause): its step failed"
        )
        self.__cause__ = error


class NoRunningLoopError(PipelineError, TypeError):
    """A coroutine API (``progress``, ``step``, ``drain``, ...) was called from code
    with no running event loop, where its coroutine would never be awaited.  The
    message names the blocking form to use instead."""


class CollectiveOrderError(PipelineError, RuntimeError):
    """Collectives could not be issued in the agreed order (ranks disagree, or the
    ticket sequence was broken)."""


class TicketAbortedError(CollectiveOrderError):
    """A collective ticket was abandoned because another task of the same progress
    failed or the progress was cancelled."""


class GraphError(PipelineError):
    """A dynamic task graph (``aiopipe.dag``) cannot do what was asked."""


class PoisonedError(GraphError):
    """A graph task did not run because a task it depends on failed."""


class BackPressureTimeout(GraphError, TimeoutError):
    """``submit`` waited longer than allowed for room in the graph's window."""


class AsyncLibraryError(PipelineError, RuntimeError):
    """An asyncio-only API was awaited from trio, or a task body awaited trio (task
    bodies always run on asyncio; see ``docs/anyio.md``)."""


class BadBatchError(PipelineError, ValueError):
    """The source yielded a batch the pipeline's ``check_batch`` rejects; the batch
    was not taken and the batches in flight are intact."""


class FetchError(PipelineError):
    """A fetch of :func:`~aiopipe.fetch_ahead` raised (the exception is chained as
    ``__cause__``).  ``key`` is its key, ``index`` the key's position in the keys,
    counted from 0.  That key is skipped: the next call goes on with the next one."""

    def __init__(self, key: object, index: int, problem: BaseException) -> None:
        super().__init__(
            f"fetch({_short(key)}) failed, the key at position {index} of the keys (counted "
            f"from 0): {type(problem).__name__}: {problem}. That key is skipped: the next call "
            f"goes on with the next key"
        )
        self.key, self.index = key, index


def _rebuilt(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    """A :class:`PipelineError` unpickled or copied: made without calling its
    ``__init__``, from its ``args`` and attributes."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


class SlotNotSetError(PipelineError, KeyError):
    """A task read a slot (``ctx.slots[name]``) that no task had set for its batch.
    ``slot`` is its name.  A ``KeyError``, so ``except KeyError`` still catches it;
    raised out of a task, a note says which task declares it in ``writes=``, if any."""

    def __init__(self, slot: str, batch: int | None, present: list[str]) -> None:
        super().__init__(slot, batch, present)
        self.slot = slot

    def __str__(self) -> str:  # not a KeyError's repr of its argument
        slot, batch, present = self.args
        return f"slot {slot!r} is not set for batch {batch} (set: {present})"


class NoStepResultWarning(UserWarning):
    """A pipeline was built whose tasks never write ``step_result``, so ``progress``
    returns ``None`` for every batch; pass ``expect_result=False`` when that is meant."""


class UndeclaredSlotWarning(UserWarning):
    """A task set a slot that no task declares in ``writes=``: readers are not ordered
    after it, so whether they find the value depends on timing."""


class IgnoredReturnWarning(UserWarning):
    """A task body returned a value, which the pipeline ignores: a task hands values
    on through ``ctx.slots`` (the step's result as ``ctx.slots.set("step_result",
    ...)``).  Said once per task."""


class SerializedAwaitWarning(UserWarning):
    """An ``async def`` task shares its stream with a task working on another batch:
    tasks on one stream run one after the other, so its awaiting overlaps nothing of
    the other's work.  The message names the fix (a stream of its own)."""


def attach_origin(exc: BaseException, task_name: str, where: str, **attributes: object) -> None:
    """Name the task that raised ``exc`` on the exception itself: ``aiopipe_task``,
    the given ``aiopipe_*`` attributes and a note "raised by task ... <where>".  Only
    once: an exception re-raised by a later task keeps its origin."""
    if getattr(exc, "aiopipe_task", None) is not None:
        return
    try:
        exc.aiopipe_task = task_name  # type: ignore[attr-defined]
        for attribute, value in attributes.items():
            setattr(exc, attribute, value)
    except AttributeError:  # exceptions with __slots__
        return
    if hasattr(exc, "add_note"):
        exc.add_note(f"aiopipe: raised by task {task_name!r} {where}")


def attach_source_origin(exc: Exception, batch: int) -> None:
    """Say on a source's own exception which of its batches it was giving: the
    attribute ``aiopipe_source_batch`` and a note (once; this package's own refusals
    say it themselves)."""
    if isinstance(exc, PipelineError) or getattr(exc, "aiopipe_source_batch", None) is not None:
        return
    try:
        exc.aiopipe_source_batch = batch  # type: ignore[attr-defined]
    except AttributeError:  # exceptions with __slots__
        return
    if hasattr(exc, "add_note"):  # Python 3.11 and later
        exc.add_note(f"aiopipe: raised by the source, reading its batch {batch} (counted from "
                     f"0); the batches before it are not lost: drain() finishes any still in "
                     f"flight")
