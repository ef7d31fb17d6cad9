"""A graph task's record (``Node``), the handle its submitter awaits (``TaskHandle``)
and the graph's statistics: what the graph keeps of each task, and how a failure or
a poisoning reaches every awaiter."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ..errors import PoisonedError
from .._core.waker import wait_settled
from .tensor_map import TensorKey

__all__ = ("GraphStatistics", "Node", "TaskHandle", "first_failure")


class Node:
    """One submitted task (a group counts as one)."""

    __slots__ = ("done", "error", "name", "poisoned_by", "result", "scope", "submission",
                 "traceback", "writes")  # fmt: skip

    def __init__(
        self, name: str, submission: int, scope: dict[Node, None], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.name = name
        self.submission = submission  # the graph's n-th submit, from 0
        self.scope = scope  # the open scope it was submitted in
        self.writes: list[TensorKey] = []  # tensor-map keys it became producer of
        self.done: asyncio.Future[None] = loop.create_future()  # resolves, never raises
        self.result: Any = None
        self.error: BaseException | None = None
        self.traceback: Any = None  # the error's own: each awaiter re-raises it from there
        self.poisoned_by: Node | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None or self.poisoned_by is not None

    def root_failure(self) -> Node:
        node = self
        while node.poisoned_by is not None:
            node = node.poisoned_by
        return node


class TaskHandle:
    """Await it for the task's result; raises its exception, or
    :class:`PoisonedError` if a task it depends on failed."""

    __slots__ = ("_node",)

    def __init__(self, node: Node) -> None:
        self._node = node

    @property
    def name(self) -> str:
        return self._node.name

    @property
    def submission(self) -> int:
        """Which submission of its graph this task was (from 0); failures name it."""
        return self._node.submission

    def done(self) -> bool:
        return self._node.done.done()

    def __await__(self) -> Any:
        # Not the shared future itself: a cancelled awaiter would cancel it for the
        # task, its other awaiters and its consumers.
        yield from wait_settled(self._node.done).__await__()
        node = self._node
        if node.error is not None:  # its traceback as recorded, not grown by each raise
            raise node.error.with_traceback(node.traceback)
        if node.poisoned_by is not None:
            root = node.root_failure()
            raise PoisonedError(
                f"task {node.name!r} did not run: task {root.name!r} it depends on failed"
            ) from root.error
        return node.result


@dataclass(frozen=True)
class GraphStatistics:
    """A snapshot of a :class:`TaskGraph`: nodes submitted but not finished, tensors
    tagged, scopes open, buffers from :meth:`TaskGraph.alloc` still referenced, and
    the lanes in use."""

    in_flight: int
    tracked_tensors: int
    open_scopes: int
    live_allocations: int
    lanes: tuple[str, ...]


async def first_failure(producers: list[Node]) -> Node | None:
    """Wait for every producer; the first that failed, if any."""
    for producer in producers:
        await wait_settled(producer.done)  # never raises; a cancelled consumer cancels nothing
    return next((p for p in producers if p.failed), None)
