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
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..errors import (
    BackPressureTimeout,
    ConfigurationError,
    ConfigurationTypeError,
    GraphError,
    attach_origin,
)
from .._core.lanes import LOOP_LANE, Lane, LanePool
from .._core.waker import LoopWaker
from ..interop import needs_event_loop, running_loop
from ..options import checked_count, checked_seconds
from ..task import is_async_callable
from .members import MemberFailure, run_async_members, run_sync_members
from .nodes import GraphStatistics, Node, TaskHandle, first_failure
from .scopes import Scope, innermost_scope
from .tags import Tagged
from .tensor_map import TensorKey, TensorMap

if sys.version_info < (3, 11):  # the standard library has it from 3.11
    from exceptiongroup import BaseExceptionGroup

__all__ = ("GraphStatistics", "TaskGraph", "TaskHandle")


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
        self.max_in_flight = checked_count("max_in_flight", max_in_flight)
        self.submit_timeout_s = checked_seconds("submit_timeout_s", submit_timeout_s)
        _check_name("default_lane", default_lane)
        self.default_lane = default_lane
        self.device = torch.device(device)
        self._lanes = LanePool(checked_count("max_lanes", max_lanes))
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
        self._entered = False  # a graph's block runs once: its lanes stop at its end
        self._root: dict[Node, None] = {}
        self._closing = False  # the block was cancelled: its tasks are being cancelled

    # -- scopes --------------------------------------------------------------------

    async def __aenter__(self) -> TaskGraph:
        if self._entered:
            raise GraphError(
                "this TaskGraph was entered already: a graph serves one 'async with' "
                "block (its lanes stop at the block's end); build a new TaskGraph, or "
                "use graph.scope() for a nested block"
            )
        self._entered = True
        self._waker = LoopWaker(running_loop("TaskGraph"))  # asyncio only: clear error on trio
        self._room = asyncio.Condition()
        self._root = {}
        self._scopes.append(self._root)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        try:
            if isinstance(exc, asyncio.CancelledError):
                raise exc  # the block was cancelled: so are its tasks (below)
            await self._close_scope(self._scopes[0], raise_failures=exc is None)
        except Exception:  # the graph's failures, raised once every task is done
            self._lanes.shutdown()
            raise
        except BaseException:
            # Cancelled (a timeout, say): so are the tasks waiting for their producers
            # and the async def ones, as asyncio.TaskGroup's; a lane's body runs to its
            # end, but the lanes are told to stop after it, never joined on the loop.
            await self._cancel_tasks()
            self._lanes.shutdown(timeout=0)
            raise
        self._lanes.shutdown()  # every task is done: the lanes stop at once
        failed = [node.error for node in self._root if node.error is not None]
        if exc is not None and failed and isinstance(exc, Exception):
            # The block raised: its error and the tasks' failures together, as
            # asyncio.TaskGroup reports them.
            raise BaseExceptionGroup(
                f"the TaskGraph block raised, and {len(failed)} task(s) of the graph failed",
                [exc, *failed],
            ) from None

    async def _cancel_tasks(self) -> None:
        """Cancel every task of the graph still running and wait for them (their
        handles then raise :class:`GraphError`); cancellations of this wait are held
        off until then."""
        self._closing = True
        tasks = [task for task in self._tasks if not task.done()]
        for task in tasks:
            task.cancel()
        while tasks := [task for task in tasks if not task.done()]:
            try:
                await asyncio.wait(tasks)
            except asyncio.CancelledError:
                continue

    def scope(self) -> Scope:
        """A nested scope: leaving it waits for its tasks and forgets them."""
        return Scope(self)

    async def _close_scope(self, nodes: dict[Node, None], raise_failures: bool) -> None:
        try:  # tasks still running may submit more into this scope
            while pending := [node.done for node in nodes if not node.done.done()]:
                await asyncio.wait(pending)
        except BaseException:
            self._hand_to_outer_scope(nodes)  # left early: what it holds is not forgotten
            raise
        # by identity: scopes of other tasks may have opened after this one
        self._scopes[:] = [open_ for open_ in self._scopes if open_ is not nodes]
        self._tensors.forget(set(nodes))
        errors = [node.error for node in nodes if node.error is not None]
        if errors and raise_failures:
            raise BaseExceptionGroup(f"{len(errors)} task(s) of the graph failed", errors)

    def _hand_to_outer_scope(self, nodes: dict[Node, None]) -> None:
        """A scope left before its tasks were done (cancelled): they, and its failed
        tasks, go to the scope around it, which waits for them, orders readers after
        them and reports their failures (forgotten here, they would do neither)."""
        self._scopes[:] = [open_ for open_ in self._scopes if open_ is not nodes]
        if nodes is self._root or not self._scopes:
            return  # the graph's own scope: its exit cancels what is left
        outer = innermost_scope(self, self._scopes)
        for node in list(nodes):
            node.scope = outer
            outer[node] = None

    # -- submission ------------------------------------------------------------------

    @needs_event_loop
    async def submit(
        self, fn: Callable[..., Any], /, *args: Any, lane: str | None = None,
        name: str | None = None, **kwargs: Any,
    ) -> TaskHandle:  # fmt: skip
        """Submit ``fn(*args, **kwargs)``; tagged arguments, positional or keyword,
        order the task on their tensors and reach ``fn`` untagged."""
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
        if name is not None:
            _check_name("name", name)
        for lane_name in lane_names:
            _check_name("lane", lane_name)
        for member in members:
            if isinstance(member, (str, bytes)) or not isinstance(member, Sequence):
                raise ConfigurationTypeError(
                    f"each member of a group is a sequence of its arguments (a tuple), got "
                    f"{member!r}; for one argument write ({member!r},)"
                )
        # async def members run on the loop; sync ones need their lanes (refused here,
        # before the task counts, if they would exceed max_lanes)
        placement = None if is_async_callable(fn) else self._lane_threads(lane_names)
        reads: list[TensorKey] = []
        writes: list[TensorKey] = []

        def untagged(arg: Any) -> Any:  # the plain value; a tag's tensor is tracked
            if not isinstance(arg, Tagged):
                return arg
            key = self._tensors.key(arg.value)  # refuses non-tensors before any change
            if arg.tag.reads:
                reads.append(key)
            if arg.tag.writes:
                writes.append(key)
            return arg.value

        calls = [tuple(untagged(arg) for arg in member) for member in members]
        kwargs = {key: untagged(value) for key, value in kwargs.items()}  # every member's
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
                failed = await first_failure(producers)
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
            if isinstance(failure.error, (KeyboardInterrupt, SystemExit)):
                raise failure.error from None
        except asyncio.CancelledError as exc:
            if not self._closing:
                self._record_failure(node, exc, None)
            else:  # awaited, it would look as if the awaiter itself were cancelled
                self._record_failure(node, GraphError(
                    f"task {node.name!r} was cancelled with its TaskGraph's block before "
                    f"it ended (a body already on a lane runs to its end)"
                ), None)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - recorded, re-raised to awaiters
            self._record_failure(node, exc, None)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise  # out of the loop at once, as from any asyncio task (TaskGroup's too)
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
        node.error, node.traceback = error, error.__traceback__

    def statistics(self) -> GraphStatistics:
        return GraphStatistics(
            in_flight=self._in_flight,
            tracked_tensors=len(self._tensors),
            open_scopes=len(self._scopes),
            live_allocations=len(self._allocations),
            lanes=self._lanes.names(),
        )


def _check_name(what: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigurationTypeError(f"{what} takes a non-empty str, got {value!r}")
