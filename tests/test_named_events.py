"""User-named events: ``ctx.record_event(name)`` / ``ctx.wait_event(name)`` order
device work around state outside slots, apart from the engine's own events."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import collect
from test_streams_events import FakeEvent, Recording

from aiopipe import (
    ConfigurationError,
    ConfigurationTypeError,
    Pipeline,
    PipelineStateError,
    StreamPool,
    Task,
    TaskContext,
)

EXECUTORS = ["sequential", "async"]


def labelled(rec: Recording, then: Any) -> Any:
    """Run ``then(ctx)`` with the events recorded meanwhile labelled by this task."""

    def run(ctx: TaskContext) -> None:
        rec.current.task = (ctx.task.name, ctx.batch_index)
        then(ctx)

    return run


def cache_pipeline(rec: Recording | None, executor: str, waited: list[Any]) -> Pipeline:
    """``update`` (lookahead 1, prefetch stream) touches a cache and records "cache";
    ``read`` (lookahead 0, default stream) waits for it in the same progress."""

    def update(ctx: TaskContext) -> None:
        ctx.record_event("cache")

    def read(ctx: TaskContext) -> None:
        waited.append((ctx.batch_index, ctx.wait_event("cache")))

    tasks = [
        Task.from_fn("update", labelled(rec, update) if rec else update, lookahead=1,
                     stream="prefetch"),
        Task.from_fn("read", read, same_progress_sync=("update",),
                     same_progress_sync_sides={"update": "cpu"}),
    ]  # fmt: skip
    return Pipeline(tasks, executor=executor, stream_pool=rec.pool if rec else None,
                    expect_result=False)  # fmt: skip


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_wait_event_waits_for_the_latest_record_on_the_waiting_stream(executor: str) -> None:
    rec = Recording(("default", "prefetch"))
    waited: list[Any] = []
    async with cache_pipeline(rec, executor, waited) as pipe:
        await collect(pipe, iter(range(3)))
    # read on batch b runs in the progress where update handles batch b + 1; in the
    # drain update does not run and the latest record is still the previous one
    assert waited == [(0, 1), (1, 2), (2, 2)]
    assert rec.waits("default") == [
        ("wait_event", FakeEvent("prefetch", "update", 1)),
        ("wait_event", FakeEvent("prefetch", "update", 2)),
        ("wait_event", FakeEvent("prefetch", "update", 2)),
    ]


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_on_cpu_null_streams_only_the_bookkeeping_remains(executor: str) -> None:
    waited: list[Any] = []
    recorded: list[Any] = []

    def update(ctx: TaskContext) -> None:
        recorded.append(ctx.record_event("cache"))

    async with cache_pipeline(None, executor, waited) as pipe:
        await collect(pipe, iter(range(3)))
    assert waited == [(0, 1), (1, 2), (2, 2)]  # the same answers as with streams
    async with Pipeline([Task.from_fn("u", update)], executor=executor,
                        expect_result=False) as pipe:  # fmt: skip
        await pipe.step(0)
    assert recorded == [None]  # no device event on a null stream


async def test_waiting_for_a_name_never_recorded_issues_nothing() -> None:
    rec = Recording(("default",))
    answers: list[Any] = []
    tasks = [Task.from_fn("read", lambda ctx: answers.append(ctx.wait_event("never")))]
    async with Pipeline(tasks, stream_pool=rec.pool, expect_result=False) as pipe:
        await pipe.step(0)
    assert answers == [None]
    assert rec.waits("default") == []


async def test_named_events_are_kept_apart_from_the_engines_task_events() -> None:
    """A user event named like a task neither sees nor replaces that task's event."""
    rec = Recording(("default", "memcpy"))
    answers: list[Any] = []

    def h2d(ctx: TaskContext) -> None:
        ctx.slots.set("x", ctx.batch_index)

    def forward(ctx: TaskContext) -> None:
        answers.append(ctx.wait_event("h2d"))  # the engine's event for h2d is not it
        ctx.record_event("h2d")  # nor does this replace the engine's event

    tasks = [
        Task.from_fn("h2d", labelled(rec, h2d), lookahead=1, stream="memcpy", writes=("x",)),
        Task.from_fn("forward", labelled(rec, forward), reads=("x",)),
    ]
    async with Pipeline(tasks, executor="sequential", stream_pool=rec.pool,
                        expect_result=False) as pipe:  # fmt: skip
        await collect(pipe, iter(range(3)))
    assert answers == [None, 0, 1]  # only forward's own earlier records
    engine_waits = [FakeEvent("memcpy", "h2d", b) for b in range(3)]
    user_waits = [FakeEvent("default", "forward", b) for b in range(2)]
    assert [arg for op, arg in rec.waits("default")] == [
        engine_waits[0], engine_waits[1], user_waits[0], engine_waits[2], user_waits[1],
    ]  # fmt: skip


async def test_init_may_record_and_its_record_belongs_to_no_batch() -> None:
    answers: list[Any] = []
    task = Task.from_fn("t", lambda ctx: answers.append(ctx.wait_event("warm")),
                        init=lambda ctx: ctx.record_event("warm"))  # fmt: skip
    async with Pipeline([task], expect_result=False) as pipe:
        await pipe.step(0)
    assert answers == [-1]


@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        ("", ConfigurationError, "must not be empty"),
        (None, ConfigurationTypeError, "must be a string"),
    ],
)
async def test_event_names_must_be_non_empty_strings(name: Any, error: type, message: str) -> None:
    failures: list[BaseException] = []

    def body(ctx: TaskContext) -> None:
        for call in (ctx.record_event, ctx.wait_event):
            try:
                call(name)
            except Exception as exc:
                failures.append(exc)

    async with Pipeline([Task.from_fn("t", body)], expect_result=False) as pipe:
        await pipe.step(0)
    assert [type(f) for f in failures] == [error, error]
    assert all(message in str(f) for f in failures)
    builtin = ValueError if error is ConfigurationError else TypeError  # caught as before
    assert all(isinstance(f, builtin) for f in failures)


def test_named_events_need_a_running_task() -> None:
    ctx = TaskContext(StreamPool({"default": None}))
    with pytest.raises(PipelineStateError, match="inside a running task"):
        ctx.record_event("cache")
    with pytest.raises(PipelineStateError, match="inside a running task"):
        ctx.wait_event("cache")
