"""Worker functions for the two-rank HSTU tests (spawned processes import this)."""

from __future__ import annotations

import asyncio
import faulthandler
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import collect

from aiopipe import PipelineStateError
from hstu_tasks import (
    DataConfig,
    HSTUPipelineFactory,
    KarmarkarKarpShuffler,
    ModelConfig,
    OptimizerConfig,
    SyntheticHSTUData,
    build_training,
    join_local_group,
    leave_and_exit,
    quiet_torchrec,
)
from hstu_tasks.runners import PIPELINES, parameter_checksum, run_pipeline

DATA = DataConfig(batch_size=8, max_history=24)
STEPS = 6


def join(rank: int, port: int) -> None:
    faulthandler.enable()  # a native abort in a worker shows every thread's stack
    quiet_torchrec()
    join_local_group(rank, 2, port)


def finish() -> None:
    leave_and_exit(0)  # every check of the worker has passed


def setup(kind: str = "sgd") -> Any:
    return build_training(ModelConfig(), DATA, OptimizerConfig(kind=kind), seed=3)


def equality_worker(rank: int, port: int, kind: str) -> None:
    join(rank, port)
    outcomes = {}
    runs = [(mode, None) for mode in PIPELINES] + [("aiopipe", "per_task")]
    for mode, thread_map in runs:
        # per_task: every task on its own lane, so only the ticket order keeps the
        # embedding all-to-alls and DDP's all-reduces in one order on both ranks
        training = setup(kind)
        data = SyntheticHSTUData(DATA, STEPS, seed=5, rank=rank)
        result = run_pipeline(mode, training, data, thread_map=thread_map)
        outcomes[f"{mode}/{thread_map}"] = (result.global_losses(), parameter_checksum(training.model))
    reference = outcomes["none/None"]
    assert len(reference[0]) == STEPS
    for mode, outcome in outcomes.items():
        assert outcome == reference, (mode, outcome, reference)
    finish()


def contract_worker(rank: int, port: int) -> None:
    join(rank, port)
    training = setup()
    data = SyntheticHSTUData(DATA, 4, seed=1, rank=rank)
    assert HSTUPipelineFactory.list() == ["hstu_prefetch_sparse_dist", "hstu_sparse_dist"]
    with pytest.raises(KeyError, match="unknown HSTU pipeline"):
        HSTUPipelineFactory.create("nope")
    pipe = HSTUPipelineFactory.create(
        "hstu_prefetch_sparse_dist", model=training.model, optimizer=training.optimizer,
        device=training.device,
    )  # fmt: skip

    async def scenario() -> None:
        # end of data: M batches -> M results, then StopAsyncIteration, again and again
        source = iter(data)
        results = await collect(pipe, source)
        assert len(results) == 4 and all(len(r) == 3 for r in results)
        with pytest.raises(StopAsyncIteration):
            await pipe.progress(source)
        assert len(pipe._state.pipelined_modules) == 1  # torchrec rewrote the embeddings
        # train -> eval switch mid-epoch: drain, then a new iterator, no weight change
        train_source = iter(SyntheticHSTUData(DATA, 6, seed=2, rank=rank))
        await pipe.progress(train_source)
        with pytest.raises(PipelineStateError, match="in flight"):
            await pipe.progress(iter(data))
        assert len(await pipe.drain()) == 2
        training.model.eval()
        before = parameter_checksum(training.model)
        evaluated = await collect(pipe, iter(data))
        assert len(evaluated) == 4 and parameter_checksum(training.model) == before
        training.model.train()
        # detach gives the model back with its own forward; attach + progress rebuild
        model = pipe.detach()
        losses, _ = model(next(iter(data)).to(training.device))
        assert losses.shape[1] == DATA.num_tasks
        with pytest.raises(PipelineStateError, match="detached"):
            await pipe.progress(iter(data))
        pipe.attach()
        assert len(await collect(pipe, iter(data))) == 4

    asyncio.run(scenario())
    # the blocking form raises StopIteration at the end, like torchrec
    blocking = pipe.blocking()
    source = iter(data)
    assert len(list(blocking.results(source))) == 4
    with pytest.raises(StopIteration):
        blocking.progress(source)
    blocking.shutdown()
    finish()


def shuffle_worker(rank: int, port: int) -> None:
    join(rank, port)
    shuffler = KarmarkarKarpShuffler()
    config = DataConfig(batch_size=8, max_history=40, length_distribution="zipf")
    batches = list(SyntheticHSTUData(config, 3, seed=9, rank=rank))
    for batch in batches:
        mine = shuffler.finish_shuffle(shuffler.start_shuffle_async(batch))
        assert mine.batch_size == batch.batch_size
        # every sample of every rank lands on exactly one rank: compare multisets
        def signature(b: Any) -> list[tuple[int, ...]]:
            items = b.features["item"].values().split(b.features["item"].lengths().tolist())
            return sorted(tuple(i.tolist()) for i in items)

        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, (signature(batch), signature(mine)))
        before = sorted(s for original, _ in gathered for s in original)
        after = sorted(s for _, shuffled in gathered for s in shuffled)
        assert before == after
    # and the whole pipeline trains with it
    training = setup()
    pipe = HSTUPipelineFactory.create("hstu_sparse_dist", model=training.model,
                                      optimizer=training.optimizer, device=training.device,
                                      batch_shuffler=KarmarkarKarpShuffler())  # fmt: skip
    results = asyncio.run(collect(pipe, iter(SyntheticHSTUData(config, 5, seed=4, rank=rank))))
    assert len(results) == 5
    tokens = [float(t) for _, t, _ in results]
    reference = [float(b.loss_tokens()) for b in SyntheticHSTUData(config, 5, seed=4, rank=rank)]
    totals = torch.tensor(reference)
    dist.all_reduce(totals)
    assert tokens == totals.tolist()  # the global token count is preserved by shuffling
    pipe.shutdown()
    shuffler.close()
    finish()
