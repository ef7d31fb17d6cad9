"""``ExecutionPlan``: a validated schedule compiled to index form for the executors.

Compiled once per pipeline.  Tasks are numbered by their position in the
topological order; every per-task fact an executor needs on the hot path (stream,
lookahead, same-progress predecessors, event waits) is a tuple lookup.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from .edges import dependency_edges, infer_cross_stream_event_deps, topological_sort
from .mask import fires
from .schedule import Schedule
from .streams import StreamPool
from .task import Task

__all__ = ("ActiveSet", "ExecutionPlan", "IndexedWait")

#: ``(producer_index, producer_stream, slot_offset)``
IndexedWait = tuple[int, str, int]


@dataclass(frozen=True)
class ActiveSet:
    """The tasks that fire in one iteration (``Iteration.active``), as task numbers of the
    :class:`ExecutionPlan`.

    * ``stages``: one tuple per stage, in topological order; stages run one after
      another.
    * ``all``: every active task, stage after stage.
    """

    stages: tuple[tuple[int, ...], ...]
    all: tuple[int, ...] = field(init=False)
    members: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "all", tuple(i for stage in self.stages for i in stage))
        object.__setattr__(self, "members", frozenset(self.all))


class ExecutionPlan:
    """The compiled form of ``(schedule, stream_pool)``: what an executor reads.

    Tasks are numbered by their position in ``order``; every per-task fact is a tuple
    indexed by that number:

    * ``order``: the tasks, in topological order; ``index``: task name -> number.
    * ``stream``: each task's stream name; ``on_device``: whether that stream is a
      real (CUDA) stream rather than a null one.
    * ``is_async``: the body is ``async def`` (run it with ``Iteration.invoke_async``).
    * ``nccl``: the task issues collectives (it takes a ticket).
    * ``preds``: same-progress predecessors, which must finish before the task starts.
    * ``lookahead``, ``lag`` (``max_lookahead - lookahead``), ``stage_of``,
      ``waits`` (cross-stream event waits), ``records_event``.
    * ``schedule``, ``stream_pool``, ``max_lookahead``, ``num_stages``.

    The engine builds it; an executor receives it in ``bind(plan)``.
    """

    def __init__(self, schedule: Schedule, stream_pool: StreamPool) -> None:
        self.schedule = schedule
        self.stream_pool = stream_pool
        self.order: tuple[Task, ...] = topological_sort(schedule)
        index = {task.name: i for i, task in enumerate(self.order)}
        self.index = index
        self.max_lookahead = schedule.max_lookahead
        self.lookahead = tuple(task.lookahead for task in self.order)
        #: ``iteration - lag`` is the batch a task processes (see mask.py).
        self.lag = tuple(self.max_lookahead - la for la in self.lookahead)
        self.stream = tuple(task.stream for task in self.order)
        #: Whether a task's stream is a real stream to make current (not a null one).
        self.on_device = tuple(stream_pool.get(s) is not None for s in self.stream)
        self.is_async = tuple(task.is_async for task in self.order)
        self.nccl = tuple(task.nccl for task in self.order)
        stage_of = {t.name: s for s, stage in enumerate(schedule.stages) for t in stage.tasks}
        self.stage_of = tuple(stage_of[t.name] for t in self.order)
        self.num_stages = len(schedule.stages)

        preds: list[set[int]] = [set() for _ in self.order]
        device_only: list[list[IndexedWait]] = [[] for _ in self.order]
        for edge in dependency_edges(schedule):
            if edge.intra_progress:
                preds[index[edge.consumer]].add(index[edge.producer])
            elif edge.sides == "device":
                source, target = index[edge.producer], index[edge.consumer]
                if self.stream[source] != self.stream[target]:
                    device_only[target].append((source, self.stream[source], edge.slot_offset))
        #: Same-progress (Δ = 0) predecessors of each task, sorted.
        self.preds: tuple[tuple[int, ...], ...] = tuple(tuple(sorted(p)) for p in preds)

        waits: list[tuple[IndexedWait, ...]] = [() for _ in self.order]
        for consumer, entries in infer_cross_stream_event_deps(schedule).items():
            waits[index[consumer]] = tuple((index[p], s, off) for p, s, off in entries)
        #: Cross-stream event waits of each task (empty on an all-null pool).
        self.waits: tuple[tuple[IndexedWait, ...], ...] = (
            tuple(() for _ in self.order) if stream_pool.is_null else tuple(waits)
        )
        #: Device-only ``same_progress_sync`` waits of each task: issued before its body
        #: when the producer has recorded by then, else at the end of the iteration.
        self.device_syncs: tuple[tuple[IndexedWait, ...], ...] = (
            tuple(() for _ in self.order)
            if stream_pool.is_null
            else tuple(tuple(entries) for entries in device_only)
        )
        consumed = {p for entries in self.waits + self.device_syncs for p, _, _ in entries}
        #: Whether a task's completion event is ever waited on.
        self.records_event = tuple(i in consumed for i in range(len(self.order)))
        self._active_cache: dict[tuple[int, ...], ActiveSet] = {}

    def __len__(self) -> int:
        return len(self.order)

    def active(self, iteration: int, batches_known: int) -> ActiveSet:
        """The tasks whose lookahead fires at ``iteration`` (cached per pattern)."""
        lookaheads = tuple(
            la
            for la in self.distinct_lookaheads
            if fires(la, iteration, self.max_lookahead, batches_known)
        )
        cached = self._active_cache.get(lookaheads)
        if cached is None:
            chosen = set(lookaheads)
            per_stage: list[list[int]] = [[] for _ in range(self.num_stages)]
            for i, la in enumerate(self.lookahead):
                if la in chosen:
                    per_stage[self.stage_of[i]].append(i)
            cached = ActiveSet(tuple(tuple(s) for s in per_stage))
            self._active_cache[lookaheads] = cached
        return cached

    @cached_property
    def distinct_lookaheads(self) -> tuple[int, ...]:
        """The lookaheads the tasks use, ascending."""
        return tuple(sorted(set(self.lookahead)))

    def same_stream_predecessor(self, active: Sequence[int]) -> dict[int, int]:
        """For each active task, the previous active task on its stream (stream FIFO
        must follow topological order even when lanes split a stream)."""
        last_on: dict[str, int] = {}
        result: dict[int, int] = {}
        for i in active:
            previous = last_on.get(self.stream[i])
            if previous is not None:
                result[i] = previous
            last_on[self.stream[i]] = i
        return result
