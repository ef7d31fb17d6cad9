"""Opt-in check that every rank issues the same collective ticket sequence.

Two ranks issuing same-shaped collectives in swapped order get wrong numbers without
any error (and differently shaped ones deadlock).  With the check on, each rank keeps
a digest of the ticket sequences it issued; every ``every`` iterations the ranks
compare digests over a dedicated gloo group (so the check never interleaves with the
pipeline's own collectives) and fail loudly at the first divergence.
"""

from __future__ import annotations

import asyncio
import hashlib
from datetime import timedelta
from typing import Any

from ..errors import CollectiveOrderError, ConfigurationError, PipelineStateError

__all__ = ("CollectiveOrderCheck",)


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
        self._history: list[tuple[int, tuple[str, ...]]] = []
        self._count = 0

    async def record_and_check(self, iteration: int, names: list[str]) -> None:
        entry = (iteration, tuple(names))
        self._digest.update(repr(entry).encode())
        self._history.append(entry)
        self._count += 1
        if self._count % self._every == 0:
            await asyncio.to_thread(self._compare)

    def _process_group(self) -> Any:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise PipelineStateError(
                "check_collective_order needs torch.distributed to be initialised"
            )
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group

    def _compare(self) -> None:
        import torch.distributed as dist

        group = self._process_group()
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (self._digest.hexdigest(), self._history), group=group)
        history, self._history = self._history, []
        if len({digest for digest, _ in gathered}) == 1:
            return
        for position, entry in enumerate(history):
            seen = {rank: h[position] if position < len(h) else None for rank, (_, h) in enumerate(gathered)}
            if len(set(seen.values())) > 1:
                lines = "\n".join(f"  rank {rank}: {value}" for rank, value in seen.items())
                raise CollectiveOrderError(
                    f"ranks issued different collective sequences at iteration {entry[0]}:\n"
                    f"{lines}\nEvery rank must run the same schedule with the same "
                    f"nccl=True tasks and the same number of batches."
                )
        raise CollectiveOrderError("ranks issued different collective sequences before this window")
