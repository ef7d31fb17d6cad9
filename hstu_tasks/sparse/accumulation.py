"""Gradient accumulation for every schedule of the sparse family
(``SparseDistPipeline(..., grad_accumulation=k)``): torchrec's
``GradientAccumulationWrapper`` as part of the step's own tasks.

The schedules' ``zero_grad`` and ``optimizer_step`` tasks ask a
:class:`GradAccumulation` instead of calling the optimizer: gradients are zeroed at the
start of each group of ``k`` batches and the optimizer steps after its last one.  A
source that ends inside a group steps once more for that partial group, before
``progress`` reports the end, and the next source starts a group of its own -- the
plain loop's ``if (i + 1) % k == 0 or i == last: optimizer.step()`` per pass.

As in torchrec's wrapper the loss is not divided by ``k`` (scale it in
``custom_model_fwd`` for the mean), and a fused optimizer (torchrec's sharded tables)
updates its tables in every batch's backward: accumulation reaches the parameters
of the optimizer passed to the pipeline that ``step()`` updates.  Every batch's
backward all-reduces the data-parallel gradients (no ``no_sync``), so a partial group
at a source's end steps with gradients every rank agrees on.
"""

from __future__ import annotations

from typing import Any

from aiopipe import ConfigurationError

__all__ = ("GradAccumulation",)


class GradAccumulation:
    """Where one pipeline is in its group of ``steps`` batches."""

    def __init__(self, steps: int = 1) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigurationError(f"grad_accumulation must be an int >= 1, got {steps!r}")
        self.steps = steps
        #: Batches trained since the optimizer last stepped.
        self.pending = 0

    def zero_grad(self, optimizer: Any) -> None:
        """The step's ``zero_grad``: only at the start of a group."""
        if self.pending == 0:
            optimizer.zero_grad()

    def step(self, optimizer: Any) -> None:
        """The step's ``optimizer.step()``: only after the group's last batch."""
        self.pending += 1
        if self.pending == self.steps:
            optimizer.step()
            self.pending = 0

    def finish(self, optimizer: Any) -> None:
        """The source has ended: a partial group still updates, and leaves no gradient
        behind (semi-sync zeroes after its step, not before the next batch)."""
        if self.pending:
            optimizer.step()
            optimizer.zero_grad()
            self.pending = 0

    def restart(self, optimizer: Any) -> None:
        """``reset()``: drop the gradients the partial group and the dropped batches
        left, now -- semi-sync zeroes after its step, not before the next batch, so
        the next group would have added to them -- and start a new group."""
        optimizer.zero_grad()
        self.pending = 0
