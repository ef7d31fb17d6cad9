"""Engine overhead per task on a 14-task HSTU-shaped schedule of no-op bodies.

Side by side in one run: AsyncExecutor with io/compute lanes (one progress() per
step, and 100 steps asked for a call with progress_many), AsyncExecutor with every
task on the "loop" lane (asyncio and uvloop), the lanes with tracing on,
SequentialExecutor, and the
specification's threaded design (ThreadPoolExecutor + threading.Event per task +
Condition ticket lock) as a plug-in baseline.

    ./dev bench engine_overhead [--iterations 3000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import uvloop  # noqa: E402
from _common import (  # noqa: E402
    interleaved_rounds,
    print_json,
    print_table,
    run_on,
    time_progress,
    with_spread,
)
from hstu_shape import IO_COMPUTE_THREAD_MAP, HSTU_TASKS, hstu_schedule, noop  # noqa: E402
from threaded_baseline import ThreadedExecutor  # noqa: E402

from aiopipe import AsyncExecutor, SchedulablePipeline  # noqa: E402


#: The io/compute lanes asked for 100 steps a call (``progress_many``: the lanes chain them).
CHAINED = "async io/compute lanes, 100 steps a call"
CONFIGS = {
    "threaded baseline (io/compute)": lambda: ThreadedExecutor(IO_COMPUTE_THREAD_MAP),
    "async io/compute lanes": lambda: AsyncExecutor(IO_COMPUTE_THREAD_MAP),
    "async io/compute lanes, traced": lambda: AsyncExecutor(IO_COMPUTE_THREAD_MAP),
    CHAINED: lambda: AsyncExecutor(IO_COMPUTE_THREAD_MAP),
    "async all on 'loop'": lambda: AsyncExecutor(lambda task: "loop"),
    "sequential": lambda: "sequential",
}
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def measure(config: str, loop: str, iterations: int) -> float:
    pipe = SchedulablePipeline(
        hstu_schedule(lambda name: noop), executor=CONFIGS[config](), trace=config.endswith("traced")
    )
    try:
        steps_per_call = 100 if config == CHAINED else 1
        return run_on(LOOPS[loop], time_progress(pipe, iterations, steps_per_call=steps_per_call))
    finally:
        pipe.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tasks = len(HSTU_TASKS)
    samples = interleaved_rounds(
        {(config, loop): lambda c=config, lp=loop: measure(c, lp, args.iterations)
         for loop in LOOPS for config in CONFIGS},
        args.repeats, show=lambda s: f"{s * 1e6 / tasks:.2f}",
    )  # fmt: skip
    per_task = {key: [s * 1e6 / tasks for s in seconds] for key, seconds in samples.items()}
    results: dict[str, dict[str, float]] = {}
    for (config, loop), us in per_task.items():
        results.setdefault(config, {})[loop] = statistics.median(us)
    baseline = results["threaded baseline (io/compute)"]
    rows = [
        [config, with_spread(per_task[(config, "asyncio")], 2),
         with_spread(per_task[(config, "uvloop")], 2),
         f"{per['asyncio'] / baseline['asyncio']:.2f}", f"{per['uvloop'] / baseline['uvloop']:.2f}"]
        for config, per in results.items()
    ]  # fmt: skip
    print_table(
        f"engine overhead, {tasks} no-op tasks, median of {args.repeats} rounds x "
        f"{args.iterations} progresses (us per task, +- half the range of the rounds)",
        ["executor", "asyncio", "uvloop", "x baseline (asyncio)", "x baseline (uvloop)"],
        rows,
    )
    print_json("engine_overhead", {"us_per_task": results, "tasks": tasks})


if __name__ == "__main__":
    main()
