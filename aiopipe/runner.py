"""``aiopipe.run``: ``asyncio.run`` on uvloop when it is installed.

``AIOPIPE_UVLOOP=0`` opts out.  Ctrl-C cancels the running coroutine -- so the
pipeline releases its lanes and tickets -- and then raises ``KeyboardInterrupt``, as
``asyncio.run`` does.  The loop itself is :class:`aiopipe._core.loops.LoopRunner`.
"""

from __future__ import annotations

import inspect
from collections.abc import Coroutine
from typing import Any, TypeVar

from ._core.loops import LoopRunner
from .errors import ConfigurationTypeError, PipelineStateError

__all__ = ("run",)

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Like ``asyncio.run(main)``, on uvloop when installed."""
    given: object = main  # checked at run time: callers pass anything
    if not inspect.isawaitable(given):
        called = " (call it: aiopipe.run(main()))" if inspect.iscoroutinefunction(given) else ""
        raise ConfigurationTypeError(f"aiopipe.run() takes a coroutine, got {given!r}{called}")

    async def wrapper() -> T:
        return await main

    with LoopRunner() as runner:
        try:
            return runner.run(wrapper)
        except PipelineStateError:
            main.close()  # never started: do not leave an un-awaited coroutine behind
            raise
