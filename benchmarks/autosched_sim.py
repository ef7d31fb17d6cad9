"""Simulated vs measured steady-state latency, on synthetic sleep workloads.

For each workload the task costs are profiled once (traced run under its first
thread map) and the engine overheads calibrated once; then every thread map is both
simulated from those costs and measured (median of ``--repeats`` runs).  The error
is (simulated - measured) / measured; the acceptance bar is 10 %.

    ./dev bench autosched_sim [--iterations 150] [--repeats 3] [--scale 1.0]
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import print_json, print_table, run_on  # noqa: E402
from _sleep_workloads import WORKLOADS, measure_ms, profile  # noqa: E402

from aiopipe.autosched import calibrate_engine, simulate  # noqa: E402
from aiopipe.runner import new_event_loop  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every sleep")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append")
    args = parser.parse_args()
    engine = run_on(new_event_loop, calibrate_engine())
    rows, results = [], []
    for name in args.workload or WORKLOADS:
        workload = WORKLOADS[name](args.scale)
        first_map = next(iter(workload.thread_maps.values()))
        costs = profile(workload.schedule, first_map, engine)
        for label, thread_map in workload.thread_maps.items():
            predicted = simulate(workload.schedule, costs, thread_map).steady_ms
            measured = measure_ms(workload.schedule, thread_map, args.iterations, args.repeats)
            error = (predicted - measured) / measured
            rows.append([name, label, f"{predicted:.3f}", f"{measured:.3f}", f"{error:+.1%}"])
            results.append({"workload": name, "thread_map": label, "simulated_ms": predicted,
                            "measured_ms": measured, "error": error})  # fmt: skip
    worst = max(abs(r["error"]) for r in results)
    print_table(
        f"simulated vs measured ms per progress (engine: progress {engine.progress_ms} ms, "
        f"task {engine.task_ms} ms, hand-off {engine.handoff_ms} ms); worst error {worst:.1%}",
        ["workload", "thread map", "simulated", "measured", "error"],
        rows,
    )
    print_json("autosched_sim", {"args": vars(args), "engine": asdict(engine),
                                 "worst_abs_error": worst, "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
