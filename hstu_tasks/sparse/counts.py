"""``CountsAcrossResets``: a source's counts kept across the engines ``reset()`` tears
down, while the same source goes on."""

from __future__ import annotations

import dataclasses

from aiopipe import PipelineStatistics
from aiopipe.sources import Source

__all__ = ("CountsAcrossResets",)


class CountsAcrossResets:
    """``reset()`` tears a sparse pipeline's engine down, and the next engine counts
    from 0.  As after aiopipe's own ``reset()``, ``statistics()`` shows the torn-down
    engine's counts until a call passes a source; if that is the same source, it
    counts on from them, its position past the batches ``reset()`` dropped (that run
    skips them, those read ahead included): a checkpoint taken later resumes after
    every step trained, none twice.  ``discarded`` counts on whatever source comes."""

    def __init__(self) -> None:
        self._source: Source | None = None  # the source the last call passed
        self._parked: PipelineStatistics | None = None  # shown until a call passes one
        self._carried: tuple[Source, PipelineStatistics] | None = None
        self._goes_on = False  # a call passed the carried source again
        self._ended = False  # a call reported the end of the source the last call passed
        # Batches dropped untrained by the engines torn down and by bootstraps: like
        # aiopipe's own ``discarded``, counted since the pipeline was built.
        self._discarded = 0

    def passed(self, source: Source) -> None:
        """A call passed ``source``: counts carried for another source are dropped."""
        carried = self._carried
        if carried is not None and carried[0] is not source:
            self._carried = None
        self._goes_on = carried is not None and carried[0] is source
        self._ended = False  # a call on the source after its end reported: a new pass
        self._parked, self._source = None, source

    def engine_gone(self, stats: PipelineStatistics) -> None:
        """The engine whose statistics are ``stats`` is shut down (``detach()``,
        ``shutdown()``): ``statistics()`` shows its counts, and the same source passed
        again counts on from them, as after ``reset()`` (which counted them already)."""
        if self._parked is None:
            self.reset(stats)

    def end_reported(self) -> None:
        """A call reported the end of the source it was passed."""
        self._ended = True

    def discard(self, dropped: int) -> None:
        """A bootstrap dropped ``dropped`` items a cancelled one had taken of another
        source, untrained."""
        self._discarded += dropped

    @property
    def source(self) -> Source | None:
        """The source the last call passed."""
        return self._source

    def batches_before(self) -> int:
        """The batches the source going on gave the engines torn down (0 when none
        goes on): the next engine numbers its batches on from there."""
        if not self._goes_on or self._carried is None:
            return 0
        before = self._carried[1]
        return before.position - before.refused

    def reset(self, stats: PipelineStatistics, wrapped: int = 0) -> None:
        """``reset()`` tears down the engine whose statistics, after its own reset (its
        ring empty; ``read_ahead`` the items it read ahead, dropped with it; a read
        under way gave none), are ``stats`` -- with no engine since the last reset,
        the pipeline's own, ``read_ahead`` what its bootstrap took; ``wrapped`` items
        of the source, read by its wrapper and never handed to the engine, are
        dropped too."""
        # What the torn-down engine still held is dropped with it: discarded, not in
        # flight (drain() has nothing of it to return); an item check_batch refused is
        # counted as refused, as a switch in aiopipe's own pipelines counts it.
        total, held = self.shown(stats), stats.read_ahead + wrapped
        refused = stats.read_ahead_refused
        total = dataclasses.replace(
            total, in_flight=0, read_ahead=0, read_ahead_refused=0,
            discarded=total.discarded + held - refused, refused=total.refused + refused,
        )  # fmt: skip
        self._discarded = total.discarded
        self._parked, self._goes_on, self._carried = total, False, None
        if self._source is None or self._ended:
            return  # passed again after its end was reported, a source starts afresh
        # (an end only read ahead is still to come: the source goes on, to its end)
        past = total.position - stats.position + stats.pulled + stats.refused + held
        self._carried = (self._source, dataclasses.replace(total, position=past))

    def shown(self, stats: PipelineStatistics) -> PipelineStatistics:
        """What ``statistics()`` shows: ``stats`` (the engine's, or a fresh pipeline's),
        with the counts carried for the source going on; right after a reset, the
        torn-down engine's."""
        if self._parked is not None:
            return dataclasses.replace(self._parked, closed=stats.closed)
        discarded = self._discarded + stats.discarded
        if not self._goes_on or self._carried is None:
            return dataclasses.replace(stats, discarded=discarded)
        before = self._carried[1]
        return dataclasses.replace(
            stats, pulled=before.pulled + stats.pulled, returned=before.returned + stats.returned,
            applied=before.applied + stats.applied, refused=before.refused + stats.refused,
            position=before.position + stats.position, discarded=discarded,
        )  # fmt: skip
