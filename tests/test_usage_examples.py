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


@pytest.mark.parametrize("name", ["t1_basic", "t2_prefetch", "custom_task", "custom_executor"])
def test_training_examples_match_their_plain_loop(examples: Any, name: str) -> None:
    example = examples(name)
    batches = example.toy.cpu_batches(count=5)
    assert_same_training(example.train_pipelined(batches), example.train_plain(batches))


def test_t2_copies_one_batch_ahead_on_the_memcpy_stream(examples: Any, capsys: Any) -> None:
    example = examples("t2_prefetch")
    example.train_pipelined(example.toy.cpu_batches(count=2))
    assert "h2d: lookahead 1, stream 'memcpy'" in capsys.readouterr().out


def test_custom_task_subclass_declares_its_fields_as_class_attributes(examples: Any) -> None:
    task = examples("custom_task").CountTokensTask()
    assert (task.name, task.stream, task.lookahead) == ("count_tokens", "default", 0)
    assert [(s.name, s.offset) for s in task.reads] == [("batch_device", 0)]
    assert [(s.name, s.offset) for s in task.writes] == [("token_count", 0)]


EXPECTED_LANES = {
    "by_stream": {"h2d": "memcpy", "forward": "default", "zero_grad": "default"},
    "per_task": {"h2d": "h2d", "forward": "forward", "zero_grad": "zero_grad"},
    "dict": {"h2d": "io", "forward": "compute", "zero_grad": "default"},  # left out: "default"
    "callable": {"h2d": "io", "forward": "compute", "zero_grad": "compute"},
}


@pytest.mark.parametrize("form", list(EXPECTED_LANES))
def test_every_thread_map_form_trains_like_the_plain_loop(examples: Any, form: str) -> None:
    example = examples("thread_maps")
    batches = example.toy.cpu_batches(count=5)
    losses, model, lanes = example.train_pipelined(batches, example.THREAD_MAPS[form])
    assert_same_training((losses, model), example.train_plain(batches))
    assert {task: lanes[task] for task in EXPECTED_LANES[form]} == EXPECTED_LANES[form]


def test_hand_built_schedule_computes_what_the_plain_code_does(examples: Any) -> None:
    example = examples("hand_built_schedule")
    results = example.compute_pipelined(4)
    assert len(results) == 4 and len(set(results)) == 4  # a fresh x every step
    assert results == example.compute_plain(4)


def test_custom_executor_sees_every_iteration_and_changes_nothing(examples: Any) -> None:
    example = examples("custom_executor")
    batches = example.toy.cpu_batches(count=3)
    *trained, log = example.train_pipelined(batches)
    assert_same_training(tuple(trained), example.train_plain(batches))
    step = "zero_grad -> forward -> backward -> optimizer_step"
    assert log == [
        "[iteration 0] h2d",  # the prefill: batch 1 is copied ahead
        f"[iteration 1] h2d -> {step}",
        f"[iteration 2] h2d -> {step}",
        f"[iteration 3] {step}",
    ]


@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_amp_example_matches_the_plain_amp_loop(examples: Any, device_type: str) -> None:
    amp = examples("amp")
    device = torch.device(device_type)
    batches = amp.make_batches(6, seed=1)
    pipelined = amp.train_pipelined(batches, device)
    plain = amp.train_plain(batches, device)
    assert_same_training(pipelined, plain)
    if device.type == "cpu":  # the documented no-op path
        scaler = amp.ScaledStep(plain[1], device, max_norm=0.5).scaler
        assert not scaler.is_enabled()


def test_hstu_usage_example_matches_the_plain_loop() -> None:
    result = subprocess.run(
        [sys.executable, "examples/spec/hstu_usage.py", "--steps", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 steps" in result.stdout
    assert "HSTU prefetch pipeline: the same as the plain loop (bit for bit)" in result.stdout
