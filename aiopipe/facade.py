"""``Pipeline``: schedule, streams and executor built from a list of tasks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._nvtx import Annotator
from .executors import AsyncExecutor, Executor
from .executors.lanes import ThreadMap
from .pipeline import SchedulablePipeline
from .schedule import Schedule
from .streams import StreamPool
from .task import Task
from .trace import Tracer

__all__ = ("Pipeline",)


class Pipeline(SchedulablePipeline):
    """A single-stage pipeline of ``tasks``.

    Streams are the ones the tasks name: CPU null streams unless ``device`` is a CUDA
    device (then ``"default"`` is the current stream and every other name a new
    stream), or pass your own ``stream_pool``.  ``executor`` defaults to
    ``"sequential"``, or to an :class:`AsyncExecutor` when ``thread_map`` is given.
    """

    def __init__(
        self,
        tasks: Iterable[Task],
        *,
        executor: str | Executor | None = None,
        thread_map: ThreadMap = None,
        device: torch.device | str | None = None,
        stream_pool: StreamPool | None = None,
        nvtx: bool | Annotator | None = None,
        trace: bool | Tracer | None = None,
        check_batch: Callable[[Any], None] | None = None,
    ) -> None:
        schedule = Schedule.of(tasks)
        if stream_pool is None:
            stream_pool = StreamPool.for_device(schedule.stream_slots, device)
        if thread_map is not None:
            if executor not in (None, "async"):
                raise ValueError("thread_map configures the async executor; drop one of them")
            executor = AsyncExecutor(thread_map)
        elif executor is None:
            executor = "sequential"
        super().__init__(
            schedule, stream_pool, executor, nvtx=nvtx, trace=trace, check_batch=check_batch
        )
