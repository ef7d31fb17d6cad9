"""``StreamPool``: named streams, and the event operations the engine issues on them.

A pool maps stream names to CUDA streams, or to ``None`` for a *CPU null stream*:
every operation on a null stream is a no-op, so the same schedule runs on a machine
without CUDA.  Any object with ``record_event()``, ``wait_event(event)`` and
``wait_stream(stream)`` is accepted as a stream, which is how the event protocol is
tested without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from .errors import ConfigurationTypeError

__all__ = ("EventLike", "StreamLike", "StreamPool")


@runtime_checkable
class EventLike(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


@runtime_checkable
class StreamLike(Protocol):
    def record_event(self, event: Any = None) -> Any: ...
    def wait_event(self, event: Any) -> None: ...
    def wait_stream(self, stream: Any) -> None: ...


def _is_cuda_stream(stream: object) -> bool:
    return isinstance(stream, torch.cuda.Stream)


class _OnStream:
    """``torch.cuda.stream(stream)`` for one task body, in fewer calls.

    The engine enters a stream around every task body on a device stream, so its
    cost is paid a dozen times a step on a launch-bound one.  torch's context looks
    the device up and builds ``torch.device`` objects on each entry; this one
    compares device indexes and keeps torch's semantics: the stream (and with it its
    device) is current inside, and on the way out the stream each device had is
    current again, and the thread's device is its own again.
    """

    __slots__ = ("_stream", "_previous", "_other_previous")

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._other_previous: Any = None

    def __enter__(self) -> Any:
        stream = self._stream
        # With no device named, torch.cuda.current_stream() checks CUDA's availability
        # (environment included) on every call: 20 us, the most of the whole switch.
        device = torch.cuda.current_device()
        self._previous = torch.cuda.current_stream(device)
        if device != stream.device_index:
            self._other_previous = torch.cuda.current_stream(stream.device_index)
        torch.cuda.set_stream(stream)  # its device becomes the thread's current one
        return stream

    def __exit__(self, *exc_info: object) -> None:
        if self._other_previous is not None:
            torch.cuda.set_stream(self._other_previous)
        torch.cuda.set_stream(self._previous)


class StreamPool:
    """Named streams for a schedule.  ``None`` values are CPU null streams."""

    def __init__(self, streams: Mapping[str, StreamLike | None]) -> None:
        if not isinstance(streams, Mapping):
            raise ConfigurationTypeError("StreamPool takes a mapping {name: stream or None}")
        for name, stream in streams.items():
            if not isinstance(name, str) or not name:
                raise ConfigurationTypeError(
                    f"stream names must be non-empty strings, got {name!r}"
                )
            if stream is not None and not isinstance(stream, StreamLike):
                raise ConfigurationTypeError(
                    f"stream {name!r} must be a torch.cuda.Stream, None (CPU null stream) or "
                    f"provide record_event/wait_event/wait_stream; got {stream!r}"
                )
        self._streams: dict[str, StreamLike | None] = dict(streams)
        #: True when every stream is a null stream: executors skip event work entirely.
        self.is_null = all(stream is None for stream in self._streams.values())

    @classmethod
    def for_device(
        cls, names: Iterable[str], device: torch.device | str | None = None
    ) -> StreamPool:
        """Null streams on CPU; on CUDA, ``"default"`` is the device's current stream
        and every other name gets a new stream."""
        device = torch.device(device) if device is not None else None
        if device is None or device.type != "cuda":
            return cls({name: None for name in names})
        streams: dict[str, StreamLike | None] = {}
        for name in names:
            if name == "default":
                streams[name] = torch.cuda.current_stream(device)
            else:
                streams[name] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return cls(streams)

    def __contains__(self, name: object) -> bool:
        return name in self._streams

    def names(self) -> tuple[str, ...]:
        return tuple(self._streams)

    def get(self, name: str) -> StreamLike | None:
        try:
            return self._streams[name]
        except KeyError:
            raise KeyError(f"stream {name!r} is not in this StreamPool {self.names()}") from None

    def use(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Make ``name`` the current CUDA stream of this thread (no-op otherwise).

        Only ever enter this inside synchronous code: the current stream is
        thread-local and must not be held across an ``await``.
        """
        stream = self._streams[name]
        if _is_cuda_stream(stream):
            return _OnStream(stream)
        return contextlib.nullcontext()

    def record_event(self, name: str) -> Any:
        """Record an event on ``name``; ``None`` on a null stream."""
        stream = self._streams[name]
        return None if stream is None else stream.record_event()

    def wait_event(self, name: str, event: Any) -> None:
        """Make ``name`` wait for ``event`` on the device, without blocking the host."""
        stream = self._streams[name]
        if stream is not None and event is not None:
            stream.wait_event(event)

    def wait_stream(self, name: str, producer: str) -> None:
        """Make ``name`` wait for everything queued on ``producer`` so far."""
        stream, other = self._streams[name], self._streams[producer]
        if stream is not None and other is not None and stream is not other:
            stream.wait_stream(other)

    def __iter__(self) -> Iterator[str]:
        return iter(self._streams)

    def __repr__(self) -> str:
        kinds = {n: ("null" if s is None else type(s).__name__) for n, s in self._streams.items()}
        return f"StreamPool({kinds})"
