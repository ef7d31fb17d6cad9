"""``PipelineStatistics``: where a pipeline stands in its current source."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ("PipelineStatistics",)


@dataclass(frozen=True)
class PipelineStatistics:
    """Where the pipeline stands in its current source.

    ``pulled`` counts the batches taken into the pipeline's ring (not those read
    ahead: ``in_flight`` counts those too), ``returned`` the results handed out.
    ``applied`` counts the batches whose step has run: those ``returned``, and those
    finished for a caller that was cancelled, whose results the next calls return
    first.  ``refused`` counts items refused with ``BadBatchError``.  ``position``
    counts the source's leading items done with -- applied, or refused with every
    batch before them applied: with no iteration running
    (:attr:`SchedulablePipeline.idle`), the position to resume a checkpointed run
    from.  (``applied + refused`` is that too, except while batches taken before a
    refused item are still in flight.)
    ``exhausted``: the source's end has been read (not after a ``drain()`` that stopped
    reading before it: passed again, that source goes on).
    ``discarded`` counts the batches dropped untrained since the pipeline was built,
    by ``reset()`` or because a ``results()`` loop was left early and another source
    came (not in the position: a run resumed from it reads them again).
    After ``drain()`` or ``reset()`` the counts are that source's; passed again, it
    counts on from them (another source, or the same one after a call was handed its
    end, from 0), also after other sources came between (``step()`` calls, an
    evaluation stream taking turns): the last few sources left before their end are
    remembered (a DataLoader's iterator that ``iter(loader)`` reset starts afresh).  After
    ``reset()`` its position then counts on past the batches ``reset()`` dropped
    (those read ahead too): that run skips them, and a run resumed from a later
    checkpoint must not train again the steps applied before them.

    ``read_ahead``: of ``in_flight``, the items the source gave that wait to be taken
    into the ring (a read still under way is in ``in_flight`` only: the source has
    not given its item); ``read_ahead_refused``: of those, the items ``check_batch``
    refused, raised when taken (dropped by a switch, they count in ``refused``, not
    in ``discarded``)."""

    pulled: int
    returned: int
    in_flight: int
    iteration: int
    exhausted: bool
    broken: str | None
    closed: bool
    refused: int = 0
    applied: int = 0
    discarded: int = 0
    position: int = 0
    read_ahead: int = 0
    read_ahead_refused: int = 0
