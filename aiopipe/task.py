"""``Task`` and ``DataSlot``: the declarative unit of work and its data handles.

A task declares *what* it touches (slots) and *what it waits for* (three dependency
fields with distinct meanings); the engine derives ordering, CPU edges and GPU event
waits from those declarations.  Normalisation runs in ``__init__`` for keyword
arguments and subclass class attributes alike, so both authoring styles behave
identically.
"""

from __future__ import annotations

import copy
import difflib
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Union, cast

from .errors import ConfigurationError, ConfigurationTypeError, TaskDefinitionError

if TYPE_CHECKING:
    from .context import TaskContext

__all__ = ("DataSlot", "SlotRef", "Task", "TaskBody", "is_async_callable", "refuse_awaitable")

#: Slots the engine itself fills: the pulled batch and the value ``progress`` returns.
BATCH_SLOT = "batch_cpu"
RESULT_SLOT = "step_result"


@dataclass(frozen=True)
class DataSlot:
    """A named value in the slot store of one batch.

    ``offset`` is the ring position the slot lives at while its task runs, which is
    the task's lookahead: a task always sees the store of the batch it processes.
    A bare string in ``reads``/``writes`` becomes ``DataSlot(name, task.lookahead)``.
    """

    name: str
    offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigurationTypeError(
                f"DataSlot name must be a non-empty str, got {self.name!r}"
            )
        if not isinstance(self.offset, int) or isinstance(self.offset, bool):
            raise ConfigurationTypeError(f"DataSlot offset must be an int, got {self.offset!r}")
        if self.offset < 0:
            raise ConfigurationError(f"DataSlot({self.name!r}, {self.offset}): offset must be >= 0")


SlotRef = Union[str, DataSlot]
CrossIterRef = Union[str, tuple[str, int]]
TaskBody = Callable[["TaskContext"], Union[None, Awaitable[None]]]
#: Which half of a ``same_progress_sync`` edge a task asks for (see ``Task``).
SyncSide = Literal["cpu", "device"]
_SYNC_SIDES = ("cpu", "device")


def _as_tuple(value: Any, field: str, task_name: str) -> tuple[Any, ...]:
    """Accept any iterable; a lone string means one entry, not its characters."""
    if value is None:
        return ()
    if isinstance(value, (str, DataSlot)):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise ConfigurationTypeError(
            f"Task {task_name!r}: {field} must be an iterable of entries, got {value!r}"
        ) from None


def _dedupe(items: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(items))


def _normalise_slots(refs: Any, field: str, task_name: str, lookahead: int) -> tuple[DataSlot, ...]:
    out = []
    for ref in _as_tuple(refs, field, task_name):
        if isinstance(ref, DataSlot):
            out.append(ref)
        elif isinstance(ref, str) and ref:
            out.append(DataSlot(ref, lookahead))
        else:
            raise ConfigurationTypeError(
                f"Task {task_name!r}: {field} entries must be slot names or DataSlot, got {ref!r}"
            )
    return _dedupe(out)


def _normalise_names(refs: Any, field: str, task_name: str) -> tuple[str, ...]:
    out = []
    for ref in _as_tuple(refs, field, task_name):
        if not isinstance(ref, str) or not ref:
            raise ConfigurationTypeError(
                f"Task {task_name!r}: {field} entries must be task names, got {ref!r}"
            )
        out.append(ref)
    return _dedupe(out)


def _normalise_cross_iter(refs: Any, task_name: str) -> tuple[tuple[str, int], ...]:
    out = []
    for ref in _as_tuple(refs, "cross_iter_depends_on", task_name):
        if isinstance(ref, str) and ref:
            out.append((ref, -1))  # a bare name means "the previous batch"
            continue
        if not (isinstance(ref, tuple) and len(ref) == 2):
            raise ConfigurationTypeError(
                f"Task {task_name!r}: cross_iter_depends_on entries must be a task name "
                f"or a (name, -N) pair, got {ref!r}"
            )
        producer, offset = ref
        if not isinstance(producer, str) or not isinstance(offset, int) or isinstance(offset, bool):
            raise ConfigurationTypeError(
                f"Task {task_name!r}: cross_iter_depends_on entry {ref!r} must be (str, int)"
            )
        if offset >= 0:
            raise TaskDefinitionError(
                f"Task {task_name!r}: cross_iter_depends_on=({producer!r}, {offset}) needs a "
                f"negative offset (-N waits for the batch N before this one). For the same "
                f"batch use depends_on; for this progress whatever the batch use "
                f"same_progress_sync."
            )
        out.append((producer, offset))
    return _dedupe(out)


def _normalise_sides(
    sides: Any, names: tuple[str, ...], task_name: str
) -> tuple[tuple[str, SyncSide], ...]:
    """A mapping (or the normalised pairs) as ``(producer, side)`` pairs in the order
    of ``same_progress_sync``: immutable like every declared field."""
    if sides is None:
        sides = {}
    try:
        given = dict(sides)
    except (TypeError, ValueError):
        raise ConfigurationTypeError(
            f"Task {task_name!r}: same_progress_sync_sides must map producer names to "
            f"'cpu' or 'device', got {sides!r}"
        ) from None
    for producer, side in given.items():
        if producer not in names:
            raise TaskDefinitionError(
                f"Task {task_name!r}: same_progress_sync_sides names {producer!r}, which is "
                f"not in its same_progress_sync {names}; add it there first."
            )
        if side not in _SYNC_SIDES:
            raise TaskDefinitionError(
                f"Task {task_name!r}: same_progress_sync_sides[{producer!r}] is {side!r}; use "
                f"'cpu' (bodies in order, no device wait) or 'device' (stream wait only), or "
                f"leave the name out for both."
            )
    return tuple((producer, given[producer]) for producer in names if producer in given)


class Task:
    """A unit of work the engine schedules.

    Author a task either by subclassing (class attributes + ``run``) or with
    :meth:`Task.from_fn`.  ``run(ctx)`` may be a plain function or ``async def``.

    Dependency fields (a producer may appear in only one of them):

    * ``depends_on``: same batch -- this task on batch K waits for X on batch K.
      Requires ``X.lookahead >= self.lookahead``.
    * ``cross_iter_depends_on``: a different, earlier batch -- ``"X"`` or
      ``("X", -N)`` waits for X on batch K-N.
    * ``same_progress_sync``: X's work in this same ``progress()`` call, whatever
      batch either task processes (a stream-coherency wait).  It has two sides: on
      the CPU this task's body starts after X's body, on the device this task's
      stream waits for X's event.  ``same_progress_sync_sides={"X": "cpu"}`` keeps
      only the first, ``{"X": "device"}`` only the second: then neither the order of
      the bodies nor this task's host thread waits for X, and the stream wait is
      issued before this body if X has recorded its event by then, otherwise at the
      end of the progress (before any later work on this task's stream).

    The declared fields are read-only once the task is built: the engine derives
    order, ring depth and event waits from them once.  :meth:`replace` builds a
    modified copy.  A subclass may set them as class attributes, as keyword
    arguments, or on ``self`` before calling ``super().__init__``.
    """

    name: str = ""
    stream: str = "default"
    priority: int = 0
    lookahead: int = 0
    # Declared types are the normalised ones; subclasses may still assign bare names.
    reads: tuple[DataSlot, ...] = ()
    writes: tuple[DataSlot, ...] = ()
    depends_on: tuple[str, ...] = ()
    cross_iter_depends_on: tuple[tuple[str, int], ...] = ()
    same_progress_sync: tuple[str, ...] = ()
    # Declared as given (a mapping); normalised to ``(producer, side)`` pairs.
    same_progress_sync_sides: tuple[tuple[str, SyncSide], ...] = ()
    nccl: bool = False
    nvtx_tag: str | None = None

    _FIELDS: ClassVar[tuple[str, ...]] = (
        "stream", "priority", "lookahead", "reads", "writes", "depends_on",
        "cross_iter_depends_on", "same_progress_sync", "same_progress_sync_sides", "nccl",
        "nvtx_tag",
    )  # fmt: skip
    #: Set once ``__init__`` has normalised the fields; from then on they are read-only.
    _sealed: bool = False

    def __init__(self, name: str | None = None, **fields: Any) -> None:
        unknown = set(fields) - set(self._FIELDS)
        if unknown:
            raise ConfigurationTypeError(f"Task got unknown field(s) {sorted(unknown)}")
        if name is not None:
            self.name = name
        if not isinstance(self.name, str) or not self.name:
            raise TaskDefinitionError(
                "Task.name must be a non-empty string (pass it or set it as a class attribute)"
            )
        for key, value in fields.items():
            if value is not None:
                setattr(self, key, value)
        self._normalise()
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, key: str, value: Any) -> None:
        if self._sealed and (key == "name" or key in self._FIELDS):
            raise AttributeError(
                f"Task {self.name!r}: {key} is read-only once the task is built (the "
                f"pipeline derives its order, ring depth and event waits from the "
                f"declaration once); build a modified copy with task.replace({key}=...)"
            )
        object.__setattr__(self, key, value)

    def __delattr__(self, key: str) -> None:
        if self._sealed and (key == "name" or key in self._FIELDS):
            raise AttributeError(f"Task {self.name!r}: {key} is read-only")
        object.__delattr__(self, key)

    def replace(self, **changes: Any) -> Task:
        """A copy of this task with some declared fields changed (``name`` included),
        normalised and checked like a new task; the body is shared."""
        fields = ["name", *self._FIELDS]
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            close = difflib.get_close_matches(unknown[0], fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigurationTypeError(
                f"Task.replace got unknown field(s) {unknown}{hint}; the fields are "
                f"{', '.join(fields)}"
            )
        clone = copy.copy(self)
        object.__setattr__(clone, "_sealed", False)
        for key, value in changes.items():
            setattr(clone, key, value)
        clone._normalise()
        object.__setattr__(clone, "_sealed", True)
        return clone

    def _normalise(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name:
            raise TaskDefinitionError("Task.name must be a non-empty string")
        if not isinstance(self.stream, str) or not self.stream:
            raise ConfigurationTypeError(f"Task {name!r}: stream must be a non-empty string")
        for field in ("lookahead", "priority"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigurationTypeError(
                    f"Task {name!r}: {field} must be an int, got {value!r}"
                )
        if self.lookahead < 0:
            raise TaskDefinitionError(
                f"Task {name!r}: lookahead is {self.lookahead}; it must be >= 0 (0 works on "
                f"the batch being finished, k on the batch k iterations ahead)"
            )
        if self.nvtx_tag is not None and not isinstance(self.nvtx_tag, str):
            raise ConfigurationTypeError(f"Task {name!r}: nvtx_tag must be a string or None")
        if not isinstance(self.nccl, bool):  # bool("no") would be True
            raise ConfigurationTypeError(
                f"Task {name!r}: nccl must be True or False, got {self.nccl!r}"
            )
        self.reads = _normalise_slots(self.reads, "reads", name, self.lookahead)
        self.writes = _normalise_slots(self.writes, "writes", name, self.lookahead)
        self.depends_on = _normalise_names(self.depends_on, "depends_on", name)
        self.same_progress_sync = _normalise_names(
            self.same_progress_sync, "same_progress_sync", name
        )
        self.same_progress_sync_sides = _normalise_sides(
            self.same_progress_sync_sides, self.same_progress_sync, name
        )
        self.cross_iter_depends_on = _normalise_cross_iter(self.cross_iter_depends_on, name)
        self._check_fields_disjoint()

    def sync_side(self, producer: str) -> Literal["both", "cpu", "device"]:
        """Which sides of the ``same_progress_sync`` edge on ``producer`` apply."""
        for name, side in self.same_progress_sync_sides:
            if name == producer:
                return side
        return "both"

    def _check_fields_disjoint(self) -> None:
        fields = {
            "depends_on": set(self.depends_on),
            "cross_iter_depends_on": {producer for producer, _ in self.cross_iter_depends_on},
            "same_progress_sync": set(self.same_progress_sync),
        }
        names = list(fields)
        for i, first in enumerate(names):
            for second in names[i + 1 :]:
                both = fields[first] & fields[second]
                if both:
                    raise TaskDefinitionError(
                        f"Task {self.name!r} names {sorted(both)} in both {first} and "
                        f"{second}; each producer takes exactly one kind of dependency."
                    )

    # -- behaviour -------------------------------------------------------------------

    def run(self, ctx: TaskContext) -> None | Awaitable[None]:
        """Do the work for the batch ``ctx.slots`` belongs to. Override this."""
        raise NotImplementedError(f"Task {self.name!r} does not implement run(ctx)")

    def init(self, ctx: TaskContext) -> None | Awaitable[None]:
        """Called once, before the first iteration of the pipeline. Optional."""
        return None

    @property
    def is_async(self) -> bool:
        """Whether ``run`` is a coroutine function (runs on the event loop)."""
        return inspect.iscoroutinefunction(self.run)

    @classmethod
    def from_fn(
        cls,
        name: str,
        fn: TaskBody,
        *,
        stream: str = "default",
        lookahead: int = 0,
        reads: Iterable[SlotRef] = (),
        writes: Iterable[SlotRef] = (),
        depends_on: Iterable[str] = (),
        cross_iter_depends_on: Iterable[CrossIterRef] = (),
        same_progress_sync: Iterable[str] = (),
        same_progress_sync_sides: Mapping[str, SyncSide] | None = None,
        nccl: bool = False,
        nvtx_tag: str | None = None,
        priority: int = 0,
        init: TaskBody | None = None,
    ) -> Task:
        """Build a task whose ``run(ctx)`` is ``fn(ctx)`` (plain or ``async def``)."""
        given_name, given_fn = cast(object, name), cast(object, fn)  # callers pass anything
        if not callable(given_fn):
            if callable(given_name) and isinstance(given_fn, str):
                raise ConfigurationTypeError(
                    f"Task.from_fn takes the name first, then the function: "
                    f"Task.from_fn({given_fn!r}, {getattr(given_name, '__name__', 'fn')}, ...)"
                )
            raise ConfigurationTypeError(f"Task {name!r}: fn must be callable, got {fn!r}")
        return _FunctionTask(
            name,
            fn,
            init,
            stream=stream,
            lookahead=lookahead,
            reads=reads,
            writes=writes,
            depends_on=depends_on,
            cross_iter_depends_on=cross_iter_depends_on,
            same_progress_sync=same_progress_sync,
            same_progress_sync_sides=same_progress_sync_sides,
            nccl=nccl,
            nvtx_tag=nvtx_tag,
            priority=priority,
        )

    def __repr__(self) -> str:
        extra = f", stream={self.stream!r}" if self.stream != "default" else ""
        return f"<Task {self.name!r} lookahead={self.lookahead}{extra}>"


class _FunctionTask(Task):
    """A task wrapping a function; built by :meth:`Task.from_fn`."""

    def __init__(self, name: str, fn: TaskBody, init: TaskBody | None, **fields: Any) -> None:
        self._fn = fn
        self._init_fn = init
        super().__init__(name, **fields)

    def run(self, ctx: TaskContext) -> None | Awaitable[None]:
        return self._fn(ctx)

    def init(self, ctx: TaskContext) -> None | Awaitable[None]:
        return self._init_fn(ctx) if self._init_fn is not None else None

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self._fn)


def is_async_callable(fn: object) -> bool:
    """``async def`` functions, and objects whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)
    )


def refuse_awaitable(result: object, why: Callable[[], str]) -> None:
    """Raise :class:`TaskDefinitionError` (``why()``) if a synchronous body returned an
    awaitable -- an ``async`` function behind a plain one: nothing would await it.  A
    coroutine is closed first, so it is not reported "never awaited" as well."""
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise TaskDefinitionError(why())
