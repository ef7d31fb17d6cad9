"""Model and data shared by the before/after migration example."""

from __future__ import annotations

import torch


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits: torch.Tensor = self.net(batch["features"])
        return logits


def loss_fn(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, batch["labels"])


def setup(steps: int = 40, seed: int = 0) -> tuple[Classifier, torch.optim.Optimizer, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(seed)
    model = Classifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed + 1)
    loader = [
        {"features": torch.randn(32, 16, generator=generator),
         "labels": torch.randint(0, 4, (32,), generator=generator)}
        for _ in range(steps)
    ]  # fmt: skip
    return model, opt, loader
