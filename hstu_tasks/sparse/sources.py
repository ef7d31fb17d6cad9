"""Sources and passes over them: torchrec's ``execute_all_batches=False`` and the end
every rank agrees on as source wrappers (and the wrappers one pipeline keeps), and one
pass of a torchrec pipeline over data (the reference the runners compare with)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from aiopipe import PipelineStateError
from aiopipe.sources import Source, not_a_source

__all__ = (
    "AgreementGroups", "SourceWrappers", "StepsPerCall", "agreement_groups", "ended_together",
    "results_by_call",
    "torchrec_results", "without_last_two",
)  # fmt: skip

#: Steps a ``progress_many`` call asks for: a number, or one from the steps done so far.
StepsPerCall = int | Callable[[int], int]

_END = object()


def without_last_two(source: Source) -> Source:
    """torchrec's ``execute_all_batches=False``: item k is handed on once item k+2 has
    been read, so the last two items of the source are read and dropped."""
    if isinstance(source, AsyncIterator):
        return _AsyncWithoutLastTwo(source)
    if not isinstance(source, Iterator):
        raise not_a_source("progress()", source)
    return _WithoutLastTwo(source)


def ended_together(source: Source, group: Any) -> Source:
    """``source`` ended on every rank of ``group`` together: an item is handed on only
    once every rank has one, so a rank whose source is shorter ends the epoch for all
    of them, on the same step, instead of leaving the others in a collective.  The
    ranks agree on each item with a gloo all-reduce of one number, started when the
    item is read, one item ahead, and waited for when it is handed on: by then it is
    done.  A longer rank reads one item beyond the common end and drops it.  A source
    that raises on one rank raises ``PipelineStateError`` on the others, which keep the
    item they had read: called again, every rank goes on from where it stood, still
    in step (the raising rank's source read again), or ends the epoch there."""
    if isinstance(source, AsyncIterator):
        return _AsyncEndedTogether(source, group)
    if not isinstance(source, Iterator):
        raise not_a_source("progress()", source)
    return _EndedTogether(source, group)


class AgreementGroups:
    """Gloo groups of every rank for :func:`ended_together`, one per pipeline alive.
    Their all-reduces run on the event loop's thread, outside the tickets that order
    the lanes' collectives, so they must not share a group with them; nor with another
    live pipeline's: an async source's agreement is started whenever its item arrives,
    so two pipelines' agreements in one group could meet in a different order on each
    rank.  A pipeline shut down gives its group back for the next one (an evaluation
    pipeline made per pass holds no new connections each time).  Every rank must take
    and give back at the same points (a pipeline's first ``progress``, its
    ``shutdown()``)."""

    def __init__(self) -> None:
        self._free: list[Any] = []
        self._world: Any = None  # the default group the free ones belong to

    def take(self) -> Any:
        if self._world is not dist.group.WORLD:  # a new default group: the old ones are gone
            self._free, self._world = [], dist.group.WORLD
        return self._free.pop() if self._free else dist.new_group(backend="gloo")

    def give_back(self, group: Any, world: Any) -> None:
        if world is self._world:
            self._free.append(group)


#: The process's agreement groups.
agreement_groups = AgreementGroups()


class SourceWrappers:
    """One pipeline's wrapper of each source (``wrap``), kept until the source ends:
    a wrapper may hold items it read ahead, and ``drain()`` may leave one unended."""

    def __init__(self, wrap: Callable[[Source], Source]) -> None:
        self._wrap = wrap
        self._held: dict[int, tuple[Source, Source]] = {}  # id(source): (source, wrapper)

    def adapt(self, source: Source) -> Source:
        """The wrapper ``progress`` reads instead of ``source``."""
        held = self._held.get(id(source))
        if held is None:
            held = self._held[id(source)] = (source, self._wrap(source))
        return held[1]

    def ended(self, source: Source) -> None:
        """``progress`` reported the end of the wrapper ``source``: forget it."""
        for key, (_, wrapper) in list(self._held.items()):
            if wrapper is source:
                del self._held[key]

    def clear(self, source: Source | None = None) -> int:
        """``reset()``: forget every wrapper; how many items the wrapper of ``source``
        had read from it and not handed on (dropped with it)."""
        held = self._held.get(id(source)) if source is not None else None
        self._held.clear()
        return _items_held(held[1]) if held is not None else 0


class _Holding:
    """A wrapper that reads items of ``_source`` before handing them on."""

    _source: Any

    def held(self) -> int:
        """Items read from the source and not handed on yet."""
        raise NotImplementedError


def _items_held(wrapper: Source) -> int:
    """The items ``wrapper`` and the wrappers inside it hold."""
    count = 0
    while isinstance(wrapper, _Holding):
        count += wrapper.held()
        wrapper = wrapper._source
    return count


#: What a rank contributes to the agreement on one item (the minimum wins).
_HAS_ITEM, _ENDED, _RAISED = 1, 0, -1
_MIN = dist.AllreduceOptions()
_MIN.reduceOp = dist.ReduceOp.MIN


class _Agreement:
    """One item read (or the source's end, or its error) and the all-reduce, under
    way, of what every rank has for it."""

    def __init__(self, item: Any, error: Exception | None, group: Any) -> None:
        self.item, self.error = item, error
        code = _RAISED if error is not None else _HAS_ITEM if item is not _END else _ENDED
        self.flag = torch.tensor([code], dtype=torch.int32)
        # The group's own call: half the time of dist.all_reduce's (about 45 against
        # 85 us of the loop's thread a batch), which checks what is known here.
        self.work = group.allreduce([self.flag], _MIN)

    def verdict(self) -> Any:
        """Once ``work`` is done: the item to hand on, or ``_END``; an error raised
        (another rank's: :class:`_ElsewhereRaised`, for the caller to keep the item)."""
        if self.error is not None:
            raise self.error
        agreed = int(self.flag.item())
        if agreed == _RAISED:
            raise _ElsewhereRaised(self.item)
        return self.item if agreed == _HAS_ITEM else _END


class _ElsewhereRaised(Exception):
    """Another rank's source raised where this one read ``item``."""

    def __init__(self, item: Any) -> None:
        super().__init__()
        self.item = item

    def told(self) -> PipelineStateError:
        return PipelineStateError(
            "another rank's source raised (that rank raises its error); this rank's next "
            "item is kept: calling progress() again with the same source on every rank "
            "goes on in step, or end the epoch on every rank"
        )


class _AgreedItems(_Holding):
    """What both wrappers share: the agreement under way one item ahead, the item kept
    when another rank's source raised, and whether the agreed end was reached."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self._next: _Agreement | None = None
        self._kept: list[Any] = []  # [item] agreed on again before anything is read
        self._over = False

    def _agree(self, item: Any, error: Exception | None) -> _Agreement:
        return _Agreement(item, error, self._group)

    def held(self) -> int:
        ahead = self._next is not None and self._next.error is None and self._next.item is not _END
        return len(self._kept) + ahead

    def _hand_on(self, agreement: _Agreement) -> Any:
        """The agreed item, or ``_END`` (the wrapper is then over)."""
        try:
            item = agreement.verdict()
        except _ElsewhereRaised as elsewhere:
            self._kept = [elsewhere.item]
            raise elsewhere.told() from None
        if item is _END:
            self._over = True
        return item


class _EndedTogether(_AgreedItems, Iterator[Any]):
    def __init__(self, source: Iterator[Any], group: Any) -> None:
        super().__init__(group)
        self._source = source

    def _read(self) -> _Agreement:
        if self._kept:
            return self._agree(self._kept.pop(), None)
        try:
            return self._agree(next(self._source, _END), None)
        except Exception as exc:  # agreed on, raised when its turn comes
            return self._agree(_END, exc)

    def __next__(self) -> Any:
        if self._over:
            raise StopIteration
        agreement = self._next or self._read()
        self._next = None
        agreement.work.wait()  # started one item ago: done (but the first)
        item = self._hand_on(agreement)
        if item is _END:
            raise StopIteration
        self._next = self._read()  # the next item's agreement runs while this one trains
        return item


class _AsyncEndedTogether(_AgreedItems, AsyncIterator[Any]):
    def __init__(self, source: AsyncIterator[Any], group: Any) -> None:
        super().__init__(group)
        self._source = source

    async def _read(self) -> _Agreement:
        if self._kept:
            return self._agree(self._kept.pop(), None)
        try:
            return self._agree(await anext(self._source, _END), None)
        except Exception as exc:
            return self._agree(_END, exc)

    async def __anext__(self) -> Any:
        if self._over:
            raise StopAsyncIteration
        agreement = self._next or await self._read()
        self._next = None
        if not agreement.work.is_completed():  # the first: off the event loop's thread
            await asyncio.get_running_loop().run_in_executor(None, agreement.work.wait)
        item = self._hand_on(agreement)
        if item is _END:
            raise StopAsyncIteration
        self._next = await self._read()
        return item


class _WithoutLastTwo(_Holding, Iterator[Any]):
    def __init__(self, source: Iterator[Any]) -> None:
        self._source, self._held = source, collections.deque[Any]()

    def held(self) -> int:
        return len(self._held)

    def __next__(self) -> Any:
        while len(self._held) < 3:
            self._held.append(next(self._source))  # at the end the held two are dropped
        return self._held.popleft()


class _AsyncWithoutLastTwo(_Holding, AsyncIterator[Any]):
    def __init__(self, source: AsyncIterator[Any]) -> None:
        self._source, self._held = source, collections.deque[Any]()

    def held(self) -> int:
        return len(self._held)

    async def __anext__(self) -> Any:
        while len(self._held) < 3:
            self._held.append(await anext(self._source))
        return self._held.popleft()


def torchrec_results(pipe: Any, data: Iterable[Any]) -> Iterator[Any]:
    """One pass over ``data`` with a torchrec pipeline: ``progress`` until it raises
    ``StopIteration``."""
    source = iter(data)
    while True:
        try:
            yield pipe.progress(source)
        except StopIteration:
            return


async def results_by_call(pipe: Any, data: Iterable[Any], steps_per_call: StepsPerCall,
                          steps_done: Callable[[], int]) -> AsyncIterator[list[Any]]:  # fmt: skip
    """An aiopipe pipeline's results of ``data``, a list per call: one result each from
    ``results()`` for ``steps_per_call=1``, else ``progress_many``'s lists (the lanes
    chain a call's steps), each call asking for ``steps_per_call`` -- or, a function,
    ``steps_per_call(steps_done())`` -- steps."""
    if steps_per_call == 1:
        async for result in pipe.results(data):
            yield [result]
        return
    source = iter(data)
    while True:
        wanted = steps_per_call(steps_done()) if callable(steps_per_call) else steps_per_call
        results = await pipe.progress_many(source, wanted)
        if not results:
            return
        yield results
