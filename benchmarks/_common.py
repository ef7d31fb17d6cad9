"""Shared helpers for the benchmark scripts: timing pipelines and printing results."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

from aiopipe import SchedulablePipeline


async def time_progress(pipe: SchedulablePipeline, iterations: int, warmup: int = 20) -> float:
    """Seconds per ``progress()`` in steady state."""
    source = iter(range(iterations + warmup + pipe.plan.max_lookahead + 1))
    for _ in range(warmup):
        await pipe.progress(source)
    start = time.perf_counter()
    for _ in range(iterations):
        await pipe.progress(source)
    return (time.perf_counter() - start) / iterations


def run_on(loop_factory: Callable[[], asyncio.AbstractEventLoop], coro: Any) -> Any:
    loop = loop_factory()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def best_of(repeats: int, measure: Callable[[], float]) -> float:
    """The median of ``repeats`` measurements (machines are noisy)."""
    return statistics.median(measure() for _ in range(repeats))


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def print_json(name: str, payload: dict[str, Any]) -> None:
    print("JSON " + json.dumps({"benchmark": name, **payload}, sort_keys=True))


def add_hstu_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every multi-rank HSTU benchmark takes."""
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-history", type=int, default=48)


def spawn_ranks(worker: Callable[..., None], args: dict[str, Any]) -> Any:
    """Run ``worker(rank, port, ranks, args, out_path)`` on ``args["ranks"]`` spawned
    processes; return the JSON rank 0 wrote to ``out_path``."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.spawn(worker, args=(port, args["ranks"], args, out.name), nprocs=args["ranks"])
        return json.loads(Path(out.name).read_text())


def report_and_leave(rank: int, out: str, payload: Any) -> None:
    """End a ``spawn_ranks`` worker: rank 0 writes ``payload`` to ``out``, then every
    rank leaves the group with ``hstu_tasks.leave_and_exit`` (no native exit-time
    teardown, which aborted once in a benchmark rank)."""
    from hstu_tasks import leave_and_exit

    if rank == 0:
        Path(out).write_text(json.dumps(payload))
    leave_and_exit(0)
