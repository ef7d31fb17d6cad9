"""After: the same loop pipelined by aiopipe (H2D one batch ahead, on its own stream)."""

from __future__ import annotations

import aiopipe
from common import loss_fn, setup


def train(steps: int = 40) -> tuple[object, list[float]]:
    model, opt, loader = setup(steps)
    losses = []
    pipe = aiopipe.basic(model, opt, loss_fn=loss_fn, prefetch=True, memcpy_stream=True)
    for loss in pipe.blocking().results(iter(loader)):
        losses.append(loss.item())
    return model, losses


if __name__ == "__main__":
    print(f"final loss {train()[1][-1]:.4f}")
