"""The result types the pipelines declare, as a user's type checker sees them: mypy
(strict, with the project's configuration) on a snippet that uses them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

USES_HSTU_RESULTS = '''
from typing import Any, assert_type

import torch

from hstu_tasks import HSTUPipeline

Step = tuple[torch.Tensor, torch.Tensor, Any]


async def train(pipe: HSTUPipeline, source: Any) -> float:
    assert_type(await pipe.progress(source), Step)
    assert_type(await pipe.drain(), list[Step])
    async for result in pipe.results(source):
        assert_type(result, Step)
    loss_sum, tokens, _ = await pipe.progress(source)
    return float(loss_sum / tokens)
'''


def test_hstu_pipeline_results_are_typed_loss_sum_tokens_output(tmp_path: Path) -> None:
    snippet = tmp_path / "uses_hstu_results.py"
    snippet.write_text(USES_HSTU_RESULTS)
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(ROOT / ".mypy_cache"), str(snippet)],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
