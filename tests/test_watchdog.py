"""The HSTU loss watch: a non-finite loss is caught, with its batch, without a host
synchronisation per step on a GPU."""

from __future__ import annotations

import pytest
import torch

from hstu_tasks.watchdog import LossWatch


class CopyEvent:
    """What a CUDA event offers the watch: ``query()`` (done?) and ``synchronize()``
    (wait).  Completed by the test, as the device would complete the copy."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def test_on_cpu_every_loss_is_checked_in_its_own_step() -> None:
    watch = LossWatch()
    watch.submit(torch.tensor(1.5), batch_index=0)
    assert watch.pending == 0
    with pytest.raises(FloatingPointError, match="nan at batch 1"):
        watch.submit(torch.tensor(float("nan")), batch_index=1)
    with pytest.raises(FloatingPointError, match="inf at batch 2"):
        watch.submit(torch.tensor(float("inf")), batch_index=2)


def test_copies_are_read_once_they_arrive_and_never_waited_for_early() -> None:
    watch = LossWatch(max_lag=3)
    events = [CopyEvent() for _ in range(3)]
    for index, event in enumerate(events):
        watch.defer(index, torch.tensor(float(index)), event)
    assert watch.pending == 3 and not any(e.waited for e in events)  # the host ran ahead
    events[0].done = True
    watch.poll()
    assert watch.pending == 2


def test_a_non_finite_loss_is_reported_with_its_batch_when_its_copy_arrives() -> None:
    watch = LossWatch(max_lag=3)
    bad, later = CopyEvent(), CopyEvent()
    watch.defer(7, torch.tensor(float("nan")), bad)
    watch.defer(8, torch.tensor(1.0), later)  # nothing raised yet: the copy is in flight
    bad.done = True
    with pytest.raises(FloatingPointError, match="nan at batch 7"):
        watch.poll()


def test_at_most_max_lag_copies_wait_then_the_oldest_is_waited_for() -> None:
    watch = LossWatch(max_lag=2)
    events = [CopyEvent() for _ in range(3)]
    watch.defer(0, torch.tensor(float("nan")), events[0])
    watch.defer(1, torch.tensor(1.0), events[1])
    with pytest.raises(FloatingPointError, match="at batch 0"):
        watch.defer(2, torch.tensor(1.0), events[2])  # a third: batch 0 is waited for
    assert events[0].waited and not events[1].waited


def test_flush_checks_what_is_left_at_the_end_and_discard_forgets_it() -> None:
    watch = LossWatch()
    watch.defer(3, torch.tensor(float("-inf")), CopyEvent())
    with pytest.raises(FloatingPointError, match="at batch 3"):
        watch.flush()
    watch.defer(4, torch.tensor(float("nan")), CopyEvent())
    watch.discard()
    watch.flush()  # nothing left to check
    assert watch.pending == 0
    with pytest.raises(ValueError, match="max_lag"):
        LossWatch(max_lag=0)


@pytest.mark.cuda
def test_on_a_gpu_the_check_does_not_synchronise_the_host() -> None:
    watch = LossWatch(max_lag=3)
    slow = torch.randn(4096, 4096, device="cuda")
    for index in range(3):
        loss = (slow @ slow).sum() * 0  # queued long work, then the loss
        watch.submit(loss, index)
    assert watch.pending >= 1  # submitted without waiting for the matmuls
    with pytest.raises(FloatingPointError, match="at batch 3"):
        # Submitting the fourth loss waits for the oldest copy; on a fast GPU every
        # copy has landed by then and the NaN is caught at once, else at the flush.
        watch.submit(torch.tensor(float("nan"), device="cuda"), 3)
        watch.flush()
