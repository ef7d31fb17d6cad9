"""``BlockingSparseDist``: the blocking form of a pipeline on a torchrec-rewritten
model -- torchrec's calling convention (``progress`` raises ``StopIteration``), with
the lifetime calls torchrec's classes have: ``detach()``, ``attach()``, and for a
training pipeline ``eval_pipeline()``, in the blocking form too."""

from __future__ import annotations

from typing import Any

import torch

from aiopipe import BlockingPipeline, ConfigurationTypeError

__all__ = ("BlockingSparseDist",)


class BlockingSparseDist(BlockingPipeline):
    """``pipe.blocking()`` of the sparse-dist family and the HSTU pipeline."""

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
            raise ConfigurationTypeError(f"{type(self.pipeline).__name__} has no "
                                         f"eval_pipeline()")  # fmt: skip
        blocking: BlockingSparseDist = make(**options).blocking()
        return blocking
