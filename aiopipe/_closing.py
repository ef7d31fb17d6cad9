"""``Closing``: how a pipeline shuts down -- ``aclose()`` (the end of ``async with``),
which first lets a call another task has under way, and an iteration whose caller was
cancelled, run to their end; and ``shutdown()``, which stops the threads at once."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ._core.log import pipeline_log
from .errors import PipelineStateError
from .interop import in_trio

if TYPE_CHECKING:
    from .calls import CallGuard
    from .driver import IterationDriver
    from .executors import Executor
    from .feeds import Feeds
    from .interop import TrioBridge
    from .ring import RetiredStores

__all__ = ("Closing",)


class Closing:
    """The closing part of :class:`~aiopipe.SchedulablePipeline` (its API reference
    lists these methods as the pipeline's own)."""

    # The pipeline's, read here.
    name: str
    _calls: CallGuard
    _closed: bool
    _closing: int  # aclose() calls waiting for another task's call: no new call starts
    _driver: IterationDriver
    _executor: Executor
    _feeds: Feeds
    _retired: RetiredStores
    _trio: TrioBridge

    if TYPE_CHECKING:

        async def wait_idle(self) -> None: ...  # the pipeline's

    async def aclose(self) -> None:
        """Wait for a call another task has under way (``progress()``, ``drain()``, ...)
        and for an iteration still running (its caller was cancelled), then shut
        down.  ``async with pipe:`` calls it on exit, so leaving the block, by an
        error too, while another task's call runs waits for that call rather than
        raising over the error; a call started meanwhile is refused
        (``PipelineStateError``).  Cancelled while it waits, it raises
        ``CancelledError`` at once and leaves the pipeline open: the call and the
        iteration run on, and a later ``aclose()`` finishes the job.  Idempotent."""
        if self._closed:
            return
        self._closing += 1
        try:
            await self.wait_idle()
            if not in_trio() and not self._called_by_the_source() and (
                await self._calls.wait_ended()
            ):
                await self.wait_idle()  # that call's iteration, if it was cancelled meanwhile
        finally:
            self._closing -= 1
        if not self._closed:  # (another aclose() may have finished the job meanwhile)
            self.shutdown()

    def _called_by_the_source(self) -> bool:
        """The caller runs in a read of the current source, which the call under way
        may be waiting for: waiting for that call would wait for ever."""
        feed = self._feeds.current
        return feed is not None and feed.reads_in(asyncio.current_task())

    def shutdown(self) -> None:
        """Stop the executor's threads.  Idempotent; the pipeline is unusable after."""
        if self._closed:
            return
        if self._calls.in_progress():
            raise PipelineStateError("cannot shut down while a progress is running")
        self._driver.refuse_while_running("shutdown()")
        pipeline_log.debug("%s: shut down", self.name)
        self._feeds.close()
        self._closed = True
        self._executor.shutdown()
        self._trio.close()
        self._retired.clear()
        if self._driver.slot_audit is not None:  # those no later call would give
            self._driver.warn_of_undeclared_slots(at_shutdown=True)

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

