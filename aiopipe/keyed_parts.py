"""The parts of :mod:`aiopipe.keyed` around its window: one entry of the window, the
checks of ``fetch``, a key pulled from async keys, and the futures ``fetch_ahead``
settles or cancels."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any

from ._core.waker import mark_retrieved
from .errors import AsyncLibraryError, ConfigurationTypeError
from .interop import in_trio
from .sources import END

__all__ = (
    "NO_KEY", "Entry", "NotAwaitable", "asyncio_loop", "cancel_quietly", "check_fetch",
    "next_key", "settled",
)  # fmt: skip


class Entry:
    """One place in the window: a key's fetch, or (``index`` None) an error of the
    keys themselves, raised unchanged in its turn."""

    __slots__ = ("future", "index", "key")

    def __init__(self, index: int | None, key: Any, future: asyncio.Future[Any]) -> None:
        self.index, self.key, self.future = index, key, future


async def next_key(keys: AsyncIterator[Any]) -> Any:
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
