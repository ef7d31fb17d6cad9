"""A source's own torch work runs on the event loop's thread, where it opens an
OpenMP worker pool.  While the lanes run the compute, that pool must not outlive
the read: with it, libgomp counts more pool threads than CPUs and the lanes'
parallel regions slow down (``AsyncExecutor.release_loop_thread_pool``).  Where the
compute runs on the loop itself, its pool is left alone."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from aiopipe import AsyncExecutor, Pipeline, Task, TaskContext
from aiopipe._core.openmp import release_thread_pool

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc"),
    pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread opens no pool"),
]


def threads_not_python() -> int:
    """The process's threads that Python did not start (OpenMP workers, here)."""
    started = {thread.native_id for thread in threading.enumerate()}
    return sum(1 for tid in os.listdir("/proc/self/task") if int(tid) not in started)


def parallel_torch_work() -> None:
    torch.ones(1 << 20).add_(1)  # above torch's grain size: an OpenMP region


def items() -> Iterator[int]:
    for n in range(4):
        parallel_torch_work()
        yield n


async def async_items() -> AsyncIterator[int]:
    for n in items():
        yield n


def echo(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])


@pytest.fixture
def no_loop_pool() -> int:
    """The count of non-Python threads with the calling (loop) thread's pool freed."""
    if not release_thread_pool():
        pytest.skip("libgomp is not loaded: torch uses another OpenMP runtime")
    parallel_torch_work()
    with_pool = threads_not_python()
    release_thread_pool()
    assert threads_not_python() < with_pool  # the work opened a pool; freeing it ended it
    return threads_not_python()


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_source_leaves_no_pool_on_the_loop_while_the_lanes_compute(
    no_loop_pool: int, kind: str
) -> None:
    source = items() if kind == "sync" else async_items()
    lanes = AsyncExecutor({"step": "compute"})
    async with Pipeline([Task.from_fn("step", echo)], executor=lanes) as pipe:
        assert [await pipe.progress(source) for _ in range(3)] == [0, 1, 2]  # the 4th read ahead
        assert threads_not_python() == no_loop_pool


async def test_the_loop_keeps_its_pool_where_it_runs_the_compute(no_loop_pool: int) -> None:
    async with Pipeline([Task.from_fn("step", echo)], executor="sequential") as pipe:
        assert await pipe.progress(items()) == 0
        assert threads_not_python() > no_loop_pool
