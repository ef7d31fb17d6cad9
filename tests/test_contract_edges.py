"""Edges of the call contract found by adversarial runs: who is handed a failure, a
failure whose caller was cancelled, an interrupt that arrives as a call ends.  Each
interleaving is forced with events held by a task body, an ``init`` or the source
(and asyncio's FIFO order of ready callbacks), never by waiting for time to pass."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiopipe import Pipeline, PipelineStateError, Task, TaskContext

pytestmark = pytest.mark.timeout(60)


def echo(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])


def echo_task(**options: Any) -> Task:
    return Task.from_fn("train", echo, writes=("step_result",), **options)


async def cancelled(call: asyncio.Future[Any]) -> None:
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_a_second_caller_is_refused_not_handed_the_first_callers_failure() -> None:
    failing, gate = asyncio.Event(), asyncio.Event()

    async def train(ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        if batch == 1:
            await gate.wait()
            failing.set()
            raise ValueError("boom on batch 1")
        ctx.slots.set("step_result", batch)

    pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",))])
    source = iter(range(5))
    assert await pipe.progress(source) == 0
    first = asyncio.ensure_future(pipe.progress(source))

    async def second_caller() -> Any:
        await failing.wait()
        await asyncio.sleep(0)  # the step has failed; the first caller is not woken yet
        return await pipe.progress(source)

    second = asyncio.ensure_future(second_caller())
    await asyncio.sleep(0)
    gate.set()
    # Refused as a second caller (asyncio's loop runs it before the first caller
    # wakes), or asked for reset() once the first was handed the failure (uvloop's):
    # never handed the first caller's failure.
    with pytest.raises(PipelineStateError, match="already running|reset"):
        await second
    with pytest.raises(ValueError, match="boom on batch 1"):
        await first  # the failure goes to the caller whose step failed
    pipe.reset()
    await pipe.aclose()


async def test_an_init_failure_whose_caller_was_cancelled_is_raised_by_the_next_call() -> None:
    reached, gate, failing = asyncio.Event(), asyncio.Event(), asyncio.Event()
    calls: list[int] = []

    async def init(ctx: TaskContext) -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            reached.set()
            await gate.wait()
            failing.set()
            raise ValueError("init failed")

    pipe = Pipeline([echo_task(init=init)])
    source = iter(range(3))
    call = asyncio.ensure_future(pipe.progress(source))
    await reached.wait()
    await cancelled(call)
    gate.set()
    await failing.wait()  # the init has failed with nobody waiting for it
    with pytest.raises(ValueError, match="init failed"):
        await pipe.progress(source)
    assert calls == [0]  # raised, not run again by that call
    assert [result async for result in pipe.results(source)] == [0, 1, 2]
    assert calls == [0, 1]  # the call after it retried the init
    await pipe.aclose()
