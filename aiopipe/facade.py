"""``Pipeline``: schedule, streams and executor built from a list of tasks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._core.nvtx import Annotator
from .executors import Executor, resolve_executor
from .lanes import ThreadMap
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
    stream), or pass your own ``stream_pool``.  ``executor`` defaults to an
    :class:`AsyncExecutor` -- sync bodies on one lane thread per stream (or per
    ``thread_map``), so the event loop never waits for them; ``"sequential"`` runs
    them inline on the loop instead (cheapest for tiny bodies, but it blocks the loop).
    The other options (``check_batch``, ``expect_result``, ...) are those of
    :class:`SchedulablePipeline`.  A non-``Task`` entry in ``tasks`` raises
    :class:`~aiopipe.errors.ConfigurationTypeError` (a ``TypeError``) naming it and its
    position; an empty list is refused.
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
        read_ahead: bool = True,
        expect_result: bool = True,
        name: str | None = None,
    ) -> None:
        schedule = Schedule.of(tasks)
        if stream_pool is None:
            stream_pool = StreamPool.for_device(schedule.stream_slots, device)
        super().__init__(
            schedule, stream_pool, resolve_executor(executor, thread_map), nvtx=nvtx, trace=trace, check_batch=check_batch,
            read_ahead=read_ahead, expect_result=expect_result, name=name,
        )  # fmt: skip
