"""NVTX ranges around task bodies, when the ``nvtx`` package and a GPU are present.

A synchronous body runs inside a push/pop range on the thread that runs it, so a
profiler's timeline shows each lane's work on its own thread.  A coroutine body
interleaves with others on the loop thread, so it gets a start/end range instead
(push/pop ranges would mis-nest).  Without ``nvtx`` or CUDA the annotator resolves to
``None`` and executors skip it entirely (no per-task cost).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ("Annotator", "resolve_annotator")


class Annotator(Protocol):
    def push_pop(self, message: str) -> contextlib.AbstractContextManager[Any]:
        """A range around synchronous code on the current thread."""

    def start(self, message: str) -> Any:
        """Open a range that may span ``await`` points; returns a handle for ``end``."""

    def end(self, handle: Any) -> None: ...


class _NvtxAnnotator:
    def __init__(self) -> None:
        import nvtx

        self._nvtx = nvtx

    def push_pop(self, message: str) -> contextlib.AbstractContextManager[Any]:
        return self._nvtx.annotate(message=message, domain="aiopipe")  # type: ignore[no-any-return]

    def start(self, message: str) -> Any:
        return self._nvtx.start_range(message=message, domain="aiopipe")

    def end(self, handle: Any) -> None:
        self._nvtx.end_range(handle)


def _no_gpu() -> bool:
    return False


def resolve_annotator(
    enabled: bool | Annotator | None = None, *, gpu_present: Callable[[], bool] = _no_gpu
) -> Annotator | None:
    """``None``: on when ``nvtx`` imports and ``gpu_present()`` (the pipeline passes
    ``torch.cuda.is_available``; ``AIOPIPE_NVTX=0/1`` overrides); ``True``/``False``
    force it; an object with ``push_pop``/``start``/``end`` is used as the annotator."""
    if enabled is not None and not isinstance(enabled, bool):
        return enabled
    if enabled is None:
        env = os.environ.get("AIOPIPE_NVTX")
        enabled = env == "1" if env in ("0", "1") else gpu_present()
    if not enabled:
        return None
    try:
        return _NvtxAnnotator()
    except ImportError:
        return None
