"""``Pulls``: an async source read ahead by pulls, each a task of its own, in order.

The pulls follow each other (an async generator is never pulled twice at once), each
started when the one before has its item, until ``read_ahead`` items are held.  An
item a caller already waits for is not held: its pull starts the next one in its own
task, before the caller is woken, so a source slower than the step starts its next
wait at once, not after the step has started.  A cancelled caller leaves the pulls
running (the item waits for the next call); only closing the feed cancels them.

:class:`~aiopipe.source.Feed` holds them, with its counts and the sync path.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ._core.loops import close_left, loop_running_in_this_thread
from ._core.waker import mark_retrieved, wait_settled
from .errors import PipelineStateError
from .pull_states import (
    NO_ITEM, RECHECK, HeldAhead, always_wanted, holds_an_item, interrupted_pull, problem_of,
)
from .sources import (
    END, Lost, Taken, closed_between_pulls, ended_by_interrupt, finished_generator, innermost,
)

if TYPE_CHECKING:
    from .source import Counts

__all__ = ("Pulls",)


class Pulls(HeldAhead):
    """The items of an async source read ahead, or being read: :attr:`ahead` first,
    then those behind it.  A base of :class:`~aiopipe.source.Feed`, whose state
    (the source, the depth, draining, exhausted, lost) it reads."""

    __slots__ = (
        "_awaited", "_behind", "_cut_why", "_read_any", "_still_wanted", "_unchecked", "ahead",
        "lost",
    )  # fmt: skip

    # Feed's, read here.
    _async: AsyncIterator[Any] | None
    _sync: Iterator[Any] | None
    _unchecked: Any  # set in _init_pulls
    _check_batch: Callable[[Any], object] | None
    _after_read: Callable[[], object] | None
    _depth: int
    _pulled_inline: bool
    draining: bool
    pulled: int
    counts_before: Counts
    numbered_from: int
    exhausted: bool
    read_ahead_allowed: bool

    @property
    def batches_before(self) -> int:
        """The batches of the source before this feed's first (a source that goes on
        after ``drain()`` or ``reset()`` counts on; those dropped untrained count, a
        refused item does not; nor those it gave another pipeline, ``numbered_from``):
        what ``ctx.batch_index`` and the notes add."""
        before = self.counts_before
        return before.position - before.refused + self.numbered_from

    def _checked(self, item: Any) -> Taken:
        """``item`` as read (on the loop's thread), with what is wrong with it.  An
        interrupt in ``check_batch`` (Ctrl-C) keeps the item, checked again when the
        next read takes it (:meth:`_item_kept`): taken from the source, it is not lost."""
        if self._after_read is not None:
            self._after_read()
        if item is END:
            return item, None
        try:
            return item, problem_of(self._check_batch, item)
        except BaseException:
            self._unchecked = item
            raise

    @property
    def keeps_an_item(self) -> bool:
        """An interrupted ``check_batch`` kept an item: the next read takes it (a
        drain too: it was taken from the source)."""
        return self._unchecked is not NO_ITEM

    def _item_kept(self) -> Any:
        """The item an interrupted check kept (taken now), else :data:`NO_ITEM`."""
        item, self._unchecked = self._unchecked, NO_ITEM
        return item

    def _next_sync_item(self) -> Any:
        """The sync source's next item (the one an interrupted check kept first)."""
        item = self._item_kept()
        if item is not NO_ITEM:
            return item
        assert self._sync is not None
        try:
            return next(self._sync, END)
        except (KeyboardInterrupt, SystemExit) as interrupt:
            self._lose_if_ended(innermost(self._sync), interrupt)
            raise

    def _init_pulls(self, ahead: Sequence[asyncio.Future[Any]]) -> None:
        """No pull yet, or those a discarded feed of the same source handed over."""
        #: An item an interrupted ``check_batch`` kept (:meth:`_checked`), read next.
        self._unchecked = NO_ITEM
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
        self._still_wanted: Callable[[], bool] = always_wanted
        #: The async source's last pull gave an item: finished before the next one, it
        #: was closed by someone else (its event loop shutting down, say).
        self._read_any = False
        #: Why :meth:`close` cancels a pull under way (the reason an async generator
        #: that cancellation finishes is lost).
        self._cut_why: str | None = None
        #: Why the source can no longer be read, when a pull found it closed (by this
        #: feed, or by an earlier feed of the same source).
        source = innermost(self._async if self._async is not None else self._sync)
        self.lost: Lost | None = _recorded_loss(source) if source is not None else None

    def hand_over_ahead(self) -> list[asyncio.Future[Any]]:
        """Give up the items read ahead, in order, for a new feed of the same source
        (``Feed(ahead=...)``), which takes them first."""
        futures = [self.ahead, *self._behind] if self.ahead is not None else []
        kept = self._item_kept()
        if kept is not NO_ITEM and loop_running_in_this_thread():  # checked again there
            settled: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            settled.set_result((kept, RECHECK))
            # In the place of the pull its check interrupted (read ahead deeper, after
            # items not taken yet); first if none is left (a sync source's).
            interrupted = [i for i, pull in enumerate(futures) if interrupted_pull(pull)]
            if interrupted:
                futures[interrupted[0]] = settled
            else:
                futures.insert(0, settled)  # (else reset() or shutdown drops it with the rest)
        self.ahead = None
        self._behind.clear()
        return futures

    def claim(
        self, ahead: asyncio.Future[Any], still_wanted: Callable[[], bool] | None = None
    ) -> None:
        """A caller will take ``ahead`` (the item being read ahead) as soon as it is
        read, if ``still_wanted()`` then: its pull may start the next one without
        waiting for the take."""
        self._awaited, self._still_wanted = ahead, still_wanted or always_wanted

    async def _wait_for(self, ahead: asyncio.Future[Any]) -> None:
        """Wait, claimed, until ``ahead`` has its item; a cancelled wait leaves the
        pull running (a sync source's item read ahead is there already)."""
        if ahead.done():
            return
        self.claim(ahead)
        try:
            await wait_settled(ahead)
        finally:
            if self._awaited is ahead:
                self._awaited = None

    def _pull_in_task(self) -> None:
        """Pull the async source in a task of its own, which no cancelled caller
        cancels: the item is kept in :attr:`ahead` for whichever call takes it."""
        self.ahead = pull = self._new_pull()
        if pull.done():  # an eager task factory ran it to its end already
            self._read_deeper()

    def _pull_behind(self) -> None:
        """Start the next pull, after those held."""
        pull = self._new_pull()
        self._behind.append(pull)
        if pull.done():  # an eager task factory ran it to its end already
            self._read_deeper()

    def _new_pull(self) -> asyncio.Future[Taken]:
        """A pull in a task of its own.  Its error is raised by the call that takes it
        (:meth:`Feed.take`), never lost; a script that ends first is not told twice
        ("Task exception was never retrieved")."""
        pull = asyncio.ensure_future(self._pull_async())
        pull.add_done_callback(mark_retrieved)
        return pull

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
            or not self.read_ahead_allowed or not holds_an_item(last)
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

    def close(self, why: str | None = None) -> bool:
        """Stop a pull under way (another source replaces this one, or the pipeline
        shuts down: ``why``); whether one was (its cancellation, thrown into an async
        generator, finishes it: lost for ``why``)."""
        self._cut_why = why
        cut = self.drop_dead_pulls()
        for ahead in self.hand_over_ahead():
            if ahead.done():
                if not ahead.cancelled():
                    ahead.exception()  # retrieved: no "never retrieved" warning
            else:
                cut = ahead.cancel() or cut
        return cut

    def drop_dead_pulls(self) -> bool:
        """Forget the pull left pending on an event loop stopped and closed under it
        (not cancelled): nothing can end it.  Its coroutine is closed now; an async
        generator it waited in is finished by that, and :attr:`lost` says so; another
        source is pulled again, as after a pull cancelled with its loop.  Whether
        there was one."""
        ahead = self.ahead
        if ahead is None or ahead.done() and not self._behind:  # the usual case, cheaply
            return False
        pulls = [pull for pull in (ahead, *self._behind) if pull is not None]
        live = [pull for pull in pulls if not close_left(pull)]
        if len(live) == len(pulls):
            return False
        if self._awaited is not None and self._awaited not in live:
            self._awaited = None
        self.ahead = live[0] if live else None
        self._behind = collections.deque(live[1:])
        source = innermost(self._async)
        if finished_generator(source) and self.lost is None:
            self._lose(source, Lost(
                "the event loop this async generator's pull waited on was stopped and "
                "closed (not cancelled); closing that pull finished the generator", True,
            ))  # fmt: skip
        return True

    def _read_no_further(self) -> Taken:
        """The source was closed mid-pull (:attr:`lost`): a drain ends here, with the
        batches in flight finished; anything else is refused."""
        if self.draining:
            return END, None
        raise PipelineStateError(f"{self.lost}: the rest of its items cannot be read")

    def _lose_if_ended(self, source: Any, interrupt: BaseException) -> None:
        """An interrupt came out of ``source``: a generator it finished is lost (the
        next call says so, not "the epoch ended"); any other source reads on."""
        why = ended_by_interrupt(source, interrupt)
        if why is not None:
            self._lose(source, Lost(why, to_its_loop=False))

    def _lose(self, source: Any, lost: Lost) -> None:
        """The source can no longer be read (:attr:`lost`), and passed again -- a new
        feed of it -- says so, rather than end as if it had run dry."""
        self.lost = lost
        try:
            _LOST[source] = lost
        except TypeError:  # not weak-referenceable
            pass

    async def _pull_async(self) -> Taken:
        assert self._async is not None
        source = innermost(self._async)  # (under trio: the caller's generator)
        # A wrapper that reads ahead (an adapter's) may have read its generator to the
        # end while it still hands items on: only a generator pulled directly (or by the
        # trio bridge, which reads nothing ahead) that is finished was closed.
        pulled = innermost(self._async) if self._pulled_inline else self._async
        if self._read_any and finished_generator(pulled):
            self._lose(source, Lost(closed_between_pulls("this async generator"), True))
            if self.draining:  # drain() finishes what is in flight, reading no further
                return END, None
            raise PipelineStateError(
                f"{self.lost}. Any items it had left cannot be read: keep every progress() "
                f"over an async source inside one asyncio.run()/aiopipe.run(), or call "
                f"pipe.blocking(), whose calls share one loop"
            )
        if inspect.isasyncgen(source) and source.ag_running:
            raise PipelineStateError(
                "this async generator is being read by someone else right now (another "
                "pipeline reading it ahead, say): one source feeds one pipeline at a time. "
                "drain() the other pipeline first, or give each pipeline a source of its own"
            )
        kept = self._item_kept()
        if kept is not NO_ITEM:
            taken = self._checked(kept)
            if not self._pulled_inline:
                self._read_on(asyncio.current_task(), taken)
            return taken
        try:
            # The generator's own step is awaited here, not through anext()'s wrapper:
            # close_left finds it (a pull left on a loop closed by hand).
            item = await self._async.__anext__()
        except StopAsyncIteration:
            lost = _recorded_loss(source)
            if lost is None:
                item = END
            else:  # finished by another feed's cancelled read since this one began
                self.lost = lost
                return self._read_no_further()
        except asyncio.CancelledError:
            # The cancellation was thrown into an async generator's frame: unless it
            # caught it, the generator is finished and its remaining items gone.
            if finished_generator(source):
                self._lose(source, Lost(self._cut_why, False) if self._cut_why else Lost(
                    "a cancelled call closed this async generator mid-pull"
                    if self._pulled_inline else
                    # Only its loop shutting down cancels a pull in a task of its own.
                    "the event loop this async generator was being read ahead on shut "
                    "down mid-pull, which closed it", True,
                ))  # fmt: skip
            raise
        except (KeyboardInterrupt, SystemExit) as interrupt:
            self._lose_if_ended(source, interrupt)
            raise
        except BaseException:  # the source's own error: it may end a generator
            self._read_any = False
            raise
        self._read_any = item is not END
        taken = self._checked(item)
        if not self._pulled_inline:  # else read by the caller's own call, never ahead
            self._read_on(asyncio.current_task(), taken)
        return taken


#: No item kept by an interrupted ``check_batch`` (:meth:`Pulls._item_kept`).
#: Why each async source closed under a pull was lost (:meth:`Pulls._lose`).
_LOST: weakref.WeakKeyDictionary[Any, Lost] = weakref.WeakKeyDictionary()


def _recorded_loss(source: Any) -> Lost | None:
    """Why ``source`` was lost, if a feed recorded it."""
    try:
        return _LOST.get(source)
    except TypeError:  # not weak-referenceable: never recorded
        return None
