"""A DLRM training set-up on torchrec's own model, for the runners of
:mod:`~hstu_tasks.sparse.dlrm_runs` (every schedule, torchrec's classes, the plain loop).

The model is torchrec's ``DLRMTrain(DLRM(...))``: sparse features pooled by an
``EmbeddingBagCollection`` (table-wise sharded by ``DistributedModelParallel``, its
optimizer fused into backward), dense features through an MLP, pairwise dot-product
interaction, an over-arch MLP and BCE.  Batches are torchrec's ``Batch``
(``Pipelineable``), deterministic from ``(seed, rank, index)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingType
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..global_order import GlobalOrder
from ..parallel import Sharding, TrainingSetup, fill_tables

__all__ = ("DLRMConfig", "SyntheticDLRMData", "build_dlrm_training")

Optimizer = Literal["sgd", "adagrad"]


@dataclass(frozen=True)
class DLRMConfig:
    num_tables: int = 4  # one sparse feature per table
    num_embeddings: int = 500
    embedding_dim: int = 16
    num_dense: int = 8
    batch_size: int = 32
    max_ids_per_feature: int = 4
    dense_arch: tuple[int, ...] = (32, 16)  # ends at embedding_dim
    over_arch: tuple[int, ...] = (32, 1)
    lr: float = 0.05

    @property
    def features(self) -> list[str]:
        return [f"feature_{i}" for i in range(self.num_tables)]


class SyntheticDLRMData(torch.utils.data.Dataset[Batch]):
    """``num_batches`` batches for one rank (a map-style dataset: a ``DataLoader``
    with ``batch_size=None`` hands them out as they are).

    Without ``world_size``, batch ``i`` depends only on (seed, rank, i).  With it, the
    data is one global sequence of samples, sample ``n`` depending only on (seed, n):
    global batch ``i`` holds samples ``sample_offset + i * G`` onwards (``G =
    config.batch_size * world_size``) and rank ``r`` takes its ``r``-th equal part, so
    jobs of any world size with the same global batch train the same samples, and
    ``sample_offset`` resumes a job where a checkpoint of any world size stopped.
    """

    def __init__(
        self,
        config: DLRMConfig,
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
        self.config, self.num_batches, self.seed, self.rank = config, num_batches, seed, rank

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        return (self[index] for index in range(self.num_batches))

    def __getitem__(self, index: int) -> Batch:
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch {index} of {self.num_batches}")
        if self.order is not None:
            return self._global_batch(index)
        config = self.config
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.rank) * 1_000_033 + index)
        size, tables = config.batch_size, config.num_tables
        dense = torch.randn(size, config.num_dense, generator=generator)
        lengths = torch.randint(1, config.max_ids_per_feature + 1, (tables * size,), generator=generator)
        ids = torch.randint(0, config.num_embeddings, (int(lengths.sum()),), generator=generator)
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=config.features, values=ids, lengths=lengths)
        labels = (dense[:, 0] + 0.5 * torch.randn(size, generator=generator) > 0).long()
        return Batch(dense_features=dense, sparse_features=sparse, labels=labels)

    batch = __getitem__  # the name SampleLedger reads batches by

    def sample_ids(self, index: int) -> range:
        """The global ids of the samples in this rank's batch ``index``."""
        if self.order is None:
            raise ValueError("per-rank data has no global sample ids: pass world_size")
        return self.order.sample_ids(index, self.config.batch_size)

    def _global_batch(self, index: int) -> Batch:
        """Every value of a sample is a hash of (seed, sample id, slot), so a sample
        does not depend on the batch (hence the world size) it falls in; vectorised
        over the batch (a generator per sample would cost ten times more)."""
        config = self.config
        ids = self.sample_ids(index)
        tables, most = config.num_tables, config.max_ids_per_feature
        slots = 2 * config.num_dense + 2 + tables + tables * most
        bits = _sample_bits(self.seed, torch.arange(ids.start, ids.stop), slots)
        normals = _normals(bits[:, : 2 * config.num_dense + 2])
        dense, noise = normals[:, : config.num_dense], normals[:, config.num_dense]
        counts = 1 + bits[:, -tables * (most + 1) : -tables * most] % most  # [B, T]
        choices = (bits[:, -tables * most :] % config.num_embeddings).view(-1, tables, most)
        taken = torch.arange(most) < counts.unsqueeze(-1)  # [B, T, M]
        # a KeyedJaggedTensor is feature-major: every sample's ids of feature 0 first
        values = choices.transpose(0, 1)[taken.transpose(0, 1)]
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=config.features, values=values, lengths=counts.t().reshape(-1)
        )
        labels = (dense[:, 0] + 0.5 * noise > 0).long()
        return Batch(dense_features=dense, sparse_features=sparse, labels=labels)


_MASK_63 = (1 << 63) - 1


def _sample_bits(seed: int, samples: torch.Tensor, slots: int) -> torch.Tensor:
    """``[len(samples), slots]`` non-negative 63-bit hashes of (seed, sample, slot):
    murmur3's 64-bit finaliser on int64 (multiplication wraps; the shifts are made
    logical by masking)."""
    salt = seed * 0x9E3779B97F4A7C15 & _MASK_63
    x = (samples.unsqueeze(1) * slots + torch.arange(slots)) ^ salt
    # 0xff51afd7ed558ccd and 0xc4ceb9fe1a85ec53 as signed int64
    for multiplier in (-49064778989728563, -4265267296055464877):
        x = (x ^ ((x >> 33) & ((1 << 31) - 1))) * multiplier
    return (x ^ ((x >> 33) & ((1 << 31) - 1))) & _MASK_63


def _normals(bits: torch.Tensor) -> torch.Tensor:
    """Standard normals (float32) from pairs of hashed columns, by Box-Muller."""
    uniform = ((bits >> 10).double() + 0.5) / float(1 << 53)  # in (0, 1)
    first, second = uniform[:, 0::2], uniform[:, 1::2]
    return (torch.sqrt(-2.0 * torch.log(first)) * torch.cos(2.0 * torch.pi * second)).float()


class RowWiseOnCPUSharder(EmbeddingBagCollectionSharder):
    """torchrec's sharder of an ``EmbeddingBagCollection``, row-wise plans allowed on
    a CPU: torchrec offers them for CUDA only, but its row-wise pooled sharding runs
    on gloo too, and a CPU job then has a plan that splits every table's rows."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = list(super().sharding_types(compute_device_type))
        if ShardingType.ROW_WISE.value not in types:
            types.append(ShardingType.ROW_WISE.value)
        return types


def build_dlrm_training(
    config: DLRMConfig, optimizer: Optimizer = "sgd", *, seed: int = 0,
    device: torch.device | str = "cpu", sharding: Sharding = "table_wise",
    compute_kernel: str | None = None,
) -> TrainingSetup:  # fmt: skip
    """torchrec's DLRM with its tables sharded by ``sharding`` (``optimizer`` fused
    into their backward) and a dense ``optimizer`` of the same kind, combined
    torchrec's way; identical on every call with the same arguments.  The initial
    weights depend on ``seed`` only, not on the plan or the world size.
    ``compute_kernel``: torchrec's kernel for every table (``"fused_uvm_caching"``:
    rows in host memory behind a cache on the GPU, what the prefetch schedule is
    for); the planner's choice by default."""
    if not dist.is_initialized():
        raise RuntimeError("call init_distributed() (or run under torchrun) first")
    device = torch.device(device)
    kind: Callable[..., torch.optim.Optimizer] = (
        torch.optim.SGD if optimizer == "sgd" else torch.optim.Adagrad
    )
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(name=f"table_{i}", embedding_dim=config.embedding_dim,
                           num_embeddings=config.num_embeddings, feature_names=[feature])
        for i, feature in enumerate(config.features)
    ]  # fmt: skip
    model = DLRMTrain(DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=config.num_dense, dense_arch_layer_sizes=list(config.dense_arch),
        over_arch_layer_sizes=list(config.over_arch), dense_device=device,
    ))  # fmt: skip
    apply_optimizer_in_backward(kind, model.model.sparse_arch.parameters(), {"lr": config.lr})
    sharders: list[Any] = [RowWiseOnCPUSharder()]
    kernels = None if compute_kernel is None else [compute_kernel]
    constraints = {
        table.name: ParameterConstraints(sharding_types=[sharding], compute_kernels=kernels)
        for table in tables
    }
    topology = Topology(world_size=dist.get_world_size(), compute_device=device.type)
    plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
        model, sharders, dist.GroupMember.WORLD
    )
    sharded = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    fill_tables(sharded, {table.name: (table.num_embeddings, table.embedding_dim)
                          for table in tables}, seed)  # fmt: skip
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(sharded.named_parameters())),
                                  lambda params: kind(params, lr=config.lr))  # fmt: skip
    return TrainingSetup(sharded, CombinedOptimizer([sharded.fused_optimizer, dense]), device)
