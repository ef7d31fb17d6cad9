"""Online training, source by latency by compute: how much of the fetch is hidden?

The newcomer's shape of docs/performance.md: ``basic(model, opt, loss_fn=...)`` with
its defaults, fed by a source that waits ``latency`` ms for each batch (a feature
store, a queue) and then builds a 256 x 384 batch for a three-layer MLP whose width
is calibrated, once, to the compute times asked for.  The rows of each cell:

* plain loop: fetch, then step (sync source: ``time.sleep``);
* prefetch thread: the plain loop fed by one background thread fetching ahead;
* aiopipe sync: ``pipe.progress`` over the sync generator (read ahead inline);
* aiopipe async: over an async generator awaiting ``asyncio.sleep(latency)``;
* aiopipe fetch_ahead: over ``fetch_ahead(keys, fetch, in_flight=4)``, each fetch
  awaiting the latency (its ideal: ``max(latency / 4, compute)``);
* aiopipe async, 2 ahead: the async generator read two batches ahead
  (``read_ahead=2``), as the prefetch thread's queue of two holds them.

Each cell's rows run in worker processes of their own, in alternating chunks
(``_chunks.py``), each chunk after ``SETTLE`` untimed steps that use up whatever a
row read ahead while the others ran.  Printed per cell: ms a step (median of the chunks), its spread,
the ideal ``max(latency, compute)``, each row's share of the ideal rate and its speed
against the prefetch thread; and the async row against the sync row.

    ./dev bench online_matrix [--latency-ms 0 3 6 12] [--compute-ms 2 7 15]
                              [--chunk 20] [--rounds 6] [--processes 1] [--jitter 0]

``--jitter F`` varies each fetch's latency evenly within ``1 +- F`` of it (the same
sequence for every row): the case a read-ahead of more than one batch is for.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _chunks import nothing_to_report, paired, repeat, time_in_chunks  # noqa: E402
from _common import print_json, print_table, spread  # noqa: E402
from online_source import prefetched  # noqa: E402

#: Untimed steps before each chunk: more than any row reads ahead while the others are
#: timed (the prefetch thread's queue of two and the batch its thread holds,
#: fetch_ahead's four in flight), so every row starts its chunk in steady state.
SETTLE = 6
CONFIGS = ("plain loop", "prefetch thread", "aiopipe sync", "aiopipe async", "aiopipe fetch_ahead",
           "aiopipe async, 2 ahead")  # fmt: skip
IN_FLIGHT = 4  # fetch_ahead's fetches at once
BATCH, FEATURES = 256, 384


def model(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
        torch.nn.ReLU(), torch.nn.Linear(width, 1),
    )  # fmt: skip
    return net, torch.optim.SGD(net.parameters(), lr=1e-4)


def loss_fn(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, batch[1])


def forward(net: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return net(batch[0])


def step_ms(width: int, steps: int = 15) -> float:
    """The plain step's time at ``width``, on this machine, now."""
    net, opt = model(width)
    batch = (torch.randn(BATCH, FEATURES), torch.randn(BATCH, 1))
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        opt.zero_grad()
        loss_fn(forward(net, batch), batch).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def calibrate(target_ms: float) -> int:
    """A width whose step takes about ``target_ms`` (time grows about linearly in the
    width here: the first layer dominates up to a few thousand)."""
    width = 512
    for _ in range(4):
        width = max(16, round(width * target_ms / step_ms(width) / 16) * 16)
    return width


def _batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, FEATURES, generator=generator), torch.randn(BATCH, 1, generator=generator)


def delay_s(latency_s: float, jitter: float, index: int) -> float:
    """The ``index``-th fetch's latency: ``latency_s`` times a factor drawn evenly from
    ``[1 - jitter, 1 + jitter]``, the same for every row (seeded by the index)."""
    return latency_s * (1 + jitter * (2 * random.Random(index).random() - 1))


def sync_source(latency_s: float, jitter: float) -> Iterator[Any]:
    generator = torch.Generator().manual_seed(1)
    for index in itertools.count():
        if latency_s:
            time.sleep(delay_s(latency_s, jitter, index))
        yield _batch(generator)


async def async_source(latency_s: float, jitter: float) -> AsyncIterator[Any]:
    generator = torch.Generator().manual_seed(1)
    for index in itertools.count():
        if latency_s:
            await asyncio.sleep(delay_s(latency_s, jitter, index))
        yield _batch(generator)


def keyed_source(latency_s: float, jitter: float) -> Any:
    from aiopipe import fetch_ahead

    generator = torch.Generator().manual_seed(1)

    async def fetch(key: int) -> tuple[torch.Tensor, torch.Tensor]:
        if latency_s:
            await asyncio.sleep(delay_s(latency_s, jitter, key))
        return _batch(generator)

    return fetch_ahead(itertools.count(), fetch, in_flight=IN_FLIGHT)


def _build(config: str, rank: int, *, width: int, latency_ms: float,
           jitter: float) -> tuple[Callable[[int], None], Any]:  # fmt: skip
    from aiopipe import basic
    from aiopipe._core.loops import LoopRunner

    net, opt = model(width)
    latency_s = latency_ms / 1000
    if config.startswith("aiopipe"):
        depth = 2 if config.endswith("2 ahead") else 1
        pipe = basic(net, opt, loss_fn=loss_fn, forward=forward, read_ahead=depth)
        sources = {"aiopipe async": async_source, "aiopipe fetch_ahead": keyed_source,
                   "aiopipe async, 2 ahead": async_source}  # fmt: skip
        source: Any = sources.get(config, sync_source)(latency_s, jitter)
        runner = LoopRunner()  # one loop for every chunk, as one aiopipe.run would be

        async def chunk(n: int) -> None:
            for _ in range(n):
                await pipe.progress(source)

        return (lambda n: runner.run(chunk, n)), nothing_to_report
    batches = sync_source(latency_s, jitter)
    if config == "prefetch thread":
        batches = prefetched(batches)

    def plain_step() -> None:
        batch = next(batches)
        opt.zero_grad()
        loss_fn(forward(net, batch), batch).backward()
        opt.step()

    return repeat(plain_step), nothing_to_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 3.0, 6.0, 12.0])
    parser.add_argument("--compute-ms", type=float, nargs="+", default=[2.0, 7.0, 15.0])
    parser.add_argument("--chunk", type=int, default=20, help="steps per timed chunk")
    parser.add_argument("--rounds", type=int, default=6, help="chunks per row and process")
    parser.add_argument("--processes", type=int, default=1, help="fresh process sets per cell")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="each fetch's latency varies evenly by up to this share "
                             "(0.5: 50-150 %% of --latency-ms; the mean stays)")  # fmt: skip
    args = parser.parse_args()
    if not 0 <= args.jitter <= 1:
        parser.error("--jitter must be within 0..1")
    widths = {target: calibrate(target) for target in args.compute_ms}
    rows, cells = [], []
    for target, latency in itertools.product(args.compute_ms, args.latency_ms):
        width = widths[target]
        compute = step_ms(width)
        build = functools.partial(_build, width=width, latency_ms=latency, jitter=args.jitter)
        chunks = time_in_chunks(build, args.configs, chunk=args.chunk, rounds=args.rounds,
                                processes=args.processes, settle=SETTLE)  # fmt: skip
        ideal = max(latency, compute)
        base = "prefetch thread" if "prefetch thread" in args.configs else args.configs[0]
        cell: dict[str, Any] = {"compute_ms": compute, "latency_ms": latency, "width": width,
                                "ideal_ms": ideal, "rows": {}}  # fmt: skip
        for config in args.configs:
            ms = chunks.ms[config]
            step = statistics.median(ms)  # ms a step, each chunk's
            versus = 1 / paired(ms, chunks.ms[base])
            fetched = latency / IN_FLIGHT if config == "aiopipe fetch_ahead" else latency
            row_ideal = max(fetched, compute)
            cell["rows"][config] = {"ms": step, "of_ideal": row_ideal / step, "x_base": versus}
            rows.append([f"{compute:.1f}", f"{latency:g}", config, f"{step:.2f}", spread(ms),
                         f"{row_ideal / step:.2f}", f"{versus:.2f}"])  # fmt: skip
        if {"aiopipe sync", "aiopipe async"} <= set(args.configs):
            cell["async_x_sync"] = 1 / paired(chunks.ms["aiopipe async"], chunks.ms["aiopipe sync"])
        cells.append(cell)
    print_table(
        f"online training, basic() defaults, batch {BATCH} x {FEATURES}, chunks of {args.chunk} "
        f"steps, {args.rounds} rounds",
        ["compute ms", "latency ms", "row", "ms / step", "spread", "x ideal rate",
         "x prefetch thread"],
        rows,
    )  # fmt: skip
    for cell in cells:
        if "async_x_sync" in cell:
            print(f"compute {cell['compute_ms']:.1f} ms, latency {cell['latency_ms']:g} ms: "
                  f"async source {cell['async_x_sync']:.3f}x the sync one")  # fmt: skip
    print_json("online_matrix", {"args": vars(args), "cells": cells})


if __name__ == "__main__":
    main()
