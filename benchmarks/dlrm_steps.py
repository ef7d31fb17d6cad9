"""Steps/s of torchrec's DLRM: SparseDistPipeline vs torchrec's class vs the plain loop.

hstu_tasks.SparseDistPipeline on each ``--schedules`` member (sparse-dist by default;
lite, base, fused, semi-sync, pt2), torchrec's own class for that member and the plain
loop side by side, on 1 and 2 ranks (gloo on CPU, NCCL with one GPU per rank).

All train the same model on the same data, interleaved over ``--repeats`` rounds
after a warm-up round; the median and the spread of the rounds are reported, and
each aiopipe row is compared with torchrec's class for its schedule.
``--ends-apart`` adds the sparse-dist row with ``end_together=False``: what the
per-batch agreement on the end of the epoch costs (on by default with two ranks).

    ./dev bench dlrm_steps [--ranks 1 2] [--steps 100] [--repeats 3] [--batch-size 256]
                           [--schedules sparse-dist lite base fused semi-sync pt2]
                           [--ends-apart]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import print_json, print_table, report_and_leave, spawn_ranks  # noqa: E402

from hstu_tasks import DLRMConfig, SyntheticDLRMData, build_dlrm_training  # noqa: E402
from hstu_tasks import join_local_group, quiet_torchrec  # noqa: E402
from hstu_tasks.parallel import default_device  # noqa: E402
from hstu_tasks.sparse.dlrm_runs import DLRMMode, run_dlrm  # noqa: E402
from hstu_tasks.sparse.schedules import TRAIN_SCHEDULES  # noqa: E402


def modes(schedule: str) -> tuple[DLRMMode, DLRMMode]:
    """aiopipe's and torchrec's run of ``schedule`` (sparse-dist under today's names)."""
    if schedule == "sparse-dist":
        return "aiopipe", "torchrec"
    return f"aiopipe-{schedule}", f"torchrec-{schedule}"  # type: ignore[return-value]


#: The sparse-dist row with end_together=False (``--ends-apart``).
ENDS_APART = "aiopipe, ends apart"


def worker(rank: int, port: int, ranks: int, args: dict[str, Any], out: str) -> None:
    quiet_torchrec()
    join_local_group(rank, ranks, port)
    config = DLRMConfig(batch_size=args["batch_size"], num_embeddings=args["num_embeddings"])
    runs: list[str] = [mode for name in args["schedules"] for mode in modes(name)]
    runs.append("none")
    if args["ends_apart"]:
        runs.append(ENDS_APART)
    samples: dict[str, list[float]] = {mode: [] for mode in runs}
    for repeat in range(args["repeats"] + 1):  # the first round warms up
        for mode in runs:
            setup = build_dlrm_training(config, "sgd", seed=0, device=default_device())
            data = list(SyntheticDLRMData(config, args["steps"], seed=repeat, rank=rank))
            dist.barrier()
            if mode == ENDS_APART:
                seconds = run_dlrm("aiopipe", setup, [data], end_together=False).seconds
            else:
                seconds = run_dlrm(mode, setup, [data]).seconds  # type: ignore[arg-type]
            if repeat:
                samples[mode].append(args["steps"] / seconds)
    report_and_leave(rank, out, samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-embeddings", type=int, default=10_000)
    parser.add_argument("--schedules", nargs="+", choices=tuple(TRAIN_SCHEDULES),
                        default=["sparse-dist"], help="aiopipe's schedules to time, each "
                        "beside torchrec's class for it")  # fmt: skip
    parser.add_argument("--ends-apart", action="store_true",
                        help="add the sparse-dist row with end_together=False")
    args = vars(parser.parse_args())
    # each row's torchrec counterpart: its own schedule's class (the plain loop: the first's)
    partner = {mode: modes(name)[1] for name in args["schedules"] for mode in modes(name)}
    partner["none"] = modes(args["schedules"][0])[1]
    partner[ENDS_APART] = "torchrec"
    rows, report = [], {}
    for ranks in args["ranks"]:
        samples = spawn_ranks(worker, {**args, "ranks": ranks})
        medians = {mode: statistics.median(values) for mode, values in samples.items()}
        report[ranks] = {"steps_per_s": medians, "samples": samples}
        for mode, rate in medians.items():
            spread = 50 * (max(samples[mode]) - min(samples[mode])) / rate
            rows.append([ranks, mode, f"{rate:.1f}", f"+-{spread:.0f}%",
                         f"{rate / medians[partner[mode]]:.3f}",
                         f"{rate / medians['none']:.3f}"])  # fmt: skip
    backend = "NCCL (GPU)" if torch.cuda.is_available() else "gloo (CPU)"
    print_table(
        f"DLRM step on {backend}, batch {args['batch_size']} per rank, {args['steps']} steps, "
        f"median of {args['repeats']}",
        ["ranks", "pipeline", "steps / s", "rounds", "x torchrec", "x plain loop"], rows,
    )  # fmt: skip
    print_json("dlrm_steps", {"args": args, "ranks": report})


if __name__ == "__main__":
    main()
