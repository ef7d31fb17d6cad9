"""Awaiting device work without blocking the loop (CPU path with event stand-ins)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from aiopipe import copy_to_host, wait_for_event


class TimedEvent:
    """Completes ``after`` seconds from creation; counts how it was waited on."""

    def __init__(self, after: float) -> None:
        self.ready_at = time.monotonic() + after
        self.queries = 0
        self.synchronized_on: list[str] = []

    def query(self) -> bool:
        self.queries += 1
        return time.monotonic() >= self.ready_at

    def synchronize(self) -> None:
        self.synchronized_on.append(threading.current_thread().name)
        time.sleep(max(0.0, self.ready_at - time.monotonic()))


async def ticker(stop: asyncio.Event) -> int:
    ticks = 0
    while not stop.is_set():
        ticks += 1
        await asyncio.sleep(0.001)
    return ticks


async def test_completed_and_missing_events_return_at_once() -> None:
    await wait_for_event(None)
    done = TimedEvent(0)
    await wait_for_event(done)
    assert done.queries == 1


async def test_short_waits_poll_inline_and_keep_the_loop_free() -> None:
    event = TimedEvent(0.02)
    stop = asyncio.Event()
    ticks = asyncio.ensure_future(ticker(stop))
    await wait_for_event(event, handoff_after_s=1.0)
    stop.set()
    assert time.monotonic() >= event.ready_at
    assert event.synchronized_on == []  # never left the loop
    assert 1 < event.queries < 200  # backed off, did not spin
    assert await ticks > 3  # other coroutines ran meanwhile


async def test_long_waits_move_to_a_waiter_thread() -> None:
    event = TimedEvent(0.3)
    stop = asyncio.Event()
    ticks = asyncio.ensure_future(ticker(stop))
    await wait_for_event(event, handoff_after_s=0.02)
    stop.set()
    assert time.monotonic() >= event.ready_at
    assert event.synchronized_on == ["aiopipe-gpu-wait"]
    assert await ticks > 20


async def test_waiter_thread_errors_reach_the_awaiting_coroutine() -> None:
    class Broken(TimedEvent):
        def synchronize(self) -> None:
            raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match="device lost"):
        await wait_for_event(Broken(5), handoff_after_s=0.001)


async def test_copy_to_host_passes_cpu_tensors_through() -> None:
    value = torch.arange(4.0)
    assert await copy_to_host(value) is value
