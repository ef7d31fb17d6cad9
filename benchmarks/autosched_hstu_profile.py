"""Profile the HSTU step on CPU (ranks on gloo) and ask the planner about it.

Each rank trains ``--steps`` batches with aiopipe under the default thread map,
tracing every task; rank 0's spans (the first iterations skipped) become the cost
model, with the engine overheads calibrated on this machine, written to
``--output`` (shipped as examples/costs/hstu_cpu.json).  The joint search then plans
the fourteen-task schedule from it -- forward, backward, finalize_model_grads and
optimizer_step frozen, at most 4 lane threads and 5 batches in flight -- and the plan
is written next to the profile.  With ``--measure`` the default thread map and the
pick's thread map are both timed (the HSTU pipeline builds its own schedule, so only
the lane part of a pick can be applied to it unchanged).  On a GPU, ``--gpu-timing``
adds each task's device time (``Tracer(gpu_timing=True)``) and ``--replicate-tables``
leaves the tables unsharded (for machines without fbgemm's CUDA kernels); the dense
part uses torch DDP either way, as the planned schedule declares.

    ./dev bench autosched_hstu_profile [--ranks 2] [--steps 60] [--measure]
                                       [--gpu-timing] [--replicate-tables] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import (  # noqa: E402
    add_hstu_arguments,
    print_json,
    print_table,
    progress,
    report_and_leave,
    spawn_ranks,
    spread,
)

from aiopipe import Schedule, Tracer  # noqa: E402
from aiopipe.autosched import CostModel, CostProfiler, calibrate_engine, joint_search  # noqa: E402
from aiopipe.autosched import simulate  # noqa: E402
from aiopipe.autosched.cli import format_plan, report  # noqa: E402
from aiopipe.runner import run
from hstu_tasks import (  # noqa: E402
    HSTU_DEFAULT_THREAD_MAP,
    HSTU_DIST_LANE_THREAD_MAP,
    HSTU_IO_LANE_THREAD_MAP,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    SyntheticHSTUData,
    build_training,
    join_local_group,
    quiet_torchrec,
)
from hstu_tasks.runners import run_pipeline  # noqa: E402
from hstu_tasks.shuffler import IdentityShuffler  # noqa: E402
from hstu_tasks.sparse.model import STREAMS  # noqa: E402
from hstu_tasks.tasks import PipelineState, build_tasks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FROZEN = ("forward", "backward", "finalize_model_grads", "optimizer_step")
SKIP_ITERATIONS = 5  # bootstrap, first allocations, torchrec's lazy set-up


def hstu_schedule() -> Schedule:
    """The HSTU step's declarations with torch DDP (bodies are never run here: an
    empty module stands in for the model)."""
    nothing: Any = None
    state = PipelineState(model=torch.nn.Module(), optimizer=nothing,
                          device=torch.device("cpu"), shuffler=IdentityShuffler())  # fmt: skip
    return Schedule.of(build_tasks(state), stream_slots=STREAMS)


def steady_ms_per_step(setup: Any, data: list[Any], **options: Any) -> float:
    """Median interval between successive steps, the first ``SKIP_ITERATIONS`` left
    out (the bootstrap traces the model and starts the first batches)."""
    stamps: list[float] = []
    run_pipeline("aiopipe", setup, data, on_step=lambda step: stamps.append(time.perf_counter()),
                 **options)  # fmt: skip
    steady = stamps[SKIP_ITERATIONS:]
    return statistics.median(b - a for a, b in zip(steady, steady[1:])) * 1e3


def worker(rank: int, port: int, ranks: int, args: dict[str, Any], out: str) -> None:
    quiet_torchrec()
    join_local_group(rank, ranks, port)
    config = DataConfig(batch_size=args["batch_size"], max_history=args["max_history"])
    payload: dict[str, Any] = {}
    setup = build_training(ModelConfig(), config, OptimizerConfig(), seed=0, data_parallel="torch",
                           shard_embeddings=not args["replicate_tables"])  # fmt: skip
    data = list(SyntheticHSTUData(config, args["steps"], seed=0, rank=rank))
    tracer = Tracer(gpu_timing=args["gpu_timing"])
    dist.barrier()
    payload["profiled_ms_per_step"] = steady_ms_per_step(setup, data, tracer=tracer)
    profiler = CostProfiler(skip_iterations=SKIP_ITERATIONS)
    profiler.add_tracer(tracer)
    payload["costs"] = profiler.cost_model().to_dict()
    maps = {"default": HSTU_DEFAULT_THREAD_MAP, "pick": args.get("pick_map")}
    if args["measure"] and maps["pick"]:
        times: dict[str, list[float]] = {name: [] for name in maps}
        for repeat in range(args["repeats"] + 1):  # the first round warms up
            for name, thread_map in maps.items():
                setup = build_training(ModelConfig(), config, OptimizerConfig(), seed=0,
                                       data_parallel="torch",
                                       shard_embeddings=not args["replicate_tables"])  # fmt: skip
                dist.barrier()
                ms = steady_ms_per_step(setup, data, thread_map=thread_map)
                if repeat:
                    times[name].append(ms)
                if rank == 0:
                    progress(f"round {repeat}/{args['repeats']}"
                             f"{' (warm-up)' if not repeat else ''}: {name} {ms:.3f} ms/step")
        payload["measured_ms_per_step"] = times
    report_and_leave(rank, out, payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_hstu_arguments(parser)
    parser.add_argument("--output", default=str(ROOT / "examples" / "costs" / "hstu_cpu.json"))
    parser.add_argument("--costs", help="plan from this profile instead of profiling again")
    parser.add_argument("--measure", action="store_true",
                        help="time the default and the pick's thread map")  # fmt: skip
    parser.add_argument("--gpu-timing", action="store_true",
                        help="also each task's device time (Tracer(gpu_timing=True); a GPU)")
    parser.add_argument("--replicate-tables", action="store_true",
                        help="no torchrec sharding (for GPUs without fbgemm's CUDA kernels)")
    args = vars(parser.parse_args())
    if args["steps"] <= SKIP_ITERATIONS + 1:
        parser.error(f"--steps must be above {SKIP_ITERATIONS + 1}: the first "
                     f"{SKIP_ITERATIONS} steps are left out of the timings")  # fmt: skip
    schedule = hstu_schedule()
    if args["costs"]:
        costs = CostModel.load(args["costs"])
    else:
        progress(f"profiling {args['steps']} steps on {args['ranks']} ranks")
        profiled = spawn_ranks(worker, {**args, "measure": False})
        engine = run(calibrate_engine())
        meta = {"workload": "HSTU ranking step, aiopipe default thread map",
                "device": "cuda" if torch.cuda.is_available() else "cpu",
                "gpu_timing": args["gpu_timing"], "replicated_tables": args["replicate_tables"],
                "ranks": args["ranks"], "steps": args["steps"],
                "batch_size": args["batch_size"], "max_history": args["max_history"],
                "skipped_iterations": SKIP_ITERATIONS, "torch": torch.__version__,
                "measured_ms_per_step": round(profiled["profiled_ms_per_step"], 3)}  # fmt: skip
        costs = CostModel.from_dict(profiled["costs"]).with_engine(engine)
        costs = CostModel(costs.tasks, costs.engine, meta)
        costs.save(args["output"])
        print(f"cost profile written to {args['output']}")
    progress("searching")
    result = joint_search(schedule, costs, thread_map=HSTU_DEFAULT_THREAD_MAP, frozen=FROZEN,
                          presets={"io lane": HSTU_IO_LANE_THREAD_MAP,
                                   "dist lane": HSTU_DIST_LANE_THREAD_MAP},
                          max_threads=4, max_in_flight=5)  # fmt: skip
    print(format_plan(result, costs))
    plan = report(result, costs)
    profile = Path(args["costs"] or args["output"])
    plan_path = profile.with_name(f"{profile.stem}_plan.json")
    plan_path.write_text(json.dumps(plan, indent=2) + "\n")
    payload: dict[str, Any] = {"plan": plan}
    if args["measure"]:
        pick_map = result.thread_map
        lanes_only = simulate(schedule, costs, pick_map).steady_ms
        progress("measuring the default and the pick's thread map")
        measured = spawn_ranks(worker, {**args, "measure": True, "pick_map": pick_map})
        measured = measured["measured_ms_per_step"]
        rows = []
        predicted = {"default": result.baseline.score, "pick": lanes_only}
        for name, values in measured.items():
            median = statistics.median(values)
            rows.append([name, f"{predicted[name]:.3f}", f"{median:.3f}", spread(values),
                         f"{(predicted[name] - median) / median:+.1%}"])  # fmt: skip
        print_table("HSTU step on CPU: thread map only (declared lookaheads, streams, order), "
                    f"median of {args['repeats']} rounds",
                    ["thread map", "simulated ms", "measured ms / step", "spread", "sim error"],
                    rows)  # fmt: skip
        payload["measured_ms_per_step"] = measured
        payload["simulated_ms"] = predicted
    print_json("autosched_hstu_profile", payload)


if __name__ == "__main__":
    main()
