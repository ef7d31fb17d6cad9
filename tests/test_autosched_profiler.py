"""CostProfiler: spans to costs; a profiled run; engine calibration."""

from __future__ import annotations

import time

import pytest

from aiopipe import Schedule, Task, TaskContext
from aiopipe.autosched import CostModelError, CostProfiler, EngineCosts, calibrate_engine
from aiopipe.autosched import profile_schedule
from aiopipe.trace import Span


def span(task: str, iteration: int, ms: float, lane: str = "io", gpu_ms: float | None = None,
         failed: bool = False) -> Span:  # fmt: skip
    return Span(task, iteration, iteration, lane, "t", "memcpy", 0, int(ms * 1e6),
                gpu_ms=gpu_ms, failed=failed)  # fmt: skip


def test_medians_lanes_and_streams_from_spans() -> None:
    profiler = CostProfiler(skip_iterations=1, pcie=("h2d",))
    spans = [span("h2d", 0, 100.0)]  # warm-up iteration: ignored
    spans += [span("h2d", i, ms, gpu_ms=ms / 2) for i, ms in enumerate((1.0, 3.0, 2.0, 9.0), 1)]
    spans += [span("h2d", 5, 50.0, failed=True)]  # a failed run says nothing about cost
    spans += [span("step", i, 4.0, lane="loop") for i in range(1, 4)]
    assert profiler.add_spans(spans) == 7
    model = profiler.cost_model(EngineCosts(0.1, 0.01, 0.05), {"run": "unit"})
    h2d = model.of("h2d")
    assert (h2d.host_ms, h2d.gpu_ms, h2d.samples, h2d.host_p90_ms) == (2.5, 1.25, 4, 9.0)
    assert h2d.pcie and not h2d.sync
    assert (h2d.lane, h2d.stream) == ("io", "memcpy")
    assert model.of("step").lane == "loop"
    assert model.meta == {"run": "unit"}


def test_an_empty_profile_is_an_error() -> None:
    with pytest.raises(CostModelError, match="saw no task runs"):
        CostProfiler().cost_model()


@pytest.mark.one_loop
async def test_profiling_a_run_measures_each_task() -> None:
    def sleeper(ms: float):  # type: ignore[no-untyped-def]
        return lambda ctx: time.sleep(ms / 1e3)

    def finish(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", ctx.batch_index)

    schedule = Schedule.of([
        Task.from_fn("load", sleeper(2.0), lookahead=1, stream="io", writes=("x",)),
        Task.from_fn("step", sleeper(1.0), reads=("x",)),
        Task.from_fn("finish", finish, depends_on=("step",)),
    ])  # fmt: skip
    model = await profile_schedule(schedule, thread_map="by_stream", batches=12,
                                   engine=EngineCosts())  # fmt: skip
    assert model.of("load").host_ms >= 2.0 and model.of("step").host_ms >= 1.0
    assert model.of("load").host_ms < 10.0  # sleeping 2 ms, not something else
    assert model.of("load").lane == "io" and model.of("step").lane == "default"
    assert model.of("load").samples == 12 - 2  # first two iterations skipped
    assert model.meta["profiled_batches"] == 12


@pytest.mark.one_loop
async def test_calibration_gives_plausible_overheads() -> None:
    # Enough tasks and rounds that the per-task figure stands well above the noise
    # between rounds (with 4 tasks and one round it once came out as 0).
    engine = await calibrate_engine(iterations=100, repeats=3, many=16, idle_ms=0.2)
    assert 0 < engine.task_ms < 1.0
    assert 0 <= engine.progress_ms < 1.0
    assert 0 < engine.handoff_ms < 5.0
