"""``OwedSteps``: the batches of ``step()`` calls cancelled before their batch was
taken, and the calls that owe them training.

A cancelled ``step()`` still trains its batch.  Its batch is queued before the call
first awaits, so a caller cancelled while the step before it is finished (or while
the first call's ``init`` runs) leaves the batch owed: the next ``step()`` trains it
first, a ``drain()`` with nothing else in flight trains it, ``reset()`` drops it,
and another source is refused meanwhile.  Owed batches' results are dropped: their
callers are gone.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import PipelineStateError
from .feeds import Feeds
from .sources import OneBatch, Source

__all__ = ("OwedSteps",)


class OwedSteps:
    """The owed batches of one pipeline (``Feeds``: where the current one stands)."""

    __slots__ = ("_feeds", "_queue")

    def __init__(self, feeds: Feeds) -> None:
        self._feeds = feeds
        self._queue: collections.deque[OneBatch] = collections.deque()

    def untaken(self) -> OneBatch | None:
        """The batch of a cancelled ``step()`` that was taken up (the current feed's
        source) but not taken yet: owed like those queued."""
        feed = self._feeds.current
        source = feed.source if feed is not None else None
        return source if type(source) is OneBatch and not source.taken else None

    def count(self) -> int:
        return len(self._queue) + (self.untaken() is not None)

    def refuse_another_source(self, source: Source) -> None:
        """Before ``source`` is taken up: refused while batches are owed (a
        ``step()``'s own one-batch source is not another)."""
        if isinstance(source, OneBatch):
            return
        owed = self.count()  # (on every call: the cheap test first)
        if owed:
            raise PipelineStateError(
                f"{owed} batch(es) of step() calls that were cancelled before their "
                f"batch was taken wait to be trained (a cancelled step() still trains "
                f"its batch): drain() trains them (call it until it returns []), "
                f"step() does first, reset() drops them"
            )

    def drop(self) -> int:
        """``reset()``: none is trained any more; how many were owed.  Called before
        the feeds are discarded (the one taken up is the current feed's)."""
        untaken = self.untaken()
        if untaken is not None:
            untaken.withdraw()
        dropped = len(self._queue) + (untaken is not None)
        self._queue.clear()
        return dropped

    def queue(self, batch: Any) -> OneBatch:
        """``step(batch)``'s batch, owed from now on: queued before the call first
        awaits (on a trio caller's side, before the bridge), so a cancelled step still
        trains it.  :meth:`step` then trains it."""
        own = OneBatch(batch)
        self._queue.append(own)
        return own

    def withdraw(self, own: OneBatch) -> None:
        """``own``'s step raised: it is not owed training."""
        if own in self._queue:
            self._queue.remove(own)
        own.withdraw()  # taken up but not taken (an init failed): not trained later

    async def step(
        self, own: OneBatch, progress: Callable[[OneBatch], Awaitable[Any]],
        finish_current: Callable[[], Awaitable[object]],
    ) -> Any:  # fmt: skip
        """The step of ``own`` (:meth:`queue`): the owed batches first, then it, each
        through ``progress``; ``finish_current()`` ends the step before (results
        dropped)."""
        try:
            while True:
                feed = self._feeds.current
                if feed is not None and isinstance(feed.source, OneBatch) and not feed.finished:
                    await finish_current()
                head = self._queue.popleft()
                try:
                    result = await progress(head)
                except BaseException:
                    current = self._feeds.current
                    if current is None or current.source is not head:  # never taken up
                        self._queue.appendleft(head)
                    raise
                if head is own:
                    return result
        except Exception:
            # Refused, or an earlier batch's failure: this step is not owed training
            # (a cancellation, a BaseException, leaves it owed).
            self.withdraw(own)
            raise

    async def train(
        self, adopt: Callable[[OneBatch], object], drain: Callable[[], Awaitable[object]],
        stopped: Callable[[], bool],
    ) -> None:  # fmt: skip
        """A ``drain()`` with nothing in flight: train the queued batches, each taken
        up as a feed of its own and drained, their results dropped -- nothing
        collected is at stake if a later one fails or the call is cancelled.
        ``stopped()``: a failure stops it."""
        while self._queue and not stopped():
            adopt(self._queue.popleft())
            await drain()
