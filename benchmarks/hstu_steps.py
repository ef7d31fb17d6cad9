"""Steps/s of the HSTU step: aiopipe vs torchrec's TrainPipelineSparseDist vs the
plain loop, side by side in one run (ranks on gloo, CPU by default).

Every configuration trains the same model on the same data; they are interleaved
over ``--repeats`` rounds and the median is reported.

    ./dev bench hstu_steps [--ranks 2] [--steps 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _common import print_json, print_table  # noqa: E402

from hstu_tasks import (  # noqa: E402
    HSTU_DIST_LANE_THREAD_MAP,
    DataConfig,
    KarmarkarKarpShuffler,
    ModelConfig,
    OptimizerConfig,
    SyntheticHSTUData,
    build_training,
    join_local_group,
    quiet_torchrec,
)
from hstu_tasks.runners import run_pipeline  # noqa: E402

CONFIGS = {
    "none": ("none", None),
    "torchrec": ("torchrec", None),
    "aiopipe": ("aiopipe", None),
    "aiopipe-prefetch": ("aiopipe-prefetch", None),
    "aiopipe, dist lane": ("aiopipe", HSTU_DIST_LANE_THREAD_MAP),
    "aiopipe-prefetch, dist lane": ("aiopipe-prefetch", HSTU_DIST_LANE_THREAD_MAP),
    "aiopipe + KK shuffler": ("aiopipe", "kk"),
}


def worker(rank: int, port: int, ranks: int, args: dict[str, Any], out: str) -> None:
    quiet_torchrec()
    join_local_group(rank, ranks, port)
    config = DataConfig(batch_size=args["batch_size"], max_history=args["max_history"],
                        length_distribution=args["lengths"])  # fmt: skip
    samples: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for repeat in range(args["repeats"] + 1):  # the first round warms up
        for name, (mode, thread_map) in CONFIGS.items():
            setup = build_training(ModelConfig(), config, OptimizerConfig(), seed=0)
            data = list(SyntheticHSTUData(config, args["steps"], seed=repeat, rank=rank))
            dist.barrier()
            if thread_map == "kk":  # balance the attention workload across ranks
                result = run_pipeline(mode, setup, data, shuffler=KarmarkarKarpShuffler())
            else:
                result = run_pipeline(mode, setup, data, thread_map=thread_map)  # type: ignore[arg-type]
            if repeat:
                samples[name].append(args["steps"] / result.seconds)
    if rank == 0:
        Path(out).write_text(json.dumps(samples))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-history", type=int, default=48)
    parser.add_argument("--lengths", choices=("uniform", "zipf"), default="uniform")
    args = vars(parser.parse_args())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.spawn(worker, args=(port, args["ranks"], args, out.name), nprocs=args["ranks"])
        samples = json.loads(Path(out.name).read_text())
    medians = {name: statistics.median(values) for name, values in samples.items()}
    rows = [[name, f"{rate:.2f}", f"{rate / medians['torchrec']:.3f}", f"{rate / medians['none']:.3f}"]
            for name, rate in medians.items()]  # fmt: skip
    print_table(
        f"HSTU step, {args['ranks']} ranks on gloo (CPU), {args['steps']} steps, "
        f"median of {args['repeats']}",
        ["pipeline", "steps / s", "x torchrec", "x plain loop"],
        rows,
    )
    print_json("hstu_steps", {"args": args, "steps_per_s": medians, "samples": samples})


if __name__ == "__main__":
    main()
