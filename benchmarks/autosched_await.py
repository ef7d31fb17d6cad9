"""`aiopipe plan` on an async fetch that awaits: predicted against measured.

The schedule is ``examples/schedules.py:async_fetch`` (issue #32): an ``async def``
fetch one batch ahead awaiting ``--fetch-ms`` and a synchronous training step of
``--train-ms`` of CPU work, both on the default stream.  It is profiled (the tracer
keeps the fetch's awaits apart from its host time), the search picks a plan, and
three configurations are measured side by side, interleaved over ``--repeats``
rounds: the schedule as declared, everything on the event loop (what the planner
proposed when awaits counted as host time) and the pick.

    ./dev bench autosched_await [--iterations 150] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

from _common import print_json, print_table, progress, run_on, spread  # noqa: E402
from _sleep_workloads import predict_and_measure  # noqa: E402
from schedules import async_fetch  # noqa: E402

from aiopipe import SerializedAwaitWarning  # noqa: E402
from aiopipe._core.loops import new_event_loop  # noqa: E402
from aiopipe.autosched import (  # noqa: E402
    CostModel, calibrate_engine, joint_search, profile_schedule,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fetch-ms", type=float, default=5.0)
    parser.add_argument("--train-ms", type=float, default=5.0)
    parser.add_argument("--profile-batches", type=int, default=60)
    args = parser.parse_args()
    warnings.simplefilter("ignore", SerializedAwaitWarning)  # the point of the schedule
    schedule = async_fetch(args.fetch_ms, args.train_ms)
    progress("calibrating the engine's overheads, profiling the task costs")

    async def measure_costs() -> CostModel:
        engine = await calibrate_engine()
        return await profile_schedule(schedule, batches=args.profile_batches, engine=engine)

    costs = run_on(new_event_loop, measure_costs())
    result = joint_search(schedule, costs)
    configs = {
        "as declared (by_stream)": (schedule, "by_stream"),
        "everything on the loop": (schedule, {"fetch": "loop", "train": "loop"}),
        "plan's pick": (result.schedule, result.thread_map),
    }
    progress(f"pick: {result.best.note}; measuring")
    predicted, samples, measured = predict_and_measure(configs, costs, args.iterations,
                                                       args.repeats)  # fmt: skip
    fetch, train = costs.of("fetch"), costs.of("train")
    print_table(
        f"async fetch ({fetch.host_ms:.3f} ms host + {fetch.await_ms:.3f} ms awaited) and "
        f"train ({train.host_ms:.3f} ms host): ms per progress, median of {args.repeats} rounds",
        ["configuration", "simulated", "measured", "spread", "sim error"],
        [[name, f"{predicted[name]:.3f}", f"{measured[name]:.3f}", spread(samples[name]),
          f"{(predicted[name] - measured[name]) / measured[name]:+.1%}"]
         for name in configs],
    )  # fmt: skip
    print(f"\npick: {result.best.note}")
    print("  thread map:", result.thread_map)
    print("  streams:", dict(result.best.streams))
    print_json("autosched_await", {
        "args": vars(args), "predicted_ms": predicted, "measured_ms": measured,
        "samples_ms": samples, "costs": costs.to_dict()["tasks"], "search": result.to_dict(),
    })  # fmt: skip


if __name__ == "__main__":
    main()
