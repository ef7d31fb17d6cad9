"""Hypothesis stateful test: random sequences of progress, source switches, drains,
cancellations and shutdown against a model of what must come out.

The model tracks, per source, the items returned and taken: a progress returns the
oldest item not yet returned and leaves ``min(len, returned + L + 1)`` taken (L = max
lookahead 2, plus the one read ahead); a cancelled progress changes nothing the
caller can see -- its iteration runs on and its result is returned by the next call
-- but ``reset``/``shutdown`` are refused until a call has waited for it; ``drain``
returns the batches in flight and forgets the source, which continues after them.
"""

from __future__ import annotations

import asyncio
import itertools
import operator
import threading
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aiopipe import Pipeline, PipelineStateError, Task, TaskContext

LOOKAHEAD = 2


class PipelineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        # Set by the cancel rule: the train body it interrupts waits for the gate, which
        # only a rule that awaits the pipeline opens -- so until then the interrupted
        # iteration is certainly still running, whatever the threads' timing.
        self.hold = False
        self.gate = threading.Event()
        self.started = asyncio.Event()
        self.pipe = Pipeline(self.tasks(), thread_map={"load": "io", "prep": "io",
                                                       "train": "compute"})  # fmt: skip
        self.labels = itertools.count()
        self.new_source(3)
        self.interrupted = False  # a cancelled call's iteration may still be running
        self.closed = False

    def tasks(self) -> list[Task]:
        def load(ctx: TaskContext) -> None:
            ctx.slots.set("raw", ctx.slots["batch_cpu"])

        def prep(ctx: TaskContext) -> None:
            ctx.slots.set("x", ctx.slots["raw"])

        def train(ctx: TaskContext) -> None:
            if self.hold:
                self.loop.call_soon_threadsafe(self.started.set)
                assert self.gate.wait(60)  # the cancellation lands while this body runs
            ctx.slots.set("step_result", ctx.slots["x"])

        return [
            Task.from_fn("load", load, lookahead=2, stream="io", writes=("raw",)),
            Task.from_fn("prep", prep, lookahead=1, stream="io", reads=("raw",), writes=("x",)),
            Task.from_fn("train", train, reads=("x",), writes=("step_result",)),
        ]

    def new_source(self, length: int) -> None:
        self.items = [next(self.labels) for _ in range(length)]
        self.source = iter(list(self.items))
        self.returned = 0
        self.taken = 0

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def call(self, api: str, *args: Any) -> Any:
        async def call() -> Any:  # made inside the loop: coroutine APIs need one running
            return await getattr(self.pipe, api)(*args)

        return self.run(call())

    # -- rules ---------------------------------------------------------------------------

    @rule()
    def progress(self) -> None:
        if self.closed:
            with pytest.raises(PipelineStateError, match="shut down"):
                self.call("progress", self.source)
            return
        self.gate.set()  # an interrupted iteration finishes first
        self.interrupted = False
        if self.returned == len(self.items):
            with pytest.raises(StopAsyncIteration):
                self.call("progress", self.source)
            return
        assert self.call("progress", self.source) == self.items[self.returned]
        self.returned += 1
        self.taken = min(len(self.items), self.returned + LOOKAHEAD + 1)

    @rule(length=st.integers(0, 6))
    def switch_source(self, length: int) -> None:
        if self.closed:
            return
        candidate = iter([-1])
        if self.interrupted or self.taken > self.returned:
            with pytest.raises(PipelineStateError, match="in flight"):
                self.call("progress", candidate)
            assert next(candidate) == -1  # nothing taken from it
            return
        self.new_source(length)

    @precondition(lambda self: not self.closed)
    @rule()
    def drain(self) -> None:
        self.gate.set()
        drained = self.call("drain")
        # after an interruption the read-ahead may or may not have happened
        possible = {self.taken} | ({self.taken + 1} if self.interrupted else set())
        assert self.returned + len(drained) in {min(t, len(self.items)) for t in possible}
        assert drained == self.items[self.returned:self.returned + len(drained)]
        self.items = self.items[self.returned + len(drained):]  # the source goes on after
        self.returned = self.taken = 0
        self.interrupted = False

    @precondition(lambda self: not self.closed and not self.interrupted)
    @rule()
    def cancel_during_a_task(self) -> None:
        if self.returned == len(self.items):
            return

        async def cancel_while_train_runs() -> None:
            self.started.clear()
            self.gate.clear()
            self.hold = True
            call = asyncio.ensure_future(self.pipe.progress(self.source))
            await self.started.wait()
            self.hold = False
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            # the iteration goes on without its caller, held at the gate

        self.run(cancel_while_train_runs())
        self.interrupted = True  # until a rule that awaits the pipeline opens the gate
        # the interrupted iteration holds batches up to returned + L; the read-ahead
        # of one more may or may not have happened before the cancellation
        self.taken = min(len(self.items), self.returned + LOOKAHEAD + 1)

    def still_running(self, action: str) -> bool:
        """Try ``action``: while the interrupted iteration runs, it is refused."""
        if not self.interrupted:
            getattr(self.pipe, action)()
            return False
        with pytest.raises(PipelineStateError, match="still running"):
            getattr(self.pipe, action)()
        return True

    @precondition(lambda self: not self.closed)
    @rule()
    def reset(self) -> None:
        if self.still_running("reset"):
            return
        # the batches in flight are dropped; the iterator goes on after what it gave
        self.items = self.items[len(self.items) - operator.length_hint(self.source):]
        self.returned = self.taken = 0
        self.interrupted = False

    @rule()
    def shutdown(self) -> None:
        if self.still_running("shutdown"):
            self.gate.set()
            self.run(self.pipe.aclose())  # waits for the iteration, then shuts down
        self.closed = True
        self.interrupted = False

    @invariant()
    def statistics_agree(self) -> None:
        stats = self.pipe.statistics()
        assert stats.closed == self.closed
        assert stats.broken is None  # a cancelled caller never breaks the pipeline
        if not self.closed and not self.interrupted:
            assert stats.in_flight == self.taken - self.returned

    def teardown(self) -> None:
        self.gate.set()
        self.run(self.pipe.aclose())
        self.loop.close()


PipelineMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None
)
test_pipeline_state_machine = pytest.mark.one_loop(PipelineMachine.TestCase)
