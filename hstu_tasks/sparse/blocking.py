"""``BlockingSparseDist``: the blocking form of a pipeline on a torchrec-rewritten
model -- torchrec's calling convention (``progress`` raises ``StopIteration``), with
the lifetime calls torchrec's classes have: ``detach()``, ``attach()``, and for a
training pipeline ``eval_pipeline()``, in the blocking form too."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from aiopipe import BlockingPipeline

if TYPE_CHECKING:
    from .base import SparseDistBase

__all__ = ("BlockingSparseDist",)


class BlockingSparseDist(BlockingPipeline):
    """``pipe.blocking()`` of the sparse-dist family and the HSTU pipeline."""

    def __init__(self, pipeline: SparseDistBase[Any]) -> None:
        super().__init__(pipeline)

    def detach(self) -> torch.nn.Module:
        """The pipeline's ``detach()``: the model back, with its own forwards."""
        model: torch.nn.Module = self.pipeline.detach()
        return model

    def attach(self, model: torch.nn.Module | None = None) -> None:
        """The pipeline's ``attach()``: go on after ``detach()``, on ``model`` if given."""
        self.pipeline.attach(model)

    def eval_pipeline(self, **options: Any) -> BlockingSparseDist:
        """The blocking form of the training pipeline's ``eval_pipeline(**options)``: an
        evaluation pipeline on the same model, run between training steps."""
        make = getattr(self.pipeline, "eval_pipeline", None)
        if make is None:
            raise AttributeError(f"{type(self.pipeline).__name__} has no eval_pipeline(): "
                                 f"it is not a training pipeline")  # fmt: skip
        blocking: BlockingSparseDist = make(**options).blocking()
        return blocking
