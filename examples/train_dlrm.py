"""Train torchrec's DLRM with aiopipe (or torchrec's pipelines, or a plain loop).

Sparse features pooled by a table-wise sharded ``EmbeddingBagCollection``, dense
features through an MLP, pairwise interaction, an over-arch MLP and BCE.  One CPU
process by default; ``torchrun --nproc-per-node 2 examples/train_dlrm.py`` for two
ranks on gloo.  Every pipeline trains the same model on the same data, so their
losses and final parameters can be compared (``--json``).  ``--pipeline aiopipe-S``
runs aiopipe's schedule S (``sparse-dist``, ``lite``, ``base``, ``fused``, ``semi-sync``,
``pt2``, ``prefetch``), ``torchrec-S`` torchrec's class for it (``torchrec-prefetch`` on
a GPU only); ``aiopipe`` and ``torchrec`` are sparse-dist.  ``--uneven K`` gives the
last rank K batches fewer: every rank still ends the epoch on the same step.

    python examples/train_dlrm.py --steps 40 --pipeline aiopipe --eval-every 10 --json run.json
    python examples/train_dlrm.py --steps 40 --pipeline aiopipe-lite --json lite.json
    python examples/train_dlrm.py --steps 40 --pipeline aiopipe-fused --grad-accumulation 3
    python examples/train_dlrm.py --steps 40 --pipeline aiopipe-semi-sync --start-batch 10
    python examples/train_dlrm.py --steps 40 --pipeline aiopipe-pt2 --compile-backend aot_eager
    torchrun --nproc-per-node 2 examples/train_dlrm.py --steps 10 --uneven 3

The data is one global sequence of samples: each rank trains its equal part of every
global batch (``--global-batch-size``, default ``--batch-size`` x world size).  With
``--checkpoint-dir`` the run checkpoints every ``--checkpoint-every`` steps and resumes
from the newest complete checkpoint when started again -- on any number of ranks,
with the tables resharded and the global batch kept (docs/fault-tolerance.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any

from torchrec.distributed.train_pipeline.train_pipelines import TorchCompileConfig
from tqdm import tqdm

from hstu_tasks import DLRMConfig, SyntheticDLRMData, build_dlrm_training
from hstu_tasks import init_distributed, leave_and_exit, quiet_torchrec, stop_on_ctrl_c
from hstu_tasks.arguments import ArgumentParser, at_least, output_file, refusal
from hstu_tasks.elastic import ResumableJob
from hstu_tasks.machine_load import busy_machine_note
from hstu_tasks.parallel import default_device
from hstu_tasks.runners import parameter_checksum, parameter_digest
from hstu_tasks.sparse.dlrm_runs import DLRM_PIPELINES, DLRMRun, run_dlrm
from hstu_tasks.sparse.schedules import check_compile_backend


def parse_args() -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.splitlines()[0],
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=at_least(0), default=40,
                        help="the job's training steps in all (a resumed run continues to it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pipeline", choices=DLRM_PIPELINES, default="aiopipe",
                        help="aiopipe-S: aiopipe's schedule S; torchrec-S: torchrec's class "
                             "for it; aiopipe, torchrec: sparse-dist; none: a plain loop")
    parser.add_argument("--optimizer", choices=("sgd", "adagrad"), default="sgd",
                        help="for the tables (fused into backward) and the dense part")
    parser.add_argument("--batch-size", type=at_least(1), default=32,
                        help="samples per rank a step, when --global-batch-size is not given "
                             "(or with --keep-rank-batch)")
    parser.add_argument("--sharding", choices=("table_wise", "row_wise"), default="table_wise",
                        help="torchrec's plan for the embedding tables")
    parser.add_argument("--start-batch", type=at_least(0), metavar="N",
                        help="semi-sync: the step from which it is semi-synchronous "
                             "(torchrec's default: 900)")
    parser.add_argument("--stash-gradients", action="store_true",
                        help="semi-sync: each step applies the previous batch's dense gradients")
    parser.add_argument("--compile-backend", metavar="NAME",
                        help="pt2: torch.compile's backend (torchrec's default: inductor)")
    parser.add_argument("--compile-on-iter", type=at_least(0), metavar="N",
                        help="pt2: the step at which the model is compiled (torchrec's default: 3)")
    parser.add_argument("--grad-accumulation", type=at_least(1), default=1, metavar="K",
                        help="the optimizer steps after every K-th batch and the last "
                             "(torchrec-S: its class in torchrec's GradientAccumulationWrapper; "
                             "not with --checkpoint-dir)")
    parser.add_argument("--eval-every", type=at_least(0), default=0, metavar="N",
                        help="an evaluation pass of --eval-batches batches after every N "
                             "training steps (0: none)")
    parser.add_argument("--eval-batches", type=at_least(1), default=4, metavar="M")
    parser.add_argument("--steps-per-call", type=at_least(1), default=1, metavar="K",
                        help="aiopipe pipelines: ask for K steps a call (progress_many: the "
                             "lanes chain them); calls end on checkpoints and eval passes")
    parser.add_argument("--uneven", type=at_least(1), metavar="K",
                        help="the last rank's source has K batches fewer than the others' "
                             "(aiopipe pipelines only, more than one rank): every rank still "
                             "ends the epoch on the same step, the shortest source's")
    parser.add_argument("--json", metavar="PATH", type=output_file,
                        help="write losses, checksum, samples digest and speed here")
    ResumableJob.add_arguments(parser)
    return parser.parse_args()


def schedule_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The knobs of torchrec's class for the schedule, from their flags; a knob of
    another schedule is refused."""
    knobs: dict[str, Any] = {}
    if args.start_batch is not None:
        knobs["start_batch"] = args.start_batch
    if args.stash_gradients:
        knobs["stash_gradients"] = True
    if knobs and not args.pipeline.endswith("semi-sync"):
        raise refusal("train_dlrm.py: --start-batch and --stash-gradients are semi-sync's: "
                      "use them with --pipeline aiopipe-semi-sync or "
                      "torchrec-semi-sync")  # fmt: skip
    if args.compile_backend is not None or args.compile_on_iter is not None:
        if not args.pipeline.endswith("pt2"):
            raise refusal("train_dlrm.py: --compile-backend and --compile-on-iter are pt2's: "
                          "use them with --pipeline aiopipe-pt2 or torchrec-pt2")  # fmt: skip
        defaults = TorchCompileConfig()
        try:  # now, not at the compile, steps in
            check_compile_backend(args.compile_backend or defaults.backend)
        except ValueError as error:
            # What this node has installed: said by every rank (it may differ by node).
            raise SystemExit(f"train_dlrm.py: --compile-backend: {error}") from None
        knobs["compile_configs"] = TorchCompileConfig(
            backend=args.compile_backend or defaults.backend,
            compile_on_iter=defaults.compile_on_iter if args.compile_on_iter is None
            else args.compile_on_iter,
        )  # fmt: skip
    return knobs


def main() -> None:
    args = parse_args()
    # Refuse what cannot run before joining the group (the other ranks would wait);
    # argparse has refused numbers out of range.
    if args.steps_per_call > 1 and not args.pipeline.startswith("aiopipe"):
        raise refusal(f"train_dlrm.py: --steps-per-call asks aiopipe for several steps a "
                      f"call; --pipeline {args.pipeline} takes one")  # fmt: skip
    knobs = schedule_knobs(args)
    if args.eval_every and args.pipeline.startswith("torchrec"):
        raise refusal("train_dlrm.py: --eval-every needs an aiopipe pipeline or none: "
                      "each of torchrec's train pipelines would forward its training "
                      "batches in flight as evaluation batches")  # fmt: skip
    if args.pipeline == "torchrec-prefetch" and default_device().type != "cuda":
        # This node's device: said by every rank (it may differ by node).
        raise SystemExit("train_dlrm.py: torchrec's PrefetchTrainPipelineSparseDist needs a "
                         "GPU: on a CPU its prefetch does nothing and its forwards find no "
                         "prefetched input (--pipeline aiopipe-prefetch runs on a CPU)")
    if args.uneven is not None:
        if not args.pipeline.startswith("aiopipe"):
            raise refusal(f"train_dlrm.py: --uneven: with --pipeline {args.pipeline} the "
                          f"longer ranks would wait in a collective until it times out "
                          f"(aiopipe's pipelines end the epoch together; torchrec issue "
                          f"#1014)")  # fmt: skip
        if args.checkpoint_dir:
            raise refusal("train_dlrm.py: --uneven with --checkpoint-dir: a resumed job "
                          "would not know which rank was short")  # fmt: skip
        if args.uneven > args.steps:
            raise refusal(f"train_dlrm.py: --uneven {args.uneven} is more than --steps "
                          f"{args.steps}")  # fmt: skip
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # torchrun's, before joining
            raise refusal("train_dlrm.py: --uneven needs more than one rank (torchrun "
                          "--nproc-per-node 2 examples/train_dlrm.py ...)")  # fmt: skip
    if args.checkpoint_dir and args.grad_accumulation > 1:
        raise refusal("train_dlrm.py: --checkpoint-dir with --grad-accumulation is not "
                      "supported: a checkpoint (a forced one, or a job stopped and "
                      "resized) may fall inside a group, whose accumulated gradients it "
                      "would lose (docs/fault-tolerance.md)")  # fmt: skip
    quiet_torchrec()
    rank, world = init_distributed(datetime.timedelta(seconds=args.collective_timeout))
    short = args.uneven if args.uneven is not None and rank == world - 1 else 0
    job: ResumableJob[Any] = ResumableJob(args, rank=rank, world_size=world)
    config = DLRMConfig(batch_size=job.rank_batch)
    setup = build_dlrm_training(config, args.optimizer, seed=args.seed, device=default_device(),
                                sharding=args.sharding)  # fmt: skip
    job.restore(setup)  # resharded onto this job's ranks: its data position is global
    data = SyntheticDLRMData(config, max(args.steps - short - job.start, 0), seed=args.seed,
                             rank=rank, world_size=world,
                             sample_offset=job.samples_consumed)  # fmt: skip
    if rank == 0:
        accumulation = (f", gradients accumulated over {args.grad_accumulation} batches "
                        f"(a step is a batch; the optimizer steps every "
                        f"{args.grad_accumulation})" if args.grad_accumulation > 1 else "")  # fmt: skip
        print(f"DLRM: {args.pipeline}, {world} rank(s) on {setup.device}, tables "
              f"{args.sharding.replace('_', '-')}, {args.steps} steps, global batch "
              f"{job.global_batch} ({job.rank_batch} per rank), {args.optimizer}{accumulation}"
              f"{job.resumed_note()}", flush=True)  # fmt: skip
        if args.pipeline.endswith("pt2"):
            compiled = knobs.get("compile_configs")
            backend = compiled.backend if compiled is not None else "inductor"
            on = setup.device.type
            print(f"note: the model is compiled (torch.compile, backend {backend}) at an early "
                  f"step; the steps around it wait for the compile"
                  + (", about a minute with inductor on a CPU (--compile-backend aot_eager "
                     "compiles in seconds)" if backend == "inductor" and on == "cpu" else ""),
                  flush=True)  # fmt: skip
        if args.pipeline.endswith("semi-sync") and job.start:
            print("note: a semi-sync schedule resumes with its step counter at 0 (synchronous "
                  "again for --start-batch steps, as torchrec's class is after a restart), so "
                  "this run differs from one that was never stopped "
                  "(docs/fault-tolerance.md)", flush=True)  # fmt: skip
        if args.pipeline == "torchrec-semi-sync" and args.grad_accumulation > 1:
            print("note: torchrec's GradientAccumulationWrapper lets TrainPipelineSemiSync's "
                  "zero_grad clear each group's first gradients, so this checksum differs "
                  "from aiopipe-semi-sync's and the plain loop's (docs/sparse-dist.md, "
                  "Gradient accumulation)", flush=True)  # fmt: skip
    bar = tqdm(total=args.steps, initial=job.start, unit="step", file=sys.stdout,
               disable=rank != 0 or job.start >= args.steps)  # nothing to run: no empty bar

    def eval_after(step: int) -> Any:  # at a progress boundary: the model has `position` steps
        bar.update(job.start + step - bar.n)  # one step, or a call's
        job.after_step(step, setup, result.global_losses)
        position = job.start + step
        if args.eval_every and position % args.eval_every == 0:
            seed = args.seed + 1 + position // args.eval_every  # a fresh eval set per pass
            return SyntheticDLRMData(config, args.eval_batches, seed=seed, rank=rank)
        return None

    def steps_for_call(done: int) -> int:  # calls end on checkpoints and eval passes
        steps = job.steps_for_call(done, args.steps_per_call)
        if args.eval_every:
            steps = min(steps, args.eval_every - (job.start + done) % args.eval_every)
        return steps

    result = DLRMRun()
    run_dlrm(args.pipeline, setup, [job.source(data)], eval_after, result=result,
             grad_accumulation=args.grad_accumulation, knobs=knobs,
             steps_per_call=1 if args.steps_per_call == 1 else steps_for_call)  # fmt: skip
    bar.close()
    losses = job.earlier_losses + result.global_losses()
    samples = job.samples_digest(len(result.losses))
    checksum = parameter_checksum(setup.model)
    digest = parameter_digest(setup.model)
    evaluated = result.global_eval_losses()
    steps_per_s = len(result.losses) / result.seconds if result.seconds else 0.0
    if rank == 0:
        passes = (f", {len(evaluated)} eval passes (last loss {evaluated[-1]:.4f})"
                  if evaluated else "")  # fmt: skip
        ran = (f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, {steps_per_s:.1f} steps/s{passes}"
               if result.losses else job.nothing_ran_note())  # fmt: skip
        print(f"{ran}, parameter checksum {checksum!r}")
        if steps_per_s and (busy := busy_machine_note()):
            print(busy)
        if args.uneven is not None:
            print(f"the last rank's source had {args.uneven} batch(es) fewer: every rank "
                  f"trained {len(result.losses)} steps and ended the epoch there")  # fmt: skip
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"pipeline": args.pipeline, "world_size": world, "steps": len(losses),
                           "resumed_from": job.start, "global_batch_size": job.global_batch,
                           "grad_accumulation": args.grad_accumulation,
                           "schedule_knobs": {name: value if isinstance(value, (bool, int, str))
                                              else repr(value) for name, value in knobs.items()},
                           "losses": losses, "eval_losses": evaluated, "checksum": checksum,
                           "samples": samples, "parameters_sha256": digest,
                           "steps_per_s": steps_per_s}, out, indent=1)  # fmt: skip
    leave_and_exit(0)  # together with the other ranks; see its docstring for why it exits


if __name__ == "__main__":
    stop_on_ctrl_c(main)
