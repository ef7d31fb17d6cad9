"""Where the CPU goes per HSTU step: each thread's CPU time per step, one process.

The demo's model and data, the plain loop, torchrec's ``TrainPipelineSparseDist``
and aiopipe, interleaved over rounds.  Each thread's CPU time (user + system, from
``/proc/self/task/*/stat``) is sampled after the first steps and near the end, so
the set-up is left out; Python threads are named (``MainThread`` runs the event
loop under aiopipe, ``aiopipe-lane-*`` are the lanes), the others are torch's
OpenMP workers and gloo's threads.  Linux only.

    ./dev bench thread_cpu [--steps 300] [--repeats 2] [--configs none torchrec aiopipe]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import print_json, print_table, progress, spread, thread_cpu_s  # noqa: E402

from hstu_tasks import (  # noqa: E402
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    SyntheticHSTUData,
    build_training,
    init_distributed,
    quiet_torchrec,
)
from hstu_tasks.runners import PIPELINES, run_pipeline  # noqa: E402

SKIPPED = 20  # steps before the first sample (bootstrap, warm caches)
def measure(mode: str, steps: int) -> dict[str, float]:
    """Wall and per-thread-name CPU milliseconds per step of one run."""
    setup = build_training(ModelConfig(), DataConfig(), OptimizerConfig(), seed=0)
    data = SyntheticHSTUData(DataConfig(), steps, seed=0)
    batches = [data.batch(i) for i in range(steps)]
    marks: dict[str, tuple[float, dict[str, tuple[str, float]]]] = {}

    def on_step(step: int) -> None:
        if step == SKIPPED:
            marks["start"] = (time.perf_counter(), thread_cpu_s())
        elif step == steps - 5:
            marks["end"] = (time.perf_counter(), thread_cpu_s())

    run_pipeline(mode, setup, batches, on_step)  # type: ignore[arg-type]
    (t0, before), (t1, after) = marks["start"], marks["end"]
    counted = steps - 5 - SKIPPED
    per_name: collections.Counter[str] = collections.Counter()
    for tid, (name, cpu) in after.items():
        per_name[name] += cpu - before.get(tid, (name, 0.0))[1]
    result = {name: 1e3 * cpu / counted for name, cpu in per_name.items()}
    result["wall"] = 1e3 * (t1 - t0) / counted
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--configs", nargs="+", default=["none", "torchrec", "aiopipe"],
                        choices=PIPELINES, help="pipelines to compare")  # fmt: skip
    args = parser.parse_args()
    if args.steps <= SKIPPED + 10:
        parser.error(f"--steps must be above {SKIPPED + 10}")
    quiet_torchrec()
    init_distributed()
    samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.configs}
    for round_no in range(1, args.repeats + 1):
        for mode in args.configs:
            samples[mode].append(measure(mode, args.steps))
            progress(f"round {round_no}/{args.repeats}: {mode} "
                     f"{samples[mode][-1]['wall']:.2f} ms a step")  # fmt: skip
    rows = []
    for mode, runs in samples.items():
        names = sorted({n for run in runs for n in run} - {"wall"})
        walls = [run["wall"] for run in runs]
        cpu = [sum(v for n, v in run.items() if n != "wall") for run in runs]
        threads = ", ".join(
            f"{n} {statistics.median(run.get(n, 0.0) for run in runs):.2f}" for n in names
        )
        rows.append([mode, f"{statistics.median(walls):.2f}", spread(walls),
                     f"{statistics.median(cpu):.2f}", threads])  # fmt: skip
    print_table(
        f"HSTU demo step, one process, {args.steps} steps, median of {args.repeats} rounds",
        ["pipeline", "wall ms/step", "spread", "CPU ms/step", "CPU ms/step by thread"],
        rows,
    )
    print_json("thread_cpu", {"args": vars(args), "samples": samples})


if __name__ == "__main__":
    main()
