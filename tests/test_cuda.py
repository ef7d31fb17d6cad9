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

pytestmark = pytest.mark.cuda

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


def slow_fill(buffer: torch.Tensor, value: float, spin: int) -> None:
    """Fill ``buffer`` on the current stream after ~``spin`` cycles of device time, so
    a reader on another stream that did not wait reads the old values."""
    torch.cuda._sleep(spin)
    buffer.fill_(value)


@pytest.mark.parametrize("producer_first", [True, False])
async def test_a_device_only_sync_orders_the_streams_without_a_host_wait(
    producer_first: bool,
) -> None:
    """State outside slots: ``update`` rewrites one of two buffers every progress on
    its own stream.  With the producer first, ``read`` sees this progress's buffer
    (waited before its body); with ``read`` first, it sees the previous progress's
    buffer (waited at the end of that progress)."""
    spin = sleep_cycles(0.02)
    buffers = [torch.zeros(N, device="cuda"), torch.zeros(N, device="cuda")]
    lag = 0 if producer_first else 1

    def update(ctx: TaskContext) -> None:
        slow_fill(buffers[ctx.iter_count % 2], float(ctx.iter_count + 1), spin)

    def read(ctx: TaskContext) -> None:
        seen = ctx.iter_count - lag
        if seen >= 0:
            ctx.slots.set("step_result", buffers[seen % 2].sum())

    updater = Task.from_fn("update", update, stream="prefetch")
    reader = Task.from_fn("read", read, writes=("step_result",), same_progress_sync=("update",),
                          same_progress_sync_sides={"update": "device"})  # fmt: skip
    tasks = [updater, reader] if producer_first else [reader, updater]
    pool = StreamPool.for_device(("default", "prefetch"), "cuda")
    async with Pipeline(tasks, executor="sequential", stream_pool=pool) as pipe:
        sums = await collect(pipe, iter(range(6)))
    torch.cuda.synchronize()
    expected = [float(N * (i - lag + 1)) for i in range(6) if i - lag >= 0]
    assert [float(s) for s in sums if s is not None] == expected


@pytest.mark.parametrize("producer_first", [True, False])
async def test_steps_chained_on_the_lanes_keep_every_device_wait(producer_first: bool) -> None:
    """``progress_many`` on two lanes and three streams sees what ``progress`` sees:
    the lane that ends an iteration issues the device waits it left (the reader first:
    at the end of the progress) before the next one starts, and the copy ahead on its
    own stream is waited for."""
    spin = sleep_cycles(0.02)

    async def run(steps_per_call: int) -> list[tuple[float, float | None]]:
        buffers = [torch.zeros(N, device="cuda"), torch.zeros(N, device="cuda")]

        def produce(ctx: TaskContext) -> None:
            x = torch.empty(N, device="cuda")
            torch.cuda._sleep(spin)
            x.fill_(float(ctx.batch_index + 1))
            ctx.slots.set("x", x)

        def update(ctx: TaskContext) -> None:
            slow_fill(buffers[ctx.iter_count % 2], float(ctx.iter_count + 1), spin)

        def read(ctx: TaskContext) -> None:
            shared = buffers[(ctx.iter_count - (0 if producer_first else 1)) % 2].sum()
            ctx.slots.set("step_result", (ctx.slots["x"].sum(), shared))

        updater = Task.from_fn("update", update, stream="prefetch")
        reader = Task.from_fn("read", read, reads=("x",), writes=("step_result",),
                              same_progress_sync=("update",),
                              same_progress_sync_sides={"update": "device"})  # fmt: skip
        producer = Task.from_fn("produce", produce, lookahead=1, stream="memcpy", writes=("x",))
        tasks = [producer, *([updater, reader] if producer_first else [reader, updater])]
        pool = StreamPool.for_device(("default", "prefetch", "memcpy"), "cuda")
        # update and read on one lane: a device-only sync never holds the host, so on
        # two lanes the reader could run before the update was even submitted.
        lanes = {"produce": "memcpy", "update": "compute", "read": "compute"}
        async with Pipeline(tasks, executor="async", stream_pool=pool, thread_map=lanes) as pipe:
            source, results = iter(range(9)), []
            while chunk := await pipe.progress_many(source, steps_per_call):
                results += chunk
        torch.cuda.synchronize()
        return [(float(x), float(shared)) for x, shared in results]

    one_by_one, chained = await run(1), await run(4)
    assert [x for x, _ in chained] == [float(N * (b + 1)) for b in range(9)]
    assert chained == one_by_one


@pytest.mark.parametrize("executor", ["sequential", "async"])
async def test_a_named_event_orders_a_reader_of_out_of_slot_state(executor: str) -> None:
    spin = sleep_cycles(0.02)
    cache = torch.zeros(N, device="cuda")

    def update(ctx: TaskContext) -> None:
        slow_fill(cache, float(ctx.batch_index + 1), spin)
        ctx.record_event("cache")

    def read(ctx: TaskContext) -> None:
        ctx.wait_event("cache")
        ctx.slots.set("step_result", cache.sum())

    tasks = [
        Task.from_fn("update", update, stream="prefetch"),
        Task.from_fn("read", read, writes=("step_result",), same_progress_sync=("update",),
                     same_progress_sync_sides={"update": "cpu"}),  # order only: the event waits
    ]  # fmt: skip
    pool = StreamPool.for_device(("default", "prefetch"), "cuda")
    async with Pipeline(tasks, executor=executor, stream_pool=pool) as pipe:
        sums = await collect(pipe, iter(range(6)))
    torch.cuda.synchronize()
    assert [float(s) for s in sums] == [float(N * (b + 1)) for b in range(6)]


def test_a_task_s_stream_is_current_in_its_body_and_the_thread_s_own_after() -> None:
    """``StreamPool.use``, the switch around every body on a device stream: inside,
    its stream is current (nested too); after, the thread's own stream again, also
    when the body raised."""
    pool = StreamPool.for_device(("default", "side"), "cuda")
    side, default = pool.get("side"), pool.get("default")
    own = torch.cuda.Stream()
    with torch.cuda.stream(own):
        with pool.use("side") as entered:
            assert entered == side == torch.cuda.current_stream()
            with pool.use("default"):
                assert torch.cuda.current_stream() == default
            assert torch.cuda.current_stream() == side
        assert torch.cuda.current_stream() == own
        with pytest.raises(ValueError), pool.use("side"):
            raise ValueError("a failing body")
        assert torch.cuda.current_stream() == own



def test_a_task_on_the_stream_already_current_finds_it_current_after_a_body_that_switched() -> None:
    """Entered where its stream is already current, ``StreamPool.use`` switches nothing;
    a body that leaves another stream current (or raises while it does) still ends
    with the task's stream current again, as ``torch.cuda.stream`` would."""
    pool = StreamPool.for_device(("default", "side"), "cuda")
    default, side = pool.get("default"), pool.get("side")
    assert torch.cuda.current_stream() == default
    with pool.use("default") as entered:
        assert entered == default == torch.cuda.current_stream()
    assert torch.cuda.current_stream() == default
    with pool.use("default"):
        torch.cuda.set_stream(side)  # a body that does not put its stream back
    assert torch.cuda.current_stream() == default
    with pytest.raises(ValueError), pool.use("default"):
        torch.cuda.set_stream(side)
        raise ValueError("a failing body")
    assert torch.cuda.current_stream() == default
    with pool.use("side"):
        with pool.use("side"):  # nested on the stream now current
            assert torch.cuda.current_stream() == side
        assert torch.cuda.current_stream() == side
    assert torch.cuda.current_stream() == default

# Without CUDA, the cuda marker's own skip says why.
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="needs two GPUs")
def test_a_stream_on_another_device_is_current_there_and_each_device_s_own_after() -> None:
    pool = StreamPool.for_device(("default", "far"), "cuda:1")
    far = pool.get("far")
    with torch.cuda.device(0):
        here, there = torch.cuda.current_stream(0), torch.cuda.current_stream(1)
        with pool.use("far"):
            assert torch.cuda.current_device() == 1 and torch.cuda.current_stream() == far
        assert torch.cuda.current_device() == 0
        assert torch.cuda.current_stream(0) == here and torch.cuda.current_stream(1) == there
