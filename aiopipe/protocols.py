"""The protocol every pipeline offers: the engine's ``SchedulablePipeline``, the
``Pipeline`` facade and adapters such as ``hstu_tasks``' pipelines.

An adapter builds its pipeline from this public surface -- it drives an engine and
offers the same calls -- rather than from the engine's internals: ``AsyncPipeline`` is
what the blocking form and :func:`results_of` need, and
:meth:`SchedulablePipeline.wait_idle` waits for an iteration whose caller was
cancelled.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any, Protocol, TypeVar

from .source import Source, iterate

__all__ = ("AsyncPipeline", "results_of")

ResultT = TypeVar("ResultT", covariant=True)


class AsyncPipeline(Protocol[ResultT]):
    """What a pipeline offers to async code, and what the blocking form
    (:class:`~aiopipe.blocking.BlockingPipeline`) wraps."""

    async def progress(self, source: Source) -> ResultT: ...

    async def drain(self) -> list[Any]: ...

    def shutdown(self) -> None: ...


async def results_of(
    pipeline: AsyncPipeline[ResultT], source: Iterable[Any] | AsyncIterable[Any]
) -> AsyncIterator[ResultT]:
    """``async for result in results_of(pipe, loader)``: one result per batch, like
    ``for batch in loader``, by calling ``pipeline.progress`` until the end.  An
    iterable (a list, a ``DataLoader``) gets a fresh iterator, so each call is a new
    pass over it; an iterator continues where it stands (every remaining result)."""
    batches = iterate(source)
    while True:
        try:
            result = await pipeline.progress(batches)
        except StopAsyncIteration:
            return
        yield result
