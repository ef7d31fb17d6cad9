"""``Schedule`` and ``Stage``: a frozen declaration of the tasks of one progress."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .errors import ConfigurationTypeError
from .task import Task

__all__ = ("Schedule", "Stage")


def _checked_tasks(entries: Iterable[object], where: str) -> tuple[Task, ...]:
    """``entries`` as a tuple of tasks; anything else is named with its position."""
    if isinstance(entries, Task):
        raise ConfigurationTypeError(
            f"{where}: expected a list of tasks, got the single task {entries!r}: wrap it, [task]"
        )
    try:
        tasks = tuple(entries)
    except TypeError:
        raise ConfigurationTypeError(
            f"{where}: expected a list of tasks, got {entries!r}"
        ) from None
    for position, entry in enumerate(tasks):
        if isinstance(entry, type) and issubclass(entry, Task):
            raise ConfigurationTypeError(
                f"{where}[{position}] is the class {entry.__name__}, not a task: "
                f"pass an instance, {entry.__name__}()"
            )
        if not isinstance(entry, Task):
            raise ConfigurationTypeError(
                f"{where}[{position}] is {entry!r} ({type(entry).__name__}), not a Task; "
                f"build tasks with Task.from_fn(name, fn, ...) or a Task subclass"
            )
        if not entry._sealed:
            raise ConfigurationTypeError(
                f"{where}[{position}] ({type(entry).__name__}) was never initialised as a "
                f"Task: its __init__ must call super().__init__(...)"
            )
    return tasks  # type: ignore[return-value]  # each entry was checked above


@dataclass(frozen=True)
class Stage:
    """A group of tasks.  Stages run one after another within every iteration;
    inside a stage the engine orders tasks topologically."""

    tasks: tuple[Task, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", _checked_tasks(self.tasks, "Stage.tasks"))


@dataclass(frozen=True)
class Schedule:
    """The declared DAG: stages of tasks plus the named streams they may use."""

    stages: tuple[Stage, ...]
    stream_slots: tuple[str, ...] = field(default=("default",))

    def __post_init__(self) -> None:
        stages = tuple(self.stages)
        for stage in stages:
            if not isinstance(stage, Stage):
                raise ConfigurationTypeError(
                    f"Schedule.stages entries must be Stage instances, got {stage!r}"
                )
        slots: object = self.stream_slots
        if isinstance(slots, str):
            raise ConfigurationTypeError(
                "Schedule.stream_slots must be a tuple of stream names, not a str"
            )
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "stream_slots", tuple(self.stream_slots))

    @classmethod
    def of(cls, tasks: Iterable[Task], stream_slots: Iterable[str] | None = None) -> Schedule:
        """A single-stage schedule; streams default to ``"default"`` plus the ones the
        tasks name.  A non-``Task`` entry raises
        :class:`~aiopipe.errors.ConfigurationTypeError` (a ``TypeError``) naming it and
        its position."""
        tasks = _checked_tasks(tasks, "tasks")
        if stream_slots is None:
            stream_slots = dict.fromkeys(["default", *(t.stream for t in tasks)])
        return cls(stages=(Stage(tasks=tasks),), stream_slots=tuple(stream_slots))

    def in_order(self, order: Iterable[Task]) -> Schedule:
        """This schedule with each stage's tasks sorted by their place in ``order``
        (every task of the schedule, e.g. a topological order); stages keep theirs."""
        position = {task.name: i for i, task in enumerate(order)}
        stages = tuple(
            Stage(tasks=tuple(sorted(stage.tasks, key=lambda task: position[task.name])))
            for stage in self.stages
        )
        return Schedule(stages=stages, stream_slots=self.stream_slots)

    @property
    def tasks(self) -> tuple[Task, ...]:
        """Every task, in declaration order (stage by stage)."""
        return tuple(task for stage in self.stages for task in stage.tasks)

    @property
    def max_lookahead(self) -> int:
        return max((task.lookahead for task in self.tasks), default=0)

    @property
    def in_flight_batches(self) -> int:
        """How many batches the ring holds at once: ``max_lookahead + 1``."""
        return self.max_lookahead + 1

    def task(self, name: str) -> Task:
        for task in self.tasks:
            if task.name == name:
                return task
        raise KeyError(f"no task named {name!r} in this schedule")
