"""The executor protocol, and ``Iteration``: one internal iteration handed to an executor.

An executor decides *where* and *when* each active task runs (which thread, in which
order, what overlaps).  *How* a task runs is the same everywhere and lives in
:meth:`Iteration.invoke` / :meth:`Iteration.invoke_async`: set the task context, issue its
cross-stream event waits, run the body under its stream and NVTX range, record its
completion event in the batch's slot store.

A custom executor implements three methods::

    class MyExecutor:
        def bind(self, plan: ExecutionPlan) -> None: ...   # once, before any iteration
        async def run_iteration(self, iteration: Iteration) -> None: ...  # once per iteration
        def shutdown(self) -> None: ...                    # idempotent

``run_iteration`` must run every task of ``iteration.active`` exactly once, never start a task
before its same-progress predecessors (``plan.preds``) and the previous active task
on its stream have finished, run stages in order, and raise the first task failure
after every started task has finished.  Device-only ``same_progress_sync`` waits need
nothing from it: ``Iteration`` issues them, and the pipeline calls :meth:`Iteration.finish`.

An executor may also offer ``start_iteration(iteration, on_done, *, release_heads=True,
after=None)``: start the whole iteration now, from the caller's frame, and return a
handle with ``abort(exc)`` and a blocking ``wait(timeout)``; then call
``on_done(error)`` exactly once, later, on the loop's thread.  Or return ``None``, and
``run_iteration`` is awaited in a task instead (``AsyncExecutor`` runs an iteration
this way when every task of it is mapped to a lane thread).  The pipeline passes both
keywords (see ``AsyncExecutor.start_iteration``); an executor without queues returns
``None`` when ``after`` is set.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .._core.log import executor_log
from ..context import CURRENT, LaneRunner, Running, TaskContext
from ..errors import IgnoredReturnWarning, SlotNotSetError, attach_origin
from ..slot_audit import unset_slot_note
from ..failures import body_fault
from ..plan import ActiveSet, ExecutionPlan
from ..ring import BatchRing
from ..task import refuse_awaitable
from .._core.lanes import lane_of_thread
from .._core.steps import AwaitClock

if TYPE_CHECKING:
    from .._core.nvtx import Annotator
    from ..task import Task
    from ..trace import Tracer

__all__ = ("Executor", "Iteration", "annotate_failure", "invoke_all")


@runtime_checkable
class Executor(Protocol):
    """What a pipeline needs from an executor: ``bind`` once, ``run_iteration`` per
    iteration, ``shutdown`` (idempotent).  See this module's docstring."""

    def bind(self, plan: ExecutionPlan) -> None: ...

    async def run_iteration(self, iteration: Iteration) -> None: ...

    def shutdown(self) -> None: ...


def annotate_failure(exc: BaseException, task_name: str, iteration: int, batch: int) -> None:
    """Attach where a task body failed to the original exception (once)."""
    where = (f"on batch {batch} of the source (counted from 0), in the pipeline's internal "
             f"iteration {iteration} (an iteration works on several batches at once)")
    attach_origin(exc, task_name, where, aiopipe_iteration=iteration, aiopipe_batch=batch)


class Iteration:
    """The active tasks of one internal iteration and the means to run them.

    An executor's ``run_iteration(iteration)`` reads ``iteration.plan`` (the
    :class:`ExecutionPlan`), ``iteration.number`` (counting from 0 in each feed of a source)
    and ``iteration.active`` (an :class:`~aiopipe.plan.ActiveSet` of task numbers),
    and runs each active task once with :meth:`invoke` (a synchronous body, on the
    calling thread) or :meth:`invoke_async` (an ``async def`` body).
    ``iteration.started`` turns true once any body has begun.
    """

    __slots__ = (
        "_annotator", "_ctx", "_deferred_syncs", "_lane_names", "_ready_ns", "_ring", "_tracer",
        "active", "batches_before", "completed", "number", "pipeline", "plan", "stage", "started",
    )  # fmt: skip

    def __init__(
        self,
        plan: ExecutionPlan,
        ring: BatchRing,
        ctx: TaskContext,
        number: int,
        active: ActiveSet,
        annotator: Annotator | None = None,
        tracer: Tracer | None = None,
        lane_names: tuple[str, ...] = (),
        pipeline: str = "",
        batches_before: int = 0,
    ) -> None:
        self.plan = plan
        #: The index in its source of the feed's first batch (a source that goes on
        #: after ``drain()`` or ``reset()`` counts on): ``ctx.batch_index`` adds it.
        self.batches_before = batches_before
        #: The name of the pipeline running the iteration (log records, trace tracks).
        self.pipeline = pipeline
        self.number = number
        self.active = active
        #: Set once any task body has begun: the iteration can no longer be retried.
        self.started = False
        #: The tasks whose bodies ran to their end (appended from any lane).
        self.completed: list[int] = []
        #: What the lanes share for the stage they run now (an executor's own object,
        #: e.g. ``AsyncExecutor``'s ``StageRun``); ``None`` when no lane runs it.
        self.stage: Any = None
        self._ring = ring
        self._ctx = ctx
        self._annotator = annotator
        #: With tracing on: where each task runs, and when its lane reached it.
        self._tracer = tracer
        self._lane_names = lane_names
        self._ready_ns: dict[int, int] = {}
        #: Device-only syncs whose producer had not recorded when the consumer started:
        #: ``(consumer, producer, slot_offset)``, issued by :meth:`finish`.
        self._deferred_syncs: list[tuple[int, int, int]] = []

    @property
    def tracing(self) -> bool:
        return self._tracer is not None

    def mark_ready(self, index: int) -> None:
        """Executors call this (when ``tracing``) before waiting on another lane or a
        ticket, so the trace can show the wait."""
        self._ready_ns[index] = time.perf_counter_ns()

    def batch_index(self, index: int) -> int:
        return self.batches_before + self.number - self.plan.lag[index]

    def _enter(self, index: int, run_on_lane: LaneRunner | None) -> Any:
        self.started = True
        running = Running(
            self.plan.order[index],
            self._ring.at(self.plan.lookahead[index]),
            self.number,
            self.batch_index(index),
            run_on_lane,
        )
        return CURRENT.set(running)

    def _wait_events(self, index: int) -> None:
        plan = self.plan
        waits = plan.waits[index]
        if waits:
            pool, stream, ring = plan.stream_pool, plan.stream[index], self._ring
            for producer, producer_stream, slot_offset in waits:
                event = ring.at(slot_offset).event_of(plan.order[producer].name)
                if event is None:  # no record yet (first batches, seeded batch)
                    pool.wait_stream(stream, producer_stream)
                else:
                    pool.wait_event(stream, event)

    def _device_syncs(self, index: int) -> None:
        """Device-only ``same_progress_sync`` waits: never hold this thread for the
        producer.  If it has recorded this progress, wait before the body; if it will
        run later in this progress, :meth:`finish` issues the wait."""
        plan, ring = self.plan, self._ring
        pool, stream = plan.stream_pool, plan.stream[index]
        for producer, producer_stream, slot_offset in plan.device_syncs[index]:
            if producer not in self.active.members:  # it does not run this progress
                pool.wait_stream(stream, producer_stream)
                continue
            event = ring.at(slot_offset).event_of(plan.order[producer].name)
            if event is None:
                self._deferred_syncs.append((index, producer, slot_offset))
            else:
                pool.wait_event(stream, event)

    def oldest_batch_done(self) -> bool:
        """Whether every task this iteration runs on the batch at offset 0 (its
        lookahead-0 tasks, which write its result) ran to its end: after a failure
        elsewhere in the iteration, that batch's step was applied all the same."""
        plan, completed = self.plan, set(self.completed)
        oldest = [i for i in self.active.all if plan.lookahead[i] == 0]
        return bool(oldest) and completed.issuperset(oldest)

    def finish(self) -> None:
        """Called by the pipeline once every task of the iteration has run: issue the
        device-only waits their consumers could not issue before their bodies."""
        plan, ring = self.plan, self._ring
        for consumer, producer, slot_offset in self._deferred_syncs:
            event = ring.at(slot_offset).event_of(plan.order[producer].name)
            if event is None:  # recorded nothing (no device work): cover its stream
                plan.stream_pool.wait_stream(plan.stream[consumer], plan.stream[producer])
            else:
                plan.stream_pool.wait_event(plan.stream[consumer], event)
        self._deferred_syncs.clear()

    def _record(self, index: int) -> None:
        plan = self.plan
        event = plan.stream_pool.record_event(plan.stream[index])
        self._ring.at(plan.lookahead[index]).record_event(plan.order[index].name, event)

    def _fail(self, index: int, exc: BaseException) -> None:
        task, batch = self.plan.order[index].name, self.batch_index(index)
        if isinstance(exc, Exception) and executor_log.isEnabledFor(logging.WARNING):
            executor_log.warning(
                "%s: task %r failed on batch %d of the source (iteration %d) on %s: %s: %s",
                self.pipeline, task, batch, self.number, self._lane_name(index),
                type(exc).__name__, exc,
            )  # fmt: skip
        annotate_failure(exc, task, self.number, batch)
        if isinstance(exc, SlotNotSetError):
            exc.add_note(unset_slot_note(self.plan, index, exc.slot))
        if body_fault(exc):
            with contextlib.suppress(AttributeError):  # exceptions with __slots__
                exc.aiopipe_body_fault = True  # type: ignore[attr-defined]

    def _lane_name(self, index: int) -> str:
        """Where task ``index`` runs, for a record (its lane, else the thread's)."""
        if self._lane_names:
            return f"lane {self._lane_names[index]!r}"
        return f"lane {lane_of_thread(threading.current_thread().name)!r}"

    def invoke(self, index: int, run_on_lane: LaneRunner | None = None) -> None:
        """Run the synchronous body of task ``index`` on the calling thread."""
        if self._tracer is None:
            self._invoke(index, run_on_lane, None)
            return
        gpu_started: list[tuple[Any, Any]] = []
        start, failed = time.perf_counter_ns(), True
        try:
            self._invoke(index, run_on_lane, gpu_started)
            failed = False
        finally:
            self._trace(index, start, failed, gpu_started[0] if gpu_started else None)

    def _invoke(
        self, index: int, run_on_lane: LaneRunner | None, gpu_started: list[Any] | None
    ) -> None:
        # The hot path of every executor: kept flat, with stream and event work
        # skipped entirely where the plan says there is none.
        plan = self.plan
        task = plan.order[index]
        self.started = True
        token = CURRENT.set(
            Running(
                task,
                self._ring.at(plan.lookahead[index]),
                self.number,
                self.batches_before + self.number - plan.lag[index],
                run_on_lane,
            )
        )
        try:
            if plan.waits[index]:
                self._wait_events(index)
            if plan.device_syncs[index]:
                self._device_syncs(index)
            annotator = self._annotator
            if plan.on_device[index]:
                if gpu_started is not None:  # tracing: after the waits, so stalls don't count
                    self._gpu_timing_start(index, gpu_started)
                with plan.stream_pool.use(plan.stream[index]):
                    if annotator is None:
                        result = task.run(self._ctx)
                    else:
                        with annotator.push_pop(task.nvtx_tag or task.name):
                            result = task.run(self._ctx)
            elif annotator is None:
                result = task.run(self._ctx)
            else:
                with annotator.push_pop(task.nvtx_tag or task.name):
                    result = task.run(self._ctx)
            if result is not None:
                refuse_awaitable(result, lambda: (
                    f"task {task.name!r} returned an awaitable from a synchronous body; "
                    f"declare run/fn with 'async def' so it runs on the event loop"
                ))  # fmt: skip
                warn_ignored_return(task, result)
            if plan.records_event[index]:
                self._record(index)
            self.completed.append(index)
        except BaseException as exc:
            self._fail(index, exc)
            raise
        finally:
            CURRENT.reset(token)

    async def invoke_async(self, index: int, run_on_lane: LaneRunner | None = None) -> None:
        """Run the ``async def`` body of task ``index`` on the event loop.

        No stream is made current around the coroutine: that state is per thread and
        other coroutines interleave at every ``await``.  The body reaches its stream
        through ``ctx.run_on_lane``; its event waits are issued on the stream first.
        """
        if self._tracer is None:
            await self._invoke_async(index, run_on_lane)
            return
        # Only the coroutine's steps are host work: the clock counts the time it
        # spends suspended at its awaits apart (the span's await_ns).
        start, failed = time.perf_counter_ns(), True
        steps = AwaitClock(self._invoke_async(index, run_on_lane))
        try:
            await steps
            failed = False
        finally:
            self._trace(index, start, failed, None, steps.awaited_ns)

    async def _invoke_async(self, index: int, run_on_lane: LaneRunner | None) -> None:
        plan = self.plan
        task = plan.order[index]
        token = self._enter(index, run_on_lane)
        annotator, handle = self._annotator, None
        if annotator is not None:
            handle = annotator.start(task.nvtx_tag or task.name)
        try:
            self._wait_events(index)
            if plan.device_syncs[index]:
                self._device_syncs(index)
            result: object = await task.run(self._ctx)  # type: ignore[misc]
            if result is not None:
                warn_ignored_return(task, result)
            if plan.records_event[index]:
                self._record(index)
            self.completed.append(index)
        except BaseException as exc:
            self._fail(index, exc)
            raise
        finally:
            if annotator is not None:
                annotator.end(handle)
            with contextlib.suppress(ValueError):  # closed outside its task: that context is gone
                CURRENT.reset(token)

    # -- tracing (only with a tracer) ----------------------------------------------------

    def _gpu_timing_start(self, index: int, started: list[Any]) -> None:
        tracer, plan = self._tracer, self.plan
        stream = plan.stream_pool.get(plan.stream[index])
        if tracer is None or not tracer.gpu_timing or stream is None:
            return
        begin = tracer.gpu_event()
        stream.record_event(begin)
        tracer.note_gpu_origin(begin, time.perf_counter_ns())
        started.append((begin, stream))

    def _trace(
        self, index: int, start: int, failed: bool, gpu_started: tuple[Any, Any] | None,
        awaited_ns: int = 0,
    ) -> None:  # fmt: skip
        tracer, plan = self._tracer, self.plan
        assert tracer is not None  # only called with a tracer
        end = time.perf_counter_ns()
        thread = threading.current_thread().name
        ready = self._ready_ns.pop(index, start) if self._ready_ns else start
        raw = (
            plan.order[index].name, self.number, self.number - plan.lag[index],
            self._lane_names[index] if self._lane_names else lane_of_thread(thread), thread,
            plan.stream[index], start, end, start - ready if ready < start else 0, failed,
            self.pipeline, None, awaited_ns,
        )  # fmt: skip
        if gpu_started is None:
            tracer.append(raw)
            return
        begin, stream = gpu_started
        finish = tracer.gpu_event()
        stream.record_event(finish)
        tracer.append_gpu(raw, begin, finish)


def invoke_all(iteration: Iteration) -> None:
    """Run every active task of ``iteration``, whose bodies are all synchronous, one
    after another on the calling thread: an executor's ``run_inline``."""
    invoke = iteration.invoke
    for index in iteration.active.all:
        invoke(index)


_TOLD_LOCK = threading.Lock()
#: The tasks told that their body's return value is ignored: each is told once.
_TOLD: weakref.WeakSet[Task] = weakref.WeakSet()


def warn_ignored_return(task: Task, value: object) -> None:
    """A body returned ``value``: the pipeline passes values on through slots only."""
    with _TOLD_LOCK:  # lanes of one pipeline may ask at once
        if task in _TOLD:
            return
        _TOLD.add(task)
    warnings.warn(
        f"task {task.name!r} returned {type(value).__name__}, which the pipeline ignores: a "
        f"task hands values on through ctx.slots.set(...), the step's result as "
        f"ctx.slots.set('step_result', ...)",
        IgnoredReturnWarning, stacklevel=2,
    )  # fmt: skip

