"""Synthetic HSTU ranking data and the batch type torchrec pipelines.

Each sample is a user history of (item, action) pairs followed by candidate items to
rank.  Features travel as one ``KeyedJaggedTensor`` with keys ``"item"`` (history
items then candidates, per sample) and ``"action"`` (history actions); each candidate
carries multi-task labels bit-encoded in one integer.  Batches are deterministic from
``(seed, rank, index)`` and differ across ranks -- or, given a ``world_size``, are
each rank's share of global batches drawn from one global order of samples, the
same at any world size (what a resized job needs).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from .global_order import GlobalOrder

__all__ = ("DataConfig", "HSTUBatch", "SyntheticHSTUData", "check_batch")


@dataclass
class HSTUBatch(Pipelineable):
    """One batch: ``features`` (KJT: ``item``, ``action``), ``num_candidates`` per
    sample, ``labels`` per candidate (bit t = task t)."""

    features: KeyedJaggedTensor
    num_candidates: torch.Tensor
    labels: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.num_candidates.numel())

    def loss_tokens(self) -> torch.Tensor:
        """How many loss terms this batch contributes (its candidates), as a tensor
        on the batch's device, ready to be all-reduced."""
        return self.num_candidates.sum()

    def to(self, device: torch.device, non_blocking: bool = False) -> HSTUBatch:
        return HSTUBatch(
            self.features.to(device=device, non_blocking=non_blocking),
            self.num_candidates.to(device=device, non_blocking=non_blocking),
            self.labels.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.features.record_stream(stream)  # type: ignore[arg-type]
        self.num_candidates.record_stream(stream)  # type: ignore[arg-type]
        self.labels.record_stream(stream)  # type: ignore[arg-type]

    def pin_memory(self) -> HSTUBatch:
        return HSTUBatch(
            self.features.pin_memory(), self.num_candidates.pin_memory(), self.labels.pin_memory()
        )

    def history_lengths(self) -> torch.Tensor:
        return self.features["action"].lengths()


def check_batch(batch: object) -> None:
    """Raise ``TypeError``/``ValueError`` naming what is wrong with a batch that
    would otherwise fail deep inside torchrec or the model (cheap: shapes and dtypes,
    plus one sum on the host)."""
    if not isinstance(batch, HSTUBatch):
        raise TypeError(f"expected an HSTUBatch, got {type(batch).__name__}")
    features, candidates, labels = batch.features, batch.num_candidates, batch.labels
    if not isinstance(features, KeyedJaggedTensor) or features.keys() != ["item", "action"]:
        raise ValueError("features must be a KeyedJaggedTensor with keys ['item', 'action']")
    for name, tensor in (("features values", features.values()),
                         ("num_candidates", candidates), ("labels", labels)):  # fmt: skip
        if tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must hold integer ids, got dtype {tensor.dtype}")
    if candidates.dim() != 1 or labels.dim() != 1:
        raise ValueError(
            f"num_candidates and labels must be 1-D, got shapes {tuple(candidates.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if features.stride() != candidates.numel():
        raise ValueError(
            f"features describe {features.stride()} samples but num_candidates has "
            f"{candidates.numel()}"
        )
    if candidates.device.type != "cpu":
        return  # the host checks below would wait for the device
    if labels.numel() != int(candidates.sum()):
        raise ValueError(
            f"labels has {labels.numel()} entries, one per candidate expected "
            f"({int(candidates.sum())})"
        )
    # keys are ["item", "action"] and stride is the batch size: the flat lengths hold
    # the items' lengths, then the actions' (slicing them skips building two
    # JaggedTensors: this runs for every batch on the event loop's thread)
    lengths, size = features.lengths(), candidates.numel()
    items, actions = lengths[:size], lengths[size:]
    expected = actions + candidates
    if not torch.equal(items, expected):  # each user: one item per action, then candidates
        wrong = (items != expected).nonzero().flatten().tolist()
        raise ValueError(
            f"sample(s) {wrong[:5]} have item lengths {items[wrong[:5]].tolist()}, expected "
            f"action lengths + num_candidates = {expected[wrong[:5]].tolist()}"
        )


@dataclass(frozen=True)
class DataConfig:
    batch_size: int = 16
    min_history: int = 4
    max_history: int = 48
    max_candidates: int = 4
    num_items: int = 2000
    num_actions: int = 8
    num_tasks: int = 3
    length_distribution: Literal["uniform", "zipf"] = "uniform"
    zipf_alpha: float = 1.2

    def __post_init__(self) -> None:
        sizes = {name: getattr(self, name) for name in (
            "batch_size", "min_history", "max_candidates", "num_items", "num_actions",
            "num_tasks")}  # fmt: skip
        too_small = [f"{name}={value}" for name, value in sizes.items() if value < 1]
        if too_small:
            raise ValueError(f"DataConfig sizes must be >= 1, got {', '.join(too_small)}")
        if self.max_history < self.min_history:
            raise ValueError(f"need min_history <= max_history, got {self.min_history} > "
                             f"{self.max_history}")  # fmt: skip
        if self.length_distribution not in ("uniform", "zipf"):
            raise ValueError(f"length_distribution must be 'uniform' or 'zipf', got "
                             f"{self.length_distribution!r}")  # fmt: skip


class SyntheticHSTUData:
    """``num_batches`` batches for one rank; iterating again yields the same batches.

    Without ``world_size``, batch ``i`` depends only on (seed, rank, i).  With it,
    the data is one global sequence of samples, sample ``n`` depending only on
    (seed, n): global batch ``i`` holds samples ``sample_offset + i * G`` onwards, ``G
    = config.batch_size * world_size``, and rank ``r`` takes its ``r``-th equal part.
    So a run at world size 2 and one at world size 1 (with twice the per-rank batch)
    train the same global batches, and ``sample_offset`` resumes a job at the global
    position a checkpoint of any world size recorded.  Either way
    :meth:`from_index` resumes a run at any batch.
    """

    def __init__(
        self,
        config: DataConfig,
        num_batches: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int | None = None,
        sample_offset: int = 0,
    ) -> None:
        if num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches}")
        self.order = GlobalOrder.of(rank, world_size, sample_offset)
        self.config = config
        self.num_batches = num_batches
        self.seed = seed
        self.rank = rank

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[HSTUBatch]:
        return self.from_index(0)

    def from_index(self, start: int) -> Iterator[HSTUBatch]:
        """The batches ``start, start + 1, ...`` (a resumed run's data)."""
        if not 0 <= start <= self.num_batches:
            raise ValueError(f"start must be in [0, {self.num_batches}], got {start}")
        for index in range(start, self.num_batches):
            yield self.batch(index)

    def sample_ids(self, index: int) -> range:
        """The global ids of the samples in this rank's batch ``index`` (global order)."""
        if self.order is None:
            raise ValueError("per-rank data has no global sample ids: pass world_size")
        return self.order.sample_ids(index, self.config.batch_size)

    def batch(self, index: int) -> HSTUBatch:
        if self.order is not None:
            return self._global_batch(index)
        config = self.config
        generator = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.rank) * 1_000_033 + index
        )
        history = self._history_lengths(generator, config.batch_size)
        candidates = torch.randint(1, config.max_candidates + 1, (config.batch_size,), generator=generator)
        item_lengths = history + candidates
        items = torch.randint(0, config.num_items, (int(item_lengths.sum()),), generator=generator)
        actions = torch.randint(0, config.num_actions, (int(history.sum()),), generator=generator)
        labels = torch.randint(0, 2**config.num_tasks, (int(candidates.sum()),), generator=generator)
        return _assemble(items, actions, item_lengths, history, candidates, labels)

    def _global_batch(self, index: int) -> HSTUBatch:
        """Sample by sample, each from its own generator: a sample's content must not
        depend on which batch (hence which world size) it falls in."""
        config = self.config
        parts: list[list[torch.Tensor]] = [[] for _ in range(6)]
        for sample in self.sample_ids(index):
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + sample) * 7_919 + 1)
            history = self._history_lengths(generator, 1)
            candidates = torch.randint(1, config.max_candidates + 1, (1,), generator=generator)
            items = torch.randint(0, config.num_items, (int(history + candidates),), generator=generator)
            actions = torch.randint(0, config.num_actions, (int(history),), generator=generator)
            labels = torch.randint(0, 2**config.num_tasks, (int(candidates),), generator=generator)
            for part, tensor in zip(parts, (items, actions, history + candidates, history,
                                            candidates, labels)):  # fmt: skip
                part.append(tensor)
        return _assemble(*(torch.cat(part) for part in parts))

    def _history_lengths(self, generator: torch.Generator, count: int) -> torch.Tensor:
        config = self.config
        size = (count,)
        if config.length_distribution == "uniform":
            return torch.randint(config.min_history, config.max_history + 1, size, generator=generator)
        # zipf: most users have short histories, a few very long ones
        span = config.max_history - config.min_history + 1
        ranks = torch.arange(1, span + 1, dtype=torch.float64)
        weights = ranks.pow(-config.zipf_alpha)
        picks = torch.multinomial(weights, count, replacement=True, generator=generator)
        return picks + config.min_history


def _assemble(
    items: torch.Tensor,
    actions: torch.Tensor,
    item_lengths: torch.Tensor,
    history: torch.Tensor,
    candidates: torch.Tensor,
    labels: torch.Tensor,
) -> HSTUBatch:
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["item", "action"], values=torch.cat([items, actions]),
        lengths=torch.cat([item_lengths, history]),
    )  # fmt: skip
    return HSTUBatch(features, candidates, labels)
