"""Specification §8.2, preset T2: batches copied to the device one batch ahead, on
their own stream.

``prefetch=True`` adds an ``h2d`` task with lookahead 1; ``memcpy_stream=True`` puts
it on stream ``"memcpy"`` and, on a CUDA device, lane ``"io"``, so the copy of batch
K+1 overlaps the step of batch K.  The loader hands over host batches; the engine moves them (pinned,
``non_blocking``) and orders the default stream after the copy with an event.
``results(it)`` keeps batches in flight between calls; ``step(batch)`` would hand
over one at a time, without overlap.  On a CPU-only machine the device is the CPU
and the copies are no-ops.

    python examples/spec/t2_prefetch.py
"""

from __future__ import annotations

import torch

from aiopipe import basic

import toy


def train_plain(batches: list[torch.Tensor]) -> tuple[list[float], torch.nn.Module]:
    return toy.train_plain(batches, on=toy.device())  # each batch moved, then trained


def train_pipelined(batches: list[torch.Tensor]) -> tuple[list[float], torch.nn.Module]:
    model, opt = toy.model_and_optimizer(toy.device())  # the model's device is the target
    pipe = basic(
        model, opt, loss_fn=lambda out: out.sum(), prefetch=True, memcpy_stream=True
    )
    h2d = pipe.schedule.task("h2d")
    print(f"h2d: lookahead {h2d.lookahead}, stream {h2d.stream!r}")
    with pipe.blocking() as blocking:
        losses = [loss.item() for loss in blocking.results(iter(batches))]
    return losses, model


def main() -> None:
    batches = toy.cpu_batches()
    toy.report("T2 preset", toy.same_training(*train_pipelined(batches), *train_plain(batches)))


if __name__ == "__main__":
    main()
