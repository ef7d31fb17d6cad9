"""Cancel-safety under stress: thousands of progresses with cancellations injected at
seeded random points, on asyncio and on trio (through anyio), over lane and loop
thread maps.  Every batch's result must come out exactly once and in order, no lane
thread or asyncio task may be left behind, and the pipeline never needs ``reset()``.

Each cancellation is forced with gates, never with timing: the chosen body announces
that it runs and waits for a gate; the driver cancels the caller, then opens the gate.
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any

import anyio
import pytest

from aiopipe import Pipeline, Task, TaskContext

POINTS = ("none", "before_pull", "lane_body", "async_body", "ticket_wait")
# which task holds the gate for each point; "ticket_wait": the holder has ticket 0
# on lane io, so "reduce_b" waits for ticket 1 on the other lane meanwhile.  A sync
# body on the loop cannot be held (it would hold the loop): in the loop map the lane
# body held is the one still on a lane.
HOLDER = {
    "lanes": {"lane_body": "train", "async_body": "prep", "ticket_wait": "reduce_a"},
    "loop": {"lane_body": "reduce_a", "async_body": "prep", "ticket_wait": "reduce_a"},
}


class Injector:
    """Arms one task body: when it next runs it reports (``started``) and waits for
    its gate.  Each arming makes a fresh gate and flag, which the body takes under a
    lock: a body of an earlier, interrupted iteration can never wait on a later gate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.armed: str | None = None
        self.started = threading.Event()
        self.gate = threading.Event()

    def arm(self, task: str | None) -> None:
        with self._lock:
            self.armed = task
            self.started = threading.Event()
            self.gate = threading.Event()

    def reached(self, task: str) -> threading.Event | None:
        """The gate to wait for, if ``task`` is the armed body (once per arming)."""
        with self._lock:
            if self.armed != task:
                return None
            self.armed = None
            started, gate = self.started, self.gate
        started.set()
        return gate

    def release(self) -> None:
        with self._lock:
            self.armed = None
            self.gate.set()


def build(injector: Injector, where: str) -> Pipeline:
    def load(ctx: TaskContext) -> None:
        ctx.slots.set("x", ctx.slots["batch_cpu"])

    async def prep(ctx: TaskContext) -> None:
        await anyio.sleep(0)  # a real checkpoint: cancellation could land here
        if gate := injector.reached("prep"):
            await anyio.to_thread.run_sync(gate.wait)

    def reduce_a(ctx: TaskContext) -> None:
        if gate := injector.reached("reduce_a"):
            gate.wait()

    def train(ctx: TaskContext) -> None:
        if gate := injector.reached("train"):
            gate.wait()
        ctx.slots.set("step_result", ctx.slots["x"])

    tasks = [
        Task.from_fn("load", load, lookahead=1, stream="io", writes=("x",)),
        Task.from_fn("prep", prep, reads=("x",)),
        Task.from_fn("reduce_a", reduce_a, nccl=True, stream="io", depends_on=("prep",)),
        Task.from_fn("reduce_b", lambda ctx: None, nccl=True, depends_on=("reduce_a",)),
        Task.from_fn("train", train, reads=("x",), depends_on=("reduce_b",),
                     writes=("step_result",)),
    ]  # fmt: skip
    if where == "lanes":
        thread_map: Any = {"load": "io", "reduce_a": "io", "prep": "compute",
                           "reduce_b": "compute", "train": "compute"}  # fmt: skip
    else:  # everything the loop can run runs there; the ticket holder keeps a lane
        thread_map = {"reduce_a": "io", "load": "loop", "prep": "loop", "reduce_b": "loop",
                      "train": "loop"}  # fmt: skip
    return Pipeline(tasks, thread_map=thread_map)


async def wait_started(injector: Injector, call_done: Any) -> bool:
    """Until the armed body runs (True) or the call finished without it (False)."""
    started = injector.started
    while not started.is_set():
        if call_done():
            return False
        await anyio.sleep(0.0002)  # polling a flag set by a lane thread; no timing assumed
    return True


async def drive(seed: int, where: str, progresses: int, library: str) -> None:
    rng = random.Random(seed)
    injector = Injector()
    pipe = build(injector, where)
    items = list(range(progresses))
    source = iter(items)
    got: list[int] = []
    cancelled = 0
    async with pipe:
        while len(got) < len(items):
            point = rng.choice(POINTS)
            injector.arm(HOLDER[where].get(point))
            outcome: list[int] = []
            finished = threading.Event()
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:

                    async def call() -> None:
                        try:
                            outcome.append(await pipe.progress(source))
                        finally:
                            finished.set()

                    tg.start_soon(call)
                    if point == "before_pull":
                        scope.cancel()
                    elif point != "none" and await wait_started(injector, finished.is_set):
                        scope.cancel()
            injector.release()
            cancelled += scope.cancelled_caught
            got.extend(outcome)
            assert pipe.statistics().broken is None
        with pytest.raises(StopAsyncIteration):
            await pipe.progress(source)
    assert got == items  # every result once, in order
    assert cancelled > progresses // 10  # the injections did land
    assert not [t.name for t in threading.enumerate() if t.name.startswith("aiopipe-lane")]
    if library != "trio":
        assert asyncio.all_tasks() == {asyncio.current_task()}


@pytest.mark.parametrize("library", ["asyncio", "trio"])
@pytest.mark.parametrize("where", ["lanes", "loop"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_cancellations_lose_and_repeat_nothing(library: str, where: str, seed: int) -> None:
    # 2 libraries x 2 maps x 2 seeds x 300 = 2400 progresses
    anyio.run(drive, seed, where, 300, library, backend=library)


async def test_serving_timeouts_shorter_than_the_step_lose_nothing() -> None:
    """``asyncio.wait_for`` around every call; 30 % of calls time out while the
    step is held (so the timeout certainly fires), for 500 calls."""
    rng = random.Random(7)
    injector = Injector()
    pipe = build(injector, "lanes")
    source = iter(range(500))
    got: list[int] = []
    timeouts = certain = 0
    previous_timed_out = False
    async with pipe:
        while len(got) < 500:
            short = rng.random() < 0.3
            # right after a timeout the call returns the interrupted iteration's result
            # without running a body; otherwise a short call meets the held body
            certain += short and not previous_timed_out
            injector.arm("train" if short else None)
            try:
                got.append(await asyncio.wait_for(pipe.progress(source), 0.002 if short else 30))
                previous_timed_out = False
            except TimeoutError:
                timeouts += 1
                previous_timed_out = True
            injector.release()
    assert got == list(range(500))
    assert timeouts >= certain > 100  # about 30 % of the calls timed out
    assert pipe.statistics().broken is None
