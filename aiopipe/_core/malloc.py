"""Keep freed host memory in the process instead of handing it back to the kernel.

torch's CPU tensors come from the C library's ``malloc``.  glibc serves large blocks
with ``mmap`` and trims the heap's free top, with thresholds that move as blocks are
freed, so a training step that allocates and frees the same tensors every step keeps
returning pages and faulting them in again: 270-1900 minor page faults a step on the
HSTU demo, depending on the loop (docs/performance.md).  With several busy threads
each fault can also wait for the address-space lock that another thread holds while
it unmaps, so lane threads pay the most.  :func:`keep_freed_memory`
fixes the thresholds: blocks below 32 MiB come from the heap, and up to 1 GiB of free
heap stays mapped, so the pages of one step are reused by the next.  The resident size
then stays at its peak, as with torch's CUDA caching allocator.

Applied once per process by the first pipeline that runs work on lane threads
(``AsyncExecutor``), on Linux with glibc only.  A process that chose its own malloc
settings (glibc's ``MALLOC_*_`` variables or ``GLIBC_TUNABLES``) is left alone, and
``AIOPIPE_KEEP_FREED_MEMORY=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

__all__ = ("keep_freed_memory",)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
_OWN_CHOICE = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
               "GLIBC_TUNABLES")  # fmt: skip
OPT_OUT = "AIOPIPE_KEEP_FREED_MEMORY"

_lock = threading.Lock()
_applied: bool | None = None  # None: not decided yet in this process


def keep_freed_memory() -> bool:
    """Fix glibc's malloc thresholds for this process (once); whether they are set."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if os.environ.get(OPT_OUT, "1") == "0" or any(name in os.environ for name in _OWN_CHOICE):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(mallopt(parameter, value) == 1 for parameter, value in _SETTINGS)
