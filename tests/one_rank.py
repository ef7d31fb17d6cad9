"""A one-process gloo group and a tiny HSTU training setup, for tests (and doc
snippets) that need torch.distributed but not a second rank."""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Iterator

import torch.distributed as dist

from hstu_tasks import DataConfig, ModelConfig, OptimizerConfig, TrainingSetup, build_training
from hstu_tasks import quiet_torchrec

TINY_DATA = DataConfig(batch_size=4, max_history=8)
TINY_MODEL = ModelConfig(embedding_dim=16, num_layers=1, mlp_hidden=16)


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """Rank 0 of a one-process gloo group on a free port, left again on exit."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    quiet_torchrec()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_training(seed: int = 3) -> TrainingSetup:
    """The HSTU model (tables sharded by torchrec) and its optimizer, small enough
    for a test step to take milliseconds.  Needs :func:`one_rank_group`."""
    return build_training(TINY_MODEL, TINY_DATA, OptimizerConfig(), seed=seed,
                          data_parallel="torch")  # fmt: skip
