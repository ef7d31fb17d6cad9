"""The joint search's pick vs the default thread map, predicted and measured.

The HSTU-shaped sleep workload (fourteen tasks, input distribution and prefetch as
GIL-free waits) is profiled under the default io/compute thread map; the search
then picks thread map, streams, fire order and lookaheads with forward, backward,
finalize_model_grads and optimizer_step frozen (default stream, lookahead 0),
``max_threads`` 4 and ``max_in_flight`` 5.  Both schedules are then measured,
interleaved over ``--repeats`` rounds.  Gain = 1 - pick / default latency.

    ./dev bench autosched_search [--iterations 150] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import (  # noqa: E402
    print_json,
    print_table,
    progress,
    run_on,
    spread,
)
from _sleep_workloads import HSTU_FROZEN, hstu, predict_and_measure, profile  # noqa: E402
from hstu_shape import IO_COMPUTE_THREAD_MAP  # noqa: E402

from aiopipe.autosched import calibrate_engine, joint_search  # noqa: E402
from aiopipe._core.loops import new_event_loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every sleep")
    args = parser.parse_args()
    workload = hstu(args.scale)
    progress("calibrating the engine's overheads, profiling the task costs")
    engine = run_on(new_event_loop, calibrate_engine())
    costs = profile(workload.schedule, IO_COMPUTE_THREAD_MAP, engine)
    progress("searching")
    started = time.perf_counter()
    result = joint_search(
        workload.schedule, costs, thread_map=IO_COMPUTE_THREAD_MAP, frozen=HSTU_FROZEN,
        presets={"io/compute": IO_COMPUTE_THREAD_MAP}, max_threads=4, max_in_flight=5,
    )  # fmt: skip
    search_s = time.perf_counter() - started
    configs = {
        "default (io/compute)": (workload.schedule, IO_COMPUTE_THREAD_MAP),
        "search pick": (result.schedule, result.thread_map),
    }
    progress(f"search done in {search_s:.1f} s; measuring the default and the pick")
    predicted, samples, measured = predict_and_measure(configs, costs, args.iterations,
                                                       args.repeats)  # fmt: skip
    base, pick = "default (io/compute)", "search pick"
    predicted_gain = 1 - predicted[pick] / predicted[base]
    measured_gain = 1 - measured[pick] / measured[base]
    gain_error = (measured_gain - predicted_gain) / predicted_gain
    rows = [[name, f"{predicted[name]:.3f}", f"{measured[name]:.3f}", spread(samples[name]),
             f"{(predicted[name] - measured[name]) / measured[name]:+.1%}"]
            for name in configs]  # fmt: skip
    print_table(
        f"HSTU-shaped sleep workload, ms per progress, median of {args.repeats} rounds "
        f"(search: {result.evaluated} candidates in {search_s:.1f} s, {result.rounds} rounds)",
        ["schedule", "simulated", "measured", "spread", "sim error"],
        rows,
    )
    print_table(
        "gain of the pick over the default thread map",
        ["predicted gain", "measured gain", "measured vs predicted"],
        [[f"{predicted_gain:.1%}", f"{measured_gain:.1%}", f"{gain_error:+.1%}"]],
    )
    best = result.best
    print("\npick:", best.note)
    print("  thread map:", {k: v for k, v in best.thread_map})
    print("  fire order:", list(best.fire_order))
    changed = {k: v for k, v in best.lookaheads if workload.schedule.task(k).lookahead != v}
    print("  lookaheads changed:", changed or "none")
    moved = {k: v for k, v in best.streams if workload.schedule.task(k).stream != v}
    print("  streams changed:", moved or "none")
    print_json("autosched_search", {
        "args": vars(args), "predicted_ms": predicted, "measured_ms": measured,
        "samples_ms": samples, "predicted_gain": predicted_gain, "measured_gain": measured_gain,
        "gain_relative_error": gain_error, "search_seconds": search_s, "search": result.to_dict(),
    })  # fmt: skip


if __name__ == "__main__":
    main()
