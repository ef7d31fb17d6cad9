"""Checkpointing a sharded training state -- the model, the embedding optimizer fused
into its backward and the dense optimizer -- of the HSTU and DLRM set-ups, through
:class:`aiopipe.checkpoint.CheckpointManager`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from aiopipe.checkpoint import CheckpointError, CheckpointManager, materialize_optimizer_state

from .parallel import TrainingSetup

__all__ = ("JobCheckpoints", "dense_optimizer", "restore_training", "training_state")


def training_state(setup: TrainingSetup) -> dict[str, Any]:
    """What a checkpoint holds: the model (its tables as sharded tensors), the fused
    optimizer applied in backward, and the dense optimizer (sharded torch-DDP setups
    only)."""
    if setup.data_parallel != "torch" or not setup.sharded:
        raise NotImplementedError(
            "checkpoints cover sharded torch-DDP setups (a Megatron-DDP model's state dict "
            "cannot be loaded back through its wrapper; an unsharded one has no fused "
            "optimizer): build it with data_parallel='torch', shard_embeddings=True"
        )
    return {
        "model": setup.model.state_dict(),
        "fused_optimizer": setup.model.fused_optimizer.state_dict(),
        "dense_optimizer": dense_optimizer(setup).state_dict(),
    }


def dense_optimizer(setup: TrainingSetup) -> Any:
    """The optimizer of the dense parameters: the set-up's own (HSTU), or the part of
    torchrec's ``CombinedOptimizer`` that is not the fused one (DLRM).  Saved apart
    from the fused optimizer because a table-wise rank's fused state holds only its
    own tables, while the dense state is the same on every rank."""
    parts = getattr(setup.optimizer, "optimizers", None)  # torchrec's CombinedOptimizer
    if parts is None:
        return setup.optimizer
    fused = setup.model.fused_optimizer
    dense = [optimizer for _, optimizer in parts if optimizer is not fused]
    if len(dense) != 1:
        raise NotImplementedError(
            f"a combined optimizer of {len(parts)} parts: checkpoints expect the fused "
            f"one and one dense optimizer"
        )
    return dense[0]


def optimizer_options(setup: TrainingSetup) -> list[str]:
    """The names of the dense optimizer's options (its first parameter group's keys):
    what tells one optimizer from another (Adagrad has ``lr_decay``, SGD
    ``momentum``), recorded with each checkpoint, compared on restore."""
    groups = getattr(dense_optimizer(setup), "param_groups", None) or [{}]
    return sorted(str(key) for key in groups[0] if key != "params")


def restore_training(
    setup: TrainingSetup, manager: CheckpointManager, *, any_world_size: bool = False
) -> tuple[int, dict[str, Any]]:
    """Load the newest complete checkpoint into a freshly built ``setup``; return its
    step (0 when there is none: start from scratch) and its meta.

    ``any_world_size`` accepts a checkpoint of another number of ranks: DCP reshards
    the tables (any plan), their fused optimizer state and the replicated dense
    state onto this job's plan.  Only for a global data position
    (``SyntheticHSTUData(..., world_size=...)``)."""
    step = manager.latest()
    if step is None:
        return 0, {}
    saved = manager.describe(step).get("meta", {}).get("dense_optimizer_options")
    if saved is not None and saved != optimizer_options(setup):
        raise CheckpointError(
            f"checkpoint step {step} was written with another optimizer: its options were "
            f"{saved}, this job's are {optimizer_options(setup)} (its state would be "
            f"dropped, or be missing)"
        )
    dense = dense_optimizer(setup)
    materialize_optimizer_state(dense)  # Adam creates its moments lazily
    state = training_state(setup)
    meta = manager.load(step, state, any_world_size=any_world_size)
    setup.model.load_state_dict(state["model"])
    setup.model.fused_optimizer.load_state_dict(state["fused_optimizer"])
    dense.load_state_dict(state["dense_optimizer"])
    return step, meta


class JobCheckpoints:
    """A training job's checkpoints under ``directory`` with a global data position
    (the examples' ``--checkpoint-dir``): one every ``every`` steps, carrying the
    job's history -- per-step global losses, samples consumed and their SHA-256 --
    so that a job resumed on any number of ranks goes on where it stopped.

    Every rank constructs it and calls its methods together (they are collectives).
    ``saved`` is the newest checkpoint's meta, read before the model is built (to
    size the batches), ``{}`` when there is none."""

    def __init__(self, directory: str, every: int) -> None:
        if every < 1:
            raise ValueError(f"a checkpoint every {every} steps: it must be >= 1")
        self.manager = CheckpointManager(directory)
        self.every = every
        latest = self.manager.latest()
        record = self.manager.describe(latest) if latest is not None else {}
        self.saved: dict[str, Any] = dict(record.get("meta", {}))
        self.saved_world_size: int | None = record.get("world_size")

    def restore(self, setup: TrainingSetup) -> tuple[int, dict[str, Any]]:
        """Load the newest checkpoint into ``setup``, resharded onto this job's ranks;
        its step (0: none) and meta."""
        return restore_training(setup, self.manager, any_world_size=True)

    def save_if_due(self, position: int, setup: TrainingSetup, *, losses: list[float],
                    global_batch_size: int, samples_consumed: int,
                    samples_sha256: Callable[[], str], last: bool = False) -> bool:  # fmt: skip
        """Checkpoint step ``position`` when it is a multiple of ``every`` or the job's
        ``last`` (a finished job started again then has nothing to redo);
        ``samples_sha256`` is called only then (it is a collective).  A step whose
        loss is not finite raises ``FloatingPointError`` instead, on every rank (the
        losses are global): its state would poison every run resumed from it, and on
        a GPU the loss watch checks a step's loss a few steps later."""
        if position % self.every and not last:
            return False
        for step, loss in enumerate(losses, start=1):
            if not math.isfinite(loss):
                raise FloatingPointError(f"the loss of step {step} is {loss}: no checkpoint "
                                         f"written at step {position}")  # fmt: skip
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.manager.save(position, training_state(setup), meta={
            "losses": losses, "world_size": world_size, "global_batch_size": global_batch_size,
            "samples_consumed": samples_consumed, "samples_sha256": samples_sha256(),
            "dense_optimizer_options": optimizer_options(setup),
        })  # fmt: skip
        return True
