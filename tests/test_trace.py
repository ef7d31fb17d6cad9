"""Timeline tracing: spans per task run, waits, failures, GPU timing, Chrome-trace export."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import re
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
from conftest import Recorder, collect

from aiopipe import Pipeline, StreamPool, Task, TaskContext, Tracer
from aiopipe.errors import ConfigurationError
from aiopipe.trace import Span, merge_traces

THREAD_MAP = {"load": "io", "prep": "io", "train": "compute", "step": "compute"}


def four_tasks(recorder: Recorder) -> list[Task]:
    return [
        recorder.task("load", lookahead=2, stream="io", reads=("batch_cpu",), writes=("raw",)),
        recorder.task("prep", lookahead=1, stream="io", reads=("raw",), writes=("x",)),
        recorder.task("train", reads=("x",), writes=("y",)),
        recorder.task("step", reads=("y",), writes=("step_result",)),
    ]


async def test_one_span_per_task_and_batch_on_the_mapped_lane(recorder: Recorder) -> None:
    async with Pipeline(four_tasks(recorder), thread_map=THREAD_MAP, trace=True) as pipe:
        results = await collect(pipe, iter(range(6)))
    assert results == [f"result-{b}" for b in range(6)]
    tracer = pipe.tracer
    assert tracer is not None
    spans = tracer.spans
    assert sorted((s.task, s.batch) for s in spans) == sorted(
        (t, b) for t in THREAD_MAP for b in range(6)
    )
    for span in spans:
        assert span.lane == THREAD_MAP[span.task]
        assert span.thread == f"aiopipe-lane-{span.lane}"
        assert span.start_ns <= span.end_ns
        assert not span.failed
        # batch b enters at iteration b; a task of lookahead L (of max 2) runs it 2 - L later
        lookahead = {"load": 2, "prep": 1}.get(span.task, 0)
        assert span.iteration == span.batch + 2 - lookahead
    # the recorded threads are the ones the bodies really ran on
    for task in THREAD_MAP:
        assert recorder.threads_of(task) == {f"aiopipe-lane-{THREAD_MAP[task]}"}


async def test_tracing_is_off_by_default(recorder: Recorder) -> None:
    async with Pipeline(four_tasks(recorder), thread_map=THREAD_MAP) as pipe:
        await collect(pipe, iter(range(3)))
    assert pipe.tracer is None


async def test_an_empty_shared_tracer_is_used_not_dropped(recorder: Recorder) -> None:
    tracer = Tracer()
    assert len(tracer) == 0
    async with Pipeline(four_tasks(recorder), executor="sequential", trace=tracer) as pipe:
        await collect(pipe, iter(range(2)))
    assert pipe.tracer is tracer
    assert {s.lane for s in tracer.spans} == {"loop"}
    assert len(tracer) == 8


def slow_then_after(seconds: float) -> list[Task]:
    """``slow`` on one lane, then ``after`` (which needs its slot) on another."""

    def slow(ctx: TaskContext) -> None:
        time.sleep(seconds)
        ctx.slots.set("a", 1)

    def after(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", ctx.slots["a"])

    return [
        Task.from_fn("slow", slow, writes=("a",)),
        Task.from_fn("after", after, reads=("a",), writes=("step_result",)),
    ]


async def test_waiting_on_another_lane_is_measured() -> None:
    tasks = slow_then_after(0.03)
    async with Pipeline(tasks, thread_map={"slow": "a", "after": "b"}, trace=True) as pipe:
        await collect(pipe, iter(range(3)))
    assert pipe.tracer is not None
    spans = pipe.tracer.spans
    waits = [s.wait_ns for s in spans if s.task == "after"]
    assert len(waits) == 3 and min(waits) >= 20_000_000, waits
    assert all(s.wait_ns == 0 for s in spans if s.task == "slow")
    by_batch = {(s.task, s.batch): s for s in spans}
    for b in range(3):
        assert by_batch["after", b].start_ns >= by_batch["slow", b].end_ns


async def test_async_bodies_and_failures_are_traced() -> None:
    async def fetch(ctx: TaskContext) -> None:
        await asyncio.sleep(0.005)
        if ctx.batch_index == 2:
            raise ValueError("bad batch")
        ctx.slots.set("step_result", ctx.batch_index)

    tasks = [Task.from_fn("fetch", fetch, writes=("step_result",))]
    async with Pipeline(tasks, thread_map={"fetch": "io"}, trace=True) as pipe:
        source = iter(range(5))
        assert await pipe.progress(source) == 0
        assert await pipe.progress(source) == 1
        with pytest.raises(ValueError, match="bad batch"):
            await pipe.progress(source)
    assert pipe.tracer is not None
    spans = pipe.tracer.spans
    assert [(s.batch, s.failed) for s in spans] == [(0, False), (1, False), (2, True)]
    assert all(s.lane == "io" and s.duration_ns >= 4_000_000 for s in spans)
    # async bodies run on the loop's thread, whatever their lane
    assert all(not s.thread.startswith("aiopipe-lane") for s in spans)


def test_max_spans_keeps_the_newest() -> None:
    tracer = Tracer(max_spans=3)
    for i in range(5):
        tracer.record(Span("t", i, i, "loop", "main", None, i, i + 1))
    assert [s.iteration for s in tracer.spans] == [2, 3, 4]
    assert tracer.dropped == 2
    with pytest.raises(ValueError):
        Tracer(max_spans=0)


async def test_chrome_trace_has_a_track_per_lane_and_wait_slices(tmp_path: Path) -> None:
    tasks = slow_then_after(0.01)
    async with Pipeline(tasks, thread_map={"slow": "a", "after": "b"}, trace=True) as pipe:
        await collect(pipe, iter(range(2)))
    assert pipe.tracer is not None
    path = pipe.tracer.save(tmp_path / "trace.json", pid=7, process_name="rank 7")
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["lane a", "lane b"]
    slices = [e for e in events if e["ph"] == "X"]
    tasks_by_track = {(e["name"], names[e["tid"]]) for e in slices if e["cat"] == "task"}
    assert tasks_by_track == {("slow", "lane a"), ("after", "lane b")}
    waits = [e for e in slices if e["cat"] == "wait"]
    assert len(waits) == 2 and all(e["dur"] >= 5_000 for e in waits)  # microseconds
    assert all(e["pid"] == 7 for e in events)
    assert {e["args"]["batch"] for e in slices if e["cat"] == "task"} == {0, 1}
    # a wait slice ends where its task's slice starts
    for wait in waits:
        task = next(e for e in slices if e["cat"] == "task" and e["name"] == "after"
                    and e["args"]["batch"] == wait["args"]["batch"])  # fmt: skip
        assert wait["ts"] + wait["dur"] == pytest.approx(task["ts"], abs=1.0)

    merged = merge_traces([path, path], tmp_path / "merged.json")
    assert len(json.loads(merged.read_text())["traceEvents"]) == 2 * len(events)


class TimingEvent:
    """Stands in for a CUDA timing event: stamped with its stream's device clock."""

    def __init__(self) -> None:
        self.at: float | None = None

    def elapsed_time(self, other: TimingEvent) -> float:
        assert self.at is not None and other.at is not None
        return (other.at - self.at) * 1e3

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class TimingStream:
    """A device stream with a clock: work enqueued on it (``enqueue``) runs after
    what it waits for; events stamp the time the stream reaches them."""

    PRODUCER_DEVICE_S = 0.02  # device time of whatever a waited-for event closes

    def __init__(self) -> None:
        self.clock = 0.0

    def now(self) -> float:
        self.clock = max(self.clock, time.perf_counter())
        return self.clock

    def enqueue(self, seconds: float) -> None:
        self.clock = self.now() + seconds

    def record_event(self, event: Any = None) -> Any:
        event = event if event is not None else TimingEvent()
        event.at = self.now()
        return event

    def wait_event(self, event: Any) -> None:
        self.clock = max(self.now(), event.at + self.PRODUCER_DEVICE_S)

    def wait_stream(self, stream: Any) -> None:
        return None


async def test_gpu_timing_brackets_the_body_not_the_waits_before_it() -> None:
    def produce(ctx: TaskContext) -> None:
        ctx.stream.enqueue(0.005)  # type: ignore[union-attr]
        ctx.slots.set("h", 1)

    def compute(ctx: TaskContext) -> None:
        ctx.stream.enqueue(0.01)  # type: ignore[union-attr]  # 10 ms of device work
        ctx.slots.set("step_result", ctx.batch_index)

    def host(ctx: TaskContext) -> None:
        ctx.slots.set("c", 1)

    tasks = [
        Task.from_fn("produce", produce, stream="a", writes=("h",)),
        Task.from_fn("compute", compute, stream="b", reads=("h", "c"), writes=("step_result",)),
        Task.from_fn("host", host, stream="cpu", writes=("c",)),
    ]
    pool = StreamPool({"a": TimingStream(), "b": TimingStream(), "cpu": None})
    tracer = Tracer(gpu_timing=True, event_factory=TimingEvent)
    async with Pipeline(tasks, stream_pool=pool, thread_map={"produce": "x", "compute": "y",
                        "host": "x"}, trace=tracer) as pipe:  # fmt: skip
        assert await collect(pipe, iter(range(3))) == [0, 1, 2]
    spans = {(s.task, s.batch): s for s in tracer.spans}
    for b in range(3):
        assert spans["host", b].gpu_ms is None
        device = spans["compute", b]
        # compute's stream first waits ~20 ms for produce's event: not its own time
        assert device.gpu_ms is not None and 9.5 <= device.gpu_ms <= 12.0, device.gpu_ms
        assert device.gpu_start_ns is not None
        assert spans["produce", b].gpu_ms == pytest.approx(5.0, abs=1.0)
    gpu_slices = [e for e in tracer.chrome_trace()["traceEvents"] if e.get("cat") == "gpu"]
    assert len(gpu_slices) == 6


def test_completed_gpu_timings_release_their_events_as_the_run_goes() -> None:
    tracer = Tracer(gpu_timing=True)
    stream = TimingStream()
    alive = []
    for i in range(1000):
        begin, finish = stream.record_event(TimingEvent()), stream.record_event(TimingEvent())
        alive.append(weakref.ref(begin))
        raw = ("t", i, i, "io", "t", "s", i, i + 1, 0, False, "p", None)
        tracer.append_gpu(raw, begin, finish)
        del begin, finish
    gc.collect()
    assert sum(ref() is not None for ref in alive) < 600  # old ones were resolved
    spans = tracer.spans
    assert len(spans) == 1000 and all(s.gpu_ms is not None and s.gpu_ms >= 0 for s in spans)


def test_reading_spans_mid_run_then_recording_more_keeps_working() -> None:
    tracer = Tracer(gpu_timing=True)
    stream = TimingStream()

    def record(count: int, first: int) -> None:
        for i in range(first, first + count):
            begin, finish = stream.record_event(TimingEvent()), stream.record_event(TimingEvent())
            raw = ("t", i, i, "io", "t", "s", i, i + 1, 0, False, "p", None)
            tracer.append_gpu(raw, begin, finish)

    record(100, 0)
    assert len(tracer.spans) == 100  # resolves every timing, pending ones included
    record(600, 100)  # compaction meets the timings the read resolved
    spans = tracer.spans
    assert len(spans) == 700 and all(s.gpu_ms is not None for s in spans)


class UnfinishedEvent(TimingEvent):
    """Device work still running: query() is False until synchronize()."""

    def query(self) -> bool:
        return False


def test_compaction_never_waits_for_unfinished_device_work() -> None:
    tracer = Tracer(gpu_timing=True)
    stream = TimingStream()
    for i in range(600):
        begin, finish = stream.record_event(TimingEvent()), stream.record_event(UnfinishedEvent())
        raw = ("t", i, i, "io", "t", "s", i, i + 1, 0, False, "p", None)
        tracer.append_gpu(raw, begin, finish)
    assert all(s.gpu_ms is not None for s in tracer.spans)  # reading does wait


def test_summary_aggregates_per_task() -> None:
    tracer = Tracer()
    for i, (task, ms, wait_ms) in enumerate([("a", 1, 0), ("a", 3, 2), ("a", 2, 0), ("b", 5, 1)]):
        start = i * 10_000_000
        tracer.record(Span(task, i, i, "io", "t", "s", start, start + ms * 1_000_000,
                           wait_ns=wait_ms * 1_000_000, failed=task == "b"))  # fmt: skip
    rows = {row["task"]: row for row in tracer.summary()}
    assert rows["a"]["runs"] == 3 and rows["a"]["median_ms"] == 2 and rows["a"]["mean_ms"] == 2
    assert rows["a"]["mean_wait_ms"] == pytest.approx(2 / 3)
    assert rows["b"]["failed"] == 1 and rows["b"]["lane"] == "io"
    assert list(rows) == ["a", "b"]


# -- several pipelines on one tracer -------------------------------------------------------


def meeting_pipeline(name: str | None, tracer: Tracer, meet: threading.Barrier) -> Pipeline:
    """A one-task pipeline whose ``train`` (lane ``compute``) runs each batch while the
    other pipeline's ``train`` runs its own: both wait at ``meet``."""

    def train(ctx: TaskContext) -> None:
        meet.wait(timeout=30)
        ctx.slots.set("step_result", ctx.batch_index)

    task = Task.from_fn("train", train, reads=("batch_cpu",), writes=("step_result",))
    return Pipeline([task], thread_map={"train": "compute"}, trace=tracer, name=name)


async def run_side_by_side(*pipes: Pipeline, batches: int) -> None:
    async with contextlib.AsyncExitStack() as stack:
        for pipe in pipes:
            await stack.enter_async_context(pipe)
        await asyncio.gather(*(collect(pipe, iter(range(batches))) for pipe in pipes))


async def test_pipelines_sharing_a_tracer_get_tracks_of_their_own() -> None:
    tracer, meet = Tracer(), threading.Barrier(2)
    train = meeting_pipeline("train", tracer, meet)
    evaluate = meeting_pipeline("eval", tracer, meet)
    await run_side_by_side(train, evaluate, batches=4)
    spans = tracer.spans
    assert {s.pipeline for s in spans} == {"train", "eval"}
    # the two lanes "compute" really ran at the same time: one track could not hold them
    by_pipeline = {p: [s for s in spans if s.pipeline == p] for p in ("train", "eval")}
    assert any(a.start_ns < b.end_ns and b.start_ns < a.end_ns
               for a in by_pipeline["train"] for b in by_pipeline["eval"])  # fmt: skip

    events = tracer.chrome_trace()["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["eval · lane compute", "train · lane compute"]
    slices = [e for e in events if e["ph"] == "X"]
    tids_of = {p: {e["tid"] for e in slices if names[e["tid"]].startswith(p)}
               for p in ("train", "eval")}  # fmt: skip
    assert len(tids_of["train"]) == len(tids_of["eval"]) == 1
    assert tids_of["train"].isdisjoint(tids_of["eval"])
    for tid in names:
        track = [e for e in slices if e["tid"] == tid]
        assert len(track) == 4
        for before, after in zip(track, track[1:]):  # in time order, none overlapping
            assert before["ts"] + before["dur"] <= after["ts"]
    rows = tracer.summary()
    assert sorted((row["pipeline"], row["task"], row["runs"]) for row in rows) == [
        ("eval", "train", 4), ("train", "train", 4)
    ]  # fmt: skip


async def test_unnamed_pipelines_are_numbered_in_the_order_they_are_built() -> None:
    tracer, meet = Tracer(), threading.Barrier(2)
    first = meeting_pipeline(None, tracer, meet)
    second = meeting_pipeline(None, tracer, meet)
    number = int(first.name.removeprefix("pipeline "))
    assert second.name == f"pipeline {number + 1}"
    await run_side_by_side(first, second, batches=2)
    names = sorted(e["args"]["name"] for e in tracer.chrome_trace()["traceEvents"]
                   if e["name"] == "thread_name")  # fmt: skip
    # Sorted on both sides: "pipeline 100" sorts before "pipeline 99" as text.
    assert names == sorted([f"{first.name} · lane compute", f"{second.name} · lane compute"])


async def test_one_pipeline_keeps_plain_lane_tracks(recorder: Recorder) -> None:
    async with Pipeline(four_tasks(recorder), thread_map=THREAD_MAP, trace=True,
                        name="solo") as pipe:  # fmt: skip
        await collect(pipe, iter(range(2)))
    assert pipe.tracer is not None
    assert {s.pipeline for s in pipe.tracer.spans} == {"solo"}
    events = pipe.tracer.chrome_trace()["traceEvents"]
    assert sorted(e["args"]["name"] for e in events if e["name"] == "thread_name") == [
        "lane compute", "lane io"
    ]  # fmt: skip


# -- awaited time: an async body's suspensions apart from its host time ------------------


class FakeClock:
    """``time.perf_counter_ns`` that moves only when a test moves it."""

    def __init__(self) -> None:
        self.now_ns = 0

    def perf_counter_ns(self) -> int:
        return self.now_ns

    def advance(self, ms: float) -> None:
        self.now_ns += int(ms * 1_000_000)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    from aiopipe._core import steps
    from aiopipe.executors import base

    fake = FakeClock()
    monkeypatch.setattr(steps, "time", fake)
    monkeypatch.setattr(base, "time", fake)
    return fake


@pytest.mark.parametrize("lane", ["loop", "io"])
async def test_an_async_body_s_awaits_are_kept_apart_from_its_host_time(
    clock: FakeClock, lane: str
) -> None:
    """The body works 2 ms, awaits an answer (5 ms pass meanwhile, in another
    coroutine, while it is suspended), then works 1 ms: 3 ms host, 5 ms awaited.
    Events order the two coroutines; the clock moves only where the test says."""
    asked, answered = asyncio.Event(), asyncio.Event()

    async def fetch(ctx: TaskContext) -> None:
        clock.advance(2.0)
        asked.set()
        await answered.wait()
        answered.clear()
        clock.advance(1.0)
        ctx.slots.set("step_result", ctx.batch_index)

    async def feature_store() -> None:
        for _ in range(3):
            await asked.wait()
            asked.clear()
            clock.advance(5.0)
            answered.set()

    tasks = [Task.from_fn("fetch", fetch, writes=("step_result",))]
    async with Pipeline(tasks, thread_map={"fetch": lane}, trace=True) as pipe:
        server = asyncio.ensure_future(feature_store())
        assert [result async for result in pipe.results(range(3))] == [0, 1, 2]
        await server
    assert pipe.tracer is not None
    spans = pipe.tracer.spans
    assert [(s.duration_ns, s.host_ns, s.await_ns) for s in spans] == [
        (8_000_000, 3_000_000, 5_000_000)
    ] * 3
    assert all(s.lane == lane for s in spans)


def test_awaited_time_in_the_summary_the_chrome_trace_and_old_raw_spans() -> None:
    tracer = Tracer()
    tracer.record(Span("fetch", 0, 0, "loop", "main", "io", 0, 6_000_000, await_ns=5_000_000))
    tracer.record(Span("train", 0, 0, "compute", "t", None, 0, 4_000_000))
    tracer.append(("old", 1, 1, "io", "t", None, 0, 1_000, 0, False, "p", None))  # 12 fields
    fetch, train, old = tracer.spans
    assert (fetch.host_ns, fetch.await_ns) == (1_000_000, 5_000_000)
    assert (train.host_ns, train.await_ns, old.await_ns) == (4_000_000, 0, 0)
    rows = {row["task"]: row for row in tracer.summary()}
    assert (rows["fetch"]["mean_await_ms"], rows["train"]["mean_await_ms"]) == (5.0, 0.0)
    slices = {e["name"]: e for e in tracer.chrome_trace()["traceEvents"] if e.get("cat") == "task"}
    assert slices["fetch"]["args"]["await_us"] == 5000.0
    assert "await_us" not in slices["train"]["args"]  # old readers see what they saw


async def test_the_await_clock_passes_results_errors_and_cancellation_through() -> None:
    from aiopipe._core.steps import AwaitClock

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def broken() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad")

    assert await AwaitClock(answer()) == 42
    with pytest.raises(ValueError, match="bad"):
        await AwaitClock(broken())

    entered, never = asyncio.Event(), asyncio.Event()
    seen: list[str] = []

    async def waiting() -> None:
        entered.set()
        try:
            await never.wait()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("finally")

    async def run_clocked() -> None:
        await AwaitClock(waiting())

    task = asyncio.ensure_future(run_clocked())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled", "finally"]

    seen.clear()
    entered.clear()
    outer = run_clocked()
    outer.send(None)  # runs to the await on `never`
    outer.close()  # closing the awaiting coroutine closes the body
    assert seen == ["finally"]


def test_merged_tracers_of_one_process_keep_their_own_rows(tmp_path: Path) -> None:
    # Both files had the same pid and tids: their lanes landed on one track, and
    # nothing said which was "train" and which "eval".
    paths = []
    for name in ("train", "eval"):
        tracer = Tracer()
        tracer.record(Span("step", 0, 0, "compute", "main", None, 10, 20, pipeline=name))
        paths.append(tracer.save(tmp_path / f"{name}.json", pid=4242, process_name="aiopipe"))
    rank = Tracer()
    rank.record(Span("step", 0, 0, "compute", "main", None, 10, 20))
    paths.append(rank.save(tmp_path / "rank1.json", pid=1, process_name="rank 1"))
    events = json.loads(merge_traces(paths, tmp_path / "merged.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {0: "aiopipe (train.json: train)", 1: "aiopipe (eval.json: eval)",
                         2: "rank 1"}  # a name no other file has is kept as it is
    slices = [e for e in events if e["ph"] == "X"]
    assert sorted((e["pid"], e["tid"]) for e in slices) == [(0, 1), (1, 1), (2, 1)]
    assert [e["args"].get("pipeline") for e in slices] == ["train", "eval", None]
    lanes = [(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"]
    assert lanes == [(0, "lane compute"), (1, "lane compute"), (2, "lane compute")]


@pytest.mark.parametrize(("text", "said"), [
    ('{"traceEvents": ', "is not a JSON trace file: Expecting value"),
    ("[]", 'expected a JSON object with a "traceEvents" list of event objects, got a JSON array'),
    ('{"events": []}', "got an object without one"),
    ('{"traceEvents": [1]}', "list of event objects"),
])  # fmt: skip
def test_merge_traces_names_a_file_that_is_not_a_trace(
    text: str, said: str, tmp_path: Path
) -> None:
    # A raw JSONDecodeError (truncated) or TypeError (a JSON array).
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    Tracer().save(good)
    bad.write_text(text)
    with pytest.raises(ConfigurationError, match=f"^{re.escape(str(bad))}.*{re.escape(said)}"):
        merge_traces([good, bad], tmp_path / "merged.json")
    assert not (tmp_path / "merged.json").exists()
