"""Critical-path list scheduling: which ready task should fire first.

Inside one progress the engine runs each stage in a topological order whose ties go
to the higher ``priority``.  That order decides which task a lane reaches first,
which task a stream queues first and the order of collective tickets, so it is a
real scheduling decision.  This module computes classic list-scheduling keys over
the same-progress (Δ = 0) DAG -- top level, bottom level (the longest path from a
task to the end of the iteration, its own cost included) and slack -- and turns a
policy into a fire order: Kahn's algorithm that always takes the ready task with
the best key.  An order never drops an edge, and because every rank derives it from
the same schedule and costs, every rank takes collective tickets in the same order.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..edges import dependency_edges, topological_sort
from ..schedule import Schedule
from .costs import CostModel
from .errors import AutoschedError

__all__ = (
    "FIRE_POLICIES",
    "Levels",
    "fire_order",
    "incomparable_adjacent_pairs",
    "task_levels",
)

#: The tie-break policies :func:`fire_order` knows: ``"declaration"`` (priority 0
#: everywhere, i.e. the declared order), ``"critical_path"``,
#: ``"critical_anchor_chain"``, ``"longest_off_anchor"``, ``"nccl_early"``,
#: ``"pcie_early"`` and ``"min_slack"``.
FIRE_POLICIES = (
    "declaration",
    "critical_path",
    "critical_anchor_chain",
    "longest_off_anchor",
    "nccl_early",
    "pcie_early",
    "min_slack",
)


@dataclass(frozen=True)
class Levels:
    """List-scheduling keys of every task, in ms."""

    weight: Mapping[str, float]
    top: Mapping[str, float]  # longest path from an entry to the task's start
    bottom: Mapping[str, float]  # longest path from the task's start to an exit
    length: float  # the critical path of one iteration

    def slack(self, name: str) -> float:
        return self.length - self.top[name] - self.bottom[name]


def _same_progress_edges(schedule: Schedule) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    preds: dict[str, set[str]] = {t.name: set() for t in schedule.tasks}
    succs: dict[str, set[str]] = {t.name: set() for t in schedule.tasks}
    for edge in dependency_edges(schedule):
        if edge.intra_progress:
            preds[edge.consumer].add(edge.producer)
            succs[edge.producer].add(edge.consumer)
    return preds, succs


def task_levels(schedule: Schedule, cost_model: CostModel) -> Levels:
    """Top and bottom levels over the Δ = 0 DAG, a task weighing the longer of its
    host time (with its awaits: its consumers wait for those too) and device time
    (plus the engine's per-task cost)."""
    preds, succs = _same_progress_edges(schedule)
    order = [task.name for task in topological_sort(schedule)]
    engine_ms = cost_model.engine.task_ms
    weight = {}
    for name in order:
        cost = cost_model.of(name)
        weight[name] = max(cost.host_ms + cost.await_ms, cost.gpu_ms) + engine_ms
    top: dict[str, float] = {}
    for name in order:
        top[name] = max((top[p] + weight[p] for p in preds[name]), default=0.0)
    bottom: dict[str, float] = {}
    for name in reversed(order):
        bottom[name] = weight[name] + max((bottom[s] for s in succs[name]), default=0.0)
    length = max((top[n] + bottom[n] for n in order), default=0.0)
    return Levels(weight, top, bottom, length)


def _policy_key(
    policy: str, schedule: Schedule, cost_model: CostModel, anchor_stream: str
) -> Callable[[str], tuple[float, ...]]:
    """Smaller key fires first."""
    levels = task_levels(schedule, cost_model)
    tasks = {task.name: task for task in schedule.tasks}
    _, succs = _same_progress_edges(schedule)

    def feeds(predicate: Callable[[str], bool]) -> set[str]:
        """Tasks that are, or precede, a task satisfying ``predicate``."""
        found = {name for name in tasks if predicate(name)}
        changed = True
        while changed:
            changed = False
            for name in tasks:
                if name not in found and succs[name] & found:
                    found.add(name)
                    changed = True
        return found

    bottom = levels.bottom
    if policy == "critical_path":
        return lambda n: (-bottom[n],)
    if policy == "critical_anchor_chain":
        anchored = feeds(lambda n: tasks[n].stream == anchor_stream)
        return lambda n: (n not in anchored, -bottom[n])
    if policy == "longest_off_anchor":
        return lambda n: (tasks[n].stream == anchor_stream, -levels.weight[n])
    if policy == "nccl_early":
        early = feeds(lambda n: tasks[n].nccl)
        return lambda n: (n not in early, -bottom[n])
    if policy == "pcie_early":
        early = feeds(lambda n: cost_model.of(n).pcie)
        return lambda n: (n not in early, -bottom[n])
    if policy == "min_slack":
        return lambda n: (levels.slack(n), -bottom[n])
    raise AutoschedError(f"unknown fire policy {policy!r}; choose from {FIRE_POLICIES}")


def fire_order(
    schedule: Schedule,
    cost_model: CostModel | None = None,
    policy: str = "critical_path",
    *,
    anchor_stream: str = "default",
) -> tuple[str, ...]:
    """A topological order of ``schedule`` (stage by stage) that breaks ties by
    ``policy``; declaration order breaks the policy's own ties.

    ``anchor_stream`` is the stream of the frozen main chain (forward, backward,
    optimizer) for the policies that favour or defer it.  Every policy but
    ``"declaration"`` needs ``cost_model`` (:data:`FIRE_POLICIES` lists them).
    """
    if policy == "declaration":
        return tuple(task.name for task in topological_sort(schedule))
    if cost_model is None:
        raise AutoschedError(f"fire policy {policy!r} needs a cost model")
    key = _policy_key(policy, schedule, cost_model, anchor_stream)
    preds, succs = _same_progress_edges(schedule)
    result: list[str] = []
    for stage in schedule.stages:
        names = [task.name for task in stage.tasks]
        position = {name: i for i, name in enumerate(names)}
        indegree = {n: len([p for p in preds[n] if p in position]) for n in names}
        ready = [(key(n), position[n], n) for n in names if indegree[n] == 0]
        heapq.heapify(ready)
        while ready:
            _, _, name = heapq.heappop(ready)
            result.append(name)
            for succ in succs[name]:
                if succ in position:
                    indegree[succ] -= 1
                    if indegree[succ] == 0:
                        heapq.heappush(ready, (key(succ), position[succ], succ))
    if len(result) != len(schedule.tasks):  # a cycle: let the engine's sort name it
        topological_sort(schedule)
    return tuple(result)


def incomparable_adjacent_pairs(schedule: Schedule, order: Sequence[str]) -> list[int]:
    """Positions ``k`` where ``order[k]`` and ``order[k + 1]`` may swap: same stage,
    no same-progress edge between them (in a topological order, adjacent tasks are
    ordered by a path only if an edge joins them)."""
    preds, _ = _same_progress_edges(schedule)
    stage_of = {t.name: s for s, stage in enumerate(schedule.stages) for t in stage.tasks}
    return [
        k
        for k in range(len(order) - 1)
        if stage_of[order[k]] == stage_of[order[k + 1]] and order[k] not in preds[order[k + 1]]
    ]
