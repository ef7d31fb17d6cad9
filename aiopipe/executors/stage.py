"""``StageRun``: what the loop and the lanes share while they run one stage of one
iteration -- the first failure, the cross-lane flags, the count of lanes still
running -- and ``IterationHandle``, the handle of an iteration started on the fast
path (``AsyncExecutor.start_iteration``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Collection
from typing import Protocol

from .._core.flags import Latch, OneShotFlag
from .._core.lanes import Lane
from .._core.loops import close_if_unstarted, unstarted
from .._core.tickets import TicketLock
from .._core.waker import LoopWaker, settle_future
from .base import Iteration
from .layout import StageLayout
from .loop_bodies import LoopBody, drop_unstarted_heads, start_queued_heads

__all__ = ("Deferred", "IterationHandle", "StageRun", "StartFast")


class StageRun:
    """Shared state of one stage of one iteration, between the loop and the lanes."""

    __slots__ = (
        "async_tasks", "deferred", "error", "failed", "finished", "gate", "heads", "heads_begun",
        "heads_started", "layout",
        "lock", "on_done", "outstanding", "flags", "iteration", "successor", "threads_done",
        "tickets", "waker",
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
        self.finished = Latch(is_set=not self.outstanding)  # every lane is done with this stage
        # Who hears that the last lane finished: a callback on the loop (start_iteration),
        # else a future awaited by _finish_stage.
        self.on_done = on_done
        self.threads_done: asyncio.Future[None] | None = (
            waker.loop.create_future() if layout.thread_chains and on_done is None else None
        )
        self.async_tasks: set[asyncio.Task[None]] = set()
        #: The ``async def`` bodies heading a chain (``layout.async_heads``) that the
        #: loop started with the stage, by task index; set before the lanes get it.
        self.heads: dict[int, LoopBody] = {}
        #: The loop has started ``heads`` (for a stage queued behind another: only
        #: once that one has ended; :func:`~.loop_bodies.start_queued_heads`).
        self.heads_started = False
        #: With ``heads``: set once the loop has run their first steps; the other
        #: chains' lanes wait for it.
        self.heads_begun: Latch | None = None
        #: For a stage queued behind another (:meth:`queue_behind`): that one's
        #: ``finished``, set once it has handed over; the lanes wait for it.
        self.gate: Latch | None = None
        #: The stage queued behind this one: its last lane prepares and starts it.
        self.successor: StageRun | None = None
        #: ``{task: [(lane, work item, the chain's first task)]}``: chains handed to
        #: their lanes once that task has finished (``StageLayout.deferred``), by its
        #: lane, or on failure.
        self.deferred: dict[int, list[Deferred]] = {}

    def queue_behind(self, previous: StageRun) -> bool:
        """Make this stage start the moment ``previous`` ends, from the lane that ends
        it, without a round trip through the loop; ``False`` if ``previous`` has ended
        already (or has a successor).  Call before handing this stage's chains over."""
        with previous.lock:
            if previous.outstanding == 0 or previous.successor is not None:
                return False
            self.gate = previous.finished
            previous.successor = self
        return True

    def detach_successor(self) -> StageRun | None:
        """Take back the stage queued behind this one if none of its tasks can have
        started: this one has not ended yet, or the successor :meth:`never_starts`.
        The caller fails it, and its lanes pass its chains by.  ``None`` if there is
        none or it may have started."""
        with self.lock:
            successor = self.successor
            if successor is None or not (self.outstanding or successor.never_starts()):
                return None
            self.successor = None
        return successor

    def never_starts(self) -> bool:
        """Whether this stage's lanes wait for ``async def`` bodies heading chains that
        the loop was to start, and the loop closed first: none of its tasks ran, and
        none will (its lanes would wait for ever)."""
        return bool(self.heads) and not self.heads_started and self.waker.loop.is_closed()

    def fail(self, exc: BaseException) -> None:
        self.skip(exc)
        self.tickets.abort(f"{type(exc).__name__} in the same progress")

    def skip(self, exc: BaseException) -> None:
        """Fail a stage none of whose tasks has started (queued behind another), leaving
        the ticket lock, which the stage before it may still be using, alone."""
        with self.lock:
            if self.error is None:
                self.error = exc
            self.failed = True
        for flag in self.flags.values():
            flag.set()
        self.release_deferred()

    def release_deferred(self, lanes: Collection[Lane] | None = None) -> None:
        """Hand over now the chains waiting for a task's end (those of ``lanes``, if
        given): the stage failed (that task may never end; their lanes pass the rest
        of the stage by), or a stage queued behind this one has work for those lanes
        now (it must reach each lane after this one's, or the lane would wait there
        for this stage's end, ahead of its own part of it).  Handed over early, a
        chain waits for that task on its lane, as any chain does."""
        if not self.deferred:
            return
        with self.lock:  # handed over before the caller goes on
            released: list[Deferred] = []
            for trigger, each in list(self.deferred.items()):
                kept = [] if lanes is None else [item for item in each if item[0] not in lanes]
                released += [item for item in each if item not in kept]
                if kept:
                    self.deferred[trigger] = kept
                else:
                    del self.deferred[trigger]
            _submit(released)

    def skip_queued(self, exc: BaseException) -> None:
        """Skip a stage queued behind another that will never start: its ``async
        def`` bodies heading a chain, which the loop was to start, are dropped too."""
        self.skip(exc)
        if self.heads and not self.heads_started:
            drop_unstarted_heads(self)

    def thread_chain_finished(self) -> LoopWaker | None:
        """A lane's chain of this stage has ended; the waker to wake once the lane has
        let go of its work item (:meth:`Lane.wake_after_item`), ``None`` if no wake-up
        is due.  Woken earlier, a caller could drop the pipeline while the lane's
        frames still hold it, and the garbage collector would miss it."""
        with self.lock:
            self.outstanding -= 1
            if self.outstanding:
                return None
            future, successor = self.threads_done, self.successor
        if successor is not None:
            self._prepare_successor(successor)
        # Queued, then `finished` set, then the loop woken: woken first, the loop
        # thread would wait for this thread to let go of the GIL.
        if future is not None:
            wake = self.waker.post(settle_future, future, None, None)
        else:  # a iteration started by start_iteration: its callback
            wake = self.on_done is not None and self.waker.post(self.on_done, self.error)
        if successor is not None and successor.heads and not successor.failed:
            # The successor's bodies heading a chain start on the loop, right after
            # this end is handled there; its other lanes wait for their first steps.
            wake = self.waker.post(start_queued_heads, successor) or wake
        # After the iteration's end is queued: a waiter finds it on the loop, and the
        # lanes start the successor (gated on it) only now, so the loop ends them in order.
        self.finished.set()
        return self.waker if wake else None

    def _prepare_successor(self, successor: StageRun) -> None:
        """On the lane that ends this stage: what the loop would do between the two
        iterations before the next one's first task -- the device waits this one left
        (``Iteration.finish``) and a fresh ticket sequence -- or, if this one failed,
        skip the next one entirely (none of its tasks starts)."""
        if self.failed:
            successor.skip_queued(_NotStarted("the iteration before it failed"))
            return
        try:
            self.iteration.finish()
            successor.tickets.reset(successor.waker)
        except BaseException as exc:  # the device failed: the next one must not run
            successor.skip_queued(exc)

    def renew_threads_done(self) -> asyncio.Future[None] | None:
        """A fresh future for the lanes still running (cancelling the task that
        awaited ``threads_done`` cancelled that future too); ``None`` if none run."""
        with self.lock:
            if self.outstanding == 0:
                return None
            self.threads_done = self.waker.loop.create_future()
            return self.threads_done

    def take_back_unbegun(self) -> bool:
        """The loop closed before this stage's ``async def`` bodies heading chains took
        their first steps: none of its tasks ran (the other chains' lanes wait for
        those steps), so the iteration may start again on another loop.  If so, close
        those bodies unstarted and let the lanes pass the stage by; whether it was."""
        begun = self.heads_begun
        if not (
            self.heads and self.heads_started and begun is not None and not begun.is_set()
            and self.waker.loop.is_closed()
            and all(body.task is not None and unstarted(body.task) for body in self.heads.values())
        ):  # fmt: skip
            return False
        for body in self.heads.values():
            close_if_unstarted(body.task)  # type: ignore[arg-type]
        self.heads_started = False  # as for a queued stage skipped before they started
        self.skip_queued(_NotStarted("the event loop closed before it began"))
        return True

    def close_loop_bodies(self) -> bool:
        """The loop closed under this stage: nothing will resume its ``async def``
        bodies.  Close their coroutines, so the lanes waiting for them go on; whether
        there were any (their tasks did not run to their end)."""
        tasks = list(self.async_tasks)
        for task in tasks:
            task.get_coro().close()
        for head in self.heads.values():
            never_ran = head.abandon()
            if never_ran is not None:
                self.fail(never_ran)  # before the other lanes go: their tasks are skipped
        if self.heads_begun is not None:
            self.heads_begun.set()  # the loop's call that would set it is gone
        return bool(tasks)

    def finish_task(self, index: int) -> None:
        ticket = self.layout.tickets.get(index)
        if ticket is not None:
            self.tickets.release(ticket)
        flag = self.flags.get(index)
        if flag is not None:
            flag.set()
        if self.deferred:
            with self.lock:  # see release_deferred
                items = self.deferred.pop(index, None)
                if items is not None:
                    _submit(items)


#: A chain handed over on another task's end: its lane, its work item, its first task.
Deferred = tuple[Lane, Callable[[], None], int]


def _submit(items: list[Deferred]) -> None:
    for lane, work, _ in items:
        lane.submit(work)


class _NotStarted(Exception):
    """Why a queued iteration never started (nobody sees it: the driver drops it)."""


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

    def take_back_unbegun(self) -> bool:
        """See :meth:`StageRun.take_back_unbegun`."""
        return self._run.take_back_unbegun()

    def abandon_loop(self, exc: BaseException | None) -> bool:
        """The loop closed under the iteration: close its ``async def`` bodies (they
        can never end) and, given ``exc``, skip the tasks not yet started (none of
        the loop's part will run).  Whether any body was closed."""
        if exc is not None:
            self._run.fail(exc)
        return self._run.close_loop_bodies()

    @property
    def stage(self) -> StageRun:
        return self._run

    @property
    def waker(self) -> LoopWaker:
        return self._run.waker

    def release_lanes(self, *, stepped: bool) -> None:
        """Let the lanes go that wait for the loop to begin the iteration's ``async
        def`` bodies heading a chain (started with ``release_heads=False``): now, if the
        loop has run a step since the start (``stepped``), else once it has run those
        bodies' first steps.  Nothing if there are none."""
        begun = self._run.heads_begun
        if begun is None or begun.is_set():
            return
        if stepped:
            begun.set()
        else:
            self._run.waker.loop.call_soon(begun.set)

    @property
    def error(self) -> BaseException | None:
        """The iteration's first failure, once :meth:`wait` has returned ``True``."""
        return self._run.error

    def drop_queued(self, reason: BaseException) -> bool:
        """Take back the iteration queued behind this one (:meth:`AsyncExecutor.start_iteration`
        with ``after=``) if it cannot have started: ``True`` if it was, and it will
        never run; its ``on_done`` is still called, with ``reason``."""
        successor = self._run.detach_successor()
        if successor is None:
            return False
        self._run.release_deferred()  # ahead of the skipped one's chains on every lane
        successor.skip_queued(reason)
        return True

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
        *, release_heads: bool = True, after: IterationHandle | None = None,
    ) -> IterationHandle | None: ...  # fmt: skip
