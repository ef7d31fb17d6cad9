"""hstu_tasks.SparseDistPipeline: torchrec's sparse-dist pipelines for any sharded
model (torchrec's DLRM here), on 2 ranks with gloo."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Iterator

import pytest

import sparse_workers
from aiopipe import BadBatchError
from conftest import collect
from hstu_tasks import DLRMConfig, SparseDistPipeline, SyntheticDLRMData, build_dlrm_training
from hstu_tasks.sparse_sources import without_last_two
from one_rank import one_rank_group

pytestmark = pytest.mark.distributed


def spawn(worker: object, *args: object) -> None:
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(worker, args=(port, *args), nprocs=2, join=True)  # type: ignore[arg-type]


def test_trains_like_torchrec_and_the_plain_loop_bit_for_bit() -> None:
    """SGD and Adagrad (tables and dense part), per-step losses and final parameters:
    the plain loop, torchrec's TrainPipelineSparseDist, the pipeline's async and
    blocking forms; and, against torchrec, custom_model_fwd with
    execute_all_batches=False."""
    spawn(sparse_workers.equality_worker)


def test_train_and_eval_interleave_and_share_one_model() -> None:
    """Evaluation between training steps over three persistent-worker epochs; then
    the contract of a train and an eval pipeline on one model (refusals, detach and
    attach)."""
    spawn(sparse_workers.eval_worker)


@pytest.mark.parametrize("items", [0, 1, 2, 3, 5])
def test_execute_all_batches_false_drops_the_last_two_batches_after_reading_them(items: int) -> None:
    source = iter(range(items))
    assert list(without_last_two(source)) == list(range(max(items - 2, 0)))
    assert next(source, "read") == "read"


async def test_execute_all_batches_false_with_an_async_source() -> None:
    async def numbers() -> AsyncIterator[int]:
        for number in range(4):
            yield number

    wrapped = without_last_two(numbers())
    assert isinstance(wrapped, AsyncIterator) and not isinstance(wrapped, Iterator)
    assert [n async for n in wrapped] == [0, 1]


def test_a_refused_first_batch_counts_in_the_source_position() -> None:
    config = DLRMConfig(num_embeddings=200, batch_size=16)
    with one_rank_group():
        setup = build_dlrm_training(config, "sgd", seed=3)
        source = iter([None, *SyntheticDLRMData(config, 3)])
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device)

        async def run() -> tuple[int, int, int]:
            async with pipe:
                with pytest.raises(BadBatchError, match="Pipelineable"):  # before tracing
                    await pipe.progress(source)
                results = await collect(pipe, source)  # the same source goes on
                assert pipe.engine is not None
                stats = pipe.engine.statistics()
                return len(results), stats.returned, stats.refused

        assert asyncio.run(run()) == (3, 3, 1)  # position: returned + refused items
