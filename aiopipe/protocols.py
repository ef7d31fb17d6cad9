"""The protocol every pipeline offers: the engine's ``SchedulablePipeline``, the
``Pipeline`` facade and adapters such as ``hstu_tasks``' pipelines.

An adapter builds its pipeline from this public surface -- it drives an engine and
offers the same calls -- rather than from the engine's internals: ``AsyncPipeline`` is
what the blocking form and :class:`Results` need, and
:meth:`SchedulablePipeline.wait_idle` waits for an iteration whose caller was
cancelled.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any, Generic, NoReturn, Protocol, TypeVar

from .sources import Source, iterate

__all__ = ("AsyncPipeline", "Results", "abandon_source")

ResultT = TypeVar("ResultT", covariant=True)


class AsyncPipeline(Protocol[ResultT]):
    """What a pipeline offers to async code, and what the blocking form
    (:class:`~aiopipe.blocking.BlockingPipeline`) wraps."""

    async def progress(self, source: Source) -> ResultT: ...

    async def drain(self) -> list[Any]: ...

    def shutdown(self) -> None: ...


class Results(AsyncIterator[ResultT], Generic[ResultT]):
    """``async for result in Results(pipe, loader)``: one result per batch, like ``for
    batch in loader``, by calling ``pipeline.progress`` until the end.  An iterable (a
    list, a ``DataLoader``) gets a fresh iterator, so each call is a new pass over it;
    an iterator continues where it stands (every remaining result).

    Left early at a result (``break``, ``aclose()``, the iterator dropped), it tells
    a pipeline that has ``abandon_source`` (the engine's does) that its batches still
    in flight need not be trained: the next pass discards them instead of being
    refused.  A plain iterator, not an async generator, so that a ``break`` tells it
    at once (an async generator is finalized later, by a task of the loop)."""

    def __init__(self, pipeline: AsyncPipeline[ResultT], source: Iterable[Any] | AsyncIterable[Any]) -> None:
        self._at_result = False  # the last step returned a result: the caller holds it
        self._done = False
        self._pipeline = pipeline
        self._batches = iterate(source)
        self._fresh = self._batches is not source  # made here: nobody else holds it

    def __aiter__(self) -> Results[ResultT]:
        return self

    def __iter__(self) -> NoReturn:
        # A plain ``for`` (or ``list()``) would say only "not iterable".
        raise TypeError(
            "results() is an async iterator: 'async for result in pipe.results(...)' "
            "inside async code, or 'for result in pipe.blocking().results(...)' in a "
            "script without an event loop"
        )

    async def __anext__(self) -> ResultT:
        if self._done:
            raise StopAsyncIteration
        self._at_result = False
        try:
            result = await self._pipeline.progress(self._batches)
        except StopAsyncIteration:
            self._done = True
            raise
        self._at_result = True
        return result

    async def aclose(self) -> None:
        self._leave()

    def __del__(self) -> None:
        self._leave()

    def _leave(self) -> None:
        # Only from a result: an error or a cancellation leaves the pipeline's
        # contract as it is (the next call goes on with the same source).
        if self._done or not self._at_result:
            return
        self._done = True
        abandon_source(self._pipeline, self._batches, fresh=self._fresh)


def abandon_source(pipeline: object, source: Any, *, fresh: bool) -> None:
    """Tell ``pipeline``, if it has ``abandon_source``, that a ``results()`` loop over
    ``source`` was left early (``fresh``: the loop made ``source`` itself).  A
    pipeline whose ``abandon_source`` takes no ``fresh`` is told without it."""
    abandon = getattr(pipeline, "abandon_source", None)
    if abandon is None:
        return
    try:
        takes_fresh = "fresh" in inspect.signature(abandon).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin, say)
        takes_fresh = False
    if fresh and takes_fresh:
        abandon(source, fresh=True)
    else:
        abandon(source)

