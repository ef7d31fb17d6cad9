"""Opt-in check that every rank issues the same collectives in the same order.

Two ranks issuing same-shaped collectives in swapped order get wrong numbers without
any error (and differently shaped ones deadlock or fail).  With the check on, each
rank records, per iteration, the batches the iteration works on and the ``nccl=True``
tasks it is about to run, in ticket order.  Before every ``every``-th iteration
issues any collective, the ranks compare what they recorded since the last
comparison over a dedicated gloo group (so the check never interleaves with the
pipeline's own collectives), and fail at the first divergence.

Comparing *before* the iteration runs is what makes ``every=1`` catch a divergence
before a single mismatched collective is issued: ranks running different schedules,
and ranks whose sources hold different numbers of batches (the rank whose source
ended has no new batch in the next iteration, so fewer tasks fire there).
"""

from __future__ import annotations

import asyncio
import hashlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..errors import CollectiveOrderError, ConfigurationError, PipelineStateError

if TYPE_CHECKING:
    from .base import Iteration

__all__ = ("CollectiveOrderCheck",)

#: One iteration as the ranks compare it: its number, the first and last batch it
#: works on (``None``: none, as in an iteration with no task to run), and the names
#: of its ``nccl=True`` tasks in ticket order.
Entry = tuple[int, "tuple[int, int] | None", tuple[str, ...]]


class CollectiveOrderCheck:
    def __init__(self, every: int, process_group: Any = None, timeout_s: float = 300.0) -> None:
        if every < 1:
            raise ConfigurationError(
                f"check_collective_order must be >= 1 (iterations), got {every}"
            )
        self._every = every
        self._group = process_group
        self._timeout = timedelta(seconds=timeout_s)
        self._digest = hashlib.sha256()
        self._history: list[Entry] = []
        self._count = 0

    async def check_before(self, iteration: Iteration) -> None:
        """Record ``iteration`` and, on every ``every``-th one, compare with the other
        ranks; called before the iteration issues any collective."""
        plan, active = iteration.plan, iteration.active.all
        batches = [iteration.batch_index(i) for i in active]
        entry: Entry = (
            iteration.number,
            (min(batches), max(batches)) if batches else None,
            tuple(plan.order[i].name for i in active if plan.nccl[i]),
        )
        self._digest.update(repr(entry).encode())
        self._history.append(entry)
        self._count += 1
        if self._count % self._every == 0:
            await asyncio.to_thread(self._compare, iteration.number)

    def _process_group(self) -> Any:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise PipelineStateError(
                "check_collective_order needs torch.distributed to be initialised"
            )
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group

    def _compare(self, number: int) -> None:
        import torch.distributed as dist

        group = self._process_group()
        gathered: list[Any] = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(gathered, (self._digest.hexdigest(), self._history), group=group)
        except RuntimeError as exc:  # a rank left, or never came: its source may have ended
            raise CollectiveOrderError(
                f"the collective order check before iteration {number} could not reach "
                f"every rank ({exc}); a rank that ran out of batches, or failed, may have "
                f"left. Every rank must run the same number of batches."
            ) from exc
        history, self._history = self._history, []
        if len({digest for digest, _ in gathered}) == 1:
            return
        histories = [h for _, h in gathered]
        for position, entry in enumerate(history):
            seen = [h[position] if position < len(h) else None for h in histories]
            if any(other != entry for other in seen):
                raise CollectiveOrderError(_describe(entry[0], seen))
        raise CollectiveOrderError("ranks issued different collective sequences before this window")


def _describe(number: int, seen: list[Entry | None]) -> str:
    """The message for the first iteration where the ranks' entries differ."""
    lines = []
    numbered = len({entry[0] for entry in seen if entry is not None}) > 1
    for rank, entry in enumerate(seen):
        if entry is None:
            lines.append(f"  rank {rank}: no such iteration")
            continue
        iteration, batches, names = entry
        if batches is None:
            span = "no batch"
        elif batches[0] == batches[1]:
            span = f"batch {batches[0]}"
        else:
            span = f"batches {batches[0]}-{batches[1]}"
        where = f"iteration {iteration}, " if numbered else ""
        lines.append(f"  rank {rank}: {where}{span}, collectives {names}")
    spans = {entry[:2] for entry in seen if entry is not None}
    why = (
        "The ranks are on different batches: their sources hold different numbers of "
        "batches (or their schedules differ). Every rank must run the same schedule on "
        "the same number of batches." if len(spans) > 1 else
        "Every rank must run the same schedule with the same nccl=True tasks."
    )  # fmt: skip
    return f"ranks are about to issue different collectives at iteration {number}:\n" + (
        "\n".join(lines) + f"\n{why}"
    )
