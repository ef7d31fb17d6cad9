"""``SlotStore`` and ``BatchRing``: how batches and their values travel across
iterations.

The ring holds one slot store per batch in flight.  ``at(k)`` is the store of the
batch that lookahead-``k`` tasks process in the current iteration; ``advance()``
drops offset 0, shifts every store down by one and opens an empty store at the top,
so values move from producer to consumer without copies.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .errors import ConfigurationError, SlotNotSetError

if TYPE_CHECKING:
    from .streams import StreamPool

__all__ = ("BatchRing", "RetiredStores", "SlotStore")

_MISSING = object()


class SlotStore:
    """The named values (and recorded producer events) of one batch."""

    __slots__ = ("_events", "_values", "batch_index")

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}
        self._events: dict[str, Any] = {}
        #: Index of this batch in the current source (``None`` for an empty store).
        self.batch_index: int | None = None

    def __getitem__(self, name: str) -> Any:
        value = self._values.get(name, _MISSING)
        if value is _MISSING:
            raise SlotNotSetError(name, self.batch_index, sorted(self._values))
        return value

    def get(self, name: str, default: Any = None) -> Any:
        return self._values.get(name, default)

    def set(self, name: str, value: Any) -> None:
        self._values[name] = value

    def __setitem__(self, name: str, value: Any) -> None:
        # Reads are ctx.slots[name]; a write by the same spelling says what to call.
        raise TypeError(
            f"slots are written with ctx.slots.set({name!r}, value), not ctx.slots[{name!r}] = "
            f"value"
        )

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def record_event(self, producer: str, event: Any) -> None:
        """Remember ``producer``'s completion event for this batch."""
        self._events[producer] = event

    def event_of(self, producer: str) -> Any:
        """``producer``'s event for this batch, or ``None`` if it never recorded one."""
        return self._events.get(producer)

    def __repr__(self) -> str:
        return f"<SlotStore batch={self.batch_index} slots={sorted(self._values)}>"


class BatchRing:
    """``depth`` slot stores, offset 0 = the oldest batch in flight."""

    __slots__ = ("_stores",)

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ConfigurationError(f"BatchRing depth must be >= 1, got {depth}")
        self._stores = [SlotStore() for _ in range(depth)]

    @property
    def depth(self) -> int:
        return len(self._stores)

    def at(self, offset: int) -> SlotStore:
        if not 0 <= offset < len(self._stores):
            raise IndexError(f"ring offset {offset} outside 0..{len(self._stores) - 1}")
        return self._stores[offset]

    @property
    def top(self) -> SlotStore:
        """The store new batches are pulled into (offset ``depth - 1``)."""
        return self._stores[-1]

    def advance(self, top: SlotStore | None = None) -> SlotStore:
        """Drop offset 0, shift the rest down, open ``top`` (default: an empty store) at
        the top; return the dropped store."""
        evicted = self._stores.pop(0)
        self._stores.append(SlotStore() if top is None else top)
        return evicted

    def advanced(self, top: SlotStore) -> BatchRing:
        """The ring as :meth:`advance` with ``top`` will leave it, leaving this one as it
        is: what an iteration queued behind the running one works on."""
        view = BatchRing.__new__(BatchRing)
        view._stores = [*self._stores[1:], top]
        return view

    def reset(self) -> list[SlotStore]:
        """Empty every store; return the old ones (they may still be referenced by
        device work, see ``SchedulablePipeline``)."""
        old = self._stores
        self._stores = [SlotStore() for _ in range(len(old))]
        return old

    def __repr__(self) -> str:
        return f"BatchRing({[s.batch_index for s in self._stores]})"


class RetiredStores:
    """Slot stores evicted from the ring, still referenced until the device work
    queued when they left has completed (another stream may still read their
    tensors), and, unless the next step was chained behind it, for one loop cycle
    after their iteration ended (:meth:`free_soon`)."""

    def __init__(self, stream_pool: StreamPool) -> None:
        self._pool = stream_pool
        self._stores: collections.deque[tuple[SlotStore, list[Any]]] = collections.deque()

    def add(self, store: SlotStore) -> None:
        pool = self._pool
        events = [] if pool.is_null else [pool.record_event(name) for name in pool.names()]
        self._stores.append((store, events))

    def add_all(self, stores: list[SlotStore]) -> None:
        """Retire every store of a ring just reset, and free what can be freed now."""
        for store in stores:
            self.add(store)
        self.free()

    def free_soon(self) -> None:
        """Free what the iteration that just ended evicted one loop cycle later: after
        its caller has run on, usually to the next hand-off.  Freeing a batch's
        tensors took 20-30 us of the loop's time between two steps
        (docs/performance.md)."""
        asyncio.get_running_loop().call_soon(self.free)

    def free(self) -> None:
        """Drop the stores whose device work has completed, oldest first."""
        stores = self._stores
        while stores and all(ev is None or ev.query() for ev in stores[0][1]):
            stores.popleft()

    def clear(self) -> None:
        self._stores.clear()

    def __len__(self) -> int:
        return len(self._stores)
