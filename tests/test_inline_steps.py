"""The sequential executor runs an iteration of synchronous tasks inline, in the
caller's frame (no task, no loop cycle), and yields to the event loop every
``INLINE_YIELD_S`` instead.  The clock the driver reads is replaced by one the task
bodies advance, so every interleaving here is forced."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import aiopipe.driver
from aiopipe import (
    AsyncExecutor, Pipeline, PipelineStateError, SequentialExecutor, Task, TaskContext,
)
from aiopipe.executors import Iteration


class Clock:
    """A monotonic clock that moves only when a body says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(aiopipe.driver, "_monotonic", fake)
    return fake


def training(steps: list[int], clock: Clock, seconds_a_step: float = 0.0) -> list[Task]:
    """``load`` one batch ahead, ``train`` on the oldest, each step taking
    ``seconds_a_step`` of the fake clock."""

    def load(ctx: TaskContext) -> None:
        ctx.slots.set("x", ctx.slots["batch_cpu"])

    def train(ctx: TaskContext) -> None:
        steps.append(ctx.slots["x"])
        clock.now += seconds_a_step
        ctx.slots.set("step_result", ctx.slots["x"])

    return [Task.from_fn("load", load, lookahead=1, writes=("x",)),
            Task.from_fn("train", train, reads=("x",), writes=("step_result",))]  # fmt: skip


def finished_without_suspending(call: Any) -> Any:
    """Run the coroutine ``call`` one step; it must return in that step."""
    with pytest.raises(StopIteration) as stop:
        call.send(None)
    return stop.value.value


#: The executors that run steps inline: the sequential one, and lanes with every
#: task on the reserved lane "loop".
INLINE = {"sequential": lambda: "sequential", "loop": lambda: AsyncExecutor(lambda task: "loop")}


@pytest.mark.parametrize("executor", INLINE)
async def test_a_step_of_synchronous_tasks_takes_no_loop_cycle(clock: Clock, executor: str) -> None:
    steps: list[int] = []
    source = iter(range(6))
    async with Pipeline(training(steps, clock), executor=INLINE[executor]()) as pipe:
        assert await pipe.progress(source) == 0  # yields once, at its start
        returned = [finished_without_suspending(pipe.progress(source)) for _ in range(4)]
        assert returned == [1, 2, 3, 4]
        assert steps == [0, 1, 2, 3, 4]
        assert pipe.statistics().position == 5


async def test_other_coroutines_run_between_steps_every_few_milliseconds(clock: Clock) -> None:
    steps: list[int] = []
    seen: list[int] = []  # how many steps had run each time the other coroutine ran
    stop = asyncio.Event()

    async def other() -> None:
        while not stop.is_set():
            if not seen or seen[-1] != len(steps):
                seen.append(len(steps))
            await asyncio.sleep(0)

    # Each step takes 40 % of the interval: the loop is yielded to every third call.
    step_seconds = aiopipe.driver.INLINE_YIELD_S * 0.4
    source = iter(range(100))
    async with Pipeline(training(steps, clock, step_seconds), executor="sequential") as pipe:
        beside = asyncio.create_task(other())
        await asyncio.sleep(0)
        for _ in range(10):
            await pipe.progress(source)
        stop.set()
        await beside
    assert steps == list(range(10))
    assert seen == [0, 3, 6, 9]


async def test_a_call_cancelled_where_it_yields_loses_and_repeats_nothing(clock: Clock) -> None:
    steps: list[int] = []
    source = iter(range(6))
    async with Pipeline(training(steps, clock), executor="sequential") as pipe:
        assert await pipe.progress(source) == 0
        clock.now += aiopipe.driver.INLINE_YIELD_S  # the next call yields first
        call = asyncio.create_task(pipe.progress(source))
        await asyncio.sleep(0)  # it runs to its yield
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert steps == [0]
        assert [await pipe.progress(source) for _ in range(5)] == [1, 2, 3, 4, 5]
        assert steps == list(range(6))


async def test_a_failing_body_run_inline_fails_its_own_call(clock: Clock) -> None:
    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 2:
            raise ValueError("bad batch 2")
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    source = iter(range(5))
    async with Pipeline([Task.from_fn("train", train, writes=("step_result",))],
                        executor="sequential") as pipe:  # fmt: skip
        assert [await pipe.progress(source) for _ in range(2)] == [0, 1]
        with pytest.raises(ValueError, match="bad batch 2"):
            await pipe.progress(source)
        with pytest.raises(PipelineStateError, match="interrupted by ValueError"):
            await pipe.progress(source)
        pipe.reset()
        assert [await pipe.progress(source) for _ in range(2)] == [3, 4]


async def test_a_keyboard_interrupt_in_a_body_run_inline_reaches_the_caller(clock: Clock) -> None:
    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 1:
            raise KeyboardInterrupt
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    source = iter(range(4))
    async with Pipeline([Task.from_fn("train", train, writes=("step_result",))],
                        executor="sequential") as pipe:  # fmt: skip
        assert await pipe.progress(source) == 0
        with pytest.raises(KeyboardInterrupt):
            await pipe.progress(source)
        with pytest.raises(PipelineStateError, match="reset"):
            await pipe.progress(source)
        pipe.reset()
        assert await pipe.progress(source) == 2


async def test_an_async_body_keeps_the_iteration_in_a_task(clock: Clock) -> None:
    async def train(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    source = iter(range(3))
    async with Pipeline([Task.from_fn("train", train, writes=("step_result",))],
                        executor="sequential") as pipe:  # fmt: skip
        assert await pipe.progress(source) == 0
        call = pipe.progress(source)
        assert call.send(None) is None  # suspended: its iteration runs in a task
        call.close()


async def test_a_subclass_overriding_run_iteration_is_called(clock: Clock) -> None:
    ran: list[int] = []

    class Counting(SequentialExecutor):
        async def run_iteration(self, iteration: Iteration) -> None:
            ran.append(iteration.number)
            await super().run_iteration(iteration)

    steps: list[int] = []
    async with Pipeline(training(steps, clock), executor=Counting()) as pipe:
        assert [r async for r in pipe.results(range(3))] == [0, 1, 2]
    assert ran == [0, 1, 2, 3]  # one more: the first fills the ring (load of batch 0)
