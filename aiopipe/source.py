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
so a slow source overlaps compute instead of preceding it.  An async source may be
read deeper (``read_ahead=N``): its pulls follow each other, each starting when the
one before has its item, until ``N`` items are held.  An item a caller already waits
for is not held: its pull starts the next one before the caller is woken, so a source
slower than the step starts its next wait at once, not after the step has started.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import inspect
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._core.waker import wait_settled
from .errors import BadBatchError, ConfigurationTypeError, PipelineStateError
from .sources import END, Source, Taken, not_a_source
from .task import BATCH_SLOT

if TYPE_CHECKING:
    from .ring import SlotStore

__all__ = ("Feed",)

class Feed:
    """One source (a sync or async iterator) and the progress made through it."""

    __slots__ = (
        "_async", "_awaited", "_behind", "_check_batch", "_depth", "_pulled_inline",
        "_read_any", "_refused_after", "_still_wanted",
        "_seed", "_sync", "abandoned", "ahead", "discarded", "draining", "exhausted",
        "iteration", "lost",
        "outbox", "pulled", "read_ahead_allowed", "refused", "results_dropped", "returned",
        "source", "top_pulled",
    )  # fmt: skip

    def __init__(
        self, source: Source, *, read_ahead: bool | int = True,
        check_batch: Callable[[Any], None] | None = None,
        seed: Mapping[str, Any] | None = None, refused: int = 0,
        ahead: Sequence[asyncio.Future[Any]] = (),
    ) -> None:  # fmt: skip
        #: Checks each item when it is read (ahead: off the step's critical path).
        self._check_batch = check_batch
        self._async: AsyncIterator[Any] | None = None
        self._sync: Iterator[Any] | None = None
        given: object = source  # checked at run time: callers pass anything
        if isinstance(given, AsyncIterator):
            self._async = given
        elif isinstance(given, Iterator):
            self._sync = given
        elif hasattr(given, "__iter__") or hasattr(given, "__aiter__"):
            raise ConfigurationTypeError(
                f"progress() takes an iterator, got the iterable {type(source).__name__}: "
                f"create it once with iter(...) / aiter(...) and pass the same iterator on "
                f"every call (a fresh iterator per call would restart the pipeline), or "
                f"loop over results({type(source).__name__}), which does that for you"
            )
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
        #: ``drain()`` was called: take what was already read, read nothing new.
        self.draining = False
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
        #: Why the source can no longer be read, when a cancelled pull closed it.
        self.lost: str | None = None
        #: The next item, read ahead or being read (a future, done for sync sources);
        #: given, one a discarded feed of the same source had read.
        self.ahead: asyncio.Future[Any] | None = ahead[0] if ahead else None
        #: The items after it, read or being read, in order (``read_ahead=N`` > 1, or
        #: the one started while a caller waited for :attr:`ahead`).
        self._behind: collections.deque[asyncio.Future[Any]] = collections.deque(ahead[1:])
        if ahead and not ahead[-1].done():  # its task reads on for the feed it left
            ahead[-1].add_done_callback(self._read_on_when_done)
        #: The pull a caller waits for (it is taken as soon as it has its item), and
        #: whether that caller still wants it.
        self._awaited: asyncio.Future[Any] | None = None
        self._still_wanted: Callable[[], bool] = _always
        #: The async source's last pull gave an item: finished before the next one, it
        #: was closed by someone else (its event loop shutting down, say).
        self._read_any = False
        #: Batches dropped untrained (:meth:`discard`), and results of applied steps
        #: dropped with them.
        self.discarded = 0
        self.results_dropped = 0
        #: The ``results()`` loop over this source was left early: another source may
        #: take its place, the batches in flight then discarded.
        self.abandoned = False
        # A trio caller's source is pulled by the caller during its own call
        # (interop.py): it cannot be read between calls.
        self._pulled_inline = bool(getattr(source, "pulled_inline", False))
        #: How many items may be held ahead (``True``: one).
        self._depth = int(read_ahead)
        self.read_ahead_allowed = self._depth > 0 and not self._pulled_inline

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

    def put_back(self, results: list[Any]) -> None:
        """Results handed out by a call that was interrupted: returned first by the
        next call, in order."""
        self.returned -= len(results)
        self.outbox.extendleft(reversed(results))

    def discard(self) -> int:
        """Drop the batches in the ring, untrained (the pipeline resets its ring); how
        many.  Results of applied steps not yet delivered go too.  An item read ahead
        stays in :attr:`ahead`: no task touched it."""
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
    def held_ahead(self) -> int:
        """Items read ahead (or being read), not yet placed in the ring."""
        return sum(map(_holds_an_item, (self.ahead, *self._behind)))

    def hand_over_ahead(self) -> list[asyncio.Future[Any]]:
        """Give up the items read ahead, in order, for a new feed of the same source
        (``Feed(ahead=...)``), which takes them first."""
        futures = [self.ahead, *self._behind] if self.ahead is not None else []
        self.ahead = None
        self._behind.clear()
        return futures

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
            future.set_result(self._checked(next(self._sync, END)))
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
            if self.draining and self.ahead is None:
                self.exhausted = True  # drain(): nothing new is read
                return
            batch, problem = await self.take()
            if batch is END:
                self.exhausted = True
                return
            if problem is not None:
                self._refuse(problem)
            top.set(BATCH_SLOT, batch)
        top.batch_index = self.pulled
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
        store.batch_index = self.pulled
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

    def _refuse(self, problem: BaseException) -> None:
        self.refused += 1
        self._refused_after.append(self.pulled)
        raise BadBatchError(
            f"the source's next batch (after {self.pulled} taken) was refused: {problem}. "
            f"It was skipped. "
            f"The {self.in_flight} batch(es) in flight are intact: call progress() again "
            f"with the same iterator to continue, or drain() to finish them"
        ) from problem

    async def take(self) -> Taken:
        """The next item (read ahead or pulled now), or :data:`END`, with what is
        wrong with it.  Cancelling the caller leaves a pull under way running; the
        item waits for the next call."""
        if self.ahead is None:
            if self._sync is not None:
                # Never through a thread: StopIteration crossing a future hangs
                # (CPython gh-112182); next() with a default cannot raise it.
                return self._checked(next(self._sync, END))
            if self._pulled_inline:
                return await self._pull_async()
            self._pull_in_task()  # read_ahead=False too: a cancelled caller loses nothing
        ahead = self.ahead
        assert ahead is not None
        if not ahead.done():  # (a sync source's item read ahead always is)
            self.claim(ahead)
            try:
                await wait_settled(ahead)
            finally:
                if self._awaited is ahead:
                    self._awaited = None
        if ahead is self.ahead:  # else another call took it meanwhile
            self._next_ahead()
        if ahead.cancelled():
            # Only its loop shutting down cancels a pull (asyncio.run cancels every
            # task left), not any caller of ours: unless that closed the source,
            # pull again on this loop.
            if self.lost is not None:
                raise PipelineStateError(
                    f"{self.lost}: the rest of its items cannot be read"
                )
            return await self.take()
        return ahead.result()  # type: ignore[no-any-return]

    def claim(
        self, ahead: asyncio.Future[Any], still_wanted: Callable[[], bool] | None = None
    ) -> None:
        """A caller will take ``ahead`` (the item being read ahead) as soon as it is
        read, if ``still_wanted()`` then: its pull may start the next one without
        waiting for the take."""
        self._awaited, self._still_wanted = ahead, still_wanted or _always

    def _pull_in_task(self) -> None:
        """Pull the async source in a task of its own, which no cancelled caller
        cancels: the item is kept in :attr:`ahead` for whichever call takes it."""
        self.ahead = pull = asyncio.ensure_future(self._pull_async())
        if pull.done():  # an eager task factory ran it to its end already
            self._read_deeper()

    def _pull_behind(self) -> None:
        """Start the next pull, after those held."""
        pull = asyncio.ensure_future(self._pull_async())
        self._behind.append(pull)
        if pull.done():  # an eager task factory ran it to its end already
            self._read_deeper()

    def _next_ahead(self) -> None:
        """The item read ahead was taken: the next one held becomes it, and reading
        goes on if fewer than ``read_ahead`` items are held now."""
        if self._awaited is self.ahead:
            self._awaited = None
        self.ahead = self._behind.popleft() if self._behind else None
        self._read_deeper()

    def _read_deeper(self) -> None:
        """The last pull already has its item (a sound one, not the end): start the
        next if fewer than ``read_ahead`` are held."""
        last = self._behind[-1] if self._behind else self.ahead
        if (
            last is None or not last.done() or last.get_loop().is_closed()
            or 1 + len(self._behind) >= self._depth or self._async is None
            or self.draining or self.exhausted or self.lost is not None
            or not self.read_ahead_allowed or not _holds_an_item(last)
            or last.cancelled() or last.exception() is not None
        ):  # fmt: skip
            return
        self._pull_behind()

    def _read_on(self, pull: asyncio.Future[Any] | None, taken: Taken) -> None:
        """``pull`` has its item (``taken``): if it is the newest, start the next pull
        now when fewer than ``read_ahead`` items are held, not counting one a caller
        still waits for.  Called in the pull's own task, the next pull runs before
        that caller is woken (tasks start in FIFO order): the source's next wait
        starts a loop cycle after the build, not after the caller's iteration has
        started."""
        newest = self._behind[-1] if self._behind else self.ahead
        if pull is None or pull is not newest:  # handed over or closed meanwhile
            return
        awaited = self._awaited is self.ahead and self._still_wanted()
        if (
            1 + len(self._behind) - awaited >= self._depth or taken[0] is END
            or self.draining or self.exhausted or self.lost is not None
            or not self.read_ahead_allowed
        ):  # fmt: skip
            return
        self._pull_behind()

    def _read_on_when_done(self, pull: asyncio.Future[Any]) -> None:
        """:meth:`_read_on` for a pull handed over by a parked feed (``reset()``):
        its task reads on for that feed, so this feed does once it is done."""
        if not (pull.cancelled() or pull.exception() is not None):
            self._read_on(pull, pull.result())

    def _checked(self, item: Any) -> Taken:
        return item, (None if item is END else _problem_of(self._check_batch, item))

    def close(self) -> bool:
        """Stop a pull under way (the pipeline is reset or shut down); whether one was
        (its cancellation, thrown into an async generator, finishes it)."""
        cut = False
        for ahead in self.hand_over_ahead():
            if ahead.done():
                if not ahead.cancelled():
                    ahead.exception()  # retrieved: no "never retrieved" warning
            else:
                cut = ahead.cancel() or cut
        return cut

    async def _pull_async(self) -> Taken:
        assert self._async is not None
        # (Under trio the bridge's stand-in holds the caller's generator.)
        source = getattr(self._async, "source", self._async)
        if self._read_any and inspect.isasyncgen(source) and source.ag_frame is None:
            self.lost = (
                "this async generator was closed between two pulls without having ended: "
                "the event loop that first iterated it shut down (asyncio.run() and "
                "aiopipe.run() close the async generators their loop iterated when they "
                "return), or it was aclose()d"
            )
            raise PipelineStateError(
                f"{self.lost}. Any items it had left cannot be read: keep every progress() "
                f"over an async source inside one asyncio.run()/aiopipe.run(), or call "
                f"pipe.blocking(), whose calls share one loop"
            )
        try:
            item = await anext(self._async, END)
        except asyncio.CancelledError:
            # The cancellation was thrown into an async generator's frame: unless it
            # caught it, the generator is finished and its remaining items gone.
            if inspect.isasyncgen(source) and source.ag_frame is None:
                self.lost = "a cancelled progress() closed this async generator mid-pull"
            raise
        except BaseException:  # the source's own error: it may end a generator
            self._read_any = False
            raise
        self._read_any = item is not END
        taken = self._checked(item)
        if not self._pulled_inline:  # else read by the caller's own call, never ahead
            self._read_on(asyncio.current_task(), taken)
        return taken


def _always() -> bool:
    return True


def _holds_an_item(future: asyncio.Future[Any] | None) -> bool:
    """Whether ``future`` (a read ahead) holds, or will hold, an item of the source."""
    if future is None:
        return False
    return not future.done() or future.cancelled() or future.exception() is not None or (
        future.result()[0] is not END
    )


def _problem_of(check_batch: Callable[[Any], None] | None, batch: Any) -> BaseException | None:
    """Why ``batch`` must be refused, if it must.  Runs when the batch is read (ahead,
    while an iteration runs), not on the critical path into the ring."""
    if check_batch is not None:
        try:
            check_batch(batch)
        except Exception as exc:
            return exc
    return None
