"""``Schedule`` and ``Stage``: a frozen declaration of the tasks of one progress."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .task import Task

__all__ = ("Schedule", "Stage")


@dataclass(frozen=True)
class Stage:
    """A group of tasks.  Stages run one after another within every iteration;
    inside a stage the engine orders tasks topologically."""

    tasks: tuple[Task, ...]

    def __post_init__(self) -> None:
        tasks = tuple(self.tasks)
        for task in tasks:
            if not isinstance(task, Task):
                raise TypeError(f"Stage.tasks entries must be Task instances, got {task!r}")
        object.__setattr__(self, "tasks", tasks)


@dataclass(frozen=True)
class Schedule:
    """The declared DAG: stages of tasks plus the named streams they may use."""

    stages: tuple[Stage, ...]
    stream_slots: tuple[str, ...] = field(default=("default",))

    def __post_init__(self) -> None:
        stages = tuple(self.stages)
        for stage in stages:
            if not isinstance(stage, Stage):
                raise TypeError(f"Schedule.stages entries must be Stage instances, got {stage!r}")
        slots: object = self.stream_slots
        if isinstance(slots, str):
            raise TypeError("Schedule.stream_slots must be a tuple of stream names, not a str")
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "stream_slots", tuple(self.stream_slots))

    @classmethod
    def of(cls, tasks: Iterable[Task], stream_slots: Iterable[str] | None = None) -> Schedule:
        """A single-stage schedule; streams default to ``"default"`` plus the ones the
        tasks name."""
        tasks = tuple(tasks)
        if stream_slots is None:
            stream_slots = dict.fromkeys(["default", *(t.stream for t in tasks)])
        return cls(stages=(Stage(tasks=tasks),), stream_slots=tuple(stream_slots))

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
