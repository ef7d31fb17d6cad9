"""The fire mask: which lookaheads run at which internal iteration.

At internal iteration ``i`` the store at ring offset ``k`` holds batch
``i - (L - k)`` (``L`` = max lookahead), so a lookahead-``k`` task fires iff that
batch exists: ``(L - k) <= i < M + (L - k)``, where ``M`` is the number of batches
pulled so far (the final count once the source is exhausted).  Iterations
``i < L`` are the prefill, ``i >= M`` the drain.
"""

from __future__ import annotations

__all__ = ("batch_index", "fires")


def batch_index(lookahead: int, iteration: int, max_lookahead: int) -> int:
    """The batch a lookahead-``lookahead`` task processes at ``iteration``."""
    return iteration - (max_lookahead - lookahead)


def fires(lookahead: int, iteration: int, max_lookahead: int, batches_known: int) -> bool:
    return 0 <= batch_index(lookahead, iteration, max_lookahead) < batches_known

