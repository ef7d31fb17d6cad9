"""What the engine's own work costs between torch steps, against what it costs alone.

One thread, one torch thread, the ``presets`` MLP's plain step (no pipeline): each
row runs in rounds of ``--steps`` steps, the rows in a shuffled order every round,
and times the thread's CPU a step (``time.thread_time_ns``).  The rows:

* ``plain``: the plain step alone;
* ``engine alone``: a pipeline of four no-op tasks (``executor="sequential"``), one
  ``progress()`` a step, no torch work;
* ``plain + engine``: the plain step, then that pipeline's ``progress()``;
* ``plain + loop cycle``: the plain step, then one ``await asyncio.sleep(0)``.

The extra CPU of the two "plain +" rows over the plain row of the same round
(paired) against the engine's cost alone says how much dearer the engine's Python
is between torch steps than in a no-op benchmark (docs/performance.md).

    ./dev bench engine_in_context [--width 256] [--batch 128] [--steps 200] [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _common import print_json, print_table, progress, with_spread  # noqa: E402
from presets import loss_fn, setup  # noqa: E402

from aiopipe import NoStepResultWarning, Schedule, SchedulablePipeline, Task  # noqa: E402

ROWS = ("plain", "engine alone", "plain + engine", "plain + loop cycle")


def _noop(ctx: object) -> None:
    return None


def _rows(width: int, batch: int) -> dict[str, Callable[[int], Coroutine[Any, Any, None]]]:
    """Each row as ``run(steps)``, on shared state built once."""
    model, optimizer = setup(torch.device("cpu"), width)
    data = itertools.cycle([(torch.randn(batch, width), torch.randn(batch, 1)) for _ in range(10)])
    with warnings.catch_warnings():  # no task writes a result: the rows time the engine alone
        warnings.simplefilter("ignore", NoStepResultWarning)
        engine = SchedulablePipeline(
            Schedule.of([Task.from_fn(name, _noop) for name in "abcd"]), executor="sequential"
        )  # fmt: skip
    nothing = itertools.repeat(None)

    def step() -> None:
        x, y = next(data)
        optimizer.zero_grad()
        loss_fn(model(x), (x, y)).backward()
        optimizer.step()

    async def plain(steps: int) -> None:
        for _ in range(steps):
            step()

    async def engine_alone(steps: int) -> None:
        for _ in range(steps):
            await engine.progress(nothing)

    async def plain_and_engine(steps: int) -> None:
        for _ in range(steps):
            step()
            await engine.progress(nothing)

    async def plain_and_cycle(steps: int) -> None:
        for _ in range(steps):
            step()
            await asyncio.sleep(0)

    return dict(zip(ROWS, (plain, engine_alone, plain_and_engine, plain_and_cycle)))


async def _measure(args: argparse.Namespace) -> dict[str, list[float]]:
    rows = _rows(args.width, args.batch)
    for run in rows.values():  # warm up every row
        await run(20)
    cpu_us: dict[str, list[float]] = {name: [] for name in rows}
    order = list(rows)
    shuffle = random.Random(0).shuffle
    for round_no in range(1, args.rounds + 1):
        shuffle(order)
        for name in order:
            start = time.thread_time_ns()
            await rows[name](args.steps)
            cpu_us[name].append((time.thread_time_ns() - start) / args.steps / 1e3)
        progress(f"round {round_no}/{args.rounds}: " + ", ".join(
            f"{name} {cpu_us[name][-1]:.1f}" for name in ROWS))  # fmt: skip
    return cpu_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200, help="steps a row a round")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu_us = asyncio.run(_measure(args))
    plain = cpu_us["plain"]
    alone = statistics.median(cpu_us["engine alone"])
    extra = {name: [a - b for a, b in zip(cpu_us[name], plain)] for name in ROWS[2:]}
    rows = [[name, with_spread(cpu_us[name], 1), "", ""] for name in ROWS[:2]]
    for name, paired in extra.items():
        median = statistics.median(paired)
        rows.append([name, with_spread(cpu_us[name], 1), f"{median:.1f}",
                     f"{median / alone:.2f}" if name == "plain + engine" else ""])  # fmt: skip
    print_table(
        f"CPU a step, one thread (width {args.width}, batch {args.batch}), median of "
        f"{args.rounds} rounds x {args.steps} steps",
        ["row", "us a step", "extra over plain (paired), us", "x the engine alone"], rows,
    )  # fmt: skip
    print_json("engine_in_context", {
        "us_per_step": {name: statistics.median(values) for name, values in cpu_us.items()},
        "extra_us": {name: statistics.median(values) for name, values in extra.items()},
    })  # fmt: skip


if __name__ == "__main__":
    main()
