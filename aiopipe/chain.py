"""``StepChain``: the steps a caller asked for beyond the running one
(``progress_many``), queued one at a time behind it on the lanes.

While a fast-path iteration runs and its caller wants more results, the next batch
is read (a sync source inline, an async one once its read has the batch), the next
iteration is built on the ring as the running one will leave it, and its chains are
handed to the lanes behind the running ones (``start_iteration(after=...)``): the
lane that ends one iteration starts the next.  At each end the driver makes the
queued iteration the running one and the chain queues the one after, so the caller
sleeps until its steps are done.  Only steps the caller asked for are queued, so
between two calls exactly the returned steps are applied.  A queued iteration that
cannot have started yet is taken back when its caller leaves; its batch is read
ahead again.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, NamedTuple

from .errors import PipelineStateError
from .ring import SlotStore

if TYPE_CHECKING:
    from .driver import IterationDriver
    from .executors import Iteration, IterationHandle
    from .source import Feed

__all__ = ("Queued", "StepChain")

#: Why a queued iteration was taken back (nobody sees it: nothing of it ran).
_NOT_ASKED = PipelineStateError("its caller left before it started")


class Queued(NamedTuple):
    """An iteration queued behind the running one."""

    iteration: Iteration
    done: asyncio.Future[None]
    handle: IterationHandle
    store: SlotStore  # its batch, the ring's top once the running iteration has ended


class StepChain:
    """The iteration queued behind the running one, and how many more to queue."""

    def __init__(self, driver: IterationDriver) -> None:
        self._driver = driver
        self.queued: Queued | None = None
        # How many more iterations the waiting caller has asked for beyond the running
        # and the queued one: queued one at a time, without waking the caller.
        self._more = 0

    def ask(self, feed: Feed, more: int) -> None:
        """A caller waits for the running iteration's result and ``more`` after it."""
        self._more = more if self._driver.runs_here() else 0
        if self.queued is not None or (self._more > 0 and self._queue_next(feed)):
            self._more = max(0, self._more - 1)

    def take(self) -> Queued | None:
        """The queued iteration, now the driver's to promote or to give back."""
        queued, self.queued = self.queued, None
        return queued

    def after_end(self, feed: Feed) -> bool:
        """At an iteration's end, with the one queued behind it now running: queue the
        next one too if the waiting caller asked for it (it sleeps on, to be woken once
        with several results); else read the next batch ahead.  Whether one was
        queued."""
        try:
            if self._more <= 0:
                if feed.can_read_ahead:
                    feed.read_ahead()
                return False
            queued = self._queue_next(feed)
        except BaseException:  # the source raised KeyboardInterrupt: out, as from a body
            self._more = 0
            self._driver.wake_waiters()
            raise
        self._more -= queued
        return queued

    def stop(self) -> None:
        """The caller is woken: queue nothing more for it."""
        self._more = 0

    def drop(self, feed: Feed | None) -> None:
        """The caller left (or the loop closed): queue nothing more, and take the
        queued iteration back if none of its tasks can have started (its batch is read
        ahead again); one that may have started runs on."""
        self._more = 0
        queued, handle = self.queued, self._driver.handle
        if queued is None or handle is None or not handle.drop_queued(_NOT_ASKED):
            return
        self.queued = None
        queued.iteration.stage = None
        if feed is not None:
            feed.give_back(queued.store)

    def forget(self) -> None:
        """The running iteration was abandoned with its loop (a queued one is skipped)."""
        self.queued, self._more = None, 0

    def _queue_next(self, feed: Feed) -> bool:
        """Queue the iteration after the running one behind it on the lanes, if the
        running one is a fast-path iteration of ``feed`` on this loop that delivers a
        result, and the next batch has been read and checked.  Whether it was."""
        driver = self._driver
        handle, current = driver.handle, driver.current
        if handle is None or current is None or current[0] is not feed or not driver.runs_here():
            return False
        running = current[1]
        if not driver.holds_oldest_batch(feed, running):  # still filling the ring
            return False
        if feed.can_read_ahead:
            feed.read_ahead()
        store = SlotStore()
        if not feed.take_ready_ahead(store):
            self._queue_when_read(feed)
            return False
        iteration = driver.new_iteration(running.number + 1, driver.ring.advanced(store), feed)
        started = driver.hand_to_lanes(feed, iteration, release_heads=False, after=handle)
        if started is None:  # the running one ended meanwhile: started once that is handled
            feed.give_back(store)
            return False
        self.queued = Queued(iteration, *started, store)
        return True

    def _queue_when_read(self, feed: Feed) -> None:
        """The next batch is still being read (an async source): queue its iteration
        once it has been, if the caller still wants it then."""
        ahead = feed.ahead
        if ahead is None or ahead.done() or self._more <= 0:
            return

        def read(_: object) -> None:
            if self._more > 0 and self.queued is None and self._queue_next(feed):
                self._more -= 1

        ahead.add_done_callback(read)
        feed.claim(ahead, lambda: self._more > 0 and self.queued is None)
