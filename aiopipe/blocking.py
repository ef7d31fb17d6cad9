"""``BlockingPipeline``: the pipeline for ordinary (non-async) scripts.

A drop-in for torchrec's ``TrainPipeline`` calling convention::

    pipe = SchedulablePipeline(schedule, executor="async").blocking()
    it = iter(loader)
    while True:
        try:
            out = pipe.progress(it)
        except StopIteration:
            break

Each call runs the pipeline's coroutine on a private asyncio event loop that lives
as long as the pipeline -- every ``pipe.blocking()`` of one pipeline shares it, so an
async source whose next batch one call began to read ahead is still read by the next
call, even through a new view (not uvloop: it is started and stopped on every call,
which costs more on uvloop; see ``runner.py``).  Calling it from inside a running
event loop is refused: use ``await pipe.progress(it)`` there.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import AsyncIterable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ._core.loops import LoopRunner, close_on_the_way_out
from .errors import ConfigurationTypeError
from .protocols import AsyncPipeline, abandon_source
from .sources import iterate

if TYPE_CHECKING:
    from .sources import Source
    from .trace import Tracer

__all__ = ("BlockingPipeline",)


#: Held while a pipeline's loop is looked up or made: two threads' first views of one
#: pipeline get the same loop.
_LOOP_LOCK = threading.Lock()


def _loop_of(pipeline: object) -> LoopRunner | None:
    """The private event loop of ``pipeline``'s blocking views: made when first asked
    for, kept on the pipeline, closed when the pipeline is dropped (or shut down).
    ``None`` where it cannot be kept there (``__slots__``, no weak references)."""
    with _LOOP_LOCK:
        kept = getattr(pipeline, "_blocking_loop", None)
        if isinstance(kept, LoopRunner):
            return kept
        runner = LoopRunner(prefer_uvloop=False)
        try:
            setattr(pipeline, "_blocking_loop", runner)  # any pipeline type
        except Exception:  # __slots__, a __setattr__ of its own: not kept there
            return None
        kept_now: object = getattr(pipeline, "_blocking_loop", None)
        if kept_now is not runner:  # dropped silently
            return None
        try:
            weakref.finalize(pipeline, _close_dropped, runner)  # dropped without shutdown()
        except TypeError:  # not weak-referenceable: nothing would close it
            delattr(pipeline, "_blocking_loop")
            return None
        return runner


class BlockingPipeline:
    """Blocking view of an async pipeline (``progress`` raises ``StopIteration``).

    ``step`` and ``reset`` are available when the wrapped pipeline has them."""

    def __init__(self, pipeline: AsyncPipeline[Any]) -> None:
        self._pipeline = pipeline
        shared = _loop_of(pipeline)
        if shared is None:  # a loop of this view's own, closed when the view is dropped
            shared = LoopRunner(prefer_uvloop=False)
            weakref.finalize(self, _close_dropped, shared)
        self._runner = shared

    @property
    def pipeline(self) -> Any:
        return self._pipeline

    @property
    def tracer(self) -> Tracer | None:
        """The wrapped pipeline's :class:`~aiopipe.trace.Tracer` (``None`` when tracing
        is off), so ``pipe.tracer.save(...)`` works on either form."""
        tracer: Tracer | None = getattr(self._pipeline, "tracer", None)
        return tracer

    def progress(self, source: Source) -> Any:
        """Like ``await pipeline.progress(source)``; raises ``StopIteration`` at the end."""
        try:
            return self._runner.run(self._pipeline.progress, source, keep=self._keep_one)
        except StopAsyncIteration:
            raise StopIteration from None

    def progress_many(self, source: Source, steps: int) -> list[Any]:
        """Like ``await pipeline.progress_many(source, steps)``: up to ``steps`` results
        in one call, ``[]`` at the end; the lanes chain the steps (one loop start and
        stop per call, not per step)."""
        many = getattr(self._pipeline, "progress_many", None)
        if many is None:
            raise ConfigurationTypeError(
                f"{type(self._pipeline).__name__} has no progress_many(); call progress() "
                f"once per step"
            )
        return self._runner.run(many, source, steps, keep=self._keep)

    def step(self, batch: Any) -> Any:
        """Like ``await pipeline.step(batch)``: one batch, to completion."""
        return self._runner.run(self._pipeline.step, batch)  # type: ignore[attr-defined]

    def results(self, source: Iterable[Any] | AsyncIterable[Any]) -> Iterator[Any]:
        """``for result in pipe.results(loader)``: one result per batch, like ``for
        batch in loader`` (an iterable gets a fresh iterator, an iterator continues
        where it stands)."""
        batches = iterate(source)
        fresh = batches is not source  # made here: nobody else holds it
        while True:
            try:
                result = self.progress(batches)
            except StopIteration:
                return
            try:
                yield result
            except GeneratorExit:  # left early: the batches in flight need no training
                abandon_source(self._pipeline, batches, fresh=fresh)
                raise

    def drain(self) -> list[Any]:
        return self._runner.run(self._pipeline.drain, keep=self._keep)

    def _keep(self, results: list[Any]) -> None:
        """Results of a call that finished as an interrupt arrived (raised instead):
        the next call returns them first, as after an interrupted call."""
        put_back = getattr(self._pipeline, "_put_back_results", None)
        if put_back is not None and results:
            put_back(results)

    def _keep_one(self, result: Any) -> None:
        self._keep([result])

    def reset(self) -> None:
        self._pipeline.reset()  # type: ignore[attr-defined]

    def statistics(self) -> Any:
        """The wrapped pipeline's :meth:`statistics`."""
        return self._pipeline.statistics()  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        """Shut the pipeline down and close the private loop.  Idempotent.  An
        iteration interrupted by Ctrl-C is finished first (see ``aclose``); a wait
        for it of over a second says what it waits for, and a Ctrl-C stops the wait:
        the loop is closed without it (``KeyboardInterrupt``; the pipeline is left as
        a loop closed under it leaves it)."""
        aclose = getattr(self._pipeline, "aclose", None)
        if aclose is not None and self._runner.usable:
            try:
                self._runner.run(aclose)
            except KeyboardInterrupt:  # it stopped the wait: the loop closes without it
                self._runner.close()
                raise
        else:
            self._pipeline.shutdown()
        self._runner.close()

    def __enter__(self) -> BlockingPipeline:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        close_on_the_way_out(self.shutdown, exc)

    def __repr__(self) -> str:
        return f"<BlockingPipeline of {self._pipeline!r}>"


def _close_dropped(runner: LoopRunner) -> None:
    """Close the loop of a pipeline dropped or left at exit.  A Ctrl-C while it waits
    for a step that does not end stops the wait: what it waits for was printed."""
    try:
        runner.close()
    except KeyboardInterrupt:
        pass
