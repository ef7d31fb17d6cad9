"""``Pipeline``: schedule, streams and executor built from a list of tasks."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from .errors import ConfigurationError
from .executors import Executor, resolve_executor
from .lanes import ThreadMap
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
        _check_thread_map_names(thread_map, [task.name for task in schedule.tasks])
        if stream_pool is None:
            stream_pool = StreamPool.for_device(schedule.stream_slots, device)
        super().__init__(schedule, stream_pool, resolve_executor(executor, thread_map), **options)


def _check_thread_map_names(thread_map: ThreadMap, names: list[str]) -> None:
    """A thread map naming a task the pipeline does not have is refused: misspelt, the
    task would run on lane ``"default"`` without a word."""
    if not isinstance(thread_map, Mapping):
        return
    unknown = [name for name in thread_map if name not in names]
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigurationError(
            f"thread_map names task(s) {unknown} the pipeline does not have{hint}; its "
            f"tasks are {names} (a map shared by pipelines of other tasks: pass a "
            f"function task -> lane name instead)"
        )
