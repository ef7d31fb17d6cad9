"""Quickstart: pipeline a small training loop with aiopipe, and check it against a
plain loop.

Three tasks: ``prepare`` (one batch ahead, on its own lane) turns raw batches into
features, ``train`` runs forward and backward, ``step`` applies the optimizer and
returns the loss.  The same model trained by a plain loop must end with the same
parameters, bit for bit.

    python examples/quickstart.py --steps 200 --executor async
"""

from __future__ import annotations

import argparse
import time

import torch

import aiopipe
from aiopipe import Pipeline, Task


Batch = tuple[torch.Tensor, torch.Tensor]


def make_batches(steps: int, seed: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=generator)
        y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=generator)
        batches.append((x, y))
    return batches


def make_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def features(batch: Batch) -> Batch:
    x, y = batch
    return (x - x.mean(dim=0)) / (x.std(dim=0) + 1e-5), y


def build_pipeline(model: torch.nn.Module, opt: torch.optim.Optimizer, executor: str) -> Pipeline:
    def prepare(ctx: aiopipe.TaskContext) -> None:
        ctx.slots.set("features", features(ctx.slots["batch_cpu"]))

    def train(ctx: aiopipe.TaskContext) -> None:
        x, y = ctx.slots["features"]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ctx.slots.set("loss", loss.detach())

    def step(ctx: aiopipe.TaskContext) -> None:
        opt.step()
        ctx.slots.set("step_result", float(ctx.slots["loss"]))

    tasks = [
        Task.from_fn("prepare", prepare, lookahead=1, stream="io", writes=("features",)),
        Task.from_fn("train", train, reads=("features",), writes=("loss",)),
        Task.from_fn("step", step, reads=("loss",), writes=("step_result",), depends_on=("train",)),
    ]
    if executor == "async":
        return Pipeline(tasks, thread_map={"prepare": "io", "train": "compute", "step": "compute"})
    return Pipeline(tasks, executor=executor)


async def train_with_aiopipe(batches: list[Batch], seed: int, executor: str) -> tuple[list[float], torch.nn.Module]:
    model, opt = make_model(seed)
    losses: list[float] = []
    async with build_pipeline(model, opt, executor) as pipe:
        source = iter(batches)
        async for loss in pipe.results(source):
            losses.append(loss)
            if len(losses) % 50 == 0 or len(losses) == len(batches):
                print(f"  step {len(losses):4d}/{len(batches)}  loss {loss:.4f}", flush=True)
    return losses, model


def train_plain(batches: list[Batch], seed: int) -> tuple[list[float], torch.nn.Module]:
    model, opt = make_model(seed)
    losses = []
    for batch in batches:
        x, y = features(batch)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model


def main() -> None:
    summary = __doc__.split("\n\n")[0]  # the first paragraph: a whole sentence
    parser = argparse.ArgumentParser(description=" ".join(summary.split()))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--executor", choices=("async", "sequential"), default="async")
    args = parser.parse_args()

    batches = make_batches(args.steps, args.seed)
    print(f"aiopipe quickstart: {args.steps} steps, {args.executor} executor")
    start = time.perf_counter()
    losses, model = aiopipe.run(train_with_aiopipe(batches, args.seed, args.executor))
    elapsed = time.perf_counter() - start
    plain_losses, plain_model = train_plain(batches, args.seed)

    same = losses == plain_losses and all(
        torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters())
    )
    print(f"final loss {losses[-1]:.4f}  ({args.steps / elapsed:.0f} steps/s)")
    print("parameters equal to a plain training loop:", "yes (bit for bit)" if same else "NO")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
