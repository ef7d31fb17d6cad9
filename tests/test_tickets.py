"""The collective ticket lock, alone and under an AsyncExecutor with random jitter."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from conftest import collect

from aiopipe import AsyncExecutor, Pipeline, Task, TaskContext, TicketAbortedError
from aiopipe.errors import CollectiveOrderError
from aiopipe._core.tickets import TicketLock


async def test_tickets_are_admitted_in_order() -> None:
    lock = TicketLock()
    lock.reset()
    admitted: list[int] = []

    async def take(ticket: int) -> None:
        await lock.acquire(ticket)
        admitted.append(ticket)
        await asyncio.sleep(0)
        lock.release(ticket)

    await asyncio.gather(*(take(t) for t in (3, 1, 4, 0, 2)))
    assert admitted == [0, 1, 2, 3, 4]


async def test_a_release_wakes_only_the_next_ticket() -> None:
    lock = TicketLock()
    lock.reset()
    waiters = [asyncio.ensure_future(lock.acquire(t)) for t in (1, 2, 3)]
    await asyncio.sleep(0)
    assert lock.statistics().waiting == (1, 2, 3)
    lock.release(0)
    await asyncio.sleep(0)
    assert [w.done() for w in waiters] == [True, False, False]
    assert lock.statistics().waiting == (2, 3)
    lock.release(1)
    lock.release(2)
    await asyncio.gather(*waiters[1:])


async def test_abort_wakes_loop_and_thread_waiters_with_an_error() -> None:
    lock = TicketLock()
    lock.reset()
    loop_waiter = asyncio.ensure_future(lock.acquire(2))
    thread_error: list[BaseException] = []

    def block() -> None:
        try:
            lock.acquire_blocking(1)
        except TicketAbortedError as exc:
            thread_error.append(exc)

    thread = threading.Thread(target=block)
    thread.start()
    while len(lock.statistics().waiting) < 2:
        await asyncio.sleep(0.001)
    lock.release(0, failed=True)
    thread.join(5)
    with pytest.raises(TicketAbortedError):
        await loop_waiter
    assert thread_error and lock.statistics().aborted
    with pytest.raises(TicketAbortedError):  # further acquires fail too, until reset
        await lock.acquire(3)
    lock.reset()
    await lock.acquire(0)


async def test_misuse_is_reported() -> None:
    lock = TicketLock()
    lock.reset()
    with pytest.raises(CollectiveOrderError, match="while 0 holds"):
        lock.release(1)
    await lock.acquire(0)
    lock.release(0)
    with pytest.raises(CollectiveOrderError, match="already used"):
        await lock.acquire(0)
    waiter = asyncio.ensure_future(lock.acquire(5))
    await asyncio.sleep(0)
    with pytest.raises(CollectiveOrderError, match="still wait"):
        lock.reset()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert lock.statistics().waiting == ()


def jittered_collective(log: list[str], lock: threading.Lock, rng: random.Random):  # type: ignore[no-untyped-def]
    def body(ctx: TaskContext) -> None:
        time.sleep(rng.random() * 2e-4)
        with lock:
            log.append(ctx.task.name)
        time.sleep(rng.random() * 2e-4)

    return body


@pytest.mark.one_loop
async def test_collectives_keep_topological_order_under_jitter() -> None:
    """600 progresses; collectives spread over three lanes with random delays must
    always start in topological order."""
    rng = random.Random(1234)
    log: list[str] = []
    lock = threading.Lock()
    body = jittered_collective(log, lock, rng)
    tasks = [
        Task.from_fn("shuffle_a", body, lookahead=1, stream="memcpy", nccl=True),
        Task.from_fn("shuffle_b", body, lookahead=1, stream="memcpy", nccl=True),
        Task.from_fn("input_dist", body, lookahead=1, stream="data_dist", nccl=True),
        Task.from_fn("local_work", body),
        Task.from_fn("allreduce", body, nccl=True),
        Task.from_fn("grads", body, nccl=True, depends_on=("local_work",)),
    ]
    thread_map = {"shuffle_a": "io", "shuffle_b": "io", "input_dist": "dist",
                  "local_work": "compute", "allreduce": "compute", "grads": "dist"}  # fmt: skip
    async with Pipeline(tasks, thread_map=thread_map) as pipe:
        progresses = len(await collect(pipe, iter(range(600))))
    assert progresses == 600
    collectives = [name for name in log if name != "local_work"]
    expected_steady = ["shuffle_a", "shuffle_b", "input_dist", "allreduce", "grads"]
    # prefill: lookahead-1 collectives only; drain: lookahead-0 only
    assert collectives[:3] == expected_steady[:3]
    assert collectives[-2:] == expected_steady[3:]
    steady = collectives[3:-2]
    assert len(steady) == 599 * 5
    for start in range(0, len(steady), 5):
        assert steady[start : start + 5] == expected_steady, f"progress {start // 5 + 1}"


async def test_collectives_on_one_lane_need_no_lock() -> None:
    tasks = [Task.from_fn(f"c{i}", lambda ctx: None, nccl=True) for i in range(3)]
    executor = AsyncExecutor(lambda task: "one")
    async with Pipeline(tasks, executor=executor) as pipe:
        await collect(pipe, iter(range(3)))
    layout = next(iter(executor._layouts.values()))
    assert layout.tickets == {} and len(layout.collectives) == 3
