"""Checkpointing the HSTU training state: sharded model, fused embedding optimizer
and dense optimizer, through :class:`aiopipe.checkpoint.CheckpointManager`."""

from __future__ import annotations

from typing import Any

from aiopipe.checkpoint import CheckpointManager, materialize_optimizer_state

from .parallel import TrainingSetup

__all__ = ("restore_training", "training_state")


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
        "dense_optimizer": setup.optimizer.state_dict(),
    }


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
    materialize_optimizer_state(setup.optimizer)  # Adam creates its moments lazily
    state = training_state(setup)
    meta = manager.load(step, state, any_world_size=any_world_size)
    setup.model.load_state_dict(state["model"])
    setup.model.fused_optimizer.load_state_dict(state["fused_optimizer"])
    setup.optimizer.load_state_dict(state["dense_optimizer"])
    return step, meta
