"""``progress_many``: several steps in one call, chained on the lanes.

Each test forces its interleaving with events held by task bodies: the lane that ends
one step starts the next one while the loop thread is blocked, a step queued behind a
running one is taken back when its caller leaves, a failure skips the step queued
behind it, and no batch is lost or repeated."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from aiopipe import (
    ConfigurationError, ConfigurationTypeError, Pipeline, PipelineStateError, Task, TaskContext,
    basic,
)  # fmt: skip

from gated_source import GatedSource


def echo(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])


def echo_ahead(ctx: TaskContext) -> None:
    ctx.slots.set("ahead", ctx.slots["batch_cpu"])


async def in_a_thread(event: threading.Event) -> None:
    """Wait for a lane body to reach its gate without blocking the loop."""
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, 10)


class Gates:
    """A body that records the batches it ran and can be held at one batch; a
    ``check_batch`` that says when an item has been read (ahead, on the loop, just
    before the step after the running one is queued)."""

    def __init__(
        self, hold_at: int | None = None, fail_at: int | None = None, after_read: int = -1
    ) -> None:
        self.ran: list[int] = []
        self.checked: list[int] = []
        self.hold_at, self.fail_at, self.after_read = hold_at, fail_at, after_read
        self.reached, self.release = threading.Event(), threading.Event()
        self.read = threading.Event()  # item ``after_read`` has been read and checked

    def __call__(self, ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        self.ran.append(batch)
        if batch in (self.hold_at, self.fail_at):
            assert self.after_read < 0 or self.read.wait(10)
        if batch == self.hold_at:
            self.reached.set()
            assert self.release.wait(10)
        if batch == self.fail_at:
            raise ValueError(f"batch {batch} is bad")
        echo(ctx)

    def check(self, batch: int) -> None:
        self.checked.append(batch)
        if batch == self.after_read:
            self.read.set()


async def cancel_while_held(pipe: Pipeline, source: Any, gates: Gates) -> None:
    """A ``progress_many(source, 5)`` cancelled once a step is held at its gate; the
    step is then let go."""
    call = asyncio.ensure_future(pipe.progress_many(source, 5))
    await in_a_thread(gates.reached)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    gates.release.set()


def held_at_1_then_says_2() -> tuple[Gates, threading.Event, Any]:
    """A step body held at batch 1, and the event it sets when batch 2 runs."""
    gates, next_ran = Gates(hold_at=1), threading.Event()

    def step(ctx: TaskContext) -> None:
        gates(ctx)
        if ctx.slots["batch_cpu"] == 2:
            next_ran.set()

    return gates, next_ran, step


def lookahead_tasks(body: Any) -> list[Task]:
    """A prepare task one batch ahead of the step: two batches in flight."""

    def prepare(ctx: TaskContext) -> None:
        ctx.slots.set("prepared", ctx.slots["batch_cpu"] * 10)

    def step(ctx: TaskContext) -> None:
        body(ctx)
        ctx.slots.set("step_result", (ctx.slots["batch_cpu"], ctx.slots["prepared"]))

    return [
        Task.from_fn("prepare", prepare, lookahead=1, writes=("prepared",)),
        Task.from_fn("step", step, reads=("prepared",)),
    ]


@pytest.mark.parametrize("chunk", [1, 3, 7, 25])
async def test_the_results_are_those_of_progress_in_order(chunk: int) -> None:
    async with Pipeline(lookahead_tasks(echo)) as pipe:
        source, got = iter(range(20)), []
        while results := await pipe.progress_many(source, chunk):
            assert len(results) == chunk or len(got) + len(results) == 20
            got += results
        assert got == [(n, 10 * n) for n in range(20)]
        assert await pipe.progress_many(source, chunk) == []  # and again at the end
        assert pipe.statistics().applied == 20


def test_training_through_progress_many_equals_progress_bit_for_bit() -> None:
    data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(13)]

    def run(chunk: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pipe = basic(model, opt, loss_fn=lambda out, b: torch.nn.functional.mse_loss(out, b[1]),
                     forward=lambda m, b: m(b[0])).blocking()  # fmt: skip
        with pipe:
            if chunk is None:
                losses = list(pipe.results(data))
            else:
                source, losses = iter(data), []
                while results := pipe.progress_many(source, chunk):
                    losses += results
        return losses, [p.detach().clone() for p in model.parameters()]

    losses, params = run(None)
    for chunk in (1, 4, 13):
        other_losses, other_params = run(chunk)
        assert len(other_losses) == 13
        assert all(torch.equal(a, b) for a, b in zip(losses, other_losses))
        assert all(torch.equal(a, b) for a, b in zip(params, other_params))


async def test_the_lane_starts_the_next_step_while_the_loop_thread_is_blocked() -> None:
    gates, next_ran, step = held_at_1_then_says_2()

    async with Pipeline([Task.from_fn("step", step)]) as pipe:
        source = iter(range(6))
        assert await pipe.progress(source) == 0
        call = asyncio.ensure_future(pipe.progress_many(source, 3))
        await in_a_thread(gates.reached)  # step 1 runs, step 2 is queued behind it
        gates.release.set()
        # The loop thread is blocked here: only the lane can start step 2.
        assert next_ran.wait(10)
        assert await call == [1, 2, 3]


async def test_only_the_steps_asked_for_are_applied() -> None:
    gates = Gates()
    async with Pipeline(lookahead_tasks(gates)) as pipe:
        source = iter(range(10))
        assert await pipe.progress_many(source, 3) == [(n, 10 * n) for n in range(3)]
        assert gates.ran == [0, 1, 2]
        assert pipe.statistics().applied == 3
        assert await pipe.progress(source) == (3, 30)
        assert gates.ran == [0, 1, 2, 3]


async def test_a_cancelled_call_takes_back_the_queued_step_and_loses_nothing() -> None:
    # Step 2 is held until item 3 has been read: step 3 is then queued behind it.
    gates = Gates(hold_at=2, after_read=3)
    async with Pipeline([Task.from_fn("step", gates)], check_batch=gates.check) as pipe:
        source = iter(range(8))
        await cancel_while_held(pipe, source, gates)
        await pipe.wait_idle()
        assert gates.ran == [0, 1, 2]  # step 3 was taken back: it never ran
        assert pipe.statistics().applied == 3
        # The collected results and the step that ran on come first, then the rest;
        # item 3 is not read (or checked) again.
        assert [r async for r in pipe.results(source)] == list(range(8))
        assert gates.ran == list(range(8))
        assert gates.checked == list(range(8))


async def test_a_cancelled_call_whose_queued_step_started_returns_it_next() -> None:
    gates = Gates(hold_at=3)
    async with Pipeline([Task.from_fn("step", gates)]) as pipe:
        source = iter(range(6))
        await cancel_while_held(pipe, source, gates)  # step 3 started on the lane on its own
        assert await pipe.progress_many(source, 10) == list(range(6))
        assert gates.ran == list(range(6))


async def test_a_failing_step_returns_the_steps_before_it_then_raises() -> None:
    # Step 3 fails once item 4 has been read: step 4 is then queued behind it.
    gates = Gates(fail_at=3, after_read=4)
    async with Pipeline([Task.from_fn("step", gates)], check_batch=gates.check) as pipe:
        source = iter(range(8))
        assert await pipe.progress_many(source, 6) == [0, 1, 2]
        with pytest.raises(ValueError, match="batch 3 is bad"):
            await pipe.progress_many(source, 6)
        assert gates.ran == [0, 1, 2, 3]  # step 4, queued behind it, never ran
        with pytest.raises(PipelineStateError, match="reset"):
            await pipe.progress_many(source, 6)
        pipe.reset()
        # item 4 was read but no task touched it: it is kept, the source goes on with it
        assert [r async for r in pipe.results(source)] == [4, 5, 6, 7]
        assert gates.checked == list(range(8))


async def test_results_before_a_failure_come_out_together_when_it_is_known_first() -> None:
    # Steps 0 and 1 end while their caller sleeps; it leaves with step 2 held on the
    # lane, and step 2 then fails: the next call finds two results and the failure.
    gates = Gates(hold_at=2, fail_at=2)
    async with Pipeline([Task.from_fn("step", gates)]) as pipe:
        source = iter(range(8))
        await cancel_while_held(pipe, source, gates)
        await pipe.wait_idle()
        assert await pipe.progress_many(source, 5) == [0, 1]  # both, not one a call
        with pytest.raises(ValueError, match="batch 2 is bad"):
            await pipe.progress_many(source, 5)


async def test_results_waiting_after_a_failed_drain_come_out_before_reset_is_asked() -> None:
    # drain() raises step 4's failure; the steps before it (2 and 3, applied) wait.
    # progress_many returns them, as progress() would, and only then asks for reset().
    gates = Gates(fail_at=4)
    tasks = [Task.from_fn("prep", echo_ahead, lookahead=2, writes=("ahead",)),
             Task.from_fn("step", gates, reads=("ahead",))]  # fmt: skip
    async with Pipeline(tasks) as pipe:
        source = iter(range(10))
        assert await pipe.progress_many(source, 2) == [0, 1]
        with pytest.raises(ValueError, match="batch 4 is bad"):
            await pipe.drain()
        assert await pipe.progress_many(source, 3) == [2, 3]
        with pytest.raises(PipelineStateError, match="reset"):
            await pipe.progress_many(source, 3)
        assert gates.ran == [0, 1, 2, 3, 4]


def test_results_given_back_by_an_interrupted_call_come_out_before_reset_is_asked() -> None:
    # A KeyboardInterrupt from step 3's body: steps 0-2 were applied and their results
    # given back; the next progress_many returns them, the one after asks for reset().
    interrupted: list[int] = []

    def step(ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        if batch == 3 and not interrupted:
            interrupted.append(batch)
            raise KeyboardInterrupt
        echo(ctx)

    with Pipeline([Task.from_fn("step", step)], executor="sequential").blocking() as pipe:
        source = iter(range(10))
        with pytest.raises(KeyboardInterrupt):
            pipe.progress_many(source, 5)
        assert pipe.progress_many(source, 5) == [0, 1, 2]
        with pytest.raises(PipelineStateError, match="reset"):
            pipe.progress_many(source, 5)


def test_the_blocking_form_chains_too() -> None:
    with Pipeline(lookahead_tasks(echo)).blocking() as pipe:
        source = iter(range(9))
        assert pipe.progress_many(source, 4) == [(n, 10 * n) for n in range(4)]
        assert pipe.progress_many(source, 9) == [(n, 10 * n) for n in range(4, 9)]
        assert pipe.progress_many(source, 9) == []


@pytest.mark.parametrize("steps", [0, -1])
async def test_steps_below_one_are_refused(steps: int) -> None:
    async with Pipeline([Task.from_fn("step", echo)]) as pipe:
        with pytest.raises(ConfigurationError, match="steps must be >= 1"):
            await pipe.progress_many(iter(range(3)), steps)


@pytest.mark.parametrize("steps", ["3", 2.0, True])
async def test_steps_of_another_type_are_refused(steps: Any) -> None:
    async with Pipeline([Task.from_fn("step", echo)]) as pipe:
        with pytest.raises(ConfigurationTypeError, match="steps must be an int"):
            await pipe.progress_many(iter(range(3)), steps)


async def test_taking_back_a_queued_step_leaves_the_running_step_s_collectives_alone() -> None:
    """Two collectives on two lanes take tickets in order.  The caller leaves while the
    first holds its ticket, and the step queued behind is taken back: the second
    collective of the running step still takes its ticket and runs."""
    gates = Gates(hold_at=2, after_read=3)
    second: list[int] = []

    def first_collective(ctx: TaskContext) -> None:
        gates(ctx)

    def second_collective(ctx: TaskContext) -> None:
        second.append(ctx.slots["batch_cpu"])

    tasks = [
        Task.from_fn("first", first_collective, nccl=True),
        Task.from_fn("second", second_collective, nccl=True, depends_on=()),
    ]
    async with Pipeline(tasks, thread_map={"first": "a", "second": "b"},
                        check_batch=gates.check) as pipe:  # fmt: skip
        source = iter(range(6))
        call = asyncio.ensure_future(pipe.progress_many(source, 5))
        await in_a_thread(gates.reached)  # step 2 holds ticket 0; step 3 is queued
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        gates.release.set()
        await pipe.wait_idle()
        assert second == [0, 1, 2] and gates.ran == [0, 1, 2]
        assert await pipe.progress_many(source, 9) == list(range(6))
        assert second == list(range(6))


async def test_an_async_source_chains_once_its_next_batch_has_been_read() -> None:
    gates, next_ran, step = held_at_1_then_says_2()

    async def items() -> AsyncIterator[int]:
        for n in range(5):
            await asyncio.sleep(0)  # a fetch: the read does not end in its first step
            yield n

    async with Pipeline([Task.from_fn("step", step)]) as pipe:
        source = items()
        assert await pipe.progress(source) == 0
        call = asyncio.ensure_future(pipe.progress_many(source, 3))
        await in_a_thread(gates.reached)  # step 1 runs; batch 2 is read by a task
        for _ in range(10_000):  # queued once that read has its batch: a few loop turns
            if pipe._driver._chain.queued is not None:
                break
            await asyncio.sleep(0)
        assert pipe._driver._chain.queued is not None
        gates.release.set()
        assert next_ran.wait(10)  # the loop thread is blocked: the lane started step 2
        assert await call == [1, 2, 3]


async def test_the_last_step_of_a_call_has_the_next_batch_read_ahead() -> None:
    gates = Gates(hold_at=0)
    async with Pipeline([Task.from_fn("step", gates)], check_batch=gates.check) as pipe:
        source = iter(range(6))
        call = asyncio.ensure_future(pipe.progress_many(source, 2))
        await in_a_thread(gates.reached)  # step 0 runs, step 1 is queued behind it
        assert pipe._driver._chain.queued is not None
        gates.release.set()
        assert await call == [0, 1]
        assert gates.checked == [0, 1, 2]  # batch 2 was read while step 1 ran
        assert await pipe.progress_many(source, 9) == [2, 3, 4, 5]


def test_the_blocking_form_needs_a_pipeline_with_progress_many() -> None:
    class OneByOne:
        async def progress(self, source: Any) -> Any:
            return next(source)

    from aiopipe import BlockingPipeline

    with pytest.raises(ConfigurationTypeError, match="OneByOne has no progress_many"):
        BlockingPipeline(OneByOne()).progress_many(iter(range(3)), 2)


async def test_a_batch_the_chain_waits_for_starts_the_next_fetch_once_read() -> None:
    # The step after the running one waits for its batch (a slow async source): once
    # that batch is read, the fetch after it starts at once, before the batch is
    # placed in the step queued behind the running one.
    gates = Gates(hold_at=0)
    pipe = Pipeline([Task.from_fn("step", gates)])
    source = GatedSource(4, pipe)
    source.open(0)
    async with pipe:
        call = asyncio.create_task(pipe.progress_many(source.items, 3))
        await in_a_thread(gates.reached)  # step 0 runs; the step after waits for batch 1
        source.open(1)
        try:  # batch 2's fetch starts while step 0 still runs
            await asyncio.wait_for(source.started[2].wait(), 10)
        finally:
            gates.release.set()
        source.open(2, 3)
        assert await call == [0, 1, 2]
        assert [r async for r in pipe.results(source.items)] == [3]
    assert source.placed_when_fetching[2] == 1  # batch 1 was read, not placed yet


async def test_a_left_chain_no_longer_has_the_next_fetch_started_for_it() -> None:
    # progress_many's chain waited for batch 1, then its caller left: nobody waits for
    # batch 1 now, so its arrival starts no fetch (one batch ahead, as documented).
    gates = Gates(hold_at=0)
    checked = [asyncio.Event() for _ in range(4)]  # set as the pull ends, in its task
    pipe = Pipeline([Task.from_fn("step", gates)], check_batch=lambda k: checked[k].set())
    source = GatedSource(4)
    source.open(0)
    async with pipe:
        call = asyncio.create_task(pipe.progress_many(source.items, 3))
        await in_a_thread(gates.reached)  # step 0 runs; the chain waits for batch 1
        await source.started[1].wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        source.open(1)
        await checked[1].wait()  # batch 1's pull has decided whether to read on
        assert not source.started[2].is_set()
        assert pipe.statistics().in_flight == 2  # batch 0 in its step, batch 1 read
        gates.release.set()
        source.open(2, 3)
        assert [r async for r in pipe.results(source.items)] == [0, 1, 2, 3]


@pytest.mark.parametrize("fetch_lane", ["io", "loop"])
@pytest.mark.parametrize("first_on_its_lane", [True, False])
async def test_chained_steps_with_an_async_def_body_on_a_lane_run_to_the_end(
    fetch_lane: str, first_on_its_lane: bool
) -> None:
    """A lane that waits for its ``async def`` body serves only that body's calls: the
    next step's chain, queued behind on the same lane, used to be run inside the wait,
    where it waited for the running step to end -- which waited for it (a hang)."""

    def mark(ctx: TaskContext) -> None:
        ctx.slots.set("marked", ctx.slots["batch_cpu"])

    async def fetch(ctx: TaskContext) -> None:
        on_lane = await ctx.run_on_lane(lambda: ctx.slots["batch_cpu"])
        await asyncio.sleep(0)
        ctx.slots.set("batch", on_lane)

    def train(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", ctx.slots["batch"])

    tasks = [Task.from_fn("fetch", fetch, lookahead=1, stream="io", writes=("batch",)),
             Task.from_fn("train", train, reads=("batch",), writes=("step_result",))]  # fmt: skip
    if not first_on_its_lane:  # a sync task before it on its lane: handed over, not started
        tasks.insert(0, Task.from_fn("mark", mark, lookahead=1, stream="io", writes=("marked",)))
    lanes = {"mark": fetch_lane, "fetch": fetch_lane, "train": "default"}
    async with Pipeline(tasks, thread_map=lambda task: lanes[task.name]) as pipe:
        source, results = iter(range(12)), []
        while len(results) < 12:
            results += await asyncio.wait_for(pipe.progress_many(source, 4), 30)
    assert results == list(range(12))
