"""Hypothesis stateful test: random sequences of progress, source switches, drains,
cancellations, resets and shutdown against a model of what must come out.

The model tracks, per source, the items returned and pulled: a progress returns the
oldest item not yet returned and leaves ``min(len, returned + 1 + L)`` pulled (L =
max lookahead 2); a cancelled progress breaks the pipeline until ``reset`` and the
iterator then continues after what was pulled; ``drain`` returns the batches in
flight and forgets the source.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
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
        self.slow = threading.Event()
        self.pipe = Pipeline(self.tasks(), thread_map={"load": "io", "prep": "io",
                                                       "train": "compute"})  # fmt: skip
        self.labels = itertools.count()
        self.new_source(3)
        self.broken = False
        self.closed = False

    def tasks(self) -> list[Task]:
        def load(ctx: TaskContext) -> None:
            ctx.slots.set("raw", ctx.slots["batch_cpu"])

        def prep(ctx: TaskContext) -> None:
            ctx.slots.set("x", ctx.slots["raw"])

        def train(ctx: TaskContext) -> None:
            if self.slow.is_set():
                time.sleep(0.05)  # a cancellation lands while this body runs
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
        self.pulled = 0

    def rest_of_source(self) -> None:
        """The engine forgot the source; the iterator goes on after what was pulled."""
        self.items = self.items[self.pulled:]
        self.returned = self.pulled = 0

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    # -- rules ---------------------------------------------------------------------------

    @rule()
    def progress(self) -> None:
        if self.closed or self.broken:
            with pytest.raises(PipelineStateError, match="shut down" if self.closed else "reset"):
                self.run(self.pipe.progress(self.source))
            return
        if self.returned == len(self.items):
            with pytest.raises(StopAsyncIteration):
                self.run(self.pipe.progress(self.source))
            return
        assert self.run(self.pipe.progress(self.source)) == self.items[self.returned]
        self.returned += 1
        self.pulled = min(len(self.items), self.returned + LOOKAHEAD)

    @rule(length=st.integers(0, 6))
    def switch_source(self, length: int) -> None:
        if self.closed or self.broken:
            return
        in_flight = self.pulled - self.returned
        candidate = iter([-1])
        if in_flight:
            with pytest.raises(PipelineStateError, match="in flight"):
                self.run(self.pipe.progress(candidate))
            assert next(candidate) == -1  # nothing taken from it
            return
        self.new_source(length)

    @precondition(lambda self: not self.closed and not self.broken)
    @rule()
    def drain(self) -> None:
        expected = self.items[self.returned:self.pulled]
        assert self.run(self.pipe.drain()) == expected
        self.rest_of_source()

    @precondition(lambda self: not self.closed and not self.broken)
    @rule()
    def cancel_during_a_task(self) -> None:
        if self.returned == len(self.items):
            return
        self.slow.set()
        try:
            with pytest.raises(TimeoutError):
                self.run(asyncio.wait_for(self.pipe.progress(self.source), 0.01))
        finally:
            self.slow.clear()
        self.pulled = min(len(self.items), self.returned + 1 + LOOKAHEAD)
        self.broken = True

    @precondition(lambda self: not self.closed)
    @rule()
    def reset(self) -> None:
        self.pipe.reset()
        self.broken = False
        self.rest_of_source()

    @rule()
    def shutdown(self) -> None:
        self.pipe.shutdown()
        self.closed = True

    @invariant()
    def statistics_agree(self) -> None:
        stats = self.pipe.statistics()
        assert stats.closed == self.closed
        assert (stats.broken is not None) == self.broken
        if not self.closed and not self.broken:
            assert stats.in_flight == self.pulled - self.returned

    def teardown(self) -> None:
        self.pipe.shutdown()
        self.loop.close()


PipelineMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None
)
test_pipeline_state_machine = pytest.mark.one_loop(PipelineMachine.TestCase)
