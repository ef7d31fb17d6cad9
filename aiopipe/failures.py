"""``IterationFailures``: what an iteration's failure leaves for the calls after it.

A failure whose caller was cancelled (or came after results the caller gets first)
is raised by the next call, once; an iteration that failed after some of its tasks
ran leaves the batches in flight in an unknown state (:attr:`broken`) until the
pipeline is reset.  :func:`body_fault` tells a body's own non-``Exception`` error
(raised as ``TaskAbortedError``) from an interrupt or a cancellation.
"""

from __future__ import annotations

import asyncio
import threading

from ._core.lanes import LANE_THREAD_PREFIX
from ._core.loops import loop_running_in_this_thread, running_task
from .errors import PipelineStateError
from .ring import BatchRing
from .source import Feed
from .task import BATCH_SLOT

__all__ = ("IterationFailures", "body_fault", "loop_closed_error", "name_the_key")


class IterationFailures:
    """The pending failure and the broken state of one pipeline's iterations."""

    __slots__ = ("_pending", "broken")

    def __init__(self) -> None:
        #: Why the batches in flight are in an unknown state (an iteration failed
        #: after some of its tasks ran); ``None`` while they are intact.
        self.broken: str | None = None
        self._pending: BaseException | None = None  # of an iteration nobody awaited

    def record(self, number: int, started: bool, error: BaseException) -> None:
        """Iteration ``number`` failed with ``error``.  Before any task ran, the next
        call runs it again, batch and all; after, the pipeline is broken."""
        if started:
            self.broken = (
                f"iteration {number} was interrupted by {type(error).__name__} after "
                f"some of its tasks ran"
            )
            if hasattr(error, "add_note") and not _has_reset_note(error):
                error.add_note(
                    "aiopipe: the pipeline stops here: call reset() to discard the batches "
                    "in flight (untrained) and go on, or shutdown()"
                )
        if isinstance(error, Exception):
            self._pending = error  # raised by the caller, or by the next call

    def defer(self, error: Exception) -> None:
        """Raise ``error`` from the next call instead of this one (whose caller gets
        the results of the steps finished before it)."""
        self._pending = error

    @property
    def pending(self) -> bool:
        """An iteration failed and no call has raised its error yet."""
        return self._pending is not None

    def raise_pending(self) -> None:
        """An iteration failed with no caller waiting (it was cancelled): the next
        call reports the original error, once."""
        failure, self._pending = self._pending, None
        if failure is not None:
            raise failure

    def raise_if_broken(self) -> None:
        if self.broken is not None:
            raise PipelineStateError(
                f"{self.broken}; the batches in flight are in an unknown state. "
                f"Call reset() to discard them and start again."
            )

    def stopped(self, results_waiting: bool) -> bool:
        """A failure was raised and no result finished before it is waiting: the
        batches left in flight are in an unknown state."""
        return self.broken is not None and not results_waiting and self._pending is None

    def clear(self) -> None:
        """Forget a pending failure and a broken state (the pipeline is reset)."""
        self._pending = None
        self.broken = None


def _has_reset_note(error: BaseException) -> bool:
    return any("call reset()" in note for note in getattr(error, "__notes__", ()))


def loop_closed_error(number: int) -> PipelineStateError:
    return PipelineStateError(
        f"iteration {number} was left unfinished on an event loop that was closed"
    )


def body_fault(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a body, is a fault of the body's own that is not an
    ``Exception``: neither an interrupt (``KeyboardInterrupt``, ``SystemExit``), nor a
    coroutine closed from outside (``GeneratorExit`` with no task running it), nor the
    cancellation of the task the body runs in (the loop shutting down, the engine
    stopping a failed iteration).  A ``CancelledError`` while its task is not being
    cancelled came out of an ``await`` someone else cancelled (Python 3.11 and later
    tell them apart)."""
    if isinstance(exc, (Exception, KeyboardInterrupt, SystemExit)):
        return False
    if threading.current_thread().name.startswith(LANE_THREAD_PREFIX):
        return True  # a sync body on its lane: nothing there closes or cancels it
    task = running_task()
    if task is None and not loop_running_in_this_thread():
        return False  # no loop runs here: a coroutine closed by a finalizer
    if isinstance(exc, GeneratorExit):
        return task is not None
    if not isinstance(exc, asyncio.CancelledError):
        return True
    cancelling = getattr(task, "cancelling", None)
    return task is not None and cancelling is not None and cancelling() == 0


def name_the_key(error: BaseException, feed: Feed, ring: BatchRing) -> None:
    """A task's failure on a batch of a keyed source (``fetch_ahead``), the batch in
    ``ring``: name its key on the exception (``aiopipe_source_key`` and a note).
    Counted back from the latest batch the source handed out, which this feed holds
    (placed, or read ahead) -- whoever read the source before it, and however its
    batches are numbered -- and checked against the batch itself.  Not for a source
    read through a wrapper (it may hold batches of its own), nor past a refused item
    (it has no number)."""
    batch = getattr(error, "aiopipe_batch", None)
    recent_key = getattr(feed.source, "aiopipe_recent_key", None)
    if batch is None or recent_key is None or feed.refused:
        return
    if getattr(error, "aiopipe_source_key", None) is not None:
        return
    stores = [ring.at(offset) for offset in range(ring.depth)]
    store = next((s for s in stores if s.batch_index == batch and BATCH_SLOT in s), None)
    if store is None:
        return
    latest = feed.batches_before + feed.pulled - 1  # the latest batch placed in the ring
    found, key = recent_key(feed.read_ahead_items + latest - batch, store.get(BATCH_SLOT))
    if not found:
        return
    try:
        error.aiopipe_source_key = key  # type: ignore[attr-defined]
    except AttributeError:  # exceptions with __slots__
        return
    if hasattr(error, "add_note"):
        error.add_note(f"aiopipe: batch {batch} is the source's batch of key {key!r}")
