"""BatchRing rotation and the fire mask."""

from __future__ import annotations

import asyncio

import pytest
from conftest import CompletesOnWait

from aiopipe import StreamPool
from aiopipe.ring import BatchRing, RetiredStores, SlotStore
from aiopipe.mask import batch_index, fires


def test_advance_drops_offset_zero_and_shifts_down() -> None:
    ring = BatchRing(3)
    for batch in range(4):
        ring.top.set("batch", batch)
        ring.top.batch_index = batch
        if batch == 3:
            break
        ring.advance()
    assert [ring.at(k).get("batch") for k in range(3)] == [1, 2, 3]
    evicted = ring.advance()
    assert evicted.get("batch") == 1
    assert [ring.at(k).get("batch") for k in range(3)] == [2, 3, None]


def test_events_travel_with_their_store() -> None:
    ring = BatchRing(2)
    ring.at(1).record_event("h2d", "event-for-batch")
    ring.advance()
    assert ring.at(0).event_of("h2d") == "event-for-batch"
    assert ring.at(1).event_of("h2d") is None


def test_missing_slot_error_names_slot_and_batch() -> None:
    ring = BatchRing(1)
    ring.at(0).batch_index = 7
    ring.at(0).set("present", 1)
    with pytest.raises(KeyError, match=r"'absent' is not set for batch 7.*present"):
        ring.at(0)["absent"]


def test_out_of_ring_offset() -> None:
    with pytest.raises(IndexError):
        BatchRing(2).at(2)
    with pytest.raises(ValueError):
        BatchRing(0)


@pytest.mark.parametrize("max_la", [0, 1, 2, 3])
@pytest.mark.parametrize("total", [0, 1, 2, 5])
def test_fire_mask_runs_every_lookahead_on_every_batch_once(max_la: int, total: int) -> None:
    for la in range(max_la + 1):
        iterations = [i for i in range(total + max_la + 2) if fires(la, i, max_la, total)]
        assert [batch_index(la, i, max_la) for i in iterations] == list(range(total))


def test_prefill_runs_only_deep_lookaheads() -> None:
    # L = 2, many batches known: iteration 0 runs lookahead 2 only, iteration 2 all.
    assert [fires(la, 0, 2, 10) for la in range(3)] == [False, False, True]
    assert [fires(la, 2, 2, 10) for la in range(3)] == [True, True, True]
    # drain: the last batch (9) has been pulled; iteration 11 runs lookahead 0 only.
    assert [fires(la, 11, 2, 10) for la in range(3)] == [True, False, False]


class Stream:
    """The device-stream protocol on CPU: every recorded event stays pending until
    the test completes it."""

    def __init__(self) -> None:
        self.events: list[CompletesOnWait] = []

    def record_event(self, event: object = None) -> CompletesOnWait:
        self.events.append(CompletesOnWait())
        return self.events[-1]

    def wait_event(self, event: object) -> None:
        return None

    def wait_stream(self, stream: object) -> None:
        return None


def test_retired_stores_go_once_their_device_work_has_completed() -> None:
    stream = Stream()
    retired = RetiredStores(StreamPool({"default": stream}))
    first, second = SlotStore(), SlotStore()
    retired.add(first)
    retired.add(second)
    retired.free()
    assert len(retired) == 2  # nothing queued when they left has completed
    stream.events[1].done = True
    retired.free()
    assert len(retired) == 2  # oldest first: the second waits for the first
    stream.events[0].done = True
    retired.free()
    assert len(retired) == 0


async def test_retired_stores_of_a_cpu_pool_go_one_loop_cycle_later() -> None:
    retired = RetiredStores(StreamPool({"default": None}))
    retired.add(SlotStore())
    retired.free_soon()
    assert len(retired) == 1  # the caller runs on first
    await asyncio.sleep(0)
    assert len(retired) == 0
