"""``Feed``: the batches pulled from one source and where the pipeline stands in it.

:meth:`Feed.pull` takes one whole item into the ring's top slot store: the batch an
adapter seeded, else the next item of the source, refused (``BadBatchError``) when
the pipeline's check finds it malformed; and it keeps the counts (pulled, refused,
batch index) that the statistics and checkpoints read.

Pulls are cancel-safe.  An async source is pulled by a task of its own that a
cancelled caller leaves running (its item is kept for the next call), so a
cancellation never lands inside the source and never loses an item.  A sync source is
called inline: ``next()`` cannot be interrupted half-way.

While an iteration runs, the pipeline reads the next item ahead (:meth:`read_ahead`),
so a slow source overlaps compute instead of preceding it: an async source through
its pulls (:class:`~aiopipe.pulls.Pulls`, the base of ``Feed``), which may read
deeper (``read_ahead=N``).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import BadBatchError, attach_source_origin
from .pull_states import RECHECK
from .pulls import Pulls
from .sources import END, OneBatch, Source, Taken, not_a_source
from .task import BATCH_SLOT

if TYPE_CHECKING:
    from .ring import SlotStore

__all__ = ("Counts", "Feed")


class Counts(NamedTuple):
    """A feed's counts, as ``statistics()`` reports them."""

    pulled: int = 0
    returned: int = 0
    applied: int = 0
    refused: int = 0
    position: int = 0


class Feed(Pulls):
    """One source (a sync or async iterator) and the progress made through it."""

    __slots__ = (
        "_after_read", "_async", "_check_batch", "_depth", "_pulled_inline", "_refused_after",
        "_seed", "_sync", "abandoned", "counts_before", "deferred", "discarded", "draining",
        "end_read", "ended", "exhausted", "fresh", "iteration", "numbered_from", "outbox",
        "pulled", "raised",
        "read_ahead_allowed", "refused", "results_dropped", "returned", "source", "top_pulled",
    )  # fmt: skip

    def __init__(
        self, source: Source, *, read_ahead: bool | int = True,
        check_batch: Callable[[Any], object] | None = None,
        seed: Mapping[str, Any] | None = None, refused: int = 0,
        ahead: Sequence[asyncio.Future[Any]] = (),
        after_read: Callable[[], object] | None = None,
    ) -> None:  # fmt: skip
        #: Checks each item when it is read (ahead: off the step's critical path).
        self._check_batch = check_batch
        #: Called on the loop's thread once the source has given an item (or its end).
        self._after_read = after_read
        self._async: AsyncIterator[Any] | None = None
        self._sync: Iterator[Any] | None = None
        given: object = source  # checked at run time: callers pass anything
        if isinstance(given, AsyncIterator):
            self._async = given
        elif isinstance(given, Iterator):
            self._sync = given
        else:
            raise not_a_source("progress()", source)
        self.source = source
        #: Batches placed in the ring so far (the final count once ``exhausted``).
        self.pulled = 0
        #: Results handed back to the caller.
        self.returned = 0
        #: Results of finished iterations not handed out yet (their caller was cancelled).
        self.outbox: collections.deque[Any] = collections.deque()
        #: The next internal iteration to run.
        self.iteration = 0
        self.exhausted = False
        #: The source's end was read (``exhausted`` is also set by a drain that stops
        #: reading before it).
        self.end_read = False
        #: The source's end was handed to a caller (``StopAsyncIteration``, an empty
        #: ``progress_many``), not only read -- by a read-ahead that a ``drain()``
        #: then took, say: passed again, the same source is a new pass.
        self.ended = False
        #: ``drain()`` was called: take what was already read, read nothing new.
        self.draining = False
        #: The last error a pull raised (the source's own, or a refusal), and one a
        #: call that collected results first left to the next call on this source.
        self.raised: Exception | None = None
        self.deferred: Exception | None = None
        #: Items the pipeline refused (``BadBatchError``).  ``refused`` at
        #: construction: those an adapter refused before seeding the first batch.
        self.refused = refused
        #: For each refused item, how many batches the source gave before it: it is
        #: done with (in :attr:`position`) once that many steps are applied.
        self._refused_after = [0] * refused
        #: The first batch's slot contents, fetched by an adapter before the pipeline
        #: existed: taken by the first pull instead of an item of the source.
        self._seed = dict(seed) if seed is not None else None
        #: The ring's top store holds a batch pulled for an iteration that has not
        #: run (its progress was cancelled or failed before any task started).
        self.top_pulled = False
        #: Batches dropped untrained (:meth:`discard`), and results of applied steps
        #: dropped with them.
        self.discarded = 0
        self.results_dropped = 0
        #: The ``results()`` loop over this source was left early: another source may
        #: take its place, the batches in flight then discarded.
        self.abandoned = False
        #: ...and its iterator was made by that loop from an iterable: nobody else holds
        #: it, so nothing need be remembered for it (it would keep a list alive).
        self.fresh = False
        # A trio caller's source is pulled by the caller during its own call
        # (interop.py): it cannot be read between calls.
        self._pulled_inline = bool(getattr(source, "pulled_inline", False))
        #: How many items may be held ahead (``True``: one).
        self._depth = int(read_ahead)
        self.read_ahead_allowed = self._depth > 0 and not self._pulled_inline
        #: The counts of the same source's feeds before a ``drain()``: it goes on.
        self.counts_before = Counts()
        #: Batches the source gave to another pipeline before (``continue_numbering``).
        self.numbered_from = 0
        self._init_pulls(ahead)

    @property
    def in_flight(self) -> int:
        """Batches taken from the source whose results have not been returned yet
        (the one read ahead included)."""
        taken = self.pulled - self.returned - self.discarded - self.results_dropped
        return taken + self.held_ahead

    @property
    def applied(self) -> int:
        """Batches whose step has run (returned, waiting to be, or dropped by reset)."""
        return self.returned + len(self.outbox) + self.results_dropped

    @property
    def position(self) -> int:
        """The source's leading items done with: the applied batches and the refused
        items with no unapplied batch before them."""
        applied = self.applied
        return applied + bisect.bisect_right(self._refused_after, applied)

    @property
    def counts(self) -> Counts:
        """Every count of the source so far, those before a ``drain()`` included."""
        before = self.counts_before
        return Counts(
            before.pulled + self.pulled, before.returned + self.returned,
            before.applied + self.applied, before.refused + self.refused,
            before.position + self.position,
        )  # fmt: skip

    @property
    def counts_past_taken(self) -> Counts:
        """:attr:`counts`, the position past every item taken (a batch dropped
        untrained included): where the same source goes on after ``reset()``."""
        before = self.counts_before.position
        return self.counts._replace(position=before + self.pulled + self.refused)

    def put_back(self, results: list[Any]) -> None:
        """Results handed out by a call that was interrupted: returned first by the
        next call, in order."""
        self.returned -= len(results)
        self.outbox.extendleft(reversed(results))

    def discard(self) -> int:
        """Drop the batches in the ring, untrained (the pipeline resets its ring); how
        many.  Results of applied steps not yet delivered go too.  An item read ahead
        stays in :attr:`ahead`: no task touched it."""
        if self._seed is not None:  # an adapter's first batch, never pulled: taken, dropped
            self._seed = None
            self.pulled += 1
        dropped = self.pulled - self.returned - len(self.outbox) - self.results_dropped
        dropped -= self.discarded
        self.discarded += dropped
        self.results_dropped += len(self.outbox)
        self.outbox.clear()
        return dropped

    @property
    def finished(self) -> bool:
        return self.exhausted and self.returned >= self.pulled

    @property
    def reads_in_a_task(self) -> bool:
        """An async source: :meth:`read_ahead` starts a task, whose first step runs at
        the loop's next cycle."""
        return self._async is not None

    @property
    def can_read_ahead(self) -> bool:
        """Whether :meth:`read_ahead` would start reading an item now."""
        return (
            self.read_ahead_allowed and self.ahead is None
            and not (self.exhausted or self.draining)
        )  # fmt: skip

    def read_ahead(self) -> None:
        """Start reading the next item while the current iteration runs.  A sync
        source is called now, inline (the loop waits for one ``next()``)."""
        if not self.can_read_ahead:
            return
        if self._async is not None:
            self._pull_in_task()
            return
        assert self._sync is not None
        future = asyncio.get_running_loop().create_future()
        try:
            future.set_result(self._checked(self._next_sync_item()))
        except Exception as exc:  # the source's own error: raised when the item is taken
            future.set_exception(exc)
        self.ahead = future

    async def pull(self, top: SlotStore) -> None:
        """Place the next whole item in ``top`` (the ring's top store): the seed,
        else the item read ahead or pulled now; at the source's end set
        :attr:`exhausted` instead.  A malformed item is dropped and refused with
        ``BadBatchError``; nothing else is touched."""
        if self._seed is not None:
            seed, self._seed = self._seed, None
            for name, value in seed.items():
                top.set(name, value)
        else:
            if (self.draining and self.ahead is None and not _owed(self.source)
                    and not self.keeps_an_item):  # fmt: skip
                self.exhausted = True  # drain(): nothing new is read
                return
            try:
                batch, problem = await self.take()
                if batch is END:
                    self.exhausted = self.end_read = True
                    return
                if problem is not None:
                    self._refuse(problem)
            except Exception as exc:  # the source's: a call after results defers it here
                self.raised = exc
                attach_source_origin(exc, self.batches_before + self.pulled)
                raise
            top.set(BATCH_SLOT, batch)
        top.batch_index = self.batches_before + self.pulled
        self.pulled += 1
        self.top_pulled = True

    def take_ready_ahead(self, store: SlotStore) -> bool:
        """Place the item read ahead in ``store`` now, if one is ready and sound (read,
        checked, not the end, no seed or drain before it): the batch of an iteration
        queued behind the running one.  ``False`` (nothing taken) otherwise."""
        ahead = self.ahead
        if (
            ahead is None or not ahead.done() or ahead.cancelled() or ahead.exception()
            or self._seed is not None or self.draining
        ):  # fmt: skip
            return False
        batch, problem = ahead.result()
        if batch is END or problem is not None:
            return False
        self._next_ahead()
        store.set(BATCH_SLOT, batch)
        store.batch_index = self.batches_before + self.pulled
        self.pulled += 1
        return True

    def give_back(self, store: SlotStore) -> None:
        """Undo :meth:`take_ready_ahead`: the queued iteration never ran, so its batch
        is the item read ahead again (the next pull takes it first).  Nothing may have
        been read ahead since it was taken."""
        future = asyncio.get_running_loop().create_future()
        future.set_result((store.get(BATCH_SLOT), None))
        if self.ahead is not None:  # read deeper meanwhile: it comes after this one
            self._behind.appendleft(self.ahead)
        self.ahead = future
        self.pulled -= 1

    def raise_deferred(self) -> None:
        """Raise, once, the error a call that returned results first left for the next
        call on this source."""
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            raise deferred

    def _refuse(self, problem: BaseException) -> None:
        self.refused += 1
        self._refused_after.append(self.pulled)
        raise BadBatchError(
            f"the source's next batch (after {self.batches_before + self.pulled} taken) was "
            f"refused: {problem}. "
            f"It was skipped. "
            f"The {self.in_flight} batch(es) in flight are intact: call progress() again "
            f"with the same iterator to continue, or drain() to finish them"
        ) from problem

    async def take(self) -> Taken:
        """The next item (read ahead or pulled now), or :data:`END`, with what is
        wrong with it.  Cancelling the caller leaves a pull under way running; the
        item waits for the next call."""
        dropped = self.drop_dead_pulls()
        if self.lost is not None and self.ahead is None and (dropped or not self.keeps_an_item):
            # Closed mid-pull (here, or by an earlier feed of it): its end would be read
            # as the source's, the items it had left never read.
            return self._read_no_further()
        if self.ahead is None:
            if self._sync is not None:
                # Never through a thread: StopIteration crossing a future hangs
                # (CPython gh-112182); next() with a default cannot raise it.
                return self._checked(self._next_sync_item())
            if self._pulled_inline:
                return await self._pull_async()
            self._pull_in_task()  # read_ahead=False too: a cancelled caller loses nothing
        ahead = self.ahead
        assert ahead is not None
        await self._wait_for(ahead)
        if ahead is self.ahead:  # else another call took it meanwhile
            self._next_ahead()
        if ahead.cancelled():
            # Only its loop shutting down cancels a pull (asyncio.run cancels every
            # task left), not any caller of ours: unless that closed the source,
            # pull again on this loop.
            if self.lost is not None:
                return self._read_no_further()
            return await self.take()
        if self.draining and self.lost is not None and ahead.exception() is not None:
            return END, None  # the source was lost: drain() finishes what is in flight
        if isinstance(ahead.exception(), (KeyboardInterrupt, SystemExit)):
            # asyncio raised it out of the event loop from the pull's task when the
            # source raised it: delivered once already.  The source gave no item: pull again.
            return await self.take()
        item, problem = ahead.result()
        if problem is RECHECK:  # kept by an interrupted check, handed over by a feed before
            return self._checked(item)
        return item, problem


def _owed(source: Any) -> bool:
    """Whether ``source`` is a ``step()``'s batch not taken yet (its caller was
    cancelled first): promised to be trained, a drain takes it."""
    return type(source) is OneBatch and not source.taken
