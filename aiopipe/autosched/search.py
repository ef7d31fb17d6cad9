"""``joint_search``: beam search over thread map x stream map x fire order.

The three choices interact -- a lane split only pays if the fire order lets the
split tasks start early, a stream move adds or removes FIFO edges, and the best
lookaheads depend on all of them -- so they are searched together.  The procedure
(see docs/autosched.md):

1. start from the schedule as declared (its thread map, streams and order);
2. each round, mutate every beam candidate: thread map (presets, and moving a
   stream group or a single task to another lane, a new lane or the loop), stream
   map (a movable group to another stream, alone or together with a move onto that
   stream's lane or a new one; an async task sharing its stream to a stream of its
   own, alone or with a lane move), fire order (the list-scheduling policies and swaps of
   adjacent independent tasks);
3. reject candidates that move a frozen task's stream or lookahead or need more
   than ``max_threads`` lane threads; score the rest by simulation;
4. give the most promising ones their lookaheads (``auto_assign_lookaheads`` under
   ``max_in_flight``, frozen tasks fixed) and score them again;
5. keep, per (thread map, streams, lookaheads), the best fire order, drop
   candidates another one matches or beats with no more threads, keep the best
   ``beam_width``;
6. stop after ``rounds`` rounds or ``patience`` rounds without a gain.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ScheduleValidationError
from .._core.lanes import LOOP_LANE
from ..lanes import ThreadMap, resolve_lane
from ..edges import topological_sort
from ..schedule import Schedule
from .costs import CostModel
from .errors import AutoschedError
from .listsched import FIRE_POLICIES, fire_order, incomparable_adjacent_pairs
from .lookahead import auto_assign_lookaheads, scoring_batches
from .rebuild import lookaheads_of, rebuild_schedule, streams_of, validate_candidate
from .simulate import simulate

__all__ = ("Candidate", "SearchResult", "joint_search")

Pairs = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Candidate:
    """One point of the search space (maps as sorted ``(task, value)`` pairs so
    candidates hash) and its simulated steady-state latency."""

    thread_map: Pairs
    streams: Pairs
    fire_order: tuple[str, ...]
    lookaheads: Pairs
    score: float = float("inf")
    note: str = ""

    @property
    def threads(self) -> int:
        return len({lane for _, lane in self.thread_map} - {LOOP_LANE})

    @property
    def key(self) -> tuple[Pairs, Pairs, tuple[str, ...], Pairs]:
        return (self.thread_map, self.streams, self.fire_order, self.lookaheads)

    def thread_map_dict(self) -> dict[str, str]:
        return dict(self.thread_map)


@dataclass(frozen=True)
class SearchResult:
    """The search's pick and the baseline it is compared with."""

    best: Candidate
    baseline: Candidate
    schedule: Schedule  # the best candidate, materialised
    evaluated: int
    rounds: int
    history: tuple[float, ...] = field(default=())  # best score after each round

    @property
    def thread_map(self) -> dict[str, str]:
        return self.best.thread_map_dict()

    @property
    def predicted_gain(self) -> float:
        """Fraction of the baseline's steady-state latency the pick saves."""
        return 1.0 - self.best.score / self.baseline.score

    def to_dict(self) -> dict[str, Any]:
        def describe(c: Candidate) -> dict[str, Any]:
            return {
                "latency_ms": round(c.score, 4),
                "threads": c.threads,
                "thread_map": dict(c.thread_map),
                "stream_map": dict(c.streams),
                "lookaheads": dict(c.lookaheads),
                "fire_order": list(c.fire_order),
                "note": c.note,
            }

        return {
            "baseline": describe(self.baseline),
            "best": describe(self.best),
            "predicted_gain": round(self.predicted_gain, 4),
            "evaluated": self.evaluated,
            "rounds": self.rounds,
        }


def _pairs(mapping: Mapping[str, Any]) -> Pairs:
    return tuple(sorted(mapping.items()))


class _Search:
    def __init__(
        self,
        schedule: Schedule,
        cost_model: CostModel,
        presets: Mapping[str, ThreadMap],
        frozen: frozenset[str],
        groups: Sequence[Collection[str]],
        max_threads: int,
        max_in_flight: int,
        anchor_stream: str,
        allow_loop: bool,
    ) -> None:
        self.schedule, self.costs = schedule, cost_model
        self.allow_loop = allow_loop
        self.names = tuple(task.name for task in schedule.tasks)
        self.presets = {
            label: _pairs({t.name: resolve_lane(t, tm) for t in schedule.tasks})
            for label, tm in presets.items()
        }
        self.frozen, self.groups = frozen, groups
        self.max_threads, self.max_in_flight = max_threads, max_in_flight
        self.anchor_stream = anchor_stream
        self.streams = tuple(schedule.stream_slots)
        self.async_tasks = tuple(task.name for task in schedule.tasks if task.is_async)
        self.batches = scoring_batches(cost_model, max_in_flight)
        self.scores: dict[tuple[Any, ...], tuple[float, tuple[str, ...]] | None] = {}
        self.normalised: dict[tuple[Any, ...], Candidate | None] = {}

    # -- scoring -------------------------------------------------------------------------

    def materialise(self, c: Candidate) -> Schedule:
        return rebuild_schedule(self.schedule, lookaheads=dict(c.lookaheads),
                                streams=dict(c.streams), fire_order=c.fire_order)  # fmt: skip

    def quick_score(self, c: Candidate) -> Candidate | None:
        """Score with the lookaheads it has; ``None`` if illegal."""
        if c.threads > self.max_threads:
            return None
        if max(lookahead for _, lookahead in c.lookaheads) + 1 > self.max_in_flight:
            return None  # more batches in flight than allowed (normalise cuts them down)
        if not self.allow_loop and any(lane == LOOP_LANE for _, lane in c.thread_map):
            return None
        declared = self.schedule
        for name in self.frozen:
            task = declared.task(name)
            if dict(c.streams)[name] != task.stream or dict(c.lookaheads)[name] != task.lookahead:
                return None
        if c.key not in self.scores:
            self.scores[c.key] = None
            try:
                built = self.materialise(c)
                validate_candidate(built)
            except ScheduleValidationError:
                return None
            latency = simulate(built, self.costs, c.thread_map_dict(), batches=self.batches)
            order = tuple(t.name for t in topological_sort(built))
            self.scores[c.key] = (latency.steady_ms, order)
        scored = self.scores[c.key]
        if scored is None:
            return None
        return replace(c, score=scored[0])

    def normalise(self, c: Candidate) -> Candidate | None:
        """Give ``c`` its best lookaheads and score it."""
        key = (c.thread_map, c.streams, c.fire_order)
        if key not in self.normalised:
            self.normalised[key] = None
            provisional = rebuild_schedule(self.schedule, streams=dict(c.streams),
                                           fire_order=c.fire_order)  # fmt: skip
            try:
                lookaheads = auto_assign_lookaheads(
                    provisional, self.costs, max_in_flight=self.max_in_flight,
                    thread_map=c.thread_map_dict(), frozen=self.frozen,
                )  # fmt: skip
            except (AutoschedError, ScheduleValidationError):
                return None
            self.normalised[key] = self.quick_score(replace(c, lookaheads=_pairs(lookaheads)))
        return self.normalised[key]

    # -- mutations -----------------------------------------------------------------------

    def mutate_thread_map(self, c: Candidate) -> Iterator[Candidate]:
        for label, preset in self.presets.items():
            yield replace(c, thread_map=preset, note=f"threads: preset {label}")
        lanes = dict(c.thread_map)
        used = sorted(set(lanes.values()))
        streams = dict(c.streams)
        units = [(f"stream {s}", [n for n in self.names if streams[n] == s])
                 for s in sorted(set(streams.values()))]  # fmt: skip
        units += [(n, [n]) for n in self.names]
        for label, members in units:
            fresh = f"lane_{members[0]}" if len(members) == 1 else f"lane_{streams[members[0]]}"
            targets = [*used, fresh, LOOP_LANE]
            for lane in dict.fromkeys(t for t in targets if self.allow_loop or t != LOOP_LANE):
                if all(lanes[m] == lane for m in members):
                    continue
                moved = {**lanes, **{m: lane for m in members}}
                yield replace(c, thread_map=_pairs(moved), note=f"threads: {label} -> {lane}")

    def mutate_stream_map(self, c: Candidate) -> Iterator[Candidate]:
        streams, lanes = dict(c.streams), dict(c.thread_map)
        for group in self.groups:
            movable = [n for n in group if n not in self.frozen]
            for stream in self.streams:
                if movable and any(streams[n] != stream for n in movable):
                    moved = {**streams, **{n: stream for n in movable}}
                    label = f"streams: {'/'.join(movable)} -> {stream}"
                    yield replace(c, streams=_pairs(moved), note=label)
                    # A stream move alone often gains nothing (the tasks still share
                    # a lane with their old stream's), and the lane move alone gains
                    # nothing either (the stream's FIFO order still chains them): each
                    # half would be pruned before the other could pay off.  So also
                    # offer both at once, onto the target stream's lane or a new one.
                    for lane in self._lanes_for_stream(stream, streams, lanes, movable):
                        yield replace(c, streams=_pairs(moved), note=f"{label}, lane {lane}",
                                      thread_map=_pairs({**lanes, **{n: lane for n in movable}}))

    def mutate_own_stream(self, c: Candidate) -> Iterator[Candidate]:
        """Each async task sharing its stream gets one of its own, alone and together
        with a lane move (the loop, or a fresh lane): on a shared stream the engine
        runs it in order with the others, so its awaits overlap none of their work
        (``aiopipe.validate.serialized_awaits``).  Nothing else may hide an await."""
        streams, lanes = dict(c.streams), dict(c.thread_map)
        taken = set(streams.values()) | set(self.streams)
        for name in self.async_tasks:
            if name in self.frozen or sum(s == streams[name] for s in streams.values()) < 2:
                continue
            own = name
            while own in taken:
                own += "_"
            moved = _pairs({**streams, name: own})
            label = f"streams: {name} -> a stream of its own, {own!r}"
            yield replace(c, streams=moved, note=label)
            for lane in (LOOP_LANE, f"lane_{own}"):
                if (lane != LOOP_LANE or self.allow_loop) and lanes[name] != lane:
                    yield replace(c, streams=moved, note=f"{label}, lane {lane}",
                                  thread_map=_pairs({**lanes, name: lane}))  # fmt: skip

    def _lanes_for_stream(self, stream: str, streams: Mapping[str, str],
                          lanes: Mapping[str, str], movable: Sequence[str]) -> list[str]:
        residents = {lanes[n] for n in self.names if streams[n] == stream and n not in movable}
        candidates = [*sorted(residents - {LOOP_LANE}), f"lane_{stream}"]
        return [lane for lane in dict.fromkeys(candidates)
                if any(lanes[n] != lane for n in movable)]  # fmt: skip

    def mutate_fire_order(self, c: Candidate) -> Iterator[Candidate]:
        built = self.materialise(c)
        for policy in FIRE_POLICIES:
            order = fire_order(built, self.costs, policy, anchor_stream=self.anchor_stream)
            yield replace(c, fire_order=order, note=f"order: {policy}")
        current = tuple(t.name for t in topological_sort(built))
        for k in incomparable_adjacent_pairs(built, current):
            swapped = (*current[:k], current[k + 1], current[k], *current[k + 2:])
            yield replace(c, fire_order=swapped, note=f"order: swap {current[k]}/{current[k + 1]}")


def _dominance_prune(candidates: Sequence[Candidate]) -> list[Candidate]:
    best_per_group: dict[tuple[Pairs, Pairs, Pairs], Candidate] = {}
    for c in candidates:
        group = (c.thread_map, c.streams, c.lookaheads)
        if group not in best_per_group or c.score < best_per_group[group].score:
            best_per_group[group] = c
    ranked = sorted(best_per_group.values(), key=lambda c: (c.score, c.threads))
    kept: list[Candidate] = []
    for c in ranked:
        # Everything kept so far scores no worse; it dominates c unless c needs
        # fewer threads than each of them.
        if all(c.threads < k.threads for k in kept):
            kept.append(c)
    return kept


def joint_search(
    schedule: Schedule,
    cost_model: CostModel,
    *,
    thread_map: ThreadMap = None,
    presets: Mapping[str, ThreadMap] | None = None,
    frozen: Collection[str] = (),
    movable_groups: Sequence[Collection[str]] | None = None,
    max_threads: int = 4,
    max_in_flight: int = 5,
    beam_width: int = 4,
    rounds: int = 6,
    patience: int = 2,
    anchor_stream: str = "default",
    allow_loop: bool = True,
) -> SearchResult:
    """Search thread map x stream map x fire order (with lookaheads assigned per
    candidate) for the lowest simulated steady-state latency.

    ``thread_map`` is the baseline the result is compared with; ``presets`` are
    extra named thread maps to try.  ``frozen`` tasks keep their stream and lookahead
    (put the bit-exact main chain here).  ``movable_groups`` are the task sets that
    change stream together (default: the non-frozen tasks of each stream).
    ``allow_loop=False`` never moves a task onto the ``"loop"`` lane: a sync body
    there holds the event loop while it runs, which the simulator does not charge
    to async sources, serving handlers or other coroutines sharing the loop.
    """
    if max_threads < 1 or max_in_flight < 1 or beam_width < 1:
        raise AutoschedError("max_threads, max_in_flight and beam_width must all be >= 1")
    cost_model.check_covers(schedule)
    frozen_set = frozenset(frozen)
    unknown = frozen_set - {task.name for task in schedule.tasks}
    if unknown:
        raise AutoschedError(f"frozen names tasks {sorted(unknown)} that the schedule lacks")
    validate_candidate(schedule)
    if movable_groups is None:
        by_stream: dict[str, list[str]] = {}
        for task in schedule.tasks:
            if task.name not in frozen_set:
                by_stream.setdefault(task.stream, []).append(task.name)
        movable_groups = list(by_stream.values())
    all_presets: dict[str, ThreadMap] = {"by_stream": "by_stream",
                                         "one_lane": lambda task: "main"}  # fmt: skip
    all_presets.update(presets or {})
    search = _Search(schedule, cost_model, all_presets, frozen_set, movable_groups,
                     max_threads, max_in_flight, anchor_stream, allow_loop)  # fmt: skip
    canonical = Candidate(
        thread_map=_pairs({t.name: resolve_lane(t, thread_map) for t in schedule.tasks}),
        streams=_pairs(streams_of(schedule)),
        fire_order=tuple(t.name for t in topological_sort(schedule)),
        lookaheads=_pairs(lookaheads_of(schedule)),
        note="baseline",
    )
    # The baseline is the schedule as the user runs it, whatever the limits say.
    base_latency = simulate(schedule, cost_model, thread_map, batches=search.batches).steady_ms
    baseline = replace(canonical, score=base_latency)
    start = canonical
    if not allow_loop:  # the baseline's loop tasks start on a thread lane of their own
        start = replace(canonical, thread_map=_pairs(
            {name: "main" if lane == LOOP_LANE else lane for name, lane in canonical.thread_map}
        ))  # fmt: skip
    starts = [c for c in (search.quick_score(start), search.normalise(start)) if c]
    if not starts:  # the baseline breaks a limit (max_threads): start from its neighbours
        starts = [n for m in search.mutate_thread_map(start) if (n := search.normalise(m))]
    if not starts:
        raise AutoschedError(
            f"no candidate satisfies max_threads={max_threads} and max_in_flight="
            f"{max_in_flight} with the frozen tasks {sorted(frozen_set)}; relax a limit"
        )
    beam = _dominance_prune(starts)[:beam_width]
    best = beam[0]
    history: list[float] = []
    stale, done_rounds = 0, 0
    for _ in range(rounds):
        done_rounds += 1
        expanded: dict[tuple[Any, ...], Candidate] = {}
        for c in beam:
            for mutation in (*search.mutate_thread_map(c), *search.mutate_stream_map(c),
                             *search.mutate_own_stream(c),
                             *search.mutate_fire_order(c)):  # fmt: skip
                expanded.setdefault(mutation.key, mutation)
        quick = sorted(
            (s for m in expanded.values() if (s := search.quick_score(m)) is not None),
            key=lambda c: (c.score, c.threads),
        )
        promising = quick[: 2 * beam_width]
        normalised = [n for c in promising if (n := search.normalise(c)) is not None]
        beam = _dominance_prune([*quick, *normalised])[:beam_width]
        if not beam:
            break
        if beam[0].score < best.score * (1 - 1e-6):
            best, stale = beam[0], 0
        else:
            stale += 1
        history.append(best.score)
        if stale >= patience:
            break
    built = search.materialise(best)
    best = replace(best, fire_order=tuple(t.name for t in topological_sort(built)))
    return SearchResult(best, baseline, built, len(search.scores), done_rounds, tuple(history))
