"""Two ranks on gloo: collectives from several lanes keep one order on every rank.

The collectives are blocking (gloo's async ops tolerate order mismatches that would
hang NCCL).  Same-shaped all-reduces carrying different magnitudes are issued from
three lanes with random jitter: a swapped order on one rank would pair different
tensors across ranks and give wrong sums, so the sums prove the order.
"""

from __future__ import annotations

import os
import random
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import aiopipe
from aiopipe import AsyncExecutor, CollectiveOrderError, Pipeline, Task, TaskContext
from hstu_tasks import leave_and_exit

pytestmark = pytest.mark.distributed

MAGNITUDE = {"shuffle": 1.0, "input_dist": 100.0, "tokens": 10_000.0, "grads": 1_000_000.0}
STEPS = 40


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init(rank: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )  # fmt: skip


def collective_tasks(rank: int, sums: dict[str, list[float]]) -> list[Task]:
    rng = random.Random(rank * 7919)

    def all_reduce(ctx: TaskContext) -> None:
        time.sleep(rng.random() * 3e-3)  # jitter: lanes race differently on each rank
        name = ctx.task.name
        value = torch.full((64,), MAGNITUDE[name] * (rank + 1))
        dist.all_reduce(value)  # blocking
        sums.setdefault(name, []).append(float(value[0]))

    return [
        Task.from_fn("shuffle", all_reduce, lookahead=1, stream="memcpy", nccl=True),
        Task.from_fn("input_dist", all_reduce, lookahead=1, stream="data_dist", nccl=True),
        Task.from_fn("tokens", all_reduce, nccl=True),
        Task.from_fn("grads", all_reduce, nccl=True),
    ]


def ordered_worker(rank: int, port: int) -> None:
    init(rank, port)
    sums: dict[str, list[float]] = {}
    thread_map = {"shuffle": "io", "input_dist": "dist", "tokens": "compute", "grads": "dist"}
    executor = AsyncExecutor(thread_map, check_collective_order=10)
    pipe = Pipeline(collective_tasks(rank, sums), executor=executor)

    async def train() -> int:
        async with pipe:
            return len([r async for r in pipe.results(iter(range(STEPS)))])

    assert aiopipe.run(train()) == STEPS
    for name, magnitude in MAGNITUDE.items():
        assert sums[name] == [3 * magnitude] * STEPS, (rank, name, sums[name][:5])
    leave_and_exit(0)  # no native teardown at exit (leave_and_exit says why)


def mismatch_worker(rank: int, port: int) -> None:
    init(rank, port)
    noop = lambda ctx: None  # noqa: E731
    # rank 1 declares its collectives in another order: the check must refuse it
    names = ["a", "b"] if rank == 0 else ["b", "a"]
    tasks = [Task.from_fn(name, noop, nccl=True, stream=name) for name in names]
    pipe = Pipeline(tasks, executor=AsyncExecutor(check_collective_order=1))

    async def train() -> None:
        async with pipe:
            await pipe.progress(iter(range(3)))

    with pytest.raises(CollectiveOrderError, match=r"iteration 0:\n  rank 0: batch 0, "
                       r"collectives \('a', 'b'\)\n  rank 1: batch 0, collectives \('b', 'a'\)\n"
                       r"Every rank must run the same schedule"):  # fmt: skip
        aiopipe.run(train())
    leave_and_exit(0)


#: Batches per rank: rank 1's source ends three batches earlier.
UNEVEN = (12, 9)


def uneven_worker(rank: int, port: int) -> None:
    """Same-shaped blocking all-reduces a batch ahead and on the batch itself: once
    rank 1's source ends, rank 0's extra collective would pair with one of rank 1's."""
    init(rank, port)
    sums: dict[str, list[float]] = {}

    def all_reduce(ctx: TaskContext) -> None:
        value = torch.ones(4)
        dist.all_reduce(value)  # blocking
        sums.setdefault(ctx.task.name, []).append(float(value[0]))

    tasks = [Task.from_fn("input_dist", all_reduce, lookahead=1, nccl=True),
             Task.from_fn("grads", all_reduce, nccl=True)]  # fmt: skip
    pipe = Pipeline(tasks, executor=AsyncExecutor(check_collective_order=1))

    async def train() -> int:
        results = 0
        async with pipe:
            async for _ in pipe.results(range(UNEVEN[rank])):
                results += 1
        return results

    with pytest.raises(CollectiveOrderError) as info:
        aiopipe.run(train())
    assert str(info.value).startswith(
        "ranks are about to issue different collectives at iteration 9:\n"
        "  rank 0: batches 8-9, collectives ('input_dist', 'grads')\n"
        "  rank 1: batch 8, collectives ('grads',)\n"
        "The ranks are on different batches: their sources hold different numbers of batches"
    ), str(info.value)
    # nothing mismatched was issued: every collective so far paired with its own
    assert sums == {"input_dist": [2.0] * 9, "grads": [2.0] * 8}
    leave_and_exit(0)


def uneven_without_lookahead_worker(rank: int, port: int) -> None:
    """With no lookahead there is no iteration after the last batch: rank 1 ends
    unchecked, and its next pass meets rank 0, still in the first pass, at the check."""
    init(rank, port)

    def all_reduce(ctx: TaskContext) -> None:
        dist.all_reduce(torch.ones(4))

    pipe = Pipeline([Task.from_fn("grads", all_reduce, nccl=True)], expect_result=False,
                    executor=AsyncExecutor(check_collective_order=1))  # fmt: skip

    async def train() -> list[int]:
        passes = []
        async with pipe:
            for _ in range(2):
                passes.append(len([r async for r in pipe.results(range(UNEVEN[rank]))]))
        return passes

    with pytest.raises(CollectiveOrderError) as info:
        aiopipe.run(train())
    number = 9 if rank == 0 else 0  # where each rank stands
    assert str(info.value).startswith(
        f"ranks are about to issue different collectives at iteration {number}:\n"
        f"  rank 0: iteration 9, batch 9, collectives ('grads',)\n"
        f"  rank 1: iteration 0, batch 0, collectives ('grads',)\n"
        f"The ranks are on different batches"
    ), str(info.value)
    leave_and_exit(0)


def spawn(worker: object) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(free_port(),), nprocs=2, join=True)  # type: ignore[arg-type]


def test_collectives_from_several_lanes_keep_one_order_on_every_rank() -> None:
    spawn(ordered_worker)


def test_collective_order_check_catches_ranks_that_disagree() -> None:
    spawn(mismatch_worker)


def test_collective_order_check_catches_ranks_with_different_numbers_of_batches() -> None:
    spawn(uneven_worker)
    spawn(uneven_without_lookahead_worker)
