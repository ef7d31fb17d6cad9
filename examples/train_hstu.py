"""Train the HSTU ranking model with aiopipe (or torchrec's pipeline, or a plain loop).

One CPU process by default; ``torchrun --nproc-per-node 2 examples/train_hstu.py``
for two ranks on gloo.  Every pipeline trains the same model on the same data, so
their losses and final parameters can be compared (``--json``).

    python examples/train_hstu.py --steps 40 --pipeline aiopipe --json run.json

With ``--checkpoint-dir`` the run checkpoints every ``--checkpoint-every`` steps and
resumes from the newest complete checkpoint when started again, e.g. by
``torchrun --max-restarts 1`` after a rank died, or on another number of ranks: the
data position is global and the global batch is kept (see docs/fault-tolerance.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from tqdm import tqdm

from aiopipe import Tracer
from aiopipe.timeline import write_timeline
from hstu_tasks import DataConfig, HSTUBatch, ModelConfig, OptimizerConfig, SyntheticHSTUData
from hstu_tasks import build_training, init_distributed, leave_and_exit, quiet_torchrec
from hstu_tasks import stop_on_ctrl_c
from hstu_tasks.arguments import ArgumentParser, at_least, output_file, refusal
from hstu_tasks.elastic import ResumableJob
from hstu_tasks.machine_load import busy_machine_note
from hstu_tasks.parallel import default_device, resolve_data_parallel
from hstu_tasks.runners import PIPELINES, RunResult, parameter_checksum, parameter_digest
from hstu_tasks.runners import run_pipeline


def parse_args() -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=at_least(0), default=40,
                        help="the job's training steps in all (a resumed run continues to it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pipeline", choices=PIPELINES, default="aiopipe")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--steps-per-call", type=at_least(1), default=1, metavar="K",
                        help="aiopipe pipelines: ask for K steps a call (progress_many: the "
                             "lanes chain them, the loop is woken once a call); calls end "
                             "on checkpoints")
    parser.add_argument("--data-parallel", choices=("auto", "torch", "megatron"), default="auto",
                        help="dense replication: torch DDP, or Megatron DDP + its optimizer "
                             "(GPU); auto = megatron on CUDA with megatron-core installed, "
                             "except for --pipeline torchrec and checkpointed runs")
    parser.add_argument("--replicate-tables", action="store_true",
                        help="no torchrec sharding: tables are ordinary parameters replicated "
                             "on every rank (plain torch operators only, e.g. for a GPU "
                             "without fbgemm's CUDA kernels)")
    parser.add_argument("--batch-size", type=at_least(1), default=16,
                        help="samples per rank a step, when --global-batch-size is not given "
                             "(or with --keep-rank-batch)")
    parser.add_argument("--sharding", choices=("row_wise", "table_wise"), default="row_wise",
                        help="torchrec's plan for the embedding tables")
    parser.add_argument("--max-history", type=at_least(DataConfig.min_history), default=48,
                        help="the longest user history, in events (the shortest: "
                             f"{DataConfig.min_history})")
    parser.add_argument("--num-items", type=at_least(1), default=2000,
                        help="rows of the item table")
    parser.add_argument("--lengths", choices=("uniform", "zipf"), default="uniform")
    parser.add_argument("--json", metavar="PATH", type=output_file,
                        help="write losses, checksum and speed here")
    parser.add_argument("--trace", metavar="PATH", type=output_file,
                        help="write a Chrome/Perfetto timeline of the aiopipe tasks here "
                             "(one file per rank: PATH gets a .rankN suffix when world > 1)")
    parser.add_argument("--timeline", metavar="PATH", type=output_file,
                        help="draw three steady-state iterations of the tasks as an SVG here "
                             "(rank 0)")
    ResumableJob.add_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # Refuse what cannot run before joining the group (the other ranks would wait).
    if args.steps_per_call > 1 and not args.pipeline.startswith("aiopipe"):
        raise refusal(f"train_hstu.py: --steps-per-call asks aiopipe for several steps a "
                      f"call; --pipeline {args.pipeline} takes one")  # fmt: skip
    if (args.trace or args.timeline) and not args.pipeline.startswith("aiopipe"):
        raise refusal(f"train_hstu.py: --trace and --timeline record aiopipe's tasks; "
                      f"--pipeline {args.pipeline} has none")  # fmt: skip
    needs_sharded_torch_ddp = args.pipeline == "torchrec" or args.checkpoint_dir
    if needs_sharded_torch_ddp and args.replicate_tables:
        raise refusal("train_hstu.py: --pipeline torchrec and --checkpoint-dir need sharded "
                      "tables (drop --replicate-tables)")  # fmt: skip
    if needs_sharded_torch_ddp and args.data_parallel == "megatron":
        raise refusal("train_hstu.py: --pipeline torchrec and --checkpoint-dir need torch "
                      "DDP (drop --data-parallel megatron)")  # fmt: skip
    try:
        resolve_data_parallel(args.data_parallel, default_device())
    except (ValueError, ImportError) as error:  # e.g. --data-parallel megatron without a GPU
        # This node's device and packages: said by every rank (they may differ by node).
        raise SystemExit(f"train_hstu.py: {error}") from None
    quiet_torchrec()
    rank, world = init_distributed(datetime.timedelta(seconds=args.collective_timeout))
    job: ResumableJob[HSTUBatch] = ResumableJob(args, rank=rank, world_size=world)
    data_config = DataConfig(
        batch_size=job.rank_batch, max_history=args.max_history, num_items=args.num_items,
        length_distribution=args.lengths,
    )  # fmt: skip
    data_parallel = "torch" if needs_sharded_torch_ddp else args.data_parallel
    setup = build_training(ModelConfig(), data_config, OptimizerConfig(kind=args.optimizer),
                           seed=args.seed, data_parallel=data_parallel,
                           shard_embeddings=not args.replicate_tables,
                           sharding=args.sharding)  # fmt: skip
    job.restore(setup)  # resharded onto this job's ranks: its data position is global
    data = SyntheticHSTUData(data_config, max(args.steps - job.start, 0), seed=args.seed,
                             rank=rank, world_size=world,
                             sample_offset=job.samples_consumed)  # fmt: skip
    if rank == 0:
        print(f"HSTU ranking: {args.pipeline}, {world} rank(s) on {setup.device}, "
              f"{setup.data_parallel} DDP, tables {'sharded' if setup.sharded else 'replicated'}, "
              f"{args.steps} steps, global batch {job.global_batch} ({job.rank_batch} per rank), "
              f"{args.optimizer}{job.resumed_note()}",
              flush=True)  # fmt: skip
    bar = tqdm(total=args.steps, initial=job.start, unit="step", file=sys.stdout,
               disable=rank != 0 or job.start >= args.steps)  # nothing to run: no empty bar
    result = RunResult()

    def on_step(step: int) -> None:  # at a progress boundary: the model has `step` more steps
        bar.update(job.start + step - bar.n)  # one step, or a call's
        job.after_step(step, setup, result.global_losses)

    def steps_for_call(done: int) -> int:  # calls end on checkpoints
        return job.steps_for_call(done, args.steps_per_call)

    tracer = Tracer() if args.trace or args.timeline else None
    run_pipeline(args.pipeline, setup, job.source(data), on_step=on_step, tracer=tracer,
                 result=result,
                 steps_per_call=1 if args.steps_per_call == 1 else steps_for_call)  # fmt: skip
    bar.close()
    if tracer is not None and args.trace:
        path = args.trace if world == 1 else f"{args.trace}.rank{rank}"
        tracer.save(path)
        print(f"rank {rank}: {len(tracer)} task spans written to {path}", flush=True)
    if tracer is not None and args.timeline and rank == 0 and len(tracer) == 0:
        print("no steps ran in this attempt: no timeline drawn")
    elif tracer is not None and args.timeline and rank == 0:
        ran = max(span.iteration for span in tracer.spans) + 1  # iterations 0 .. ran - 1
        first = max(min((args.steps - job.start) // 2, ran - 3), 0)
        last = min(first + 2, ran - 1)
        write_timeline(tracer.spans, args.timeline, iterations=(first, last),
                       title=f"HSTU step, {args.pipeline}, rank 0 of {world}, "
                             f"iterations {first}-{last}")  # fmt: skip
        print(f"timeline of iterations {first}-{last} drawn in {args.timeline}")
    losses = job.earlier_losses + result.global_losses()
    samples = job.samples_digest(len(result.loss_sums))
    checksum = parameter_checksum(setup.model)
    digest = parameter_digest(setup.model)
    steps_per_s = len(result.loss_sums) / result.seconds if result.seconds else 0.0
    if rank == 0:
        ran = (f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, {steps_per_s:.1f} steps/s"
               if result.loss_sums else job.nothing_ran_note())  # fmt: skip
        print(f"{ran}, parameter checksum {checksum!r}")
        if steps_per_s and (busy := busy_machine_note()):
            print(busy)
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"pipeline": args.pipeline, "world_size": world, "steps": len(losses),
                           "resumed_from": job.start, "global_batch_size": job.global_batch,
                           "losses": losses, "checksum": checksum, "samples": samples,
                           "parameters_sha256": digest,
                           "steps_per_s": steps_per_s}, out, indent=1)  # fmt: skip
    leave_and_exit(0)  # together with the other ranks; see its docstring for why it exits


if __name__ == "__main__":
    stop_on_ctrl_c(main)
