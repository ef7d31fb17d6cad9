"""Synthetic schedules whose tasks sleep (GIL-free, like a CUDA launch or a collective
wait), for checking the auto-scheduler's predictions against measured runs.

Each workload is a schedule plus the thread maps to compare; the first thread map is
the one the costs are profiled under.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from _common import interleaved_rounds, run_on, time_progress
from hstu_shape import IO_COMPUTE_THREAD_MAP, hstu_schedule

from aiopipe import (
    AsyncExecutor,
    SchedulablePipeline,
    Schedule,
    Stage,
    Task,
    TaskContext,
    ThreadMap,
)
from aiopipe.autosched import CostModel, EngineCosts, profile_schedule, simulate
from aiopipe._core.loops import new_event_loop

#: Per-task sleep (ms) of the HSTU-shaped workload: input distribution and prefetch
#: stand for waits on other ranks, forward/backward for GIL-free compute.
HSTU_MS = {
    "h2d": 1.0, "start_shuffle": 0.5, "finish_shuffle": 1.5, "start_input_dist": 1.5,
    "wait_input_dist": 3.0, "prefetch_embeddings": 1.5, "zero_grad": 0.3,
    "global_tokens_allreduce": 0.5, "nccl_safety_barrier": 0.05, "forward": 6.0,
    "backward": 8.0, "finalize_model_grads": 1.5, "optimizer_step": 2.0, "watchdog_step": 0.2,
}  # fmt: skip
#: The main chain the search must leave on its stream and at lookahead 0.
HSTU_FROZEN = ("forward", "backward", "finalize_model_grads", "optimizer_step")


def sleeper(ms: float, scale: float = 1.0) -> Callable[[TaskContext], None]:
    seconds = ms * scale / 1e3

    def body(ctx: TaskContext) -> None:
        time.sleep(seconds)

    return body


@dataclass(frozen=True)
class Workload:
    name: str
    schedule: Schedule
    thread_maps: Mapping[str, ThreadMap]


def hstu(scale: float = 1.0) -> Workload:
    schedule = hstu_schedule(lambda name: sleeper(HSTU_MS[name], scale))
    return Workload("hstu_shape", schedule, {
        "io/compute": IO_COMPUTE_THREAD_MAP,
        "by_stream": "by_stream",
        "per_task": "per_task",
        "one lane": lambda task: "main",
        "all on loop": lambda task: "loop",
    })  # fmt: skip


def ticketed(scale: float = 1.0) -> Workload:
    """Collectives on three lanes: the ticket order couples the lanes."""
    def t(name: str, ms: float, **fields: Any) -> Task:
        return Task.from_fn(name, sleeper(ms, scale), **fields)

    tasks = [
        t("load", 1.0, lookahead=2, stream="io", writes=("raw",), reads=("batch_cpu",)),
        t("exchange", 2.0, lookahead=1, stream="comm", nccl=True, reads=("raw",),
          writes=("mixed",)),
        t("gather", 1.5, lookahead=1, stream="comm", nccl=True, reads=("mixed",),
          writes=("ready",)),
        t("forward", 3.0, reads=("ready",), writes=("out",)),
        t("reduce", 2.0, nccl=True, reads=("out",), writes=("grads",)),
        t("update", 1.0, reads=("grads",), writes=("step_result",)),
    ]
    schedule = Schedule.of(tasks)
    return Workload("ticketed", schedule, {
        "by_stream": "by_stream",
        "io/comm+compute": {"load": "io", "exchange": "comm", "gather": "comm",
                            "forward": "comm", "reduce": "comm", "update": "comm"},
        "per_task": "per_task",
        "comm on loop": {"load": "io", "exchange": "loop", "gather": "loop",
                         "forward": "compute", "reduce": "compute", "update": "compute"},
    })  # fmt: skip


def shared_stream(scale: float = 1.0) -> Workload:
    """Two stages; one stream split over two lanes (stream order forces a chain)."""
    def t(name: str, ms: float, **fields: Any) -> Task:
        return Task.from_fn(name, sleeper(ms, scale), **fields)

    first = Stage(tasks=(
        t("a", 2.0, stream="s1", lookahead=1, writes=("x",)),
        t("b", 1.5, stream="s1", lookahead=1),
        t("c", 2.5, stream="s2", lookahead=1),
    ))  # fmt: skip
    second = Stage(tasks=(
        t("d", 3.0, stream="s1", reads=("x",)),
        t("e", 1.0, stream="s2"),
        t("f", 2.0, stream="s2", depends_on=("e",)),
    ))  # fmt: skip
    schedule = Schedule(stages=(first, second), stream_slots=("default", "s1", "s2"))
    return Workload("two_stages_shared_stream", schedule, {
        "by_stream": "by_stream",
        "per_task": "per_task",
        "split s1": {"a": "x", "b": "y", "c": "z", "d": "x", "e": "z", "f": "z"},
        "one lane": lambda task: "main",
    })  # fmt: skip


WORKLOADS: dict[str, Callable[[float], Workload]] = {
    "hstu_shape": hstu,
    "ticketed": ticketed,
    "two_stages_shared_stream": shared_stream,
}


def predict_and_measure(
    configs: Mapping[str, tuple[Schedule, ThreadMap]], costs: CostModel, iterations: int,
    repeats: int,
) -> tuple[dict[str, float], dict[str, list[float]], dict[str, float]]:
    """Per named (schedule, thread map): the simulated ms per progress, the measured
    ones of ``repeats`` interleaved rounds, and their median."""
    predicted = {name: simulate(s, costs, tm).steady_ms for name, (s, tm) in configs.items()}
    samples = interleaved_rounds(
        {name: lambda s=s, tm=tm: measure_ms(s, tm, iterations, 1)[0]  # type: ignore[misc]
         for name, (s, tm) in configs.items()},
        repeats, show=lambda ms: f"{ms:.3f} ms",
    )  # fmt: skip
    return predicted, samples, {name: statistics.median(v) for name, v in samples.items()}


def measure_ms(
    schedule: Schedule, thread_map: ThreadMap, iterations: int, repeats: int
) -> list[float]:
    """The steady-state ms per progress, measured ``repeats`` times."""

    def once() -> float:
        pipe = SchedulablePipeline(schedule, executor=AsyncExecutor(thread_map), expect_result=False)
        try:
            seconds: float = run_on(new_event_loop, time_progress(pipe, iterations, warmup=10))
        finally:
            pipe.shutdown()
        return seconds * 1e3

    return [once() for _ in range(repeats)]


def profile(
    schedule: Schedule, thread_map: ThreadMap, engine: EngineCosts, batches: int = 60
) -> CostModel:
    return run_on(  # type: ignore[no-any-return]
        new_event_loop,
        profile_schedule(schedule, thread_map=thread_map, batches=batches, engine=engine),
    )
