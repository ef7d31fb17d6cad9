"""An async source whose every fetch waits at a gate the test opens: the test then
knows which fetches have started, and what the pipeline had placed in its ring when
each did."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiopipe import Pipeline


class GatedSource:
    """``n`` items; item ``k`` is fetched once ``gates[k]`` is set (``open(k)``)."""

    def __init__(self, n: int, pipe: Pipeline | None = None) -> None:
        self.started = [asyncio.Event() for _ in range(n)]
        self.gates = [asyncio.Event() for _ in range(n)]
        #: For each fetch started, ``pipe.statistics().pulled`` at its start.
        self.placed_when_fetching: dict[int, int] = {}
        self._pipe = pipe
        self.items = self._items()

    def open(self, *ks: int) -> None:
        for k in ks:
            self.gates[k].set()

    async def _items(self) -> AsyncIterator[int]:
        for k in range(len(self.gates)):
            if self._pipe is not None:
                self.placed_when_fetching[k] = self._pipe.statistics().pulled
            self.started[k].set()
            await self.gates[k].wait()
            yield k
