"""``Feeds``: which source a pipeline is fed from, and what becomes of the old one.

A pipeline has at most one current :class:`~aiopipe.source.Feed`.  Passing another
source replaces it: refused while batches of the old one are in flight, unless its
``results()`` loop was left early (they are then discarded, untrained).  ``reset()``
discards the batches in flight and *parks* the feed: its counts stay visible in
``statistics()`` and an item it read ahead, untouched by any task, goes to the next
feed of the same source, which counts on from them (its position past the batches
dropped, which that run skips) -- ``drain()`` takes that source up again to finish
it.  The last few sources left before their end are
remembered with their counts: passed again after other sources (``step()``, an
evaluation stream taking turns), each counts on -- unless it is a DataLoader's
iterator that ``iter(loader)`` reset for a new pass.  Every batch dropped untrained
is counted.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ._core.log import pipeline_log
from .errors import PipelineStateError
from .source import Counts, Feed
from .sources import OneBatch, Source, innermost
from .statistics import PipelineStatistics

__all__ = ("Feeds",)


class _Left(NamedTuple):
    """A source left before its end."""

    source: Callable[[], object]  # a reference to it
    counts: Counts
    error: Exception | None  # raised by its next call
    yielded: int | None  # how many items it had given (a DataLoader's iterator)

#: How many sources left before their end are remembered (training and validation
#: streams taking turns, say), the latest first kept.
REMEMBERED = 4

#: How a feed's async generator is finished by the pipeline it feeds.
REPLACED_MID_READ = (
    "this async generator was closed by aiopipe: another source replaced it (after "
    "reset(), or after a results() loop over it was left early) while its next item was "
    "being read, and cancelling that read finished it (drain() a source, or pass it "
    "again, before passing another to keep its read)"
)


class Feeds:
    """The current feed of one pipeline, the parked one, a seeded first batch and
    the count of batches discarded.  ``reset_ring`` empties the pipeline's ring."""

    def __init__(
        self, name: str, reset_ring: Callable[[], None], *, read_ahead: int,
        check_batch: Callable[[Any], object] | None,
        after_read: Callable[[], object] | None = None,
    ) -> None:  # fmt: skip
        self._name, self._reset_ring = name, reset_ring
        self._read_ahead, self._check_batch = read_ahead, check_batch
        self._after_read = after_read
        self.current: Feed | None = None
        self._parked: Feed | None = None
        self._drained: Feed | None = None  # shown by statistics() until the next source
        # The last sources left before their end (drained, their batches dropped by
        # reset() and another source passed, or idle when another was passed), with
        # their counts and the error left for their next call: passed again, even
        # after other sources, each counts on.  Held weakly where a source takes it (a
        # loader's iterator keeps its workers), only so a results() loop's left early.
        self._left: list[_Left] = []  # oldest first
        #: Batches dropped untrained, since the pipeline was built.
        self.discarded = 0
        # The first batch an adapter seeded, and the items it refused before it.
        self._seed: dict[str, Any] | None = None
        self._seed_refused = 0
        # A source whose batches an adapter numbers on (``continue_numbering``), from where.
        self._numbered: tuple[Source, int] | None = None

    @property
    def shown(self) -> Feed | None:
        """The feed ``statistics()`` describes: the current one, else the parked one,
        else the one last drained."""
        for feed in (self.current, self._parked, self._drained):
            if feed is not None:
                return feed
        return None

    @property
    def fed_last(self) -> Feed | None:
        """The current feed, else the one ``drain()`` finished last (until the next)."""
        return self.current if self.current is not None else self._drained

    def seed_first(self, contents: Mapping[str, Any], refused: int) -> None:
        """Seed the next source's first batch (``seed_first_batch``), refused while a
        source is under way."""
        feed = self.current
        if feed is not None and feed.in_flight:
            raise PipelineStateError(
                f"cannot seed a batch while {feed.in_flight} batch(es) are in flight"
            )
        if feed is not None and not feed.finished:
            raise PipelineStateError(
                "seed_first_batch seeds the first batch of a source: call it before the "
                "first progress(), after drain(), or once the current source has ended"
            )
        self.seed(contents, refused)

    def continue_numbering(self, source: Source, batches_before: int) -> None:
        """``source``'s next feed numbers its batches after ``batches_before``
        (``SchedulablePipeline.continue_numbering``)."""
        if isinstance(batches_before, bool) or not isinstance(batches_before, int) or (
            batches_before < 0
        ):
            raise ValueError(f"batches_before must be an int >= 0, got {batches_before!r}")
        fed: list[object] = [feed.source for feed in (self.current, self._parked, self._drained)
                             if feed]  # fmt: skip
        fed += [left.source() for left in self._left]
        if any(known is source for known in fed):
            raise PipelineStateError(
                "continue_numbering() comes before the source's first progress() here; "
                "this pipeline has fed from it already (and numbers it on itself)"
            )
        self._numbered = (source, batches_before)

    def seed(self, contents: Mapping[str, Any] | None, refused: int = 0) -> None:
        """The first batch of the next source (``None``: no seed)."""
        self._seed = dict(contents) if contents is not None else None
        self._seed_refused = refused

    def adopt(self, source: Source, *, idle: bool) -> Feed:
        """The feed of ``source``: the current one, or a new one replacing it."""
        feed = self.current
        if feed is not None and source is feed.source:
            feed.abandoned = feed.fresh = False  # taken up again: it goes on with its batches
            return feed
        if feed is not None and feed.in_flight:
            if feed.abandoned and idle and feed.outbox:
                # Only a cancelled drain() leaves applied steps' results waiting under
                # a results() loop: they are owed to the caller, never dropped unasked.
                raise PipelineStateError(
                    f"a new iterator was passed while {len(feed.outbox)} result(s) of steps "
                    f"already applied wait to be returned (a drain() was cancelled); none "
                    f"of its batches was taken. drain() returns them (and finishes any "
                    f"other batch in flight), reset() drops them."
                )
            if not (feed.abandoned and idle) and type(source) is OneBatch:
                raise PipelineStateError(
                    f"step() cannot run while {feed.in_flight} batch(es) of the iterator "
                    f"given to progress() are in flight; nothing was taken. Call drain() "
                    f"first to finish them (their steps are applied), or reset() to "
                    f"discard them untrained."
                )
            if not (feed.abandoned and idle):
                raise PipelineStateError(
                    f"a new iterator was passed while {feed.in_flight} batch(es) of the "
                    f"previous one are in flight; none of its batches was taken. Keep "
                    f"passing the same iterator until progress() reports its end, or call "
                    f"drain() first to finish the batches in flight (their steps are "
                    f"applied), or reset() to discard them untrained."
                )
            pipeline_log.info("%s: a results() loop was left early; discarding its %d "
                              "batch(es) in flight, untrained", self._name, feed.in_flight)  # fmt: skip
            self.discard()
            feed = None
        # The incoming source's record is taken before another is left (a bounded list).
        resumed = self._resumed(source)
        ahead: list[Any] = []
        parked, goes_on_from = self._parked, None
        if parked is not None:
            if feed is None and parked.source is source:  # reset() kept what it read ahead
                ahead = parked.hand_over_ahead()
                goes_on_from = parked
            else:
                # Past the items it read ahead too (dropped just below); the source's
                # error a call left for the next (deferred), or one read ahead, is
                # raised when the source comes back.  A results() loop's own iterator
                # (over a list) is held weakly only: nobody else has it, and it would
                # keep the list's batches alive.
                past = parked.counts_past_taken
                past = past._replace(position=past.position + parked.read_ahead_items,
                                     refused=past.refused + parked.refused_ahead)  # fmt: skip
                error = parked.deferred or parked.held_error()
                self._suspend(parked, past, error, weak_only=parked.fresh)
            self._drop(parked)
            self._parked = None
        if feed is not None:  # idle: nothing read ahead (an error may be)
            self._suspend(feed, feed.counts, feed.deferred or feed.held_error())
            self._drop(feed)
        new_feed = Feed(
            source, read_ahead=self._read_ahead, check_batch=self._check_batch,
            seed=self._seed, refused=self._seed_refused, ahead=ahead, after_read=self._after_read,
        )  # fmt: skip
        self._drained = None
        if goes_on_from is not None and not goes_on_from.ended:
            # The same source goes on after reset(): past the batches it dropped too,
            # its error left for the next call (the source's, not a task's) still owed.
            new_feed.counts_before = goes_on_from.counts_past_taken
            new_feed.deferred = goes_on_from.deferred
        elif resumed is not None:
            new_feed.counts_before, new_feed.deferred = resumed  # the same source goes on
        self.seed(None)
        numbered, self._numbered = self._numbered, None
        if numbered is not None and numbered[0] is source:
            new_feed.numbered_from = numbered[1]
        # step() adopts a one-batch source per call: those only at DEBUG
        level = logging.DEBUG if isinstance(source, OneBatch) else logging.INFO
        if pipeline_log.isEnabledFor(level):
            pipeline_log.log(level, "%s: new source %s", self._name, type(source).__name__)
        self._reset_ring()
        self.current = new_feed
        return new_feed

    def reset(self, owed: int) -> None:
        """The pipeline's ``reset()``: discard the batches in flight, and the ``owed``
        batches of cancelled ``step()`` calls never taken; drop any seed."""
        feed = self.current
        pipeline_log.info("%s: reset, discarding %d batch(es) in flight", self._name,
                          feed.in_flight if feed is not None else 0)  # fmt: skip
        self.discard()
        self.discarded += owed  # never taken: untrained
        if self._seed is not None:  # a seeded batch no source has taken yet: dropped
            self.discarded += 1
        self.seed(None)

    def discard(self) -> None:
        """Drop the batches in flight untrained, counting them; the feed is parked
        (its counts for statistics(), its read-ahead item for the same source)."""
        feed = self.current
        if feed is not None:
            self.discarded += feed.discard()
            if self._parked is not None:
                self._drop(self._parked)
            self._parked = feed
        self._reset_ring()
        self.current = None

    def take_up_parked(self) -> None:
        """``drain()`` after ``reset()``: the source ``reset()`` parked, with the items
        it kept read ahead (a fetch under way too), is the current one again, so the
        drain finishes them rather than the next source dropping them.  Not a source
        whose ``results()`` loop was left early (that one trains nothing more), nor
        while a seeded first batch waits for the next source."""
        parked = self._parked
        if (self.current is None and parked is not None and not parked.finished
                and not parked.abandoned and self._seed is None):  # fmt: skip
            self.adopt(parked.source, idle=True)

    def forget(self) -> None:
        """The current source is done with (``drain()``): its next use starts a new
        feed, which counts on from this one unless a call was handed the source's end
        (passed again after that, an iterator such as a persistent ``DataLoader``'s
        starts a new pass)."""
        if self.current is not None:
            self._suspend(self.current, self.current.counts, self.current.deferred)
            self._drained, self.current = self.current, None

    def put_back_results(self, results: list[Any]) -> None:
        """Results a finished call could not hand over (the blocking form raised an
        interrupt that came as it ended): the current feed returns them first, as
        after an interrupted call.  A drain's go back to the feed it forgot, taken
        up again if no source came since (its record of counts is replaced when it
        is forgotten again)."""
        if self.current is None and self._drained is not None:
            self.current, self._drained = self._drained, None
        if self.current is not None:
            self.current.put_back(results)

    def end_handed(self) -> None:
        """A call handed the current source's end to its caller (not only read, as by
        a ``progress_many`` that returns results first): the same source again is a
        new pass."""
        if self.current is not None:
            self.current.ended = True

    def statistics(self, *, broken: str | None, closed: bool) -> PipelineStatistics:
        """The pipeline's :class:`PipelineStatistics`, of the feed :attr:`shown`."""
        feed = self.shown
        counts = feed.counts if feed else Counts()
        return PipelineStatistics(
            pulled=counts.pulled, returned=counts.returned,
            in_flight=feed.in_flight if feed else 0, iteration=feed.iteration if feed else 0,
            exhausted=feed.end_read if feed else False, broken=broken, closed=closed,
            refused=counts.refused, applied=counts.applied, discarded=self.discarded,
            position=counts.position, read_ahead=feed.read_ahead_items if feed else 0,
            read_ahead_refused=feed.refused_ahead if feed else 0,
        )  # fmt: skip

    def _suspend(
        self, feed: Feed, counts: Counts, error: Exception | None, *, weak_only: bool = False
    ) -> None:
        """``feed`` is left before its source's end: remember its counts, and the error
        its next call must raise, for the source's next use (the latest
        :data:`REMEMBERED` sources; ``step()``'s one-batch sources never go on)."""
        reference = _reference(feed.source, weak_only)
        if reference is not None and not feed.ended and not isinstance(feed.source, OneBatch):
            self._left = [left for left in self._left if left.source() is not feed.source]
            self._left.append(_Left(reference, counts, error, _yielded(feed.source)))
            if len(self._left) > REMEMBERED:
                forgotten = self._left.pop(0)
                if forgotten.error is not None:
                    pipeline_log.warning(
                        "%s: an earlier source's %r was never raised: other sources came "
                        "after it", self._name, forgotten.error,
                    )  # fmt: skip

    def _resumed(self, source: Source) -> tuple[Counts, Exception | None] | None:
        """The counts (and error) ``source`` was left with, taken; ``None`` if it is
        none of the sources left, or is a loader's iterator reset since (a new pass)."""
        found = [left for left in self._left if left.source() is source]
        if not found:
            return None
        record = found[0]
        self._left.remove(record)
        yielded = _yielded(source)
        if yielded is not None and record.yielded is not None and yielded < record.yielded:
            return None  # iter(loader) reset the persistent DataLoader's iterator
        return record.counts, record.error

    def close(self) -> None:
        """Stop any pull under way (the pipeline shuts down)."""
        for feed in (self.current, self._parked):
            if feed is not None:
                feed.close("this async generator was closed by aiopipe: the pipeline it "
                           "fed shut down while its next item was being read")  # fmt: skip

    def _drop(self, feed: Feed) -> None:
        """Forget ``feed`` for good: the items its source gave ahead are discarded
        too.  A fetch under way is cancelled (the source never gave its item, so it
        is not counted): an async generator it closes is remembered, refused by name
        if passed again, not silently empty."""
        self.discarded += feed.read_ahead_items - feed.refused_ahead
        # A generator the cancelled read finishes is lost for that reason (Pulls): its
        # next use, in any pipeline, is refused by it, not ended as if it ran dry.
        if feed.close(REPLACED_MID_READ) and inspect.isasyncgen(innermost(feed.source)):
            pipeline_log.info(
                "%s: another source replaced an async generator while its next item was "
                "being read; that read is cancelled, which finishes the generator unless "
                "it catches the cancellation", self._name,
            )  # fmt: skip


def _reference(source: Source, weak_only: bool) -> Callable[[], object] | None:
    """A weak reference to ``source`` where it takes one, else a strong one (a list's
    iterator), or none where ``weak_only``."""
    try:
        return weakref.ref(source)
    except TypeError:
        return None if weak_only else lambda: source


def _yielded(source: object) -> int | None:
    """How many items a DataLoader's iterator has given in its pass: one whose count
    went down since was reset by ``iter(loader)`` (persistent workers keep one
    iterator object for every pass)."""
    yielded = getattr(source, "_num_yielded", None)
    return yielded if isinstance(yielded, int) else None
