"""Sources and passes over them: torchrec's ``execute_all_batches=False`` as a source
wrapper (and the wrappers one pipeline keeps), and one pass of a torchrec pipeline
over data (the reference the runners compare with)."""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from aiopipe.source import Source, not_a_source

__all__ = ("LastTwoDropped", "torchrec_results", "without_last_two")


def without_last_two(source: Source) -> Source:
    """torchrec's ``execute_all_batches=False``: item k is handed on once item k+2 has
    been read, so the last two items of the source are read and dropped."""
    if isinstance(source, AsyncIterator):
        return _AsyncWithoutLastTwo(source)
    if not isinstance(source, Iterator):
        raise not_a_source("progress()", source)
    return _WithoutLastTwo(source)


class LastTwoDropped:
    """``execute_all_batches=False`` for one pipeline: each source's wrapper, kept
    until the source ends (a wrapper holds the two items it read ahead, and
    ``drain()`` may leave one unended)."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[Source, Source]] = {}  # id(source): (source, wrapper)

    def adapt(self, source: Source) -> Source:
        """The wrapper ``progress`` reads instead of ``source``."""
        held = self._held.get(id(source))
        if held is None:
            held = self._held[id(source)] = (source, without_last_two(source))
        return held[1]

    def ended(self, source: Source) -> None:
        """``progress`` reported the end of the wrapper ``source``: forget it."""
        for key, (_, wrapper) in list(self._held.items()):
            if wrapper is source:
                del self._held[key]

    def clear(self) -> None:
        """``reset()``: forget every wrapper."""
        self._held.clear()


class _WithoutLastTwo(Iterator[Any]):
    def __init__(self, source: Iterator[Any]) -> None:
        self._source, self._held = source, collections.deque[Any]()

    def __next__(self) -> Any:
        while len(self._held) < 3:
            self._held.append(next(self._source))  # at the end the held two are dropped
        return self._held.popleft()


class _AsyncWithoutLastTwo(AsyncIterator[Any]):
    def __init__(self, source: AsyncIterator[Any]) -> None:
        self._source, self._held = source, collections.deque[Any]()

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
