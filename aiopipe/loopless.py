"""``LoopLessCall``: the coroutine a coroutine API returns when no event loop runs.

``asyncio.run(pipe.progress(it))`` and ``aiopipe.run(pipe.progress(it))`` make the
coroutine before any loop runs, and then run it: that is fine.  The trap is an
ordinary script that calls ``pipe.progress(it)`` with no ``await`` and no loop at all:
its coroutine never runs.  So the call returns its coroutine wrapped in a
:class:`LoopLessCall`, which remembers whether it was started; the next loop-less call
on the same pipeline raises :class:`~aiopipe.errors.NoRunningLoopError` if the last one
never was, and using the result as a value (``loss.item()``, ``float(loss)``, ``total
+ loss``, ``loss[0]``, ``f"{loss:.3f}"``) says why it is no value.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar

__all__ = ("LoopLessCall", "last_call_never_ran", "record_loopless_call")

T = TypeVar("T")


class _Started:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = False


# Per pipeline: whether its last loop-less call was started or closed (kept apart from
# the call, so a call collected unstarted is still known as never run).
_LAST: weakref.WeakKeyDictionary[Any, _Started] = weakref.WeakKeyDictionary()


def last_call_never_ran(owner: Any) -> bool:
    """Whether ``owner``'s previous loop-less call returned a coroutine that nobody
    ran nor closed."""
    try:
        started = _LAST.get(owner)
    except TypeError:  # not weak-referenceable: not tracked
        return False
    return started is not None and not started.value


class LoopLessCall(Coroutine[Any, Any, T], Generic[T]):
    """A coroutine made with no event loop running; it runs when a loop runs it."""

    __slots__ = ("_coro", "_hint", "_started")

    def __init__(self, coro: Coroutine[Any, Any, T], started: _Started, hint: str) -> None:
        self._coro, self._started, self._hint = coro, started, hint

    def send(self, value: Any) -> Any:
        self._started.value = True
        return self._coro.send(value)

    def throw(self, *args: Any) -> Any:
        self._started.value = True
        return self._coro.throw(*args)

    def close(self) -> None:
        self._started.value = True  # dropped on purpose: no trap
        self._coro.close()

    def __await__(self) -> Generator[Any, None, T]:
        self._started.value = True
        return self._coro.__await__()

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("cr_", "__")):  # asyncio's introspection of coroutines
            return getattr(self._coro, name)
        raise AttributeError(f"a coroutine has no attribute {name!r}: {self._hint}")

    def __repr__(self) -> str:
        return f"<LoopLessCall {self._coro!r}>"

    # Used as the value it is not (``float(loss)``, ``total + loss``, ``loss[0]``,
    # ``f"{loss:.3f}"``): say why, as an attribute does.
    def _no_value(self, *args: Any) -> Any:
        raise TypeError(f"a coroutine is not a value: {self._hint}")

    __float__ = __int__ = __getitem__ = _no_value
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _no_value
    __truediv__ = __rtruediv__ = _no_value
    __lt__ = __le__ = __gt__ = __ge__ = __neg__ = __pow__ = _no_value  # (loss < 1)

    def __format__(self, spec: str) -> str:
        if spec:
            self._no_value()
        return repr(self)

    def __del__(self) -> None:
        if self._started.value:
            return
        # Dropped unstarted (a single call in a plain script): say so with the fix, in
        # place of Python's bare "coroutine ... was never awaited", which closing it
        # here silences.  The next loop-less call still raises.
        try:
            warnings.warn(f"{self._hint} It was never awaited, so nothing ran.", RuntimeWarning,
                          stacklevel=2)  # fmt: skip
        except Exception:  # the interpreter shutting down, or warnings made errors
            pass
        self._coro.close()


def record_loopless_call(owner: Any, coro: Coroutine[Any, Any, T], hint: str) -> LoopLessCall[T]:
    """Wrap ``coro``, made by a call on ``owner`` with no event loop running."""
    started = _Started()
    try:
        _LAST[owner] = started
    except TypeError:
        pass
    return LoopLessCall(coro, started, hint)
