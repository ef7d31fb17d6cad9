"""What the pipelines take as a source: a sync or async iterator (``Source``), made
from an iterable for one pass (:func:`iterate`), the one-batch source behind
``step(batch)``, the marker of a source's end, and the error for anything else."""

from __future__ import annotations

import inspect
import reprlib
import traceback
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, Union

import torch

from .errors import ConfigurationTypeError

__all__ = (
    "END", "Lost", "OneBatch", "Source", "Taken", "closed_between_pulls", "ended_by_interrupt",
    "finished_generator", "innermost", "iterate", "not_a_source",
)  # fmt: skip

#: What a feed takes at a source's end (:meth:`~aiopipe.source.Feed.take`).
END: Any = object()
Source = Union[Iterator[Any], AsyncIterator[Any]]
Taken = tuple[Any, Union[BaseException, None]]


def iterate(items: Iterable[Any] | AsyncIterable[Any]) -> Source:
    """The source for one pass over ``items``, as ``for`` / ``async for`` would make it:
    an iterator is returned as it is (the pass continues where it stands), an
    iterable gets a fresh iterator (``iter()`` / ``aiter()``: a new pass, a new epoch
    of a ``DataLoader``)."""
    given: object = items  # checked at run time: callers pass anything
    if isinstance(given, (Iterator, AsyncIterator)):
        return given
    if isinstance(given, AsyncIterable):
        return aiter(given)
    if isinstance(given, Iterable):
        return iter(given)
    raise not_a_source("results()", items, "an iterable or async iterable of batches")


def not_a_source(
    call: str, given: object, wanted: str = "a sync or async iterator"
) -> ConfigurationTypeError:
    """The error for ``call`` given ``given`` instead of ``wanted`` (its repr cut short:
    a batch's tensors can run to pages); a generator function passed uncalled gets
    asked "did you mean gen()?", an iterable where an iterator is wanted how to make
    one."""
    if inspect.isgeneratorfunction(given) or inspect.isasyncgenfunction(given):
        kind = "an async generator" if inspect.isasyncgenfunction(given) else "a generator"
        name = getattr(given, "__name__", "gen")
        return ConfigurationTypeError(
            f"{call} takes {wanted}, got {kind} function: did you mean {name}()?"
        )
    if wanted.endswith("iterator") and isinstance(given, (torch.Tensor, Mapping)):
        # Iterable, but most likely one batch: iterating it would train its rows
        # (or keys) one by one.
        return ConfigurationTypeError(
            f"{call} takes an iterator of batches, got one {type(given).__name__}: for a "
            f"single batch call step(batch); for several, pass an iterator over them "
            f"(iter([batch, ...]), a DataLoader's iterator)"
        )
    if wanted.endswith("iterator") and (hasattr(given, "__iter__") or hasattr(given, "__aiter__")):
        kind = type(given).__name__
        return ConfigurationTypeError(
            f"{call} takes an iterator, got the iterable {kind}: create it once with "
            f"iter(...) / aiter(...) and pass the same iterator on every call (a fresh "
            f"iterator per call would restart the pipeline), or loop over "
            f"results({kind}), which does that for you"
        )
    return ConfigurationTypeError(f"{call} takes {wanted}, got {reprlib.repr(given)}")


class OneBatch(Iterator[Any]):
    """The one-item source behind ``step(batch)``."""

    __slots__ = ("_batch", "_taken")

    def __init__(self, batch: Any) -> None:
        self._batch, self._taken = batch, False

    def __next__(self) -> Any:
        if self._taken:
            raise StopIteration
        self._taken = True
        return self._batch

    @property
    def taken(self) -> bool:
        """Whether its batch was taken (or withdrawn).  Until then ``drain()`` still
        takes it: a ``step()`` cancelled before its batch was pulled still trains it."""
        return self._taken

    def withdraw(self) -> None:
        """Never to be trained (its ``step()`` raised, or ``reset()`` dropped it): the
        source ends without giving it."""
        self._taken = True


def innermost(source: Any) -> Any:
    """The iterator behind ``source``.  A wrapper that reads another iterator for the
    pipeline (the trio bridge's stand-in, an adapter dropping a source's last items)
    names it in ``aiopipe_wraps``: a generator finished under the wrapper is then
    recognised, and refused by name rather than taken for one that ran dry."""
    for _ in range(16):  # (a wrapper naming itself would loop)
        inner = getattr(source, "aiopipe_wraps", None)
        if inner is None:
            break
        source = inner
    return source


def finished_generator(source: object) -> bool:
    """Whether ``source`` is an async generator that is finished: ended, or closed
    (by its loop's shutdown, ``aclose()``, or a pull closed on a closed loop)."""
    return inspect.isasyncgen(source) and source.ag_frame is None


def ended_by_interrupt(source: object, interrupt: BaseException) -> str | None:
    """Why ``source``, a generator (sync or async) that ``interrupt`` (a
    ``KeyboardInterrupt``/``SystemExit``) came out of, cannot give its remaining
    items: raised through its frame, the interrupt finished it.  ``None`` where
    ``source`` is no such generator (an iterator of another kind reads on)."""
    if inspect.isasyncgen(source):
        finished, code, what = source.ag_frame is None, source.ag_code, "this async generator"
    elif inspect.isgenerator(source):
        finished, code, what = source.gi_frame is None, source.gi_code, "this generator"
    else:
        return None
    # (Through the generator's own code: a wrapper reading it ahead may have read it
    # to its end before the interrupt came out of the wrapper.)
    if not finished or not any(frame.f_code is code for frame, _ in
                               traceback.walk_tb(interrupt.__traceback__)):  # fmt: skip
        return None
    return (
        f"{what} raised {type(interrupt).__name__} while it was read (a Ctrl-C that "
        f"landed in its code, or its own raise), which finished it"
    )


class Lost(NamedTuple):
    """Why a source can give no more items: ``why``, said in the errors, and whether
    it was lost to an event loop's life (closed with its loop, or by a caller's
    cancellation), which keeping every call on one loop avoids -- not to an interrupt
    of its own or to its pipeline."""

    why: str
    to_its_loop: bool

    def __str__(self) -> str:
        return self.why


def closed_between_pulls(what: str) -> str:
    """Why ``what``, an async generator finished though it never ended, cannot give
    its remaining items."""
    return (
        f"{what} was closed between two pulls without having ended: the event loop "
        f"that first iterated it shut down (asyncio.run() and aiopipe.run() close the "
        f"async generators their loop iterated when they return), or it was aclose()d"
    )
