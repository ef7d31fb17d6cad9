"""Materialise a candidate: the same tasks with other lookaheads, streams or fire order.

The search proposes choices as plain maps; this module turns them back into a real
:class:`Schedule` the engine (and the validator) accepts, so every candidate is
checked by the same rules as a hand-written schedule.  Task bodies are shared, not
copied: only the declaration fields change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..schedule import Schedule, Stage
from ..streams import StreamPool
from ..task import DataSlot, Task
from ..validate import validate_schedule
from .errors import AutoschedError

__all__ = ("lookaheads_of", "rebuild_schedule", "streams_of", "validate_candidate")


def lookaheads_of(schedule: Schedule) -> dict[str, int]:
    return {task.name: task.lookahead for task in schedule.tasks}


def streams_of(schedule: Schedule) -> dict[str, str]:
    return {task.name: task.stream for task in schedule.tasks}


def _moved(task: Task, lookahead: int, stream: str, priority: int) -> Task:
    if (lookahead, stream, priority) == (task.lookahead, task.stream, task.priority):
        return task
    # Rule 2 keeps every declared slot at its task's lookahead, so a slot at the old
    # lookahead moves with the task; any other offset is kept as declared.
    return task.replace(
        reads=tuple(_shift(slot, task.lookahead, lookahead) for slot in task.reads),
        writes=tuple(_shift(slot, task.lookahead, lookahead) for slot in task.writes),
        lookahead=lookahead, stream=stream, priority=priority,
    )  # fmt: skip


def _shift(slot: DataSlot, old: int, new: int) -> DataSlot:
    return DataSlot(slot.name, new) if slot.offset == old else slot


def rebuild_schedule(
    schedule: Schedule,
    *,
    lookaheads: Mapping[str, int] | None = None,
    streams: Mapping[str, str] | None = None,
    fire_order: Sequence[str] | None = None,
) -> Schedule:
    """``schedule`` with the given per-task lookaheads and streams (others unchanged).

    ``fire_order`` lists every task name once, in the order the engine should prefer
    among tasks that are ready together; it becomes the tasks' ``priority`` (the
    topological sort's tie-break), so it never overrides a dependency.
    """
    names = [task.name for task in schedule.tasks]
    for label, given in (("lookaheads", lookaheads), ("streams", streams)):
        unknown = sorted(set(given or {}) - set(names))
        if unknown:
            raise AutoschedError(f"{label} names tasks {unknown} that the schedule lacks")
    priority = {task.name: task.priority for task in schedule.tasks}
    if fire_order is not None:
        if sorted(fire_order) != sorted(names):
            raise AutoschedError(
                f"fire_order must list every task exactly once; got {list(fire_order)}"
            )
        priority = {name: len(fire_order) - position for position, name in enumerate(fire_order)}
    lookaheads, streams = lookaheads or {}, streams or {}
    stages = tuple(
        Stage(tasks=tuple(
            _moved(task, lookaheads.get(task.name, task.lookahead),
                   streams.get(task.name, task.stream), priority[task.name])
            for task in stage.tasks
        ))  # fmt: skip
        for stage in schedule.stages
    )
    stream_slots = tuple(dict.fromkeys([*schedule.stream_slots, *streams.values()]))
    return Schedule(stages=stages, stream_slots=stream_slots)


def validate_candidate(schedule: Schedule) -> None:
    """Run the engine's validator as the pipeline would on CPU null streams
    (raises :class:`~aiopipe.ScheduleValidationError`)."""
    validate_schedule(schedule, StreamPool({name: None for name in schedule.stream_slots}))
