"""``Feed``: the batches pulled from one source and where the pipeline stands in it."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Iterator
from typing import Any, Union

__all__ = ("END", "Feed", "Source")

#: Returned by :meth:`Feed.next` once the source is exhausted.
END: Any = object()
Source = Union[Iterator[Any], AsyncIterator[Any]]


class Feed:
    """One source (a sync or async iterator) and the progress made through it."""

    __slots__ = (
        "_async", "_sync", "exhausted", "iteration", "lost", "pulled", "refused", "returned",
        "source",
    )  # fmt: skip

    def __init__(self, source: Source) -> None:
        self._async: AsyncIterator[Any] | None = None
        self._sync: Iterator[Any] | None = None
        given: object = source  # checked at run time: callers pass anything
        if isinstance(given, AsyncIterator):
            self._async = given
        elif isinstance(given, Iterator):
            self._sync = given
        elif hasattr(given, "__iter__") or hasattr(given, "__aiter__"):
            raise TypeError(
                f"progress() takes an iterator, got the iterable {type(source).__name__}: "
                f"create it once with iter(...) / aiter(...) and pass the same iterator on "
                f"every call (a fresh iterator per call would restart the pipeline)"
            )
        else:
            raise TypeError(f"progress() takes a sync or async iterator, got {source!r}")
        self.source = source
        #: Batches pulled so far (the final count once ``exhausted``).
        self.pulled = 0
        #: Results handed back to the caller.
        self.returned = 0
        #: The next internal iteration to run.
        self.iteration = 0
        self.exhausted = False
        #: Items the pipeline refused (``BadBatchError``): the source's position is
        #: ``returned + refused`` once nothing is in flight.
        self.refused = 0
        #: Why the source can no longer be read, when a cancelled pull closed it.
        self.lost: str | None = None

    @property
    def in_flight(self) -> int:
        """Batches pulled whose results have not been returned yet."""
        return self.pulled - self.returned

    @property
    def finished(self) -> bool:
        return self.exhausted and self.returned >= self.pulled

    async def next(self) -> Any:
        """The next batch, or :data:`END`.

        Sync iterators are called inline with a default (never through a thread:
        ``StopIteration`` crossing a future hangs, CPython gh-112182).
        """
        if self._async is not None:
            try:
                return await anext(self._async, END)
            except asyncio.CancelledError:
                # The cancellation was thrown into an async generator's frame: unless
                # it caught it, the generator is finished and its remaining items gone.
                # (Under trio the bridge's stand-in holds the caller's generator.)
                source = getattr(self._async, "source", self._async)
                if inspect.isasyncgen(source) and source.ag_frame is None:
                    self.lost = "a cancelled progress() closed this async generator mid-pull"
                raise
        assert self._sync is not None
        return next(self._sync, END)
