"""One global order of samples cut into ranks' batches: what lets a job resume on
another number of ranks without skipping or repeating a sample."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ("GlobalOrder",)


@dataclass(frozen=True)
class GlobalOrder:
    """Global batch ``i`` holds samples ``sample_offset + i * G`` onwards, ``G =
    batch_size * world_size``, and rank ``rank`` takes its ``rank``-th equal part;
    ``sample_offset`` is where a resumed job's data starts."""

    rank: int
    world_size: int
    sample_offset: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.sample_offset < 0:
            raise ValueError(f"sample_offset must be >= 0, got {self.sample_offset}")

    @classmethod
    def of(cls, rank: int, world_size: int | None, sample_offset: int) -> GlobalOrder | None:
        """The order of a data set given these arguments; ``None`` (per-rank data)
        without a ``world_size``, where a ``sample_offset`` is refused."""
        if world_size is not None:
            return cls(rank, world_size, sample_offset)
        if sample_offset:
            raise ValueError(f"sample_offset={sample_offset} needs world_size (the global "
                             f"order it counts in)")  # fmt: skip
        return None

    def sample_ids(self, index: int, batch_size: int) -> range:
        """The global ids of the samples in this rank's batch ``index``."""
        first = self.sample_offset + (index * self.world_size + self.rank) * batch_size
        return range(first, first + batch_size)
