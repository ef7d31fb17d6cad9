"""An ``async def`` body at the head of a chain (nothing before it on its lane, no
wait on another lane) starts on the loop with its iteration, before the other lanes
start their chains: a fetch one batch ahead is under way while the step it should
overlap runs, however busy the lanes keep the cores.  Its failures, cancellation and
``run_on_lane`` behave as for any ``async def`` body."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
from typing import Any

import pytest
from conftest import collect

from aiopipe import Pipeline, PipelineStateError, Task, TaskContext
from aiopipe.executors.loop_bodies import LoopBody

#: Where the fetch runs: its stream's lane (a lane thread hands it to the loop), or the loop.
THREAD_MAPS = pytest.mark.parametrize(
    "thread_map", [None, {"fetch": "loop", "train": "default"}], ids=["io-lane", "loop"]
)


def fetch_and_train(fetch: Any, train: Any, thread_map: Any) -> Pipeline:
    """``fetch`` reads batch k+1 (``lookahead=1``, stream ``"io"``) while ``train`` steps
    on batch k (lane ``"default"``)."""
    return Pipeline(
        [Task.from_fn("fetch", fetch, lookahead=1, stream="io", writes=("batch",)),
         Task.from_fn("train", train, reads=("batch",), writes=("step_result",))],
        thread_map=thread_map,
    )  # fmt: skip


def echo_batch(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch"])


@THREAD_MAPS
async def test_the_fetch_of_the_next_batch_has_begun_when_the_step_starts(thread_map: Any) -> None:
    began: set[int] = set()  # the batches whose fetch has reached its first await
    seen: list[tuple[int, bool]] = []  # each step: (its batch, had the next fetch begun?)

    async def fetch(ctx: TaskContext) -> None:
        began.add(ctx.slots["batch_cpu"])
        await asyncio.sleep(0)
        ctx.slots.set("batch", ctx.slots["batch_cpu"])

    def train(ctx: TaskContext) -> None:
        batch = ctx.slots["batch"]
        seen.append((batch, batch + 1 in began))
        echo_batch(ctx)

    async with fetch_and_train(fetch, train, thread_map) as pipe:
        assert await collect(pipe, iter(range(6))) == list(range(6))
    # Every step but the last (there is no batch 6) started with the next fetch begun.
    assert [batch for batch, begun in seen if not begun] == [5]


@THREAD_MAPS
async def test_a_failing_fetch_fails_its_progress_with_its_own_error(thread_map: Any) -> None:
    async def fetch(ctx: TaskContext) -> None:
        await asyncio.sleep(0)
        if ctx.slots["batch_cpu"] == 3:
            raise ValueError("no features for batch 3")
        ctx.slots.set("batch", ctx.slots["batch_cpu"])

    results: list[Any] = []
    async with fetch_and_train(fetch, echo_batch, thread_map) as pipe:
        source = iter(range(6))
        with pytest.raises(ValueError, match="no features for batch 3"):
            while True:
                results.append(await pipe.progress(source))
    # The step on batch 2 shares the failed iteration: whether it ran before the
    # failure was known is timing (its result then comes first).  Nothing else comes.
    assert results in ([0, 1], [0, 1, 2])


@THREAD_MAPS
async def test_a_call_cancelled_while_the_fetch_waits_loses_and_repeats_nothing(
    thread_map: Any,
) -> None:
    waiting, go_on = asyncio.Event(), asyncio.Event()

    async def fetch(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 3 and not go_on.is_set():
            waiting.set()
            await go_on.wait()
        ctx.slots.set("batch", ctx.slots["batch_cpu"])

    async with fetch_and_train(fetch, echo_batch, thread_map) as pipe:
        source = iter(range(6))
        results = [await pipe.progress(source) for _ in range(2)]
        call = asyncio.create_task(pipe.progress(source))
        await waiting.wait()  # the iteration fetching batch 3 (and stepping on 2) is under way
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            results.append(await call)
        go_on.set()
        results += await collect(pipe, source)
    assert results == list(range(6))


async def test_run_on_lane_from_a_fetch_heading_its_lane_runs_on_that_lane() -> None:
    threads: list[str] = []

    async def fetch(ctx: TaskContext) -> None:
        threads.append(await ctx.run_on_lane(lambda: threading.current_thread().name))
        ctx.slots.set("batch", ctx.slots["batch_cpu"])

    async with fetch_and_train(fetch, echo_batch, None) as pipe:
        assert await collect(pipe, iter(range(4))) == list(range(4))
    assert threads == ["aiopipe-lane-io"] * 4


def test_the_blocking_form_starts_the_fetch_before_the_step_too() -> None:
    began: set[int] = set()
    late: list[int] = []

    async def fetch(ctx: TaskContext) -> None:
        began.add(ctx.slots["batch_cpu"])
        await asyncio.sleep(0)
        ctx.slots.set("batch", ctx.slots["batch_cpu"])

    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch"] + 1 not in began:
            late.append(ctx.slots["batch"])
        echo_batch(ctx)

    with fetch_and_train(fetch, train, None).blocking() as pipe:
        source = iter(range(5))
        assert [pipe.progress(source) for _ in range(5)] == list(range(5))
    assert late == [4]


INTERRUPTED_HEAD = """
import asyncio
from aiopipe import Pipeline, Task, TaskContext

def case(error, fetch_lane):
    steps = []

    async def fetch(ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        if batch == 2 and not steps.count("raised"):
            steps.append("raised")
            raise {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[error]()
        await asyncio.sleep(0)
        ctx.slots.set("batch", batch)

    def train(ctx: TaskContext) -> None:
        steps.append(ctx.slots["batch"])
        ctx.slots.set("step_result", ctx.slots["batch"])

    pipe = Pipeline(
        [Task.from_fn("fetch", fetch, lookahead=1, stream="io", writes=("batch",)),
         Task.from_fn("train", train, reads=("batch",), writes=("step_result",))],
        thread_map={"fetch": fetch_lane, "train": "default"},
    ).blocking()
    source = iter(range(5))
    first = pipe.progress(source)
    try:
        while True:
            pipe.progress(source)
    except (KeyboardInterrupt, SystemExit) as exc:
        print(error, fetch_lane, "interrupted by", type(exc).__name__, flush=True)
    pipe.reset()  # nothing of the interrupted call is left to run on
    print(error, fetch_lane, "first", first, "then", list(pipe.results(iter(range(3)))), flush=True)
    pipe.shutdown()

for error in ("KeyboardInterrupt", "SystemExit"):
    for fetch_lane in ("io", "loop"):
        case(error, fetch_lane)
"""


def test_an_interrupt_in_a_fetch_heading_its_chain_leaves_nothing_stuck() -> None:
    """The body raises before its first ``await``, while the step's lane waits for
    the loop to let it go: the interrupt reaches the caller, and the lanes are free
    for ``reset()`` and the next calls (no hang: a child that hung would time out)."""
    out = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_HEAD], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for error in ("KeyboardInterrupt", "SystemExit"):
        for lane in ("io", "loop"):
            assert f"{error} {lane} interrupted by {error}" in lines
            assert f"{error} {lane} first 0 then [0, 1, 2]" in lines
    assert "never retrieved" not in out.stderr


class PostedTo:
    """A lane's ``post``, recorded."""

    def __init__(self) -> None:
        self.posted: list[object] = []

    def post(self, marker: object) -> None:
        self.posted.append(marker)


def test_a_body_whose_loop_closed_before_it_started_lets_its_lane_go_with_an_error() -> None:
    lane = PostedTo()
    never_ran = LoopBody(lane)  # type: ignore[arg-type]
    error = never_ran.abandon()  # the stage fails with it, before its other lanes go
    assert lane.posted == [never_ran]
    assert isinstance(error, PipelineStateError) and never_ran.error is error  # not a success
    ended = LoopBody(lane)  # type: ignore[arg-type]
    ended.finish()
    assert ended.abandon() is None  # after its own end: nothing more, no error made up
    assert lane.posted == [never_ran, ended] and ended.error is None


async def test_a_fetch_that_is_its_lanes_whole_chain_ends_it_without_the_lane() -> None:
    """The stage's end must not wait for the fetch's lane to wake up and end its
    chain: on busy cores that took 0.3-0.8 ms a step.  Here the lane is held by other
    work for the whole run, and every step still completes (with a run_on_lane call
    in the last fetch, served once the lane is let go)."""
    held, let_go = threading.Event(), threading.Event()
    calls: list[str] = []

    async def fetch(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 4:
            let_go.set()
            calls.append(await ctx.run_on_lane(lambda: threading.current_thread().name))
        ctx.slots.set("batch", ctx.slots["batch_cpu"])

    async with fetch_and_train(fetch, echo_batch, None) as pipe:
        source = iter(range(5))
        assert await pipe.progress(source) == 0  # the lanes exist now
        io_lane = pipe.executor._lane_pool.get("io")  # type: ignore[attr-defined]
        io_lane.submit(lambda: (held.set(), let_go.wait(30)))
        await asyncio.get_running_loop().run_in_executor(None, held.wait, 10)
        results = [await asyncio.wait_for(pipe.progress(source), 5) for _ in range(2)]
        assert results == [1, 2] and not let_go.is_set()  # the lane was held throughout
        assert await collect(pipe, source) == [3, 4]  # batch 4's fetch let it go
    assert calls == ["aiopipe-lane-io"]


async def test_run_on_lane_from_a_whole_chain_fetch_with_steps_queued_behind_it() -> None:
    """``progress_many`` queues the next step on the fetch's lane while the fetch
    runs on the loop: that lane must still run the fetch's ``run_on_lane`` calls,
    not wait behind the queued step for the fetch's own end."""
    threads: list[str] = []
    release = asyncio.Event()

    async def fetch(ctx: TaskContext) -> None:
        await release.wait()  # the next step is queued by now (see below)
        threads.append(await ctx.run_on_lane(lambda: threading.current_thread().name))
        ctx.slots.set("batch", ctx.slots["batch_cpu"])

    async with fetch_and_train(fetch, echo_batch, None) as pipe:
        source = iter(range(6))
        release.set()
        assert await pipe.progress(source) == 0  # fetches 0 and 1: the lanes exist
        release.clear()
        many = asyncio.ensure_future(pipe.progress_many(source, 5))
        for _ in range(100):  # until the step after the running one is queued
            await asyncio.sleep(0)
        release.set()
        assert await asyncio.wait_for(many, 10) == [1, 2, 3, 4, 5]
    assert threads == ["aiopipe-lane-io"] * 6


# -- steps queued behind the running one (progress_many) ------------------------------------

#: The fetch on its own lane, or heading a longer chain there (then a sync task after it).
QUEUED_LAYOUTS = pytest.mark.parametrize("layout", ["whole chain", "heading a chain"])


def fetch_then_train(fetch: Any, train: Any, layout: str) -> Pipeline:
    if layout == "whole chain":
        return fetch_and_train(fetch, train, None)

    def unpack(ctx: TaskContext) -> None:
        ctx.slots.set("batch", ctx.slots["fetched"])

    return Pipeline(
        [Task.from_fn("fetch", fetch, lookahead=1, stream="io", writes=("fetched",)),
         Task.from_fn("unpack", unpack, lookahead=1, stream="io", reads=("fetched",),
                      writes=("batch",)),
         Task.from_fn("train", train, reads=("batch",), writes=("step_result",))],
    )  # fmt: skip


@QUEUED_LAYOUTS
async def test_chained_steps_start_the_next_fetch_before_each_step(layout: str) -> None:
    """A step queued behind the running one starts its fetch on the loop first, as a
    step begun by the loop does: its other lanes wait for the fetch's first step."""
    began: set[int] = set()
    seen: list[tuple[int, bool]] = []
    slot = "batch" if layout == "whole chain" else "fetched"

    async def fetch(ctx: TaskContext) -> None:
        began.add(ctx.slots["batch_cpu"])
        await asyncio.sleep(0)
        ctx.slots.set(slot, ctx.slots["batch_cpu"])

    def train(ctx: TaskContext) -> None:
        batch = ctx.slots["batch"]
        seen.append((batch, batch + 1 in began))
        echo_batch(ctx)

    async with fetch_then_train(fetch, train, layout) as pipe:
        source = iter(range(8))
        assert await pipe.progress_many(source, 8) == list(range(8))
        assert await pipe.progress_many(source, 8) == []
    assert [batch for batch, begun in seen if not begun] == [7]


@QUEUED_LAYOUTS
async def test_a_step_failing_with_the_next_queued_skips_it_and_hangs_nothing(
    layout: str,
) -> None:
    slot = "batch" if layout == "whole chain" else "fetched"
    fetched: list[int] = []

    async def fetch(ctx: TaskContext) -> None:
        fetched.append(ctx.slots["batch_cpu"])
        await asyncio.sleep(0)
        ctx.slots.set(slot, ctx.slots["batch_cpu"])

    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch"] == 3:
            raise ValueError("step 3 fails")
        echo_batch(ctx)

    async with fetch_then_train(fetch, train, layout) as pipe:
        source, results = iter(range(8)), []
        with pytest.raises(ValueError, match="step 3 fails"):
            while True:  # the steps applied before the failure come out first
                results += await asyncio.wait_for(pipe.progress_many(source, 8), 10)
        assert results == [0, 1, 2]
        pipe.reset()
        assert await collect(pipe, iter(range(3))) == [0, 1, 2]
    # The step queued behind the failed one never started: batch 5 was never fetched.
    assert 5 not in fetched


@QUEUED_LAYOUTS
async def test_chained_steps_cancelled_while_a_fetch_waits_lose_and_repeat_nothing(
    layout: str,
) -> None:
    waiting, go_on = asyncio.Event(), asyncio.Event()
    slot = "batch" if layout == "whole chain" else "fetched"
    steps: list[int] = []

    async def fetch(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 4 and not go_on.is_set():
            waiting.set()
            await go_on.wait()
        ctx.slots.set(slot, ctx.slots["batch_cpu"])

    def train(ctx: TaskContext) -> None:
        steps.append(ctx.slots["batch"])
        echo_batch(ctx)

    async with fetch_then_train(fetch, train, layout) as pipe:
        source = iter(range(8))
        call = asyncio.ensure_future(pipe.progress_many(source, 8))
        await waiting.wait()  # batch 4's fetch, in the step on batch 3: step 4 may be queued
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        go_on.set()
        results = await asyncio.wait_for(pipe.progress_many(source, 8), 10)
        results += await collect(pipe, source)
    assert results == list(range(8)) and steps == list(range(8))
