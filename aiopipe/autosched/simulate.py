"""``simulate``: the iteration latency a schedule would have, from its costs.

The model follows the engine's own execution rules (docs/executors.md), so it can be
checked against a measured run task by task:

* every internal iteration runs its stages one after another; inside a stage each
  lane runs its chain of active tasks in topological order, and the iteration ends
  when every lane has finished (a host barrier per ``progress``);
* a task waits for its same-progress predecessors and for the previous active task
  on its stream (CPU edges), and a collective for the previous ticket when the
  iteration's collectives span several lanes;
* waiting for another lane costs a thread hand-off, as do starting a thread lane's
  chain and waking the loop at the end;
* device work queues on its stream: one stream runs one task at a time (FIFO), one
  communicator runs one collective at a time even across streams, host-link (PCIe)
  transfers contend; everything else overlaps.  Device work outlives the iteration
  that queued it; only ``sync`` tasks make the host wait for it.  A device-only
  ``same_progress_sync`` whose producer has not run yet is waited for at the end of
  the progress, by later work on the consumer's stream.

Steady-state latency is the median interval between the completions of successive
iterations in which every task fires (warm-up and drain are reported apart).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .._core.lanes import LOOP_LANE
from ..lanes import ThreadMap, resolve_lane
from ..edges import dependency_edges, topological_sort
from ..mask import fires
from ..schedule import Schedule
from .costs import CostModel
from .errors import AutoschedError

__all__ = ("SimResult", "TaskTiming", "overlap_matrix", "simulate", "thread_count")

_WORLD = "world"


@dataclass(frozen=True)
class TaskTiming:
    """One task of the reported steady iteration, in ms from the iteration's start."""

    task: str
    lane: str
    start_ms: float
    end_ms: float
    wait_ms: float
    gpu_start_ms: float | None = None
    gpu_end_ms: float | None = None


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` predicts."""

    steady_ms: float
    warmup_ms: float
    drain_ms: float
    total_ms: float
    #: Completion time of every internal iteration, ms from the start.
    iteration_end_ms: tuple[float, ...]
    #: Thread lanes used (``"loop"`` excluded).
    lanes: tuple[str, ...]
    #: The tasks of one steady iteration, in topological order.
    timeline: tuple[TaskTiming, ...]
    #: The chain of tasks (and waits) that set the steady iteration's length.
    critical_path: tuple[str, ...]
    #: Batches simulated.
    batches: int


def thread_count(schedule: Schedule, thread_map: ThreadMap) -> int:
    """How many lane threads ``thread_map`` needs for ``schedule``."""
    return len({resolve_lane(task, thread_map) for task in schedule.tasks} - {LOOP_LANE})


def overlap_matrix(schedule: Schedule, cost_model: CostModel) -> dict[tuple[str, str], bool]:
    """Whether the device work of two tasks may overlap, ignoring the DAG: not on one
    stream, not on one communicator, not both on the host link."""
    keys = {task.name: _resources(task.stream, task.nccl, cost_model, task.name)
            for task in schedule.tasks}  # fmt: skip
    return {(a, b): not (keys[a] & keys[b]) for a in keys for b in keys if a != b}


def _resources(stream: str, nccl: bool, cost_model: CostModel, name: str) -> frozenset[str]:
    cost = cost_model.of(name)
    keys = {f"stream:{stream}"}
    if nccl or cost.comm is not None:
        keys.add(f"comm:{cost.comm or _WORLD}")
    if cost.pcie:
        keys.add("pcie")
    return frozenset(keys)


class _Compiled:
    """Index form of (schedule, costs, thread map), as in ``ExecutionPlan``."""

    def __init__(self, schedule: Schedule, costs: CostModel, thread_map: ThreadMap) -> None:
        costs.check_covers(schedule)
        order = topological_sort(schedule)
        index = {task.name: i for i, task in enumerate(order)}
        self.names = tuple(task.name for task in order)
        self.max_lookahead = schedule.max_lookahead
        self.lookahead = tuple(task.lookahead for task in order)
        stage_of = {t.name: s for s, stage in enumerate(schedule.stages) for t in stage.tasks}
        self.stage_of = tuple(stage_of[name] for name in self.names)
        self.num_stages = len(schedule.stages)
        self.stream = tuple(task.stream for task in order)
        self.lane = tuple(resolve_lane(task, thread_map) for task in order)
        self.nccl = tuple(task.nccl for task in order)
        engine = costs.engine
        self.handoff = engine.handoff_ms
        self.progress_ms = engine.progress_ms
        task_costs = [costs.of(name) for name in self.names]
        self.work = tuple(c.host_ms + engine.task_ms for c in task_costs)
        self.awaited = tuple(c.await_ms for c in task_costs)
        self.is_async = tuple(t.is_async for t in order)
        # The loop's thread runs the "loop" lane's bodies and every async body's steps,
        # one at a time; an async body on a thread lane goes to the loop and back (a
        # hand-off each way), its lane waiting meanwhile.
        self.on_loop = tuple(lane == LOOP_LANE or t.is_async for t, lane in zip(order, self.lane))
        self.relay = tuple(
            engine.handoff_ms if t.is_async and lane != LOOP_LANE else 0.0
            for t, lane in zip(order, self.lane)
        )  # fmt: skip
        # Only an async body on a thread lane takes the loop's thread from another chain.
        self.loop_shared = any(a and lane != LOOP_LANE for a, lane in zip(self.is_async, self.lane))
        self.gpu = tuple(c.gpu_ms for c in task_costs)
        self.sync = tuple(c.sync for c in task_costs)
        self.resources = tuple(
            _resources(t.stream, t.nccl, costs, t.name) for t in order
        )
        preds: list[set[int]] = [set() for _ in order]
        gpu_waits: list[list[tuple[int, int]]] = [[] for _ in order]
        for edge in dependency_edges(schedule):
            p, c = index[edge.producer], index[edge.consumer]
            if edge.intra_progress:
                preds[c].add(p)
            if self.stream[p] != self.stream[c] and edge.sides != "cpu":
                gpu_waits[c].append((p, edge.delta))
        self.preds = tuple(tuple(sorted(p)) for p in preds)
        self.gpu_waits = tuple(tuple(w) for w in gpu_waits)
        self.thread_lanes = tuple(sorted(set(self.lane) - {LOOP_LANE}))
        self._layouts: dict[tuple[int, ...], list[_StageLayout]] = {}

    def layout(self, active: tuple[int, ...]) -> list[_StageLayout]:
        """Per stage: its active tasks, one chain per lane, and what each task waits
        for besides its lane: its same-progress predecessors, the previous active task
        on its stream and, when the stage's collectives span several lanes, the task
        holding the previous ticket."""
        cached = self._layouts.get(active)
        if cached is None:
            cached = []
            for stage in range(self.num_stages):
                members = tuple(i for i in active if self.stage_of[i] == stage)
                present = set(members)
                collectives = [i for i in members if self.nccl[i]]
                previous: dict[int, int] = {}
                if len({self.lane[i] for i in collectives}) > 1:
                    previous = dict(zip(collectives[1:], collectives[:-1]))
                chains: dict[str, list[int]] = {}
                last_on_stream: dict[str, int] = {}
                blockers: dict[int, tuple[int, ...]] = {}
                for i in members:  # topological order
                    chains.setdefault(self.lane[i], []).append(i)
                    waits = {p for p in self.preds[i] if p in present}
                    if self.stream[i] in last_on_stream:
                        waits.add(last_on_stream[self.stream[i]])
                    if i in previous:
                        waits.add(previous[i])
                    blockers[i] = tuple(sorted(waits))
                    last_on_stream[self.stream[i]] = i
                lanes = {lane: tuple(chain) for lane, chain in chains.items()}
                cached.append(_StageLayout(members, lanes, blockers))
            self._layouts[active] = cached
        return cached


@dataclass(frozen=True)
class _StageLayout:
    members: tuple[int, ...]
    chains: dict[str, tuple[int, ...]]
    blockers: dict[int, tuple[int, ...]]


@dataclass
class _Device:
    """Device-side state that outlives iterations."""

    free: dict[str, float]
    gpu_end: dict[tuple[int, int], float]
    #: (producer, stream) waits of this progress issued at its end: a device-only
    #: sync whose producer had not run when its consumer did.
    deferred: list[tuple[int, str]] = field(default_factory=list)


def simulate(
    schedule: Schedule,
    cost_model: CostModel,
    thread_map: ThreadMap = None,
    *,
    batches: int | None = None,
) -> SimResult:
    """Predict the run of ``batches`` batches (default ``3 * max_lookahead + 8``)
    through ``schedule`` on the async executor with ``thread_map``.

    Raises :class:`~aiopipe.autosched.CostModelError` if a task has no cost, and the
    validator's errors for a schedule whose dependencies cannot be honoured.
    """
    compiled = _Compiled(schedule, cost_model, thread_map)
    return _run(compiled, batches)


def _run(c: _Compiled, batches: int | None) -> SimResult:
    top = c.max_lookahead
    total = batches if batches is not None else 3 * top + 8
    if total < top + 2:
        raise AutoschedError(
            f"simulate needs at least max_lookahead + 2 = {top + 2} batches for two steady "
            f"iterations, got {total}"
        )
    device = _Device({}, {})
    clock = 0.0
    ends: list[float] = []
    report = (top + total - 1) // 2  # a steady iteration in the middle of the run
    timeline: tuple[TaskTiming, ...] = ()
    critical: tuple[str, ...] = ()
    for iteration in range(total + top):
        active = tuple(
            i for i, la in enumerate(c.lookahead) if fires(la, iteration, top, total)
        )
        begin = clock
        clock += c.progress_ms
        device_end = clock
        record: list[TaskTiming] | None = [] if iteration == report else None
        because: dict[int, int | None] = {}
        last = -1
        for layout in c.layout(active):
            clock, stage_device_end, stage_last = _run_stage(
                c, iteration, layout, clock, device, because, record, begin
            )
            device_end = max(device_end, stage_device_end)
            last = stage_last if stage_last >= 0 else last
        _issue_deferred_waits(device, iteration)
        ends.append(max(clock, device_end))
        if record is not None:
            timeline = tuple(record)
            critical = _backtrack(c, because, last)
    steady = [b - a for a, b in zip(ends[top:total - 1], ends[top + 1:total])]
    first_steady_start = ends[top - 1] if top > 0 else 0.0
    return SimResult(
        steady_ms=statistics.median(steady),
        warmup_ms=first_steady_start,
        drain_ms=ends[-1] - ends[total - 1],
        total_ms=ends[-1],
        iteration_end_ms=tuple(ends),
        lanes=c.thread_lanes,
        timeline=timeline,
        critical_path=critical,
        batches=total,
    )


def _run_stage(
    c: _Compiled,
    iteration: int,
    layout: _StageLayout,
    start: float,
    device: _Device,
    because: dict[int, int | None],
    record: list[TaskTiming] | None,
    origin: float,
) -> tuple[float, float, int]:
    """Run one stage from ``start``; return (host end, device end, last task).

    Tasks run in the order they start, as on the machine: each round takes, of every
    lane's next task whose waits are known, the one that starts first.  That order
    books the loop's thread, which runs one body at a time: the "loop" lane's
    synchronous bodies whole, an async body only its host part (its awaits leave the
    thread free).  At equal times the loop lane's chain goes first: it runs its sync
    bodies back to back and lets other coroutines in only where it awaits.
    """
    if not layout.members:
        return start, start, -1
    heads = {lane: 0 for lane in layout.chains}
    lane_free: dict[str, float] = {}
    lane_last: dict[str, int] = {}
    end: dict[int, float] = {}
    loop_free, loop_last = start, None  # when the loop's thread is free, and who had it
    device_end = start
    timings: list[tuple[int, TaskTiming]] = []
    taken = 0
    while heads:
        pick: tuple[tuple[float, bool, int], str, float, int | None] | None = None
        candidates: Iterable[tuple[str, int]] = heads.items()
        if not c.loop_shared:  # the order cannot matter: take the topological one (faster)
            lane_of_next = c.lane[layout.members[taken]]
            candidates = ((lane_of_next, heads[lane_of_next]),)
        taken += 1
        for lane, head in candidates:
            i = layout.chains[lane][head]
            waits = layout.blockers[i]
            if any(p not in end for p in waits):
                continue
            ready = lane_free.get(lane)
            if ready is None:  # a thread lane wakes when it receives its chain
                ready = start if lane == LOOP_LANE else start + c.handoff
            blocker = max(waits, key=end.__getitem__, default=None)
            cause: int | None
            if blocker is not None and end[blocker] > ready:
                begin, cause = end[blocker] + c.handoff, blocker
            else:
                begin, cause = ready, lane_last.get(lane)
            body = begin + c.relay[i]
            if c.on_loop[i] and loop_free > body:
                body, cause = loop_free, loop_last
            key = (body, lane != LOOP_LANE, i)
            if pick is None or key < pick[0]:
                pick = (key, lane, ready, cause)
        assert pick is not None  # the earliest task left in topological order is ready
        (body, _, i), lane, ready, because[i] = pick
        heads[lane] += 1
        if heads[lane] == len(layout.chains[lane]):
            del heads[lane]
        host_end = body + c.work[i]
        body_end = host_end + c.awaited[i]
        for producer, delta in c.gpu_waits[i]:
            if delta == 0 and (producer, iteration) not in device.gpu_end:
                device.deferred.append((producer, c.stream[i]))
        gpu_span = None
        if c.gpu[i] > 0.0:
            gpu_begin = max([body, *(device.free.get(r, 0.0) for r in c.resources[i])])
            for producer, delta in c.gpu_waits[i]:
                gpu_begin = max(gpu_begin, device.gpu_end.get((producer, iteration - delta), 0.0))
            gpu_end = max(gpu_begin + c.gpu[i], host_end)
            for resource in c.resources[i]:
                device.free[resource] = gpu_end
            device.gpu_end[(i, iteration)] = gpu_end
            device_end = max(device_end, gpu_end)
            gpu_span = (gpu_begin - origin, gpu_end - origin)
            if c.sync[i]:
                body_end = max(body_end, gpu_end)
        if c.on_loop[i]:  # a sync body holds the loop's thread to its end
            loop_free, loop_last = (host_end if c.is_async[i] else body_end), i
        end[i] = lane_free[lane] = body_end + c.relay[i]
        lane_last[lane] = i
        if record is not None:
            started = body - c.relay[i]
            timings.append((i, TaskTiming(
                c.names[i], lane, started - origin, end[i] - origin, started - ready,
                *(gpu_span or (None, None)),
            )))  # fmt: skip
    if record is not None:
        record.extend(timing for _, timing in sorted(timings, key=lambda item: item[0]))
    # The loop finishes its own chain, then is woken by the last thread lane.
    finish = {i: t + (c.handoff if c.lane[i] != LOOP_LANE else 0.0) for i, t in end.items()}
    last = max(finish, key=finish.__getitem__)
    return finish[last], device_end, last


def _issue_deferred_waits(device: _Device, iteration: int) -> None:
    """The engine's end-of-progress stream waits: later work on each stream waits for
    the producer's device work of this progress."""
    for producer, stream in device.deferred:
        produced = device.gpu_end.get((producer, iteration))
        if produced is not None:
            key = f"stream:{stream}"
            device.free[key] = max(device.free.get(key, 0.0), produced)
    device.deferred.clear()


def _backtrack(c: _Compiled, because: Mapping[int, int | None], last: int) -> tuple[str, ...]:
    path: list[str] = []
    node: int | None = last
    seen: set[int] = set()
    while node is not None and node not in seen and node >= 0:
        seen.add(node)
        path.append(c.names[node])
        node = because.get(node)
    return tuple(reversed(path))

