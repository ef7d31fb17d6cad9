"""Executors: strategies for running the active tasks of one iteration.

``SequentialExecutor`` is the reference; ``AsyncExecutor`` runs one event loop plus
GPU-submit lane threads.  Any object following :class:`Executor` plugs in: it is
bound to an :class:`ExecutionPlan` once and runs one :class:`Iteration` per iteration.
"""

from __future__ import annotations

import torch

from ..errors import ConfigurationError, ConfigurationTypeError
from ..lanes import ThreadMap, thread_map_for_device
from ..plan import ActiveSet, ExecutionPlan
from .asyncio_executor import AsyncExecutor, IterationHandle
from .base import Executor, Iteration
from .sequential import SequentialExecutor

__all__ = (
    "ActiveSet", "AsyncExecutor", "ExecutionPlan", "Executor", "SequentialExecutor", "Iteration",
    "IterationHandle", "resolve_executor",
)  # fmt: skip


def resolve_executor(
    executor: str | Executor | None = None,
    thread_map: ThreadMap = None,
    *,
    default_thread_map: ThreadMap = None,
    device: torch.device | str | None = None,
) -> Executor:
    """The executor that the ``executor=`` and ``thread_map=`` options of every
    pipeline ask for; the one place that decides it.

    ``executor``: ``None`` or ``"async"`` (an :class:`AsyncExecutor`), ``"sequential"``
    or an executor instance.  ``thread_map`` configures the async executor, so it
    cannot go with another choice.  Without one, the async executor uses
    ``default_thread_map`` -- the pipeline's own layout, kept on a CUDA ``device``
    and folded onto one ``"compute"`` lane on any other
    (:func:`~aiopipe.lanes.thread_map_for_device`) -- or, without that, one lane per
    stream.  So does an :class:`AsyncExecutor` instance built without a thread map
    (``AsyncExecutor(check_collective_order=1)``): it takes the pipeline's default
    lanes, as ``executor=None`` would."""
    default = None
    if default_thread_map is not None:
        where = torch.device(device) if device is not None else torch.device("cpu")
        default = thread_map_for_device(default_thread_map, where)
    if executor is None or executor == "async":
        return AsyncExecutor(thread_map if thread_map is not None else default)
    if thread_map is not None:
        raise ConfigurationError(
            f"thread_map configures the async executor; drop thread_map or executor={executor!r}"
        )
    if executor == "sequential":
        return SequentialExecutor()
    if isinstance(executor, str):
        raise ConfigurationError(
            f"unknown executor {executor!r}; use 'async', 'sequential' or an instance"
        )
    if isinstance(executor, type):
        raise ConfigurationTypeError(
            f"executor takes an instance, got the class {executor.__name__}: pass "
            f"{executor.__name__}() (or 'async' / 'sequential')"
        )
    if not isinstance(executor, Executor):
        raise ConfigurationTypeError(
            f"executor must be 'async', 'sequential' or provide bind/run_iteration/shutdown, "
            f"got {executor!r}"
        )
    if isinstance(executor, AsyncExecutor) and default is not None:
        executor.take_default_thread_map(default)
    return executor
