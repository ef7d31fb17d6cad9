"""Lane threads: long-lived submit threads, each with a work queue.

Synchronous task bodies run on their lane's thread, so CUDA launches and
GIL-releasing torch ops of different lanes overlap.  The reserved lane ``"loop"`` is
not a thread: its bodies run inline on the event loop.  Which task runs on which lane
is policy, in :mod:`aiopipe.lanes`.
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import ConfigurationError, PipelineStateError
from .waker import LoopWaker

__all__ = (
    "LANE_THREAD_PREFIX", "LOOP_LANE", "Lane", "LanePool", "call_on_lane", "lane_of_thread",
    "start_on_lane",
)  # fmt: skip

LOOP_LANE = "loop"
#: Lane threads are named ``aiopipe-lane-<lane>`` (tests and traces rely on it).
LANE_THREAD_PREFIX = "aiopipe-lane-"

_STOP = object()

#: How much lower than the loop's a lane thread's CPU priority is (a nice increment;
#: ``AIOPIPE_LANE_NICE=0`` keeps them equal).  When the lanes and their OpenMP workers
#: keep every core busy, the kernel then runs the loop thread first the moment it has
#: work -- the next batch's read-ahead, a timer, a request -- instead of queueing it
#: behind a lane's time slice.  The OpenMP workers a lane starts inherit it.
LANE_NICE = max(0, int(os.environ.get("AIOPIPE_LANE_NICE", "5") or 0))


def _lower_this_threads_priority(increment: int) -> None:
    """Raise the calling thread's nice value by ``increment`` (Linux schedules threads
    one by one; lowering a priority needs no privilege).  Nothing elsewhere."""
    if increment <= 0 or not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + increment)
    except OSError:  # a sandbox refusing it: the lanes run at the loop's priority
        pass

# Counts the fork()s this process came out of: a pool whose lanes were started under
# another count has their queues here but not their threads.
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)


def lane_of_thread(name: str) -> str:
    """The lane a thread (by name) serves: a lane thread's lane, else ``"loop"``."""
    return name[len(LANE_THREAD_PREFIX):] if name.startswith(LANE_THREAD_PREFIX) else LOOP_LANE


class Lane:
    """One submit thread.  Work items are zero-argument callables run in order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._wakes: list[LoopWaker] = []  # for after the running work item (this thread only)
        # Work items set aside by run_pending_until, run next (this thread only).
        self._set_aside: collections.deque[object] = collections.deque()
        self._thread = threading.Thread(target=self._main, name=f"{LANE_THREAD_PREFIX}{name}", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], object]) -> None:
        self.queue.put(work)

    def submit_call(self, work: Callable[[], object]) -> None:
        """Queue ``work`` as a call for the ``async def`` body this lane may be waiting
        for (:meth:`run_pending_until` runs it at once)."""
        self.queue.put(_Call(work))

    def wake_after_item(self, waker: LoopWaker) -> None:
        """From this lane's thread: wake ``waker``'s loop once the running work item
        has returned and been dropped, so that whatever the woken caller drops (a
        whole pipeline, at the end of a script) is no longer held by this thread."""
        self._wakes.append(waker)

    def _send_wakes(self) -> None:
        wakes = self._wakes
        while wakes:
            wakes.pop().wake()

    def post(self, marker: object) -> None:
        """Queue a marker for :meth:`run_pending_until`."""
        self.queue.put(marker)

    def run_pending_until(self, done: object) -> None:
        """From inside this lane's thread: run the calls queued for it
        (:meth:`submit_call`) until ``done`` is dequeued -- used while an ``async def``
        task of this lane runs on the loop and may hand synchronous calls back to its
        lane.  Other work queued meanwhile (a later iteration's chain, queued behind
        the running one) is set aside and runs after the running work item: run here,
        inside it, it would wait for that item to end, which waits for ``done``."""
        while True:
            item = self.queue.get()
            if item is done:
                return
            if item is _STOP:
                self.queue.put(_STOP)  # let the thread's main loop see it
                raise PipelineStateError(f"lane {self.name!r} stopped while a task was running")
            if type(item) is _Call:
                item()
                self._send_wakes()
            else:
                self._set_aside.append(item)

    def _main(self) -> None:
        _lower_this_threads_priority(LANE_NICE)
        set_aside = self._set_aside
        while True:
            item = set_aside.popleft() if set_aside else self.queue.get()
            if item is _STOP:
                return
            if not callable(item):  # a body's end, posted after its waiter had gone
                continue
            item()
            # Drop the reference before waking the loop and blocking again: a finished
            # work item must not keep its executor (and so this lane) alive.
            del item
            self._send_wakes()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def stop(self, timeout: float | None = None) -> None:
        self.queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()


class LanePool:
    """The lanes of one executor, created on first use, at most ``max_lanes``."""

    def __init__(self, max_lanes: int) -> None:
        if max_lanes < 1:
            raise ConfigurationError(f"max_lanes must be >= 1, got {max_lanes}")
        self.max_lanes = max_lanes
        self._lanes: dict[str, Lane] = {}
        self._forks = _forks  # when the lanes were started: a fork()ed child has no threads
        self._closed = False
        # A pool dropped without shutdown() still lets its threads end.
        weakref.finalize(self, _post_stop, self._lanes)

    def get(self, name: str) -> Lane:
        if self._forks != _forks and self._lanes:
            raise PipelineStateError(
                "this pipeline's lane threads were started before this process was "
                "fork()ed, and fork() does not copy threads: work handed to them would wait "
                "forever. Build the pipeline in the child process (or fork before the "
                "first progress, or use the 'spawn' start method)"
            )
        lane = self._lanes.get(name)
        if lane is None:
            if not self._lanes:
                self._forks = _forks  # the first lane: this process starts them
            if self._closed:
                raise PipelineStateError("the executor has been shut down")
            lane = self._lanes[name] = Lane(name)
        return lane

    def names(self) -> tuple[str, ...]:
        return tuple(self._lanes)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self._closed = True
        lanes = list(self._lanes.values())
        self._lanes.clear()
        for lane in lanes:
            lane.stop(timeout)


def _post_stop(lanes: dict[str, Lane]) -> None:
    for lane in lanes.values():
        lane.queue.put(_STOP)


class _Call:
    """A call queued for an ``async def`` body's lane (:meth:`Lane.submit_call`)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn

    def __call__(self) -> None:
        self.fn()


async def call_on_lane(waker: LoopWaker, lane: Lane, fn: Callable[[], Any]) -> Any:
    """Run ``fn()`` on ``lane``'s thread and await its result from the loop."""
    return await start_on_lane(waker, lane, fn)


def start_on_lane(waker: LoopWaker, lane: Lane, fn: Callable[[], Any]) -> asyncio.Future[Any]:
    """Queue ``fn()`` on ``lane``'s thread now (before the caller next yields); the
    future resolves on the loop with its result or exception."""
    future: asyncio.Future[Any] = waker.loop.create_future()

    def work() -> None:
        try:
            result = fn()
        except BaseException as exc:
            waker.resolve(future, exc)
        else:
            waker.resolve(future, None, result)

    lane.submit_call(work)
    return future
