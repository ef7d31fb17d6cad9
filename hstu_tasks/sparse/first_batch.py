"""``FirstBatch``: the source's first batch that a sparse pipeline's bootstrap takes
before its engine exists (torchrec traces the model on it).

It outlives a failed bootstrap (kept, the next bootstrap on that source trains it), a
cancelled one (its pull runs on; the next bootstrap on that source takes its batch)
and the items ``check_batch`` refused before it (counted, so the source's position
stays exact).  ``reset()`` drops it, counting what it had taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiopipe import BadBatchError, PipelineStateError
from aiopipe.source import Feed
from aiopipe.sources import END, Source

__all__ = ("FIRST_READ_DROPPED", "FirstBatch")

#: Why an async generator whose first batch a bootstrap was reading is lost, when
#: dropping that read finished it.
FIRST_READ_DROPPED = (
    "this async generator was closed by aiopipe: reset(), or another source passed, "
    "dropped the read of its first batch that a cancelled progress() had left under way, "
    "and cancelling that read finished it"
)


class FirstBatch:
    """One pipeline's first batch of a source, taken by its bootstrap (``source`` is
    the source the engine reads: a wrapper of the one passed, if any)."""

    def __init__(
        self, check_batch: Callable[[Any], None], discard: Callable[[int], None]
    ) -> None:
        self._check_batch = check_batch
        self._discard = discard  # told of a batch dropped for another source, untrained
        self._kept: tuple[Source, Any] | None = None  # taken by a bootstrap that failed
        self._refused: tuple[Source, int] | None = None
        self._pull: tuple[Source, Feed] | None = None  # a cancelled bootstrap's, running on
        self._passed: Source | None = None  # the source the call that pulled was passed

    @property
    def refused(self) -> int:
        """Items refused before the first batch (of the source they came from)."""
        return self._refused[1] if self._refused is not None else 0

    def waits(self, source: Source) -> bool:
        """Whether a batch of ``source`` (kept, or being pulled), or a refusal of its
        items, waits for the next bootstrap: it seeds the engine even on a model that
        another pipeline has traced since."""
        return self._kept is not None or bool(self.refused_from(source)) or self._pulling(source)

    def refused_from(self, source: Source) -> int:
        """First items of ``source`` refused before the engine existed."""
        return self._refused[1] if self._refused and self._refused[0] is source else 0

    async def take(self, source: Source, passed: Source | None) -> Any:
        """``source``'s first batch: the one a failed bootstrap kept, or a new one
        (``passed``: the source the caller passed, whose counts ``reset()`` keeps)."""
        if self._kept is not None:
            kept_source, batch = self._kept
            if kept_source is not source:
                raise PipelineStateError(
                    "a batch taken from the previous source is still waiting for its "
                    "step: pass that source again, or reset() to drop the batch"
                )
            return batch
        pull = self._pull
        if pull is None or pull[0] is not source:
            self.drop_other_pull()
            pull = self._pull = (source, Feed(source, read_ahead=False))
            self._passed = passed
        batch, _ = await pull[1].take()  # pulled in a task: a cancelled caller loses nothing
        self._pull = None
        if batch is END:
            raise StopAsyncIteration
        try:
            self._check_batch(batch)
        except (TypeError, ValueError) as exc:  # nothing in flight yet: nothing else lost
            self._refused = (source, self.refused_from(source) + 1)
            raise BadBatchError(f"the source's first batch was refused: {exc}") from exc
        self._kept = (source, batch)
        return batch

    def taken_of(self, passed: Source | None) -> int:
        """The items of the source ``passed`` that were taken and are held here: the
        kept first batch, or the one a pull left running has read."""
        if passed is None or self._passed is not passed:
            return 0
        pulled = self._pull[1].read_ahead_items if self._pull is not None else 0
        return (self._kept is not None) + pulled

    def trained(self) -> None:
        """The engine is built and seeded: nothing waits any more."""
        self._kept = self._refused = None

    def drop(self) -> None:
        """``reset()`` or shutdown: forget the batch and the refusals, and cancel a pull
        left running (an async generator that finishes is lost, said so when passed
        again)."""
        self.trained()
        self.drop_pull()

    def drop_pull(self) -> None:
        if self._pull is not None:
            self._pull[1].close(FIRST_READ_DROPPED)
            self._pull = None

    def drop_other_pull(self) -> None:
        """Another source is passed: drop the pull a cancelled bootstrap left, counting
        the batch it took, if any, as discarded (as aiopipe's own pipelines count a
        batch read ahead of a source left for another)."""
        taken = self._pull[1].read_ahead_items if self._pull is not None else 0
        self.drop_pull()
        if taken:
            self._discard(taken)

    def _pulling(self, source: Source) -> bool:
        return self._pull is not None and self._pull[0] is source
