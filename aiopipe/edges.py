"""Dependency analysis: edges, topological order and cross-stream event waits.

Every declared dependency becomes an :class:`Edge` with its *Δ*: the number of ring
advances (``progress()`` calls) between the producer recording its work and the
consumer needing it.  Δ = 0 edges order tasks inside one progress (topological and
CPU edges); Δ >= 1 edges are satisfied by ring rotation and only ever become GPU
event waits.  A producer always records its event in the slot store at its own
lookahead, so after Δ advances the consumer finds it at
``slot_offset = producer.lookahead - Δ``:

==========================  ==============================  =====================
declaration                 Δ                               slot_offset
==========================  ==============================  =====================
reads/writes (slot)         writer.offset - read.offset     read.offset
depends_on X                X.la - c.la   (>= 0 required)   c.la
cross_iter_depends_on X,-N  X.la + N - c.la (>= 0 required) c.la - N (X.la if Δ=0)
same_progress_sync X        0                               X.la
==========================  ==============================  =====================

A ``same_progress_sync`` edge may keep one side only (``Task.same_progress_sync_sides``):
``"cpu"`` orders the bodies but issues no event wait; ``"device"`` issues the event
wait but adds no topological or CPU edge (see ``Iteration`` for where that wait goes).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .errors import ScheduleValidationError
from .schedule import Schedule
from .task import Task

__all__ = (
    "Edge",
    "EventWait",
    "dependency_edges",
    "infer_cross_stream_event_deps",
    "topological_sort",
)

EdgeKind = Literal["slot", "depends_on", "cross_iter", "same_progress_sync"]
EdgeSides = Literal["both", "cpu", "device"]
#: ``(producer_name, producer_stream, slot_offset)``
EventWait = tuple[str, str, int]


@dataclass(frozen=True)
class Edge:
    """One dependency of ``consumer`` on ``producer``."""

    producer: str
    consumer: str
    kind: EdgeKind
    delta: int
    slot_offset: int
    slot: str | None = None  # the slot name, for ``kind == "slot"``
    #: ``"both"``, or the one side a ``same_progress_sync`` edge keeps.
    sides: EdgeSides = "both"

    @property
    def intra_progress(self) -> bool:
        """True for a topological (and CPU) edge: both tasks run in the same
        progress (Δ = 0) and the edge keeps its CPU side."""
        return self.delta == 0 and self.sides != "device"


def _writers_by_slot(tasks: Sequence[Task]) -> dict[str, tuple[Task, int]]:
    writers: dict[str, tuple[Task, int]] = {}
    for task in tasks:
        for slot in task.writes:
            writers.setdefault(slot.name, (task, slot.offset))
    return writers


def dependency_edges(tasks: Sequence[Task] | Schedule) -> list[Edge]:
    """Every dependency edge of a schedule, in declaration order.

    Raises :class:`ScheduleValidationError` for references that cannot be honoured:
    unknown task names or future reads (rule 6), reads of slots only written at a
    smaller lookahead (rule 5).  Reads of slots nobody writes produce no edge (rule 5
    of the validator reports them).
    """
    if isinstance(tasks, Schedule):
        tasks = tasks.tasks
    by_name = {task.name: task for task in tasks}
    writers = _writers_by_slot(tasks)
    edges: list[Edge] = []

    def producer_of(consumer: Task, name: str, field: str) -> Task:
        producer = by_name.get(name)
        if producer is None:
            raise ScheduleValidationError(
                6, f"task {consumer.name!r} has {field}={name!r}, but no task has that name"
            )
        return producer

    for consumer in tasks:
        la = consumer.lookahead
        for read in consumer.reads:
            if read.name not in writers:
                continue
            writer, write_offset = writers[read.name]
            delta = write_offset - read.offset
            if delta < 0:
                raise ScheduleValidationError(
                    5,
                    f"task {consumer.name!r} (lookahead {la}) reads slot {read.name!r}, "
                    f"but its writer {writer.name!r} has lookahead {writer.lookahead}: the "
                    f"value would not exist yet. Give {writer.name!r} a lookahead >= {la}.",
                )
            edges.append(Edge(writer.name, consumer.name, "slot", delta, read.offset, read.name))
        for name in consumer.depends_on:
            producer = producer_of(consumer, name, "depends_on")
            delta = producer.lookahead - la
            if delta < 0:
                raise ScheduleValidationError(
                    6,
                    f"task {consumer.name!r} (lookahead {la}) has depends_on={name!r}, but "
                    f"{name!r} has lookahead {producer.lookahead}: it would not have processed "
                    f"the same batch yet (a future read). Use same_progress_sync or "
                    f"cross_iter_depends_on, or raise {name!r}'s lookahead.",
                )
            edges.append(Edge(name, consumer.name, "depends_on", delta, la))
        for name, neg_offset in consumer.cross_iter_depends_on:
            producer = producer_of(consumer, name, "cross_iter_depends_on")
            delta = producer.lookahead - neg_offset - la
            if delta < 0:
                raise ScheduleValidationError(
                    6,
                    f"task {consumer.name!r} (lookahead {la}) has cross_iter_depends_on="
                    f"({name!r}, {neg_offset}), but {name!r} (lookahead {producer.lookahead}) "
                    f"processes that batch only {-delta} progress(es) later (Δ={delta} < 0, a "
                    f"future read).",
                )
            slot_offset = producer.lookahead if delta == 0 else la + neg_offset
            edges.append(Edge(name, consumer.name, "cross_iter", delta, slot_offset))
        for name in consumer.same_progress_sync:
            producer = producer_of(consumer, name, "same_progress_sync")
            edges.append(Edge(
                name, consumer.name, "same_progress_sync", 0, producer.lookahead,
                sides=consumer.sync_side(name),
            ))  # fmt: skip
    for edge in edges:
        if edge.delta == 0 and edge.producer == edge.consumer:
            raise ScheduleValidationError(
                6,
                f"task {edge.consumer!r} waits for itself in the same progress ({edge.kind}); "
                f"remove the self-reference.",
            )
    return edges


def _find_cycle(remaining: set[str], preds: dict[str, set[str]]) -> list[str]:
    """A cycle among ``remaining`` (every node there has a predecessor there)."""
    start = min(remaining)
    path: list[str] = []
    seen: dict[str, int] = {}
    node = start
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = min(p for p in preds[node] if p in remaining)
    cycle = path[seen[node] :]
    cycle.reverse()  # producer -> consumer direction
    return [*cycle, cycle[0]]


def _sort_stage(tasks: Sequence[Task], preds: dict[str, set[str]]) -> list[Task]:
    """Kahn's algorithm; ready tasks go by higher ``priority``, then declaration order."""
    index = {task.name: i for i, task in enumerate(tasks)}
    local_preds = {t.name: {p for p in preds[t.name] if p in index} for t in tasks}
    succs: dict[str, list[str]] = {t.name: [] for t in tasks}
    for name, ps in local_preds.items():
        for p in ps:
            succs[p].append(name)
    indegree = {name: len(ps) for name, ps in local_preds.items()}
    ready = [(-t.priority, index[t.name]) for t in tasks if indegree[t.name] == 0]
    heapq.heapify(ready)
    order: list[Task] = []
    while ready:
        _, i = heapq.heappop(ready)
        task = tasks[i]
        order.append(task)
        for succ in succs[task.name]:
            indegree[succ] -= 1
            if indegree[succ] == 0:
                heapq.heappush(ready, (-tasks[index[succ]].priority, index[succ]))
    if len(order) != len(tasks):
        remaining = {t.name for t in tasks} - {t.name for t in order}
        cycle = _find_cycle(remaining, local_preds)[:-1]
        first = min(range(len(cycle)), key=lambda k: index[cycle[k]])  # earliest declared
        cycle = cycle[first:] + cycle[:first] + [cycle[first]]
        raise ScheduleValidationError(
            7,
            "cyclic dependency within one progress: "
            + " -> ".join(cycle)
            + ". Break it by turning one edge into a cross-iteration dependency "
            "(a different lookahead or cross_iter_depends_on).",
        )
    return order


def topological_sort(schedule: Schedule) -> tuple[Task, ...]:
    """The execution order: every stage sorted by its Δ = 0 edges (Kahn's algorithm,
    higher ``priority`` first, declaration order breaking remaining ties), stages
    kept in their declared order."""
    preds: dict[str, set[str]] = {task.name: set() for task in schedule.tasks}
    stage_of = {task.name: i for i, stage in enumerate(schedule.stages) for task in stage.tasks}
    for edge in dependency_edges(schedule):
        if not edge.intra_progress:
            continue
        if stage_of[edge.producer] > stage_of[edge.consumer]:
            raise ScheduleValidationError(
                7,
                f"task {edge.consumer!r} (stage {stage_of[edge.consumer]}) waits in the same "
                f"progress for {edge.producer!r} in a later stage "
                f"({stage_of[edge.producer]}); stages run in order, so move the producer "
                f"to an earlier stage or merge the stages.",
            )
        preds[edge.consumer].add(edge.producer)
    order: list[Task] = []
    for stage in schedule.stages:
        order.extend(_sort_stage(stage.tasks, preds))
    return tuple(order)


def infer_cross_stream_event_deps(schedule: Schedule) -> dict[str, list[EventWait]]:
    """Per consumer, the GPU event waits to issue before it runs.

    Returns ``{consumer: [(producer, producer_stream, slot_offset), ...]}``.  Same-stream
    edges need no wait (stream FIFO).  CPU-only ``same_progress_sync`` edges issue no
    wait; device-only ones are not listed here either: their producer may not have
    run yet when the consumer starts (the executors place those waits themselves).  Per (consumer, producer stream) only the most
    recently recorded event is kept -- events on one stream complete in record order,
    so it implies the others.  A cross-stream wait whose event would already have
    rotated out of the ring (``slot_offset < 0``) is rejected (rule 8).
    """
    order = topological_sort(schedule)
    position = {task.name: i for i, task in enumerate(order)}
    by_name = {task.name: task for task in order}
    chosen: dict[tuple[str, str], Edge] = {}
    for edge in dependency_edges(schedule):
        producer, consumer = by_name[edge.producer], by_name[edge.consumer]
        if producer.stream == consumer.stream or edge.sides != "both":
            continue
        if edge.slot_offset < 0:
            raise ScheduleValidationError(
                8,
                f"task {consumer.name!r} (stream {consumer.stream!r}, lookahead "
                f"{consumer.lookahead}) waits across streams for {producer.name!r} "
                f"{edge.delta} progress(es) back, but that event sits at ring offset "
                f"{edge.slot_offset} and has already rotated out. Raise {consumer.name!r}'s "
                f"lookahead to >= {consumer.lookahead - edge.slot_offset}, shorten N, or put "
                f"both tasks on one stream.",
            )
        key = (consumer.name, producer.stream)
        best = chosen.get(key)
        # Smaller Δ = recorded more recently; same Δ: later in topological order.
        if best is None or (edge.delta, -position[edge.producer]) < (
            best.delta,
            -position[best.producer],
        ):
            chosen[key] = edge
    waits: dict[str, list[EventWait]] = {}
    for (consumer_name, stream), edge in chosen.items():
        waits.setdefault(consumer_name, []).append((edge.producer, stream, edge.slot_offset))
    for entries in waits.values():
        entries.sort(key=lambda wait: position[wait[0]])
    return {name: waits[name] for name in sorted(waits, key=position.__getitem__)}
