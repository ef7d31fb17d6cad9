"""``StageRun``: what the loop and the lanes share while they run one stage of one
iteration -- the first failure, the cross-lane flags, the count of lanes still
running -- and ``IterationHandle``, the handle of an iteration started on the fast
path (``AsyncExecutor.start_iteration``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Protocol

from .._core.flags import OneShotFlag
from .._core.tickets import TicketLock
from .._core.waker import LoopWaker, settle_future
from .base import Iteration
from .layout import StageLayout

__all__ = ("IterationHandle", "StageRun", "StartFast")


class StageRun:
    """Shared state of one stage of one iteration, between the loop and the lanes."""

    __slots__ = (
        "async_tasks", "error", "failed", "finished", "layout", "lock", "on_done", "outstanding",
        "flags", "iteration", "threads_done", "tickets", "waker",
    )  # fmt: skip

    def __init__(
        self, iteration: Iteration, layout: StageLayout, waker: LoopWaker, tickets: TicketLock,
        on_done: Callable[[BaseException | None], None] | None = None,
    ) -> None:  # fmt: skip
        self.iteration = iteration
        self.layout = layout
        self.waker = waker
        self.tickets = tickets
        self.lock = threading.Lock()
        self.failed = False
        self.error: BaseException | None = None
        self.flags = {i: OneShotFlag(waker, self.lock) for i in layout.flagged}
        self.outstanding = len(layout.thread_chains)
        self.finished = threading.Event()  # every lane is done with this stage
        if not self.outstanding:
            self.finished.set()
        # Who hears that the last lane finished: a callback on the loop (start_iteration),
        # else a future awaited by _finish_stage.
        self.on_done = on_done
        self.threads_done: asyncio.Future[None] | None = (
            waker.loop.create_future() if layout.thread_chains and on_done is None else None
        )
        self.async_tasks: set[asyncio.Task[None]] = set()

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc
            self.failed = True
        self.tickets.abort(f"{type(exc).__name__} in the same progress")
        for flag in self.flags.values():
            flag.set()

    def thread_chain_finished(self) -> None:
        with self.lock:
            self.outstanding -= 1
            if self.outstanding:
                return
            future = self.threads_done
        # Queued, then `finished` set, then the loop woken: woken first, the loop
        # thread would wait for this thread to let go of the GIL.
        if future is not None:
            wake = self.waker.post(settle_future, future, None, None)
        else:  # a iteration started by start_iteration: its callback
            wake = self.on_done is not None and self.waker.post(self.on_done, self.error)
        self.finished.set()  # after the iteration's end is queued: a waiter finds it on the loop
        if wake:
            self.waker.wake()

    def renew_threads_done(self) -> asyncio.Future[None] | None:
        """A fresh future for the lanes still running (cancelling the task that
        awaited ``threads_done`` cancelled that future too); ``None`` if none run."""
        with self.lock:
            if self.outstanding == 0:
                return None
            self.threads_done = self.waker.loop.create_future()
            return self.threads_done

    def close_loop_bodies(self) -> bool:
        """The loop closed under this stage: nothing will resume its ``async def``
        bodies.  Close their coroutines, so the lanes waiting for them go on; whether
        there were any (their tasks did not run to their end)."""
        tasks = list(self.async_tasks)
        for task in tasks:
            task.get_coro().close()
        return bool(tasks)

    def finish_task(self, index: int) -> None:
        ticket = self.layout.tickets.get(index)
        if ticket is not None:
            self.tickets.release(ticket)
        flag = self.flags.get(index)
        if flag is not None:
            flag.set()


class IterationHandle:
    """A iteration started by :meth:`AsyncExecutor.start_iteration`."""

    __slots__ = ("_run",)

    def __init__(self, run: StageRun) -> None:
        self._run = run

    @classmethod
    def of(cls, iteration: Iteration) -> IterationHandle | None:
        """A handle on the stage of ``iteration`` that the lanes run now, if any."""
        run = iteration.stage
        return cls(run) if isinstance(run, StageRun) else None

    def abandon_loop(self, exc: BaseException | None) -> bool:
        """The loop closed under the iteration: close its ``async def`` bodies (they
        can never end) and, given ``exc``, skip the tasks not yet started (none of
        the loop's part will run).  Whether any body was closed."""
        if exc is not None:
            self._run.fail(exc)
        return self._run.close_loop_bodies()

    @property
    def error(self) -> BaseException | None:
        """The iteration's first failure, once :meth:`wait` has returned ``True``."""
        return self._run.error

    def abort(self, exc: BaseException) -> None:
        """Skip the tasks not yet started (the loop is shutting down); running bodies
        finish, then ``on_done`` is called as usual."""
        self._run.fail(exc)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every lane has finished the iteration (``True``), or ``timeout``
        seconds have passed (``False``).  Any thread but the lanes'."""
        if not self._run.finished.wait(timeout):
            return False
        self._run.waker.wake()  # the iteration's end may be queued, its wake-up not yet written
        return True


class StartFast(Protocol):
    """``AsyncExecutor.start_iteration``, as the pipeline's driver calls it."""

    def __call__(
        self, iteration: Iteration, on_done: Callable[[BaseException | None], None],
        *, yield_cpu: bool = True,
    ) -> IterationHandle | None: ...  # fmt: skip
