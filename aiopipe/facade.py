"""``Pipeline``: schedule, streams and executor built from a list of tasks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from .executors import Executor, resolve_executor
from .lanes import ThreadMap, check_thread_map_names
from .pipeline import SchedulablePipeline
from .schedule import Schedule
from .streams import StreamPool
from .task import Task

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; only read by type checkers

    from .options import PipelineOptions

__all__ = ("Pipeline",)


class Pipeline(SchedulablePipeline):
    """A single-stage pipeline of ``tasks``.

    Streams are the ones the tasks name: CPU null streams unless ``device`` is a CUDA
    device (then ``"default"`` is the current stream and every other name a new
    stream), or pass your own ``stream_pool``.  ``executor`` defaults to an
    :class:`AsyncExecutor` -- sync bodies on one lane thread per stream (or per
    ``thread_map``), so the event loop never waits for them; ``"sequential"`` runs
    them inline on the loop instead (cheapest for tiny bodies, but it blocks the loop).
    The keyword options (``trace``, ``check_batch``, ``name``, ...) are those of every
    pipeline, :class:`~aiopipe.options.PipelineOptions`.  A non-``Task`` entry in
    ``tasks`` raises :class:`~aiopipe.errors.ConfigurationTypeError` (a ``TypeError``)
    naming it and its position; an empty list is refused.
    """

    def __init__(
        self,
        tasks: Iterable[Task],
        *,
        executor: str | Executor | None = None,
        thread_map: ThreadMap = None,
        device: torch.device | str | None = None,
        stream_pool: StreamPool | None = None,
        **options: Unpack[PipelineOptions],
    ) -> None:
        schedule = Schedule.of(tasks)
        check_thread_map_names(thread_map, [task.name for task in schedule.tasks])
        if stream_pool is None:
            stream_pool = StreamPool.for_device(schedule.stream_slots, device)
        super().__init__(schedule, stream_pool, resolve_executor(executor, thread_map), **options)
