"""``end_together``'s windowed agreement on two ranks, each rank a thread, the gloo
all-reduce replaced by one that meets the other rank's call of the same turn: which
items each rank hands on, where both stop, what a longer rank read beyond the end,
and what a source raising on one rank leaves on the other (tests/sparse_workers.py
runs the same wrappers on real gloo ranks, under every schedule)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from sparse_workers import read_by_the_end

from aiopipe import PipelineStateError
from hstu_tasks.sparse.agreement import WINDOW, EndedTogether


class _Turn:
    """One all-reduce of two ranks: each rank's flag, and both set to the minimum once
    the second arrives."""

    def __init__(self) -> None:
        self.flags: list[torch.Tensor] = []
        self.met = threading.Event()


class _Work:
    def __init__(self, turn: _Turn) -> None:
        self._turn = turn

    def wait(self) -> bool:
        assert self._turn.met.wait(10), "the other rank never made its call of this turn"
        return True

    def is_completed(self) -> bool:
        return self._turn.met.is_set()


class TwoRanks:
    """The k-th all-reduce of one rank meets the k-th of the other."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._turns: list[_Turn] = []
        self._calls = [0, 0]

    def group(self, rank: int) -> Any:
        ranks = self

        class Group:
            def allreduce(self, tensors: list[torch.Tensor], options: Any) -> _Work:
                return ranks._allreduce(rank, tensors[0])

        return Group()

    def _allreduce(self, rank: int, flag: torch.Tensor) -> _Work:
        with self._lock:
            index = self._calls[rank]
            self._calls[rank] += 1
            if index == len(self._turns):
                self._turns.append(_Turn())
            turn = self._turns[index]
            turn.flags.append(flag)
            if len(turn.flags) == 2:
                low = min(int(f.item()) for f in turn.flags)
                for f in turn.flags:
                    f.fill_(low)
                turn.met.set()
        return _Work(turn)


class Items:
    """``count`` items; with ``raise_at``, ``next`` raises once there (the item is not
    lost: the next call gives it).  Counts what it gave."""

    def __init__(self, count: int, raise_at: int | None = None) -> None:
        self.count, self.raise_at, self.given = count, raise_at, 0

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self.given == self.raise_at:
            self.raise_at = None
            raise ValueError(f"no item {self.given}")
        if self.given == self.count:
            raise StopIteration
        self.given += 1
        return self.given - 1


def on_two_ranks(sources: tuple[Items, Items], calls: int | None = None) -> list[list[Any]]:
    """Each rank's wrapper read to its end (or ``calls`` times), each on a thread of
    its own: what each call gave -- an item, ``"end"``, or the error's type."""
    ranks, out = TwoRanks(), [[], []]  # type: ignore[var-annotated]

    def run(rank: int) -> None:
        wrapper = EndedTogether(sources[rank], ranks.group(rank))
        while calls is None or len(out[rank]) < calls:
            try:
                out[rank].append(next(wrapper))
            except StopIteration:
                out[rank].append("end")
                return
            except (ValueError, PipelineStateError) as exc:
                out[rank].append(type(exc).__name__)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()
    return out


@pytest.mark.parametrize("counts", [(10, 7), (20, 5), (40, 33), (0, 5), (1, 1), (31, 31),
                                    (3 * WINDOW, 100), (2, 0)])  # fmt: skip
def test_both_ranks_hand_on_the_shorter_ones_count_and_end_together(
    counts: tuple[int, int]
) -> None:
    sources = (Items(counts[0]), Items(counts[1]))
    common = min(counts)
    assert on_two_ranks(sources) == [[*range(common), "end"]] * 2
    for rank in (0, 1):  # a longer rank read up to one window beyond, no further
        assert sources[rank].given == read_by_the_end(common, counts[rank])
        assert sources[rank].given - common <= WINDOW


@pytest.mark.parametrize("raise_at", [0, 1, 3, 7, 20])
def test_a_source_raising_on_one_rank_leaves_the_other_in_step(raise_at: int) -> None:
    """Rank 0's source raises once at ``raise_at``: both hand on the items before it,
    then rank 0 raises the error and rank 1 ``PipelineStateError``, in the same call;
    called on, both go on in step, rank 1 with the items it had read kept, nothing
    lost or repeated on either."""
    sources = (Items(30, raise_at=raise_at), Items(25))
    ranks = on_two_ranks(sources)
    before = list(range(raise_at))
    assert ranks[0] == [*before, "ValueError", *range(raise_at, 25), "end"]
    assert ranks[1] == [*before, "PipelineStateError", *range(raise_at, 25), "end"]


def test_the_windows_grow_to_the_largest_and_the_reads_keep_one_window_ahead() -> None:
    """While both ranks fill every window, each call reads at most two items, and a
    rank never holds more than two windows of items."""
    sources = (Items(200), Items(200))
    ranks, reads = TwoRanks(), []
    wrapper = EndedTogether(sources[0], ranks.group(0))
    other = EndedTogether(sources[1], ranks.group(1))
    helper = threading.Thread(target=lambda: [next(other) for _ in range(150)])
    helper.start()
    for _ in range(150):
        before = sources[0].given
        next(wrapper)
        reads.append(sources[0].given - before)
        assert wrapper.held() <= 2 * WINDOW
    helper.join(30)
    assert reads[0] == 3  # the first window, then two of the next
    assert max(reads[1:]) <= 2
    assert reads[-20:] == [1] * 20  # windows of WINDOW: one read a call
