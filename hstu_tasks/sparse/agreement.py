"""The end every rank agrees on, window by window (``ended_together``'s wrappers).

Each rank reads a *window* of items ahead of the ones it hands on and all-reduces
one number for it: how many items it read, and whether its source raised after
them.  The minimum over the ranks says how many items of the window every rank has:
those are handed on, one a call, while the next window is read (one item a call)
and its all-reduce runs.  A window every rank filled doubles the next one, up to
:data:`WINDOW`; so the ranks agree once every :data:`WINDOW` items once under way
(one all-reduce an item cost 10-20 % of a two-rank DLRM step on two cores,
docs/performance.md), and a pass starts with a window of one.

Where the minimum falls short of the window, the epoch ends there on every rank
(a longer rank drops what it read beyond: one window at most), or a rank's source
raised there: that rank raises its error, the others ``PipelineStateError`` and keep
what they read, to be agreed on again first when called again.  Every decision
rests on the agreed numbers only, so the ranks' windows stay the same size.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch
import torch.distributed as dist

from aiopipe import PipelineStateError

__all__ = ("WINDOW", "AsyncEndedTogether", "EndedTogether", "Holding")

#: The most items one agreement covers.
WINDOW = 16

_END = object()
_MIN = dist.AllreduceOptions()
_MIN.reduceOp = dist.ReduceOp.MIN


class Holding:
    """A wrapper that reads items of ``_source`` before handing them on."""

    _source: Any

    def held(self) -> int:
        """Items read from the source and not handed on yet."""
        raise NotImplementedError

    @property
    def aiopipe_wraps(self) -> Any:
        """The source read (``aiopipe.sources.innermost``): a generator finished under
        the wrapper is then refused by name, not taken for one that ran dry."""
        return self._source


class _Raised:
    """The source's error, read where an item would have been."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _is_item(entry: Any) -> bool:
    return entry is not _END and not isinstance(entry, _Raised)


class _Window:
    """Up to ``size`` entries read (items, then maybe the source's end or error) and
    the all-reduce, under way, of what every rank has of them."""

    __slots__ = ("entries", "flag", "size", "work")

    def __init__(self, entries: list[Any], size: int, group: Any) -> None:
        self.entries, self.size = entries, size
        items = sum(map(_is_item, entries))
        raised = bool(entries) and isinstance(entries[-1], _Raised)
        # 2 * items, plus one unless the source raised: the minimum is the fewest items,
        # and among the ranks with that many, a raise wins over an end or a full window.
        self.flag = torch.tensor([2 * items + (0 if raised else 1)], dtype=torch.int32)
        # The group's own call: half the time of dist.all_reduce's (about 45 against
        # 85 us of the loop's thread), which checks what is known here.
        self.work = group.allreduce([self.flag], _MIN)

    def agreed(self) -> tuple[int, bool]:
        """Once ``work`` is done: how many items every rank has, and whether a rank's
        source raised right after them."""
        code = int(self.flag.item())
        return code // 2, code % 2 == 0


def _told() -> PipelineStateError:
    return PipelineStateError(
        "another rank's source raised (that rank raises its error); this rank's next "
        "item is kept, with those it read after it: calling progress() again with the "
        "same source on every rank goes on in step, or end the epoch on every rank"
    )


class _Windows(Holding):
    """What the two wrappers share: the agreed items, the window read next and its
    agreement, the entries kept when another rank's source raised."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self._size = 1  # of the window read next
        # Entries of the next window read a call: twice as many while the windows grow,
        # so that it is complete when the last item of this one is handed on.
        self._rate = 1
        self._agreed = collections.deque[Any]()  # every rank has them: handed on one a call
        # What follows the agreed items: None, the next window; _END; an error to raise.
        self._then: object = None
        self._reading: list[Any] = []  # entries of the next window, read so far
        self._next: _Window | None = None  # the next window, its agreement under way
        self._kept = collections.deque[Any]()  # entries read again before the source
        self._over = False

    def held(self) -> int:
        windows = (self._reading, self._kept, self._next.entries if self._next else ())
        return len(self._agreed) + sum(sum(map(_is_item, w)) for w in windows)

    def _add(self, entry: Any) -> None:
        """One entry of the next window; its agreement starts once it is complete."""
        self._reading.append(entry)
        if not _is_item(entry) or len(self._reading) == self._size:
            self._next = _Window(self._reading, self._size, self._group)
            self._reading = []

    def _reads_ahead(self) -> bool:
        """Whether a call reads one entry of the next window before it returns."""
        return self._then is None and self._next is None and not self._over

    def _follow(self) -> None:
        """The agreed items are handed on: end, or raise, as agreed."""
        then, self._then = self._then, None
        if then is _END:
            self._over = True
        elif isinstance(then, BaseException):
            raise then

    def _settle(self, window: _Window) -> None:
        items, raised_here = window.entries, None
        if items and isinstance(items[-1], _Raised):
            raised_here = items[-1].error
        count, raised = window.agreed()
        self._agreed.extend(items[:count])
        if count == window.size:  # every rank filled it: the next one is larger
            self._size = min(2 * window.size, WINDOW)
            self._rate = self._size // window.size
            return
        self._size = self._rate = 1
        if raised and raised_here is not None and len(items) - 1 == count:  # its own, here
            self._then = raised_here
        elif raised:
            self._kept.extendleft(reversed(items[count:]))
            self._then = _told()
        else:
            self._then = _END  # what this rank read beyond is dropped


class EndedTogether(_Windows, Iterator[Any]):
    def __init__(self, source: Iterator[Any], group: Any) -> None:
        super().__init__(group)
        self._source = source

    def _entry(self) -> Any:
        if self._kept:
            return self._kept.popleft()
        try:
            return next(self._source, _END)
        except Exception as exc:  # agreed on, raised when its turn comes
            return _Raised(exc)

    def __next__(self) -> Any:
        while not self._agreed:
            if self._then is not None:
                self._follow()
            if self._over:
                raise StopIteration
            while self._next is None:  # the first window, or the first after a raise
                self._add(self._entry())
            window = self._next
            window.work.wait()  # started a window ago: done (but the first)
            self._next = None
            self._settle(window)
        item = self._agreed.popleft()
        for _ in range(self._rate):
            if self._reads_ahead():  # the next window's agreement runs while this one trains
                self._add(self._entry())
        return item


class AsyncEndedTogether(_Windows, AsyncIterator[Any]):
    def __init__(self, source: AsyncIterator[Any], group: Any) -> None:
        super().__init__(group)
        self._source = source

    async def _entry(self) -> Any:
        if self._kept:
            return self._kept.popleft()
        try:
            return await anext(self._source, _END)
        except Exception as exc:
            return _Raised(exc)

    async def __anext__(self) -> Any:
        while not self._agreed:
            if self._then is not None:
                self._follow()
            if self._over:
                raise StopAsyncIteration
            while self._next is None:
                self._add(await self._entry())
            window = self._next
            if not window.work.is_completed():  # off the event loop's thread
                await asyncio.get_running_loop().run_in_executor(None, window.work.wait)
            self._next = None  # only now: a caller cancelled in the wait loses no window
            self._settle(window)
        item = self._agreed.popleft()
        for _ in range(self._rate):
            if self._reads_ahead():
                self._add(await self._entry())
        return item
