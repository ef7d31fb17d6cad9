"""Overlap: two GIL-free 3 ms stages on two lanes should take 3 ms per progress.

Stage one (lookahead 1) and stage two (lookahead 0) each sleep 3 ms (sleeping
releases the GIL, like a CUDA launch or a GIL-free torch op).  Run one after the
other a progress costs two stages; on two lanes the stages of different batches
overlap and the ideal is one stage.  A 3 ms sleep itself lasts a little longer than
3 ms (timer slack), so the efficiency is reported against both the nominal 3 ms and
the stage time actually measured inside the bodies.

    ./dev bench overlap [--stage-ms 3] [--iterations 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import uvloop  # noqa: E402
from _common import print_json, print_table, progress, run_on, spread, time_progress  # noqa: E402

from aiopipe import AsyncExecutor, Pipeline, Task  # noqa: E402

CONFIGS = {
    "async, two lanes": lambda: AsyncExecutor({"stage_one": "io", "stage_two": "compute"}),
    "async, lane + loop": lambda: AsyncExecutor({"stage_one": "io", "stage_two": "loop"}),
    "async, one lane": lambda: AsyncExecutor(lambda task: "single"),
    "sequential": lambda: "sequential",
}


def build(stage_s: float, executor: object, durations: list[float]) -> Pipeline:
    def stage(ctx: object) -> None:
        start = time.perf_counter()
        time.sleep(stage_s)
        durations.append(time.perf_counter() - start)

    tasks = [
        Task.from_fn("stage_one", stage, lookahead=1, stream="memcpy", writes=("x",)),
        Task.from_fn("stage_two", stage, reads=("x",)),
    ]
    return Pipeline(tasks, executor=executor, expect_result=False)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage-ms", type=float, default=3.0)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    stage_s = args.stage_ms / 1e3
    rows, payload = [], {}
    durations: list[float] = []
    spreads: dict[str, str] = {}
    for name, make in CONFIGS.items():

        def measure() -> float:
            pipe = build(stage_s, make(), durations)
            try:
                return run_on(uvloop.new_event_loop, time_progress(pipe, args.iterations, warmup=10))
            finally:
                pipe.shutdown()

        runs = [measure() for _ in range(args.repeats)]
        progress(f"{name}: {', '.join(f'{s * 1e3:.3f}' for s in runs)} ms per progress")
        payload[name] = {"ms_per_progress": statistics.median(runs) * 1e3}
        spreads[name] = spread(runs)
    stage_measured = statistics.median(durations)
    for name, result in payload.items():
        seconds = result["ms_per_progress"] / 1e3
        result["vs_nominal"] = stage_s / seconds
        result["vs_measured_stage"] = stage_measured / seconds
        rows.append([name, f"{seconds * 1e3:.3f}", spreads[name], f"{stage_s / seconds:.3f}",
                     f"{stage_measured / seconds:.3f}"])  # fmt: skip
    print_table(
        f"two {args.stage_ms:g} ms stages (one stage measures {stage_measured * 1e3:.3f} ms "
        f"here), uvloop, median of {args.repeats} runs",
        ["executor", "ms / progress", "spread", f"{args.stage_ms:g} ms / measured",
         "stage / measured"],
        rows,
    )
    print_json(
        "overlap",
        {"stage_ms": args.stage_ms, "stage_measured_ms": stage_measured * 1e3, "results": payload},
    )


if __name__ == "__main__":
    main()
