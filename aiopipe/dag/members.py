"""Running the members of one graph task (a plain task is a group of one).

Synchronous members are spread over lanes: member ``i`` runs on ``lanes[i % len(lanes)]``
(``None`` standing for inline on the loop), members that share a lane run in order, and
after a failure the members not yet started are skipped.  ``async def`` members run
concurrently on the loop; the first failure cancels the running siblings.  Either way
the task completes only when no member of it is still running, so nothing of a failed
group outlives the group (or the scope that waits for it).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._core.lanes import Lane, start_on_lane
from .._core.waker import LoopWaker
from ..task import refuse_awaitable

__all__ = ("MemberFailure", "run_async_members", "run_sync_members")

Call = tuple[Any, ...]


def _call_sync(fn: Callable[..., Any], call: Call, kwargs: dict[str, Any]) -> Any:
    """``fn(*call, **kwargs)``, refusing an awaitable (an ``async`` function hidden
    behind a plain one, a lambda say): run on a lane, it would never be awaited."""
    result = fn(*call, **kwargs)
    refuse_awaitable(result, lambda: (
        f"{getattr(fn, '__name__', fn)!r} returned an awaitable, so it ran as a plain "
        f"function on a lane; submit an 'async def' function (or an object whose "
        f"__call__ is one) to run it on the loop"
    ))  # fmt: skip
    return result


class MemberFailure(Exception):
    """Carries the first failing member's exception and index out of a run (internal:
    the graph re-raises ``error`` itself)."""

    def __init__(self, error: BaseException, member: int) -> None:
        super().__init__(member)
        self.error = error
        self.member = member


async def run_sync_members(
    waker: LoopWaker, fn: Callable[..., Any], calls: Sequence[Call], kwargs: dict[str, Any],
    lanes: Sequence[Lane | None],
) -> list[Any]:  # fmt: skip
    if len(calls) == 1:  # a plain task: nothing to share out
        try:
            if lanes[0] is None:
                return [_call_sync(fn, calls[0], kwargs)]
            work = functools.partial(_call_sync, fn, calls[0], kwargs)
            return [await start_on_lane(waker, lanes[0], work)]
        except Exception as exc:  # noqa: BLE001 - handed to the graph
            raise MemberFailure(exc, 0) from None
    results: list[Any] = [None] * len(calls)
    failures: list[MemberFailure] = []  # in the order the members failed
    halt = threading.Event()  # set by the first failure: skip members not yet started
    lock = threading.Lock()

    def run_share(members: list[int]) -> None:
        for member in members:
            if halt.is_set():
                return
            try:
                results[member] = _call_sync(fn, calls[member], kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the graph
                with lock:
                    failures.append(MemberFailure(exc, member))
                halt.set()
                return

    shares: dict[Lane | None, list[int]] = {}
    for member in range(len(calls)):
        shares.setdefault(lanes[member % len(lanes)], []).append(member)
    # Queue every lane's share before running the loop's own share inline, so the
    # lanes start at once rather than after it.
    started = [start_on_lane(waker, lane, functools.partial(run_share, members))
               for lane, members in shares.items() if lane is not None]  # fmt: skip
    try:
        if None in shares:
            run_share(shares[None])
        if started:
            await asyncio.gather(*started)
    except BaseException:  # cancelled: the lanes finish their current member only
        halt.set()
        raise
    if failures:
        raise failures[0]
    return results


async def run_async_members(
    fn: Callable[..., Any], calls: Sequence[Call], kwargs: dict[str, Any]
) -> list[Any]:
    if len(calls) == 1:
        try:
            return [await fn(*calls[0], **kwargs)]
        except Exception as exc:  # noqa: BLE001 - handed to the graph
            raise MemberFailure(exc, 0) from None
    members = [asyncio.ensure_future(fn(*call, **kwargs)) for call in calls]
    index = {task: member for member, task in enumerate(members)}
    failures: list[MemberFailure] = []  # done callbacks run in completion order

    def record(task: asyncio.Future[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            failures.append(MemberFailure(task.exception(), index[task]))  # type: ignore[arg-type]

    for task in members:
        task.add_done_callback(record)
    try:
        await asyncio.wait(members, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # a failure, or this task cancelled: the siblings go, and are awaited
        running = [task for task in members if not task.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
    if failures:
        raise failures[0]
    return [task.result() for task in members]
