"""Building the sharded model and its optimizers, and the plain training step.

Embedding tables are row-wise sharded by torchrec's ``DistributedModelParallel``
with a fused optimizer applied in backward (or, with ``shard_embeddings=False``,
replicated like the rest).  The dense part is replicated either with torch DDP
(DMP's default data-parallel wrapper, gloo on CPU) and stepped by a ``torch.optim``
optimizer, or -- on GPU with megatron-core -- with Megatron DDP and Megatron's
optimizer (see ``megatron.py``).  The loss is ``loss_sum * dp_size / global_tokens``
with the loss-token count all-reduced, so every rank differentiates the exact global
mean.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from .data import DataConfig, HSTUBatch
from .megatron import (
    MegatronDataParallelWrapper,
    finalize_grads,
    grad_buffer_chunks,
    megatron_available,
    megatron_optimizer,
    require_megatron,
    zero_grad_buffers,
)
from .model import HSTURankingModel, ModelConfig

__all__ = (
    "DataParallel",
    "Sharding",
    "OptimizerConfig",
    "join_local_group",
    "leave_and_exit",
    "quiet_torchrec",
    "stop_on_ctrl_c",
    "TrainingSetup",
    "build_training",
    "default_device",
    "global_loss",
    "init_distributed",
    "fill_tables",
    "initialize_tables",
    "plain_train_step",
    "resolve_data_parallel",
    "shard_model",
)


#: "torch": torch DDP + ``torch.optim``; "megatron": Megatron DDP + Megatron's
#: optimizer (CUDA only); "auto": megatron when the device is CUDA and megatron-core
#: is installed, torch otherwise.
DataParallel = Literal["auto", "torch", "megatron"]

#: torchrec's sharding type for both tables: rows split over every rank, or each
#: table whole on one rank.
Sharding = Literal["row_wise", "table_wise"]


@dataclass(frozen=True)
class OptimizerConfig:
    kind: Literal["sgd", "adam"] = "sgd"
    dense_lr: float = 0.05
    embedding_lr: float = 0.05

    def __post_init__(self) -> None:
        if self.kind not in ("sgd", "adam"):  # the tables and the dense part must agree
            raise ValueError(f"OptimizerConfig.kind must be 'sgd' or 'adam', got {self.kind!r}")


@dataclass
class TrainingSetup:
    #: ``DistributedModelParallel`` when the tables are sharded; otherwise the model
    #: itself, or torch DDP around it.
    model: torch.nn.Module
    #: ``torch.optim`` for torch DDP, Megatron's optimizer with Megatron DDP (both
    #: offer ``zero_grad()``, ``step()`` and ``state_dict()``).
    optimizer: Any
    device: torch.device
    data_parallel: Literal["torch", "megatron"] = "torch"
    sharded: bool = True


def init_distributed(timeout: datetime.timedelta | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes, or a one-process gloo group.

    ``timeout`` bounds every collective: a rank whose peer died or stalls fails
    with an error after it instead of hanging (torch's default is 30 minutes for
    gloo, 10 for NCCL)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # one GPU per local rank, before anything touches the device
        device, gpus = default_device(), torch.cuda.device_count()
        if device.index is not None and device.index >= gpus:
            raise RuntimeError(f"local rank {device.index} has no GPU of its own: this machine "
                               f"has {gpus}; start at most {gpus} ranks per machine")  # fmt: skip
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timeout)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    threads = max(1, (os.cpu_count() or 1) // local_ranks)
    no_env = "OMP_NUM_THREADS" not in os.environ
    if backend == "gloo" and no_env and threads < torch.get_num_threads():
        # Several ranks on one CPU: intra-op pools must not oversubscribe the cores.
        # Only to lower it: set even to torch's own default, each thread's first
        # parallel op then fixes its OpenMP and MKL thread counts, and the pipelined
        # DLRM example ran at 0.8x the speed (docs/performance.md).
        torch.set_num_threads(threads)
    return dist.get_rank(), dist.get_world_size()


def join_local_group(
    rank: int, world_size: int, port: int, timeout: datetime.timedelta | None = None
) -> tuple[int, int]:
    """Join a group of ``world_size`` processes on this host started without
    torchrun (e.g. by ``torch.multiprocessing.spawn``), rank 0 serving ``port``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip
    return init_distributed(timeout)


def stop_on_ctrl_c(main: Callable[[], None]) -> None:
    """Run a training script's ``main``; Ctrl-C ends it with one line saying how to go
    on, instead of a traceback from wherever the step was, and exit status 130 (the
    shell's for SIGINT)."""
    try:
        main()
    except KeyboardInterrupt:
        print(f"{Path(sys.argv[0]).name}: interrupted; with --checkpoint-dir the same command "
              f"resumes from the newest checkpoint", file=sys.stderr)  # fmt: skip
        leave_and_exit(130, barrier=False)  # the peers stop too, or time out


def leave_and_exit(code: int = 0, *, barrier: bool = True) -> NoReturn:
    """End a worker process: leave the process group (together with the others when
    ``barrier``), flush the output, and exit without running native static
    destructors.  With torchrec's pipelined input distribution those aborted at
    interpreter exit ("terminate called without an active exception", no Python
    frame) in roughly 1 of 100 two-rank runs, after all work was done -- enough to
    fail a job under torchrun, which treats the abort as a worker failure."""
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def quiet_torchrec() -> None:
    """torchrec's planner and torch's FX tracer log warnings meant for their own
    developers on every model build; keep them out of training output."""
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"(torchrec|fbgemm_gpu)\..*")
    warnings.filterwarnings("ignore", message=".*is_fx_tracing.*")
    # torchrec's sharded tables are ShardedTensors, which torch's checkpoint code
    # announces as deprecated on every load.
    warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)


def default_device() -> torch.device:
    """This process's device: the GPU of its local rank when CUDA is available."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def resolve_data_parallel(
    choice: DataParallel, device: torch.device
) -> Literal["torch", "megatron"]:
    """The data-parallel implementation ``choice`` means on ``device``; a clear error
    when Megatron is asked for where it cannot run."""
    if choice == "auto":
        return "megatron" if device.type == "cuda" and megatron_available() else "torch"
    if choice == "megatron":
        if device.type != "cuda":
            raise ValueError(
                "data_parallel='megatron' needs a CUDA device: Megatron-core allocates its "
                f"gradient buffers and optimizer state on the GPU (device is {device})"
            )
        require_megatron()
        return "megatron"
    if choice != "torch":
        raise ValueError(f"data_parallel must be 'auto', 'torch' or 'megatron', got {choice!r}")
    return "torch"


def shard_model(
    model_config: ModelConfig,
    data_config: DataConfig,
    optimizer: OptimizerConfig,
    *,
    seed: int,
    device: torch.device,
    data_parallel_wrapper: DataParallelWrapper | None = None,
    sharding: Sharding = "row_wise",
) -> DistributedModelParallel:
    """The HSTU model with its tables sharded by ``sharding`` (their optimizer fused
    into backward) and its dense part wrapped by ``data_parallel_wrapper`` (torch DDP
    when ``None``)."""
    torch.manual_seed(seed)
    model = HSTURankingModel(model_config, data_config)
    # fbgemm's CPU kernels fuse SGD and Adagrad but not Adam into the backward.
    embedding_optimizer: type[torch.optim.Optimizer] = torch.optim.SGD
    if optimizer.kind == "adam":
        embedding_optimizer = torch.optim.Adam if device.type == "cuda" else torch.optim.Adagrad
    apply_optimizer_in_backward(
        embedding_optimizer, model.embeddings.parameters(), {"lr": optimizer.embedding_lr}
    )
    sharders = [EmbeddingCollectionSharder()]
    constraints = {
        name: ParameterConstraints(sharding_types=[sharding])
        for name in ("item_table", "action_table")
    }
    topology = Topology(world_size=dist.get_world_size(), compute_device=device.type)
    plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
        model, sharders, dist.GroupMember.WORLD
    )
    sharded = DistributedModelParallel(
        model, device=device, plan=plan, sharders=sharders,
        data_parallel_wrapper=data_parallel_wrapper,
    )  # fmt: skip
    initialize_tables(sharded, model_config, data_config, seed)
    return sharded


def initialize_tables(
    model: torch.nn.Module, model_config: ModelConfig, data_config: DataConfig, seed: int
) -> None:
    """The HSTU tables' weights from ``seed`` only (:func:`fill_tables`)."""
    fill_tables(model, {"item_table": (data_config.num_items, model_config.embedding_dim),
                        "action_table": (data_config.num_actions, model_config.embedding_dim)},
                seed)  # fmt: skip


def fill_tables(model: torch.nn.Module, shapes: Mapping[str, tuple[int, int]], seed: int) -> None:
    """Give the tables named in ``shapes`` (rows, dim) weights that depend on ``seed``
    only, not on the plan or the world size: torchrec initialises each shard from
    the rank's random stream, so a table's rows would differ between a 1-rank and a
    2-rank job (and a resized job could not be compared with an uninterrupted one).
    Each rank draws every whole table and keeps its shards' rows: fine for these
    tables, a cost for huge ones."""
    state = model.state_dict()
    with torch.no_grad():
        for number, (table, (rows, dim)) in enumerate(shapes.items()):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + number)
            bound = (1.0 / rows) ** 0.5  # torchrec's default init range
            full = torch.empty(rows, dim).uniform_(-bound, bound, generator=generator)
            for name, value in state.items():
                if not name.endswith(f".{table}.weight"):
                    continue
                if not hasattr(value, "local_shards"):  # a whole table: one of the plan's
                    value.copy_(full)
                    continue
                for shard in value.local_shards():
                    (row, column) = shard.metadata.shard_offsets
                    (height, width) = shard.metadata.shard_sizes
                    shard.tensor.copy_(full[row : row + height, column : column + width])
    model.load_state_dict(state)  # the shards' tensors may be copies, not views


def build_training(
    model_config: ModelConfig,
    data_config: DataConfig,
    optimizer: OptimizerConfig,
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
    data_parallel: DataParallel = "auto",
    shard_embeddings: bool = True,
    sharding: Sharding = "row_wise",
) -> TrainingSetup:
    """The model and its dense optimizer, identical on every call with the same
    arguments (so several pipelines can be compared bit for bit).

    ``data_parallel`` picks how the dense part is replicated (see
    :data:`DataParallel`).  ``shard_embeddings=False`` skips torchrec's sharding: the
    tables are ordinary parameters replicated like the rest and stepped by the dense
    optimizer, at ``dense_lr`` (for machines without fbgemm's GPU kernels; the model
    then uses only plain torch operators).  ``sharding`` picks torchrec's plan for
    the tables (see :data:`Sharding`)."""
    if sharding not in ("row_wise", "table_wise"):
        raise ValueError(f"sharding must be 'row_wise' or 'table_wise', got {sharding!r}")
    if not dist.is_initialized():
        raise RuntimeError("call init_distributed() (or run under torchrun) first")
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":  # Megatron allocates on the current device
        torch.cuda.set_device(device)
    kind = resolve_data_parallel(data_parallel, device)
    if not shard_embeddings:
        return _replicated_training(model_config, data_config, optimizer, seed, device, kind)
    if kind == "megatron":
        model = shard_model(model_config, data_config, optimizer, seed=seed, device=device,
                            data_parallel_wrapper=MegatronDataParallelWrapper(),
                            sharding=sharding)  # fmt: skip
        chunks = grad_buffer_chunks(model)
        return TrainingSetup(model, megatron_optimizer(chunks, optimizer.kind, optimizer.dense_lr),
                             device, "megatron")  # fmt: skip
    model = shard_model(model_config, data_config, optimizer, seed=seed, device=device,
                        sharding=sharding)  # fmt: skip
    dense = [p for name, p in model.named_parameters() if "embeddings." not in name]
    return TrainingSetup(model, _torch_optimizer(dense, optimizer), device)


def _torch_optimizer(
    params: list[torch.nn.Parameter], config: OptimizerConfig
) -> torch.optim.Optimizer:
    if config.kind == "sgd":
        return torch.optim.SGD(params, lr=config.dense_lr)
    return torch.optim.Adam(params, lr=config.dense_lr)


def _replicated_training(
    model_config: ModelConfig,
    data_config: DataConfig,
    optimizer: OptimizerConfig,
    seed: int,
    device: torch.device,
    kind: Literal["torch", "megatron"],
) -> TrainingSetup:
    torch.manual_seed(seed)
    model: torch.nn.Module = HSTURankingModel(model_config, data_config, embedding_device=device)
    model.to(device)
    if kind == "megatron":
        MegatronDataParallelWrapper().wrap_dense_children(model)
        chunks = grad_buffer_chunks(model)
        return TrainingSetup(model, megatron_optimizer(chunks, optimizer.kind, optimizer.dense_lr),
                             device, "megatron", sharded=False)  # fmt: skip
    if dist.get_world_size() > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=None if device.type == "cpu" else [device]
        )
    params = list(model.parameters())
    return TrainingSetup(model, _torch_optimizer(params, optimizer), device, sharded=False)


def dp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def global_tokens(batch: HSTUBatch) -> torch.Tensor:
    """This batch's loss tokens summed over every rank (a blocking all-reduce)."""
    tokens = batch.loss_tokens().to(torch.float32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tokens)
    return tokens


def global_loss(loss_sum: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The loss to differentiate: with DDP averaging gradients over ``dp_size`` ranks,
    this gives the gradient of the global per-token mean."""
    return loss_sum * dp_size() / tokens


def plain_train_step(
    setup: TrainingSetup, batch: HSTUBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One unpipelined step: the reference every pipeline must reproduce."""
    batch = batch.to(setup.device)
    chunks = grad_buffer_chunks(setup.model)
    zero_grad_buffers(chunks)
    setup.optimizer.zero_grad()
    tokens = global_tokens(batch)
    losses, output = setup.model(batch)
    loss_sum = losses.sum()
    global_loss(loss_sum, tokens).backward()
    finalize_grads(chunks)
    setup.optimizer.step()
    return loss_sum.detach(), tokens, output
