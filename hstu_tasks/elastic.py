"""Resizing a job: the global batch rule and the record of the samples consumed.

A job that resumes on another number of ranks keeps its data position global: the
samples consumed, in one global order (``SyntheticHSTUData(..., world_size=...)``).
Each rank's share of the next global batch follows from that position and the
current world size, so nothing is skipped or trained twice across a resize.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch.distributed as dist

from .data import HSTUBatch, SyntheticHSTUData

__all__ = ("SampleLedger", "rank_batch_size")


def rank_batch_size(global_batch_size: int, world_size: int) -> int:
    """Each rank's batch when ``world_size`` ranks share a global batch: refused when
    it does not divide (uneven shares would weigh the ranks' samples differently
    under DDP's gradient mean and change the optimisation)."""
    if global_batch_size < 1 or world_size < 1:
        raise ValueError(
            f"global batch size and world size must be >= 1, got {global_batch_size} and "
            f"{world_size}"
        )
    if global_batch_size % world_size:
        raise ValueError(
            f"the global batch size {global_batch_size} does not divide into {world_size} "
            f"equal rank batches: pick a multiple of {world_size}, or keep the per-rank batch "
            f"instead (which changes the global batch, hence the optimisation)"
        )
    return global_batch_size // world_size


class SampleLedger:
    """The global sample ids of the batches a rank's source yielded, folded -- once
    applied -- into a SHA-256 chained sample by sample in global order.

    Chaining per sample (``d = sha256(d || id)``) makes the digest depend on the
    ordered ids only, not on how they were cut into batches or ranks, and keeps it a
    hex string a checkpoint can carry across a resize.
    """

    def __init__(self, data: SyntheticHSTUData, digest: str = "") -> None:
        self.data = data
        self.digest = digest
        self._yielded: list[range] = []
        self._folded = 0

    def source(self) -> Iterator[HSTUBatch]:
        """``data``'s batches, each one's ids noted as it is taken."""
        for index in range(len(self.data)):
            self._yielded.append(self.data.sample_ids(index))
            yield self.data.batch(index)

    def fold(self, applied: int) -> str:
        """Fold the ids of batches up to ``applied`` (this run's applied steps) into
        the digest and return it.  A collective: every rank calls it at the same
        progress boundary (the ranks' ids are gathered to interleave them)."""
        mine = [list(ids) for ids in self._yielded[self._folded : applied]]
        if len(mine) != applied - self._folded:
            raise ValueError(f"{applied} steps applied but only {len(self._yielded)} batches taken")
        shares: list[list[list[int]]] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            shares = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(shares, mine)
        digest = bytes.fromhex(self.digest)
        for step in range(len(mine)):
            for rank_share in shares:  # rank r holds part r of the global batch
                for sample in rank_share[step]:
                    digest = hashlib.sha256(digest + sample.to_bytes(8, "little")).digest()
        self.digest = digest.hex()
        self._folded = applied
        return self.digest
