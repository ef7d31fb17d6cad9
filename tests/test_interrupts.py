"""What interrupts that leave the event loop do to the blocking form: a body raising
``KeyboardInterrupt``/``SystemExit``, Ctrl-C (real signals) and a lane body that never
returns.  Each runs in a subprocess: an interrupt must not reach the test runner."""

from __future__ import annotations

import ast
import asyncio
import queue
import signal
import subprocess
import sys
import threading
from typing import IO

import pytest

from aiopipe import Pipeline, Task, TaskContext
from aiopipe._core.loops import LoopRunner

LEFT_THE_LOOP = """
import signal; signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with Ctrl-C ignored
import os, signal, sys
from aiopipe import Pipeline, Task, TaskContext

def case(error, lane):
    steps = []

    def train(ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        steps.append(batch)
        if batch == 1 and steps.count(1) == 1:
            if error == "ctrl-c-twice":  # the first cancels the caller, the second lands here
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
            else:
                raise {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[error]()
        ctx.slots.set("step_result", batch)

    pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",))],
                    thread_map={"train": lane}).blocking()
    source = iter(range(5))
    assert pipe.progress(source) == 0
    try:
        pipe.progress(source)
    except (KeyboardInterrupt, SystemExit) as exc:
        print(error, lane, "interrupted by", type(exc).__name__)
    pipe.reset()  # no call of the interrupted one is left to run on
    print(error, lane, "results", list(pipe.results(iter(range(3)))), "steps", steps)
    pipe.shutdown()

for error, lane in [("KeyboardInterrupt", "compute"), ("KeyboardInterrupt", "loop"),
                    ("SystemExit", "compute"), ("SystemExit", "loop"),
                    ("ctrl-c-twice", "loop")]:
    case(error, lane)
"""


def test_an_interrupt_that_left_the_loop_leaves_no_call_behind() -> None:
    out = subprocess.run(
        [sys.executable, "-c", LEFT_THE_LOOP], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for error, lane in [("KeyboardInterrupt", "compute"), ("KeyboardInterrupt", "loop"),
                        ("SystemExit", "compute"), ("SystemExit", "loop"),
                        ("ctrl-c-twice", "loop")]:  # fmt: skip
        raised = "SystemExit" if error == "SystemExit" else "KeyboardInterrupt"
        assert f"{error} {lane} interrupted by {raised}" in lines
        # batch 1's step is not run again by a call left behind
        assert f"{error} {lane} results [0, 1, 2] steps [0, 1, 0, 1, 2]" in lines
    assert "never retrieved" not in out.stderr


STUCK_BODY = """
import signal; signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with Ctrl-C ignored
import asyncio, sys, threading
import aiopipe
from aiopipe import Pipeline, Task, TaskContext

never = threading.Event()

def train(ctx: TaskContext) -> None:
    if ctx.slots["batch_cpu"] == 1:
        print("stuck", flush=True)
        never.wait()  # a body that never returns
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])

pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",)),
                 Task.from_fn("after", lambda ctx: None, depends_on=("train",))],
                thread_map={"train": "compute", "after": "compute"})

async def main() -> None:
    async for _ in pipe.results(range(4)):
        pass

async def main_with() -> None:
    async with pipe:  # its aclose() waits for the step on the way out
        await main()

form = sys.argv[1]
if form == "blocking":
    for _ in pipe.blocking().results(range(4)):
        pass
elif form == "blocking, with":
    with pipe.blocking() as blocking:
        for _ in blocking.results(range(4)):
            pass
elif form.startswith("asyncio.run"):
    asyncio.run(main_with() if form.endswith("async with") else main())
else:
    aiopipe.run(main_with() if form.endswith("async with") else main())
"""


class StreamLines:
    """The lines of a child's stream, read by a thread of their own as they come."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.all: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.all.append(line)
            self._lines.put(line)

    def first(self, prefix: str, timeout: float = 30) -> str:
        """The next line starting with ``prefix``; fails after ``timeout`` seconds
        instead of hanging on a child that says nothing."""
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no line starting with {prefix!r} in {timeout} s") from None
            if line.startswith(prefix):
                return line

    def to_the_end(self) -> str:
        """Everything the stream said, once the child has closed it."""
        self._reader.join(timeout=30)
        return "".join(self.all)


@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGINT")
@pytest.mark.parametrize("form", ["blocking", "blocking, with", "asyncio.run",
                                  "asyncio.run, async with", "aiopipe.run",
                                  "aiopipe.run, async with"])  # fmt: skip
def test_ctrl_c_twice_leaves_a_body_that_never_returns(form: str) -> None:
    # With ``with``/``async with`` the first wait is aclose()'s, on the way out: it
    # tells what it waits for too, and the second Ctrl-C ends every wait for the step.
    with subprocess.Popen(
        [sys.executable, "-c", STUCK_BODY, form],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as child:  # fmt: skip
        assert child.stdout is not None and child.stderr is not None
        try:
            ctrl_c_twice(child, child.stdout, child.stderr,
                         ours=not form.startswith("asyncio.run"))  # fmt: skip
        finally:
            child.kill()  # (a no-op once it exited)


def ctrl_c_twice(
    child: subprocess.Popen[str], stdout: IO[str], stderr: IO[str], *, ours: bool = True
) -> None:
    """``ours``: the loop is this package's (the blocking form, ``aiopipe.run``), whose
    second Ctrl-C ends every wait for the step, and which show one traceback.  Under
    ``asyncio.run``, which handles Ctrl-C itself, the second one stops ``aclose()``'s
    wait (``async with``) and the loop's shutdown waits once more, saying so: a third
    stops that one."""
    assert stdout.readline() == "stuck\n"
    errors = StreamLines(stderr)
    waits = 1
    child.send_signal(signal.SIGINT)  # the caller returns; what comes next waits for the step
    while True:
        line = errors.first("aiopipe:")  # after KeyboardInterrupt's traceback
        assert "waiting for iteration 1" in line
        # the running task only: the one after it on its lane is counted (and, once
        # the loop shuts down, will not start)
        assert ("task 'train' (batch 1) on lane 'compute' has not returned; "
                "1 task(s) after it") in line  # fmt: skip
        assert "Press Ctrl-C to stop waiting" in line
        child.send_signal(signal.SIGINT)
        if ours or "before the event loop closes" in line:
            break
        waits += 1  # asyncio.run's shutdown waits once more
    child.wait(timeout=30)  # no exit hook waits for the lane, nor another wait
    assert child.returncode != 0
    said = errors.to_the_end()
    assert said.count("waiting for iteration") == waits
    if ours:  # one wait, and the first Ctrl-C's traceback, no second one chained
        assert waits == 1 and said.count("Traceback") == 1


SOURCE_INTERRUPTED_ONCE = """
from aiopipe import Pipeline, Task, TaskContext

class Source:
    '''An async source that raises the interrupt once, at its 4th item, then reads on.'''

    def __init__(self, error):
        self.next, self.error, self.raised = 0, error, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.next >= 7:
            raise StopAsyncIteration
        if self.next == 4 and not self.raised:
            self.raised = True
            raise self.error()
        self.next += 1
        return self.next - 1

def echo(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])

for error in (KeyboardInterrupt, SystemExit):
    pipe = Pipeline([Task.from_fn("echo", echo, writes=("step_result",))]).blocking()
    source, seen = Source(error), []
    while True:
        try:
            seen.append(pipe.progress(source))
        except StopIteration:
            break
        except (KeyboardInterrupt, SystemExit) as exc:
            seen.append(type(exc).__name__)
    print(error.__name__, seen, flush=True)
    pipe.shutdown()
"""


def test_an_interrupt_from_an_async_source_reaches_the_caller_once() -> None:
    """asyncio raises it out of the loop from the pull's task; the pull's future holds
    it too, and the next call used to raise it again.  The source gave no item then:
    the next call reads on."""
    out = subprocess.run(
        [sys.executable, "-c", SOURCE_INTERRUPTED_ONCE], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    for error in ("KeyboardInterrupt", "SystemExit"):
        seen = ast.literal_eval(lines[error])
        assert seen.count(error) == 1  # once: when the source raised it
        assert [x for x in seen if x != error] == list(range(7))  # every item once, in order


ONE_CTRL_C = """
import signal; signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with Ctrl-C ignored
import os, signal, sys
from aiopipe import Pipeline, Task, TaskContext

executor = sys.argv[1]
steps = []

def train(ctx: TaskContext) -> None:
    batch = ctx.slots["batch_cpu"]
    steps.append(batch)
    if batch == 1 and steps.count(1) == 1:
        signal.raise_signal(signal.SIGINT)  # to this thread: handled in the body or beside it
    ctx.slots.set("step_result", batch)

options = ({"executor": "sequential"} if executor == "sequential"
           else {"thread_map": {"train": executor}})
pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",))], **options).blocking()
source = iter(range(4))
assert pipe.progress(source) == 0
try:
    pipe.progress(source)
except KeyboardInterrupt:
    print("interrupted")
print("results", [pipe.progress(source) for _ in range(3)], "steps", steps)
pipe.shutdown()
"""


@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGINT")
@pytest.mark.parametrize("executor", ["compute", "loop", "sequential"])
def test_one_ctrl_c_during_a_step_keeps_its_result_for_the_next_call(executor: str) -> None:
    """The step Ctrl-C interrupted was applied: its result is the next call's,
    whether the step ran on a lane or inline in the call (no lost, no repeated step)."""
    out = subprocess.run(
        [sys.executable, "-c", ONE_CTRL_C, executor], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["interrupted", "results [1, 2, 3] steps [0, 1, 2, 3]"]


def test_a_timeout_that_cancels_aclose_stops_that_wait_only() -> None:
    # A step whose caller left (a timeout); aclose() waits for it and is cancelled by a
    # timeout too.  Only a Ctrl-C stops every wait for a step (the subprocess tests
    # above): here the step runs on, the task after it too, and the next call returns
    # its result.
    gate, started, ran = threading.Event(), threading.Event(), []

    def train(ctx: TaskContext) -> None:
        started.set()
        gate.wait(30)
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    def after(ctx: TaskContext) -> None:
        ran.append(ctx.slots["batch_cpu"])

    pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",)),
                     Task.from_fn("after", after, depends_on=("train",))],
                    thread_map={"train": "compute", "after": "compute"})  # fmt: skip
    source = iter(range(3))

    async def leave_then_close() -> None:
        call = asyncio.ensure_future(pipe.progress(source))
        assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        call.cancel()  # the caller leaves
        with pytest.raises(asyncio.CancelledError):
            await call
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(pipe.aclose(), 0.05)

    with LoopRunner(prefer_uvloop=False) as runner:
        runner.run(leave_then_close)
        gate.set()
        assert runner.run(pipe.progress, source) == 0 and ran == [0]
        runner.run(pipe.aclose)
