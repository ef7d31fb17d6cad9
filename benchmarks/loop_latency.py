"""Does the event loop stay free while the pipeline trains?

A 1 ms ticker coroutine runs on the same loop as ``await pipe.progress(it)``; each
row reports how late its ticks came (max and p99 over the run) while steps of about
``--step-ms`` run, for every public constructor with its defaults -- plus
``executor="sequential"`` (the opt-in that runs bodies inline on the loop) for
contrast.  Steps are real torch work (matmuls or an MLP training step), whose
kernels release the GIL.

    ./dev bench loop_latency [--steps 6] [--step-ms 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _common import Table, print_json, progress  # noqa: E402

from aiopipe import Pipeline, SchedulablePipeline, Schedule, Task, TaskContext, run  # noqa: E402
from aiopipe.presets import basic  # noqa: E402
from hstu_tasks import (  # noqa: E402
    DataConfig,
    HSTUPipeline,
    ModelConfig,
    OptimizerConfig,
    SyntheticHSTUData,
    build_training,
    init_distributed,
    quiet_torchrec,
)


def matmul_step(step_ms: float) -> Callable[[TaskContext], None]:
    """A task body of about ``step_ms`` of torch work (calibrated once)."""
    a = torch.randn(512, 512)
    start, rounds = time.perf_counter(), 0
    while time.perf_counter() - start < 0.05:
        a @ a
        rounds += 1
    per_round = (time.perf_counter() - start) / rounds
    repeats = max(1, round(step_ms / 1000 / per_round))

    def body(ctx: TaskContext) -> None:
        for _ in range(repeats):
            a @ a
        ctx.slots.set("step_result", ctx.batch_index)

    return body


def mlp(step_ms: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[Any]]:
    """An MLP whose training step on one batch takes about ``step_ms``."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 512))  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 512)
    start = time.perf_counter()
    model(x).pow(2).mean().backward()
    per_256 = time.perf_counter() - start
    rows = max(256, int(256 * step_ms / 1000 / per_256))
    return model, optimizer, [torch.randn(rows, 512) for _ in range(2)]


def square_loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def build(name: str, step_ms: float) -> tuple[Any, Callable[[int], Any]]:
    """The pipeline for row ``name`` and a source factory."""
    if name.startswith("Pipeline") or name.startswith("SchedulablePipeline"):
        tasks = [Task.from_fn("work", matmul_step(step_ms), writes=("step_result",))]
        executor = "sequential" if "sequential" in name else None
        if name.startswith("Pipeline"):
            return Pipeline(tasks, executor=executor), lambda n: iter(range(n))
        return SchedulablePipeline(Schedule.of(tasks), executor=executor or "async"), (
            lambda n: iter(range(n))
        )
    if name.startswith("basic"):
        model, optimizer, batches = mlp(step_ms)
        pipe = basic(model, optimizer, loss_fn=square_loss, memcpy_stream="T2" in name)
        return pipe, lambda n: iter(batches[i % 2] for i in range(n))
    quiet_torchrec()
    init_distributed()
    config = DataConfig(batch_size=256)  # big batches: long steps
    setup = build_training(ModelConfig(), config, OptimizerConfig(), seed=0)
    pipe = HSTUPipeline(setup.model, setup.optimizer, setup.device)
    return pipe, lambda n: iter(SyntheticHSTUData(config, n, seed=0))


ROWS = (
    "Pipeline(tasks)",
    "SchedulablePipeline(schedule)",
    "basic() T1",
    "basic(memcpy_stream=True) T2",
    "HSTUPipeline, batch 256",
    "Pipeline(tasks, executor='sequential') [opt-in]",
)


async def measure(name: str, steps: int, step_ms: float) -> dict[str, float]:
    pipe, source_of = build(name, step_ms)
    delays: list[float] = []
    running = True

    async def ticker() -> None:
        while running:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            delays.append(time.perf_counter() - start - 0.001)

    async with pipe:
        source = source_of(steps + 1)
        await pipe.progress(source)  # warm-up: lanes started, model traced
        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.01)
        start = time.perf_counter()
        for _ in range(steps - 1):
            await pipe.progress(source)
        elapsed = (time.perf_counter() - start) / (steps - 1)
        running = False
        await tick
        await pipe.drain()
    delays.sort()
    return {
        "step_ms": 1000 * elapsed,
        "max_ms": 1000 * delays[-1],
        "p99_ms": 1000 * delays[int(0.99 * (len(delays) - 1))],
        "ticks": len(delays),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--step-ms", type=float, default=200.0)
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    table = Table(f"1 ms ticker on the pipeline's event loop, {args.steps} steps per row",
                  ["constructor (defaults)", "step ms", "max tick delay ms", "p99 ms", "ticks"],
                  [max(map(len, ROWS))])  # fmt: skip
    for name in ROWS:
        progress(f"measuring {name}")
        r = results[name] = run(measure(name, args.steps, args.step_ms))
        table.row(name, f"{r['step_ms']:.0f}", f"{r['max_ms']:.1f}", f"{r['p99_ms']:.1f}",
                  int(r["ticks"]))  # fmt: skip
    worst = max(r["max_ms"] for name, r in results.items() if "opt-in" not in name)
    print(f"worst max delay under the defaults: {worst:.1f} ms")
    print_json("loop_latency", {"args": vars(args), "results": results,
                                "median_step_ms": statistics.median(
                                    r["step_ms"] for r in results.values())})  # fmt: skip


if __name__ == "__main__":
    main()
