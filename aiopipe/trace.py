"""Timeline tracing: one span per task run, exported as Chrome-trace JSON.

Switch it on per pipeline with ``SchedulablePipeline(..., trace=True)`` (or pass a
:class:`Tracer` to share one between pipelines), run some progresses, then
``pipe.tracer.save("trace.json")`` and open the file in Perfetto
(https://ui.perfetto.dev) or ``chrome://tracing``.  With tracing off the executors
skip this module entirely.

Each :class:`Span` says which task ran, for which iteration and batch, on which lane
and thread, under which stream, when it started and ended (``time.perf_counter_ns``)
and how long it was ready but waiting on another lane or a collective ticket.  For an
``async def`` body the span also says how long the coroutine sat suspended at its
``await``s (``await_ns``): only the rest (``host_ns``) is work on the loop's thread.  On a
GPU, ``Tracer(gpu_timing=True)`` also records a pair of timing events around each
device task, so the span carries the stream's time for it (``gpu_ms``).
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .options import checked_count
from .trace_files import merge_traces as merge_traces

__all__ = (
    "Span", "Tracer", "merge_traces", "resolve_tracer", "several_pipelines", "track_name",
    "track_numbers",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Span:
    """One run of one task body."""

    task: str
    iteration: int
    batch: int
    #: The lane the thread map gave the task; ``"loop"`` for the event loop.
    lane: str
    #: The thread that actually ran the body (async bodies run on the loop's thread).
    thread: str
    stream: str | None
    start_ns: int
    end_ns: int
    #: Ready (the lane reached it) but blocked on another lane's task or a ticket.
    wait_ns: int = 0
    #: Device time between timing events recorded on the task's stream, when measured.
    gpu_ms: float | None = None
    #: When the stream reached the task, on the host clock; ``None`` without GPU timing.
    gpu_start_ns: int | None = None
    failed: bool = False
    #: The name of the pipeline that ran it (``SchedulablePipeline.name``).
    pipeline: str = ""
    #: Of the span, the time an ``async def`` body sat suspended at its awaits
    #: (0 for synchronous bodies): latency, not work on the thread.
    await_ns: int = 0

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def host_ns(self) -> int:
        """The span less the time suspended at ``await``: the body's work on its thread."""
        return self.end_ns - self.start_ns - self.await_ns


#: What Iteration hands over per task run, turned into a Span only when read:
#: (task, iteration, batch, lane, thread, stream, start_ns, end_ns, wait_ns, failed,
#:  pipeline, _GpuTiming or None, await_ns).  Appending a tuple to a deque keeps
#: tracing cheap.  ``await_ns`` came last, and tuples without it still read (as 0).
RawSpan = tuple[str, int, int, str, str, "str | None", int, int, int, bool, str, Any, int]

#: Completed GPU timings are turned into numbers (and their events released) in
#: batches of this many, so a long traced run does not hold millions of events.
_GPU_COMPACT_EVERY = 256


class _GpuTiming:
    """A device task's timing events until resolved, then its numbers."""

    __slots__ = ("begin", "finish", "ms", "start_ns")

    def __init__(self, begin: Any, finish: Any) -> None:
        self.begin, self.finish = begin, finish
        self.ms: float | None = None
        self.start_ns: int | None = None

    def resolve(self, origin: tuple[Any, int] | None) -> None:
        """Turn the events into numbers (waits for the device).  Idempotent and safe
        to race: a lane compacting and a reader reading compute the same values."""
        begin, finish = self.begin, self.finish
        if begin is None or finish is None:
            return
        finish.synchronize()
        ms = float(begin.elapsed_time(finish))
        start_ns = None
        if origin is not None:
            start_ns = origin[1] + int(float(origin[0].elapsed_time(begin)) * 1e6)
        self.ms, self.start_ns = ms, start_ns  # numbers first, then drop the events
        self.begin = self.finish = None

    def done(self) -> bool:
        """Resolved, or its device work has completed (never waits)."""
        finish = self.finish
        return finish is None or bool(finish.query())


class Tracer:
    """Collects :class:`Span` objects from every pipeline it is given to.

    ``max_spans`` bounds memory in long runs: the oldest spans are dropped first
    (``dropped`` counts them).  ``gpu_timing=True`` records timing events on the
    stream of every device task; ``event_factory`` makes those events (default
    ``torch.cuda.Event(enable_timing=True)``; any object with ``elapsed_time``,
    ``synchronize`` and ``query`` that the stream's ``record_event`` accepts works).
    """

    def __init__(
        self,
        *,
        max_spans: int = 1_000_000,
        gpu_timing: bool = False,
        event_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.max_spans = checked_count("max_spans", max_spans)
        self.gpu_timing = gpu_timing
        self._event_factory = event_factory
        self._raw: collections.deque[RawSpan] = collections.deque(maxlen=max_spans)
        self._lock = threading.Lock()  # uncontended in practice: ~0.1 us per span
        self._recorded = 0
        self._gpu_origin: tuple[Any, int] | None = None  # (event, host ns when recorded)
        self._gpu_pending: collections.deque[_GpuTiming] = collections.deque()
        # perf_counter_ns is per process; exported times add this offset so traces
        # of several ranks on one host line up.
        self._wall_offset_ns = time.time_ns() - time.perf_counter_ns()

    # -- recording (called by Iteration, from any thread) -------------------------------------

    def append(self, raw: RawSpan) -> None:
        with self._lock:
            self._recorded += 1
            self._raw.append(raw)

    def append_gpu(self, raw: RawSpan, begin: Any, finish: Any) -> None:
        """``append`` for a device task timed by a pair of events."""
        timing = _GpuTiming(begin, finish)
        self.append((*raw[:11], timing, *raw[12:]))
        with self._lock:
            self._gpu_pending.append(timing)
            compact = len(self._gpu_pending) >= 2 * _GPU_COMPACT_EVERY
        if compact:
            self._compact_gpu()

    def _compact_gpu(self) -> None:
        """Resolve the oldest completed timings (never waits for the device)."""
        for _ in range(_GPU_COMPACT_EVERY):
            with self._lock:
                if not self._gpu_pending or not self._gpu_pending[0].done():
                    return
                timing = self._gpu_pending.popleft()
            timing.resolve(self._gpu_origin)  # a no-op if a reader resolved it already

    def record(self, span: Span) -> None:
        """Add a finished span (for spans measured outside a pipeline)."""
        self.append((
            span.task, span.iteration, span.batch, span.lane, span.thread, span.stream,
            span.start_ns, span.end_ns, span.wait_ns, span.failed, span.pipeline, None,
            span.await_ns,
        ))  # fmt: skip

    def gpu_event(self) -> Any:
        """A timing event for a device task (the first one becomes the time origin)."""
        if self._event_factory is not None:
            return self._event_factory()
        import torch

        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def note_gpu_origin(self, event: Any, host_ns: int) -> None:
        if self._gpu_origin is None:
            self._gpu_origin = (event, host_ns)

    # -- reading -----------------------------------------------------------------------

    @property
    def spans(self) -> list[Span]:
        """All spans kept so far, oldest first (waits for pending GPU timings)."""
        with self._lock:
            raws = list(self._raw)
        return [self._span(raw) for raw in raws]

    @property
    def dropped(self) -> int:
        """Spans dropped to stay within ``max_spans``."""
        with self._lock:
            return self._recorded - len(self._raw)

    def clear(self) -> None:
        with self._lock:
            self._raw.clear()
            self._gpu_pending.clear()
            self._recorded = 0

    def _span(self, raw: tuple[Any, ...]) -> Span:
        (task, iteration, batch, lane, thread, stream, start, end, wait, failed, pipeline,
         gpu) = raw[:12]
        gpu_ms = gpu_start = None
        if gpu is not None:
            gpu.resolve(self._gpu_origin)  # waits for the device if still running
            gpu_ms, gpu_start = gpu.ms, gpu.start_ns
        awaited = raw[12] if len(raw) > 12 else 0
        return Span(task, iteration, batch, lane, thread, stream, start, end, wait,
                    gpu_ms, gpu_start, failed, pipeline, awaited)  # fmt: skip

    # -- export ------------------------------------------------------------------------

    def chrome_trace(self, *, process_name: str | None = None, pid: int | None = None) -> dict[str, Any]:
        """The spans as a Chrome-trace / Perfetto JSON object.

        One process (``pid``: the distributed rank when a process group is up, else the
        OS pid), one track per lane, plus one track per stream for GPU times; waiting
        shows as its own ``wait`` slice just before the task's slice.  When several
        pipelines share the tracer each has its own tracks, named after it
        (``"train · lane compute"``), grouped by pipeline.
        """
        spans = self.spans
        default_pid, default_name = _default_process()
        if pid is None:
            pid = default_pid
        if process_name is None:
            process_name = default_name
        tracks = track_numbers(spans)
        several = several_pipelines(spans)
        offset = self._wall_offset_ns
        events: list[dict[str, Any]] = []
        for span in spans:
            track = tracks[track_name(span, several)]
            args = {
                "iteration": span.iteration,
                "batch": span.batch,
                "stream": span.stream,
                "thread": span.thread,
                "wait_us": span.wait_ns / 1e3,
            }
            if span.pipeline:
                args["pipeline"] = span.pipeline
            if span.await_ns:
                args["await_us"] = span.await_ns / 1e3
            if span.failed:
                args["failed"] = True
            if span.wait_ns:
                events.append(_slice(
                    f"wait {span.task}", "wait", pid, track,
                    span.start_ns - span.wait_ns + offset, span.wait_ns, args,
                    colour="grey",
                ))  # fmt: skip
            events.append(_slice(
                span.task, "task", pid, track, span.start_ns + offset, span.duration_ns,
                args, colour="terrible" if span.failed else None,
            ))  # fmt: skip
            if span.gpu_ms is not None and span.gpu_start_ns is not None:
                events.append(_slice(
                    span.task, "gpu", pid, tracks[track_name(span, several, gpu=True)],
                    span.gpu_start_ns + offset, int(span.gpu_ms * 1e6), args,
                ))  # fmt: skip
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process_name}}
        ]
        for name, number in tracks.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": number,
                         "args": {"name": name}})  # fmt: skip
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": number,
                         "args": {"sort_index": number}})  # fmt: skip
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike[str], **kwargs: Any) -> Path:
        """Write :meth:`chrome_trace` to ``path`` and return it."""
        target = Path(path)
        target.write_text(json.dumps(self.chrome_trace(**kwargs)))
        return target

    def summary(self) -> list[dict[str, Any]]:
        """Per task of each pipeline, in first-seen order: runs, median and mean ms
        (the whole span), mean ms suspended at ``await`` (``async def`` bodies), mean
        wait ms, failures."""
        by_task: dict[tuple[str, str], list[Span]] = {}
        for span in self.spans:
            by_task.setdefault((span.pipeline, span.task), []).append(span)
        rows = []
        for (pipeline, task), spans in by_task.items():
            durations = sorted(s.duration_ns / 1e6 for s in spans)
            rows.append({
                "pipeline": pipeline,
                "task": task,
                "lane": spans[-1].lane,
                "stream": spans[-1].stream,
                "runs": len(spans),
                "median_ms": durations[len(durations) // 2],
                "mean_ms": sum(durations) / len(durations),
                "mean_await_ms": sum(s.await_ns for s in spans) / len(spans) / 1e6,
                "mean_wait_ms": sum(s.wait_ns for s in spans) / len(spans) / 1e6,
                "failed": sum(s.failed for s in spans),
            })  # fmt: skip
        return rows

    def __len__(self) -> int:
        return len(self._raw)

    def __repr__(self) -> str:
        return f"<Tracer spans={len(self._raw)} dropped={self.dropped}>"


def track_name(span: Span, several_pipelines: bool, *, gpu: bool = False) -> str:
    """The track (timeline row) of ``span``: ``"lane NAME"``, or ``"stream NAME"`` for
    its GPU time; prefixed with the pipeline's name when several pipelines share it."""
    track = f"stream {span.stream}" if gpu else f"lane {span.lane}"
    return f"{span.pipeline} · {track}" if several_pipelines and span.pipeline else track


def several_pipelines(spans: Iterable[Span]) -> bool:
    """Whether ``spans`` come from more than one pipeline (tracks then name theirs)."""
    return len({span.pipeline for span in spans}) > 1


def track_numbers(spans: Sequence[Span]) -> dict[str, int]:
    """Track name -> tid from 1: pipelines in first-seen order, in each its lanes and
    then its streams, each in first-seen order."""
    several = several_pipelines(spans)
    pipelines: dict[str, int] = {}
    keys: dict[str, tuple[int, int, int]] = {}
    for span in spans:
        rank = pipelines.setdefault(span.pipeline, len(pipelines))
        keys.setdefault(track_name(span, several), (rank, 0, len(keys)))
        if span.gpu_ms is not None and span.gpu_start_ns is not None:
            keys.setdefault(track_name(span, several, gpu=True), (rank, 1, len(keys)))
    ordered = sorted(keys, key=keys.__getitem__)
    return {name: number for number, name in enumerate(ordered, start=1)}


def resolve_tracer(trace: bool | Tracer | None) -> Tracer | None:
    """What a ``trace=`` argument means: ``True`` a fresh tracer, a tracer itself,
    ``False``/``None`` no tracing."""
    if trace is True:
        return Tracer()
    return None if trace is False else trace


def _slice(
    name: str, category: str, pid: int, tid: int, start_ns: int, duration_ns: int,
    args: dict[str, Any], colour: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    event: dict[str, Any] = {
        "name": name, "cat": category, "ph": "X", "pid": pid, "tid": tid,
        "ts": start_ns / 1e3, "dur": max(duration_ns, 0) / 1e3, "args": args,
    }  # fmt: skip
    if colour is not None:
        event["cname"] = colour
    return event


def _default_process() -> tuple[int, str]:
    """The distributed rank when a process group is up, else the OS pid."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = int(dist.get_rank())
            return rank, f"aiopipe rank {rank}"
    except Exception:  # a broken process group must not break tracing
        pass
    return os.getpid(), f"aiopipe pid {os.getpid()}"
