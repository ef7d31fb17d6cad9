"""Fire orders, lookahead assignment and the joint search."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from aiopipe import (
    AsyncExecutor,
    SchedulablePipeline,
    Schedule,
    Task,
    TaskContext,
    validate_schedule,
)
from aiopipe.autosched import (
    FIRE_POLICIES,
    AutoschedError,
    CostModel,
    EngineCosts,
    TaskCost,
    auto_assign_lookaheads,
    fire_order,
    joint_search,
    rebuild_schedule,
    simulate,
)
from aiopipe.autosched.search import Candidate, _dominance_prune
from aiopipe.edges import topological_sort
from aiopipe.streams import StreamPool
from schedules import Trace, build_tasks, schedule_specs

FREE = EngineCosts(progress_ms=0.0, task_ms=0.0, handoff_ms=0.0)
CHEAP = EngineCosts(progress_ms=0.01, task_ms=0.002, handoff_ms=0.05)


def step_result(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.batch_index)


def task(name: str, **fields: Any) -> Task:
    return Task.from_fn(name, lambda ctx: None, **fields)


def hstu_like() -> Schedule:
    """The HSTU step's shape: io prep, input distribution, a frozen main chain."""
    spec = [
        ("h2d", 2, "memcpy", False, ("batch_cpu",), ("batch_gpu",), {}),
        ("shuffle", 2, "memcpy", True, ("batch_gpu",), ("shuffled",), {}),
        ("start_dist", 1, "data_dist", True, ("shuffled",), ("request",), {}),
        ("wait_dist", 1, "data_dist", True, ("request",), ("dist",), {}),
        ("tokens", 0, "default", True, ("shuffled",), ("tokens",), {}),
        ("forward", 0, "default", False, ("dist",), ("losses",), {"depends_on": ("tokens",)}),
        ("backward", 0, "default", False, ("losses",), ("grads",), {}),
        ("optimizer", 0, "default", False, ("grads",), (), {}),
        ("result", 0, "default", False, (), ("step_result",), {"depends_on": ("optimizer",)}),
    ]
    tasks = [
        Task.from_fn(name, step_result if name == "result" else (lambda ctx: None),
                     lookahead=la, stream=stream, nccl=nccl, reads=reads, writes=writes, **extra)
        for name, la, stream, nccl, reads, writes, extra in spec
    ]  # fmt: skip
    return Schedule.of(tasks, ("default", "memcpy", "data_dist"))


HSTU_MS = {"h2d": 1.0, "shuffle": 1.0, "start_dist": 1.5, "wait_dist": 3.0, "tokens": 0.5,
           "forward": 5.0, "backward": 7.0, "optimizer": 1.5, "result": 0.1}  # fmt: skip
HSTU_DEFAULT = {"h2d": "io", "shuffle": "io"}  # the rest on lane "default"
FROZEN = ("forward", "backward", "optimizer")


# -- fire order ----------------------------------------------------------------------


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule_specs())
def test_every_policy_gives_an_order_the_engine_reproduces(specs: Any) -> None:
    schedule = Schedule.of(build_tasks(specs, Trace()))
    model = CostModel.from_host_ms({s.name: 1.0 + len(s.name) % 3 for s in specs}, FREE)
    for policy in FIRE_POLICIES:
        order = fire_order(schedule, model, policy)
        assert sorted(order) == sorted(t.name for t in schedule.tasks)
        rebuilt = rebuild_schedule(schedule, fire_order=order)
        assert tuple(t.name for t in topological_sort(rebuilt)) == order


def test_critical_path_first_starts_the_long_chain_early() -> None:
    schedule = Schedule.of([task("short"), task("head"), task("tail", depends_on=("head",))])
    model = CostModel.from_host_ms({"short": 1.0, "head": 1.0, "tail": 5.0}, FREE)
    assert fire_order(schedule, model, "declaration") == ("short", "head", "tail")
    assert fire_order(schedule, model, "critical_path") == ("head", "tail", "short")
    with pytest.raises(AutoschedError, match="unknown fire policy"):
        fire_order(schedule, model, "random")


# -- lookaheads ------------------------------------------------------------------------


def prep_then_train() -> Schedule:
    return Schedule.of([task("prep", stream="io", writes=("x",)), task("train", reads=("x",))])


def test_raising_a_lookahead_lets_prep_overlap_training() -> None:
    schedule, model = prep_then_train(), CostModel.from_host_ms({"prep": 3.0, "train": 3.0}, FREE)
    assert simulate(schedule, model, "by_stream").steady_ms == pytest.approx(6.0)
    assigned = auto_assign_lookaheads(schedule, model, max_in_flight=3, thread_map="by_stream")
    assert assigned == {"prep": 1, "train": 0}  # one more batch is enough
    faster = rebuild_schedule(schedule, lookaheads=assigned)
    assert simulate(faster, model, "by_stream").steady_ms == pytest.approx(3.0)
    # one batch in flight, or the consumer frozen: nothing to gain
    assert auto_assign_lookaheads(schedule, model, max_in_flight=1, thread_map="by_stream") == {
        "prep": 0, "train": 0}  # fmt: skip


def test_producers_follow_a_raised_reader_and_frozen_tasks_never_move() -> None:
    schedule = Schedule.of([
        task("read", stream="io", writes=("raw",)),
        task("prep", stream="io", reads=("raw",), writes=("x",)),
        task("train", reads=("x",)),
    ])  # fmt: skip
    model = CostModel.from_host_ms({"read": 1.0, "prep": 3.0, "train": 4.0}, FREE)
    assigned = auto_assign_lookaheads(schedule, model, max_in_flight=4, thread_map="by_stream")
    assert assigned["prep"] >= 1 and assigned["read"] >= assigned["prep"]
    assert assigned["train"] == 0
    frozen = auto_assign_lookaheads(schedule, model, max_in_flight=4, thread_map="by_stream",
                                    frozen=("read",))  # fmt: skip
    assert frozen["read"] == 0 and frozen["prep"] == 0


def test_needless_lookahead_is_given_back() -> None:
    schedule = Schedule.of([task("prep", lookahead=3, writes=("x",)), task("train", reads=("x",))])
    model = CostModel.from_host_ms({"prep": 1.0, "train": 1.0}, FREE)
    # both on one lane: running ahead buys nothing, so hold fewer batches
    assert auto_assign_lookaheads(schedule, model, thread_map=lambda t: "main")["prep"] == 0


def test_lookahead_limits_are_enforced() -> None:
    schedule = Schedule.of([task("prep", lookahead=3, writes=("x",)), task("train", reads=("x",))])
    model = CostModel.from_host_ms({"prep": 1.0, "train": 1.0}, FREE)
    assert auto_assign_lookaheads(schedule, model, max_in_flight=2)["prep"] <= 1
    with pytest.raises(AutoschedError, match="frozen task 'prep'"):
        auto_assign_lookaheads(schedule, model, max_in_flight=2, frozen=("prep",))
    with pytest.raises(AutoschedError, match="max_in_flight must be"):
        auto_assign_lookaheads(schedule, model, max_in_flight=0)


# -- the joint search ---------------------------------------------------------------------


def test_dominance_keeps_only_candidates_that_trade_threads_for_time() -> None:
    def c(score: float, lanes: tuple[str, ...], order: tuple[str, ...] = ("a",)) -> Candidate:
        return Candidate(tuple((f"t{i}", lane) for i, lane in enumerate(lanes)), (), order, (),
                         score)  # fmt: skip

    fast_two = c(1.0, ("x", "y"))
    slow_one = c(2.0, ("x",))
    slow_two = c(2.0, ("x", "z"))  # as many threads as fast_two, slower: dominated
    same_group_worse = c(3.0, ("x", "y"), ("b",))
    kept = _dominance_prune([slow_two, same_group_worse, slow_one, fast_two])
    assert kept == [fast_two, slow_one]


def test_search_beats_the_default_thread_map_within_its_limits() -> None:
    schedule = hstu_like()
    model = CostModel.from_host_ms(HSTU_MS, CHEAP)
    result = joint_search(schedule, model, thread_map=HSTU_DEFAULT, frozen=FROZEN,
                          max_threads=3, max_in_flight=4)  # fmt: skip
    assert result.predicted_gain > 0.10
    assert result.best.threads <= 3
    # the pick is what it claims: a valid schedule whose simulation gives its score
    validate_schedule(result.schedule, StreamPool({n: None for n in result.schedule.stream_slots}))
    assert simulate(result.schedule, model, result.thread_map).steady_ms == pytest.approx(
        result.best.score)  # fmt: skip
    assert result.best.fire_order == tuple(t.name for t in topological_sort(result.schedule))
    assert set(result.thread_map) == set(HSTU_MS)
    assert max(result.schedule.task(n).lookahead for n in HSTU_MS) + 1 <= 4
    for name in FROZEN:
        assert result.schedule.task(name).lookahead == 0
        assert result.schedule.task(name).stream == "default"
    report = result.to_dict()
    assert report["baseline"]["latency_ms"] > report["best"]["latency_ms"]


def test_search_finds_a_schedule_that_needs_a_stream_and_a_lane_move_together() -> None:
    # Side work (stats, report) shares the main chain's stream and lane.  A spare
    # stream alone leaves it on the lane; a lane alone leaves it in the stream's
    # FIFO order behind the main chain: only both moves at once overlap it.
    tasks = [
        task("load", lookahead=1, writes=("x",)),
        task("forward", reads=("x",), writes=("y",)),
        task("backward", reads=("y",), writes=("g",)),
        Task.from_fn("optimizer", step_result, reads=("g",)),
        task("stats", reads=("x",), writes=("s",)),
        task("report", reads=("s",)),
    ]
    schedule = Schedule.of(tasks, ("default", "side"))
    ms = {"load": 1.0, "forward": 4.0, "backward": 5.0, "optimizer": 1.0, "stats": 3.0,
          "report": 3.0}  # fmt: skip
    model = CostModel.from_host_ms(ms, CHEAP)
    one_lane = {name: "main" for name in ms}
    side = ("stats", "report")
    only_streams = rebuild_schedule(schedule, streams={n: "side" for n in side})
    only_lanes = {**one_lane, **{n: "side" for n in side}}
    base = simulate(schedule, model, one_lane).steady_ms
    assert simulate(only_streams, model, one_lane).steady_ms >= base * 0.99
    assert simulate(schedule, model, only_lanes).steady_ms >= base * 0.99
    result = joint_search(schedule, model, thread_map=one_lane, frozen=FROZEN,
                          max_threads=2, allow_loop=False)  # fmt: skip
    assert result.predicted_gain > 0.3
    picked = result.schedule
    for name in side:
        assert picked.task(name).stream != "default"
        assert result.thread_map[name] != result.thread_map["forward"]


def test_max_threads_bounds_the_pick() -> None:
    schedule = hstu_like()
    model = CostModel.from_host_ms(HSTU_MS, CHEAP)
    result = joint_search(schedule, model, thread_map=HSTU_DEFAULT, frozen=FROZEN, max_threads=1,
                          rounds=2)  # fmt: skip
    assert result.best.threads <= 1


def test_allow_loop_false_keeps_tasks_off_the_event_loop() -> None:
    schedule = hstu_like()
    model = CostModel.from_host_ms(HSTU_MS, CHEAP)
    free = joint_search(schedule, model, thread_map=HSTU_DEFAULT, frozen=FROZEN, rounds=3)
    assert "loop" in free.thread_map.values()  # the loop is attractive here ...
    kept_off = joint_search(schedule, model, thread_map=HSTU_DEFAULT, frozen=FROZEN, rounds=3,
                            allow_loop=False)  # fmt: skip
    assert "loop" not in kept_off.thread_map.values()  # ... but not taken when refused
    assert kept_off.predicted_gain > 0.10
    # nor kept from a baseline or a preset that uses it
    on_loop = {name: "loop" for name in HSTU_MS}
    moved_off = joint_search(schedule, model, thread_map=on_loop, frozen=FROZEN, rounds=2,
                             presets={"all loop": on_loop}, allow_loop=False)  # fmt: skip
    assert "loop" not in moved_off.thread_map.values()
    assert moved_off.baseline.thread_map_dict() == on_loop  # compared with what was run


async def test_the_pick_runs_and_returns_every_batch_in_order() -> None:
    schedule = hstu_like()
    model = CostModel.from_host_ms(HSTU_MS, CHEAP)
    result = joint_search(schedule, model, thread_map=HSTU_DEFAULT, frozen=FROZEN, rounds=2)
    pipe = SchedulablePipeline(result.schedule, executor=AsyncExecutor(result.thread_map))
    try:
        results = [r async for r in pipe.results(iter(range(12)))]
    finally:
        pipe.shutdown()
    assert results == list(range(12))


def test_search_rejects_bad_arguments() -> None:
    schedule = hstu_like()
    model = CostModel.from_host_ms(HSTU_MS, CHEAP)
    with pytest.raises(AutoschedError, match="frozen names"):
        joint_search(schedule, model, frozen=("nope",))
    with pytest.raises(AutoschedError, match=">= 1"):
        joint_search(schedule, model, max_threads=0)


async def fetch_body(ctx: TaskContext) -> None:
    return None


def test_an_async_task_sharing_its_stream_may_get_one_of_its_own() -> None:
    """Only a stream of its own lets an async task's awaits overlap the tasks it
    shares a stream with; a frozen one keeps its stream."""
    schedule = Schedule.of([
        Task.from_fn("fetch", fetch_body, lookahead=1, writes=("batch",)),
        task("train", reads=("batch",)),
    ])  # fmt: skip
    model = CostModel({"fetch": TaskCost(0.1, await_ms=5.0), "train": TaskCost(5.0)}, CHEAP)
    result = joint_search(schedule, model, thread_map="by_stream")
    streams = dict(result.best.streams)
    assert streams["train"] == "default" and streams["fetch"] == "fetch"
    assert result.schedule.task("fetch").stream == "fetch"
    assert "fetch" in result.schedule.stream_slots
    validate_schedule(result.schedule, StreamPool({n: None for n in result.schedule.stream_slots}))
    assert result.best.score < 0.55 * result.baseline.score
    frozen = joint_search(schedule, model, thread_map="by_stream", frozen=("fetch",))
    assert dict(frozen.best.streams)["fetch"] == "default"


@pytest.mark.parametrize("max_in_flight", [1, 2, 3])
def test_the_pick_keeps_no_more_batches_in_flight_than_allowed(max_in_flight: int) -> None:
    # A candidate that kept the declared lookaheads (load two ahead) was never held to
    # the limit: with max_in_flight=1 the pick kept three batches in flight.
    schedule = Schedule.of(
        [task("load", lookahead=2, stream="s2"), task("train", depends_on=("load",))],
        stream_slots=("default", "s2"),
    )
    costs = CostModel(tasks={"load": TaskCost(host_ms=1.0), "train": TaskCost(host_ms=3.0)},
                      engine=CHEAP)  # fmt: skip
    found = joint_search(schedule, costs, thread_map={"load": "B", "train": "B"},
                         max_threads=1, max_in_flight=max_in_flight)  # fmt: skip
    assert found.schedule.max_lookahead + 1 <= max_in_flight
    assert max(dict(found.best.lookaheads).values()) + 1 <= max_in_flight
