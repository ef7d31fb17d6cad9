"""One read-bound online cycle taken apart: the wait, the build and the hand-off.

Where a source's wait is longer than the step (``online_matrix``'s 3 ms / 2.4 ms cell),
a step's cycle is the read: wait for the batch, build it, start the next wait.  The
source stamps each wait and each build; this prints, per row, the time a step, how
long the wait took, the build, and the gap from a build's end to the next wait's
start -- for the hand-written prefetch thread (``time.sleep`` in the thread) and for
``basic()`` fed by an async generator (``asyncio.sleep``), reading one and two ahead.
Each row runs in a fresh process, the rows alternating over rounds.

    ./dev bench online_cycle [--latency-ms 3] [--compute-ms 2.4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _common import print_json, print_table, progress, with_spread  # noqa: E402

ROWS = ("prefetch thread", "aiopipe async", "aiopipe async, 2 ahead")
COLUMNS = ("ms_per_step", "wait_ms", "build_ms", "gap_ms")


def measure(row: str, *, width: int, latency_s: float, steps: int) -> dict[str, float]:
    """The row's medians over ``steps`` timed steps (after 20 untimed)."""
    import online_matrix as matrix

    net, opt = matrix.model(width)
    waits: list[tuple[float, float]] = []
    builds: list[tuple[float, float]] = []

    def build(generator: torch.Generator) -> Any:
        start = time.perf_counter()
        batch = matrix._batch(generator)
        builds.append((start, time.perf_counter()))
        return batch

    if row == "prefetch thread":
        ready: queue.Queue[Any] = queue.Queue(2)

        def fetch_forever() -> None:
            generator = torch.Generator().manual_seed(1)
            while True:
                start = time.perf_counter()
                time.sleep(latency_s)
                waits.append((start, time.perf_counter()))
                ready.put(build(generator))

        threading.Thread(target=fetch_forever, daemon=True).start()

        def run(n: int) -> None:
            for _ in range(n):
                batch = ready.get()
                opt.zero_grad()
                matrix.loss_fn(matrix.forward(net, batch), batch).backward()
                opt.step()

    else:
        from aiopipe import basic
        from aiopipe._core.loops import LoopRunner

        async def source() -> Any:
            generator = torch.Generator().manual_seed(1)
            for _ in itertools.count():
                start = time.perf_counter()
                await asyncio.sleep(latency_s)
                waits.append((start, time.perf_counter()))
                yield build(generator)

        pipe = basic(net, opt, loss_fn=matrix.loss_fn, forward=matrix.forward,
                     read_ahead=2 if row.endswith("2 ahead") else 1)  # fmt: skip
        batches, runner = source(), LoopRunner()

        async def steps_of(n: int) -> None:
            for _ in range(n):
                await pipe.progress(batches)

        def run(n: int) -> None:
            runner.run(steps_of, n)

    run(20)
    first = len(waits)
    began = time.perf_counter()
    run(steps)
    elapsed = time.perf_counter() - began
    timed = list(zip(waits[first:], builds[first:]))
    gaps = [nxt[0][0] - cur[1][1] for cur, nxt in itertools.pairwise(timed)]
    return {
        "ms_per_step": 1e3 * elapsed / steps,
        "wait_ms": 1e3 * statistics.median(end - start for (start, end), _ in timed),
        "build_ms": 1e3 * statistics.median(end - start for _, (start, end) in timed),
        "gap_ms": 1e3 * statistics.median(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=3.0)
    parser.add_argument("--compute-ms", type=float, default=2.4)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)  # a worker process
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row is not None:
        print(json.dumps(measure(args.row, width=args.width, latency_s=args.latency_ms / 1e3,
                                 steps=args.steps)))  # fmt: skip
        return
    if min(args.steps, args.rounds) < 2 or args.latency_ms <= 0:
        parser.error("--steps and --rounds must be >= 2, --latency-ms above 0")
    import online_matrix as matrix

    width = matrix.calibrate(args.compute_ms)
    results: dict[str, list[dict[str, float]]] = {row: [] for row in ROWS}
    for round_no in range(1, args.rounds + 1):
        order = ROWS if round_no % 2 else ROWS[::-1]
        for row in order:
            done = subprocess.run(
                [sys.executable, __file__, "--row", row, "--width", str(width), "--latency-ms",
                 str(args.latency_ms), "--steps", str(args.steps)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            results[row].append(json.loads(done.stdout.strip().splitlines()[-1]))
        progress(f"round {round_no}/{args.rounds}: " + ", ".join(
            f"{row} {results[row][-1]['ms_per_step']:.2f} ms" for row in ROWS))  # fmt: skip
    thread = statistics.median(r["ms_per_step"] for r in results["prefetch thread"])
    rows = []
    for row in ROWS:
        cells = [with_spread([r[c] for r in results[row]], 2) for c in COLUMNS]
        speed = thread / statistics.median(r["ms_per_step"] for r in results[row])
        rows.append([row, *cells, f"{speed:.3f}"])
    print_table(
        f"one read-bound cycle: a {args.latency_ms:g} ms wait, a ~{args.compute_ms:g} ms step "
        f"(width {width}), {args.rounds} rounds of {args.steps} steps, a process each",
        ["row", "ms / step", "the wait took (ms)", "build (ms)", "build's end to next wait (ms)",
         "speed x prefetch thread"],
        rows,
    )  # fmt: skip
    print_json("online_cycle", {"width": width, "latency_ms": args.latency_ms, "rows": results})


if __name__ == "__main__":
    main()
