"""The step boundary: how long the lane that runs the step sits idle between two steps.

From the tracer's spans of the ``presets`` MLP on ``basic()`` (one lane on a CPU):
the time from the last task body of one iteration to the first body of the next on
the busiest lane thread, less any time that body was ready but waiting for another
lane or a collective ticket, per boundary.  The rows run in one process, in
alternating rounds; each prints the median and the 90th percentile of its boundaries
and its time per step (the tracer costs a little per task: compare the rows, and time
speed with ``./dev bench presets``).

The rows: ``progress`` per step (the async form), ``progress_many(source, chunk)``
(the lanes chain the steps), and the same two in the blocking form.

    ./dev bench step_boundary [--width 256] [--batch 128] [--chunk 100] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _common import print_json, print_table, spread, step_boundaries_us  # noqa: E402
from presets import _batches, forward, loss_fn, setup  # noqa: E402

from aiopipe import Tracer, basic  # noqa: E402
from aiopipe._core.loops import LoopRunner  # noqa: E402

ROWS = {
    "progress": "progress() per step",
    "progress_many": "progress_many(source, chunk)",
    "blocking": "blocking progress() per step",
    "blocking-many": "blocking progress_many(source, chunk)",
}


def build(row: str, width: int, batch: int) -> tuple[Callable[[int], None], Tracer]:
    source = _batches(torch.device("cpu"), width, batch)
    model, opt = setup(torch.device("cpu"), width)
    tracer = Tracer()
    pipe = basic(model, opt, loss_fn=loss_fn, forward=forward, trace=tracer)
    if row.startswith("blocking"):
        blocking = pipe.blocking()
        if row == "blocking-many":
            return (lambda n: blocking.progress_many(source, n)), tracer
        return (lambda n: [blocking.progress(source) for _ in range(n)]), tracer
    runner = LoopRunner()

    async def chunk(n: int) -> None:
        if row == "progress_many":
            await pipe.progress_many(source, n)
        else:
            for _ in range(n):
                await pipe.progress(source)

    return (lambda n: runner.run(chunk, n)), tracer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=100, help="steps per round and row")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    args = parser.parse_args()
    if min(args.chunk, args.rounds) < 2:
        parser.error("--chunk and --rounds must be at least 2")
    runs = {row: build(row, args.width, args.batch) for row in args.rows}
    gaps: dict[str, list[float]] = {row: [] for row in args.rows}
    step_ms: dict[str, list[float]] = {row: [] for row in args.rows}
    for run, tracer in runs.values():  # warm up: threads, allocator, the ring filling
        run(20)
        tracer.clear()
    for round_ in range(args.rounds):
        order = args.rows if round_ % 2 == 0 else args.rows[::-1]
        for row in order:
            run, tracer = runs[row]
            start = time.perf_counter()
            run(args.chunk)
            step_ms[row].append((time.perf_counter() - start) * 1e3 / args.chunk)
            gaps[row].extend(step_boundaries_us(tracer.spans))
            tracer.clear()
    rows, payload = [], {}
    for row in args.rows:
        values = sorted(gaps[row])
        median, p90 = statistics.median(values), values[int(0.9 * (len(values) - 1))]
        ms = statistics.median(step_ms[row])
        rows.append([ROWS[row], f"{median:.0f}", f"{p90:.0f}", f"{ms:.3f}", spread(step_ms[row])])
        payload[row] = {"gap_us_median": median, "gap_us_p90": p90, "ms_per_step": step_ms[row]}
    print_table(
        f"the step boundary, basic() MLP width {args.width}, batch {args.batch}, "
        f"{args.rounds} rounds of {args.chunk} steps",
        ["row", "boundary us (median)", "p90", "ms / step (traced)", "spread"], rows,
    )  # fmt: skip
    print_json("step_boundary", {"args": vars(args), "results": payload})


if __name__ == "__main__":
    main()
