"""Keep torch's CPU intra-op threads at full speed when compute runs on lane threads.

torch's CPU wheels run intra-op parallelism on GNU OpenMP (libgomp), which keeps one
worker pool *per thread that opened a parallel region*.  Between regions a worker
spins briefly before sleeping -- unless libgomp counts more pool threads than CPUs,
in which case it sleeps at once, and every later region pays a futex wake-up per
worker.  The event-loop thread usually owns a pool from building the model; once
compute moves to a lane thread, the lane's pool pushes the count over the CPU count
and a many-small-op model ran at half speed on 2 cores (docs/performance.md).

:func:`release_thread_pool` hands the calling thread's idle pool back
(``omp_pause_resource_all``, which frees only the caller's pool), so the lane's
workers spin again.  A later parallel region on that thread simply builds a new pool.
Elsewhere (another OpenMP runtime, torch's native pool, no OpenMP) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

__all__ = ("release_thread_pool",)

_OMP_PAUSE_SOFT = 1


@functools.lru_cache(maxsize=1)
def _pause_function() -> Callable[[int], int] | None:
    """libgomp's ``omp_pause_resource_all``, when libgomp is loaded (torch's CPU
    wheels load it for their OpenMP backend; with another backend, pausing the
    caller's idle libgomp pool, if any, is still harmless)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            function = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # an older libgomp without OpenMP 5 pauses
            continue
        function.argtypes = [ctypes.c_int]
        function.restype = ctypes.c_int
        return function
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's idle OpenMP worker pool; whether that is supported
    here.  Cheap (about a microsecond) when the thread has no pool.  Never call it
    from inside a parallel region (libgomp refuses, harmlessly)."""
    pause = _pause_function()
    if pause is None:
        return False
    pause(_OMP_PAUSE_SOFT)
    return True
