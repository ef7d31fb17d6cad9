"""``CostProfiler``: a :class:`CostModel` from the spans of real progresses.

Tracing (``SchedulablePipeline(..., trace=True)``) records, per task run, the host
time of its body on its lane (for an ``async def`` body, its span less the time it
sat suspended at its awaits, which is kept apart as ``await_ms``), the lane and
stream it ran on, and -- with
``Tracer(gpu_timing=True)`` on a GPU -- the device time between timing events on its
stream.  The profiler keeps robust statistics of those: the median (the
simulator's input) and the 90th percentile (how noisy the task is).  The first
``skip_iterations`` iterations of a run are ignored: they pay for allocator
warm-up, lazy initialisation and the bootstrap of adapters.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from ..lanes import ThreadMap
from ..schedule import Schedule
from ..streams import StreamPool
from ..trace import Span, Tracer
from .costs import CostModel, EngineCosts, TaskCost
from .errors import CostModelError

__all__ = ("CostProfiler", "profile_schedule")


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class CostProfiler:
    """Accumulates spans, then summarises them as a :class:`CostModel`.

    ``pcie`` names tasks whose device work crosses the host link and ``sync`` tasks
    whose body waits for its own device work: neither shows in a span, so the caller
    (who knows the tasks) says so.  ``skip_iterations`` drops the first iterations of
    every span source added.
    """

    def __init__(
        self,
        *,
        skip_iterations: int = 2,
        pcie: Collection[str] = (),
        sync: Collection[str] = (),
    ) -> None:
        self.skip_iterations = skip_iterations
        self.pcie = frozenset(pcie)
        self.sync = frozenset(sync)
        self._host: dict[str, list[float]] = collections.defaultdict(list)
        self._gpu: dict[str, list[float]] = collections.defaultdict(list)
        self._awaited: dict[str, list[float]] = collections.defaultdict(list)
        self._lanes: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self._streams: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )

    def add_spans(self, spans: Iterable[Span]) -> int:
        """Add the spans of successful task runs; return how many were kept."""
        spans = list(spans)
        if not spans:
            return 0
        first = min(span.iteration for span in spans)
        kept = 0
        for span in spans:
            if span.failed or span.iteration < first + self.skip_iterations:
                continue
            self._host[span.task].append(span.host_ns / 1e6)
            self._awaited[span.task].append(span.await_ns / 1e6)
            if span.gpu_ms is not None:
                self._gpu[span.task].append(span.gpu_ms)
            self._lanes[span.task][span.lane] += 1
            if span.stream is not None:
                self._streams[span.task][span.stream] += 1
            kept += 1
        return kept

    def add_tracer(self, tracer: Tracer, *, clear: bool = True) -> int:
        """Add a tracer's spans (and by default clear it, so runs are not counted twice)."""
        kept = self.add_spans(tracer.spans)
        if clear:
            tracer.clear()
        return kept

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self._host)

    def cost_model(
        self, engine: EngineCosts | None = None, meta: Mapping[str, Any] | None = None
    ) -> CostModel:
        """The median costs seen so far."""
        if not self._host:
            raise CostModelError(
                "the profiler saw no task runs; trace some progresses (trace=True) past "
                f"the first {self.skip_iterations} iterations and add the tracer's spans"
            )
        tasks = {}
        for name, host in self._host.items():
            gpu = self._gpu.get(name)
            tasks[name] = TaskCost(
                host_ms=round(statistics.median(host), 4),
                gpu_ms=round(statistics.median(gpu), 4) if gpu else 0.0,
                await_ms=round(statistics.median(self._awaited[name]), 4),
                sync=name in self.sync,
                pcie=name in self.pcie,
                samples=len(host),
                host_p90_ms=round(_percentile(host, 0.9), 4),
                lane=self._lanes[name].most_common(1)[0][0],
                stream=(self._streams[name].most_common(1)[0][0]
                        if self._streams.get(name) else None),  # fmt: skip
            )
        return CostModel(tasks, engine or EngineCosts(), meta or {})


async def profile_schedule(
    schedule: Schedule,
    *,
    thread_map: ThreadMap = None,
    stream_pool: StreamPool | None = None,
    batches: int = 40,
    source: Iterable[Any] | None = None,
    profiler: CostProfiler | None = None,
    engine: EngineCosts | None = None,
    meta: Mapping[str, Any] | None = None,
) -> CostModel:
    """Run ``schedule`` on the async executor with tracing on and return its costs.

    ``source`` defaults to ``range(batches)``; task bodies must accept its items.
    ``engine`` defaults to :func:`~aiopipe.autosched.calibrate_engine` on this machine.
    """
    from ..executors import AsyncExecutor
    from ..pipeline import SchedulablePipeline
    from .calibrate import calibrate_engine

    profiler = profiler or CostProfiler()
    tracer = Tracer()
    pipe = SchedulablePipeline(schedule, stream_pool, AsyncExecutor(thread_map), trace=tracer,
                               expect_result=False)  # run for its timings  # fmt: skip
    started = time.perf_counter()
    try:
        async for _ in pipe.results(iter(source if source is not None else range(batches))):
            pass
    finally:
        pipe.shutdown()
    profiler.add_tracer(tracer)
    info = {"profiled_batches": batches, "profile_seconds": round(time.perf_counter() - started, 3)}
    if engine is None:
        engine = await calibrate_engine()
    return profiler.cost_model(engine, {**info, **(meta or {})})
