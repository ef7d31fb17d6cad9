"""The device-event protocol, checked on CPU with recording streams.

A recording stream implements the three operations the engine issues
(``record_event``, ``wait_event``, ``wait_stream``) and logs them, so the exact waits
each consumer issues -- and which producer event they name -- can be asserted
without a GPU.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from dataclasses import dataclass, field

import pytest
from conftest import collect

from aiopipe import Pipeline, PipelineStateError, StreamPool, Task, TaskContext


@dataclass(frozen=True)
class FakeEvent:
    stream: str
    producer: str | None
    batch: int | None
    done: list[bool] = field(default_factory=lambda: [True], compare=False)

    def query(self) -> bool:
        return self.done[0]

    def synchronize(self) -> None:
        return None


class Recording:
    """Streams that log what the engine asks of them."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.log: list[tuple[str, str, object]] = []
        self.lock = threading.Lock()
        self.current: threading.local = threading.local()
        self.pool = StreamPool({name: RecordingStream(name, self) for name in names})

    def waits(self, stream: str) -> list[tuple[str, object]]:
        return [(op, arg) for s, op, arg in self.log if s == stream and op.startswith("wait")]


class RecordingStream:
    def __init__(self, name: str, recording: Recording) -> None:
        self.name = name
        self.recording = recording

    def _log(self, op: str, arg: object) -> None:
        with self.recording.lock:
            self.recording.log.append((self.name, op, arg))

    def record_event(self, event: object = None) -> FakeEvent:
        running = getattr(self.recording.current, "task", None)
        made = FakeEvent(self.name, *(running or (None, None)))
        self._log("record", made)
        return made

    def wait_event(self, event: object) -> None:
        self._log("wait_event", event)

    def wait_stream(self, stream: object) -> None:
        self._log("wait_stream", getattr(stream, "name", stream))


def body(recording: Recording, writes: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    def run(ctx: TaskContext) -> None:
        for slot in writes:
            ctx.slots.set(slot, ctx.batch_index)
        # events recorded right after this body are labelled with it
        recording.current.task = (ctx.task.name, ctx.batch_index)

    return run


EXECUTORS = ["sequential", "async"]


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_consumer_waits_for_the_event_of_its_own_batch(executor: str) -> None:
    rec = Recording(("default", "memcpy"))
    tasks = [
        Task.from_fn("h2d", body(rec, ("x",)), lookahead=1, stream="memcpy", writes=("x",)),
        Task.from_fn("forward", body(rec), reads=("x",)),
    ]
    async with Pipeline(tasks, executor=executor, stream_pool=rec.pool) as pipe:
        await collect(pipe, iter(range(4)))
    waits = rec.waits("default")
    assert waits == [("wait_event", FakeEvent("memcpy", "h2d", b)) for b in range(4)]


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_same_progress_sync_waits_for_this_progress_event(executor: str) -> None:
    rec = Recording(("default", "prefetch"))
    tasks = [
        Task.from_fn("prefetch", body(rec), lookahead=1, stream="prefetch"),
        Task.from_fn("backward", body(rec), same_progress_sync=("prefetch",)),
    ]
    async with Pipeline(tasks, executor=executor, stream_pool=rec.pool) as pipe:
        await collect(pipe, iter(range(3)))
    # backward on batch b runs in the progress where prefetch handles batch b + 1
    assert rec.waits("default") == [
        ("wait_event", FakeEvent("prefetch", "prefetch", 1)),
        ("wait_event", FakeEvent("prefetch", "prefetch", 2)),
        ("wait_stream", "prefetch"),  # drain: prefetch did not run, fall back to the stream
    ]


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_seeded_batch_still_orders_consumers_after_the_producer_stream(
    executor: str,
) -> None:
    """The producer still fires for a seeded batch (adapters guard the work already
    done); its event, recorded after the bootstrap work on the same stream, covers it."""
    rec = Recording(("default", "memcpy"))
    tasks = [
        Task.from_fn("h2d", body(rec, ("x",)), lookahead=1, stream="memcpy", writes=("x",)),
        Task.from_fn("forward", body(rec), reads=("x",)),
    ]
    async with Pipeline(tasks, executor=executor, stream_pool=rec.pool) as pipe:
        pipe.seed_first_batch({"batch_cpu": 0, "x": 0})  # h2d already done for batch 0
        source = iter(range(1, 3))
        await collect(pipe, source)
    assert rec.waits("default") == [
        ("wait_event", FakeEvent("memcpy", "h2d", b)) for b in range(3)
    ]


async def test_only_producers_with_cross_stream_consumers_record_task_events() -> None:
    rec = Recording(("default", "memcpy"))
    tasks = [
        Task.from_fn("h2d", body(rec, ("x",)), lookahead=1, stream="memcpy", writes=("x",)),
        Task.from_fn("forward", body(rec, ("y",)), reads=("x",), writes=("y",)),
        Task.from_fn("loss", body(rec), reads=("y",)),  # same stream as forward
    ]
    pipe = Pipeline(tasks, stream_pool=rec.pool)
    assert [t.name for t, r in zip(pipe.plan.order, pipe.plan.records_event) if r] == ["h2d"]
    pipe.shutdown()


async def test_dropped_slot_stores_live_until_queued_device_work_completes() -> None:
    rec = Recording(("default", "memcpy"))

    class Payload:
        pass

    refs: list[weakref.ref[Payload]] = []

    def produce(ctx: TaskContext) -> None:
        payload = Payload()
        refs.append(weakref.ref(payload))
        ctx.slots.set("x", payload)

    tasks = [
        Task.from_fn("h2d", produce, lookahead=1, stream="memcpy", writes=("x",)),
        Task.from_fn("forward", lambda ctx: None, reads=("x",)),
    ]
    pipe = Pipeline(tasks, stream_pool=rec.pool)
    source = iter(range(10))
    pending = [False]
    original = RecordingStream.record_event

    def record_pending(self: RecordingStream, event: object = None) -> FakeEvent:
        made = original(self, event)
        made.done[0] = not pending[0]
        return made

    RecordingStream.record_event = record_pending  # type: ignore[method-assign]
    try:
        pending[0] = True  # the device is "busy": nothing queued so far has completed
        for _ in range(3):
            await pipe.progress(source)
        gc.collect()
        assert all(ref() is not None for ref in refs[:3])  # batches 0-2 are still held
        for _, op, arg in rec.log:  # the device catches up
            if op == "record":
                arg.done[0] = True  # type: ignore[attr-defined]
        pending[0] = False
        await pipe.progress(source)
        gc.collect()
        assert refs[0]() is None and refs[1]() is None
    finally:
        RecordingStream.record_event = original  # type: ignore[method-assign]
        pipe.shutdown()


def test_null_pool_issues_no_event_work() -> None:
    tasks = [
        Task.from_fn("h2d", lambda ctx: None, lookahead=1, stream="memcpy"),
        Task.from_fn("forward", lambda ctx: None, depends_on=("h2d",)),
    ]
    pipe = Pipeline(tasks)
    assert pipe.stream_pool.is_null
    assert pipe.plan.waits == ((), ())
    assert not any(pipe.plan.records_event)


def test_stream_pool_rejects_objects_that_are_not_streams() -> None:
    with pytest.raises(TypeError, match="record_event"):
        StreamPool({"default": object()})  # type: ignore[dict-item]
    with pytest.raises(KeyError, match="not in this StreamPool"):
        StreamPool({"default": None}).get("memcpy")


class FailingOnTheLoop(RecordingStream):
    """Records for the lanes; fails as the loop records the end of a step (a device
    error surfacing there)."""

    loop_thread: int | None = None  # armed once a body has run

    def record_event(self, event: object = None) -> FakeEvent:
        if threading.get_ident() == self.loop_thread:
            raise RuntimeError("device error at the end of the step")
        return super().record_event(event)


async def test_a_device_error_at_the_end_of_a_step_reaches_the_caller() -> None:
    # The step's end is handled in a callback on the loop (every task on a lane): an
    # error there must not leave the waiting caller hanging.
    rec = Recording(("default",))
    stream = FailingOnTheLoop("default", rec)
    loop_thread = threading.get_ident()

    def step(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", ctx.batch_index)
        if armed:
            stream.loop_thread = loop_thread

    armed = [True]

    tasks = [Task.from_fn("t", step, writes=("step_result",))]
    pipe = Pipeline(tasks, executor="async", stream_pool=StreamPool({"default": stream}))
    source = iter(range(3))
    assert await asyncio.wait_for(pipe.progress(source), 10) == 0  # the result was taken
    with pytest.raises(RuntimeError, match="device error"):
        await pipe.progress(source)
    with pytest.raises(PipelineStateError, match="interrupted by RuntimeError"):
        await pipe.progress(source)
    stream.loop_thread, armed[:] = None, []  # the device recovered
    pipe.reset()
    assert await collect(pipe, iter(range(2))) == [0, 1]
    pipe.shutdown()
