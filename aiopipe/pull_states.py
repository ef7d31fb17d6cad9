"""What a pull (a future read ahead from a source) holds: an item, the source's end
or error, ``check_batch``'s refusal, an interrupt -- asked by
:class:`~aiopipe.pulls.Pulls` and :class:`~aiopipe.source.Feed`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .sources import END

__all__ = (
    "RECHECK", "always_wanted", "gave_an_item", "holds_an_item", "interrupted_pull", "problem_of",
    "refused_item",
)  # fmt: skip

#: The "problem" of an item an interrupted ``check_batch`` kept: check it again.
RECHECK: Any = object()


def interrupted_pull(future: asyncio.Future[Any]) -> bool:
    """Whether ``future``, a pull, ended with ``KeyboardInterrupt`` or ``SystemExit``."""
    return (future.done() and not future.cancelled()
            and isinstance(future.exception(), (KeyboardInterrupt, SystemExit)))  # fmt: skip


def always_wanted() -> bool:
    """The item a caller waits for is wanted (no cancelled caller to ask)."""
    return True


def holds_an_item(future: asyncio.Future[Any] | None) -> bool:
    """Whether ``future`` (a read ahead) holds, or will hold, an item of the source: a
    pull under way or cancelled (read again) does; the source's error, or its end,
    does not (no batch is in flight behind it, none is dropped with it)."""
    if future is None:
        return False
    if not future.done() or future.cancelled():
        return True
    return future.exception() is None and future.result()[0] is not END


def refused_item(pull: asyncio.Future[Any]) -> bool:
    """Whether ``pull``, which gave an item, holds ``check_batch``'s refusal of it."""
    problem = pull.result()[1]
    return problem is not None and problem is not RECHECK


def gave_an_item(future: asyncio.Future[Any] | None) -> bool:
    """Whether ``future`` is a finished read ahead that took an item from the source."""
    return future is not None and future.done() and not future.cancelled() and holds_an_item(future)


def problem_of(check_batch: Callable[[Any], object] | None, batch: Any) -> BaseException | None:
    """Why ``batch`` must be refused, if it must: ``check_batch`` raised, or (written
    as a predicate) returned ``False``.  Runs when the batch is read (ahead, while an
    iteration runs), not on the critical path into the ring."""
    if check_batch is not None:
        try:
            verdict = check_batch(batch)
        except Exception as exc:
            return exc
        if verdict is False:
            return ValueError("check_batch returned False")
    return None
