"""Driving pipelines from trio, directly or through anyio's trio backend.

The engine is built on asyncio: lane threads resolve asyncio futures through the
loop (``LoopWaker``), ``async def`` bodies run as asyncio tasks, collective
tickets are futures.  Under trio the caller's thread has no asyncio loop, so a
pipeline's public coroutines (``progress`` and ``drain``, and ``step`` / ``results``
built on them) hand each call to a private asyncio loop running on a thread of its
own -- one :class:`TrioBridge` per pipeline, started by the first trio call and
stopped by ``shutdown()``:

* the trio task awaiting the call sleeps in trio (other trio tasks keep running) and
  pulls the pipeline's *async* source itself, so a trio memory channel or socket is
  read in trio, where it belongs; sync iterators are called inline on the loop, as
  under asyncio;
* cancelling that trio task (a cancel scope, ``fail_after``, Ctrl-C) cancels the
  call on the loop and waits, shielded, until it has unwound -- what cancelling the
  caller does under asyncio: the iteration under way runs on to completion on the
  bridge loop, and the next call returns its result.  A call that completed before
  the cancellation reached it keeps its outcome (no result is lost); trio raises
  ``Cancelled`` at the caller's next checkpoint.

Not bridged: ``wait_for_event`` / ``copy_to_host`` and ``aiopipe.dag.TaskGraph``
awaited from trio code raise :class:`AsyncLibraryError`, and task bodies always run
on the asyncio loop (they may use asyncio or anyio there, never trio).

trio is never imported: it is found in ``sys.modules``, where a trio program has put
it, so programs that do not use trio never load it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import math
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from .errors import AsyncLibraryError, NoRunningLoopError, PipelineStateError
from ._core.waker import settle_future
from ._core.loops import finish_loop, new_event_loop
from .loopless import last_call_never_ran, record_loopless_call
from .sources import END, Source

__all__ = ("TrioBridge", "current_trio", "in_trio", "needs_event_loop", "running_loop")

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")

BRIDGE_THREAD_NAME = "aiopipe-trio-bridge"


def current_trio() -> Any:
    """The ``trio`` module if the caller runs under trio (and not on an asyncio loop
    of its own, as trio-asyncio provides), else ``None``."""
    if asyncio._get_running_loop() is not None:  # the cheap common case, never raises
        return None
    trio = sys.modules.get("trio")
    if trio is None:
        return None
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:  # trio is loaded, but this thread is not running it
        return None
    return trio


def in_trio() -> bool:
    """Whether the caller runs under trio rather than asyncio."""
    return current_trio() is not None


def running_loop(api: str) -> asyncio.AbstractEventLoop:
    """``asyncio.get_running_loop()`` for asyncio-only ``api``, with an error that says
    what to do when it is awaited from trio."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return loop
    if in_trio():
        raise AsyncLibraryError(
            f"{api} needs an asyncio event loop and was awaited from trio. Await it inside "
            f"an 'async def' task body (task bodies run on asyncio, also when the pipeline "
            f"is driven from trio), or use trio's own tools, e.g. "
            f"'await trio.to_thread.run_sync(event.synchronize)'."
        )
    return asyncio.get_running_loop()  # asyncio's own "no running event loop" error


def needs_event_loop(api: Callable[P, R]) -> Callable[P, R]:
    """Make coroutine API ``api`` refuse to be called with no running event loop
    (asyncio or trio), where its coroutine would silently never run."""
    name = api.__name__
    # an async iterator (from an async generator or a plain function) is iterated
    iterated = not inspect.iscoroutinefunction(api)
    awaited = f"async for result in pipe.{name}(...)" if iterated else f"await pipe.{name}(...)"

    @functools.wraps(api)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        if asyncio._get_running_loop() is not None or current_trio() is not None:
            return api(*args, **kwargs)
        owner = args[0] if args else None
        qualified = f"{type(owner).__name__ if args else 'the pipeline'}.{name}()"
        fixes = (
            f"In an ordinary script use the blocking form: 'pipe = pipe.blocking(); "
            f"pipe.{name}(...)', or run your async code with 'aiopipe.run(main())'; in "
            f"async code write '{awaited}'."
        )
        if iterated or last_call_never_ran(owner):
            # An async generator cannot be handed to a loop later; a coroutine that
            # was not run before the next call never will be.
            why = "" if iterated else ", and the coroutine of the previous call never ran"
            kind = "an async generator" if iterated else "a coroutine function"
            raise NoRunningLoopError(
                f"{qualified} is {kind} and was called with no event loop running{why}. "
                f"{fixes}"
            )
        # asyncio.run(pipe.progress(it)) makes the coroutine first, then runs it.
        hint = f"{qualified} returned a coroutine (no event loop was running). {fixes}"
        return record_loopless_call(owner, api(*args, **kwargs), hint)  # type: ignore[arg-type, return-value]

    return checked


class TrioBridge:
    """A private asyncio loop on its own thread that runs one pipeline's calls for
    trio callers.  Costs nothing until the first call: the thread starts then."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: weakref.finalize[Any, Any] | None = None
        self._closed = False
        #: The stand-in last made: the same source passed again gets it back (the
        #: pipeline knows a source by identity; it may hold an item, ``kept``).
        self._stand_in: _CallerSource | None = None

    async def call(self, fn: Callable[..., Awaitable[T]], /, *args: Any) -> T:
        """``await fn(*args)`` on the bridge loop, from a trio task.  Async iterators
        among ``args`` must come from :meth:`source_for`."""
        trio = sys.modules["trio"]
        call = _Call(trio, self._ensure_loop())
        call.start(fn, args)
        try:
            await call.serve(closing=False)
        except BaseException as exc:
            call.cancel()
            with trio.CancelScope(shield=True):
                await call.serve(closing=True)  # as under asyncio: wait until it unwound
            if call.cancelled() or not isinstance(exc, trio.Cancelled):
                raise
            # It completed before the cancellation reached it: keep its outcome (a
            # result is never lost); trio re-raises Cancelled at the next checkpoint.
        return call.outcome()  # type: ignore[no-any-return]

    def source_for(self, source: Source, current: Source | None) -> Source:
        """What the bridge loop should be given for ``source``: an async iterator is
        replaced by a stand-in that the trio caller pulls -- the same stand-in as
        ``current`` (the pipeline's source) or as the last call's when that already
        stands for ``source``, because the pipeline recognises its source by identity."""
        if isinstance(current, _CallerSource) and current.source is source:
            return current
        last = self._stand_in
        if last is not None and last.source is source:  # after a drain(), say: it goes on
            return last
        if isinstance(source, AsyncIterator):
            self._stand_in = _CallerSource(source)
            return self._stand_in
        return source

    def close(self) -> None:
        """Stop the loop thread (idempotent); later calls are refused."""
        with self._lock:
            self._closed = True
            stop, self._stop, self._loop = self._stop, None, None
        if stop is not None:
            stop()

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise PipelineStateError("the pipeline has been shut down")
            if self._loop is None:
                loop = new_event_loop()
                thread = threading.Thread(
                    target=_serve_forever, args=(loop,), name=BRIDGE_THREAD_NAME, daemon=True
                )
                thread.start()
                # A pipeline dropped without shutdown() still lets the thread end.
                self._stop = weakref.finalize(self, _stop_loop, loop, thread)
                self._loop = loop
            return self._loop


def _serve_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
        finish_loop(loop)
    finally:
        loop.close()


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:  # already closed
        return
    if threading.current_thread() is not thread:
        thread.join(10.0)


#: The bridged call the current asyncio task belongs to (set inside that task only).
_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "aiopipe_trio_call", default=None
)
_DONE = object()


class _Call:
    """One bridged call: an asyncio task on the bridge loop, and the trio task that
    waits for it and pulls its async source."""

    def __init__(self, trio: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._trio = trio
        self._loop = loop
        self._token = trio.lowlevel.current_trio_token()
        # Unbounded: the loop thread posts without ever blocking; at most one pull
        # and the completion are outstanding.
        self._send, self._receive = trio.open_memory_channel(math.inf)
        self._task: asyncio.Task[Any] | None = None
        self._finished = False

    # -- trio side ---------------------------------------------------------------------

    def start(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        self._loop.call_soon_threadsafe(self._create_task, fn, args)

    def cancel(self) -> None:
        # Queued after _create_task (call_soon_threadsafe keeps order): the task exists.
        self._loop.call_soon_threadsafe(self._cancel_task)

    async def serve(self, *, closing: bool) -> None:
        """Until the task has finished, pull the async source for it -- or, once the
        call is being cancelled, refuse pulls (a pull may wait forever)."""
        while not self._finished:
            message = await self._receive.receive()
            if message is _DONE:
                self._finished = True
            elif closing:
                self._loop.call_soon_threadsafe(message[1].cancel)
            else:
                await self._pull(*message)

    async def _pull(self, source: AsyncIterator[Any], future: asyncio.Future[Any]) -> None:
        try:
            item = await anext(source, END)
        except Exception as exc:  # the source's own error: the pipeline raises it
            self._loop.call_soon_threadsafe(settle_future, future, exc, None)
        else:
            self._loop.call_soon_threadsafe(settle_future, future, None, item)

    def cancelled(self) -> bool:
        return self._task is not None and self._task.cancelled()

    def outcome(self) -> Any:
        if self._task is None or not self._task.done():
            raise RuntimeError("the bridged call has not finished")  # a bug here, not the user's
        try:
            return self._task.result()
        except (RuntimeError, AttributeError) as exc:
            if _raised_in_trio(exc):
                raise AsyncLibraryError(
                    f"a task body awaited trio ({type(exc).__name__}: {exc}). Task bodies run "
                    f"on the pipeline's asyncio loop even when it is driven from trio: use "
                    f"asyncio or anyio inside them and keep trio code in the caller."
                ) from exc
            raise

    # -- loop side ---------------------------------------------------------------------

    def _create_task(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        self._task = self._loop.create_task(self._run(fn, args))
        self._task.add_done_callback(lambda _: self._post(_DONE))

    async def _run(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> Any:
        _CALL.set(self)
        # The task inherited the trio caller's context, where anyio.run(backend="trio")
        # records "trio" for sniffio: anyio inside task bodies must see asyncio.
        sniffio = sys.modules.get("sniffio")
        if sniffio is not None:
            sniffio.current_async_library_cvar.set("asyncio")
        return await fn(*args)

    def _cancel_task(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def pull(self, source: AsyncIterator[Any]) -> asyncio.Future[Any]:
        """From the bridged task: ask the caller for the next item of ``source``; the
        future gets it (or the source's error)."""
        future = self._loop.create_future()
        self._post((source, future))
        return future

    def _post(self, message: object) -> None:
        try:
            self._token.run_sync_soon(self._send.send_nowait, message)
        except self._trio.RunFinishedError:  # the caller's trio run is gone
            pass


def _raised_in_trio(exc: BaseException) -> bool:
    """Whether ``exc`` came out of trio's code: trio primitives outside a trio run
    fail with a RuntimeError or AttributeError from trio's internals."""
    tb = exc.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module == "trio" or module.startswith("trio."):
            return True
        tb = tb.tb_next
    return False


class _CallerSource:
    """Stands, on the bridge loop, for an async iterator of the trio caller: each
    item is pulled by the trio task awaiting the current call."""

    __slots__ = ("kept", "source")
    #: Pulled by the trio caller during its own call, so never read ahead between calls.
    pulled_inline = True

    @property
    def aiopipe_wraps(self) -> AsyncIterator[Any]:
        """The caller's iterator (:func:`aiopipe.sources.innermost`)."""
        return self.source

    def __init__(self, source: AsyncIterator[Any]) -> None:
        self.source = source
        #: A pull that had its item (or the source's error) when its call was
        #: cancelled: the next pull hands that out.
        self.kept: asyncio.Future[Any] | None = None

    def __aiter__(self) -> _CallerSource:
        return self

    async def __anext__(self) -> Any:
        call = _CALL.get()
        if call is None:
            raise PipelineStateError(
                "this source belongs to a trio caller and can only be pulled during its calls"
            )
        pulled, self.kept = self.kept, None
        if pulled is None:
            pulled = call.pull(self.source)
        try:
            item = await pulled
        except asyncio.CancelledError:
            # The caller took the item from its source, then was cancelled before this
            # task resumed (the item reaches the loop first, the cancellation after).
            if pulled.done() and not pulled.cancelled():
                self.kept = pulled
            raise
        if item is END:
            raise StopAsyncIteration
        return item

    def __repr__(self) -> str:
        return f"<pulled in trio: {self.source!r}>"
