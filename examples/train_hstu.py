"""Train the HSTU ranking model with aiopipe (or torchrec's pipeline, or a plain loop).

One CPU process by default; ``torchrun --nproc-per-node 2 examples/train_hstu.py``
for two ranks on gloo.  Every pipeline trains the same model on the same data, so
their losses and final parameters can be compared (``--json``).

    python examples/train_hstu.py --steps 40 --pipeline aiopipe --json run.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch.distributed as dist
from tqdm import tqdm

from aiopipe import Tracer
from hstu_tasks import DataConfig, ModelConfig, OptimizerConfig, SyntheticHSTUData
from hstu_tasks import build_training, init_distributed, quiet_torchrec
from hstu_tasks.runners import PIPELINES, parameter_checksum, run_pipeline


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="batches per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pipeline", choices=PIPELINES, default="aiopipe")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-history", type=int, default=48)
    parser.add_argument("--lengths", choices=("uniform", "zipf"), default="uniform")
    parser.add_argument("--json", metavar="PATH", help="write losses, checksum and speed here")
    parser.add_argument("--trace", metavar="PATH",
                        help="write a Chrome/Perfetto timeline of the aiopipe tasks here "
                             "(one file per rank: PATH gets a .rankN suffix when world > 1)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    quiet_torchrec()
    rank, world = init_distributed()
    data_config = DataConfig(
        batch_size=args.batch_size, max_history=args.max_history,
        length_distribution=args.lengths,
    )  # fmt: skip
    setup = build_training(ModelConfig(), data_config, OptimizerConfig(kind=args.optimizer),
                           seed=args.seed)  # fmt: skip
    data = SyntheticHSTUData(data_config, args.steps, seed=args.seed, rank=rank)
    if rank == 0:
        print(f"HSTU ranking: {args.pipeline}, {world} rank(s) on {setup.device}, "
              f"{args.steps} steps, {args.optimizer}", flush=True)  # fmt: skip
    bar = tqdm(total=args.steps, disable=rank != 0, unit="step", file=sys.stdout)
    tracer = Tracer() if args.trace else None
    result = run_pipeline(args.pipeline, setup, data, on_step=lambda step: bar.update(1),
                          tracer=tracer)  # fmt: skip
    bar.close()
    if tracer is not None:
        path = args.trace if world == 1 else f"{args.trace}.rank{rank}"
        tracer.save(path)
        print(f"rank {rank}: {len(tracer)} task spans written to {path}", flush=True)
    losses = result.global_losses()
    checksum = parameter_checksum(setup.model)
    steps_per_s = len(losses) / result.seconds if result.seconds else 0.0
    if rank == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, {steps_per_s:.1f} steps/s, "
              f"parameter checksum {checksum:.10f}")  # fmt: skip
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"pipeline": args.pipeline, "world_size": world, "steps": len(losses),
                           "losses": losses, "checksum": checksum,
                           "steps_per_s": steps_per_s}, out, indent=1)  # fmt: skip
    dist.barrier()  # leave the group together
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
