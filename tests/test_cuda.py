"""The device protocol on a real GPU: CUDA events order the streams, and waits on
device work keep the loop free.  The same protocol is checked on every machine with
recording streams (test_streams_events.py) and fake events (test_gpu_wait.py); these
tests are the GPU evidence and skip where there is no CUDA device."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch
from conftest import collect

from aiopipe import Pipeline, StreamPool, Task, TaskContext, copy_to_host, wait_for_event

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

N = 1 << 20


def sleep_cycles(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds``."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    stop.record()
    stop.synchronize()
    return int(10_000_000 * seconds * 1000 / start.elapsed_time(stop))


@pytest.mark.parametrize("executor", ["sequential", "async"])
async def test_consumers_on_another_stream_see_the_producers_finished_data(executor: str) -> None:
    """The producer leaves its tensor unwritten for ~20 ms of device time before
    filling it; a consumer on another stream that did not wait for the producer's
    event would sum stale memory."""
    spin = sleep_cycles(0.02)

    def produce(ctx: TaskContext) -> None:
        x = torch.empty(N, device="cuda")
        torch.cuda._sleep(spin)
        x.fill_(float(ctx.batch_index + 1))
        ctx.slots.set("x", x)

    def consume(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", ctx.slots["x"].sum())

    pool = StreamPool.for_device(("default", "memcpy"), "cuda")
    tasks = [
        Task.from_fn("produce", produce, lookahead=1, stream="memcpy", writes=("x",)),
        Task.from_fn("consume", consume, reads=("x",), writes=("step_result",)),
    ]
    async with Pipeline(tasks, executor=executor, stream_pool=pool) as pipe:
        sums = await collect(pipe, iter(range(8)))
    torch.cuda.synchronize()
    assert [float(s) for s in sums] == [float(N * (b + 1)) for b in range(8)]


async def test_waiting_for_device_work_keeps_the_loop_free() -> None:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(sleep_cycles(0.2))
        event = stream.record_event()
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.005)

    ticker = asyncio.create_task(tick())
    started = time.perf_counter()
    await wait_for_event(event)
    waited = time.perf_counter() - started
    ticker.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await ticker
    assert event.query()
    assert waited > 0.1  # the kernel really ran that long ...
    assert ticks >= 10  # ... and the loop kept running other work meanwhile


async def test_copy_to_host_returns_the_device_values() -> None:
    device = torch.arange(1000, dtype=torch.float32, device="cuda") * 3
    host = await copy_to_host(device)
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host, torch.arange(1000, dtype=torch.float32) * 3)
