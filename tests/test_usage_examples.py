"""The usage examples of the specification (examples/spec/) and the AMP example
(examples/amp.py) run, and each gives exactly what its plain loop gives."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "spec"


@pytest.fixture
def examples() -> Iterator[Any]:
    """Imports examples by file name, as `python examples/spec/NAME.py` would see them."""
    paths = [str(SPEC), str(ROOT / "examples")]
    sys.path[:0] = paths
    imported: list[str] = []

    def load(name: str) -> ModuleType:
        imported.append(name)
        return importlib.import_module(name)

    try:
        yield load
    finally:
        del sys.path[: len(paths)]
        for name in [*imported, "toy"]:
            sys.modules.pop(name, None)


def assert_same_training(pipelined: tuple[Any, ...], plain: tuple[Any, ...]) -> None:
    (losses, model), (plain_losses, plain_model) = pipelined[:2], plain[:2]
    assert len(losses) == len(plain_losses) > 0
    assert losses == plain_losses
    for got, want in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(got, want)


def test_amp_example_matches_the_plain_amp_loop(examples: Any) -> None:
    amp = examples("amp")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = amp.make_batches(6, seed=1)
    pipelined = amp.train_pipelined(batches, device)
    plain = amp.train_plain(batches, device)
    assert_same_training(pipelined, plain)
    if device.type == "cpu":  # the documented no-op path
        scaler = amp.ScaledStep(plain[1], device, max_norm=0.5).scaler
        assert not scaler.is_enabled()
