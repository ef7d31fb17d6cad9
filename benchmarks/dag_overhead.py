"""Per-node overhead of aiopipe.dag against asyncio.TaskGroup, chains and fan-outs.

Each node is timed from submit to complete, for chains and wide fan-outs, against
running the same functions through ``asyncio.TaskGroup``.

A chain: each node INOUT-updates one tensor (each waits for the previous).  A
fan-out: N independent nodes, each writing its own tensor.  Functions are no-ops
run inline on the loop (lane "loop") for both, so the difference is bookkeeping.

A group: ``submit_group`` of ``--members`` members that each sleep ``--member-ms``
(releasing the GIL, like a CUDA launch or a collective), run on one lane against
spread over one lane per member (``lanes=``); one round times both, rounds
interleave.

    ./dev bench dag_overhead [--nodes 20000] [--repeats 5] [--members 4] [--member-ms 50]
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


async def graph_group(members: int, member_s: float, lanes: list[str]) -> float:
    def member(i: int) -> None:
        time.sleep(member_s)

    calls = [(i,) for i in range(members)]
    async with TaskGraph() as graph:
        await (await graph.submit_group(member, calls, lanes=lanes))  # lane threads up
        start = time.perf_counter()
        await (await graph.submit_group(member, calls, lanes=lanes))
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
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--member-ms", type=float, default=50.0)
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
    group_ms = group_rows(args.members, args.member_ms / 1e3, args.repeats)
    print_json("dag_overhead", {"nodes": n, "us_per_node": {f"{s}/{i}": v for (s, i), v in us.items()},
                                "group_ms": group_ms})  # fmt: skip


def group_rows(members: int, member_s: float, repeats: int) -> dict[str, float]:
    """Time one group on one lane and spread over lanes; print a table, return medians."""
    layouts = {"one lane": ["g"], f"{members} lanes": [f"g{i}" for i in range(members)]}
    samples = interleaved_rounds(
        {name: lambda lanes=lanes: run_on(uvloop.new_event_loop,
                                          graph_group(members, member_s, lanes)) * 1e3
         for name, lanes in layouts.items()},
        repeats, show=lambda ms: f"{ms:.1f} ms",
    )  # fmt: skip
    medians = {name: statistics.median(v) for name, v in samples.items()}
    rows = [[name, f"{medians[name]:.1f}", spread(v)] for name, v in samples.items()]
    print_table(f"submit_group of {members} members sleeping {member_s * 1e3:.0f} ms, "
                f"median of {repeats} rounds (uvloop)", ["lanes", "ms", "spread"], rows)  # fmt: skip
    return medians


if __name__ == "__main__":
    main()
