"""``AsyncExecutor``: one event loop plus a small pool of GPU-submit lane threads.

Per iteration the active tasks are split into *chains*, one per lane, in
topological order.  Each thread lane receives its whole chain in one hand-off and
runs it without returning to the loop; it blocks only where a task has a
same-progress predecessor on another lane (a :class:`OneShotFlag`) or must take a
collective ticket.  The ``"loop"`` lane's chain runs as a coroutine on the event
loop; ``async def`` bodies always run on the loop (a thread lane hands them over and
serves their ``ctx.run_on_lane`` calls meanwhile, so lane order is kept).

Failure: the first error marks the iteration failed, aborts the ticket lock and sets
every flag, so nothing waits forever; tasks not yet started are skipped, running
bodies finish, then the original exception is raised.  Cancelling the caller takes
the same path before ``CancelledError`` propagates.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._core.lanes import LOOP_LANE, LanePool
from .._core.malloc import keep_freed_memory
from .._core.openmp import release_thread_pool
from .._core.tickets import TicketLock, TicketStatistics
from .._core.waker import LoopWaker
from ..errors import ConfigurationError, PipelineStateError
from ..lanes import ThreadMap, resolve_lane
from ..options import checked_count, checked_seconds
from ..plan import ExecutionPlan
from .base import Iteration, invoke_all
from .layout import StageLayout, build_layout
from .order_check import CollectiveOrderCheck
from .handover import hand_over
from .loop_bodies import begin_heads, start_heads
from .runners import ChainRunners
from .slow_waits import DeferredWaits
from .stage import IterationHandle, StageRun

__all__ = (
    "AsyncExecutor", "ExecutorStatistics", "LOOP_SWITCH_INTERVAL_S", "SLOW_WAIT_S", "IterationHandle",
    "keep_loop_responsive",
)  # fmt: skip

#: The interpreter's GIL switch interval while lanes run (its default is 5 ms).
LOOP_SWITCH_INTERVAL_S = 0.001
#: How long a task may wait for a task on another lane, or for its collective ticket,
#: before a warning is logged (``AsyncExecutor(slow_wait_s=...)``).
SLOW_WAIT_S = 10.0


def keep_loop_responsive() -> None:
    """Lower the GIL switch interval to :data:`LOOP_SWITCH_INTERVAL_S` (never raise
    it).  A lane running Python code keeps the GIL for up to one interval before the
    event-loop thread may take it, so with the default 5 ms a coroutine on the loop
    could be held that long.  Measured on the HSTU step, the shorter interval costs no
    throughput (docs/performance.md).  It is process-wide, like torch's thread count."""
    if sys.getswitchinterval() > LOOP_SWITCH_INTERVAL_S:
        sys.setswitchinterval(LOOP_SWITCH_INTERVAL_S)


@dataclass(frozen=True)
class ExecutorStatistics:
    lanes: tuple[str, ...]
    tickets: TicketStatistics


class AsyncExecutor:
    """Event loop + lane threads.  See the module docstring.

    ``thread_map``: ``None``/``"by_stream"`` (lane = stream), ``"per_task"``, a dict
    ``{task name: lane}`` (unmapped tasks go to lane ``"default"``) or a callable
    ``task -> lane``; lane ``"loop"`` runs sync bodies inline on the loop.  ``None``
    given to a pipeline with lanes of its own (``basic()``, the ``hstu_tasks``
    pipelines) takes those lanes instead (:meth:`take_default_thread_map`).
    ``check_collective_order=N`` compares the collectives across ranks before every
    N-th iteration issues its own, and raises :class:`CollectiveOrderError` on a
    mismatch (with N=1 before any mismatched collective: different schedules, or
    different numbers of batches; see ``order_check.py``).
    ``slow_wait_s``: a task still waiting for a task on another lane or for its
    collective ticket after this many seconds logs a warning on ``aiopipe.executors``
    (and goes on waiting); ``None`` turns that off.  An attribute, so it can be
    changed on a running pipeline's ``pipe.executor``.
    """

    def __init__(
        self,
        thread_map: ThreadMap = None,
        *,
        max_lanes: int = 16,
        check_collective_order: int = 0,
        process_group: Any = None,
        slow_wait_s: float | None = SLOW_WAIT_S,
    ) -> None:
        self.thread_map = thread_map
        self._runners = ChainRunners(
            (), checked_seconds("slow_wait_s", slow_wait_s, allow_none=True)
        )
        self._lane_pool = LanePool(checked_count("max_lanes", max_lanes))
        checked_count("check_collective_order", check_collective_order, minimum=0)
        self._tickets = TicketLock()
        self._order_check = (
            CollectiveOrderCheck(check_collective_order, process_group)
            if check_collective_order
            else None
        )
        self._plan: ExecutionPlan | None = None
        self._lane_of: tuple[str, ...] = ()
        self._deferred_waits = DeferredWaits(())
        self._layouts: dict[tuple[int, ...], StageLayout] = {}
        self._compute_off_loop = False
        self._waker: LoopWaker | None = None  # the last stage's loop's: one per loop will do

    @property
    def slow_wait_s(self) -> float | None:
        """Seconds a task may wait for a task on another lane, or for its collective
        ticket, before a warning is logged; ``None``: never.  Settable on a running
        pipeline (``pipe.executor.slow_wait_s = ...``)."""
        return self._runners.slow_wait_s

    @slow_wait_s.setter
    def slow_wait_s(self, seconds: float | None) -> None:
        self._runners.slow_wait_s = checked_seconds("slow_wait_s", seconds, allow_none=True)

    # -- protocol ----------------------------------------------------------------------

    def bind(self, plan: ExecutionPlan) -> None:
        if self._plan is not None and self._plan is not plan:
            raise ConfigurationError(
                "an AsyncExecutor serves one pipeline; create one per pipeline"
            )
        lane_of = tuple(resolve_lane(task, self.thread_map) for task in plan.order)
        threads = sorted(set(lane_of) - {LOOP_LANE})
        if len(threads) > self._lane_pool.max_lanes:
            raise ConfigurationError(
                f"thread_map puts tasks on {len(threads)} lanes {threads}, more than "
                f"max_lanes={self._lane_pool.max_lanes}; group tasks onto fewer lanes"
            )
        self._plan, self._lane_of = plan, lane_of
        self._runners.lane_of = lane_of
        self._deferred_waits = DeferredWaits(lane_of)
        # Every sync body runs on a lane thread: the loop thread's OpenMP pool only
        # slows the lanes' pools down (see _core/openmp.py), so it is released per iteration.
        self._compute_off_loop = bool(threads) and not any(
            lane == LOOP_LANE and not plan.is_async[i] for i, lane in enumerate(lane_of)
        )
        if threads:
            keep_loop_responsive()
            keep_freed_memory()  # page faults cost lane threads most (_core/malloc.py)

    def start_iteration(
        self, iteration: Iteration, on_done: Callable[[BaseException | None], None],
        *, release_heads: bool = True, after: IterationHandle | None = None,
    ) -> IterationHandle | None:  # fmt: skip
        """Run ``iteration`` without a coroutine, when every task of it runs on lane threads
        (one stage, nothing on the loop's chain, no collective order check): hand its
        chains to their lanes now and return a handle; ``on_done(error)`` is called on
        the loop once every lane has finished (``error``: the first failure, or
        ``None``).  Otherwise return ``None``: the iteration needs :meth:`run_iteration`.

        The pipeline's fast path: the lanes start before the caller next yields, and
        the iteration's end is handled in the callback that wakes the loop, two loop cycles
        sooner than a task awaiting :meth:`run_iteration` would (docs/performance.md).
        ``release_heads=False``: the caller has loop work to start first (the next
        batch's read-ahead), and lets the lanes go that wait for the loop to begin the
        iteration's ``async def`` bodies itself, with :meth:`IterationHandle.release_lanes`.

        ``after``: the handle of the iteration running now.  The new one is queued
        behind it, and the lane that ends it starts the new one at once, with no round
        trip through the loop (its end is still handled on the loop, in order); see
        :meth:`IterationHandle.drop_queued`.  ``None`` if it cannot be queued (the
        running one has ended already): start it once that end is handled."""
        stages = [active for active in iteration.active.stages if active]
        if len(stages) != 1 or self._order_check is not None:
            return None
        layout = self._layout(stages[0])
        if layout.loop_chain or not layout.thread_chains:
            return None
        if after is not None:
            run = self._queue_stage(iteration, stages[0], on_done, after)
            return None if run is None else IterationHandle(run)
        return IterationHandle(self._begin_stage(iteration, stages[0], on_done, release_heads))

    async def run_iteration(self, iteration: Iteration) -> None:
        if self._order_check is not None:  # before the iteration issues any collective
            await self._order_check.check_before(iteration)
        for active in iteration.active.stages:
            if active:
                await self._finish_stage(self._begin_stage(iteration, active))

    def release_loop_thread_pool(self) -> None:
        """From the loop's thread, after work of its own that may have run torch ops (a
        source giving a batch): free the OpenMP pool they opened there, if the lanes
        run the compute.  Alive while the lanes run, it would make libgomp count more
        pool threads than CPUs, and the lanes' parallel regions slow down (a DLRM
        step whose source builds batches with torch ops ran 1.5x slower;
        docs/performance.md)."""
        if self._compute_off_loop:
            release_thread_pool()

    def inlines(self, plan: ExecutionPlan) -> bool:
        """Whether the pipeline may run ``plan``'s iterations with :meth:`run_inline`:
        every task synchronous and on lane ``"loop"`` (one chain, in order, so no
        ticket or flag to wait for), no collective order check, and ``run_iteration``
        not overridden by a subclass."""
        return (
            plan is self._plan and self._order_check is None
            and all(lane == LOOP_LANE for lane in self._lane_of) and not any(plan.is_async)
            and type(self).run_iteration is AsyncExecutor.run_iteration
        )  # fmt: skip

    def run_inline(self, iteration: Iteration) -> None:
        """Run an iteration :meth:`inlines` allows, now, in the caller's frame."""
        invoke_all(iteration)

    def shutdown(self) -> None:
        self._lane_pool.shutdown()

    def take_default_thread_map(self, thread_map: ThreadMap) -> None:
        """Use ``thread_map``, a pipeline's default lanes, if this executor was built
        without a thread map and is not bound yet: passing an executor to set another
        option (``check_collective_order``) keeps the pipeline's lanes."""
        if self.thread_map is None and self._plan is None:
            self.thread_map = thread_map

    def lane_of(self, task_name: str) -> str:
        plan = self._require_plan()
        return self._lane_of[plan.index[task_name]]

    def statistics(self) -> ExecutorStatistics:
        return ExecutorStatistics(self._lane_pool.names(), self._tickets.statistics())

    def __repr__(self) -> str:
        return f"AsyncExecutor(thread_map={self.thread_map!r})"

    # -- layout ------------------------------------------------------------------------

    def _require_plan(self) -> ExecutionPlan:
        if self._plan is None:
            raise PipelineStateError("AsyncExecutor used before bind()")
        return self._plan

    def _layout(self, active: tuple[int, ...]) -> StageLayout:
        layout = self._layouts.get(active)
        if layout is None:
            layout = self._layouts[active] = build_layout(self._require_plan(), self._lane_of, active)
        return layout

    # -- one stage ---------------------------------------------------------------------

    def _begin_stage(
        self, iteration: Iteration, active: tuple[int, ...],
        on_done: Callable[[BaseException | None], None] | None = None,
        release_heads: bool = True,
    ) -> StageRun:  # fmt: skip
        """Hand the stage's thread chains to their lanes and start the ``async def``
        bodies heading a chain; :meth:`_finish_stage` runs the loop's chain and waits
        for the lanes (or ``on_done`` is called, see :meth:`start_iteration`).

        A body heading a chain starts here, on the loop, rather than when its lane (or
        the loop's chain) reaches it: with every core busy with the lanes' compute, a
        loop woken later gets a core only milliseconds later, and a fetch one batch
        ahead would start only once the step it should overlap has ended."""
        layout = self._layout(active)
        waker = self._waker = LoopWaker.for_running_loop(self._waker)
        lanes = [self._lane_pool.get(name) for name, _ in layout.thread_chains]  # may start threads
        self._tickets.reset(waker)
        run = iteration.stage = StageRun(iteration, layout, waker, self._tickets, on_done)
        if layout.async_heads:
            begin_heads(run, lanes)
        hand_over(run, lanes, self._runners.run_thread_chain)
        self._watch_deferred(run)
        if run.heads:  # ``release_heads=False``: the caller lets the other lanes go
            start_heads(run, release=release_heads)
        if self._compute_off_loop:
            release_thread_pool()
        # No yield of the loop's CPU to the lanes just woken: the loop runs on to its
        # wait and sleeps there; a yielded loop came back mid-step and took the GIL
        # from the lane (the tiny MLP's step was 3.5-8 % slower; docs/performance.md).
        return run

    def _queue_stage(
        self, iteration: Iteration, active: tuple[int, ...],
        on_done: Callable[[BaseException | None], None], after: IterationHandle,
    ) -> StageRun | None:  # fmt: skip
        """Like :meth:`_begin_stage`, behind the stage ``after`` runs: each lane finds
        its chain queued behind its chain of that stage and waits for the whole stage
        to end (the gate) -- the barrier the loop kept between two iterations."""
        layout = self._layout(active)
        lanes = [self._lane_pool.get(name) for name, _ in layout.thread_chains]
        run = StageRun(iteration, layout, after.waker, self._tickets, on_done)
        if layout.async_heads:
            # Before it is linked (the stage before may end at once and look for them);
            # the loop starts them once that one ends (start_queued_heads).
            begin_heads(run, lanes)
        if not run.queue_behind(after.stage):
            return None
        iteration.stage = run
        hand_over(run, lanes, self._runners.run_thread_chain, after=after.stage)
        self._watch_deferred(run)
        return run

    def _watch_deferred(self, run: StageRun) -> None:
        """Warn about a long wait of a chain its lane has not been handed yet, as a
        lane waiting for it would."""
        if run.deferred and self.slow_wait_s is not None:
            self._deferred_waits.watch(run, self.slow_wait_s)

    async def _finish_stage(self, run: StageRun) -> None:
        layout = run.layout
        try:
            if layout.loop_chain:
                await self._runners.run_loop_chain(run, layout.loop_chain)
            if run.threads_done is not None:
                await run.threads_done
        except BaseException as exc:
            run.fail(exc)
            for task in list(run.async_tasks):
                if task.get_loop().is_closed():  # collected on a closed loop: nothing runs it
                    task.get_coro().close()
                else:
                    task.cancel()
            # Running bodies finish first.  Cancel scopes (anyio, trio-style) deliver
            # the cancellation again at every await: keep waiting through those.
            while (still_running := run.renew_threads_done()) is not None:
                try:
                    await asyncio.shield(still_running)
                except asyncio.CancelledError:
                    continue
                break
            raise
        if run.error is not None:
            raise run.error
