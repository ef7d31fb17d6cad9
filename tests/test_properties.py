"""Property tests on random valid schedules, for every executor and thread_map form."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schedules import Spec, Trace, build_tasks, check_trace, schedule_specs, thread_maps

import aiopipe
from aiopipe import AsyncExecutor, SchedulablePipeline, Schedule, validate_schedule
from aiopipe.edges import topological_sort


async def run_all(pipe: SchedulablePipeline, batches: int) -> list[object]:
    source = iter(range(batches))
    return [result async for result in pipe.results(source)]


def run_schedule(specs: list[Spec], batches: int, executor: object) -> tuple[list[object], Trace, Schedule]:
    trace = Trace()
    schedule = Schedule.of(build_tasks(specs, trace), stream_slots=("default", "memcpy", "data_dist"))
    pipe = SchedulablePipeline(schedule, executor=executor)  # type: ignore[arg-type]
    try:
        results = aiopipe.run(run_all(pipe, batches))
    finally:
        pipe.shutdown()
    return results, trace, pipe.schedule


SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(specs=schedule_specs(), batches=st.integers(0, 6))
def test_generated_schedules_are_valid(specs: list[Spec], batches: int) -> None:
    validate_schedule(Schedule.of(build_tasks(specs, Trace())))


@SETTINGS
@given(specs=schedule_specs(), batches=st.integers(0, 6))
def test_sequential_runs_every_task_on_every_batch_in_order(specs: list[Spec], batches: int) -> None:
    results, trace, schedule = run_schedule(specs, batches, "sequential")
    assert results == list(range(batches))
    order = [t.name for t in schedule.tasks]
    check_trace(trace, schedule, order, batches)


@SETTINGS
@given(data=st.data(), specs=schedule_specs(), batches=st.integers(0, 6))
def test_async_executor_matches_sequential(data: st.DataObject, specs: list[Spec], batches: int) -> None:
    thread_map = data.draw(thread_maps(specs))
    results, trace, schedule = run_schedule(specs, batches, AsyncExecutor(thread_map))
    assert results == list(range(batches))
    sequential_results, sequential_trace, _ = run_schedule(specs, batches, "sequential")
    assert results == sequential_results
    order = [t.name for t in topological_sort(schedule)]
    check_trace(trace, schedule, order, batches)
    # the same (task, batch) pairs ran under both executors
    ran = sorted((task, batch) for _, kind, task, _, batch in trace.events if kind == "start")
    ran_sequential = sorted(
        (task, batch) for _, kind, task, _, batch in sequential_trace.events if kind == "start"
    )
    assert ran == ran_sequential
