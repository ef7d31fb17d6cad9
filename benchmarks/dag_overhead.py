"""Per-node overhead of aiopipe.dag against asyncio.TaskGroup, chains and fan-outs.

Each node is timed from submit to complete, for chains and wide fan-outs, against
running the same functions through ``asyncio.TaskGroup``.

A chain: each node INOUT-updates one tensor (each waits for the previous).  A
fan-out: N independent nodes, each writing its own tensor.  Functions are no-ops
run inline on the loop (lane "loop") for both, so the difference is bookkeeping.

    ./dev bench dag_overhead [--nodes 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import uvloop  # noqa: E402
from _common import interleaved_rounds, print_json, print_table, run_on, spread  # noqa: E402

from aiopipe.dag import INOUT, OUTPUT, TaskGraph  # noqa: E402


def noop(*tensors: torch.Tensor) -> None:
    return None


async def anoop(*tensors: torch.Tensor) -> None:
    return None


async def graph_chain(n: int) -> float:
    x = torch.zeros(1)
    async with TaskGraph(max_in_flight=n + 1) as graph:
        start = time.perf_counter()
        handles = [await graph.submit(noop, INOUT(x), lane="loop") for _ in range(n)]
        await handles[-1]
        return time.perf_counter() - start


async def graph_fanout(n: int, tensors: list[torch.Tensor]) -> float:
    async with TaskGraph(max_in_flight=n + 1) as graph:
        start = time.perf_counter()
        handles = [await graph.submit(noop, OUTPUT(t), lane="loop") for t in tensors]
        for handle in handles:
            await handle
        return time.perf_counter() - start


async def taskgroup_chain(n: int) -> float:
    x = torch.zeros(1)
    start = time.perf_counter()
    previous: asyncio.Task[None] | None = None
    async with asyncio.TaskGroup() as group:
        for _ in range(n):
            async def step(before: asyncio.Task[None] | None = previous) -> None:
                if before is not None:
                    await before
                noop(x)

            previous = group.create_task(step())
    return time.perf_counter() - start


async def taskgroup_fanout(n: int, tensors: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for t in tensors:
            group.create_task(anoop(t))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.nodes
    tensors = [torch.zeros(1) for _ in range(n)]
    configs = {
        ("chain", "aiopipe.dag"): lambda: graph_chain(n),
        ("chain", "asyncio.TaskGroup"): lambda: taskgroup_chain(n),
        ("fan-out", "aiopipe.dag"): lambda: graph_fanout(n, tensors),
        ("fan-out", "asyncio.TaskGroup"): lambda: taskgroup_fanout(n, tensors),
    }
    samples = interleaved_rounds(
        {key: lambda make=make: run_on(uvloop.new_event_loop, make())
         for key, make in configs.items()},
        args.repeats, show=lambda s: f"{s / n * 1e6:.2f} us/node",
    )  # fmt: skip
    us = {key: statistics.median(v) / n * 1e6 for key, v in samples.items()}
    rows = [[shape, impl, f"{value:.2f}", spread(samples[(shape, impl)]),
             f"{value / us[(shape, 'asyncio.TaskGroup')]:.2f}"]
            for (shape, impl), value in us.items()]  # fmt: skip
    print_table(f"per-node overhead, {n} nodes, median of {args.repeats} rounds (uvloop)",
                ["shape", "runner", "us / node", "spread", "x TaskGroup"], rows)  # fmt: skip
    print_json("dag_overhead", {"nodes": n, "us_per_node": {f"{s}/{i}": v for (s, i), v in us.items()}})


if __name__ == "__main__":
    main()
