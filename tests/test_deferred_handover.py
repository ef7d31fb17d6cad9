"""A thread chain whose first task waits for one task of another lane is handed to
its lane by that lane, as it finishes that task (``StageLayout.deferred``), instead
of by the loop with the stage: its lane is woken once, when it can run.  What must
hold: who hands it over and when, failures, steps chained by ``progress_many``
(the work of two steps reaches each lane in step order), tracing."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from conftest import collect

from aiopipe import AsyncExecutor, Pipeline, Task, TaskContext
from aiopipe.executors.layout import build_layout


def echo(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])


class Handovers:
    """Records, for each work item handed to lane ``lane``, the thread that handed
    it over and which tasks had finished by then."""

    def __init__(self, executor: AsyncExecutor, lane: str, finished: list[str]) -> None:
        self.by: list[str] = []
        self.finished_then: list[list[str]] = []
        pool_lane = executor._lane_pool.get(lane)
        submit = pool_lane.submit

        def recording(work: Any) -> None:
            self.by.append(threading.current_thread().name)
            self.finished_then.append(list(finished))
            submit(work)

        pool_lane.submit = recording  # type: ignore[method-assign]


def recorded(name: str, finished: list[str], body: Any = echo) -> Any:
    def run(ctx: TaskContext) -> None:
        body(ctx)
        finished.append(f"{name} {ctx.slots['batch_cpu']}")

    return run


def second_waits_for_first(finished: list[str]) -> tuple[list[Task], AsyncExecutor]:
    """``first`` on lane a, then ``second`` (the result) on lane b."""
    tasks = [
        Task.from_fn("first", recorded("first", finished, lambda ctx: None)),
        Task.from_fn("second", recorded("second", finished), depends_on=("first",)),
    ]
    return tasks, AsyncExecutor({"first": "a", "second": "b"})


async def test_a_chain_waiting_for_a_task_of_another_lane_is_handed_over_by_that_lane() -> None:
    finished: list[str] = []
    tasks, executor = second_waits_for_first(finished)
    async with Pipeline(tasks, executor=executor) as pipe:
        handed = Handovers(executor, "b", finished)
        assert await collect(pipe, iter(range(3))) == [0, 1, 2]
    assert handed.by == ["aiopipe-lane-a"] * 3
    assert handed.finished_then == [
        ["first 0"], ["first 0", "second 0", "first 1"],
        ["first 0", "second 0", "first 1", "second 1", "first 2"],
    ]  # fmt: skip


async def test_a_collective_waiting_for_the_ticket_of_another_lane_is_handed_over_there() -> None:
    finished: list[str] = []
    tasks = [
        Task.from_fn("first", recorded("first", finished, lambda ctx: None), nccl=True,
                     stream="s1"),
        Task.from_fn("second", recorded("second", finished), nccl=True, stream="s2"),
    ]
    executor = AsyncExecutor({"first": "a", "second": "b"})
    async with Pipeline(tasks, executor=executor) as pipe:
        handed = Handovers(executor, "b", finished)
        assert await collect(pipe, iter(range(2))) == [0, 1]
    assert handed.by == ["aiopipe-lane-a"] * 2
    assert [then[-1] for then in handed.finished_then] == ["first 0", "first 1"]


def deferred_of(tasks: list[Task], lanes: dict[str, str]) -> dict[str, str]:
    """``StageLayout.deferred`` of every task active, by task name."""
    pipe = Pipeline(tasks, executor=AsyncExecutor(lanes), expect_result=False)
    try:
        plan = pipe.plan
        names = [task.name for task in plan.order]
        lane_of = tuple(lanes[name] for name in names)
        layout = build_layout(plan, lane_of, tuple(range(len(names))))
    finally:
        pipe.shutdown()
    return {names[first]: names[trigger] for first, trigger in layout.deferred.items()}


def test_only_a_wait_for_one_other_thread_lane_is_deferred() -> None:
    tasks = [
        Task.from_fn("x", echo, stream="s1"),
        Task.from_fn("y", echo, stream="s2"),
        Task.from_fn("both", echo, depends_on=("x", "y"), stream="s3"),
        Task.from_fn("on_loop", echo, stream="s4"),
        Task.from_fn("after_loop", echo, depends_on=("on_loop",), stream="s5"),
        Task.from_fn("free", echo, stream="s6"),
    ]
    lanes = {"x": "a", "y": "b", "both": "c", "on_loop": "loop", "after_loop": "d", "free": "e"}
    # two lanes waited for, the loop waited for, nothing waited for: handed over at once
    assert deferred_of(tasks, lanes) == {}
    one_lane = [Task.from_fn("x", echo, stream="s1"), Task.from_fn("w", echo, stream="s1"),
                Task.from_fn("z", echo, depends_on=("x", "w"), stream="s2")]  # fmt: skip
    assert deferred_of(one_lane, {"x": "a", "w": "a", "z": "b"}) == {"z": "w"}  # the later one


@pytest.mark.parametrize("fails", ["first", "second"])
async def test_a_failing_task_leaves_no_chain_behind(fails: str) -> None:
    ran: list[str] = []

    def body(name: str) -> Any:
        def run(ctx: TaskContext) -> None:
            ran.append(f"{name} {ctx.slots['batch_cpu']}")
            if name == fails and ctx.slots["batch_cpu"] == 1:
                raise ValueError(f"{name} fails")
            echo(ctx)

        return run

    tasks = [Task.from_fn("first", body("first")),
             Task.from_fn("second", body("second"), depends_on=("first",))]  # fmt: skip
    async with Pipeline(tasks, executor=AsyncExecutor({"first": "a", "second": "b"})) as pipe:
        source = iter(range(4))
        assert await pipe.progress(source) == 0
        with pytest.raises(ValueError, match=f"{fails} fails"):
            await pipe.progress(source)
        pipe.reset()
        assert await collect(pipe, source) == [2, 3]
    assert ran == ["first 0", "second 0", "first 1", *(["second 1"] if fails == "second" else []),
                   "first 2", "second 2", "first 3", "second 3"]  # fmt: skip


async def test_steps_chained_with_layouts_that_change_reach_each_lane_in_order() -> None:
    # One stream: train (batch k) waits for the copy (batch k+1) on the other lane, so
    # its chain is handed over by the io lane.  The first step copies only, the last
    # trains only: a step queued behind one whose chain is not handed over yet must
    # not reach the compute lane first (it would wait there for that step's end).
    finished: list[str] = []
    tasks = [
        Task.from_fn("copy", recorded("copy", finished, lambda ctx: None), lookahead=1),
        Task.from_fn("train", recorded("train", finished)),
    ]
    executor = AsyncExecutor({"copy": "io", "train": "compute"})
    async with Pipeline(tasks, executor=executor) as pipe:
        source = iter(range(12))
        assert await pipe.progress_many(source, 5) == [0, 1, 2, 3, 4]
        assert await pipe.progress_many(source, 20) == list(range(5, 12))
    assert [f for f in finished if f.startswith("train")] == [f"train {k}" for k in range(12)]


async def test_a_traced_step_hands_every_chain_over_at_once() -> None:
    finished: list[str] = []
    tasks, executor = second_waits_for_first(finished)
    async with Pipeline(tasks, executor=executor, trace=True) as pipe:
        handed = Handovers(executor, "b", finished)
        assert await collect(pipe, iter(range(2))) == [0, 1]
    assert handed.by == ["MainThread"] * 2  # its wait shows in the trace
