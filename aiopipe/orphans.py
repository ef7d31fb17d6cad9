"""``OrphanedIterations``: what :class:`~aiopipe.driver.IterationDriver` does with an
iteration left on an event loop that was stopped and closed under it (mixed into the
driver; its state is the driver's): end it from the next loop, start it again if
none of it ran, or ask for ``reset()``."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ._core.log import pipeline_log
from ._core.loops import close_if_unstarted
from .executors import Iteration, IterationHandle
from .failures import IterationFailures, loop_closed_error

if TYPE_CHECKING:
    from .chain import StepChain
    from .source import Feed

__all__ = ("OrphanedIterations",)


class OrphanedIterations:
    """The driver's handling of an iteration whose loop was closed under it."""

    # The driver's state (set by IterationDriver.__init__).
    running: asyncio.Future[None] | None
    failures: IterationFailures
    _current: tuple[Feed, Iteration] | None
    _handle: IterationHandle | None
    _chain: StepChain
    _pipeline: str

    def _end(
        self, feed: Feed, iteration: Iteration, error: BaseException | None,
        done: asyncio.Future[None] | None = None, *, free_now: bool = False,
    ) -> BaseException | None:  # fmt: skip
        raise NotImplementedError  # the driver's

    async def _finish_orphan(self) -> None:
        """The loop the iteration under way was started on was closed before its end
        was handled there (the lanes' report of it was dropped with the loop).  A
        lanes-only iteration is waited for from this loop and ended here, result and
        all; a task's iteration died with its loop: the pipeline asks for reset()."""
        current, fast = self._current, self._handle is not None
        handle = IterationHandle.of(current[1]) if current is not None else None
        if current is None or handle is None:
            self.abandon_orphan()
            return
        feed, iteration = current
        self._chain.drop(feed)
        again = handle.take_back_unbegun()  # nothing of it ran: it starts again
        # Else bodies on the dead loop, and a task's part of the iteration, can never end.
        lost = not again and handle.abandon_loop(
            None if fast else loop_closed_error(iteration.number)
        )
        if not handle.wait(0):
            await asyncio.get_running_loop().run_in_executor(None, handle.wait)
        if self._current is not current:
            return  # another call ended it meanwhile
        if again:
            iteration.stage = None
            self._start_again()
        elif fast and not lost:
            self._end(feed, iteration, handle.error)
        else:
            self.abandon_orphan()

    def _start_again(self) -> None:
        """Forget the iteration under way, none of whose tasks ran on the closed loop
        it was started on: the next call starts it again, its batch still in the ring."""
        self.running = self._handle = self._current = None
        self._chain.forget()
        pipeline_log.info("%s: an iteration left unstarted on a closed event loop is "
                          "started again", self._pipeline)  # fmt: skip

    def abandon_orphan(self) -> bool:
        """Forget an iteration left on a closed event loop, unfinished (the pipeline is
        reset or shut down, or its task died with the loop): ``False`` if none."""
        running, current = self.running, self._current
        if running is None or not running.get_loop().is_closed():
            return False
        if close_if_unstarted(running):  # the loop closed before the task's first step
            self._start_again()  # (a task's iteration never has steps queued behind it)
            return True
        number = -1
        if current is not None:
            self._chain.drop(current[0])  # one that cannot start must not hold its lanes
            iteration = current[1]
            number = iteration.number
            handle = IterationHandle.of(iteration)
            if handle is not None:  # let the lanes go on (they are not waited for)
                handle.abandon_loop(loop_closed_error(number))  # a queued one is skipped too
            iteration.stage = None
        self.running = self._handle = self._current = None
        self._chain.forget()
        self.failures.broken = str(loop_closed_error(number))
        pipeline_log.warning("%s: %s", self._pipeline, self.failures.broken)
        return True
