"""Where a warning of the package should point: the user's line, not aiopipe's."""

from __future__ import annotations

import asyncio
import os
import sys
from types import FrameType

__all__ = ("user_stacklevel",)

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: The event loop's own frames, between a blocking call and the coroutine it runs.
_ASYNCIO = os.path.dirname(os.path.abspath(asyncio.__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the caller that names the first
    frame outside this package and asyncio: the user's line, through the awaits of a
    coroutine and the blocking form's event loop too."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith((_PACKAGE, _ASYNCIO)):
        frame, level = frame.f_back, level + 1
    return level
