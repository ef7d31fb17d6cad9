"""The blocking form for ordinary scripts, and aiopipe.run."""

from __future__ import annotations

import asyncio
import gc
import signal
import subprocess
import sys
import textwrap
import threading
import weakref
from typing import Any

import pytest

import aiopipe
from aiopipe import BlockingPipeline, Pipeline, PipelineStateError, Task, TaskContext
from aiopipe._core.loops import LoopRunner


def echo_pipeline(executor: str = "async") -> Pipeline:
    tasks = [
        Task.from_fn("load", lambda ctx: ctx.slots.set("x", ctx.slots["batch_cpu"] * 2),
                     lookahead=1, stream="memcpy", writes=("x",)),
        Task.from_fn("step", lambda ctx: ctx.slots.set("step_result", ctx.slots["x"]),
                     reads=("x",), writes=("step_result",)),
    ]  # fmt: skip
    return Pipeline(tasks, executor=executor)


@pytest.mark.parametrize("executor", ["sequential", "async"])
def test_blocking_progress_raises_stop_iteration_like_torchrec(executor: str) -> None:
    with echo_pipeline(executor).blocking() as pipe:
        source = iter(range(4))
        results = []
        while True:
            try:
                results.append(pipe.progress(source))
            except StopIteration:
                break
        assert results == [0, 2, 4, 6]
        with pytest.raises(StopIteration):
            pipe.progress(source)


def test_blocking_results_and_drain() -> None:
    with echo_pipeline().blocking() as pipe:
        assert list(pipe.results(iter(range(3)))) == [0, 2, 4]
        source = iter(range(5))
        assert pipe.progress(source) == 0
        assert pipe.drain() == [2, 4]  # the batch in the ring, the one read ahead
        assert list(pipe.results(source)) == [6, 8]


def test_blocking_results_of_an_iterable_is_one_pass_per_call() -> None:
    loader = range(3)
    with echo_pipeline().blocking() as pipe:
        assert list(pipe.results(loader)) == [0, 2, 4]
        assert list(pipe.results(loader)) == [0, 2, 4]


def test_blocking_source_switch_error_names_no_async_exception() -> None:
    """A script's user never sees ``StopAsyncIteration``: the message must not name it."""
    with echo_pipeline().blocking() as pipe:
        assert pipe.progress(iter(range(5))) == 0
        with pytest.raises(PipelineStateError, match="new iterator was passed") as caught:
            pipe.progress(iter(range(5)))
        assert "StopAsyncIteration" not in str(caught.value)
        assert "call drain() first" in str(caught.value)


async def test_blocking_refuses_inside_a_running_loop() -> None:
    pipe = echo_pipeline().blocking()
    with pytest.raises(PipelineStateError, match="await pipe.progress"):
        pipe.progress(iter(range(3)))
    pipe.pipeline.shutdown()


def test_a_pipeline_dropped_right_after_a_step_is_garbage_at_once() -> None:
    """The lane wakes the caller only once it has let go of its work item: a script
    dropping the pipeline the moment a step returns leaves nothing that a single
    collection misses (a lane woken earlier still held it, and its thread lived on)."""
    for _ in range(5):
        pipe = echo_pipeline("async").blocking()
        assert pipe.progress(iter(range(3))) == 0
        dropped = weakref.ref(pipe.pipeline)
        lanes = [t for t in threading.enumerate() if t.name.startswith("aiopipe-lane")]
        assert lanes
        del pipe
        gc.collect()
        assert dropped() is None
        for lane in lanes:
            lane.join(10)
            assert not lane.is_alive()


def test_blocking_shutdown_is_idempotent() -> None:
    pipe = echo_pipeline().blocking()
    assert pipe.progress(iter(range(2))) == 0
    pipe.shutdown()
    pipe.shutdown()
    with pytest.raises(PipelineStateError):
        pipe.progress(iter(range(2)))


def test_run_uses_uvloop_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    async def loop_type() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert aiopipe.run(loop_type()).startswith("uvloop")
    monkeypatch.setenv("AIOPIPE_UVLOOP", "0")
    assert aiopipe.run(loop_type()).startswith("asyncio")


def test_the_blocking_form_runs_on_asyncio_s_loop() -> None:
    # It starts and stops its loop on every call, which costs more on uvloop.
    seen: list[str] = []

    async def record_loop(ctx: TaskContext) -> None:
        seen.append(type(asyncio.get_running_loop()).__module__)
        ctx.slots.set("step_result", ctx.batch_index)

    with Pipeline([Task.from_fn("step", record_loop, writes=("step_result",))]).blocking() as pipe:
        assert list(pipe.results(range(3))) == [0, 1, 2]
    assert seen and all(module.startswith("asyncio") for module in seen)


async def test_run_refuses_inside_a_running_loop() -> None:
    async def nothing() -> None:
        return None

    with pytest.raises(PipelineStateError):
        aiopipe.run(nothing())


CTRL_C_SCRIPT = textwrap.dedent(
    """
    import os, signal, threading, time
    from aiopipe import Pipeline, Task

    # A shell's background job starts with Ctrl-C ignored: take the interpreter's default.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def slow(ctx):
        if ctx.batch_index == 2 and ctx.task.name == "load":
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)

    def step(ctx):
        slow(ctx)
        ctx.slots.set("step_result", ctx.batch_index)

    tasks = [Task.from_fn("load", slow, lookahead=1, stream="memcpy"),
             Task.from_fn("step", step, writes=("step_result",))]
    pipe = Pipeline(tasks, executor="async").blocking()
    source = iter(range(6))
    results = []
    try:
        while True:
            results.append(pipe.progress(source))
    except KeyboardInterrupt:
        print("interrupted after", results)
    results += list(pipe.results(source))  # the interrupted iteration's result first
    print("every result once, in order:", results == list(range(6)))
    pipe.shutdown()
    print("lanes left:", [t.name for t in threading.enumerate() if t.name.startswith("aiopipe")])
    """
)


def test_ctrl_c_interrupts_cleanly_and_the_pipeline_carries_on() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CTRL_C_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == [
        "interrupted after [0]",  # the call that would return batch 1
        "every result once, in order: True",
        "lanes left: []",
    ]


class _CountedRepr:
    """A step result that counts how often something formats it."""

    formatted = 0

    def __repr__(self) -> str:
        type(self).formatted += 1
        return "<counted>"


def test_a_blocking_progress_never_formats_its_result() -> None:
    # signal.signal() builds the repr of the Ctrl-C handler it replaces; a handler
    # holding the finished call's task formatted the step's result (its tensors) on
    # every progress.  Run on the main thread, where the handler is installed.
    # A shell's background job starts with Ctrl-C ignored: install the default handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    tasks = [Task.from_fn("step", lambda ctx: ctx.slots.set("step_result", _CountedRepr()),
                          writes=("step_result",))]  # fmt: skip
    try:
        with Pipeline(tasks).blocking() as pipe:
            results = list(pipe.results(range(5)))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(results) == 5 and _CountedRepr.formatted == 0


def echo_index(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.batch_index)


def test_a_second_blocking_call_from_another_thread_is_refused() -> None:
    # The task body runs on a lane thread while the main thread's call is under way.
    refused: list[PipelineStateError] = []
    blocking: list[Any] = []

    def step(ctx: TaskContext) -> None:
        try:
            blocking[0].progress(iter([1]))
        except PipelineStateError as exc:
            refused.append(exc)
        ctx.slots.set("step_result", ctx.batch_index)

    with Pipeline([Task.from_fn("step", step, writes=("step_result",))]).blocking() as pipe:
        blocking.append(pipe)
        assert list(pipe.results(range(2))) == [0, 1]
    assert len(refused) == 2 and "one call at a time" in str(refused[0])


def test_a_second_thread_calling_as_the_first_call_begins_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first call is held while it makes its event loop -- after it was let in, before
    # its task exists -- and a second thread calls then: refused, and the first call's
    # result is not lost.
    from aiopipe._core import loops

    making, second_done = threading.Event(), threading.Event()
    make_loop = loops.new_event_loop

    def held_new_event_loop(**options: Any) -> asyncio.AbstractEventLoop:
        if threading.current_thread() is threading.main_thread():
            making.set()
            assert second_done.wait(10)
        return make_loop(**options)

    monkeypatch.setattr(loops, "new_event_loop", held_new_event_loop)
    second: list[BaseException] = []
    with Pipeline([Task.from_fn("step", echo_index, writes=("step_result",))]).blocking() as pipe:
        source = iter(range(3))

        def call_too() -> None:
            assert making.wait(10)
            try:
                pipe.progress(source)
            except BaseException as exc:  # noqa: BLE001 -- the test inspects it
                second.append(exc)
            second_done.set()

        thread = threading.Thread(target=call_too)
        thread.start()
        assert pipe.progress(source) == 0
        thread.join(10)
        assert len(second) == 1 and isinstance(second[0], PipelineStateError)
        assert "one call at a time" in str(second[0])
        assert list(pipe.results(source)) == [1, 2]


def test_the_blocking_form_reports_the_statistics_of_its_pipeline() -> None:
    with Pipeline([Task.from_fn("t", lambda ctx: None)], expect_result=False).blocking() as pipe:
        assert list(pipe.results(range(3))) == [None, None, None]
        assert (pipe.statistics().returned, pipe.statistics().applied) == (3, 3)


class _Slotted:
    """A pipeline of a user's own that keeps no attribute it was not built with."""

    __slots__ = ("__weakref__",)

    async def progress(self, source: Any) -> Any:
        return next(source)

    async def drain(self) -> list[Any]:
        return []

    def shutdown(self) -> None:
        pass


class _Strict(_Slotted):
    """One that refuses every attribute set on it."""

    __slots__ = ("__dict__",)

    def __setattr__(self, name: str, value: Any) -> None:
        raise ValueError(f"no field {name!r}")


class _Lenient(_Slotted):
    """One that ignores every attribute set on it."""

    __slots__ = ("__dict__",)

    def __setattr__(self, name: str, value: Any) -> None:
        pass


@pytest.mark.parametrize("kind", [_Slotted, _Strict, _Lenient])
def test_a_pipeline_that_cannot_keep_a_loop_gets_one_for_each_view(kind: type) -> None:
    # Each view's loop is its own, closed with the view: none is left behind.
    def loops_alive() -> int:
        gc.collect()
        return sum(type(thing) is LoopRunner for thing in gc.get_objects())

    pipe, source = kind(), iter(range(20))
    before = loops_alive()
    for expected in range(20):
        assert BlockingPipeline(pipe).progress(source) == expected
    assert loops_alive() == before
