"""``same_progress_sync_sides``: a same-progress sync that keeps only its CPU side
(bodies in order, no device wait) or only its device side (a stream wait that never
orders the bodies nor holds the consumer's host thread).

Device waits are checked with the recording streams of test_streams_events.py; the
interleavings are forced with the sequential executor's order or with gates."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from conftest import collect
from test_streams_events import FakeEvent, Recording

from aiopipe import Pipeline, Schedule, Task, TaskContext
from aiopipe.edges import dependency_edges, topological_sort

GATE_TIMEOUT_S = 30  # only reached when the engine wrongly holds a body back


def marked(rec: Recording, then: Callable[[TaskContext], None] | None = None) -> Callable[[TaskContext], None]:
    """A body that logs ``(stream, "body", (task, batch))`` and labels the events the
    engine records right after it (see Recording)."""

    def run(ctx: TaskContext) -> None:
        if then is not None:
            then(ctx)
        label = (ctx.task.name, ctx.batch_index)
        with rec.lock:
            rec.log.append((ctx.task.stream, "body", label))
        rec.current.task = label

    return run


def consumer_view(rec: Recording, stream: str = "default") -> list[tuple[str, object]]:
    """What happened on the consumer's stream: its waits and the bodies run on it."""
    return [(op, arg) for s, op, arg in rec.log if s == stream and op != "record"]


def prefetch_and_backward(rec: Recording, side: str, backward_first: bool) -> list[Task]:
    prefetch = Task.from_fn("prefetch", marked(rec), lookahead=1, stream="prefetch")
    backward = Task.from_fn("backward", marked(rec), same_progress_sync=("prefetch",),
                            same_progress_sync_sides={"prefetch": side})  # fmt: skip
    return [backward, prefetch] if backward_first else [prefetch, backward]


# -- the graph --------------------------------------------------------------------------


def test_only_the_cpu_side_makes_a_topological_edge() -> None:
    rec = Recording(("default", "prefetch"))
    for side, order in (("cpu", ["prefetch", "backward"]), ("device", ["backward", "prefetch"])):
        schedule = Schedule.of(prefetch_and_backward(rec, side, backward_first=True))
        (edge,) = dependency_edges(schedule)
        assert (edge.kind, edge.sides, edge.intra_progress) == (
            "same_progress_sync", side, side == "cpu",
        )  # fmt: skip
        assert [t.name for t in topological_sort(schedule)] == order
        pipe = Pipeline(schedule.tasks, stream_pool=rec.pool, expect_result=False)
        backward = pipe.plan.index["backward"]
        assert pipe.plan.preds[backward] == (() if side == "device" else (pipe.plan.index["prefetch"],))
        assert pipe.plan.waits[backward] == ()  # neither one-sided edge waits before the body
        pipe.shutdown()


# -- the CPU side only -------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["sequential", "async"])
async def test_cpu_side_only_orders_the_bodies_and_issues_no_device_wait(executor: str) -> None:
    rec = Recording(("default", "prefetch"))
    tasks = prefetch_and_backward(rec, "cpu", backward_first=True)
    async with Pipeline(tasks, executor=executor, stream_pool=rec.pool, expect_result=False) as pipe:
        await collect(pipe, iter(range(3)))
    assert consumer_view(rec) == [("body", ("backward", b)) for b in range(3)]
    assert not any(op.startswith("wait") for _, op, _ in rec.log)


async def test_cpu_side_only_holds_the_consumer_until_the_producer_finished() -> None:
    """prefetch's lane is held until the first task on backward's lane has run;
    backward, next on that lane, must still wait for prefetch's body."""
    released = threading.Event()
    done: list[str] = []

    def hold(ctx: TaskContext) -> None:
        assert released.wait(GATE_TIMEOUT_S)

    def release(ctx: TaskContext) -> None:
        released.set()

    def backward(ctx: TaskContext) -> None:
        done.append("backward" if "prefetch" in done else "backward before prefetch")

    tasks = [
        Task.from_fn("release", release),
        Task.from_fn("hold", hold, stream="prefetch"),
        Task.from_fn("backward", backward, same_progress_sync=("prefetch",),
                     same_progress_sync_sides={"prefetch": "cpu"}),
        Task.from_fn("prefetch", lambda ctx: done.append("prefetch"), stream="prefetch"),
    ]  # fmt: skip
    lanes = {"release": "b", "backward": "b", "hold": "a", "prefetch": "a"}
    async with Pipeline(tasks, thread_map=lanes, expect_result=False) as pipe:
        await pipe.step(0)
    assert done == ["prefetch", "backward"]


# -- the device side only ----------------------------------------------------------------


def event_of_prefetch(batch: int) -> tuple[str, FakeEvent]:
    return ("wait_event", FakeEvent("prefetch", "prefetch", batch))


@pytest.mark.parametrize(
    ("backward_first", "expected"),
    [
        # prefetch ran first: as with both sides, this progress's event before the body
        # (or prefetch's stream in the drain, where prefetch does not run)
        (False, [event_of_prefetch(1), ("body", ("backward", 0)),
                 event_of_prefetch(2), ("body", ("backward", 1)),
                 ("wait_stream", "prefetch"), ("body", ("backward", 2))]),
        # backward ran first (no edge orders it after prefetch): the wait comes once
        # prefetch has recorded, at the end of the progress, before the next one
        (True, [("body", ("backward", 0)), event_of_prefetch(1),
                ("body", ("backward", 1)), event_of_prefetch(2),
                ("wait_stream", "prefetch"), ("body", ("backward", 2))]),
    ],
)  # fmt: skip
async def test_device_side_only_waits_before_the_body_or_at_the_end_of_the_progress(
    backward_first: bool, expected: list[tuple[str, object]]
) -> None:
    rec = Recording(("default", "prefetch"))
    tasks = prefetch_and_backward(rec, "device", backward_first=backward_first)
    async with Pipeline(tasks, executor="sequential", stream_pool=rec.pool,
                        expect_result=False) as pipe:  # fmt: skip
        await collect(pipe, iter(range(3)))
    assert consumer_view(rec) == expected


@pytest.mark.parametrize("pool", ["recording", "null"])
async def test_device_side_only_never_holds_the_consumers_host_thread(pool: str) -> None:
    """prefetch's lane waits for a gate that only backward's body opens: a consumer
    held until prefetch finished would never open it."""
    rec = Recording(("default", "prefetch"))
    gates = {i: threading.Event() for i in range(3)}

    def hold(ctx: TaskContext) -> None:
        assert gates[ctx.iter_count].wait(GATE_TIMEOUT_S), "backward waited for prefetch"

    def open_gate(ctx: TaskContext) -> None:
        gates[ctx.iter_count].set()

    tasks = [
        Task.from_fn("backward", marked(rec, open_gate), same_progress_sync=("prefetch",),
                     same_progress_sync_sides={"prefetch": "device"}),
        Task.from_fn("hold", hold, stream="prefetch"),
        Task.from_fn("prefetch", marked(rec), stream="prefetch"),
    ]  # fmt: skip
    lanes = {"backward": "b", "hold": "a", "prefetch": "a"}
    stream_pool = rec.pool if pool == "recording" else None
    async with Pipeline(tasks, thread_map=lanes, stream_pool=stream_pool,
                        expect_result=False) as pipe:  # fmt: skip
        await collect(pipe, iter(range(3)))
    expected_waits = [FakeEvent("prefetch", "prefetch", b) for b in range(3)] if stream_pool else []
    assert [arg for op, arg in consumer_view(rec) if op == "wait_event"] == expected_waits
    bodies = [arg for _, op, arg in rec.log if op == "body"]
    for b in range(3):  # every progress: backward's body, then prefetch's
        assert bodies.index(("backward", b)) < bodies.index(("prefetch", b))
    if stream_pool:  # and each wait follows the body it could not precede
        view = consumer_view(rec)
        for b in range(3):
            assert view.index(("body", ("backward", b))) < view.index(
                ("wait_event", FakeEvent("prefetch", "prefetch", b))
            )
