"""Sources and passes over them: torchrec's ``execute_all_batches=False`` and the end
every rank agrees on as source wrappers (and the wrappers one pipeline keeps), and one
pass of a torchrec pipeline over data (the reference the runners compare with)."""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import torch.distributed as dist

from aiopipe.sources import Source, not_a_source

from .agreement import AsyncEndedTogether, EndedTogether, Holding

__all__ = (
    "AgreementGroups", "SourceWrappers", "StepsPerCall", "agreement_groups", "ended_together",
    "results_by_call",
    "torchrec_results", "without_last_two",
)  # fmt: skip

#: Steps a ``progress_many`` call asks for: a number, or one from the steps done so far.
StepsPerCall = int | Callable[[int], int]


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
    ranks agree on a window of up to 16 items at a time (``agreement.WINDOW``) with a
    gloo all-reduce of one number, started while the window before is handed on: by
    the time it is needed it is done.  A longer rank drops what it read beyond the
    common end (one window at most).  A source that raises on one rank raises
    ``PipelineStateError`` on the others, which keep the items they had read: called
    again, every rank goes on from where it stood, still in step (the raising rank's
    source read again), or ends the epoch there."""
    if isinstance(source, AsyncIterator):
        return AsyncEndedTogether(source, group)
    if not isinstance(source, Iterator):
        raise not_a_source("progress()", source)
    return EndedTogether(source, group)


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


def _items_held(wrapper: Source) -> int:
    """The items ``wrapper`` and the wrappers inside it hold."""
    count = 0
    while isinstance(wrapper, Holding):
        count += wrapper.held()
        wrapper = wrapper._source
    return count


class _WithoutLastTwo(Holding, Iterator[Any]):
    def __init__(self, source: Iterator[Any]) -> None:
        self._source, self._held = source, collections.deque[Any]()

    def held(self) -> int:
        return len(self._held)

    def __next__(self) -> Any:
        while len(self._held) < 3:
            self._held.append(next(self._source))  # at the end the held two are dropped
        return self._held.popleft()


class _AsyncWithoutLastTwo(Holding, AsyncIterator[Any]):
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
