"""The simulator: each engine rule it models, checked on hand-computed cases, plus
one check against a measured run."""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from aiopipe import AsyncExecutor, SchedulablePipeline, Schedule, Stage, Task, TaskContext
from aiopipe.autosched import (
    AutoschedError,
    CostModel,
    CostModelError,
    EngineCosts,
    TaskCost,
    overlap_matrix,
    simulate,
    task_levels,
)

from schedules import Trace, build_tasks, schedule_specs, thread_maps

FREE = EngineCosts(progress_ms=0.0, task_ms=0.0, handoff_ms=0.0)


def noop(ctx: TaskContext) -> None:
    return None


def task(name: str, **fields: Any) -> Task:
    return Task.from_fn(name, noop, **fields)


def costs(engine: EngineCosts = FREE, **host_ms: float) -> CostModel:
    return CostModel.from_host_ms(host_ms, engine)


def test_one_lane_runs_its_chain_back_to_back() -> None:
    schedule = Schedule.of([task("a", lookahead=1, writes=("x",)), task("b", reads=("x",))])
    result = simulate(schedule, costs(a=2.0, b=3.0), lambda t: "main")
    assert result.steady_ms == pytest.approx(5.0)
    assert result.lanes == ("main",)


def test_independent_lanes_overlap_and_the_slower_one_sets_the_pace() -> None:
    schedule = Schedule.of(
        [task("a", lookahead=1, stream="io", writes=("x",)), task("b", reads=("x",))]
    )
    result = simulate(schedule, costs(a=2.0, b=3.0), "per_task")
    assert result.steady_ms == pytest.approx(3.0)
    assert result.critical_path == ("b",)


def test_same_progress_edges_chain_across_lanes() -> None:
    schedule = Schedule.of([task("a", writes=("x",)), task("b", reads=("x",))])
    result = simulate(schedule, costs(a=2.0, b=3.0), "per_task")
    assert result.steady_ms == pytest.approx(5.0)
    assert result.critical_path == ("a", "b")
    b = next(t for t in result.timeline if t.task == "b")
    assert (b.start_ms, b.wait_ms) == (pytest.approx(2.0), pytest.approx(2.0))


def test_one_stream_split_over_lanes_still_runs_in_order() -> None:
    schedule = Schedule.of([task("a"), task("b"), task("c", stream="other")])
    result = simulate(schedule, costs(a=2.0, b=3.0, c=4.0), "per_task")
    assert result.steady_ms == pytest.approx(5.0)  # a then b (FIFO); c alongside


def test_collectives_on_several_lanes_take_tickets_in_order() -> None:
    schedule = Schedule.of([task("a", stream="x", nccl=True), task("b", stream="y", nccl=True)])
    assert simulate(schedule, costs(a=2.0, b=3.0), "by_stream").steady_ms == pytest.approx(5.0)
    plain = Schedule.of([task("a", stream="x"), task("b", stream="y")])
    assert simulate(plain, costs(a=2.0, b=3.0), "by_stream").steady_ms == pytest.approx(3.0)


def test_stages_are_barriers() -> None:
    schedule = Schedule(
        stages=(Stage((task("a", stream="x"), task("b", stream="y"))),
                Stage((task("c", stream="x"), task("d", stream="y")))),
        stream_slots=("default", "x", "y"),
    )  # fmt: skip
    result = simulate(schedule, costs(a=1.0, b=3.0, c=2.0, d=1.0), "by_stream")
    assert result.steady_ms == pytest.approx(3.0 + 2.0)


def test_engine_overheads_are_charged_where_the_engine_pays_them() -> None:
    engine = EngineCosts(progress_ms=0.1, task_ms=0.01, handoff_ms=0.05)
    one = Schedule.of([task("a")])
    on_loop = simulate(one, costs(engine, a=1.0), lambda t: "loop").steady_ms
    on_thread = simulate(one, costs(engine, a=1.0), lambda t: "lane").steady_ms
    assert on_loop == pytest.approx(0.1 + 0.01 + 1.0)
    # the lane wakes to take its chain, then wakes the loop
    assert on_thread == pytest.approx(0.1 + 0.01 + 1.0 + 2 * 0.05)


def test_warm_up_and_drain_run_only_the_firing_tasks() -> None:
    schedule = Schedule.of([task("a", lookahead=2, writes=("x",)), task("b", reads=("x",))])
    result = simulate(schedule, costs(a=2.0, b=3.0), lambda t: "main", batches=6)
    ends = result.iteration_end_ms
    assert len(ends) == 6 + 2
    assert [round(b - a, 6) for a, b in zip((0.0, *ends), ends)] == [2, 2, 5, 5, 5, 5, 3, 3]
    assert (result.warmup_ms, result.drain_ms, result.total_ms) == (4.0, 6.0, 30.0)


def test_device_work_serialises_per_stream_and_carries_over() -> None:
    schedule = Schedule.of([task("a"), task("b")])
    model = costs(a=0.1, b=0.1).with_task("a", gpu_ms=4.0).with_task("b", gpu_ms=1.0)
    # the host is far ahead; the stream runs a and b of every batch back to back
    assert simulate(schedule, model, lambda t: "main", batches=40).steady_ms == pytest.approx(5.0)


def test_device_work_on_two_streams_overlaps_unless_a_resource_is_shared() -> None:
    schedule = Schedule.of([task("a", stream="x"), task("b", stream="y")])
    model = costs(a=0.1, b=0.1).with_task("a", gpu_ms=4.0).with_task("b", gpu_ms=3.0)
    assert simulate(schedule, model, "by_stream", batches=40).steady_ms == pytest.approx(4.0)
    for shared in ({"pcie": True}, {"comm": "world"}):
        contended = model.with_task("a", **shared).with_task("b", **shared)
        steady = simulate(schedule, contended, "by_stream", batches=40).steady_ms
        assert steady == pytest.approx(7.0)


def test_sync_tasks_make_the_host_wait_for_the_device() -> None:
    schedule = Schedule.of([task("a")])
    model = costs(a=0.5).with_task("a", gpu_ms=3.0, sync=True)
    result = simulate(schedule, model, lambda t: "main")
    assert result.steady_ms == pytest.approx(3.0)
    assert result.timeline[0].end_ms == pytest.approx(3.0)


def test_overlap_matrix() -> None:
    schedule = Schedule.of([task("a", stream="x", nccl=True), task("b", stream="y", nccl=True),
                            task("c", stream="x"), task("d", stream="z")])
    matrix = overlap_matrix(schedule, costs(a=1, b=1, c=1, d=1).with_task("d", pcie=True))
    assert matrix[("a", "b")] is False  # one communicator
    assert matrix[("a", "c")] is False  # one stream
    assert matrix[("b", "c")] is True
    assert matrix[("c", "d")] is True


def test_missing_costs_and_too_few_batches_are_errors() -> None:
    schedule = Schedule.of([task("a", lookahead=2), task("b")])
    with pytest.raises(CostModelError, match="'b'"):
        simulate(schedule, costs(a=1.0))
    with pytest.raises(AutoschedError, match="at least"):
        simulate(schedule, costs(a=1.0, b=1.0), batches=3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule_specs().flatmap(lambda specs: thread_maps(specs).map(lambda tm: (specs, tm))))
def test_latency_lies_between_the_critical_path_and_the_serial_sum(case: Any) -> None:
    specs, thread_map = case
    schedule = Schedule.of(build_tasks(specs, Trace()))
    model = costs(**{s.name: 1.0 + i % 3 for i, s in enumerate(specs)})
    steady = simulate(schedule, model, thread_map).steady_ms
    serial = sum(cost.host_ms for cost in model.tasks.values())
    assert task_levels(schedule, model).length - 1e-9 <= steady <= serial + 1e-9


@pytest.mark.one_loop
async def test_prediction_matches_a_measured_run() -> None:
    """Loose tolerance: this machine is shared; benchmarks/autosched_sim.py holds the
    10 % bar on longer runs."""
    def sleeper(ms: float) -> Any:
        return lambda ctx: time.sleep(ms / 1e3)

    schedule = Schedule.of([
        Task.from_fn("load", sleeper(2.0), lookahead=1, stream="io", writes=("x",)),
        Task.from_fn("step", sleeper(3.0), reads=("x",), nccl=True),
        Task.from_fn("sync", sleeper(1.0), stream="comm", nccl=True),
    ])  # fmt: skip
    model = CostModel(
        {"load": TaskCost(2.1), "step": TaskCost(3.1), "sync": TaskCost(1.1)},
        EngineCosts(progress_ms=0.01, task_ms=0.002, handoff_ms=0.06),
    )
    for thread_map in ("by_stream", {"load": "io"}):
        predicted = simulate(schedule, model, thread_map).steady_ms
        pipe = SchedulablePipeline(schedule, executor=AsyncExecutor(thread_map))
        try:
            source = iter(range(60))
            for _ in range(5):
                await pipe.progress(source)
            samples = []
            for _ in range(40):
                start = time.perf_counter()
                await pipe.progress(source)
                samples.append((time.perf_counter() - start) * 1e3)
        finally:
            pipe.shutdown()
        measured = statistics.median(samples)
        assert abs(predicted - measured) / measured < 0.25, (thread_map, predicted, measured)


@pytest.mark.parametrize("declared_first", ["consumer", "producer"])
def test_a_device_only_sync_makes_the_stream_wait_for_its_producer(declared_first: str) -> None:
    """b's stream waits for a's device work of the same progress: before b when a
    has run by then, otherwise at the end of the progress (so the next b waits)."""
    producer = task("a", stream="x")
    consumer = task("b", stream="y", same_progress_sync=("a",),
                    same_progress_sync_sides={"a": "device"})  # fmt: skip
    order = [consumer, producer] if declared_first == "consumer" else [producer, consumer]
    model = costs(a=0.1, b=0.1).with_task("a", gpu_ms=4.0).with_task("b", gpu_ms=1.0)
    result = simulate(Schedule.of(order), model, "by_stream", batches=40)
    spans = {t.task: (t.gpu_start_ms, t.gpu_end_ms) for t in result.timeline}
    assert result.steady_ms == pytest.approx(4.0)  # stream x sets the pace
    if declared_first == "consumer":  # b of this progress waited for a of the previous
        assert spans["b"][0] == pytest.approx(spans["a"][0])
    else:
        assert spans["b"][0] == pytest.approx(spans["a"][1])


def test_a_cpu_only_sync_orders_the_bodies_and_not_the_streams() -> None:
    consumer = task("b", stream="y", same_progress_sync=("a",),
                    same_progress_sync_sides={"a": "cpu"})  # fmt: skip
    schedule = Schedule.of([task("a", stream="x"), consumer])
    model = costs(a=0.5, b=0.1).with_task("a", gpu_ms=4.0).with_task("b", gpu_ms=1.0)
    result = simulate(schedule, model, "by_stream", batches=40)
    timing = {t.task: t for t in result.timeline}
    assert timing["b"].start_ms >= timing["a"].end_ms  # the body after a's body
    assert timing["b"].gpu_start_ms < timing["a"].gpu_end_ms  # the stream does not wait


# -- awaited time: latency for the consumers and the lane, not work on the loop's thread --


async def awaiting(ctx: TaskContext) -> None:
    return None


def async_task(name: str, **fields: Any) -> Task:
    return Task.from_fn(name, awaiting, **fields)


def fetch_and_train(fetch_stream: str) -> Schedule:
    """The schedule of issue #32: an async fetch one batch ahead and a sync step."""
    return Schedule.of([
        async_task("fetch", lookahead=1, stream=fetch_stream, writes=("batch",)),
        task("train", reads=("batch",)),
    ])  # fmt: skip


FETCH_AND_TRAIN = CostModel(
    {"fetch": TaskCost(0.1, await_ms=5.0), "train": TaskCost(5.0)}, FREE
)


@pytest.mark.parametrize(("stream", "thread_map", "expected"), [
    # On the training step's stream the engine runs the two one after the other.
    ("default", "by_stream", 10.1),
    ("default", {"fetch": "loop", "train": "loop"}, 10.1),
    # On a stream of its own the fetch awaits while the step runs on its lane ...
    ("io", {"fetch": "loop", "train": "compute"}, 5.1),
    ("io", "by_stream", 5.1),
    # ... but not on the same lane (a lane runs its chain in order), nor with the step
    # on the loop: the loop runs a sync body to its end before the fetch can start.
    ("io", {"fetch": "main", "train": "main"}, 10.1),
    ("io", {"fetch": "loop", "train": "loop"}, 10.1),
    ("io", {"fetch": "io", "train": "loop"}, 10.1),
])  # fmt: skip
def test_an_async_fetch_overlaps_the_step_only_on_its_own_stream_and_lane(
    stream: str, thread_map: Any, expected: float
) -> None:
    result = simulate(fetch_and_train(stream), FETCH_AND_TRAIN, thread_map)
    assert result.steady_ms == pytest.approx(expected)


def test_awaits_leave_the_loop_s_thread_free_and_host_time_holds_it() -> None:
    """Two async bodies on two lanes both run on the loop's thread: their awaits
    overlap, their host parts take turns."""
    schedule = Schedule.of([async_task("a", stream="s1"), async_task("b", stream="s2")])
    lanes = {"a": "loop", "b": "io"}
    waits = CostModel({"a": TaskCost(0.5, await_ms=4.0), "b": TaskCost(0.5, await_ms=4.0)}, FREE)
    assert simulate(schedule, waits, lanes).steady_ms == pytest.approx(5.0)  # b after a's host
    work = CostModel({"a": TaskCost(3.0, await_ms=0.5), "b": TaskCost(3.0, await_ms=0.5)}, FREE)
    assert simulate(schedule, work, lanes).steady_ms == pytest.approx(6.5)  # not 3.5
    timeline = {t.task: t for t in simulate(schedule, work, lanes).timeline}
    assert (timeline["b"].start_ms, timeline["b"].wait_ms) == (3.0, 3.0)  # a held the loop


def test_consumers_wait_for_the_awaits_of_their_producer() -> None:
    schedule = Schedule.of([
        async_task("fetch", stream="io", writes=("batch",)), task("train", reads=("batch",)),
    ])  # fmt: skip
    result = simulate(schedule, FETCH_AND_TRAIN, {"fetch": "loop", "train": "compute"})
    assert result.steady_ms == pytest.approx(10.1)
    assert result.critical_path == ("fetch", "train")
