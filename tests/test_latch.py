"""``Latch``: the set-once event of every stage's lanes and tickets."""

from __future__ import annotations

import threading

from aiopipe._core.flags import Latch


def test_waits_until_set_and_then_never_again() -> None:
    latch = Latch()
    assert not latch.is_set() and latch.wait(timeout=0) is False
    assert latch.wait(timeout=0.01) is False  # still unset: the timeout ends the wait
    latch.set()
    assert latch.is_set() and latch.wait(timeout=0) and latch.wait()
    latch.set()  # a second set changes nothing
    assert latch.wait(timeout=0)
    assert Latch(is_set=True).wait(timeout=0)


def test_every_waiter_passes_once_it_is_set() -> None:
    latch, waiting, passed = Latch(), threading.Barrier(5), []

    def waiter() -> None:
        waiting.wait()
        passed.append(latch.wait(timeout=30))

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for thread in threads:
        thread.start()
    waiting.wait()  # all four are about to wait (or waiting): none can pass yet
    assert not passed
    latch.set()
    for thread in threads:
        thread.join(timeout=30)
    assert passed == [True] * 4


def test_threads_setting_it_at_once_open_it_exactly_once() -> None:
    errors: list[BaseException] = []
    for _ in range(200):
        latch, start = Latch(), threading.Barrier(3)

        def setter() -> None:
            start.wait()
            try:
                latch.set()  # a second release of the gate would raise here
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=setter) for _ in range(2)]
        for thread in threads:
            thread.start()
        start.wait()
        for thread in threads:
            thread.join(timeout=30)
        assert latch.wait(timeout=0) and latch.wait(timeout=1)
    assert not errors
