"""The model, data and comparison the specification examples share.

Every example trains (or computes) once with aiopipe and once with a plain loop on
the same model and data, and checks that both give the same results, bit for bit.
"""

from __future__ import annotations

import torch

Model = torch.nn.Sequential


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def model_and_optimizer(on: torch.device | None = None) -> tuple[Model, torch.optim.Optimizer]:
    """The same initial weights on every call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model.to(on or torch.device("cpu"))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def cpu_batches(count: int = 12, rows: int = 16, seed: int = 1) -> list[torch.Tensor]:
    """Batches of inputs on the host, as a data loader hands them over."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 8, generator=generator) for _ in range(count)]


def train_plain(
    batches: list[torch.Tensor], on: torch.device | None = None
) -> tuple[list[float], torch.nn.Module]:
    """The specification's loop, unpipelined: the losses and the trained model."""
    model, opt = model_and_optimizer(on)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = model(batch.to(on or torch.device("cpu"))).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def same_training(
    losses: list[float], model: torch.nn.Module, plain_losses: list[float], plain: torch.nn.Module
) -> bool:
    """Equal losses and bit-identical parameters."""
    return losses == plain_losses and all(
        torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters())
    )


def report(what: str, same: bool) -> None:
    """Print the verdict; exit with status 1 when aiopipe and the plain loop differ."""
    print(f"{what}: {'the same as the plain loop (bit for bit)' if same else 'DIFFERENT'}")
    if not same:
        raise SystemExit(1)
