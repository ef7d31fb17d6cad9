"""Megatron-core data parallelism for the dense part of a torchrec model.

With ``build_training(data_parallel="megatron")`` (the ``"auto"`` choice when CUDA
and megatron-core are present) the model's trainable children that torchrec does not
shard are wrapped in Megatron's ``DistributedDataParallel`` instead of torch DDP:

* backward accumulates gradients into one contiguous buffer per dtype (each
  parameter's ``main_grad``) and, with ``overlap_grad_reduce``, launches the
  all-reduce of each bucket as soon as its gradients are complete (from the second
  step on: the first one records the order in which gradients become ready);
* the ``finalize_model_grads`` task calls Megatron's ``finalize_model_grads``, which
  waits for those reductions (or issues them, without overlap);
* the dense optimizer is Megatron's (``get_megatron_optimizer``), which steps on the
  reduced ``main_grad``;
* ``zero_grad`` also zeroes the gradient buffers (``zero_grad_buffer``).

Sharded tables are left to torchrec and their fused optimizer; with
``shard_embeddings=False`` the tables are one more wrapped child.  Megatron allocates
the gradient buffers on the current CUDA device and builds its optimizer state there,
so this path needs a GPU.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardedModule, ShardingEnv

__all__ = (
    "MegatronDataParallelWrapper",
    "finalize_grads",
    "grad_buffer_chunks",
    "megatron_available",
    "megatron_optimizer",
    "require_megatron",
    "zero_grad_buffers",
)


def megatron_available() -> bool:
    """Whether megatron-core is installed (it is imported only when used)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no "megatron" package at all
        return False


@contextmanager
def _quiet() -> Iterator[None]:
    # megatron-core warns on import and config creation about optional fused kernels
    # (Transformer Engine, Apex) and its own deprecations; none concern this adapter.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def require_megatron() -> None:
    """Raise a clear ImportError when megatron-core is missing."""
    if not megatron_available():
        raise ImportError(
            "data_parallel='megatron' needs megatron-core (pip install megatron-core==0.16.1)"
        )


def ensure_model_parallel() -> None:
    """Megatron's process groups (tensor/pipeline parallel size 1: every rank is a
    data-parallel replica), created once on top of the default group."""
    require_megatron()
    with _quiet():
        from megatron.core import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    # The loss is scaled by the world size (global_loss): every rank must be a replica.
    replicas = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    if replicas != torch.distributed.get_world_size():
        raise ValueError(
            f"Megatron's data-parallel group has {replicas} of "
            f"{torch.distributed.get_world_size()} ranks (tensor, pipeline or context "
            "parallelism was set up); this adapter needs every rank to be a replica"
        )


class MegatronDataParallelWrapper(DataParallelWrapper):
    """A torchrec ``DataParallelWrapper``: every direct child of the model that holds
    no sharded module is replaced by Megatron DDP around it (the child keeps its name,
    so torchrec's tracer still sees it as one leaf and state-dict keys do not change).

    ``overlap_grad_reduce`` all-reduces gradient buckets during backward;
    ``bucket_size`` is in elements (Megatron's default when ``None``)."""

    def __init__(
        self, *, overlap_grad_reduce: bool = True, bucket_size: int | None = None
    ) -> None:
        self.overlap_grad_reduce = overlap_grad_reduce
        self.bucket_size = bucket_size

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        root = dmp._dmp_wrapped_module.to(device)  # as torchrec's default wrapper does
        self.wrap_dense_children(root)

    def wrap_dense_children(self, root: torch.nn.Module) -> None:
        """Wrap each trainable direct child of ``root`` without a sharded module (on a
        model that torchrec does not shard, every trainable child)."""
        ensure_model_parallel()
        with _quiet():
            from megatron.core.distributed import (
                DistributedDataParallel,
                DistributedDataParallelConfig,
            )
            from megatron.core.transformer import TransformerConfig

            # Megatron DDP reads only parallelism and loss flags from this config;
            # the dense part is not a Megatron transformer, so its sizes are nominal.
            config = TransformerConfig(num_layers=1, hidden_size=1, num_attention_heads=1)
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=self.overlap_grad_reduce, bucket_size=self.bucket_size
        )
        for name, child in list(root.named_children()):
            if any(isinstance(m, ShardedModule) for m in child.modules()):
                continue
            if not any(p.requires_grad for p in child.parameters()):
                continue
            with _quiet():
                wrapped = DistributedDataParallel(config, ddp_config, child)
            setattr(root, name, wrapped)


def grad_buffer_chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Megatron DDP modules inside ``model`` (empty for torch DDP)."""
    return [m for m in model.modules() if hasattr(m, "finish_grad_sync") and hasattr(
        m, "zero_grad_buffer")]  # fmt: skip


def zero_grad_buffers(chunks: Sequence[torch.nn.Module]) -> None:
    """Zero the contiguous gradient buffers before a backward (Megatron's contract)."""
    for chunk in chunks:
        chunk.zero_grad_buffer()  # type: ignore[operator]


def finalize_grads(chunks: Sequence[torch.nn.Module]) -> None:
    """Finish the data-parallel gradient reduction of ``chunks``: wait for the bucket
    all-reduces started during backward, or issue them without overlap."""
    if not chunks:
        return
    # Imported already (quietly) by the wrapper that made the chunks; no warnings
    # filter is touched here, which runs on a lane thread every step.
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(list(chunks))


def megatron_optimizer(chunks: Sequence[torch.nn.Module], kind: str, lr: float) -> Any:
    """Megatron's optimizer over the dense parameters of ``chunks``, configured to
    match ``torch.optim`` (``kind`` "sgd" or "adam"): no weight decay, no gradient
    clipping, no momentum, torch's Adam betas and epsilon."""
    with _quiet():
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(
            optimizer=kind, lr=lr, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0,
            adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
        )  # fmt: skip
        optimizer = get_megatron_optimizer(config, list(chunks))
    # One group of dense parameters gives a chain of one; its step would still compute
    # the gradient norm (a host sync every step) although nothing is clipped.
    inner = getattr(optimizer, "chained_optimizers", None)
    return inner[0] if inner is not None and len(inner) == 1 else optimizer
