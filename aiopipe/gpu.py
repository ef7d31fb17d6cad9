"""Awaiting device work from the event loop without blocking it.

``Event.query()`` costs about a microsecond and holds the GIL only that long, so a
short wait is polled inline with exponential back-off; pushing each query through an
executor would cost far more than it saves.  A wait that outlasts ``handoff_after``
seconds moves to a waiter thread blocked in ``synchronize()``, which wakes the loop
through a ``LoopWaker``.  On CPU (``event is None``, CPU tensors) both helpers
return at once.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch

from ._core.waker import LoopWaker
from .interop import running_loop
from .streams import EventLike

__all__ = ("copy_to_host", "wait_for_event")


async def wait_for_event(
    event: EventLike | None,
    *,
    first_poll_s: float = 20e-6,
    max_poll_s: float = 2e-3,
    handoff_after_s: float = 0.05,
) -> None:
    """Return once ``event`` has completed (``None`` counts as complete).

    The loop polls ``event.query()`` first after ``first_poll_s``, doubling the
    interval up to ``max_poll_s``; work still running after ``handoff_after_s`` is
    waited for by a helper thread in ``event.synchronize()``, which wakes the loop.
    """
    loop = running_loop("aiopipe.wait_for_event")  # asyncio only: a clear error on trio
    if event is None or event.query():
        return
    deadline = loop.time() + handoff_after_s
    delay = first_poll_s
    while loop.time() < deadline:
        await asyncio.sleep(delay)
        if event.query():
            return
        delay = min(delay * 2, max_poll_s)
    future: asyncio.Future[None] = loop.create_future()
    waker = LoopWaker(loop)

    def wait() -> None:
        try:
            event.synchronize()
        except BaseException as exc:
            waker.resolve(future, exc)
        else:
            waker.resolve(future)

    threading.Thread(target=wait, name="aiopipe-gpu-wait", daemon=True).start()
    await future


async def copy_to_host(tensor: torch.Tensor, *, stream: Any = None) -> torch.Tensor:
    """The value of ``tensor`` on the host, awaited without blocking the loop.

    The device-to-host copy is queued on ``stream`` (default: the device's current
    stream, which must already be ordered after the work producing ``tensor``) into
    pinned memory; the coroutine resumes once it has landed.  CPU tensors come back
    as they are.
    """
    if tensor.device.type != "cuda":
        return tensor
    stream = stream if stream is not None else torch.cuda.current_stream(tensor.device)
    with torch.cuda.stream(stream):
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
    tensor.record_stream(stream)
    await wait_for_event(event)
    return host
