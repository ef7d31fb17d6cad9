"""Does the event loop stay free while the pipeline trains?

A 1 ms ticker coroutine runs on the same loop as ``await pipe.progress(it)``; each
row reports how late its ticks came (max and p99 over the run) while steps of about
``--step-ms`` run, for every public constructor with its defaults -- plus
``executor="sequential"`` (the opt-in that runs bodies inline on the loop) for
contrast.  Steps are real torch work (matmuls or an MLP training step), whose
kernels release the GIL.  ``--rows`` picks rows by key; the HSTU row runs on the GPU
where there is one (``--replicate-tables`` for machines without fbgemm's CUDA
kernels) and also reports its watchdog's ``pending`` after each step: losses copied
but not yet checked, i.e. how many steps the host runs ahead of the device.

    ./dev bench loop_latency [--steps 6] [--step-ms 200] [--rows KEY ...] [--replicate-tables]
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


def build(name: str, step_ms: float,
          replicate_tables: bool) -> tuple[Any, Callable[[int], Any]]:  # fmt: skip
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
    setup = build_training(ModelConfig(), config, OptimizerConfig(), seed=0, data_parallel="torch",
                           shard_embeddings=not replicate_tables)  # fmt: skip
    pipe = HSTUPipeline(setup.model, setup.optimizer, setup.device)
    return pipe, lambda n: iter(SyntheticHSTUData(config, n, seed=0))


# key: the row's name
ROWS = {
    "tasks": "Pipeline(tasks)",
    "schedule": "SchedulablePipeline(schedule)",
    "basic": "basic() T1",
    "basic-t2": "basic(memcpy_stream=True) T2",
    "hstu": "HSTUPipeline, batch 256",
    "sequential": "Pipeline(tasks, executor='sequential') [opt-in]",
}


async def measure(name: str, steps: int, step_ms: float,
                  replicate_tables: bool) -> dict[str, Any]:  # fmt: skip
    pipe, source_of = build(name, step_ms, replicate_tables)
    watch = getattr(pipe, "loss_watch", None)
    delays: list[float] = []
    pending: list[int] = []
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
            if watch is not None:
                pending.append(watch.pending)
        elapsed = (time.perf_counter() - start) / (steps - 1)
        running = False
        await tick
        await pipe.drain()
    delays.sort()
    result: dict[str, Any] = {
        "step_ms": 1000 * elapsed,
        "max_ms": 1000 * delays[-1],
        "p99_ms": 1000 * delays[int(0.99 * (len(delays) - 1))],
        "ticks": len(delays),
    }
    if pending:
        result.update(pending=pending, pending_max=max(pending))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--step-ms", type=float, default=200.0)
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), metavar="KEY",
                        help=f"rows to run (default: all of {list(ROWS)})")
    parser.add_argument("--replicate-tables", action="store_true",
                        help="HSTU without torchrec sharding (for GPUs without fbgemm's kernels)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first one warms up")
    names = [ROWS[key] for key in args.rows]
    results: dict[str, dict[str, Any]] = {}
    table = Table(f"1 ms ticker on the pipeline's event loop, {args.steps} steps per row",
                  ["constructor (defaults)", "step ms", "max tick delay ms", "p99 ms", "ticks",
                   "watchdog pending max"], [max(map(len, names))])  # fmt: skip
    for name in names:
        progress(f"measuring {name}")
        r = results[name] = run(measure(name, args.steps, args.step_ms, args.replicate_tables))
        table.row(name, f"{r['step_ms']:.0f}", f"{r['max_ms']:.1f}", f"{r['p99_ms']:.1f}",
                  int(r["ticks"]), r.get("pending_max", "--"))  # fmt: skip
    defaults = [r["max_ms"] for name, r in results.items() if "opt-in" not in name]
    if defaults:
        print(f"worst max delay under the defaults: {max(defaults):.1f} ms")
    print_json("loop_latency", {"args": vars(args), "results": results,
                                "median_step_ms": statistics.median(
                                    r["step_ms"] for r in results.values())})  # fmt: skip


if __name__ == "__main__":
    main()
