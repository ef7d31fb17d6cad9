"""CostProfiler: spans to costs; a profiled run; engine calibration."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import pytest

from aiopipe import Schedule, Task, TaskContext
from aiopipe.autosched import AutoschedError, CostModelError, CostProfiler, EngineCosts
from aiopipe.autosched import calibrate_engine
from aiopipe.autosched import calibrate, profile_schedule
from aiopipe.autosched.calibrate import engine_costs_from_timings
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


def test_an_async_body_s_awaits_are_its_await_ms_not_its_host_ms() -> None:
    profiler = CostProfiler(skip_iterations=0)
    profiler.add_spans(
        Span("fetch", i, i, "loop", "main", "io", 0, int((0.2 + wait) * 1e6),
             await_ns=int(wait * 1e6))
        for i, wait in enumerate((5.0, 4.0, 6.0))
    )  # fmt: skip
    profiler.add_spans([span("train", i, 5.0) for i in range(3)])
    model = profiler.cost_model()
    assert (model.of("fetch").host_ms, model.of("fetch").await_ms) == (0.2, 5.0)
    assert (model.of("train").host_ms, model.of("train").await_ms) == (5.0, 0.0)


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


def test_calibration_arithmetic_from_median_timings() -> None:
    # Medians: one 0.04, many 0.11, lanes 0.60 (the 0.40 outlier is ignored).
    # task = (0.11 - 0.04) / 7 = 0.01; progress = 0.04 - 0.01 = 0.03;
    # handoff = (0.60 - 0.11) / 9 = 0.05444.. -> 0.0544 (rounded to 0.1 us).
    engine = engine_costs_from_timings(
        [0.03, 0.05, 0.04], [0.11, 0.10, 0.40], [0.65, 0.56, 0.60], many=8
    )
    assert engine == EngineCosts(progress_ms=0.03, task_ms=0.01, handoff_ms=0.0544)


def test_calibration_median_of_an_even_count_is_the_middle_mean() -> None:
    # one: (0.02 + 0.04) / 2 = 0.03; many: 0.06 -> task (0.06 - 0.03) / 3 = 0.01.
    engine = engine_costs_from_timings([0.04, 0.02], [0.06], [0.16], many=4)
    assert engine == EngineCosts(progress_ms=0.02, task_ms=0.01, handoff_ms=0.02)


def test_calibration_noise_below_zero_gives_a_zero_task_cost() -> None:
    # The many-task run came out faster than the one-task run: the task term is 0
    # and the whole one-task figure is progress.  handoff = (0.2 - 0.045) / 5.
    engine = engine_costs_from_timings([0.05], [0.045], [0.2], many=4)
    assert engine == EngineCosts(progress_ms=0.05, task_ms=0.0, handoff_ms=0.031)


def test_calibration_noise_below_zero_gives_a_zero_handoff_cost() -> None:
    # The lanes run (sleep taken out) came out faster than the loop chain.
    engine = engine_costs_from_timings([0.02], [0.09], [0.08], many=8)
    assert engine == EngineCosts(progress_ms=0.01, task_ms=0.01, handoff_ms=0.0)


def test_calibration_task_term_above_the_one_task_run_gives_zero_progress() -> None:
    # task = (0.15 - 0.01) / 7 = 0.02 > 0.01, so progress would be -0.01: it is 0.
    engine = engine_costs_from_timings([0.01], [0.15], [0.42], many=8)
    assert engine == EngineCosts(progress_ms=0.0, task_ms=0.02, handoff_ms=0.03)


@pytest.mark.one_loop
async def test_calibration_interleaves_the_three_runs_and_feeds_their_timings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Only the timed measurement is replaced: each run reports a fixed figure, so
    # what calibrate_engine does with them is checked exactly.
    figures = {"one": [0.03, 0.05, 0.04], "many": [0.11, 0.10, 0.40], "lanes": [0.65, 0.56, 0.60]}
    runs: list[tuple[str, int, frozenset[str], int]] = []

    async def timed(schedule: Schedule, thread_map: Callable[[Task], str], iterations: int,
                    sleeper: object | None = None) -> float:  # fmt: skip
        kind = "lanes" if sleeper is not None else "one" if len(schedule.tasks) == 1 else "many"
        lanes = frozenset(thread_map(task) for task in schedule.tasks)
        runs.append((kind, len(schedule.tasks), lanes, iterations))
        return figures[kind].pop(0)

    monkeypatch.setattr(calibrate, "_ms_per_iteration", timed)
    engine = await calibrate_engine(iterations=100, repeats=3, many=8, idle_ms=0.5)
    assert engine == EngineCosts(progress_ms=0.03, task_ms=0.01, handoff_ms=0.0544)
    loop, two_lanes = frozenset({"loop"}), frozenset({"a", "b"})
    assert runs == [("one", 1, loop, 100), ("many", 8, loop, 100), ("lanes", 8, two_lanes, 25)] * 3


@pytest.mark.one_loop
async def test_calibration_runs_and_returns_well_formed_costs() -> None:
    # A real (small) calibration; what it measures depends on the machine's load, so
    # only the shape of the answer is checked, never its size.
    engine = await calibrate_engine(iterations=5, repeats=1, many=2, idle_ms=0.05)
    assert isinstance(engine, EngineCosts)
    for value in (engine.progress_ms, engine.task_ms, engine.handoff_ms):
        assert isinstance(value, float) and math.isfinite(value) and value >= 0
        assert round(value, 4) == value


@pytest.mark.parametrize(
    "bad",
    [{"many": 1}, {"repeats": 0}, {"iterations": 0}, {"idle_ms": -1.0}],
    ids=["one-task-chain", "no-repeats", "no-iterations", "negative-idle"],
)
async def test_calibration_refuses_arguments_it_cannot_measure_with(bad: dict[str, float]) -> None:
    with pytest.raises(AutoschedError, match=next(iter(bad))):
        await calibrate_engine(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("many, samples", [(1, 1), (4, 0)], ids=["one-task-chain", "no-samples"])
def test_the_calibration_arithmetic_refuses_what_it_cannot_divide(many: int, samples: int) -> None:
    with pytest.raises(AutoschedError, match="many >= 2"):
        engine_costs_from_timings([0.02] * samples, [0.05] * samples, [0.2] * samples, many=many)
