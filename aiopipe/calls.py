"""``CallGuard``: the one call at a time -- ``progress``, ``progress_many`` or ``drain``
-- that a pipeline runs, and what becomes of a call whose event loop was stopped and
closed while it waited (not cancelled first): it can never resume, so the next call
takes over instead of being refused for good."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Collection
from types import CodeType
from typing import Any

from ._core.log import pipeline_log
from ._core.loops import close_awaited
from .errors import PipelineStateError

__all__ = ("SLOW_CALL_S", "CallGuard")

#: How long closing waits for another task's call before it says so.
SLOW_CALL_S = 5.0


class CallGuard:
    """Which call of ``owner`` is under way: its loop and task.  ``codes``: the
    code of the owner's calls, looked for in a dead call's awaits."""

    __slots__ = ("_codes", "_ended", "_loop", "_name", "_owner", "_task")

    def __init__(self, name: str, owner: object, codes: Collection[CodeType]) -> None:
        self._name, self._codes = name, codes
        self._owner = weakref.ref(owner)  # (no cycle through the pipeline)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._ended: list[asyncio.Future[None]] = []  # wait_ended()'s, woken by end()

    def begin(self) -> asyncio.AbstractEventLoop:
        """Enter a call; refused while another is under way.  The token to end it."""
        if self.in_progress():
            raise PipelineStateError(
                "another call (progress(), progress_many(), drain() or step()) is already "
                "running on this pipeline; await it first"
            )
        self._loop = loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        return loop

    def end(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop:  # (always, bar a call left on a closed loop, closed late)
            self._loop = self._task = None
            waiters, self._ended = self._ended, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def wait_ended(self) -> bool:
        """Wait until the call under way, run by another task on this event loop, has
        ended; whether there was one to wait for.  ``False`` at once for none, for the
        caller's own call, and for a call on another loop (nothing to await here)."""
        if not self.in_progress():
            return False
        if self._task is asyncio.current_task() or self._loop is not asyncio.get_running_loop():
            return False
        waiter = asyncio.get_running_loop().create_future()
        self._ended.append(waiter)
        try:
            await asyncio.wait((waiter,), timeout=SLOW_CALL_S)
            if not waiter.done():  # it may wait for a source only the waiter's caller feeds
                pipeline_log.warning(
                    "%s: closing waits for a call another task has under way (%.0f s so "
                    "far); it may be waiting for its source. Cancel that task, or give "
                    "aclose() a timeout, to stop waiting", self._name, SLOW_CALL_S,
                )  # fmt: skip
                await waiter
        finally:
            if waiter in self._ended:  # cancelled: not woken
                self._ended.remove(waiter)
        return True

    def in_progress(self) -> bool:
        """A call is under way; not one whose event loop was stopped and closed while
        it waited, which the caller takes over."""
        loop, task = self._loop, self._task
        if loop is None:
            return False
        if not loop.is_closed():
            return True
        pipeline_log.warning("%s: a call was left waiting on an event loop that was closed; "
                             "the next call goes on from where it stopped", self._name)  # fmt: skip
        self._loop = self._task = None
        if task is not None:
            # Now, not whenever it is collected: its way out gives back what it had
            # collected and takes back the steps queued for it (collect.py, chain.py).
            close_awaited(task, self._codes, self._owner())
        return False
