"""``LaneWatch``: an event loop shutting down waits for the lanes of an iteration whose
caller left early -- and says what it waits for, so a stuck body is not a silent hang.

The wait is abandoned by a second Ctrl-C: under this package's runners it lands in
:func:`~aiopipe._core.loops.finish_loop`, which stops waiting; under ``asyncio.run`` it
leaves ``asyncio.run``, which closes the loop, and the thread waiting for the lanes
sees that and returns, so interpreter exit (which joins that thread) goes on.  A
Ctrl-C that stopped an earlier wait for the same iteration (``aclose()`` on the way
out of ``with`` / ``async with``) stops this one before it starts
(:meth:`LaneWatch.abandon`).  Lane threads are daemons: a body that never returns
does not hold the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from .loops import STOPPED_WAITING, runner_owns, task_quiet_if_left, waits_for_ctrl_c
from .waker import wait_settled

__all__ = ("GRACE_S", "LaneWatch", "describe_wait")

#: An iteration that ends this soon after the loop began to shut down is waited for
#: without a word.
GRACE_S = 1.0
#: How often the waiting thread looks whether its loop was closed under it.
_POLL_S = 0.1


class Lanes(Protocol):
    """What is watched: the lanes running one iteration."""

    def wait(self, timeout: float | None = None) -> bool: ...

    def abort(self, exc: BaseException) -> None: ...


class LaneWatch:
    """Waits for one iteration's lanes; ``describe()`` says what they still run."""

    def __init__(self, lanes: Lanes, describe: Callable[..., str]) -> None:
        self._lanes, self._describe = lanes, describe
        self._told: set[str] = set()  # the waits that said what they wait for
        self._lock = threading.Lock()
        #: A Ctrl-C stopped a wait for the iteration: nothing waits for it again.
        self._abandoned = False
        self._guard: asyncio.Task[None] | None = None

    def tell(self, until: str = " before the event loop closes", skipping: bool = True) -> None:
        """Say once per kind of wait, on stderr, what is waited for (``until``: what
        waits; ``skipping``: the tasks not started are skipped), and how to stop."""
        with self._lock:
            if until in self._told:
                return
            self._told.add(until)
        print(
            f"aiopipe: {self._describe(until=until, skipping=skipping)}. Press Ctrl-C "
            f"to stop waiting (the model's state is then undefined).",
            file=sys.stderr, flush=True,
        )  # fmt: skip

    @contextlib.contextmanager
    def telling(self) -> Iterator[None]:
        """Around a wait on the loop for the iteration (``aclose()``'s): :meth:`tell`
        if it lasts over :data:`GRACE_S`.  A Ctrl-C that this package's runner
        handles meanwhile stops waiting for the iteration for good (:meth:`abandon`,
        through :func:`~aiopipe._core.loops.waits_for_ctrl_c`); any other end of the
        wait (a timeout, a cancellation) ends this wait only."""
        loop = asyncio.get_running_loop()
        timer = loop.call_later(GRACE_S, self.tell, "", False)
        try:
            with waits_for_ctrl_c(loop, self.abandon):
                yield
        finally:
            timer.cancel()

    def abandon(self) -> None:
        """Stop waiting for the iteration, for good: its tasks not started are skipped,
        its guard waits no more (the loop closes without it), and stderr says so."""
        if self._abandoned:
            return
        self._abandoned = True
        self._lanes.abort(asyncio.CancelledError())  # its tasks not started: skipped now
        if self._told:
            print(STOPPED_WAITING, file=sys.stderr, flush=True)
        else:
            print(f"aiopipe: {self._describe(stopped=True)} (the model's state is then "
                  f"undefined).", file=sys.stderr, flush=True)  # fmt: skip
        if self._guard is not None:
            self._guard.cancel()

    async def until_done(self, done: asyncio.Future[Any]) -> None:
        """A task that waits for ``done``.  Cancelled (the loop is shutting down), it
        skips the iteration's tasks not yet started and waits on, and says what for
        if the wait lasts over :data:`GRACE_S`."""
        timer: asyncio.TimerHandle | None = None
        try:
            while not done.done():
                try:
                    await wait_settled(done)
                except asyncio.CancelledError:
                    self._lanes.abort(asyncio.CancelledError())
                    if self._abandoned:
                        return  # a Ctrl-C stopped an earlier wait for it: no second one
                    if timer is None:
                        timer = asyncio.get_running_loop().call_later(GRACE_S, self.tell)
        finally:
            if timer is not None:
                timer.cancel()

    def guard(self, done: asyncio.Future[None], guards: set[asyncio.Task[None]]) -> None:
        """Make a loop shutting down wait for the lanes (``done`` once they are), as it
        would for a task awaiting the iteration -- and say what it waits for, and let a
        second Ctrl-C abandon the wait.  ``guards`` keeps the guarding task referenced.

        A task waits (:meth:`until_done`).  A loop of this package's runners cancels
        again the tasks made while it cancels; for other loops (``asyncio.run``
        cancels once: the caller's own cancellation may come from that shutdown) a
        thread of the loop's default executor waits for the lanes as well, since
        ``asyncio.run`` waits for those threads before it closes the loop.  That thread
        stops waiting once the loop is closed (a second Ctrl-C), so interpreter exit,
        which joins it, never waits on a lane without bound."""
        self._guard = guard = task_quiet_if_left(self.until_done(done))
        guards.add(guard)  # referenced until done
        guard.add_done_callback(guards.discard)
        loop = asyncio.get_running_loop()
        if not runner_owns(loop):
            try:
                loop.run_in_executor(None, self.block_until_done, loop)
            except RuntimeError:  # the executor is shut down already: the task alone
                pass

    def block_until_done(self, loop: asyncio.AbstractEventLoop) -> None:
        """On a thread of ``loop``'s default executor: return once the lanes are done,
        once ``loop`` is closed (nothing can handle the iteration's end there), or once
        a Ctrl-C has stopped waiting for it (:meth:`abandon`)."""
        while not self._lanes.wait(_POLL_S):
            if loop.is_closed() or self._abandoned:
                return


def describe_wait(pipeline: str, iteration: Any, lane_names: Sequence[str], *, until: str = "",
                  skipping: bool = False, stopped: bool = False) -> str:  # fmt: skip
    """What a wait (``until``: what waits, say " before the event loop closes") waits
    for, or (``stopped``) stopped waiting for: the tasks of ``iteration`` (an
    executor's ``Iteration``) still running, with their batches and lanes -- on each
    lane the first task not done (a lane runs its tasks in order); those after it are
    counted (``skipping``: as skipped)."""
    order, completed = iteration.plan.order, set(iteration.completed)
    first_left: dict[str, int] = {}
    skipped = 0
    for i in iteration.active.all:
        if i not in completed:
            lane = lane_names[i] if lane_names else ""
            if lane in first_left:
                skipped += 1
            else:
                first_left[lane] = i
    left = [
        f"task {order[i].name!r} (batch {iteration.batch_index(i)})"
        + (f" on lane {lane_names[i]!r}" if lane_names else "")
        for i in first_left.values()
    ]  # fmt: skip
    after = f"; {skipped} task(s) after it" if skipped else ""
    if skipped and skipping:
        after += " will not start"
    head = (f"stopped waiting for iteration {iteration.number}" if stopped else
            f"waiting for iteration {iteration.number} to finish{until}")  # fmt: skip
    return f"{pipeline}: {head}: {', '.join(left) or 'its last task'} has not returned{after}"
