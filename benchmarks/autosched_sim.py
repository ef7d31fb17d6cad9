"""Simulated vs measured steady-state latency, on synthetic sleep workloads.

For each workload the task costs are profiled once (traced run under its first
thread map) and the engine overheads calibrated once; then every thread map is both
simulated from those costs and measured (median of ``--repeats`` runs).  The error
is (simulated - measured) / measured; the acceptance bar is 10 %.

    ./dev bench autosched_sim [--iterations 150] [--repeats 3] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import Table, print_json, progress, run_on, spread  # noqa: E402
from _sleep_workloads import WORKLOADS, measure_ms, profile  # noqa: E402

from aiopipe.autosched import calibrate_engine, simulate  # noqa: E402
from aiopipe._core.loops import new_event_loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every sleep")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append")
    args = parser.parse_args()
    progress("calibrating the engine's overheads")
    engine = run_on(new_event_loop, calibrate_engine())
    names = args.workload or list(WORKLOADS)
    workloads = {name: WORKLOADS[name](args.scale) for name in names}
    table = Table(
        f"simulated vs measured ms per progress, measured: median of {args.repeats} runs "
        f"(engine: progress {engine.progress_ms} ms, task {engine.task_ms} ms, hand-off "
        f"{engine.handoff_ms} ms)",
        ["workload", "thread map", "simulated", "measured", "spread", "error"],
        [max(map(len, names)), max(len(m) for w in workloads.values() for m in w.thread_maps)],
    )
    results = []
    for name, workload in workloads.items():
        progress(f"{name}: profiling the task costs")
        first_map = next(iter(workload.thread_maps.values()))
        costs = profile(workload.schedule, first_map, engine)
        for label, thread_map in workload.thread_maps.items():
            progress(f"{name}: measuring thread map {label!r}")
            predicted = simulate(workload.schedule, costs, thread_map).steady_ms
            samples = measure_ms(workload.schedule, thread_map, args.iterations, args.repeats)
            measured = statistics.median(samples)
            error = (predicted - measured) / measured
            table.row(name, label, f"{predicted:.3f}", f"{measured:.3f}", spread(samples),
                      f"{error:+.1%}")  # fmt: skip
            results.append({"workload": name, "thread_map": label, "simulated_ms": predicted,
                            "measured_ms": measured, "samples_ms": samples,
                            "error": error})  # fmt: skip
    worst = max(abs(r["error"]) for r in results)
    print(f"worst error {worst:.1%}")
    print_json("autosched_sim", {"args": vars(args), "engine": asdict(engine),
                                 "worst_abs_error": worst, "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
