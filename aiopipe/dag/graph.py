"""``TaskGraph``: task graphs built at run time, on the same loop and lanes.

    async with TaskGraph() as graph:
        handle = await graph.submit(scale, INPUT(x), OUTPUT(y), factor=2.0)
        await handle                   # fn's return value (or its exception)

Each tensor argument carries a tag (``aiopipe.dag.tags``); a tensor map keyed by
data address records the current producer of every tensor written in the graph, so a
reader waits for the last writer (read after write) and a write replaces the entry
(write after write).  Ready work runs on its lane's thread (sync functions), inline
on the loop (lane ``"loop"``) or as a coroutine (``async def``); the members of a
group task can spread over several lanes (``aiopipe.dag.members``).

* **Failure poisoning**: the consumers of a failed task never run (their handles
  raise :class:`PoisonedError`); unrelated work continues; leaving the scope raises
  an ``ExceptionGroup`` of the original exceptions, each noting its task and
  submission number.
* **Back-pressure**: at most ``max_in_flight`` unfinished tasks; ``submit`` waits for
  room and raises :class:`BackPressureTimeout` after ``submit_timeout_s``.  A task
  that finished is retired at once: a success leaves nothing behind in the graph (its
  result lives on in its handle only), so finished tasks need no room in the window;
  a failure stays until its scope closes, to poison readers and be reported.
* **Scopes**: ``async with graph.scope():`` waits for the tasks submitted inside and
  forgets their failures.
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

from ..errors import (
    BackPressureTimeout,
    ConfigurationError,
    ConfigurationTypeError,
    GraphError,
    PoisonedError,
    attach_origin,
)
from .._core.lanes import LOOP_LANE, Lane, LanePool
from .._core.waker import LoopWaker, wait_settled
from ..interop import needs_event_loop, running_loop
from .members import MemberFailure, run_async_members, run_sync_members
from .scopes import Scope, innermost_scope
from .tags import Tagged
from .tensor_map import TensorKey, TensorMap

if sys.version_info < (3, 11):  # the standard library has it from 3.11
    from exceptiongroup import BaseExceptionGroup

__all__ = ("GraphStatistics", "Node", "TaskGraph", "TaskHandle")


class Node:
    """One submitted task (a group counts as one)."""

    __slots__ = ("done", "error", "name", "poisoned_by", "result", "scope", "submission", "writes")

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
        if node.error is not None:
            raise node.error
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


class TaskGraph:
    """A dynamic task graph; use it as an async context manager (the root scope).

    ``max_lanes`` bounds the lane threads the graph creates: a submission that would
    need one more is refused with :class:`GraphError`.
    """

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
            raise ConfigurationError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.submit_timeout_s = submit_timeout_s
        self.default_lane = default_lane
        self.device = torch.device(device)
        self._lanes = LanePool(max_lanes)
        self._lane_by_name: dict[str, Lane | None] = {LOOP_LANE: None}  # None: on the loop
        self._tensors = TensorMap()
        # Per open scope, its unfinished and failed tasks in submission order (a task
        # that succeeded leaves at once).
        self._scopes: list[dict[Node, None]] = []
        self._submissions = 0
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
        self._scopes.append({})
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self._close_scope(self._scopes[0], raise_failures=exc_info[0] is None)
        except Exception:  # the graph's failures, raised once every task is done
            self._lanes.shutdown()
            raise
        except BaseException:
            # Interrupted (cancelled) while bodies may still run: tell the lanes to stop
            # after their current body, but never join them here, on the loop's thread.
            self._lanes.shutdown(timeout=0)
            raise
        self._lanes.shutdown()  # every task is done: the lanes stop at once

    def scope(self) -> Scope:
        """A nested scope: leaving it waits for its tasks and forgets them."""
        return Scope(self)

    async def _close_scope(self, nodes: dict[Node, None], raise_failures: bool) -> None:
        try:  # tasks still running may submit more into this scope
            while pending := [node.done for node in nodes if not node.done.done()]:
                await asyncio.wait(pending)
        finally:
            # by identity: scopes of other tasks may have opened after this one
            self._scopes[:] = [open_ for open_ in self._scopes if open_ is not nodes]
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
        return await self._submit(fn, [args], [lane or self.default_lane], name, kwargs, group=False)

    @needs_event_loop
    async def submit_group(
        self, fn: Callable[..., Any], args_list: Sequence[Sequence[Any]], /, *,
        lane: str | None = None, lanes: Sequence[str] | None = None, name: str | None = None,
        **kwargs: Any,
    ) -> TaskHandle:  # fmt: skip
        """One task run ``len(args_list)`` ways; it completes when every member has
        (its result is the list of theirs) and fails if any member fails.

        Synchronous members run on ``lane`` one after another, or spread over
        ``lanes``: member ``i`` on ``lanes[i % len(lanes)]``, so distinct lanes run in
        parallel.  After a failure, members not yet started are skipped.  ``async
        def`` members run concurrently on the loop; a failure cancels the running
        siblings, and the group completes once they have ended."""
        if not args_list:
            raise ConfigurationError("submit_group needs at least one member")
        if lanes is None:
            lane_names = [lane or self.default_lane]
        elif lane is not None:
            raise ConfigurationTypeError(
                "submit_group takes lane= (one lane) or lanes= (spread), not both"
            )
        elif isinstance(lanes, str) or not lanes or not all(isinstance(n, str) and n for n in lanes):
            raise ConfigurationTypeError(
                f"lanes must be a non-empty sequence of lane names, got {lanes!r}; "
                f"for a single lane pass lane="
            )
        else:
            lane_names = list(lanes)
        return await self._submit(fn, list(args_list), lane_names, name, kwargs, group=True)

    def alloc(self, shape: Iterable[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A buffer owned by the graph, freed when nothing references it; hand it to
        a task as ``OUTPUT_EXISTING`` (or ``INOUT`` to keep ordering on it)."""
        buffer = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        self._allocations.add(buffer)
        return buffer

    async def _submit(
        self, fn: Callable[..., Any], members: list[Sequence[Any]], lane_names: list[str],
        name: str | None, kwargs: dict[str, Any], group: bool,
    ) -> TaskHandle:  # fmt: skip
        if not self._scopes or self._waker is None:
            raise GraphError("submit outside 'async with TaskGraph()'")
        if not callable(fn):
            raise ConfigurationTypeError(f"fn must be callable, got {fn!r}")
        # async def members run on the loop; sync ones need their lanes (refused here,
        # before the task counts, if they would exceed max_lanes)
        placement = None if inspect.iscoroutinefunction(fn) else self._lane_threads(lane_names)
        calls: list[tuple[Any, ...]] = []
        reads: list[TensorKey] = []
        writes: list[TensorKey] = []
        for member in members:
            values = []
            for arg in member:
                if isinstance(arg, Tagged):
                    key = self._tensors.key(arg.value)  # refuses non-tensors before any change
                    if arg.tag.reads:
                        reads.append(key)
                    if arg.tag.writes:
                        writes.append(key)
                    values.append(arg.value)
                else:
                    values.append(arg)
            calls.append(tuple(values))
        await self._wait_for_room()
        scope = innermost_scope(self, self._scopes)
        node = Node(name or str(getattr(fn, "__name__", "task")), self._submissions, scope,
                     self._waker.loop)  # fmt: skip
        self._submissions += 1
        producers: dict[int, Node] = {}
        for key in reads:
            producer = self._tensors.lookup(key)
            if producer is not None:
                producers[id(producer)] = producer
        for key in writes:  # after every lookup: a task never waits for itself
            self._tensors.insert(key, node)
        self._in_flight += 1
        scope[node] = None
        task = asyncio.ensure_future(
            self._run(node, fn, calls, kwargs, list(producers.values()), placement, group)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return TaskHandle(node)

    def _lane_threads(self, lane_names: list[str]) -> list[Lane | None]:
        """The lane thread of each name (``None``: inline on the loop), created on
        first use; a new one beyond ``max_lanes`` is refused."""
        known = self._lane_by_name
        try:
            return [known[n] for n in lane_names]
        except KeyError:
            pass
        new = [n for n in dict.fromkeys(lane_names) if n not in known]
        if new:
            in_use = self._lanes.names()
            if len(in_use) + len(new) > self._lanes.max_lanes:
                raise GraphError(
                    f"lane(s) {new} would give the graph {len(in_use) + len(new)} lane "
                    f"threads, more than max_lanes={self._lanes.max_lanes} (in use: "
                    f"{list(in_use)}); submit to a lane in use or raise max_lanes"
                )
            for name in new:
                known[name] = self._lanes.get(name)
        return [known[n] for n in lane_names]

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
        self, node: Node, fn: Callable[..., Any], calls: list[tuple[Any, ...]],
        kwargs: dict[str, Any], producers: list[Node], placement: list[Lane | None] | None,
        group: bool,
    ) -> None:  # fmt: skip
        try:
            if producers:
                failed = await _first_failure(producers)
                producers.clear()  # a running task keeps no producer (nor its result) alive
                if failed is not None:
                    node.poisoned_by = failed
                    return
            if placement is None:
                results = await run_async_members(fn, calls, kwargs)
            else:
                assert self._waker is not None
                results = await run_sync_members(self._waker, fn, calls, kwargs, placement)
            node.result = results if group else results[0]
        except MemberFailure as failure:
            self._record_failure(node, failure.error, failure.member if group else None)
        except BaseException as exc:  # noqa: BLE001 - recorded, re-raised to awaiters
            self._record_failure(node, exc, None)
        finally:
            if not node.failed:  # nothing to report or poison: the graph lets go of it
                node.scope.pop(node, None)
                self._tensors.retire(node)
            node.done.set_result(None)
            self._in_flight -= 1
            if self._waiting_for_room:
                assert self._room is not None
                async with self._room:
                    self._room.notify()

    @staticmethod
    def _record_failure(node: Node, error: BaseException, member: int | None) -> None:
        where = f"submission {node.submission}" + ("" if member is None else f", group member {member}")
        attach_origin(error, node.name, f"of a TaskGraph ({where})", aiopipe_submission=node.submission)
        node.error = error

    def statistics(self) -> GraphStatistics:
        return GraphStatistics(
            in_flight=self._in_flight,
            tracked_tensors=len(self._tensors),
            open_scopes=len(self._scopes),
            live_allocations=len(self._allocations),
            lanes=self._lanes.names(),
        )


async def _first_failure(producers: list[Node]) -> Node | None:
    """Wait for every producer; the first that failed, if any."""
    for producer in producers:
        await wait_settled(producer.done)  # never raises; a cancelled consumer cancels nothing
    return next((p for p in producers if p.failed), None)
