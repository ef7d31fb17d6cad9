"""Specification §8.1, preset T1: a plain training loop, pipelined by ``basic()``.

The loop::

    for batch in loader:
        opt.zero_grad()
        loss = model(batch).sum()
        loss.backward()
        opt.step()

becomes ``aiopipe.basic(model, opt, loss_fn=...)``, fed one batch at a
time with ``step(batch)``.  The blocking view serves ordinary scripts; in an
``async def`` the same calls are awaited.

    python examples/spec/t1_basic.py
"""

from __future__ import annotations

import torch

from aiopipe import basic

import toy
from toy import train_plain  # the specification's loop, unpipelined


def train_pipelined(batches: list[torch.Tensor]) -> tuple[list[float], torch.nn.Module]:
    model, opt = toy.model_and_optimizer()
    pipe = basic(model, opt, loss_fn=lambda out: out.sum()).blocking()
    with pipe:  # shuts the lane threads down at the end
        losses = [pipe.step(batch).item() for batch in batches]
    return losses, model


def main() -> None:
    batches = toy.cpu_batches()
    toy.report("T1 preset", toy.same_training(*train_pipelined(batches), *train_plain(batches)))


if __name__ == "__main__":
    main()
