"""Specification §9.1: a custom ``Task`` subclass.

A task declared as a class: its name, stream, lookahead and slots are class
attributes, its body is ``run(self, ctx)``.  ``CountTokensTask`` counts the values
of the batch on the device; ``train`` divides the loss sum by that count (a
per-token mean).  Bare slot names in ``reads``/``writes`` live at the task's own
lookahead; ``DataSlot(name, offset)`` names the ring position explicitly.

    python examples/spec/custom_task.py
"""

from __future__ import annotations

import torch

from aiopipe import DataSlot, Pipeline, Task, TaskContext

import toy


class CountTokensTask(Task):
    name = "count_tokens"
    stream = "default"
    lookahead = 0
    reads = (DataSlot("batch_device", 0),)
    writes = (DataSlot("token_count", 0),)

    def run(self, ctx: TaskContext) -> None:
        ctx.slots.set("token_count", ctx.slots["batch_device"].numel())


def build_pipeline(
    model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device
) -> Pipeline:
    def h2d(ctx: TaskContext) -> None:
        ctx.slots.set("batch_device", ctx.slots["batch_cpu"].to(device, non_blocking=True))

    def train(ctx: TaskContext) -> None:
        opt.zero_grad()
        loss = model(ctx.slots["batch_device"]).sum() / ctx.slots["token_count"]
        loss.backward()
        opt.step()
        ctx.slots.set("step_result", loss.detach())

    return Pipeline(
        [
            Task.from_fn("h2d", h2d, lookahead=1, stream="memcpy", writes=("batch_device",)),
            CountTokensTask(),
            Task.from_fn("train", train, reads=("batch_device", "token_count"),
                         writes=("step_result",)),
        ],
        device=device,
    )  # fmt: skip


def train_plain(batches: list[torch.Tensor]) -> tuple[list[float], torch.nn.Module]:
    device = toy.device()
    model, opt = toy.model_and_optimizer(device)
    losses = []
    for batch in batches:
        batch = batch.to(device)
        opt.zero_grad()
        loss = model(batch).sum() / batch.numel()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def train_pipelined(batches: list[torch.Tensor]) -> tuple[list[float], torch.nn.Module]:
    device = toy.device()
    model, opt = toy.model_and_optimizer(device)
    with build_pipeline(model, opt, device).blocking() as pipe:
        losses = [loss.item() for loss in pipe.results(iter(batches))]
    return losses, model


def main() -> None:
    batches = toy.cpu_batches()
    same = toy.same_training(*train_pipelined(batches), *train_plain(batches))
    toy.report("CountTokensTask", same)


if __name__ == "__main__":
    main()
