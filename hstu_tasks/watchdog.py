"""``LossWatch``: catch a non-finite loss without a host synchronisation per step.

``float(loss)`` on a CUDA tensor waits for every kernel queued before it, so a check
in every step would stop the host from running ahead of the device and defeat the
pipeline's lookahead.  Instead each step's loss is copied into pinned host memory
without blocking, behind an event; the copy is read once its event has completed --
usually a step or two later, at the latest ``max_lag`` steps later (then the oldest
copy is waited for).  The error names the batch whose loss was bad.  On CPU there is
nothing to wait for and every loss is checked in its own step.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

__all__ = ("LossWatch",)


class LossWatch:
    """Checks ``loss_sum`` values for finiteness, lagging behind the device."""

    def __init__(self, max_lag: int = 3) -> None:
        if max_lag < 1:
            raise ValueError(f"max_lag must be >= 1, got {max_lag}")
        self.max_lag = max_lag
        # (batch index, host copy, event that completes it) in submission order
        self._pending: collections.deque[tuple[int, torch.Tensor, Any]] = collections.deque()

    @property
    def pending(self) -> int:
        """Losses copied but not checked yet."""
        return len(self._pending)

    def submit(self, loss: torch.Tensor, batch_index: int) -> None:
        """Queue ``loss`` (of batch ``batch_index``) for checking; check every copy that
        has arrived, and wait for the oldest if more than ``max_lag`` are pending."""
        loss = loss.detach()
        if loss.device.type != "cuda":
            self._check(batch_index, loss)
            return
        host = torch.empty(loss.shape, dtype=loss.dtype, pin_memory=True)
        host.copy_(loss, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.defer(batch_index, host, event)

    def defer(self, batch_index: int, host: torch.Tensor, event: Any) -> None:
        """Queue a host copy that is complete once ``event`` (``query()`` /
        ``synchronize()``, a CUDA event) has completed."""
        self._pending.append((batch_index, host, event))
        self._check_until(self.max_lag)

    def poll(self) -> None:
        """Check the copies that have arrived (never blocks)."""
        while self._pending and self._pending[0][2].query():
            batch_index, host, _ = self._pending.popleft()
            self._check(batch_index, host)

    def flush(self) -> None:
        """Wait for and check every pending copy (at the end of a source)."""
        self._check_until(0)

    def _check_until(self, most_pending: int) -> None:
        """Check what has arrived, then wait for the oldest copies until at most
        ``most_pending`` are left unchecked."""
        self.poll()
        while len(self._pending) > most_pending:
            self._pending[0][2].synchronize()
            self.poll()

    def discard(self) -> None:
        """Forget pending copies (the batches in flight were dropped)."""
        self._pending.clear()

    @staticmethod
    def _check(batch_index: int, loss: torch.Tensor) -> None:
        value = float(loss)
        if not math.isfinite(value):
            raise FloatingPointError(f"loss became {value} at batch {batch_index}")
