"""Log records: silent unless configured, lifecycle at INFO, failures and long waits
at WARNING (docs/logging.md)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import Recorder, collect
from test_trace import THREAD_MAP, four_tasks

from aiopipe import AsyncExecutor, Pipeline, Task, TaskContext
from aiopipe.checkpoint import CheckpointManager

def messages(caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("aiopipe") and r.levelno >= level]  # fmt: skip


def test_the_library_only_adds_a_null_handler() -> None:
    # In a fresh interpreter: other tests (and the docs' snippets) configure the logger.
    check = (
        "import logging, aiopipe\n"
        "root = logging.getLogger('aiopipe')\n"
        "assert any(isinstance(h, logging.NullHandler) for h in root.handlers)\n"
        "assert all(isinstance(h, logging.NullHandler) for h in root.handlers)\n"
        "assert root.level == logging.NOTSET and root.propagate\n"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=120)


async def test_a_healthy_run_says_nothing_at_warning(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with Pipeline(four_tasks(recorder), thread_map=THREAD_MAP) as pipe:
        await collect(pipe, iter(range(4)))
        await pipe.drain()
        pipe.reset()
    assert messages(caplog) == []


async def test_lifecycle_records_at_info(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiopipe")
    async with Pipeline(four_tasks(recorder), thread_map=THREAD_MAP, name="job") as pipe:
        first = iter(range(6))
        await pipe.progress(first)
        await pipe.drain()  # finishes the 3 batches in flight
        await pipe.progress(iter(range(6)))
        pipe.reset()
    built, source, init, drain, switched, reset = messages(caplog)  # nothing else
    assert built.startswith("job: built with 4 tasks (max lookahead 2)")
    assert built.endswith("lanes io: load, prep; compute: train, step")
    assert init == "job: init() of 4 tasks done; up to 3 batches will be in flight"
    assert source == switched == "job: new source range_iterator"
    # 2 pulled into the ring and not returned, and the one read ahead
    assert drain == "job: drain, finishing 3 batch(es) in flight"
    assert reset == "job: reset, discarding 3 batch(es) in flight"
    assert all(r.name == "aiopipe.pipeline" for r in caplog.records)


async def test_step_by_step_sources_switch_at_debug_only(caplog: pytest.LogCaptureFixture) -> None:
    def double(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", 2 * ctx.slots["batch_cpu"])

    caplog.set_level(logging.INFO, logger="aiopipe")
    tasks = [Task.from_fn("double", double, reads=("batch_cpu",), writes=("step_result",))]
    async with Pipeline(tasks, name="serve") as pipe:
        for batch in range(3):
            assert await pipe.step(batch) == 2 * batch
    assert len(messages(caplog)) == 2  # built, init(): nothing per step
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="aiopipe")
    async with Pipeline(tasks, name="serve") as pipe:
        for batch in range(3):
            await pipe.step(batch)
    assert len(messages(caplog, logging.INFO)) == 2  # built, init(): nothing per step
    assert [m for m in messages(caplog) if "source" in m] == ["serve: new source OneBatch"] * 3


async def test_a_task_failure_is_a_warning_naming_task_iteration_batch_and_lane(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def explode(ctx: TaskContext) -> None:
        if ctx.batch_index == 1:
            raise ValueError("bad batch")

    tasks = [Task.from_fn("prep", lambda ctx: None, lookahead=1, stream="io"),
             Task.from_fn("train", explode)]  # fmt: skip
    caplog.set_level(logging.WARNING)
    async with Pipeline(tasks, thread_map={"prep": "io", "train": "compute"}, name="job") as pipe:
        with pytest.raises(ValueError, match="bad batch"):
            await collect(pipe, iter(range(4)))
        pipe.reset()
    (record,) = [r for r in caplog.records if r.name.startswith("aiopipe")]
    assert record.name == "aiopipe.executors" and record.levelno == logging.WARNING
    assert record.getMessage() == (
        "job: task 'train' failed on batch 1 of the source (iteration 2) on lane 'compute': "
        "ValueError: bad batch"
    )


# -- long waits: a gate opens only once the warning is out, so the wait really is long ---


class OpensOnWarning(logging.Handler):
    """Sets ``event`` when a record saying a task has waited arrives."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.event = threading.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "has waited" in record.getMessage():
            self.messages.append(record.getMessage())
            self.event.set()


@pytest.fixture
def warned() -> Iterator[OpensOnWarning]:
    handler = OpensOnWarning()
    logger = logging.getLogger("aiopipe.executors")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def held_until(gate: OpensOnWarning) -> Callable[[TaskContext], None]:
    def body(ctx: TaskContext) -> None:
        assert gate.event.wait(timeout=30), "no warning about the long wait came"

    return body


@pytest.mark.parametrize("waiting_lane", ["b", "loop"])
async def test_a_long_wait_for_another_lane_is_a_warning(
    warned: OpensOnWarning, waiting_lane: str
) -> None:
    tasks = [Task.from_fn("first", held_until(warned)),
             Task.from_fn("second", lambda ctx: None, depends_on=("first",))]
    executor = AsyncExecutor({"first": "a", "second": waiting_lane})
    async with Pipeline(tasks, executor=executor, name="job") as pipe:
        executor.slow_wait_s = 0.01  # an attribute, changed on a running pipeline
        await collect(pipe, iter(range(1)))
    assert warned.messages == [
        f"job: task 'second' (iteration 0, lane '{waiting_lane}') has waited 0.01 s for task "
        f"'first' on lane 'a'; still waiting"
    ]


async def test_a_long_wait_for_a_collective_ticket_is_a_warning(warned: OpensOnWarning) -> None:
    # two streams, no dependency: only the ticket order makes the second one wait
    tasks = [Task.from_fn("first_collective", held_until(warned), nccl=True, stream="s1"),
             Task.from_fn("second_collective", lambda ctx: None, nccl=True, stream="s2")]
    executor = AsyncExecutor({"first_collective": "a", "second_collective": "b"},
                             slow_wait_s=0.01)  # fmt: skip
    async with Pipeline(tasks, executor=executor, name="job") as pipe:
        await collect(pipe, iter(range(1)))
    assert warned.messages == [
        "job: task 'second_collective' (iteration 0, lane 'b') has waited 0.01 s for collective "
        "ticket 1 (the collective before it, 'first_collective', has not finished "
        "submitting); still waiting"
    ]


async def test_no_wait_warning_when_turned_off(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()

    def first(ctx: TaskContext) -> None:
        assert release.wait(timeout=30)

    def second(ctx: TaskContext) -> None:
        return None

    tasks = [Task.from_fn("first", first), Task.from_fn("second", second, depends_on=("first",))]
    executor = AsyncExecutor({"first": "a", "second": "b"}, slow_wait_s=None)
    caplog.set_level(logging.DEBUG, logger="aiopipe")
    async with Pipeline(tasks, executor=executor) as pipe:
        threading.Timer(0.05, release.set).start()  # long past any threshold
        await collect(pipe, iter(range(1)))
    assert not [m for m in messages(caplog) if "has waited" in m]


def test_checkpoint_saved_and_resumed_at_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiopipe")
    manager = CheckpointManager(tmp_path)
    manager.save(7, {"w": torch.ones(2)})
    state = {"w": torch.zeros(2)}
    manager.load(7, state)
    assert messages(caplog) == [
        f"checkpoint of step 7 saved in {tmp_path / 'step-00000007'}",
        f"resuming from the checkpoint of step 7 in {tmp_path / 'step-00000007'}",
    ]
    assert torch.equal(state["w"], torch.ones(2))
