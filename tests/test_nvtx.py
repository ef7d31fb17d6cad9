"""NVTX ranges: on the thread that runs each body, off by default without CUDA."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import collect

from aiopipe import Pipeline, Task, TaskContext
from aiopipe._core.nvtx import resolve_annotator


class RecordingAnnotator:
    def __init__(self) -> None:
        self.ranges: list[tuple[str, str, str]] = []

    @contextlib.contextmanager
    def push_pop(self, message: str) -> Iterator[None]:
        self.ranges.append(("push", message, threading.current_thread().name))
        yield

    def start(self, message: str) -> Any:
        self.ranges.append(("start", message, threading.current_thread().name))
        return message

    def end(self, handle: Any) -> None:
        self.ranges.append(("end", handle, threading.current_thread().name))


async def test_every_body_runs_inside_a_range_on_its_own_thread() -> None:
    annotator = RecordingAnnotator()

    async def coroutine_body(ctx: TaskContext) -> None:
        return None

    tasks = [
        Task.from_fn("h2d", lambda ctx: None, lookahead=1, stream="memcpy", nvtx_tag="copy"),
        Task.from_fn("forward", lambda ctx: None),
        Task.from_fn("report", coroutine_body),
    ]
    thread_map = {"h2d": "io", "forward": "compute", "report": "compute"}
    async with Pipeline(tasks, thread_map=thread_map, nvtx=annotator) as pipe:
        await collect(pipe, iter(range(2)))
    loop_thread = threading.current_thread().name
    assert set(annotator.ranges) == {
        ("push", "copy", "aiopipe-lane-io"),
        ("push", "forward", "aiopipe-lane-compute"),
        ("start", "report", loop_thread),  # coroutines get start/end ranges, not push/pop
        ("end", "report", loop_thread),
    }
    assert len(annotator.ranges) == 2 + 2 + 4


def test_annotator_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIOPIPE_NVTX", raising=False)
    assert resolve_annotator(None) is None  # no CUDA here
    assert resolve_annotator(None, gpu_present=lambda: True) is not None
    assert resolve_annotator(False) is None
    forced = resolve_annotator(True)
    assert forced is not None
    with forced.push_pop("real nvtx range"):  # the real package, no profiler attached
        pass
    forced.end(forced.start("real start/end range"))
    monkeypatch.setenv("AIOPIPE_NVTX", "1")
    assert resolve_annotator(None) is not None
    custom = RecordingAnnotator()
    assert resolve_annotator(custom) is custom  # type: ignore[arg-type]
