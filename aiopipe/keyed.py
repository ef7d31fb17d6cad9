"""``fetch_ahead``: a source made of keys and an ``async def fetch(key)``, with up to
``in_flight`` fetches running at once.

An async generator runs one ``anext()`` at a time, so the pipeline's read-ahead hides
at most one fetch behind a step, and a fetch slower than a step sets the pace.
:class:`FetchAhead` starts the fetches of the next keys as asyncio tasks and hands
their batches out in key order: with N in flight a step can take as little as
``max(fetch / N, compute)``.

Invariants, all held by :class:`FetchAhead`:

* A fetch counts against ``in_flight`` from its start until its batch (or error) is
  handed out; finished fetches wait in the window, in key order.  A slot is given to
  the next key when a batch leaves, so memory holds at most ``in_flight`` batches
  plus those the consumer took.
* ``__anext__`` never cancels a fetch or a key pull, and takes a batch out of the
  window only on its way out, with no ``await`` in between: a cancelled ``anext()``
  leaves every fetch running and every fetched batch in place for the next call.
  (The pipeline pulls async sources in a task of its own anyway; this holds for any
  caller.)
* Only :meth:`FetchAhead.aclose` (or garbage collection) cancels fetches; a loop
  shutting down cancels them too, and the next loop starts them again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

from .errors import ConfigurationError, ConfigurationTypeError, FetchError, PipelineStateError
from ._core.loops import close_left
from ._core.waker import mark_retrieved, wait_settled
from .keyed_parts import (
    CLOSED, NO_KEY, Entry, NotAwaitable, asyncio_loop, cancel_quietly, check_fetch,
    FetchStatistics, close_coroutine_result, fetch_interrupted, next_key, notify_when_pulled,
    settled,
)  # fmt: skip
from .sources import END, closed_between_pulls, finished_generator, not_a_source

__all__ = ("FetchAhead", "FetchStatistics", "fetch_ahead")

K = TypeVar("K")
T = TypeVar("T")

#: How many of the latest batches' keys a source keeps for the failure notes (keys,
#: not batches: a few kilobytes).
KEYS_KEPT = 256


class FetchAhead(AsyncIterator[T]):
    """The batches ``fetch(key)`` returns for each key, in key order, fetched up to
    ``in_flight`` at a time: an async iterator any pipeline takes as its source.
    Made by :func:`fetch_ahead`."""

    def __init__(
        self, keys: Iterable[K] | AsyncIterable[K], fetch: Callable[[K], Awaitable[T]], *,
        in_flight: int,
    ) -> None:  # fmt: skip
        given: object = keys  # checked at run time: callers pass anything
        self._sync: Iterator[Any] | None = None
        self._async: AsyncIterator[Any] | None = None
        if isinstance(given, AsyncIterable):
            self._async = aiter(given)
        elif isinstance(given, Iterable):
            self._sync = iter(given)
        elif callable(given) and isinstance(fetch, (Iterable, AsyncIterable)):
            raise ConfigurationTypeError(
                "fetch_ahead() takes the keys first, then the fetch function: "
                "fetch_ahead(keys, fetch, in_flight=N)"
            )
        else:
            raise not_a_source("fetch_ahead()", keys, "an iterable or async iterable of keys")
        check_fetch(fetch)
        if isinstance(in_flight, bool) or not isinstance(in_flight, int):
            raise ConfigurationTypeError(
                f"fetch_ahead(in_flight=...) takes an int, got {in_flight!r}"
            )
        if in_flight < 1:
            raise ConfigurationError(
                f"fetch_ahead(in_flight={in_flight}): at least 1 fetch must be allowed in flight"
            )
        self._fetch: Callable[[Any], Awaitable[T]] = fetch
        self._limit = in_flight
        #: Fetches started, in key order; the head is handed out next.
        self._window: collections.deque[Entry] = collections.deque()
        #: The next key being pulled from async keys (a task: never cancelled by a caller).
        self._key_pull: asyncio.Future[Any] | None = None
        self._taken = self._delivered = 0
        #: ``(key, id(batch))`` of the latest batches handed out, oldest first
        #: (:meth:`aiopipe_recent_key`; the id tells a batch read by someone else).
        self._given: collections.deque[tuple[Any, int]] = collections.deque(maxlen=KEYS_KEPT)
        #: Positions of the failed fetches, ascending (for :meth:`position`).
        self._failed: list[int] = []
        self._keys_done = self._keys_failed = self._closed = False
        self._read_a_key = False  # async keys: one was read (and the generator not ended)
        #: A key taken whose fetch could not be started (an interrupt): started first.
        self._unstarted: Any = NO_KEY
        #: ``fetch`` returned no awaitable: raised again, no further key taken.
        self._refused: ConfigurationTypeError | None = None
        #: ``fetch`` returned no awaitable once: no other key is fetched with it.
        self._plain = False
        self._lost: str | None = None

    async def __anext__(self) -> T:
        loop = asyncio_loop()
        while True:
            if self._closed:
                raise StopAsyncIteration
            if self._refused is not None:
                raise ConfigurationTypeError(*self._refused.args)
            self._revive(loop)
            self._refill()
            # The batches of the keys read before the loss come out first: raised
            # while any wait, their fetches would be restarted by every later call.
            if self._lost is not None and not self._window:
                raise PipelineStateError(f"{self._lost}: the rest of the keys cannot be read")
            if self._window and self._window[0].future.done():
                if fetch_interrupted(self._window[0]):
                    # The interrupt reached the loop's caller as the fetch raised it
                    # (asyncio raises it out of the loop): fetch the key again.
                    head = self._window[0]
                    head.future = self._start(head.key)
                    continue
                entry = self._window.popleft()
                try:
                    self._refill()  # its slot goes to the next key at once
                except BaseException:  # an interrupt in next(keys) or fetch(key):
                    self._window.appendleft(entry)  # the batch is handed out next time
                    raise
                return self._outcome(entry)
            if not self._window and self._key_pull is None:
                raise StopAsyncIteration
            # The head's batch, or a key when nothing is fetching; a cancelled wait
            # leaves either running.
            waiting = self._window[0].future if self._window else self._key_pull
            assert waiting is not None
            await wait_settled(waiting)

    def aiopipe_recent_key(self, back: int, batch: object) -> tuple[bool, Any]:
        """``(True, key)``: the key of ``batch``, handed out ``back`` batches before the
        latest (0: the latest), which a pipeline's failure note names; ``(False,
        None)`` if the batch handed out there is another object (someone else read
        batches meanwhile), or lies beyond the latest :data:`KEYS_KEPT`."""
        if 0 <= back < len(self._given):
            key, given = self._given[-1 - back]
            if given == id(batch):  # (``batch`` is alive: no other object has its id)
                return True, key
        return False, None

    def statistics(self) -> FetchStatistics:
        """The counts of :class:`FetchStatistics`, now."""
        fetches = [entry for entry in self._window if entry.index is not None]
        return FetchStatistics(
            keys_taken=self._taken, in_flight=len(fetches),
            ready=sum(1 for entry in fetches if entry.future.done()),
            delivered=self._delivered, failed=len(self._failed),
            exhausted=self._keys_done and not self._window, closed=self._closed,
        )  # fmt: skip

    def position(self, items_done: int) -> int:
        """How many keys are done with once the consumer is done with the first
        ``items_done`` batches handed out: the keys whose fetch failed before them
        count as done.  Where a resumed run starts its keys; with a pipeline, once
        it is idle, ``source.position(pipe.statistics().position)``."""
        keys = items_done
        for failed in self._failed:  # ascending: each failure before the spot moves it on
            if failed > keys:
                break
            keys += 1
        return keys

    async def aclose(self) -> None:
        """Cancel the fetches in flight and wait for them to end; their batches are
        dropped.  Fetches running on another loop (a blocking pipeline's) are
        cancelled there, as :meth:`close` does, not waited for.  Iterating afterwards
        ends at once.  Idempotent."""
        self._closed = True
        pending = self._pending()
        if not pending:  # nothing started: no loop needed (under trio too)
            return
        loop = asyncio_loop()
        running = []
        for future in pending:
            if future.done():
                mark_retrieved(future)
            elif future.get_loop() is loop:  # (one of a closed loop never ends)
                cancel_quietly(future)
                running.append(future)
            else:  # another loop's (a blocking pipeline's): cancelled there, not awaited
                with contextlib.suppress(RuntimeError):  # that loop is closed: nothing runs
                    future.get_loop().call_soon_threadsafe(cancel_quietly, future)
        self._window.clear()
        self._key_pull = None
        if running:
            await asyncio.wait(running)

    def close(self) -> None:
        """:meth:`aclose` for code without a loop at hand (the blocking form, a
        ``finally`` of a sync function): the fetches in flight are cancelled on their
        loop, not waited for -- they end when that loop next runs (the blocking
        pipeline's next call or its ``shutdown()``).  Their batches are dropped;
        iterating afterwards ends at once.  Idempotent."""
        self._closed = True
        self._cancel_pending()
        self._window.clear()
        self._key_pull = None

    async def __aenter__(self) -> FetchAhead[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # Dropped without aclose(): cancel what still runs, on its loop's thread
        # (the collector may run anywhere), so no task is destroyed pending and no
        # error goes unretrieved.
        if hasattr(self, "_key_pull"):  # else __init__ refused its arguments
            self._cancel_pending()

    def _cancel_pending(self) -> None:
        """Cancel what still runs, on its loop's thread, without waiting."""
        for future in self._pending():
            if future.done():
                mark_retrieved(future)
                continue
            with contextlib.suppress(RuntimeError):  # its loop is closed: nothing runs
                future.get_loop().call_soon_threadsafe(cancel_quietly, future)

    def _pending(self) -> list[asyncio.Future[Any]]:
        """The fetches and the key pull whose outcome nobody has taken."""
        pull = [self._key_pull] if self._key_pull is not None else []
        return [entry.future for entry in self._window] + pull

    # -- filling the window --------------------------------------------------------------

    def _refill(self) -> None:
        """Start the fetches of the next keys while fewer than ``in_flight`` run."""
        while len(self._window) < self._limit and not (
            self._keys_done or self._keys_failed or self._closed or self._lost or self._plain
        ):
            if self._unstarted is not NO_KEY:
                self._take(self._unstarted)
                continue
            if self._async is not None:
                pull = self._key_pull
                if pull is None:
                    if self._keys_closed():
                        return
                    self._key_pull = asyncio.ensure_future(next_key(self._async))
                    # A weak reference: a pending pull must not keep a dropped self alive.
                    self._key_pull.add_done_callback(notify_when_pulled(weakref.ref(self)))
                    return  # _key_arrived goes on
                if not pull.done():
                    return
                self._key_arrived(pull)  # done, its callback not run yet
                continue
            assert self._sync is not None
            try:
                key = next(self._sync, END)
            except Exception as exc:  # the keys' own error: raised in its turn
                self._fail_keys(exc)
                return
            self._take(key)

    def _key_arrived(self, pull: asyncio.Future[Any]) -> None:
        if pull is not self._key_pull:
            return  # taken already, closed meanwhile, or a pull of a loop that shut down
        self._key_pull = None
        if pull.cancelled():  # a loop shutting down: pulled again on the next one
            if finished_generator(self._async):
                self._lost = "a loop shutting down closed the async generator of keys mid-pull"
            return
        problem = pull.exception()
        if problem is not None:
            self._fail_keys(problem)
        else:
            key = pull.result()
            if key is CLOSED:  # closed with its loop: lost if it gave keys, else empty
                if self._read_a_key:
                    self._lost = self._closed_keys()
                    return
                key = END
            self._read_a_key = key is not END
            self._take(key)

    def _keys_closed(self) -> bool:
        """Whether the async generator of keys was closed between two pulls without
        having ended (its loop shut down: ``asyncio.run`` closes the generators it
        iterated): then its remaining keys are lost, said by the next call."""
        if self._read_a_key and finished_generator(self._async):
            self._lost = self._closed_keys()
        return self._lost is not None

    @staticmethod
    def _closed_keys() -> str:
        return closed_between_pulls("the async generator of keys") + (
            "; keep every call inside one loop, or use pipe.blocking()"
        )

    def _take(self, key: Any) -> None:
        if key is END:
            self._keys_done = True
            return
        self._unstarted = key  # kept if fetch(key) is interrupted
        future = self._start(key)
        self._unstarted = NO_KEY
        index = self._taken
        self._taken += 1
        self._window.append(Entry(index, key, future))

    def _start(self, key: Any) -> asyncio.Future[Any]:
        try:
            fetching: object = self._fetch(key)  # checked: callers pass any callable
        except Exception as exc:  # a plain function that raised: that fetch failed
            return settled(exc)
        if not inspect.isawaitable(fetching):
            self._plain = True  # every key would fail alike: the refusal comes next
            return settled(NotAwaitable(
                f"fetch_ahead(): fetch returned {type(fetching).__name__}, not an awaitable: "
                f"define fetch with 'async def'"
            ))  # fmt: skip
        return asyncio.ensure_future(fetching)

    def _fail_keys(self, problem: BaseException) -> None:
        self._keys_failed = True  # no key is read past it until it is raised
        self._window.append(Entry(None, None, settled(problem)))

    def _revive(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start again, on ``loop``, the fetches of a loop that shut down before they
        finished (``asyncio.run`` cancels every task left): none was handed out."""
        for entry in self._window:
            future = entry.future
            if future.get_loop() is not loop and (future.cancelled() or not future.done()):
                close_left(future)
                entry.future = self._start(entry.key)
        pull = self._key_pull
        if pull is not None and pull.get_loop() is not loop and not pull.done():
            close_left(pull)  # a generator's step: closing it finishes the generator
            self._key_pull = None  # its loop closed before the pull ended
            if finished_generator(self._async):
                self._lost = ("the event loop a pull of the async generator of keys waited "
                              "on was stopped and closed (not cancelled); closing that pull "
                              "finished the generator")  # fmt: skip

    # -- handing out -----------------------------------------------------------------------

    def _outcome(self, entry: Entry) -> T:
        future = entry.future
        problem = None if future.cancelled() else future.exception()
        if problem is None and not future.cancelled():
            batch = future.result()
            if inspect.iscoroutine(batch):  # a bug, as a plain fetch is (below)
                for other in (entry, *self._window):  # said once, not again when collected
                    other.future.add_done_callback(close_coroutine_result)
                assert entry.index is not None  # a fetch's entry: the keys' own hold errors
                self._failed.append(entry.index)
                self._refused = ConfigurationTypeError(
                    f"fetch_ahead(): fetch({entry.key!r}) returned a coroutine as its batch: "
                    f"an 'await' missing inside fetch?"
                )  # fmt: skip
                raise self._refused
            self._given.append((entry.key, id(batch)))
            self._delivered += 1
            return batch  # type: ignore[no-any-return]
        if problem is None:
            problem = asyncio.CancelledError("the fetch was cancelled, not by fetch_ahead")
        if entry.index is None:  # the keys' own error, raised unchanged
            self._keys_failed = False
            raise problem
        self._failed.append(entry.index)
        if isinstance(problem, NotAwaitable):  # a bug, not a failed key (`except FetchError`
            # would skip every key): raised again by every call, taking no further key
            self._refused = ConfigurationTypeError(*problem.args)
            raise self._refused from None
        raise FetchError(entry.key, entry.index, problem) from problem


def fetch_ahead(
    keys: Iterable[K] | AsyncIterable[K], fetch: Callable[[K], Awaitable[T]], *, in_flight: int
) -> FetchAhead[T]:
    """A source of the batches ``await fetch(key)`` returns for each of ``keys``, with
    up to ``in_flight`` fetches running at once as asyncio tasks.

    * Batches come out in key order, whatever order the fetches finish in.
    * At most ``in_flight`` fetches are started and not yet handed out: the next
      key's fetch starts when a batch leaves (memory holds ``in_flight`` batches).
    * A fetch that raises comes out in its turn as :class:`~aiopipe.FetchError`
      naming the key and its position in the keys (the exception chained); that key
      is skipped and the next call goes on with the next one.  An error of ``keys``
      themselves comes out unchanged, in its turn.
    * Cancel-safe: a cancelled ``progress()`` (or ``anext()``) cancels no fetch and
      loses no fetched batch; none is fetched twice.  ``reset()`` of the pipeline
      keeps the fetches too: the same source goes on where it stands.  (A loop
      shutting down cancels the fetches running on it; the next loop starts them
      again.)
    * ``await source.aclose()`` (or ``async with fetch_ahead(...) as source:``)
      cancels the fetches in flight and waits for them; ``source.close()`` (from
      sync code: the blocking form) cancels them without waiting; dropping the
      source cancels them too.

    ``keys`` is an iterable (called inline on the loop, like a sync source) or an
    async iterable (pulled in a task of its own, one key ahead).  asyncio only: under
    trio, fetch in a nursery and feed the pipeline from a memory channel."""
    return FetchAhead(keys, fetch, in_flight=in_flight)
