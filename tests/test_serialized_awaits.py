"""An ``async def`` task on the stream of a task working on another batch overlaps
nothing: construction and ``aiopipe validate`` say so, with the fix, and the fix
overlaps (forced with events: each step waits for the next batch's fetch)."""

from __future__ import annotations

import asyncio
import threading
import warnings

import pytest

from aiopipe import Pipeline, SerializedAwaitWarning, Task, TaskContext
from aiopipe.validate import serialized_awaits


def fetch_and_train(stream: str, started: dict[int, threading.Event]) -> list[Task]:
    """``fetch`` of batch b waits until the step of batch b - 1 has begun, and that
    step waits until the fetch has: both finish only if the two overlap."""
    fetching = {n: threading.Event() for n in started}

    async def fetch(ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        if batch - 1 in started:  # the step before it runs now, or never will
            fetching[batch].set()
            assert await asyncio.to_thread(started[batch - 1].wait, 10), "no overlap"
        ctx.slots.set("x", batch)

    def train(ctx: TaskContext) -> None:
        batch = ctx.slots["x"]
        if batch in started:
            started[batch].set()
            if batch + 1 in fetching:
                assert fetching[batch + 1].wait(10), "no overlap"
        ctx.slots.set("step_result", batch)

    return [
        Task.from_fn("fetch", fetch, lookahead=1, stream=stream, writes=("x",)),
        Task.from_fn("train", train, reads=("x",), writes=("step_result",)),
    ]


def test_an_async_task_sharing_the_stream_of_other_batches_warns_with_the_fix() -> None:
    with pytest.warns(SerializedAwaitWarning, match=r"'fetch'.*'train'.*stream='io'") as caught:
        pipe = Pipeline(fetch_and_train("default", {}))
    assert caught[0].filename == __file__  # points at the user's line
    pipe.shutdown()


def test_an_async_task_on_a_stream_of_its_own_is_quiet_and_overlaps() -> None:
    started = {n: threading.Event() for n in range(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", SerializedAwaitWarning)
        pipe = Pipeline(fetch_and_train("io", started))

    async def run() -> list[int]:
        async with pipe:
            return [r async for r in pipe.results(range(5))]

    assert asyncio.run(run()) == [0, 1, 2, 3, 4]


def test_validate_gives_the_same_advice() -> None:
    pipe = Pipeline(fetch_and_train("io", {}))
    try:
        assert serialized_awaits(pipe.plan.schedule) == []
    finally:
        pipe.shutdown()
    with pytest.warns(SerializedAwaitWarning):
        shared = Pipeline(fetch_and_train("default", {}))
    try:
        (advice,) = serialized_awaits(shared.plan.schedule)
        assert "'fetch' is async def" in advice and "'train'" in advice
    finally:
        shared.shutdown()
