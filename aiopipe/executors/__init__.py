"""Executors: strategies for running the active tasks of one iteration.

``SequentialExecutor`` is the reference; ``AsyncExecutor`` runs one event loop plus
GPU-submit lane threads.  Any object following :class:`Executor` plugs in: it is
bound to an :class:`ExecutionPlan` once and runs one :class:`Step` per iteration.
"""

from __future__ import annotations

from ..plan import ActiveSet, ExecutionPlan
from .asyncio_executor import AsyncExecutor, StepHandle
from .base import Executor, Step
from .sequential import SequentialExecutor

__all__ = (
    "ActiveSet", "AsyncExecutor", "ExecutionPlan", "Executor", "SequentialExecutor", "Step",
    "StepHandle", "make_executor",
)  # fmt: skip


def make_executor(spec: str | Executor) -> Executor:
    """``"sequential"``, ``"async"`` or an executor instance."""
    if isinstance(spec, str):
        if spec == "sequential":
            return SequentialExecutor()
        if spec == "async":
            return AsyncExecutor()
        raise ValueError(f"unknown executor {spec!r}; use 'sequential', 'async' or an instance")
    if not isinstance(spec, Executor):
        raise TypeError(
            f"executor must be 'sequential', 'async' or provide bind/run_step/shutdown, "
            f"got {spec!r}"
        )
    return spec
