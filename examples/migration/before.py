"""Before: a plain PyTorch training loop."""

from __future__ import annotations

from common import loss_fn, setup


def train(steps: int = 40) -> tuple[object, list[float]]:
    model, opt, loader = setup(steps)
    losses = []
    for batch in loader:
        opt.zero_grad()
        loss = loss_fn(model(batch), batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


if __name__ == "__main__":
    print(f"final loss {train()[1][-1]:.4f}")
