"""Batch shufflers: rebalance the attention workload across data-parallel ranks.

HSTU's cost grows with the square of each user's sequence, so equal-sized batches
can take very different times on different ranks.  ``KarmarkarKarpShuffler``
re-partitions the global batch (all ranks' samples) into equal-count per-rank batches
whose workloads are as even as the balanced largest-differencing method makes them.
Two phases, so the partitioning overlaps other work:

1. ``start_shuffle_async(batch)``: all-gather the per-sample workloads, then
   partition in a background thread;
2. ``finish_shuffle(work)``: all-gather the batches and keep this rank's samples.

``IdentityShuffler`` (the default) keeps every batch as it is, with no collective.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .data import HSTUBatch

__all__ = (
    "BatchShuffler",
    "IdentityShuffler",
    "KarmarkarKarpShuffler",
    "balanced_partition",
    "hstu_workload",
)


class BatchShuffler(Protocol):
    is_identity: bool

    def start_shuffle_async(self, batch: HSTUBatch) -> Any: ...

    def finish_shuffle(self, work: Any) -> HSTUBatch: ...


class IdentityShuffler:
    is_identity = True

    def start_shuffle_async(self, batch: HSTUBatch) -> HSTUBatch:
        return batch

    def finish_shuffle(self, work: HSTUBatch) -> HSTUBatch:
        return work


def hstu_workload(batch: HSTUBatch) -> torch.Tensor:
    """Per-sample cost estimate: tokens squared (attention) plus tokens (the rest)."""
    tokens = 2 * batch.history_lengths() + batch.num_candidates
    return tokens * tokens + tokens


def balanced_partition(weights: Sequence[int], parts: int) -> list[list[int]]:
    """Split item indices into ``parts`` lists of equal length with sums as equal as
    the balanced largest-differencing method (Karmarkar-Karp) makes them.

    ``len(weights)`` must be a multiple of ``parts``.  Deterministic: ties break on
    indices, so every rank computes the same partition.  Lists are returned by
    ascending sum.
    """
    if parts < 1 or len(weights) % parts:
        raise ValueError(f"{len(weights)} items cannot be split evenly into {parts} parts")
    if not weights:
        return [[] for _ in range(parts)]
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    counter = itertools.count()
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for start in range(0, len(order), parts):
        # each initial partition puts one item in every subset
        subsets = [(weights[i], [i]) for i in order[start : start + parts]]
        subsets.sort(key=lambda s: (-s[0], s[1]))
        heapq.heappush(heap, (-(subsets[0][0] - subsets[-1][0]), next(counter), subsets))
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # largest of one with smallest of the other: the differences cancel
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))]
        merged.sort(key=lambda s: (-s[0], min(s[1])))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(counter), merged))
    subsets = heap[0][2]
    return [sorted(items) for _, items in sorted(subsets, key=lambda s: (s[0], min(s[1])))]


@dataclass
class ShuffleWork:
    batch: HSTUBatch
    partition: Future[list[list[int]]]


class KarmarkarKarpShuffler:
    """Workload-balancing shuffler over ``process_group`` (default: the world)."""

    is_identity = False

    def __init__(
        self,
        process_group: Any = None,
        workload: Callable[[HSTUBatch], torch.Tensor] = hstu_workload,
    ) -> None:
        self._group = process_group
        self._workload = workload
        self._pool: ThreadPoolExecutor | None = None  # made on first use, again after close()

    def _world(self) -> tuple[int, int]:
        return dist.get_rank(self._group), dist.get_world_size(self._group)

    def start_shuffle_async(self, batch: HSTUBatch) -> ShuffleWork:
        _, world = self._world()
        local = self._workload(batch).to(torch.int64)
        gathered = _all_gather_padded(local, world, self._group)  # batch sizes may differ
        weights = torch.cat(gathered).tolist()
        if len(weights) % world:  # every rank sees the same sizes: all raise together
            raise ValueError(
                f"the ranks' batches hold {[len(g) for g in gathered]} samples, "
                f"{len(weights)} in all, which {world} ranks cannot share equally"
            )
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiopipe-kk")
        return ShuffleWork(batch, self._pool.submit(balanced_partition, weights, world))

    def finish_shuffle(self, work: ShuffleWork) -> HSTUBatch:
        rank, world = self._world()
        everyone = _all_gather_batch(work.batch, world, self._group)
        mine = work.partition.result()[rank]
        return _select(everyone, mine)

    def close(self) -> None:
        """Stop the partitioning thread; a later shuffle starts a new one (a pipeline
        closes its shuffler at shutdown, and the same shuffler may serve the next)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _all_gather_padded(tensor: torch.Tensor, world: int, group: Any) -> list[torch.Tensor]:
    """All-gather tensors whose first dimension differs across ranks."""
    size = torch.tensor([tensor.shape[0]], device=tensor.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(int(s) for s in sizes))
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [g[: int(s)] for g, s in zip(gathered, sizes)]


def _all_gather_batch(batch: HSTUBatch, world: int, group: Any) -> HSTUBatch:
    """One batch holding every rank's samples, rank 0's first."""
    item, action = batch.features["item"], batch.features["action"]
    lengths = torch.stack([item.lengths(), action.lengths(), batch.num_candidates], dim=1)
    all_lengths = torch.cat(_all_gather_padded(lengths, world, group)).T  # [3, samples]
    items = torch.cat(_all_gather_padded(item.values(), world, group))
    actions = torch.cat(_all_gather_padded(action.values(), world, group))
    labels = torch.cat(_all_gather_padded(batch.labels, world, group))
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["item", "action"],
        values=torch.cat([items, actions]),
        lengths=torch.cat([all_lengths[0], all_lengths[1]]),
    )
    return HSTUBatch(features, all_lengths[2], labels)


def _take(values: torch.Tensor, lengths: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    starts = torch.cumsum(lengths, 0) - lengths
    pieces = [values[int(starts[s]) : int(starts[s] + lengths[s])] for s in samples.tolist()]
    return torch.cat(pieces) if pieces else values[:0]


def _select(batch: HSTUBatch, samples: list[int]) -> HSTUBatch:
    """The samples ``samples`` of ``batch``, in that order."""
    index = torch.tensor(samples, dtype=torch.int64)
    item, action = batch.features["item"], batch.features["action"]
    items = _take(item.values(), item.lengths(), index)
    actions = _take(action.values(), action.lengths(), index)
    labels = _take(batch.labels, batch.num_candidates, index)
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["item", "action"],
        values=torch.cat([items, actions]),
        lengths=torch.cat([item.lengths()[index], action.lengths()[index]]),
    )
    return HSTUBatch(features, batch.num_candidates[index], labels)
