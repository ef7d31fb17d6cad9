"""Specification §8.3: the HSTU pipeline as a drop-in for torchrec's train pipeline.

``HSTUPipelineFactory.create("hstu_prefetch_sparse_dist", ...)`` builds the HSTU
ranking step -- input distribution one batch ahead, embedding prefetch, a batch
shuffler that balances work over ranks -- and its blocking form keeps torchrec's
calling convention: ``progress(it)`` returns ``(loss_sum, tokens, output)`` and
raises ``StopIteration`` after the last batch.  Create the iterator once: a new
iterator is a new source, and the batches in flight of the old one are finished
first.

Runs as one process (a one-rank gloo group) or under torchrun; the same model
trained by the plain loop must end with the same losses and parameters.

    python examples/spec/hstu_usage.py --steps 8
"""

from __future__ import annotations

import argparse

from hstu_tasks import DataConfig, HSTUPipelineFactory, KarmarkarKarpShuffler, ModelConfig
from hstu_tasks import OptimizerConfig, SyntheticHSTUData, TrainingSetup, build_training
from hstu_tasks import init_distributed, leave_and_exit, quiet_torchrec
from hstu_tasks.runners import parameter_digest, run_pipeline

import toy

DATA = DataConfig(batch_size=8, max_history=16, num_items=500)


def make_setup() -> TrainingSetup:
    return build_training(ModelConfig(), DATA, OptimizerConfig(), seed=0, data_parallel="torch")


def train_pipelined(data: SyntheticHSTUData, max_train_iters: int) -> tuple[list[float], str]:
    setup = make_setup()
    pipe = HSTUPipelineFactory.create(
        "hstu_prefetch_sparse_dist",
        model=setup.model,
        optimizer=setup.optimizer,
        device=setup.device,
        batch_shuffler=KarmarkarKarpShuffler(),
    ).blocking()
    loss_sums = []
    dataloader_iter = iter(data)  # once, outside the loop
    for _ in range(max_train_iters):
        try:
            loss_sum, tokens, output = pipe.progress(dataloader_iter)
        except StopIteration:
            break
        loss_sums.append(float(loss_sum))
    pipe.shutdown()
    return loss_sums, parameter_digest(setup.model)


def train_plain(data: SyntheticHSTUData) -> tuple[list[float], str]:
    setup = make_setup()
    result = run_pipeline("none", setup, data)  # the unpipelined reference step
    return result.loss_sums, parameter_digest(setup.model)


def main() -> None:
    parser = argparse.ArgumentParser(description="the HSTU pipeline against the plain loop")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    quiet_torchrec()
    rank, _ = init_distributed()
    data = SyntheticHSTUData(DATA, args.steps, seed=0, rank=rank)
    losses, digest = train_pipelined(data, max_train_iters=args.steps + 10)
    plain_losses, plain_digest = train_plain(data)
    if rank == 0:
        print(f"{len(losses)} steps, local loss sum {losses[0]:.3f} -> {losses[-1]:.3f}")
        toy.report("HSTU prefetch pipeline", losses == plain_losses and digest == plain_digest)
    leave_and_exit(0)  # with the other ranks; torchrec's native teardown is skipped


if __name__ == "__main__":
    main()
