"""Online training from a source with latency: does the pipeline hide the fetch?

Each batch of the HSTU demo's data is fetched with a latency of 5-10 ms (a feature
store over the network, drawn per batch from a seeded generator) and then decoded on
the CPU (the synthetic batch is built: torch ops and Python).  Side by side, one
process, interleaved over rounds:

* plain loop: ``for batch in fetcher`` (fetch, then train);
* torchrec: ``TrainPipelineSparseDist`` over the same sync iterator (it calls
  ``next()`` on the training thread);
* prefetch thread: the plain loop fed by one background thread that fetches ahead
  into a bounded queue (what a user would write by hand);
* aiopipe: ``HSTUPipeline`` fed by an ``async for`` source that awaits the latency
  (``asyncio.sleep``) and decodes on the loop; the pipeline reads it ahead while the
  lanes train.

Each run is timed after its first steps (set-up and prefill left out).

    ./dev bench online_source [--steps 100] [--repeats 3] [--latency-ms 5 10]
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import random
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import print_json, print_table, progress, spread  # noqa: E402

from aiopipe import run  # noqa: E402
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
from hstu_tasks.runners import run_pipeline  # noqa: E402

CONFIGS = ("plain loop", "torchrec", "prefetch thread", "aiopipe")
#: Steps left out of the timing at the start of every run.
WARM_UP = 10


class Fetcher:
    """Batch ``i`` after its latency; the same latencies for every configuration."""

    def __init__(self, steps: int, latency_ms: tuple[float, float], seed: int) -> None:
        self.data = SyntheticHSTUData(DataConfig(), steps, seed=seed)
        draw = random.Random(seed)
        self.latency_s = [draw.uniform(*latency_ms) / 1000 for _ in range(steps)]

    def __iter__(self) -> Iterator[Any]:  # the blocking client
        for index, latency in enumerate(self.latency_s):
            time.sleep(latency)
            yield self.data.batch(index)

    async def __aiter__(self) -> AsyncIterator[Any]:  # the asyncio client
        for index, latency in enumerate(self.latency_s):
            await asyncio.sleep(latency)
            yield self.data.batch(index)


def prefetched(batches: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """``batches``, fetched ahead by one background thread into a bounded queue."""
    slots: queue.Queue[Any] = queue.Queue(maxsize=depth)
    end = object()

    def fetch() -> None:
        for batch in batches:
            slots.put(batch)
        slots.put(end)

    threading.Thread(target=fetch, daemon=True).start()
    while (batch := slots.get()) is not end:
        yield batch


def train_aiopipe(setup: Any, fetcher: Fetcher, on_step: Callable[[int], None]) -> None:
    pipe = HSTUPipeline(setup.model, setup.optimizer, setup.device)

    async def train() -> None:
        async with pipe:
            step = 0
            async for _ in pipe.results(fetcher):
                step += 1
                on_step(step)

    run(train())


def measure(name: str, steps: int, latency_ms: tuple[float, float], seed: int) -> float:
    """Steps per second after the first :data:`WARM_UP` steps (the pipelines' own
    set-up -- torchrec's rewrite of the model on its first batch, the prefill -- and
    the first fetches are left out, as in a long online run)."""
    setup = build_training(ModelConfig(), DataConfig(), OptimizerConfig(), seed=0)
    fetcher = Fetcher(steps, latency_ms, seed)
    done: list[float] = []

    def on_step(step: int) -> None:  # run_pipeline's hook: called after step n
        done.append(time.perf_counter())

    if name == "aiopipe":
        train_aiopipe(setup, fetcher, on_step)
    else:
        mode = {"plain loop": "none", "torchrec": "torchrec", "prefetch thread": "none"}[name]
        source: Any = prefetched(iter(fetcher)) if name == "prefetch thread" else fetcher
        run_pipeline(mode, setup, source, on_step)
    if len(done) != steps:
        raise RuntimeError(f"{name} trained {len(done)} of {steps} batches")
    return (steps - WARM_UP) / (done[-1] - done[WARM_UP - 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, nargs=2, default=(5.0, 10.0))
    args = parser.parse_args()
    if args.steps <= WARM_UP + 10:
        parser.error(f"--steps must be above {WARM_UP + 10}")
    quiet_torchrec()
    init_distributed()  # one rank on gloo: torchrec's pipeline needs a process group
    latency = (args.latency_ms[0], args.latency_ms[1])
    samples: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name in CONFIGS:
            rate = measure(name, args.steps, latency, seed=repeat)
            if repeat:
                samples[name].append(rate)
            progress(f"round {repeat}/{args.repeats}{' (warm-up)' if not repeat else ''}: "
                     f"{name} {rate:.1f} steps/s")  # fmt: skip
    medians = {name: statistics.median(values) for name, values in samples.items()}
    rows = [
        [name, f"{rate:.1f}", spread(samples[name]),
         f"{rate / medians['torchrec']:.2f}", f"{rate / medians['prefetch thread']:.2f}"]
        for name, rate in medians.items()
    ]  # fmt: skip
    print_table(
        f"HSTU step with a {latency[0]:g}-{latency[1]:g} ms fetch per batch, {args.steps} "
        f"steps (the first {WARM_UP} not timed), median of {args.repeats} rounds (spread: half "
        f"their range)",
        ["pipeline", "steps / s", "spread", "x torchrec", "x prefetch thread"],
        rows,
    )
    print_json("online_source", {"args": vars(args), "steps_per_s": medians,
                                 "samples": samples})  # fmt: skip


if __name__ == "__main__":
    main()
