"""Steps/s of the HSTU step: aiopipe vs torchrec's pipeline vs the plain loop.

aiopipe, torchrec's TrainPipelineSparseDist and the plain loop run side by side in
one run (ranks on gloo, CPU by default).

Every configuration trains the same model on the same data, with torch DDP for the
dense part; they are interleaved over ``--repeats`` rounds and the median is
reported, with how busy the ranks kept the machine's cores (on CPU, ``1 / busy``
bounds what any schedule of the same work could gain).  On a CUDA machine each rank
takes one GPU (NCCL; ``--ranks`` at most the GPU count) and, when megatron-core is
installed, a row with Megatron DDP is added.
``--replicate-tables`` skips torchrec's sharding (for GPUs without fbgemm's CUDA
kernels): the model alone on the engine, without the torchrec row.
``--engine-time`` traces the aiopipe rows and gives the engine's host time per step
(``_common.engine_host_ms`` says how it is read from the spans) and its share of the
step; tracing costs a little per task, in those rows' steps/s too.

    ./dev bench hstu_steps [--ranks 2] [--steps 60] [--repeats 3] [--replicate-tables]
                           [--configs none torchrec aiopipe ...] [--engine-time]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
from contextlib import nullcontext
from pathlib import Path
from collections.abc import Callable
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import (  # noqa: E402
    add_hstu_arguments,
    engine_host_ms,
    print_json,
    print_table,
    progress,
    report_and_leave,
    spawn_ranks,
    spread,
    task_body_ms,
)

from stream_cost import torch_stream_context  # noqa: E402

from aiopipe import Tracer  # noqa: E402
from hstu_tasks import (  # noqa: E402
    HSTU_DIST_LANE_THREAD_MAP,
    HSTU_IO_LANE_THREAD_MAP,
    DataConfig,
    KarmarkarKarpShuffler,
    ModelConfig,
    OptimizerConfig,
    SyntheticHSTUData,
    build_training,
    join_local_group,
    quiet_torchrec,
)
from hstu_tasks.megatron import megatron_available  # noqa: E402
from hstu_tasks.runners import RunResult, run_pipeline  # noqa: E402


def on_the_loop(task: Any) -> str:
    """Every task inline on the event loop: no lane thread at all."""
    return "loop"


#: The plain loop on a thread of its own (by default on a GPU only: see its entry below).
ON_A_THREAD = "none, on a thread"
#: The row that asks for 20 steps a call (``progress_many``: the lanes chain them).
CHAINED = "aiopipe, 20 steps a call"
#: The default row with ``torch.cuda.stream(s)`` around each body (the engine's own
#: switch replaced it; ``stream_cost`` times both).
TORCH_STREAM = "aiopipe, torch.cuda.stream a task"
# name: (pipeline, thread map or "kk" for the shuffler, data parallel)
CONFIGS: dict[str, tuple[str, Any, str]] = {
    "none": ("none", None, "torch"),
    # The plain loop run by a thread of its own while the main thread waits: whether a
    # step's host work is slower off the main thread before any engine (a lane's floor).
    # On a CPU it also pays for a second OpenMP pool, which the engine releases before
    # its lanes compute (performance.md, "Compute on lane threads at full CPU speed").
    ON_A_THREAD: ("none", "thread", "torch"),
    "torchrec": ("torchrec", None, "torch"),
    "aiopipe": ("aiopipe", None, "torch"),
    "aiopipe-prefetch": ("aiopipe-prefetch", None, "torch"),
    "aiopipe, dist lane": ("aiopipe", HSTU_DIST_LANE_THREAD_MAP, "torch"),
    "aiopipe-prefetch, dist lane": ("aiopipe-prefetch", HSTU_DIST_LANE_THREAD_MAP, "torch"),
    "aiopipe + KK shuffler": ("aiopipe", "kk", "torch"),
    "aiopipe, io/compute lanes": ("aiopipe", HSTU_IO_LANE_THREAD_MAP, "torch"),
    "aiopipe, on the loop": ("aiopipe", on_the_loop, "torch"),
    CHAINED: ("aiopipe", None, "torch"),
    TORCH_STREAM: ("aiopipe", None, "torch"),
}
if torch.cuda.is_available() and megatron_available():
    CONFIGS["aiopipe, Megatron DDP"] = ("aiopipe", None, "megatron")


def on_a_thread(run: Callable[[], RunResult]) -> RunResult:
    """``run()`` on a new thread (the current CUDA device goes with it), waited for."""
    done: list[RunResult] = []
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def body() -> None:
        if device is not None:
            torch.cuda.set_device(device)
        done.append(run())

    thread = threading.Thread(target=body, name="plain-loop")
    thread.start()
    thread.join()
    if not done:
        raise RuntimeError("the plain loop on a thread failed (its traceback is above)")
    return done[0]


def worker(rank: int, port: int, ranks: int, args: dict[str, Any], out: str) -> None:
    quiet_torchrec()
    join_local_group(rank, ranks, port)  # on CUDA, also makes cuda:rank the current device
    config = DataConfig(batch_size=args["batch_size"], max_history=args["max_history"],
                        length_distribution=args["lengths"])  # fmt: skip
    chosen = {name: CONFIGS[name] for name in args["configs"]}
    samples: dict[str, list[float]] = {name: [] for name in chosen}
    busy: dict[str, list[float]] = {name: [] for name in chosen}
    engine: dict[str, list[list[float]]] = {}  # name: [engine ms, step ms] per round
    bodies: dict[str, list[dict[str, float]]] = {}  # name: {task: body ms a step} per round
    for repeat in range(args["repeats"] + 1):  # the first round warms up
        round_name = f"round {repeat}/{args['repeats']}" + (" (warm-up)" if not repeat else "")
        for name, (mode, thread_map, data_parallel) in chosen.items():
            if mode == "torchrec" and args["replicate_tables"]:
                continue  # torchrec's pipeline needs sharded tables
            setup = build_training(ModelConfig(), config, OptimizerConfig(), seed=0,
                                   data_parallel=data_parallel,  # type: ignore[arg-type]
                                   shard_embeddings=not args["replicate_tables"])  # fmt: skip
            data = list(SyntheticHSTUData(config, args["steps"], seed=repeat, rank=rank))
            tracer = Tracer() if args["engine_time"] and mode.startswith("aiopipe") else None
            dist.barrier()
            if thread_map == "kk":  # balance the attention workload across ranks
                result = run_pipeline(mode, setup, data, shuffler=KarmarkarKarpShuffler(),
                                      tracer=tracer)  # fmt: skip
            elif thread_map == "thread":
                result = on_a_thread(lambda: run_pipeline(mode, setup, data))
            else:
                chained = 20 if name == CHAINED else 1
                with torch_stream_context() if name == TORCH_STREAM else nullcontext():
                    result = run_pipeline(
                        mode, setup, data, thread_map=thread_map,  # type: ignore[arg-type]
                        tracer=tracer, steps_per_call=chained,
                    )  # fmt: skip
            rate = args["steps"] / result.seconds
            cores_busy = machine_busy(result.seconds, result.cpu_seconds)
            if repeat:
                samples[name].append(rate)
                busy[name].append(cores_busy)
                if tracer is not None:
                    engine.setdefault(name, []).append(list(engine_host_ms(tracer.spans)))
                    bodies.setdefault(name, []).append(task_body_ms(tracer.spans))
            if rank == 0:
                progress(f"{round_name}: {name} {rate:.2f} steps/s")
    report_and_leave(rank, out, {"steps_per_s": samples, "busy": busy, "engine": engine,
                                 "bodies": bodies})  # fmt: skip


def machine_busy(seconds: float, cpu_seconds: float) -> float:
    """The share of this machine's cores the ranks kept busy over a run: every rank's
    CPU time (all its threads) over wall time x cores.  A schedule that does the same
    work can run at most ``1 / busy`` times faster."""
    # NCCL reduces device tensors only; gloo takes host tensors.
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    totals = torch.tensor([cpu_seconds, seconds], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    mean_wall = float(totals[1]) / dist.get_world_size()
    return float(totals[0]) / (mean_wall * len(os.sched_getaffinity(0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_hstu_arguments(parser)
    parser.add_argument("--lengths", choices=("uniform", "zipf"), default="uniform")
    parser.add_argument("--replicate-tables", action="store_true",
                        help="no torchrec sharding (and no torchrec row)")
    default = [name for name in CONFIGS
               if name not in (ON_A_THREAD, TORCH_STREAM) or torch.cuda.is_available()]
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=default, metavar="NAME",
                        help=f"rows to run, of {list(CONFIGS)} (default: all, "
                             f"{ON_A_THREAD!r} and {TORCH_STREAM!r} on a GPU only)")  # fmt: skip
    parser.add_argument("--engine-time", action="store_true",
                        help="trace the aiopipe rows: the engine's host time per step")
    args = vars(parser.parse_args())
    if "none" not in args["configs"]:
        args["configs"].insert(0, "none")  # every ratio is also given against the plain loop
    if torch.cuda.is_available() and args["ranks"] > torch.cuda.device_count():
        parser.error(f"--ranks {args['ranks']}: this machine has "
                     f"{torch.cuda.device_count()} GPU(s), one per rank")  # fmt: skip
    report = spawn_ranks(worker, args)
    samples, busy = report["steps_per_s"], report["busy"]
    medians = {name: statistics.median(values) for name, values in samples.items() if values}
    torchrec = medians.get("torchrec")

    rows = [[name, f"{rate:.2f}", spread(samples[name]),
             f"{rate / torchrec:.3f}" if torchrec else "--",
             f"{rate / medians['none']:.3f}", f"{statistics.median(busy[name]):.0%}"]
            for name, rate in medians.items()]  # fmt: skip
    tables = "replicated tables" if args["replicate_tables"] else "sharded tables"
    print_table(
        f"HSTU step, {args['ranks']} ranks on "
        f"{'NCCL (GPU)' if torch.cuda.is_available() else 'gloo (CPU)'}, {tables}, "
        f"{args['steps']} steps, median of {args['repeats']} rounds (spread: half their range)",
        ["pipeline", "steps / s", "spread", "x torchrec", "x plain loop", "cores busy"],
        rows,
    )
    print(f"cores busy: every rank's CPU time over wall time x {len(os.sched_getaffinity(0))} "
          "cores")
    if not torch.cuda.is_available():  # on CPU the cores bound every schedule
        baseline = "torchrec" if torchrec else "none"
        print(f"the same work can run at most {1 / statistics.median(busy[baseline]):.2f}x "
              f"as fast as {baseline} on these cores")  # fmt: skip
    payload = {"args": args, "steps_per_s": medians, "samples": samples, "busy": busy}
    if report["engine"]:
        payload.update(engine_report(report["engine"]))
        payload["bodies_ms"] = bodies_report(report["bodies"], 1e3 / medians["none"])
    print_json("hstu_steps", payload)


def engine_report(engine: dict[str, list[list[float]]]) -> dict[str, Any]:
    """Print the engine's host time per step of each traced row; the JSON fields of
    the row where it is the largest share of the step (the figure held to a target)."""
    shares = {}
    for name, rounds in engine.items():
        host, step = (statistics.median(r[i] for r in rounds) for i in (0, 1))
        shares[name] = (host / step, host, step)
        print(f"engine host time per step, {name}: {host:.3f} ms of {step:.3f} ms "
              f"({host / step:.2%}; tracer, median of {len(rounds)} rounds)")  # fmt: skip
    worst = max(shares, key=lambda name: shares[name][0])
    share, host, step = shares[worst]
    return {"engine_host": {name: list(value) for name, value in shares.items()},
            "engine_row": worst, "engine_share": share, "engine_host_ms": host,
            "engine_step_ms": step}  # fmt: skip


def bodies_report(bodies: dict[str, list[dict[str, float]]], plain_ms: float
                  ) -> dict[str, dict[str, float]]:  # fmt: skip
    """Print each traced row's task bodies per step (medians of the rounds) beside the
    plain loop's whole step: how much of a row's step its tasks' own work is."""
    medians = {}
    for name, rounds in bodies.items():
        tasks = {task: statistics.median(r.get(task, 0.0) for r in rounds) for task in rounds[0]}
        medians[name] = tasks
        listed = ", ".join(f"{task} {ms:.3f}" for task, ms in
                           sorted(tasks.items(), key=lambda item: -item[1]))  # fmt: skip
        print(f"task bodies per step, {name}: {sum(tasks.values()):.3f} ms (the plain loop's "
              f"whole step: {plain_ms:.3f} ms): {listed}")  # fmt: skip
    return medians


if __name__ == "__main__":
    main()
