"""The two chain runners of :class:`~.asyncio_executor.AsyncExecutor`: one lane's
chain of a stage, run on the event loop (awaited) or on a lane thread (blocking).

Both follow one per-task protocol -- wait for the
predecessors on other lanes, stop if the stage failed, take the ticket, run,
then release the ticket and set the task's flag -- written out twice, blocking
and awaited.  Folded into one generator both runners drive, no-op tasks on two
lanes cost 8 % more per task under uvloop (./dev bench versus ... engine_overhead,
docs/performance.md): this is the hot path, so the flat copies stay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import TicketAbortedError
from .loop_bodies import hand_to_loop, wait_on_lane
from .slow_waits import slow_ticket_warning, warn_slow_wait

if TYPE_CHECKING:
    from .._core.lanes import Lane
    from .stage import StageRun

__all__ = ("ChainRunners",)


class ChainRunners:
    """Runs the chains of one executor's stages; ``slow_wait_s`` is read as each
    chain starts (``AsyncExecutor.slow_wait_s`` sets it)."""

    __slots__ = ("lane_of", "slow_wait_s")

    def __init__(self, lane_of: tuple[str, ...], slow_wait_s: float | None) -> None:
        self.lane_of = lane_of
        self.slow_wait_s = slow_wait_s

    async def run_loop_chain(self, run: StageRun, chain: tuple[int, ...]) -> None:
        iteration, layout = run.iteration, run.layout
        is_async = iteration.plan.is_async
        slow_s = self.slow_wait_s
        slow_ticket = slow_ticket_warning(self.lane_of, run, slow_s)
        heads = run.heads
        for i in chain:
            if heads and i in heads:  # started with the stage: no wait, no ticket before it
                head = heads[i]
                try:
                    await head.task  # type: ignore[misc]
                    if head.error is not None:  # an interrupt: raised here, as if run inline
                        raise head.error
                except Exception as exc:
                    run.fail(exc)
                    return
                run.finish_task(i)
                continue
            ticket = layout.tickets.get(i)
            cross_preds = layout.cross_preds.get(i, ())
            if iteration.tracing and (cross_preds or ticket is not None):
                iteration.mark_ready(i)
            for p in cross_preds:
                flag = run.flags[p]
                if slow_s is None or flag.is_set():
                    await flag.wait()  # set on failure too: never waits forever
                    continue
                timer = run.waker.loop.call_later(
                    slow_s, warn_slow_wait, self.lane_of, run, i, p, slow_s
                )
                try:
                    await flag.wait()
                finally:
                    timer.cancel()
            if run.failed:
                return
            try:
                if ticket is not None:
                    await run.tickets.acquire(ticket, slow_s, slow_ticket)
                if is_async[i]:
                    await iteration.invoke_async(i)
                else:
                    iteration.invoke(i)
            except TicketAbortedError:
                return
            except Exception as exc:
                run.fail(exc)
                return
            run.finish_task(i)

    def run_thread_chain(self, run: StageRun, lane: Lane, chain: tuple[int, ...]) -> None:
        """Runs on ``lane``'s thread."""
        iteration, layout = run.iteration, run.layout
        is_async = iteration.plan.is_async
        slow_s = self.slow_wait_s
        slow_ticket = slow_ticket_warning(self.lane_of, run, slow_s)
        heads = run.heads
        try:
            for i in chain:
                if heads and i in heads:  # started with the stage: wait for it, even failed
                    if run.failed and not run.heads_started:
                        return  # a queued stage skipped: the loop never started it
                    try:
                        wait_on_lane(lane, heads[i])
                    except BaseException as exc:
                        run.fail(exc)
                        return
                    run.finish_task(i)
                    continue
                ticket = layout.tickets.get(i)
                cross_preds = layout.cross_preds.get(i, ())
                if iteration.tracing and (cross_preds or ticket is not None):
                    iteration.mark_ready(i)
                for p in cross_preds:
                    # set on failure too; a timeout only reports a long wait
                    if not run.flags[p].wait_blocking(slow_s):
                        warn_slow_wait(self.lane_of, run, i, p, slow_s)
                        run.flags[p].wait_blocking()
                if run.failed:
                    return
                try:
                    if ticket is not None:
                        run.tickets.acquire_blocking(ticket, slow_s, slow_ticket)
                    if is_async[i]:
                        hand_to_loop(run, lane, i)
                    else:
                        iteration.invoke(i)
                except TicketAbortedError:
                    return
                except BaseException as exc:
                    run.fail(exc)
                    return
                run.finish_task(i)
        except BaseException as exc:  # a bug in the executor itself: never hang the loop
            run.fail(exc)
        finally:
            waker = run.thread_chain_finished()
            if waker is not None:
                lane.wake_after_item(waker)
