"""Mixed precision and gradient clipping with the ``basic()`` preset, checked against
the plain loop.

``backward_fn`` scales the loss before back-propagating it; ``optimizer_step_fn``
unscales the gradients, clips them, steps through the scaler and updates its scale:
torch's AMP recipe, one hook each.  The batches are ``(inputs, target)`` pairs, so
``loss_fn=torch.nn.CrossEntropyLoss()`` needs no ``forward=``.

On CUDA, autocast runs the model in float16 and ``GradScaler`` scales the loss.  On
a CPU both are built with ``enabled=False``: ``scale()`` returns the loss as it is,
``unscale_()`` and ``update()`` do nothing and ``step()`` calls ``optimizer.step()``
-- the same code runs, in float32, and must match the plain loop bit for bit.

    python examples/amp.py --steps 50
"""

from __future__ import annotations

import argparse

import torch

from aiopipe import basic

Batch = tuple[torch.Tensor, torch.Tensor]


class Classifier(torch.nn.Module):
    """A small MLP that runs its forward under autocast (float16 on CUDA only)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5)
        )
        self.amp = device.type == "cuda"
        self.device_type = device.type

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=torch.float16, enabled=self.amp):
            logits: torch.Tensor = self.net(inputs)
        return logits.float()  # the loss in float32


class ScaledStep:
    """The AMP half of a training step: scaled backward, then unscale, clip, step."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_norm: float) -> None:
        self.scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")
        self.model = model
        self.max_norm = max_norm

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.scaler.step(optimizer)  # skipped when the gradients hold inf/nan
        self.scaler.update()


def make_batches(steps: int, seed: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(64, 32, generator=generator), torch.randint(0, 5, (64,), generator=generator))
        for _ in range(steps)
    ]


def make_model(seed: int, device: torch.device) -> tuple[Classifier, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Classifier(device).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def train_plain(batches: list[Batch], device: torch.device) -> tuple[list[float], Classifier]:
    model, optimizer = make_model(0, device)
    amp = ScaledStep(model, device, max_norm=0.5)
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []
    for inputs, target in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(inputs.to(device)), target.to(device))
        amp.backward(loss)
        amp.step(optimizer)
        losses.append(loss.item())
    return losses, model


def train_pipelined(batches: list[Batch], device: torch.device) -> tuple[list[float], Classifier]:
    model, optimizer = make_model(0, device)
    amp = ScaledStep(model, device, max_norm=0.5)
    pipe = basic(
        model,
        optimizer,
        loss_fn=torch.nn.CrossEntropyLoss(),
        backward_fn=amp.backward,
        optimizer_step_fn=amp.step,
        prefetch=True,
        memcpy_stream=True,
    )
    with pipe.blocking() as blocking:
        losses = [loss.item() for loss in blocking.results(iter(batches))]
    return losses, model


def main() -> None:
    parser = argparse.ArgumentParser(description="AMP and clipping through basic()'s hooks")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    batches = make_batches(args.steps, seed=1)

    plain_losses, plain_model = train_plain(batches, device)
    losses, model = train_pipelined(batches, device)
    same = losses == plain_losses and all(
        torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters())
    )
    mode = "float16 autocast, scaled loss" if device.type == "cuda" else "AMP disabled on CPU"
    print(f"{args.steps} steps on {device} ({mode}): final loss {losses[-1]:.4f}")
    print("losses and parameters equal to the plain loop:", "yes (bit for bit)" if same else "NO")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
