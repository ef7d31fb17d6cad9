"""The eight schedule rules, checked in order; the first violation is raised.

=====  ==========================================================================
rule   requirement
=====  ==========================================================================
1      there is at least one task, and task names are unique
2      every declared slot sits at its task's lookahead (``Task`` itself refuses
       a negative lookahead)
3      every task's stream is in ``Schedule.stream_slots`` and in the StreamPool
4      every slot name has one writer (``batch_cpu`` is written by the engine)
5      every read has a writer at a lookahead >= the reader's (``batch_cpu`` exempt)
6      every dependency names a task of the schedule, and can be honoured (no
       future reads, no same-progress wait on oneself)
7      the same-progress graph is acyclic and never points back across stages
8      cross-stream event waits stay inside the ring, one per (consumer, stream)
=====  ==========================================================================
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import TYPE_CHECKING

from ._core.stack import user_stacklevel
from .errors import NoStepResultWarning, ScheduleValidationError, SerializedAwaitWarning
from .edges import dependency_edges, infer_cross_stream_event_deps, topological_sort
from .schedule import Schedule
from .task import BATCH_SLOT, RESULT_SLOT, Task

if TYPE_CHECKING:
    from .streams import StreamPool

__all__ = ("serialized_awaits", "validate_schedule", "warn_serialized_awaits", "warn_without_result")


def _rule_1_unique_names(tasks: tuple[Task, ...]) -> None:
    if not tasks:
        raise ScheduleValidationError(
            1, "the schedule has no tasks; a pipeline needs at least one task to run"
        )
    duplicates = sorted(name for name, n in Counter(t.name for t in tasks).items() if n > 1)
    if duplicates:
        raise ScheduleValidationError(1, f"task names must be unique; repeated: {duplicates}")


def _rule_2_offsets(tasks: tuple[Task, ...]) -> None:
    for task in tasks:
        for field, slots in (("reads", task.reads), ("writes", task.writes)):
            for slot in slots:
                if slot.offset != task.lookahead:
                    raise ScheduleValidationError(
                        2,
                        f"task {task.name!r} (lookahead {task.lookahead}) {field} {slot}: a "
                        f"task sees the slot store of the batch it processes, so the offset "
                        f"must be {task.lookahead}. Pass the bare name {slot.name!r}.",
                    )


def _rule_3_streams(schedule: Schedule, pool: StreamPool | None) -> None:
    declared = set(schedule.stream_slots)
    for task in schedule.tasks:
        if task.stream not in declared:
            raise ScheduleValidationError(
                3,
                f"task {task.name!r} uses stream {task.stream!r}, which is not in "
                f"Schedule.stream_slots {schedule.stream_slots}",
            )
        if pool is not None and task.stream not in pool:
            raise ScheduleValidationError(
                3,
                f"task {task.name!r} uses stream {task.stream!r}, which the StreamPool "
                f"does not provide (it has {sorted(pool.names())})",
            )


def _rule_4_single_writer(tasks: tuple[Task, ...]) -> None:
    writer_of: dict[str, str] = {}
    for task in tasks:
        for slot in task.writes:
            if slot.name == BATCH_SLOT:
                raise ScheduleValidationError(
                    4,
                    f"task {task.name!r} writes {BATCH_SLOT!r}, which the engine fills with "
                    f"each pulled batch; write to a slot of your own instead.",
                )
            first = writer_of.setdefault(slot.name, task.name)
            if first != task.name:
                raise ScheduleValidationError(
                    4,
                    f"slot {slot.name!r} is written by both {first!r} and {task.name!r}; a "
                    f"batch's slot store lives through all its tasks, so the second write "
                    f"would silently replace the first. Give each value its own slot name.",
                )


def _rule_5_reads_resolve(tasks: tuple[Task, ...]) -> None:
    writers = {slot.name: task for task in tasks for slot in task.writes}
    for task in tasks:
        for slot in task.reads:
            if slot.name == BATCH_SLOT:
                continue
            writer = writers.get(slot.name)
            if writer is None:
                raise ScheduleValidationError(
                    5, f"task {task.name!r} reads slot {slot.name!r}, but no task writes it"
                )
            if writer.lookahead < task.lookahead:
                raise ScheduleValidationError(
                    5,
                    f"task {task.name!r} (lookahead {task.lookahead}) reads slot "
                    f"{slot.name!r}, but its only writer {writer.name!r} has lookahead "
                    f"{writer.lookahead}: the value would not exist yet.",
                )


def _rule_8_one_wait_per_stream(waits: dict[str, list[tuple[str, str, int]]]) -> None:
    for consumer, entries in waits.items():
        streams = Counter(stream for _, stream, _ in entries)
        repeated = sorted(s for s, n in streams.items() if n > 1)
        if repeated:  # an internal invariant of infer_cross_stream_event_deps
            raise ScheduleValidationError(
                8, f"task {consumer!r} would wait more than once on stream(s) {repeated}"
            )


def validate_schedule(schedule: Schedule, stream_pool: StreamPool | None = None) -> None:
    """Check ``schedule`` against rules 1-8; raise :class:`ScheduleValidationError`
    for the first violation.  ``stream_pool`` adds the pool half of rule 3."""
    tasks = schedule.tasks
    _rule_1_unique_names(tasks)
    _rule_2_offsets(tasks)
    _rule_3_streams(schedule, stream_pool)
    _rule_4_single_writer(tasks)
    _rule_5_reads_resolve(tasks)
    dependency_edges(schedule)  # rule 6
    topological_sort(schedule)  # rule 7
    _rule_8_one_wait_per_stream(infer_cross_stream_event_deps(schedule))


def warn_without_result(schedule: Schedule) -> None:
    """Warn (:class:`~aiopipe.errors.NoStepResultWarning`, pointing at the caller's
    line) when no task writes ``step_result``: every result would be ``None``."""
    if any(slot.name == RESULT_SLOT for task in schedule.tasks for slot in task.writes):
        return
    names = ", ".join(task.name for task in schedule.tasks)
    warnings.warn(
        f"no task declares writes=({RESULT_SLOT!r},), so progress() will return None for "
        f"every batch unless a task sets it undeclared (tasks: {names}). Declare "
        f"writes=({RESULT_SLOT!r},) on the task that makes the result and call "
        f"ctx.slots.set({RESULT_SLOT!r}, value) in it, or pass "
        f"expect_result=False if the pipeline runs for its side effects.",
        NoStepResultWarning,
        stacklevel=user_stacklevel(),
    )


def serialized_awaits(schedule: Schedule) -> list[str]:
    """Advice for each ``async def`` task that shares its stream with a task working on
    another batch (another lookahead).  Tasks on one stream run one after the other --
    on a device that is the stream's order, and each stream has one lane -- so the
    time the coroutine spends awaiting (a fetch, a queue) overlaps nothing of the
    other's work, silently."""
    advice = []
    for task in schedule.tasks:
        if not task.is_async:
            continue
        others = [
            other.name for other in schedule.tasks
            if other is not task and other.stream == task.stream and other.lookahead != task.lookahead
        ]  # fmt: skip
        if others:
            advice.append(
                f"task {task.name!r} is async def (lookahead {task.lookahead}) and shares "
                f"stream {task.stream!r} with tasks working on other batches "
                f"({', '.join(map(repr, others))}): tasks on one stream run one after the "
                f"other, so its awaiting overlaps none of their work (a lane of its own "
                f"does not change that). Give it a stream of its own, e.g. stream='io' (on "
                f"a CPU a stream only orders work and costs nothing)"
            )
    return advice


def warn_serialized_awaits(schedule: Schedule) -> None:
    """:class:`~aiopipe.errors.SerializedAwaitWarning` for each piece of
    :func:`serialized_awaits` advice, pointing at the caller's line."""
    for advice in serialized_awaits(schedule):
        warnings.warn(advice, SerializedAwaitWarning, stacklevel=user_stacklevel())
