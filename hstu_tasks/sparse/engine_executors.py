"""``EngineExecutors``: the executor each engine of one pipeline on a rewritten model
gets.  A pipeline builds a new engine after ``detach()``/``attach()`` or ``reset()``,
and an executor serves one engine: each gets its own, resolved from the same choice,
except an executor instance the caller gave, which serves the first engine only."""

from __future__ import annotations

from collections.abc import Callable

import torch

from aiopipe import AsyncExecutor, Executor, PipelineStateError, Task
from aiopipe.executors import resolve_executor
from aiopipe.lanes import ThreadMap, check_thread_map_names, resolve_lane

__all__ = ("EngineExecutors",)


class EngineExecutors:
    """``executor`` and ``thread_map`` as given to a pipeline of ``what`` on ``device``
    (:func:`aiopipe.executors.resolve_executor`, with ``default_thread_map``)."""

    def __init__(self, executor: str | Executor | None, thread_map: ThreadMap, *,
                 device: torch.device, default_thread_map: dict[str, str], what: str,
                 tasks: Callable[[], list[Task]]) -> None:  # fmt: skip
        self._choice = (executor, thread_map)
        self._device, self._default_thread_map, self._what = device, default_thread_map, what
        # An executor instance serves one engine: detach()/reset() cannot rebuild on it.
        self._given_instance = executor is not None and not isinstance(executor, str)
        # The first engine's executor, resolved now: a bad choice fails here, and so
        # does a bad thread map, not after a batch was taken.
        self._next: Executor | None = self._resolve()
        if not self._given_instance and isinstance(self._next, AsyncExecutor):
            built = tasks()
            # A typo is refused; a map naming the family's other tasks may be shared.
            check_thread_map_names(thread_map, list({**{t.name: 0 for t in built},
                                                     **default_thread_map}))  # fmt: skip
            for task in built:
                resolve_lane(task, self._next.thread_map)

    @property
    def next(self) -> Executor:
        """The executor the next engine gets (kept: what is set on it stays)."""
        if self._next is None and not self._given_instance:
            self._next = self._resolve()
        return self._next or self._resolve()

    def take(self, pipeline: str) -> Executor:
        """The next engine's executor, handed over; refused for a ``pipeline`` whose
        given instance served an engine already."""
        executor, self._next = self._next, None
        if executor is not None:
            return executor
        if self._given_instance:
            raise PipelineStateError(
                f"the executor instance given to the {self._what} served the engine "
                f"that detach()/reset() tore down, and an executor serves one pipeline "
                f"engine; build a new {pipeline}, or pass thread_map= instead of an "
                f"executor instance"
            )
        return self._resolve()

    def _resolve(self) -> Executor:
        executor, thread_map = self._choice
        return resolve_executor(executor, thread_map, device=self._device,
                                default_thread_map=self._default_thread_map)  # fmt: skip
