"""``TaskContext``: what a task body sees.

The pipeline hands every task the same ``TaskContext`` object; what it returns
depends on the task currently running *in this thread or coroutine*, which is kept
in a ``contextvars.ContextVar``.  Lane threads and loop coroutines each have their
own context, so concurrent tasks never see each other's slots.

Named events (:meth:`TaskContext.record_event` / :meth:`TaskContext.wait_event`)
order device work around state that lives outside slots.  They live in a registry
of their own, apart from the events the engine records per task in the slot stores.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar, copy_context
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from .errors import ConfigurationError, ConfigurationTypeError, PipelineStateError
from .ring import SlotStore
from .streams import StreamLike, StreamPool

if TYPE_CHECKING:
    from .task import Task

__all__ = ("LaneRunner", "TaskContext")

T = TypeVar("T")
#: Runs a synchronous callable where the task's sync work belongs (its lane thread,
#: with its stream current) and awaits the result without blocking the loop.
LaneRunner = Callable[[Callable[[], Any]], Awaitable[Any]]


class Running(NamedTuple):
    """The task a thread or coroutine is currently executing."""

    task: Task
    store: SlotStore | None
    iteration: int
    batch_index: int
    run_on_lane: LaneRunner | None


CURRENT: ContextVar[Running | None] = ContextVar("aiopipe_current_task", default=None)


class _NamedEvent(NamedTuple):
    """The latest record of a user-named event."""

    event: Any  # None when recorded on a CPU null stream
    batch_index: int


class TaskContext:
    """Per-pipeline handle passed to every ``run(ctx)`` / ``init(ctx)``."""

    __slots__ = ("_named_events", "_stream_pool")

    def __init__(self, stream_pool: StreamPool) -> None:
        self._stream_pool = stream_pool
        # Kept apart from the engine's per-task events (SlotStore.record_event): a
        # user name can never shadow or be shadowed by a task's name.
        self._named_events: dict[str, _NamedEvent] = {}

    @staticmethod
    def _running() -> Running:
        running = CURRENT.get()
        if running is None:
            raise PipelineStateError("TaskContext is only usable inside a running task")
        return running

    @property
    def slots(self) -> SlotStore:
        """The slot store of the batch this task is processing."""
        store = self._running().store
        if store is None:
            raise PipelineStateError("no batch is being processed during init(ctx)")
        return store

    @property
    def iter_count(self) -> int:
        """Internal iteration number since the current source was adopted (0-based)."""
        return self._running().iteration

    @property
    def batch_index(self) -> int:
        """Index of the batch this task processes within the current source."""
        return self._running().batch_index

    @property
    def task(self) -> Task:
        return self._running().task

    @property
    def stream_pool(self) -> StreamPool:
        return self._stream_pool

    @property
    def stream(self) -> StreamLike | None:
        """This task's stream (``None`` on a CPU null stream)."""
        return self._stream_pool.get(self._running().task.stream)

    def record_event(self, name: str) -> Any:
        """Record the event ``name`` on this task's stream, after the work queued on it
        so far, and return it (``None`` on a CPU null stream).

        For state outside slots (a cache, a module attribute) whose readers run on
        other streams.  An event name is one per pipeline: each record replaces the
        previous one, whichever task, batch or progress made it (as re-recording a
        CUDA event does), and stays until the next record.  Names are separate from
        task names and from the engine's own events."""
        _check_event_name(name)
        running = self._running()
        event = self._stream_pool.record_event(running.task.stream)
        self._named_events[name] = _NamedEvent(event, running.batch_index)
        return event

    def wait_event(self, name: str) -> int | None:
        """Make this task's stream wait, on the device, for the latest record of the
        event ``name``; the host thread never blocks.  Returns the batch index the
        recording task was processing (``-1`` from ``init``), or ``None`` if ``name``
        was never recorded -- then there is nothing to wait for and nothing is issued.

        It waits for the record made *before this call*: declare a dependency on the
        recording task (``depends_on``, ``same_progress_sync`` or
        ``cross_iter_depends_on``) so its record comes first.  On a CPU null stream
        the wait itself is a no-op; the bookkeeping (and the return value) is the same.
        """
        _check_event_name(name)
        running = self._running()
        named = self._named_events.get(name)
        if named is None:
            return None
        if named.event is not None:
            self._stream_pool.wait_event(running.task.stream, named.event)
        return named.batch_index

    async def run_on_lane(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """From an ``async def`` task: run ``fn(*args, **kwargs)`` on this task's lane
        thread with the task's stream current, and await its result.  ``fn`` sees the
        same ``ctx`` (slots, stream, batch index) as the task.

        This is how coroutine tasks submit GPU work: stream and device state are
        thread-local and must never be held across an ``await``.  Where the task has
        no lane thread (``SequentialExecutor``, or lane ``"loop"``) it runs inline on
        the calling thread.
        """
        running = self._running()
        stream = running.task.stream
        pool = self._stream_pool

        def call() -> T:
            with pool.use(stream):
                return fn(*args, **kwargs)

        if running.run_on_lane is None:
            return call()
        # The lane thread sees this task's context (ctx.slots, ctx.stream) as the
        # loop does: run fn in a copy of the coroutine's context variables.
        variables = copy_context()
        result: T = await running.run_on_lane(lambda: variables.run(call))
        return result

    def __repr__(self) -> str:
        running = CURRENT.get()
        where = f"task={running.task.name!r} batch={running.batch_index}" if running else "idle"
        return f"<TaskContext {where}>"


def _check_event_name(name: object) -> None:
    if not isinstance(name, str):
        raise ConfigurationTypeError(f"an event name must be a string, got {name!r}")
    if not name:
        raise ConfigurationError("an event name must not be empty: name the state it guards")
