"""What the engine's stream and event work costs a task on a GPU's host.

Every task on a device stream has its stream made current around its body, its event
waits issued and, where a consumer on another stream needs it, an event recorded.
On a step bound by the host's kernel launches that work is on the critical path, a
dozen times a step.  Two parts, each in interleaved rounds (median, spread):

* the CUDA calls themselves, microseconds a call: ``torch.cuda.stream(s)`` against
  the engine's own switch (``StreamPool.use``), and what they are made of;
* fourteen no-op tasks shaped like the HSTU step (``hstu_shape``), microseconds a
  task: null streams (the CPU path) against CUDA streams, with the engine's switch
  and with ``torch.cuda.stream`` in its place ("before") or a candidate switch by
  raw stream ids (``RawIdSwitch``, "raw ids"): the difference is the stream and
  event work.

Needs a CUDA device (``./dev gpu-suite`` runs it).

    ./dev bench stream_cost [--calls 20000] [--iterations 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _common import (  # noqa: E402
    interleaved_rounds,
    print_json,
    print_table,
    run_on,
    time_progress,
    with_spread,
)
from hstu_shape import HSTU_TASKS, STREAMS, hstu_schedule, noop  # noqa: E402

from aiopipe import SchedulablePipeline, StreamPool  # noqa: E402


@contextlib.contextmanager
def torch_stream_context() -> Iterator[None]:
    """``StreamPool.use`` as it was: ``torch.cuda.stream(stream)`` around each body
    (the "before" rows, here and in ``hstu_steps``)."""
    engines = StreamPool.use

    def use(self: StreamPool, name: str) -> Any:
        stream = self.get(name)
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()  # type: ignore[arg-type]

    StreamPool.use = use  # type: ignore[method-assign]
    try:
        yield
    finally:
        StreamPool.use = engines  # type: ignore[method-assign]


class RawIdSwitch:
    """A candidate for the engine's switch, measured here before it is adopted: the
    current stream read and set by ids through torch's own private calls (what
    ``torch.cuda.current_stream`` and ``set_stream`` wrap), so no ``Stream`` object is
    built on the way in or out; the switch skipped where the stream is current."""

    __slots__ = ("_stream", "_device", "_previous", "_other")

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __enter__(self) -> Any:
        stream, get = self._stream, torch._C._cuda_getCurrentStream
        device = self._device = torch.cuda.current_device()
        previous = get(device)  # (stream id, device index, device type)
        if previous[0] == stream.stream_id and previous[1] == stream.device_index:
            self._previous = None
            return stream
        self._previous = previous
        self._other = get(stream.device_index) if device != stream.device_index else None
        torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                                 device_type=stream.device_type)  # fmt: skip
        return stream

    def __exit__(self, *exc_info: object) -> None:
        set_ids = torch._C._cuda_setStream
        if self._previous is None:  # a body that left another stream or device current
            stream = self._stream
            if (torch.cuda.current_device() != self._device
                    or torch._C._cuda_getCurrentStream(self._device)[0] != stream.stream_id):
                set_ids(stream_id=stream.stream_id, device_index=stream.device_index,
                        device_type=stream.device_type)
            return  # fmt: skip
        for ids in (self._other, self._previous):
            if ids is not None:
                set_ids(stream_id=ids[0], device_index=ids[1], device_type=ids[2])


@contextlib.contextmanager
def raw_id_switch() -> Iterator[None]:
    """``StreamPool.use`` with :class:`RawIdSwitch` (the "raw ids" rows)."""
    engines = StreamPool.use

    def use(self: StreamPool, name: str) -> Any:
        stream = self.get(name)
        return RawIdSwitch(stream) if stream is not None else contextlib.nullcontext()

    StreamPool.use = use  # type: ignore[method-assign]
    try:
        yield
    finally:
        StreamPool.use = engines  # type: ignore[method-assign]


def per_call(body: Callable[[], None], calls: int) -> float:
    """Microseconds a call of ``body``."""
    start = time.perf_counter()
    for _ in range(calls):
        body()
    return (time.perf_counter() - start) * 1e6 / calls


def call_rows(calls: int) -> dict[str, Callable[[], float]]:
    pool = StreamPool.for_device(["default", "side"], "cuda")
    side = pool.get("side")
    event = side.record_event()  # type: ignore[union-attr]

    def torch_context() -> None:
        with torch.cuda.stream(side):  # type: ignore[arg-type]
            pass

    def engine_switch() -> None:
        with pool.use("side"):
            pass

    def engine_current() -> None:
        with pool.use("default"):
            pass

    def raw_switch() -> None:
        with RawIdSwitch(side):
            pass

    def raw_current() -> None:
        with RawIdSwitch(pool.get("default")):
            pass

    rows: dict[str, Callable[[], None]] = {
        "with torch.cuda.stream(s)": torch_context,
        "with StreamPool.use(name) (the engine's)": engine_switch,
        "with StreamPool.use(name), its stream already current": engine_current,
        "with RawIdSwitch(s) (a candidate)": raw_switch,
        "with RawIdSwitch(s), its stream already current": raw_current,
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "torch.cuda.set_stream(current)": lambda: torch.cuda.set_stream(torch.cuda.current_stream()),
        "s.record_event() (a new event)": side.record_event,  # type: ignore[union-attr]
        "event.record(s) (the same event)": lambda: event.record(side),
        "s.wait_event(event)": lambda: side.wait_event(event),  # type: ignore[union-attr]
    }  # fmt: skip
    return {name: lambda b=body: per_call(b, calls) for name, body in rows.items()}


def task_rows(iterations: int) -> dict[str, Callable[[], float]]:
    """Microseconds a task, fourteen no-op tasks a step, ``progress()`` per step."""

    switches = {"": contextlib.nullcontext, "before": torch_stream_context,
                "raw ids": raw_id_switch}  # fmt: skip

    def measure(device: str | None, executor: str | None, switch: str) -> float:
        pool = StreamPool.for_device(STREAMS, device)
        kwargs: dict[str, Any] = {} if executor is None else {"executor": executor}
        pipe = SchedulablePipeline(hstu_schedule(lambda name: noop), stream_pool=pool, **kwargs)
        try:
            with switches[switch]():
                seconds = run_on(asyncio.new_event_loop, time_progress(pipe, iterations))
        finally:
            pipe.shutdown()
        torch.cuda.synchronize()
        return seconds * 1e6 / len(HSTU_TASKS)

    rows = {}
    for executor, label in ((None, "lane (default)"), ("sequential", "sequential")):
        rows[f"{label}, null streams"] = (None, executor, "")
        rows[f"{label}, CUDA streams"] = ("cuda", executor, "")
        rows[f"{label}, CUDA streams, before"] = ("cuda", executor, "before")
        rows[f"{label}, CUDA streams, raw ids"] = ("cuda", executor, "raw ids")
    return {name: lambda a=a: measure(*a) for name, a in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls a round (the calls)")
    parser.add_argument("--iterations", type=int, default=2000, help="steps a round (the tasks)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("stream_cost needs a CUDA device (./dev gpu-suite runs it on one)")
    tables = {}
    for part, rows in (("calls", call_rows(args.calls)), ("tasks", task_rows(args.iterations))):
        samples = interleaved_rounds(rows, args.repeats, warmup=True,
                                     show=lambda us: f"{us:.2f}")  # fmt: skip
        tables[part] = {name: statistics.median(us) for name, us in samples.items()}
        unit = "us a call" if part == "calls" else "us a task"
        print_table(
            f"{part}: {unit}, median of {args.repeats} rounds (+- half their range)",
            ["what", unit], [[name, with_spread(us, 2)] for name, us in samples.items()],
        )  # fmt: skip
    tasks = tables["tasks"]
    for label in ("lane (default)", "sequential"):
        null = tasks[f"{label}, null streams"]
        print(f"{label}: stream and event work {tasks[f'{label}, CUDA streams'] - null:.2f} us "
              f"a task, {tasks[f'{label}, CUDA streams, before'] - null:.2f} before, "
              f"{tasks[f'{label}, CUDA streams, raw ids'] - null:.2f} by raw ids")  # fmt: skip
    print_json("stream_cost", {"us_per_call": tables["calls"], "us_per_task": tasks,
                               "device": torch.cuda.get_device_name()})  # fmt: skip


if __name__ == "__main__":
    main()
