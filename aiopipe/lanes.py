"""Lane policy: which lane thread runs each task.

``thread_map`` says it: ``None``/``"by_stream"`` (lane = stream), ``"per_task"``, a
mapping ``{task name: lane}`` (unmapped tasks go to lane ``"default"``) or a callable
``task -> lane``; lane ``"loop"`` runs sync bodies inline on the event loop.  The
threads themselves are plumbing (:mod:`aiopipe._core.lanes`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Union

from ._core.lanes import LOOP_LANE
from .errors import ConfigurationError, ConfigurationTypeError

if TYPE_CHECKING:
    import torch

    from .task import Task

__all__ = (
    "COMPUTE_LANE", "IO_LANE", "LOOP_LANE", "ThreadMap", "check_thread_map_names",
    "copies_on_io", "resolve_lane", "thread_map_for_device",
)  # fmt: skip

#: Which lane thread runs each task: ``None`` / ``"by_stream"``, ``"per_task"``, a
#: mapping ``{task name: lane}`` or a callable ``task -> lane`` (``aiopipe.lanes``).
ThreadMap = Union[None, str, Mapping[str, str], Callable[["Task"], str]]

#: The two lanes of the default layout on a GPU (and the one lane on a CPU).
IO_LANE = "io"
COMPUTE_LANE = "compute"


def copies_on_io(copies: Iterable[str], others: Iterable[str]) -> dict[str, str]:
    """The default layout on a CUDA device: the copy tasks ``copies`` on lane
    ``"io"`` (overlapping compute on the GPU's copy engine), every task of
    ``others`` on lane ``"compute"`` (so the model's state is touched from one
    thread).  :func:`thread_map_for_device` turns it into one lane on a CPU."""
    lanes = {name: COMPUTE_LANE for name in others}
    lanes.update((name, IO_LANE) for name in copies)
    return lanes


def thread_map_for_device(thread_map: ThreadMap, device: torch.device) -> ThreadMap:
    """A preset's default ``thread_map`` on a CUDA device; on any other device every
    task on lane ``"compute"``.  A second lane overlaps host-to-device copies with
    compute on a GPU's copy engine; a CPU has none, and the lane's thread only takes a
    core from the compute lane's intra-op threads at every step (docs/performance.md,
    ``./dev bench lane_cost``)."""
    return thread_map if device.type == "cuda" else _on_compute_lane


def _on_compute_lane(task: Task) -> str:
    return COMPUTE_LANE


def resolve_lane(task: Task, thread_map: ThreadMap) -> str:
    """The lane of ``task`` under ``thread_map``.

    ``None``/``"by_stream"``: the task's stream.  ``"per_task"``: its name.  (A stream
    or task named ``"loop"`` gets lane ``"loop-stream"`` / ``"loop-task"``: a thread,
    not the event loop.)  A mapping:
    ``thread_map[name]``, falling back to lane ``"default"``.  A callable:
    ``thread_map(task)``.
    """
    if thread_map is None or thread_map == "by_stream":
        lane = _a_thread(task.stream, "stream")
    elif thread_map == "per_task":
        lane = _a_thread(task.name, "task")
    elif isinstance(thread_map, str):
        raise ConfigurationError(
            f"unknown thread_map {thread_map!r}; use 'by_stream', 'per_task', a dict "
            f"{{task name: lane}} or a callable task -> lane"
        )
    elif isinstance(thread_map, Mapping):
        lane = thread_map.get(task.name, "default")
    elif callable(thread_map):
        lane = thread_map(task)
    else:
        raise ConfigurationTypeError(
            f"thread_map must be a str, a mapping or a callable, got {thread_map!r}"
        )
    if not isinstance(lane, str) or not lane:
        raise ConfigurationTypeError(
            f"thread_map gave lane {lane!r} for task {task.name!r}; lanes are names"
        )
    return lane


def _a_thread(name: str, kind: str) -> str:
    """The lane named after a stream or a task: a thread, also for one named like the
    reserved lane ``"loop"`` (a device stream's bodies would block the event loop)."""
    return f"{name}-{kind}" if name == LOOP_LANE else name


def check_thread_map_names(thread_map: ThreadMap, names: list[str]) -> None:
    """Refuse a thread map that names a task the pipeline does not have (``names``):
    misspelt, the task would run on lane ``"default"`` without a word."""
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
