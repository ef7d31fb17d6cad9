"""What a pull (a future read ahead from a source) holds: an item, the source's end
or error, ``check_batch``'s refusal, an interrupt -- asked by
:class:`~aiopipe.pulls.Pulls` and :class:`~aiopipe.source.Feed`; and
:class:`HeldAhead`, what a feed's pulls hold, counted."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import attach_source_origin
from .sources import END, Lost

__all__ = (
    "NO_ITEM", "RECHECK", "HeldAhead", "always_wanted", "gave_an_item", "holds_an_item",
    "interrupted_pull", "problem_of", "refused_item",
)  # fmt: skip

#: The "problem" of an item an interrupted ``check_batch`` kept: check it again.
RECHECK: Any = object()
#: No item kept by an interrupted ``check_batch``.
NO_ITEM: Any = object()


def interrupted_pull(future: asyncio.Future[Any]) -> bool:
    """Whether ``future``, a pull, ended with ``KeyboardInterrupt`` or ``SystemExit``."""
    return (future.done() and not future.cancelled()
            and isinstance(future.exception(), (KeyboardInterrupt, SystemExit)))  # fmt: skip


def always_wanted() -> bool:
    """The item a caller waits for is wanted (no cancelled caller to ask)."""
    return True


def holds_an_item(future: asyncio.Future[Any] | None) -> bool:
    """Whether ``future`` (a read ahead) holds, or will hold, an item of the source: a
    pull under way or cancelled (read again) does; the source's error, or its end,
    does not (no batch is in flight behind it, none is dropped with it)."""
    if future is None:
        return False
    if not future.done() or future.cancelled():
        return True
    return future.exception() is None and future.result()[0] is not END


def refused_item(pull: asyncio.Future[Any]) -> bool:
    """Whether ``pull``, which gave an item, holds ``check_batch``'s refusal of it."""
    problem = pull.result()[1]
    return problem is not None and problem is not RECHECK


def gave_an_item(future: asyncio.Future[Any] | None) -> bool:
    """Whether ``future`` is a finished read ahead that took an item from the source."""
    return future is not None and future.done() and not future.cancelled() and holds_an_item(future)


def problem_of(check_batch: Callable[[Any], object] | None, batch: Any) -> BaseException | None:
    """Why ``batch`` must be refused, if it must: ``check_batch`` raised, or (written
    as a predicate) returned ``False``.  Runs when the batch is read (ahead, while an
    iteration runs), not on the critical path into the ring."""
    if check_batch is not None:
        try:
            verdict = check_batch(batch)
        except Exception as exc:
            return exc
        if verdict is False:
            return ValueError("check_batch returned False")
    return None


class HeldAhead:
    """What the pulls of a feed hold -- :attr:`ahead` first, then those behind it --
    counted and asked for (a base of :class:`~aiopipe.pulls.Pulls`, which reads them)."""

    __slots__ = ()

    # Pulls' and Feed's, read here.
    ahead: asyncio.Future[Any] | None
    _behind: collections.deque[asyncio.Future[Any]]
    _unchecked: Any
    lost: Lost | None
    end_read: bool
    pulled: int

    if TYPE_CHECKING:

        @property
        def batches_before(self) -> int: ...

    @property
    def held_ahead(self) -> int:
        """Items read ahead (or being read), not yet placed in the ring.  A cancelled
        pull holds one only while the source can give it again (not :attr:`lost`)."""
        pulls = (self.ahead, *self._behind)
        kept = self._unchecked is not NO_ITEM
        if self.lost is not None:
            return kept + sum(1 for pull in pulls if gave_an_item(pull))
        return kept + sum(map(holds_an_item, pulls))

    @property
    def read_ahead_items(self) -> int:
        """Items the source gave that wait here: a pull under way, or cancelled, has
        taken none (a source that survives the cancellation gives that item again)."""
        pulls = (self.ahead, *self._behind)
        return (self._unchecked is not NO_ITEM) + sum(1 for pull in pulls if gave_an_item(pull))

    def reads_in(self, task: object) -> bool:
        """Whether ``task`` is one of this feed's pulls (the source runs in it)."""
        return task is not None and any(task is pull for pull in (self.ahead, *self._behind))

    @property
    def end_is_next(self) -> bool:
        """The source's end has been read: taken, or read ahead with no item before it."""
        ahead = self.ahead
        return self.end_read or (
            ahead is not None and ahead.done() and not ahead.cancelled()
            and ahead.exception() is None and ahead.result()[0] is END
        )  # fmt: skip

    @property
    def refused_ahead(self) -> int:
        """Of :attr:`read_ahead_items`, those ``check_batch`` refused (not raised yet):
        dropped with the feed, they count as refused, not as batches discarded."""
        return sum(1 for pull in (self.ahead, *self._behind)
                   if pull is not None and gave_an_item(pull) and refused_item(pull))  # fmt: skip

    def held_error(self) -> Exception | None:
        """The source's own error, read ahead and not raised yet (noted with the batch
        it was giving: it may be raised later, by a call on another feed)."""
        for offset, pull in enumerate((self.ahead, *self._behind)):
            if pull is not None and pull.done() and not pull.cancelled():
                error = pull.exception()
                if isinstance(error, Exception):
                    attach_source_origin(error, self.batches_before + self.pulled + offset)
                    return error
        return None
