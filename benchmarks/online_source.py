"""Online training from a source with latency: does the pipeline hide the fetch?

Each batch of the HSTU demo's data is fetched with a latency of 5-10 ms (a feature
store over the network, drawn per batch from a seeded generator: the same latencies
for every pipeline) and then decoded on the CPU (the synthetic batch is built: torch
ops and Python).  The rows:

* plain loop: ``for batch in fetcher`` (fetch, then train);
* torchrec: ``TrainPipelineSparseDist`` over the same sync iterator (it calls
  ``next()`` on the training thread);
* prefetch thread: the plain loop fed by one background thread that fetches ahead
  into a bounded queue (what a user would write by hand);
* aiopipe: ``HSTUPipeline`` fed by an ``async for`` source that awaits the latency
  (``asyncio.sleep``) and decodes on the loop; the pipeline reads it ahead while the
  lanes train.

Every pipeline runs in worker processes of its own, in short alternating chunks,
``--processes`` fresh sets of them (``benchmarks/_chunks.py`` says why); each chunk's
ratio to the prefetch thread's and torchrec's chunks of the same round is the paired
figure.  Between chunks a worker is idle, but a fetch under way completes (the
prefetch thread fills its queue); the two untimed steps that start every chunk use
that up.

    ./dev bench online_source [--chunk 30] [--rounds 12] [--processes 3]
                              [--latency-ms 5 10] [--configs ...]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
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

from _chunks import nothing_to_report, paired, repeat, time_in_chunks  # noqa: E402
from _common import print_json, print_table, spread  # noqa: E402

CONFIGS = ("plain loop", "torchrec", "prefetch thread", "aiopipe")
WARM_UP = 20  # steps before the first timed chunk (set-up, torchrec's rewrite, prefill)


class Fetcher:
    """Batch ``i`` after its latency, endlessly; the same latencies for every pipeline."""

    def __init__(self, latency_ms: tuple[float, float], seed: int) -> None:
        from hstu_tasks import DataConfig, SyntheticHSTUData

        self.data = SyntheticHSTUData(DataConfig(), 10**6, seed=seed)
        self.latency_ms, self.seed = latency_ms, seed

    def _latencies(self) -> Iterator[tuple[int, float]]:
        draw = random.Random(self.seed)
        for index in range(len(self.data)):
            yield index, draw.uniform(*self.latency_ms) / 1000

    def __iter__(self) -> Iterator[Any]:  # the blocking client
        for index, latency in self._latencies():
            time.sleep(latency)
            yield self.data.batch(index)

    async def __aiter__(self) -> AsyncIterator[Any]:  # the asyncio client
        for index, latency in self._latencies():
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


def _build(config: str, rank: int, *,
           latency_ms: tuple[float, float]) -> tuple[Callable[[int], None], Any]:  # fmt: skip
    """The chunk worker's ``run(n)``: the next ``n`` steps of ``config``."""
    from hstu_tasks import DataConfig, HSTUPipeline, ModelConfig, OptimizerConfig
    from hstu_tasks import build_training, quiet_torchrec
    from hstu_tasks.parallel import plain_train_step
    from hstu_tasks.runners import torchrec_pipeline

    from aiopipe._core.loops import LoopRunner

    quiet_torchrec()
    setup = build_training(ModelConfig(), DataConfig(), OptimizerConfig(), seed=0)
    fetcher = Fetcher(latency_ms, seed=1)
    if config == "aiopipe":
        pipe = HSTUPipeline(setup.model, setup.optimizer, setup.device)
        source = aiter(fetcher)
        runner = LoopRunner()  # one loop for every chunk, as one aiopipe.run would be

        async def chunk(n: int) -> None:
            for _ in range(n):
                await pipe.progress(source)

        return (lambda n: runner.run(chunk, n)), nothing_to_report
    batches = prefetched(iter(fetcher)) if config == "prefetch thread" else iter(fetcher)
    if config == "torchrec":
        sparse_dist = torchrec_pipeline(setup)
        return repeat(lambda: sparse_dist.progress(batches)), nothing_to_report
    return repeat(lambda: plain_train_step(setup, next(batches))), nothing_to_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=30, help="steps per timed chunk")
    parser.add_argument("--rounds", type=int, default=12, help="chunks per pipeline and process")
    parser.add_argument("--processes", type=int, default=3,
                        help="fresh processes per pipeline, one set after another")  # fmt: skip
    parser.add_argument("--latency-ms", type=float, nargs=2, default=(5.0, 10.0))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    args = parser.parse_args()
    if min(args.chunk, args.rounds, args.processes) < 1:
        parser.error("--chunk, --rounds and --processes must be at least 1")
    latency = (args.latency_ms[0], args.latency_ms[1])
    configs = [*(c for c in ("torchrec", "prefetch thread") if c in args.configs),
               *(c for c in args.configs if c not in ("torchrec", "prefetch thread"))]  # fmt: skip
    chunks = time_in_chunks(
        functools.partial(_build, latency_ms=latency), configs, chunk=args.chunk,
        rounds=args.rounds, processes=args.processes, gloo=True, warm_up=WARM_UP,
    )  # fmt: skip
    ms = chunks.ms
    rows = []
    for config, values in ms.items():
        rows.append([
            config, f"{1e3 / statistics.median(values):.1f}", spread(values),
            *(f"{1 / paired(values, ms[base]):.2f}" if base in ms else "--"
              for base in ("torchrec", "prefetch thread")),
            f"{statistics.median(chunks.cores[config]):.2f}",
        ])  # fmt: skip
    print_table(
        f"HSTU step with a {latency[0]:g}-{latency[1]:g} ms fetch per batch, one rank, "
        f"{args.processes} process sets, {args.rounds} alternating chunks of {args.chunk} "
        "steps per set (speed ratios: paired medians)",
        ["pipeline", "steps / s", "spread", "x torchrec", "x prefetch thread",
         "cores busy (cpu/wall)"],
        rows,
    )  # fmt: skip
    print_json("online_source", {"args": vars(args), "ms_per_step": ms, "cores": chunks.cores})


if __name__ == "__main__":
    main()
