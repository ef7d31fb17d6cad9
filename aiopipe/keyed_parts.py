"""The parts of :mod:`aiopipe.keyed` around its window: its statistics, one entry of
the window, the checks of ``fetch``, a key pulled from async keys (and the callback
that takes it), and the futures ``fetch_ahead`` settles, cancels or reads."""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ._core.waker import mark_retrieved
from .errors import AsyncLibraryError, ConfigurationTypeError
from .interop import in_trio
from .sources import END, finished_generator

__all__ = (
    "CLOSED", "NO_KEY", "Entry", "NotAwaitable", "asyncio_loop", "cancel_quietly", "check_fetch",
    "FetchStatistics", "close_coroutine_result", "fetch_interrupted", "next_key",
    "notify_when_pulled", "settled",
)  # fmt: skip


@dataclass(frozen=True)
class FetchStatistics:
    """Where a :class:`FetchAhead` stands in its keys.

    ``in_flight`` counts the fetches started whose batch (or error) has not been
    handed out yet, ``ready`` of them finished; ``delivered`` and ``failed`` count the
    batches and the :class:`~aiopipe.FetchError` handed out (and the refusal of a
    ``fetch`` that returned no awaitable), so ``keys_taken == in_flight + delivered +
    failed`` until the source is closed (which drops the fetches in flight)."""

    keys_taken: int
    in_flight: int
    ready: int
    delivered: int
    failed: int
    exhausted: bool
    closed: bool


class Entry:
    """One place in the window: a key's fetch, or (``index`` None) an error of the
    keys themselves, raised unchanged in its turn."""

    __slots__ = ("future", "index", "key")

    def __init__(self, index: int | None, key: Any, future: asyncio.Future[Any]) -> None:
        self.index, self.key, self.future = index, key, future


#: What :func:`next_key` gives for a generator of keys closed before the pull began
#: (not its end: a closed generator answers every pull with ``StopAsyncIteration``).
CLOSED: Any = object()


async def next_key(keys: AsyncIterator[Any]) -> Any:
    # A pull that a loop's shutdown let run after closing the generator (a pull
    # started as its cancelled tasks ended) would read the closure as the keys' end.
    if finished_generator(keys):
        return CLOSED
    try:
        # The generator's own step, not anext()'s wrapper: close_left finds it (a pull
        # left on a loop closed by hand).
        return await keys.__anext__()
    except StopAsyncIteration:
        return END


def asyncio_loop() -> asyncio.AbstractEventLoop:
    if asyncio._get_running_loop() is None and in_trio():
        raise AsyncLibraryError(
            "fetch_ahead() runs its fetches as asyncio tasks and was iterated from trio: "
            "under trio, start the fetches in a nursery and feed the pipeline from a "
            "memory channel (docs/anyio.md)"
        )
    return asyncio.get_running_loop()


def check_fetch(fetch: object) -> None:
    if inspect.isawaitable(fetch):
        if inspect.iscoroutine(fetch):
            fetch.close()  # never to be awaited: no "never awaited" warning after this
        raise ConfigurationTypeError(
            f"fetch_ahead() takes the fetch function, got {type(fetch).__name__} (the "
            f"result of calling it): pass fetch, not fetch(key)"
        )
    generator = inspect.isgeneratorfunction(fetch) or inspect.isasyncgenfunction(fetch)
    if not callable(fetch) or generator:
        raise ConfigurationTypeError(
            f"fetch_ahead() takes an 'async def fetch(key)' returning one batch, got {fetch!r}"
        )


NO_KEY = object()


class NotAwaitable(ConfigurationTypeError):
    """``fetch`` is a plain function: every key would fail the same way."""


def settled(problem: BaseException) -> asyncio.Future[Any]:
    future = asyncio.get_running_loop().create_future()
    future.set_exception(problem)
    return future


def cancel_quietly(future: asyncio.Future[Any]) -> None:
    future.add_done_callback(mark_retrieved)
    future.cancel()


def fetch_interrupted(entry: Entry) -> bool:
    """Whether ``entry``'s fetch ended with ``KeyboardInterrupt`` or ``SystemExit``
    (the two asyncio raises out of the loop; any other error is the fetch's failure)."""
    future = entry.future
    if entry.index is None or future.cancelled():
        return False
    return isinstance(future.exception(), (KeyboardInterrupt, SystemExit))


def close_coroutine_result(future: asyncio.Future[Any]) -> None:
    """Close the coroutine a fetch returned as its batch (``return get(key)``)."""
    if not future.cancelled() and future.exception() is None:
        result = future.result()
        if inspect.iscoroutine(result):
            result.close()


def notify_when_pulled(owner: weakref.ref[Any]) -> Callable[[asyncio.Future[Any]], None]:
    """The done-callback of a key pull: the :class:`~aiopipe.keyed.FetchAhead` (held
    weakly: a pending pull must not keep a dropped source alive) takes the key and
    starts its fetch."""
    def arrived(pull: asyncio.Future[Any]) -> None:
        me = owner()
        if me is not None:
            me._key_arrived(pull)
            if not pull.cancelled():  # (a loop shutting down must start no task)
                me._refill()

    return arrived
