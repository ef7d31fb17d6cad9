"""``TaskGraph``: task graphs built at run time, on the same loop and lanes.

    async with TaskGraph() as graph:
        handle = await graph.submit(scale, INPUT(x), OUTPUT(y), factor=2.0)
        await handle                   # fn's return value (or its exception)

Each tensor argument carries a tag (``aiopipe.dag.tags``); a tensor map keyed by
data address records the current producer of every tensor written in the graph, so a
reader waits for the last writer (read after write) and a write replaces the entry
(write after write).  Ready work runs on its lane's thread (sync functions), inline
on the loop (lane ``"loop"``) or as a coroutine (``async def``).

* **Failure poisoning**: the consumers of a failed task never run (their handles
  raise :class:`PoisonedError`); unrelated work continues; leaving the scope raises
  an ``ExceptionGroup`` of the original exceptions, each noting its task.
* **Back-pressure**: at most ``max_in_flight`` unfinished tasks; ``submit`` waits for
  room and raises :class:`BackPressureTimeout` after ``submit_timeout_s``.
* **Scopes**: ``async with graph.scope():`` waits for the tasks submitted inside and
  forgets them, so a long-running graph does not grow.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..interop import needs_event_loop
from ..errors import BackPressureTimeout, GraphError, PoisonedError
from ..executors.base import annotate_failure
from ..executors.lanes import LOOP_LANE, LanePool, call_on_lane
from ..executors.signals import LoopWaker
from ..interop import running_loop
from .tags import Tagged

if sys.version_info < (3, 11):  # the standard library has it from 3.11
    from exceptiongroup import BaseExceptionGroup

__all__ = ("GraphStatistics", "TaskGraph", "TaskHandle")


class _Node:
    """One submitted task (a group counts as one)."""

    __slots__ = ("done", "error", "name", "poisoned_by", "result")

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self.name = name
        self.done: asyncio.Future[None] = loop.create_future()  # resolves, never raises
        self.result: Any = None
        self.error: BaseException | None = None
        self.poisoned_by: _Node | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None or self.poisoned_by is not None

    def root_failure(self) -> _Node:
        node = self
        while node.poisoned_by is not None:
            node = node.poisoned_by
        return node


class TaskHandle:
    """Await it for the task's result; raises its exception, or
    :class:`PoisonedError` if a task it depends on failed."""

    __slots__ = ("_node",)

    def __init__(self, node: _Node) -> None:
        self._node = node

    @property
    def name(self) -> str:
        return self._node.name

    def done(self) -> bool:
        return self._node.done.done()

    def __await__(self) -> Any:
        yield from self._node.done.__await__()
        node = self._node
        if node.error is not None:
            raise node.error
        if node.poisoned_by is not None:
            root = node.root_failure()
            raise PoisonedError(
                f"task {node.name!r} did not run: task {root.name!r} it depends on failed"
            ) from root.error
        return node.result


class _TensorMap:
    """The current producer of every tensor written in the graph, keyed by the
    tensor's data address: a view shares its entry with every tensor that starts
    at the same address, and disjoint rows of one buffer are independent (views
    that overlap without sharing a start are not ordered against each other)."""

    def __init__(self) -> None:
        self._producer: dict[tuple[str, int], _Node] = {}

    @staticmethod
    def key(value: Any) -> tuple[str, int]:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"only tensors can be tagged, got {type(value).__name__}")
        return (str(value.device), value.data_ptr())

    def lookup(self, value: Any) -> _Node | None:
        return self._producer.get(self.key(value))

    def insert(self, value: Any, node: _Node) -> None:
        self._producer[self.key(value)] = node

    def forget(self, nodes: set[_Node]) -> None:
        self._producer = {k: n for k, n in self._producer.items() if n not in nodes}

    def __len__(self) -> int:
        return len(self._producer)


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


class TaskGraph:
    """A dynamic task graph; use it as an async context manager (the root scope)."""

    def __init__(
        self,
        *,
        max_in_flight: int = 1024,
        submit_timeout_s: float = 10.0,
        default_lane: str = "default",
        max_lanes: int = 8,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.submit_timeout_s = submit_timeout_s
        self.default_lane = default_lane
        self.device = torch.device(device)
        self._lanes = LanePool(max_lanes)
        self._tensors = _TensorMap()
        self._scopes: list[list[_Node]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight = 0
        self._waiting_for_room = 0
        self._room: asyncio.Condition | None = None
        self._waker: LoopWaker | None = None
        self._allocations: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()

    # -- scopes --------------------------------------------------------------------

    async def __aenter__(self) -> TaskGraph:
        self._waker = LoopWaker(running_loop("TaskGraph"))  # asyncio only: clear error on trio
        self._room = asyncio.Condition()
        self._scopes.append([])
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self._close_scope(raise_failures=exc_info[0] is None)
        finally:
            self._lanes.shutdown()

    def scope(self) -> _Scope:
        """A nested scope: leaving it waits for its tasks and forgets them."""
        return _Scope(self)

    async def _close_scope(self, raise_failures: bool) -> None:
        nodes = self._scopes[-1]
        try:
            if nodes:
                await asyncio.wait([node.done for node in nodes])
        finally:
            self._scopes.pop()
            self._tensors.forget(set(nodes))
        errors = [node.error for node in nodes if node.error is not None]
        if errors and raise_failures:
            raise BaseExceptionGroup(f"{len(errors)} task(s) of the graph failed", errors)

    # -- submission ------------------------------------------------------------------

    @needs_event_loop
    async def submit(
        self, fn: Callable[..., Any], /, *args: Any, lane: str | None = None,
        name: str | None = None, **kwargs: Any,
    ) -> TaskHandle:  # fmt: skip
        """Submit ``fn(*args, **kwargs)``; tagged arguments are passed untagged."""
        return await self._submit(fn, [args], lane, name, kwargs, group=False)

    @needs_event_loop
    async def submit_group(
        self, fn: Callable[..., Any], args_list: Sequence[Sequence[Any]], /, *,
        lane: str | None = None, name: str | None = None, **kwargs: Any,
    ) -> TaskHandle:  # fmt: skip
        """One task run ``len(args_list)`` ways; it completes when every member has
        (its result is the list of theirs) and fails if any member fails (members
        not yet started are skipped)."""
        if not args_list:
            raise ValueError("submit_group needs at least one member")
        return await self._submit(fn, list(args_list), lane, name, kwargs, group=True)

    def alloc(self, shape: Iterable[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A buffer owned by the graph, freed when nothing references it; hand it to
        a task as ``OUTPUT_EXISTING`` (or ``INOUT`` to keep ordering on it)."""
        buffer = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        self._allocations.add(buffer)
        return buffer

    async def _submit(
        self, fn: Callable[..., Any], members: list[Sequence[Any]], lane: str | None,
        name: str | None, kwargs: dict[str, Any], group: bool,
    ) -> TaskHandle:  # fmt: skip
        if not self._scopes or self._waker is None:
            raise GraphError("submit outside 'async with TaskGraph()'")
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        await self._wait_for_room()
        node = _Node(name or str(getattr(fn, "__name__", "task")), self._waker.loop)
        producers: dict[int, _Node] = {}
        calls: list[tuple[Any, ...]] = []
        writes: list[Any] = []
        for member in members:
            values = []
            for arg in member:
                if isinstance(arg, Tagged):
                    if arg.tag.reads:
                        producer = self._tensors.lookup(arg.value)
                        if producer is not None:
                            producers[id(producer)] = producer
                    if arg.tag.writes:
                        writes.append(arg.value)
                    values.append(arg.value)
                else:
                    values.append(arg)
            calls.append(tuple(values))
        for value in writes:  # after every lookup: a task never waits for itself
            self._tensors.insert(value, node)
        self._in_flight += 1
        self._scopes[-1].append(node)
        task = asyncio.ensure_future(
            self._run(node, fn, calls, kwargs, list(producers.values()), lane, group)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return TaskHandle(node)

    async def _wait_for_room(self) -> None:
        assert self._room is not None
        if self._in_flight < self.max_in_flight:
            return
        self._waiting_for_room += 1
        async with self._room:
            try:
                await asyncio.wait_for(
                    self._room.wait_for(lambda: self._in_flight < self.max_in_flight),
                    self.submit_timeout_s,
                )
            except asyncio.TimeoutError:
                raise BackPressureTimeout(
                    f"{self._in_flight} tasks still in flight after "
                    f"{self.submit_timeout_s} s (max_in_flight={self.max_in_flight}); a "
                    f"task may be waiting for work that cannot be submitted -- raise "
                    f"max_in_flight or submit_timeout_s"
                ) from None
            finally:
                self._waiting_for_room -= 1

    # -- execution -------------------------------------------------------------------

    async def _run(
        self, node: _Node, fn: Callable[..., Any], calls: list[tuple[Any, ...]],
        kwargs: dict[str, Any], producers: list[_Node], lane: str | None, group: bool,
    ) -> None:  # fmt: skip
        try:
            if producers:
                for producer in producers:  # ``done`` futures never raise
                    await producer.done
                failed = next((p for p in producers if p.failed), None)
                if failed is not None:
                    node.poisoned_by = failed
                    return
            results = await self._call(fn, calls, kwargs, lane or self.default_lane)
            node.result = results if group else results[0]
        except BaseException as exc:  # noqa: BLE001 - recorded, re-raised to awaiters
            annotate_failure(exc, node.name, -1, -1)
            node.error = exc
        finally:
            node.done.set_result(None)
            self._in_flight -= 1
            if self._waiting_for_room:
                assert self._room is not None
                async with self._room:
                    self._room.notify()

    async def _call(
        self, fn: Callable[..., Any], calls: list[tuple[Any, ...]], kwargs: dict[str, Any],
        lane: str,
    ) -> list[Any]:  # fmt: skip
        if inspect.iscoroutinefunction(fn):
            return list(await asyncio.gather(*(fn(*call, **kwargs) for call in calls)))

        def run_members() -> list[Any]:  # stops at the first failing member
            return [fn(*call, **kwargs) for call in calls]

        if lane == LOOP_LANE:
            return run_members()
        assert self._waker is not None
        return await call_on_lane(self._waker, self._lanes.get(lane), run_members)  # type: ignore[no-any-return]

    def statistics(self) -> GraphStatistics:
        return GraphStatistics(
            in_flight=self._in_flight,
            tracked_tensors=len(self._tensors),
            open_scopes=len(self._scopes),
            live_allocations=len(self._allocations),
            lanes=self._lanes.names(),
        )


class _Scope:
    def __init__(self, graph: TaskGraph) -> None:
        self._graph = graph

    async def __aenter__(self) -> TaskGraph:
        if not self._graph._scopes:
            raise GraphError("graph.scope() outside 'async with TaskGraph()'")
        self._graph._scopes.append([])
        return self._graph

    async def __aexit__(self, *exc_info: object) -> None:
        await self._graph._close_scope(raise_failures=exc_info[0] is None)
