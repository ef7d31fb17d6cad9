"""aiopipe.dag group tasks: members spread over lanes, failures skip or cancel siblings."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from aiopipe.dag import OUTPUT, TaskGraph
from aiopipe._core.lanes import LANE_THREAD_PREFIX


async def test_members_spread_over_lanes_all_run_at_once() -> None:
    # Each member waits at the barrier until all four are inside: one lane running
    # them in turn would break it (BrokenBarrierError after the timeout).
    barrier = threading.Barrier(4, timeout=10)
    out = [torch.zeros(1) for _ in range(4)]

    def member(t: torch.Tensor, i: int) -> tuple[int, str]:
        barrier.wait()
        t.fill_(i)
        return i, threading.current_thread().name

    async with TaskGraph() as graph:
        lanes = ("g0", "g1", "g2", "g3")
        group = await graph.submit_group(member, [(OUTPUT(t), i) for i, t in enumerate(out)], lanes=lanes)
        results = await group
    assert results == [(i, LANE_THREAD_PREFIX + lane) for i, lane in enumerate(lanes)]
    assert [float(t) for t in out] == [0.0, 1.0, 2.0, 3.0]


async def test_members_sharing_a_lane_run_in_turn_on_it() -> None:
    log: list[tuple[int, str]] = []
    lock = threading.Lock()

    def member(i: int) -> int:
        with lock:
            log.append((i, threading.current_thread().name))
        return i * 10

    async with TaskGraph() as graph:
        group = await graph.submit_group(member, [(i,) for i in range(5)], lanes=["a", "b"])
        assert await group == [0, 10, 20, 30, 40]  # in member order, whoever ran first
        assert graph.statistics().lanes == ("a", "b")
    on_lane = {lane: [i for i, thread in log if thread == LANE_THREAD_PREFIX + lane] for lane in "ab"}
    assert on_lane == {"a": [0, 2, 4], "b": [1, 3]}


async def test_lanes_may_include_the_loop() -> None:
    loop_thread = threading.current_thread().name
    async with TaskGraph() as graph:
        group = await graph.submit_group(lambda i: threading.current_thread().name,
                                         [(0,), (1,)], lanes=["loop", "x"])  # fmt: skip
        assert await group == [loop_thread, LANE_THREAD_PREFIX + "x"]


async def test_a_failing_member_skips_members_not_yet_started_on_every_lane() -> None:
    ran: list[int] = []
    member_0_running, member_1_failed = threading.Event(), threading.Event()

    def member(i: int) -> None:
        ran.append(i)
        if i == 0:  # lane a: still running when member 1 fails on lane b
            member_0_running.set()
            assert member_1_failed.wait(10)
        elif i == 1:
            assert member_0_running.wait(10)
            raise ValueError("member 1 broke")

    with pytest.raises(BaseExceptionGroup):
        async with TaskGraph() as graph:
            # members 0 and 2 on lane a, 1 and 3 on lane b
            group = await graph.submit_group(member, [(i,) for i in range(4)], lanes=("a", "b"), name="g")
            # queued on lane b behind the group's share, so it runs once member 1's
            # failure is recorded; then member 0 may finish
            await graph.submit(member_1_failed.set, lane="b")
            with pytest.raises(ValueError, match="member 1 broke") as info:
                await group
    assert sorted(ran) == [0, 1]  # members 2 (lane a) and 3 (lane b) were skipped
    assert "aiopipe: raised by task 'g' of a TaskGraph (submission 0, group member 1)" in info.value.__notes__


async def test_bad_lanes_arguments_are_refused() -> None:
    async with TaskGraph() as graph:
        with pytest.raises(TypeError, match="not both"):
            await graph.submit_group(print, [()], lane="a", lanes=["b"])
        with pytest.raises(TypeError, match="sequence of lane names"):
            await graph.submit_group(print, [()], lanes="ab")
        with pytest.raises(TypeError, match="sequence of lane names"):
            await graph.submit_group(print, [()], lanes=[])
        assert graph.statistics().in_flight == 0


async def test_a_failing_async_member_cancels_and_awaits_its_running_siblings() -> None:
    running = {i: asyncio.Event() for i in (1, 2)}
    cancelled = {i: asyncio.Event() for i in (1, 2)}
    cleanup_may_end = asyncio.Event()
    finished: list[int] = []

    async def member(i: int) -> str:
        if i == 0:
            for event in running.values():
                await event.wait()
            raise KeyError("member 0 broke")
        if i == 3:
            return "done before the failure"
        running[i].set()
        try:
            await asyncio.Event().wait()  # only cancellation ends this
        except asyncio.CancelledError:
            cancelled[i].set()
            await cleanup_may_end.wait()  # cleanup that itself awaits
            finished.append(i)
            raise
        return "unreachable"

    with pytest.raises(BaseExceptionGroup) as info:
        async with TaskGraph() as graph:
            group = await graph.submit_group(member, [(i,) for i in (3, 0, 1, 2)], name="fan")
            for event in cancelled.values():
                await asyncio.wait_for(event.wait(), 10)
            # both siblings are cancelled but still cleaning up: the group waits for them
            assert not group.done() and finished == []
            cleanup_may_end.set()
            with pytest.raises(KeyError, match="member 0 broke") as failure:
                await group
            assert sorted(finished) == [1, 2]
    assert info.value.exceptions == (failure.value,)  # the siblings' cancellations are not failures
    assert "(submission 0, group member 1)" in failure.value.__notes__[0]
