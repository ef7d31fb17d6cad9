"""``auto_assign_lookaheads``: how far ahead each task should work.

Raising a task's lookahead moves it to a later batch, which turns its same-progress
edges to the tasks it feeds into ring-rotated ones: it can then overlap them on
another lane.  It costs one more batch in flight (memory) and is only legal while
every consumer still reads values that exist, i.e. while the engine's validator
accepts the schedule.

The assignment is a local search guided by the simulator.  A move raises (or lowers)
one task's lookahead by one, together with the producers (consumers) that must
follow it to keep every ``depends_on``/slot read legal.  Each round applies the move
that lowers the simulated steady-state latency most; equal latencies prefer fewer
batches in flight.  Frozen tasks never move, and ``max_lookahead + 1`` never
exceeds ``max_in_flight``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ..errors import ScheduleValidationError
from ..lanes import ThreadMap
from ..edges import dependency_edges
from ..schedule import Schedule
from .costs import CostModel
from .errors import AutoschedError
from .rebuild import lookaheads_of, rebuild_schedule, validate_candidate
from .simulate import simulate

__all__ = ("auto_assign_lookaheads", "scoring_batches")

#: A move must gain at least this fraction to count (simulated ties are exact, so
#: this only keeps float noise from cycling).
_MIN_GAIN = 1e-6


def scoring_batches(cost_model: CostModel, max_in_flight: int) -> int | None:
    """Batches to simulate when only the steady state matters: with host-only costs
    every steady iteration is the same, so a few suffice; device work carries over
    between iterations and needs the default, longer run."""
    if any(cost.gpu_ms > 0 for cost in cost_model.tasks.values()):
        return None
    return 2 * max_in_flight + 2


class _Constraints:
    """``la[producer] + slack >= la[consumer]`` for every same-batch style edge."""

    def __init__(self, schedule: Schedule) -> None:
        self.edges: list[tuple[str, str, int]] = []
        for task in schedule.tasks:
            for name, offset in task.cross_iter_depends_on:
                self.edges.append((name, task.name, -offset))
        for edge in dependency_edges(schedule):
            if edge.kind in ("slot", "depends_on"):
                self.edges.append((edge.producer, edge.consumer, 0))

    def raise_task(
        self, la: Mapping[str, int], name: str, frozen: Collection[str]
    ) -> dict[str, int] | None:
        result = dict(la)
        result[name] += 1
        changed = True
        while changed:
            changed = False
            for producer, consumer, slack in self.edges:
                need = result[consumer] - slack
                if result[producer] < need:
                    if producer in frozen:
                        return None
                    result[producer] = need
                    changed = True
        return result

    def lower_task(
        self, la: Mapping[str, int], name: str, frozen: Collection[str]
    ) -> dict[str, int] | None:
        result = dict(la)
        result[name] -= 1
        if result[name] < 0:
            return None
        changed = True
        while changed:
            changed = False
            for producer, consumer, slack in self.edges:
                allowed = result[producer] + slack
                if result[consumer] > allowed:
                    if consumer in frozen or allowed < 0:
                        return None
                    result[consumer] = allowed
                    changed = True
        return result


def auto_assign_lookaheads(
    schedule: Schedule,
    cost_model: CostModel,
    *,
    max_in_flight: int = 5,
    thread_map: ThreadMap = None,
    frozen: Collection[str] = (),
    max_rounds: int = 32,
) -> dict[str, int]:
    """The lookahead of every task that minimises the simulated steady-state latency
    of ``schedule`` under ``thread_map``, starting from the declared lookaheads.

    Raises :class:`AutoschedError` when the declared lookaheads cannot be brought
    within ``max_in_flight`` batches without moving a frozen task or breaking a rule.
    """
    if max_in_flight < 1:
        raise AutoschedError(f"max_in_flight must be >= 1, got {max_in_flight}")
    frozen = frozenset(frozen)
    unknown = frozen - {task.name for task in schedule.tasks}
    if unknown:
        raise AutoschedError(f"frozen names tasks {sorted(unknown)} that the schedule lacks")
    cost_model.check_covers(schedule)
    limit = max_in_flight - 1
    constraints = _Constraints(schedule)
    batches = scoring_batches(cost_model, max_in_flight)
    cache: dict[tuple[int, ...], tuple[float, int] | None] = {}
    names = [task.name for task in schedule.tasks]

    def score(la: Mapping[str, int]) -> tuple[float, int] | None:
        key = tuple(la[n] for n in names)
        if key not in cache:
            cache[key] = None
            if max(key) <= limit:
                candidate = rebuild_schedule(schedule, lookaheads=la)
                try:
                    validate_candidate(candidate)
                except ScheduleValidationError:
                    return None
                steady = simulate(candidate, cost_model, thread_map, batches=batches).steady_ms
                cache[key] = (steady, sum(key))
        return cache[key]

    current = _within_limit(lookaheads_of(schedule), limit, constraints, frozen)
    best = score(current)
    if best is None:
        raise AutoschedError(
            f"the schedule's lookaheads {current} cannot be used within max_in_flight="
            f"{max_in_flight} (the validator rejects them); raise max_in_flight"
        )
    for _ in range(max_rounds):
        moves = []
        for name in names:
            if name in frozen:
                continue
            for move in (constraints.raise_task, constraints.lower_task):
                proposal = move(current, name, frozen)
                if proposal is not None:
                    moves.append(proposal)
        scored = [(s, m) for m in moves if (s := score(m)) is not None]
        if not scored:
            break
        (steady, in_flight), proposal = min(scored, key=lambda item: item[0])
        better = steady < best[0] * (1 - _MIN_GAIN)
        leaner = steady <= best[0] * (1 + _MIN_GAIN) and in_flight < best[1]
        if not (better or leaner):
            break
        current, best = proposal, (steady, in_flight)
    return current


def _within_limit(
    la: dict[str, int], limit: int, constraints: _Constraints, frozen: Collection[str]
) -> dict[str, int]:
    """Lower every lookahead above ``limit`` to it, consumers following."""
    for name, value in sorted(la.items(), key=lambda item: -item[1]):
        while la[name] > limit:
            if name in frozen:
                raise AutoschedError(
                    f"frozen task {name!r} has lookahead {la[name]}, more than max_in_flight "
                    f"allows ({limit}); raise max_in_flight"
                )
            lowered = constraints.lower_task(la, name, frozen)
            if lowered is None:
                raise AutoschedError(
                    f"cannot lower {name!r} to lookahead {limit} without moving a frozen "
                    f"task; raise max_in_flight"
                )
            la = lowered
    return la
