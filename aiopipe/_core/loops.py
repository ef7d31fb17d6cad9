"""Event loops for ordinary code: the loop behind ``aiopipe.run`` and the blocking API.

``aiopipe.run`` uses uvloop when it is installed (``AIOPIPE_UVLOOP=0`` opts out) and
plain asyncio otherwise.  The blocking API always uses plain asyncio: it starts and
stops its loop on every call, and uvloop sets its signal handling up on every start
in the main thread (37 us a start there against 13 for asyncio's loop; 70-200 us more
per progress between two training steps, docs/performance.md).

Ctrl-C cancels the running coroutine -- so the pipeline releases its lanes and
tickets -- and then raises ``KeyboardInterrupt``, as ``asyncio.run`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Collection, Coroutine, Iterator
from types import CodeType, FrameType
from typing import Any, TypeVar

from ..errors import PipelineStateError

try:  # signal's C module: its calls without the Python wrappers' enum conversions
    import _signal as _raw_signal  # type: ignore[import-not-found]
except ImportError:  # not CPython
    _raw_signal = signal

__all__ = (
    "STOPPED_WAITING", "LoopRunner", "close_awaited", "close_if_unstarted", "close_left",
    "close_on_the_way_out", "finish_loop", "loop_running_in_this_thread", "new_event_loop",
    "runner_owns", "running_task",
    "task_quiet_if_left", "unstarted", "uvloop_enabled", "waits_for_ctrl_c",
)  # fmt: skip

T = TypeVar("T")

#: The loops of LoopRunners: their shutdown (finish_loop) cancels again the tasks
#: made while it cancels, so nothing else need hold them open.
_RUNNER_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


#: What a wait stopped by Ctrl-C says.
STOPPED_WAITING = "aiopipe: stopped waiting; the event loop closes without it"
#: Per loop, what to call on the next Ctrl-C a runner handles: the waits that stop for
#: good on one (:func:`waits_for_ctrl_c`).
_ON_CTRL_C: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[Callable[[], None]]] = (
    weakref.WeakKeyDictionary()
)


@contextlib.contextmanager
def waits_for_ctrl_c(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> Iterator[None]:
    """While the block runs, a Ctrl-C that a :class:`LoopRunner` of ``loop`` handles
    calls ``stop()`` first (a wait for a step left running stops for good on it)."""
    stops = _ON_CTRL_C.setdefault(loop, [])
    stops.append(stop)
    try:
        yield
    finally:
        stops.remove(stop)


def runner_owns(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` belongs to a :class:`LoopRunner` (``aiopipe.run``, the
    blocking API), which ends with :func:`finish_loop`."""
    return loop in _RUNNER_LOOPS


def uvloop_enabled() -> bool:
    """Whether the project's entry points run on uvloop."""
    if os.environ.get("AIOPIPE_UVLOOP") == "0":
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def new_event_loop(*, prefer_uvloop: bool = True) -> asyncio.AbstractEventLoop:
    """A uvloop loop when ``prefer_uvloop`` and :func:`uvloop_enabled`, else asyncio's."""
    if prefer_uvloop and uvloop_enabled():
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class LoopRunner:
    """Owns one event loop and runs coroutines on it to completion, call after call
    (pipelines keep lanes and state between calls, so the loop must persist).
    ``prefer_uvloop=False``: always asyncio's loop (for many short calls, see above)."""

    def __init__(self, *, prefer_uvloop: bool = True) -> None:
        self._prefer_uvloop = prefer_uvloop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._interrupts = 0
        self._late_interrupt = False  # a first Ctrl-C after the call had finished
        self._closed = False
        self._task: asyncio.Task[Any] | None = None  # the call under way
        # Held by the call under way: a second thread's call is refused, never let onto
        # a loop running in another thread (checking ``_task`` alone left a window).
        self._calling = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or self._loop.is_closed():
            self._loop = new_event_loop(prefer_uvloop=self._prefer_uvloop)
            _RUNNER_LOOPS.add(self._loop)
            self._closed = False
        return self._loop

    def run(
        self, fn: Callable[..., Coroutine[Any, Any, T]], /, *args: Any,
        keep: Callable[[T], None] | None = None,
    ) -> T:  # fmt: skip
        """Run ``fn(*args)`` to completion on this runner's loop.

        An interrupt (Ctrl-C, or ``KeyboardInterrupt``/``SystemExit`` out of another
        task) that arrives after the call has finished, before the loop has stopped,
        is raised all the same, and the call's result is handed to ``keep`` (the
        pipeline keeps it for the next call) instead of being dropped."""
        if loop_running_in_this_thread():
            raise PipelineStateError(
                "the blocking API was called from inside a running event loop; in async "
                "code use 'await pipe.progress(...)' instead"
            )
        if not self._calling.acquire(blocking=False):  # another thread's call is under way
            raise PipelineStateError(
                "the blocking API is already running a call on this pipeline (from another "
                "thread); one call at a time"
            )
        try:
            return self._run(fn, args, keep)
        finally:
            self._calling.release()

    def _run(
        self, fn: Callable[..., Coroutine[Any, Any, T]], args: tuple[Any, ...],
        keep: Callable[[T], None] | None,
    ) -> T:  # fmt: skip
        loop = self.loop

        async def call() -> T:  # fn(*args) is made inside the loop: coroutine APIs check
            return await fn(*args)

        self._interrupts = 0  # (before the handler is installed: it counts them)
        self._late_interrupt = False
        task = loop.create_task(call())
        self._task = task
        # The C module's calls, once a blocking call each: signal.signal() and
        # getsignal() turn every handler into an enum member where they can, and for a
        # handler that is none they pay a ValueError with its repr (7.4 us of a 15.1 us
        # round trip, docs/performance.md).
        install = (
            threading.current_thread() is threading.main_thread()
            and _raw_signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if install:
            _raw_signal.signal(signal.SIGINT, self._on_sigint)
        try:
            result = loop.run_until_complete(task)
        except asyncio.CancelledError:
            if self._interrupts:
                raise KeyboardInterrupt() from None
            raise
        except BaseException:
            if not task.done():  # the loop itself was left (KeyboardInterrupt, SystemExit)
                _cancel_and_settle(loop, task)
            else:  # the call had finished: the interrupt came before the loop stopped
                failure = None if task.cancelled() else task.exception()
                if keep is not None and not task.cancelled() and failure is None:
                    keep(task.result())
                _drop_pending_stop(loop)
                if failure is not None:
                    if self._late_interrupt:  # Ctrl-C wins, the error its context
                        raise KeyboardInterrupt()
                    raise failure  # the call's own error says more than the interrupt
            raise
        finally:
            if install:
                _raw_signal.signal(signal.SIGINT, signal.default_int_handler)
            self._task = None  # (after: a Ctrl-C in between is still this call's)
        if self._late_interrupt:  # Ctrl-C after the call had finished: raised now
            if keep is not None:
                keep(result)
            raise KeyboardInterrupt()
        return result

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        task = self._task
        if task is None:  # between calls: a plain Ctrl-C
            raise KeyboardInterrupt()
        self._interrupts += 1
        loop = self._loop
        assert loop is not None
        for stop in _ON_CTRL_C.get(loop, ()):  # on the loop, ahead of the cancellation
            loop.call_soon_threadsafe(stop)
        if self._interrupts == 1 and not task.done():
            if asyncio.current_task(loop) is task or unstarted(task):
                # Handled inside the call's own step: cancelling now would turn the
                # result of a coroutine about to return into the cancellation.  Before
                # the call's first step: cancelling now would run none of it (a step()
                # would leave no trace, not even its batch owed).  So: at the next cycle.
                loop.call_soon_threadsafe(self._cancel_call, task)
            else:
                task.cancel()
                loop.call_soon_threadsafe(lambda: None)  # wake the loop
            return
        if self._interrupts == 1:
            # The call has finished: raised once the loop has stopped, not here, in
            # whatever runs meanwhile (a source's async generator read ahead would
            # be finished by it, its items lost).
            self._late_interrupt = True
            return
        raise KeyboardInterrupt()

    def _cancel_call(self, task: asyncio.Task[Any]) -> None:
        """The first Ctrl-C, at the loop's next cycle: cancel the call if it still
        runs; if it has returned meanwhile, the interrupt is raised as it ends (its
        result kept for the next call)."""
        if not task.done():
            task.cancel()
            return
        self._late_interrupt = True

    @property
    def usable(self) -> bool:
        """Whether :meth:`run` may be called now: not closed, and no loop is running
        in this thread."""
        return not self._closed and not loop_running_in_this_thread()

    def close(self) -> None:
        """Cancel what is left on the loop and close it.  Safe from a finalizer: if
        another loop runs in this thread, the loop is just closed."""
        self._closed = True
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed() or loop.is_running():
            return
        try:
            if not loop_running_in_this_thread():
                finish_loop(loop)
        finally:
            loop.close()

    def __enter__(self) -> LoopRunner:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        close_on_the_way_out(self.close, exc)


def close_on_the_way_out(close: Callable[[], None], exc: object) -> None:
    """``close()`` as a ``with`` block ends with ``exc`` (or none).  A Ctrl-C that
    stops close()'s wait while the first one's ``KeyboardInterrupt`` is on its way
    out is not raised again: one traceback, not two chained."""
    try:
        close()
    except KeyboardInterrupt:
        if not isinstance(exc, KeyboardInterrupt):
            raise


def running_task() -> asyncio.Task[Any] | None:
    """The task running now; ``None`` outside one, and where no loop runs (a lane
    thread, a coroutine closed by a finalizer)."""
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


def loop_running_in_this_thread() -> bool:
    return asyncio._get_running_loop() is not None  # (get_running_loop() raises when none)


def _cancel_and_settle(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
    """Cancel a call that a ``KeyboardInterrupt``/``SystemExit`` from a callback or
    another task left pending, and let it end now: left on the loop, it would run on
    at the next call and take that call's place (cancelled, a pipeline's caller
    returns at once; its iteration runs on like any other's)."""
    task.cancel()
    loop.run_until_complete(asyncio.wait([task]))


def _drop_pending_stop(loop: asyncio.AbstractEventLoop) -> None:
    """Run the loop one cycle, so that the ``stop()`` a finished call scheduled (the
    callback ``run_until_complete`` adds to it) runs now: left queued, it would stop
    the next call's loop at its first cycle ("Event loop stopped before Future
    completed")."""
    for _ in range(3):  # a second interrupt in that cycle: the first is on its way out
        try:
            loop.stop()
            loop.run_forever()  # stopping already: one cycle of the callbacks ready
            return
        except (KeyboardInterrupt, SystemExit):
            continue


def finish_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on ``loop`` and shut down its async generators and default
    executor (``asyncio.run``'s ending), before the owner closes it."""
    # A cancelled progress() leaves a task behind that waits for its step on the
    # lanes (IterationDriver.guard_lanes): cancel that one too.  A few rounds,
    # not forever (a task may start another as it is cancelled).  Ctrl-C here (the
    # task said what it waits for) stops waiting: the loop is closed without it.
    try:
        for _ in range(4):
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            if not pending:
                break
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    except KeyboardInterrupt:
        print(STOPPED_WAITING, file=sys.stderr)
        raise
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())


def task_quiet_if_left(
    coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop | None = None
) -> asyncio.Task[T]:
    """A task of the engine's own.  A loop closed by hand while it waits leaves it
    pending for good; the pipeline says so itself ("left unfinished on an event loop
    that was closed"), so asyncio's "Task was destroyed but it is pending!" when the
    task is collected would be noise."""
    task = (loop or asyncio.get_running_loop()).create_task(coro)
    task._log_destroy_pending = False  # type: ignore[attr-defined]
    return task


def unstarted(task: asyncio.Future[Any]) -> bool:
    """Whether ``task`` is a task whose coroutine has not taken its first step."""
    coro = _coro_of(task)
    return inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED


def close_if_unstarted(task: asyncio.Future[Any]) -> bool:
    """Close the coroutine of a task left on a closed loop before its first step:
    nothing of it ran, and collected unclosed it would warn "coroutine ... was never
    awaited".  Whether it was such a task (a started one is left as it is)."""
    if not unstarted(task):
        return False
    _coro_of(task).close()  # type: ignore[attr-defined]
    return True


def close_left(task: asyncio.Future[Any]) -> bool:
    """If ``task`` was left pending on a closed loop (stopped and closed by hand, not
    cancelled), close its coroutine: its ``finally`` clauses run now, on the caller's
    thread; nothing else would ever run them.  Collected, the task says nothing: the
    caller tells what was lost.  Whether it was so left."""
    if task.done() or not task.get_loop().is_closed():
        return False
    coro = _coro_of(task)
    if not inspect.iscoroutine(coro):
        return True
    task._log_destroy_pending = False  # type: ignore[attr-defined]
    awaited: Any = coro.cr_await
    if type(awaited).__name__ == "async_generator_asend":
        # An async generator's step: its close() would leave the generator marked
        # running for good (CPython 3.11); thrown in, GeneratorExit finishes it.
        with contextlib.suppress(BaseException):
            awaited.throw(GeneratorExit)
    with contextlib.suppress(Exception):  # its way out, not the caller's concern
        coro.close()
    return True


def close_awaited(task: asyncio.Future[Any], codes: Collection[CodeType], owner: object) -> bool:
    """Close the coroutine that ``task`` (left waiting on a closed loop) awaits,
    through any depth, whose code is one of ``codes`` and whose ``self`` is
    ``owner``: its ``finally`` clauses and handlers run now, on the caller's thread,
    not whenever the garbage collector gets to it.  Whether one was found."""
    coro = _coro_of(task)
    while inspect.iscoroutine(coro):
        frame = coro.cr_frame
        if coro.cr_code in codes and frame is not None and frame.f_locals.get("self") is owner:
            with contextlib.suppress(Exception):  # its way out, not the caller's concern
                coro.close()
            return True
        coro = coro.cr_await
    return False


def _coro_of(task: asyncio.Future[Any]) -> object:
    get_coro = getattr(task, "get_coro", None)  # a task's; another future has none
    return get_coro() if get_coro is not None else None
