"""Edges of the call contract found by adversarial runs: who is handed a failure, a
failure whose caller was cancelled, an interrupt that arrives as a call ends.  Each
interleaving is forced with events held by a task body, an ``init`` or the source
(and asyncio's FIFO order of ready callbacks), never by waiting for time to pass."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import pytest
from conftest import cancelled

from aiopipe import BadBatchError, Pipeline, PipelineStateError, Task, TaskAbortedError, TaskContext

pytestmark = pytest.mark.timeout(60)


def echo(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])


def echo_task(**options: Any) -> Task:
    return Task.from_fn("train", echo, writes=("step_result",), **options)


async def test_a_second_caller_is_refused_not_handed_the_first_callers_failure() -> None:
    failing, gate = asyncio.Event(), asyncio.Event()

    async def train(ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        if batch == 1:
            await gate.wait()
            failing.set()
            raise ValueError("boom on batch 1")
        ctx.slots.set("step_result", batch)

    pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",))])
    source = iter(range(5))
    assert await pipe.progress(source) == 0
    first = asyncio.ensure_future(pipe.progress(source))

    async def second_caller() -> Any:
        await failing.wait()
        await asyncio.sleep(0)  # the step has failed; the first caller is not woken yet
        return await pipe.progress(source)

    second = asyncio.ensure_future(second_caller())
    await asyncio.sleep(0)
    gate.set()
    # Refused as a second caller (asyncio's loop runs it before the first caller
    # wakes), or asked for reset() once the first was handed the failure (uvloop's):
    # never handed the first caller's failure.
    with pytest.raises(PipelineStateError, match="already running|reset"):
        await second
    with pytest.raises(ValueError, match="boom on batch 1"):
        await first  # the failure goes to the caller whose step failed
    pipe.reset()
    await pipe.aclose()


async def test_an_init_failure_whose_caller_was_cancelled_is_raised_by_the_next_call() -> None:
    reached, gate, failing = asyncio.Event(), asyncio.Event(), asyncio.Event()
    calls: list[int] = []

    async def init(ctx: TaskContext) -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            reached.set()
            await gate.wait()
            failing.set()
            raise ValueError("init failed")

    pipe = Pipeline([echo_task(init=init)])
    source = iter(range(3))
    call = asyncio.ensure_future(pipe.progress(source))
    await reached.wait()
    await cancelled(call)
    gate.set()
    await failing.wait()  # the init has failed with nobody waiting for it
    with pytest.raises(ValueError, match="init failed"):
        await pipe.progress(source)
    assert calls == [0]  # raised, not run again by that call
    assert [result async for result in pipe.results(source)] == [0, 1, 2]
    assert calls == [0, 1]  # the call after it retried the init
    await pipe.aclose()


def run_with_interrupts(pipe: Any, source: Any) -> list[Any]:
    """Every result of ``source`` through the blocking ``pipe``, an interrupt noted
    where a call raised it (the next call goes on)."""
    seen: list[Any] = []
    while True:
        try:
            seen.append(pipe.progress(source))
        except StopIteration:
            return seen
        except (KeyboardInterrupt, SystemExit) as interrupt:
            seen.append(type(interrupt).__name__)


class InterruptedCheck:
    """A ``check_batch`` that raises ``KeyboardInterrupt`` once, checking batch 2."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, batch: int) -> None:
        if batch == 2 and not self.fired:
            self.fired = True
            raise KeyboardInterrupt


async def numbers(count: int, *, yields: int = 0) -> Any:
    """An async generator of ``range(count)``, yielding to the loop ``yields`` times
    before each item."""
    for number in range(count):
        for _ in range(yields):
            await asyncio.sleep(0)
        yield number


def until_interrupted(pipe: Any, source: Any, check: InterruptedCheck) -> list[Any]:
    """The blocking ``pipe``'s results of ``source`` until ``check`` has fired."""
    seen: list[Any] = []
    while not check.fired:
        try:
            seen.append(pipe.progress(source))
        except KeyboardInterrupt:
            pass
    return seen


def interrupt_once_the_call_is_done(pipe: Any) -> None:
    """Raise ``KeyboardInterrupt`` out of the blocking ``pipe``'s loop in the first
    cycle after its call under way has finished (before the loop stops)."""
    loop = pipe._runner.loop

    def interrupt() -> None:
        call = pipe._runner._task
        if call is not None and not call.done():
            loop.call_soon(interrupt)
            return
        raise KeyboardInterrupt

    loop.call_soon(interrupt)


@pytest.mark.parametrize("options", [{}, {"executor": "sequential"}, {"read_ahead": False}],
                         ids=["lanes", "sequential", "no read-ahead"])  # fmt: skip
@pytest.mark.parametrize("async_source", [False, True], ids=["sync source", "async source"])
def test_an_interrupt_in_check_batch_keeps_the_item_it_was_checking(
    options: dict[str, Any], async_source: bool
) -> None:
    """``check_batch`` is called on an item already taken from the source: Ctrl-C
    there must not lose it (nor the checkpoint position count past it)."""
    pipe = Pipeline([echo_task()], check_batch=InterruptedCheck(), **options).blocking()
    try:
        seen = run_with_interrupts(pipe, numbers(6) if async_source else iter(range(6)))
        stats = pipe.statistics()
    finally:
        pipe.shutdown()
    assert [x for x in seen if x != "KeyboardInterrupt"] == [0, 1, 2, 3, 4, 5]
    assert seen.count("KeyboardInterrupt") == 1
    assert (stats.pulled, stats.refused, stats.discarded, stats.position) == (6, 0, 0, 6)


INLINE = {"sequential": {"executor": "sequential"}, "lane loop": {"thread_map": {"train": "loop"}}}


class InterruptingSource:
    """An async iterator of 0..6 that raises ``error`` once, in place of item 4,
    then reads on (a ``KeyboardInterrupt`` out of the source, read ahead)."""

    def __init__(self, error: type[BaseException]) -> None:
        self.next, self.error, self.raised = 0, error, False

    def __aiter__(self) -> InterruptingSource:
        return self

    async def __anext__(self) -> int:
        if self.next >= 7:
            raise StopAsyncIteration
        if self.next == 4 and not self.raised:
            self.raised = True
            raise self.error()
        self.next += 1
        return self.next - 1


@pytest.mark.parametrize("options", [*INLINE.values(), {}], ids=[*INLINE, "lanes"])
@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_out_of_the_source_as_a_call_ends_loses_no_result(
    error: type[BaseException], options: dict[str, Any]
) -> None:
    """Read ahead after a step run inline, the source's interrupt leaves the loop
    once the call has its result: the interrupt is raised, and the result comes
    with the next call; that call is not stopped by the finished call's loop stop."""
    pipe = Pipeline([echo_task()], **options).blocking()
    try:
        seen = run_with_interrupts(pipe, InterruptingSource(error))
        stats = pipe.statistics()
    finally:
        pipe.shutdown()
    assert [x for x in seen if isinstance(x, int)] == list(range(7))
    assert seen.count(error.__name__) == 1 and len(seen) == 8
    assert (stats.applied, stats.returned) == (7, 7)


def ctrl_c_on_the_loop_after(batches: set[int]) -> Any:
    """A body that echoes its batch and, for ``batches``, has the loop send this
    process Ctrl-C at its next cycle: after an inline step, as the call ends."""
    sent: set[int] = set()

    def train(ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        if batch in batches and batch not in sent:
            sent.add(batch)
            asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGINT)
        ctx.slots.set("step_result", batch)

    return train


@pytest.fixture
def ctrl_c_raises() -> Any:
    """SIGINT raises ``KeyboardInterrupt`` (as in a script), whatever the runner set."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize("options", INLINE.values(), ids=INLINE)
def test_a_ctrl_c_as_a_call_ends_keeps_its_result_for_the_next_call(
    options: dict[str, Any], ctrl_c_raises: None
) -> None:
    train = ctrl_c_on_the_loop_after({2, 5})
    pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",))], **options).blocking()
    source = iter(range(8))
    try:
        seen = run_with_interrupts(pipe, source)
    finally:
        pipe.shutdown()
    assert [x for x in seen if isinstance(x, int)] == list(range(8))
    assert seen.count("KeyboardInterrupt") == 2


def interrupt_as_the_call_ends(batches: set[int]) -> Any:
    """A body (run inline, in the call's own task) that echoes its batch and, for
    ``batches``, raises ``KeyboardInterrupt`` out of the loop in the first cycle
    after the call has finished: before the loop stops, its result made."""
    sent: set[int] = set()

    def train(ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        if batch in batches and batch not in sent:
            sent.add(batch)
            loop, call = asyncio.get_running_loop(), asyncio.current_task()
            assert call is not None

            def interrupt_once_done() -> None:
                if not call.done():
                    loop.call_soon(interrupt_once_done)
                    return
                raise KeyboardInterrupt

            loop.call_soon(interrupt_once_done)
        ctx.slots.set("step_result", batch)

    return train


@pytest.mark.parametrize("options", INLINE.values(), ids=INLINE)
def test_an_interrupt_as_progress_many_or_drain_ends_keeps_their_results(
    options: dict[str, Any]
) -> None:
    train = interrupt_as_the_call_ends({2, 4})
    pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",))], **options).blocking()
    source = iter(range(6))
    got: list[Any] = []
    interrupts = 0
    try:
        while len(got) < 3:  # interrupted after batch 2: its results come next call
            try:
                got += pipe.progress_many(source, 3)
            except KeyboardInterrupt:
                interrupts += 1
        got.append(pipe.progress(source))  # batch 3; batch 4 is read ahead
        try:
            got += pipe.drain()  # trains batch 4, then the interrupt
        except KeyboardInterrupt:
            interrupts += 1
        got += pipe.drain()  # what the interrupted drain had finished
        got += pipe.progress_many(source, 5)  # the source goes on after its drain
    finally:
        pipe.shutdown()
    assert got == list(range(6)) and interrupts == 2


class HeldSteps:
    """An ``async def`` body that echoes its batch and holds batch ``"a"`` at a gate;
    ``trained`` lists the batches whose body ran to its end."""

    def __init__(self) -> None:
        self.reached, self.gate = asyncio.Event(), asyncio.Event()
        self.trained: list[Any] = []

    def pipeline(self, **options: Any) -> Pipeline:
        async def train(ctx: TaskContext) -> None:
            batch = ctx.slots["batch_cpu"]
            if batch == "a":
                self.reached.set()
                await self.gate.wait()
            self.trained.append(batch)
            ctx.slots.set("step_result", batch)

        return Pipeline([Task.from_fn("train", train, writes=("step_result",))], **options)

    async def cancel_a_then_b(self, pipe: Any) -> None:
        """step("a") cancelled while its body is held, then step("b") cancelled while
        it waits for "a" (before its own batch was taken); then "a" goes on."""
        a = asyncio.ensure_future(pipe.step("a"))
        await self.reached.wait()
        await cancelled(a)
        b = asyncio.ensure_future(pipe.step("b"))
        await asyncio.sleep(0)  # b runs up to its wait for a's step
        await cancelled(b)
        self.gate.set()


STEP_EXECUTORS = {"lanes": {}, "sequential": {"executor": "sequential"}}
ALL_STEP_FORMS = {**STEP_EXECUTORS, "lane loop": {"thread_map": {"train": "loop"}}}


@pytest.mark.parametrize("options", STEP_EXECUTORS.values(), ids=STEP_EXECUTORS)
async def test_a_step_cancelled_before_its_batch_was_taken_still_trains_it(
    options: dict[str, Any]
) -> None:
    body = HeldSteps()
    pipe = body.pipeline(**options)
    await body.cancel_a_then_b(pipe)
    assert await pipe.step("c") == "c"
    assert body.trained == ["a", "b", "c"]
    assert pipe.statistics().discarded == 0
    await pipe.aclose()


@pytest.mark.parametrize("options", STEP_EXECUTORS.values(), ids=STEP_EXECUTORS)
async def test_the_batches_of_cancelled_steps_are_drained_or_reset_never_skipped(
    options: dict[str, Any]
) -> None:
    body = HeldSteps()
    pipe = body.pipeline(**options)
    await body.cancel_a_then_b(pipe)
    with pytest.raises(PipelineStateError, match="step\\(\\) calls that were cancelled"):
        await pipe.progress(iter(range(3)))  # "b" would be passed over
    assert await pipe.drain() == ["a"]  # the batch in flight
    assert await pipe.drain() == []  # then "b", its result dropped (its caller is gone)
    assert body.trained == ["a", "b"]
    assert [r async for r in pipe.results(iter(range(2)))] == [0, 1]

    body = HeldSteps()
    pipe2 = body.pipeline(**options)
    await body.cancel_a_then_b(pipe2)
    await pipe2.wait_idle()  # "a" has ended; "b" was never taken
    pipe2.reset()
    assert pipe2.statistics().discarded == 1 and body.trained == ["a"]
    assert await pipe2.step("c") == "c" and body.trained == ["a", "c"]
    await pipe.aclose()
    await pipe2.aclose()


NO_RAISE_SIGNAL = not hasattr(signal, "raise_signal") or os.name != "posix"


@pytest.mark.skipif(NO_RAISE_SIGNAL, reason="POSIX signals")
@pytest.mark.parametrize("options", ALL_STEP_FORMS.values(), ids=ALL_STEP_FORMS)
def test_a_ctrl_c_before_a_blocking_step_starts_leaves_its_batch_owed(
    options: dict[str, Any], ctrl_c_raises: None
) -> None:
    trained: list[Any] = []

    def train(ctx: TaskContext) -> None:
        trained.append(ctx.slots["batch_cpu"])
        echo(ctx)

    pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",))], **options).blocking()
    try:
        assert pipe.step("warm") == "warm"
        # Queued ahead of the call's task: Ctrl-C arrives before the call's first step.
        pipe._runner.loop.call_soon(signal.raise_signal, signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            pipe.step("a")
        assert pipe.step("b") == "b"  # "a" was owed: trained first, its result dropped
    finally:
        pipe.shutdown()
    assert trained == ["warm", "a", "b"]


class Abort(BaseException):
    """A BaseException of a body's own (not an Exception, not an interrupt)."""


ALL_EXECUTORS = {**INLINE, "lanes": {}}


def a_body_that_raises_on_batch_1(kind: str) -> Any:
    """``kind``: ``"cancelled"``, an ``async def`` body whose await another component
    cancels; ``"abort"``, a sync body raising :class:`Abort`; ``"generator exit"``, an
    ``async def`` body raising ``GeneratorExit`` of its own."""
    if kind == "abort":
        def train(ctx: TaskContext) -> None:
            if ctx.slots["batch_cpu"] == 1:
                raise Abort("abort on batch 1")
            echo(ctx)

        return train

    if kind == "generator exit":
        async def train_exits(ctx: TaskContext) -> None:
            if ctx.slots["batch_cpu"] == 1:
                raise GeneratorExit("a body's own")
            echo(ctx)

        return train_exits

    async def train_async(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 1:
            never = asyncio.ensure_future(asyncio.Event().wait())
            asyncio.get_running_loop().call_soon(never.cancel)  # someone else's cancel
            await never
        echo(ctx)

    return train_async


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() tells the cases apart")
@pytest.mark.parametrize("kind", ["cancelled", "abort", "generator exit"])
@pytest.mark.parametrize("options", ALL_EXECUTORS.values(), ids=ALL_EXECUTORS)
@pytest.mark.parametrize("many", [False, True], ids=["progress", "progress_many"])
async def test_a_body_s_own_base_exception_is_its_task_s_failure_said_once(
    kind: str, options: dict[str, Any], many: bool
) -> None:
    train = a_body_that_raises_on_batch_1(kind)
    pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",))], **options)
    source = iter(range(4))
    expected = {"cancelled": asyncio.CancelledError, "abort": Abort,
                "generator exit": GeneratorExit}[kind]  # fmt: skip
    got: list[Any] = []
    if many:
        got += await pipe.progress_many(source, 3)  # the step before it comes first
    else:
        got.append(await pipe.progress(source))
    assert got == [0]
    with pytest.raises(TaskAbortedError, match="task 'train' raised") as failure:
        await pipe.progress(source)
    assert isinstance(failure.value.__cause__, expected)
    assert any("batch 1" in note for note in failure.value.__cause__.__notes__)
    with pytest.raises(PipelineStateError, match="reset"):  # once; then reset() is asked for
        await pipe.progress(source)
    assert pipe.statistics().returned == 1  # no applied result dropped by the reset
    pipe.reset()
    await pipe.aclose()



@pytest.mark.parametrize("then", ["another source", "reset"])
async def test_a_first_step_cancelled_at_its_init_is_owed_like_any_other(then: str) -> None:
    """Cancelled at the first call's ``init`` wait, taken up but not taken: another
    source is refused until the batch is trained, and ``reset()`` counts it dropped."""
    reached, gate = asyncio.Event(), asyncio.Event()
    trained: list[Any] = []

    async def init(ctx: TaskContext) -> None:
        reached.set()
        await gate.wait()

    def train(ctx: TaskContext) -> None:
        trained.append(ctx.slots["batch_cpu"])
        echo(ctx)

    pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",), init=init)])
    step = asyncio.ensure_future(pipe.step("x"))
    await reached.wait()
    await cancelled(step)
    gate.set()
    if then == "reset":
        pipe.reset()
        assert pipe.statistics().discarded == 1
        assert await pipe.step("y") == "y" and trained == ["y"]
    else:
        with pytest.raises(PipelineStateError, match="step\\(\\) calls that were cancelled"):
            await pipe.progress(iter([1, 2]))
        assert await pipe.drain() == ["x"] and trained == ["x"]
        assert [r async for r in pipe.results([1, 2])] == [1, 2]
    await pipe.aclose()


async def test_a_step_whose_init_failed_is_not_trained_later() -> None:
    calls: list[int] = []
    trained: list[Any] = []

    def init(ctx: TaskContext) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("init failed")

    def train(ctx: TaskContext) -> None:
        trained.append(ctx.slots["batch_cpu"])
        echo(ctx)

    pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",), init=init)])
    with pytest.raises(ValueError, match="init failed"):
        await pipe.step("c")
    assert await pipe.step("d") == "d"
    assert trained == ["d"]  # the step that raised is not owed
    await pipe.aclose()


@pytest.mark.parametrize("options", [{}, {"executor": "sequential"}, {"read_ahead": False}],
                         ids=["lanes", "sequential", "no read-ahead"])  # fmt: skip
def test_an_item_kept_by_an_interrupted_check_is_drained_not_lost(options: dict[str, Any]) -> None:
    check = InterruptedCheck()
    pipe = Pipeline([echo_task()], check_batch=check, **options).blocking()
    source = iter(range(6))
    try:
        seen = until_interrupted(pipe, source, check)
        seen += pipe.drain()
        seen += list(pipe.results(source))
        stats = pipe.statistics()
    finally:
        pipe.shutdown()
    assert seen == list(range(6)) and stats.position == 6


def test_an_item_kept_by_an_interrupted_check_keeps_its_place_through_reset() -> None:
    check = InterruptedCheck()
    pipe = Pipeline([echo_task()], check_batch=check, read_ahead=2).blocking()
    source = numbers(6, yields=1)
    try:
        seen = until_interrupted(pipe, source, check)
        pipe._runner.run(pipe.pipeline.wait_idle)  # the step the interrupt left running
        pipe.reset()  # what was read ahead stays, in order
        seen += list(pipe.results(source))
    finally:
        pipe.shutdown()
    assert seen == sorted(seen) and set(range(1, 6)) <= set(seen)


@pytest.mark.parametrize("options", ALL_EXECUTORS.values(), ids=ALL_EXECUTORS)
def test_two_interrupts_as_a_call_ends_keep_its_result_and_the_next_call_runs(
    options: dict[str, Any]
) -> None:
    pipe = Pipeline([echo_task()], **options).blocking()
    source = iter(range(5))
    seen: list[Any] = [pipe.progress(source)]
    interrupt_once_the_call_is_done(pipe)
    interrupt_once_the_call_is_done(pipe)
    try:
        seen += run_with_interrupts(pipe, source)
    finally:
        pipe.shutdown()
    assert [x for x in seen if isinstance(x, int)] == list(range(5))


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix", reason="POSIX signals")
def test_a_ctrl_c_inside_the_call_s_own_step_keeps_its_result(ctrl_c_raises: None) -> None:
    """Ctrl-C handled while the call itself runs (a body inline, sending it): the call
    is cancelled at the loop's next cycle, not in the middle of returning."""
    sent: list[int] = []

    def train(ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        if batch == 2 and not sent:
            sent.append(batch)
            os.kill(os.getpid(), signal.SIGINT)  # handled here, inside the call's step
        echo(ctx)

    pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",))],
                    executor="sequential").blocking()  # fmt: skip
    try:
        seen = run_with_interrupts(pipe, iter(range(5)))
    finally:
        pipe.shutdown()
    assert [x for x in seen if isinstance(x, int)] == list(range(5))
    assert seen.count("KeyboardInterrupt") == 1


def test_a_call_s_error_is_not_hidden_by_an_interrupt_as_it_ends() -> None:
    def refuse_2(batch: int) -> bool:
        return batch != 2

    pipe = Pipeline([echo_task()], check_batch=refuse_2, read_ahead=False,
                    executor="sequential").blocking()  # fmt: skip
    source = iter(range(5))
    seen: list[Any] = [pipe.progress(source), pipe.progress(source)]
    interrupt_once_the_call_is_done(pipe)
    try:
        with pytest.raises(BadBatchError):  # the refusal of item 2, not the interrupt
            pipe.progress(source)
        seen += run_with_interrupts(pipe, source)
    finally:
        pipe.shutdown()
    assert seen == [0, 1, 3, 4]


async def test_an_end_read_but_not_handed_over_keeps_the_source_s_counts() -> None:
    """``progress_many`` that reads the end while it returns results has not handed
    the end over: a ``drain()`` and the next call go on counting in that source, as
    the same calls one ``progress()`` at a time do."""
    pipe = Pipeline([echo_task()])
    source = iter(range(4))
    assert await pipe.progress_many(source, 10) == [0, 1, 2, 3]
    assert await pipe.drain() == []
    assert pipe.statistics().position == 4
    assert await pipe.progress_many(source, 10) == []  # the end, handed over now
    assert pipe.statistics().position == 4
    await pipe.aclose()


SOURCE_KINDS = ("generator", "async generator")


def pressing_ctrl_c_at(item: int, kind: str) -> Any:
    """A ``kind`` source of ``range(10)`` that delivers one SIGINT to this thread (a
    user's Ctrl-C) as it makes ``item``, then goes on."""

    def values() -> Any:
        for value in range(10):
            if value == item:
                signal.raise_signal(signal.SIGINT)
            yield value

    async def async_values() -> Any:
        for value in values():
            yield value

    return values() if kind == "generator" else async_values()


@pytest.mark.skipif(NO_RAISE_SIGNAL, reason="POSIX signals")
@pytest.mark.parametrize("kind", SOURCE_KINDS)
@pytest.mark.parametrize("options", ALL_EXECUTORS.values(), ids=ALL_EXECUTORS)
def test_a_ctrl_c_while_a_source_is_read_ahead_loses_none_of_it(
    options: dict[str, Any], kind: str, ctrl_c_raises: None
) -> None:
    # Inline, the call has returned when its read-ahead runs the generator: the
    # interrupt is raised as the call ends, never inside the generator's frame.
    pipe = Pipeline([echo_task()], **options).blocking()
    try:
        seen = run_with_interrupts(pipe, pressing_ctrl_c_at(2, kind))
    finally:
        pipe.shutdown()
    assert [x for x in seen if isinstance(x, int)] == list(range(10))
    assert seen.count("KeyboardInterrupt") == 1


def raising_at(item: int, kind: str, interrupt: type[BaseException]) -> Any:
    """A ``kind`` source of ``range(10)`` that raises ``interrupt`` itself at ``item``,
    which finishes it."""

    def values() -> Any:
        for value in range(10):
            if value == item:
                raise interrupt
            yield value

    async def async_values() -> Any:
        for value in values():
            yield value

    return values() if kind == "generator" else async_values()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("kind", SOURCE_KINDS)
@pytest.mark.parametrize("options", ALL_EXECUTORS.values(), ids=ALL_EXECUTORS)
def test_a_generator_an_interrupt_finished_is_said_lost_not_ended(
    options: dict[str, Any], kind: str, interrupt: type[BaseException]
) -> None:
    pipe = Pipeline([echo_task()], **options).blocking()
    source = raising_at(3, kind, interrupt)
    got: list[Any] = []
    try:
        with pytest.raises(PipelineStateError, match=f"raised {interrupt.__name__}.*finished it"):
            while True:
                try:
                    got.append(pipe.progress(source))
                except interrupt:
                    got.append(interrupt.__name__)
        got += pipe.drain()  # the batches in flight
        with pytest.raises(PipelineStateError, match="finished it"):
            pipe.progress(source)  # passed again: still lost, not an empty epoch
        assert pipe.progress(iter([7])) == 7  # a new source goes on
    finally:
        pipe.shutdown()
    assert [x for x in got if isinstance(x, int)] == [0, 1, 2]
    assert got.count(interrupt.__name__) == 1


def ctrl_c_after_cycles(pipe: Any, cycles: int) -> None:
    """Deliver one SIGINT ``cycles`` loop cycles into the blocking ``pipe``'s next call."""
    loop = pipe._runner.loop

    def press(left: int) -> None:
        if left:
            loop.call_soon(press, left - 1)
        else:
            signal.raise_signal(signal.SIGINT)

    loop.call_soon(press, cycles)


@pytest.mark.skipif(NO_RAISE_SIGNAL, reason="POSIX signals")
@pytest.mark.parametrize("cycles", [0, 1, 2])
@pytest.mark.parametrize("ending", ["the end", "a refused batch"])
@pytest.mark.parametrize("options", ALL_EXECUTORS.values(), ids=ALL_EXECUTORS)
def test_a_ctrl_c_during_a_call_that_raises_is_raised_not_swallowed(
    options: dict[str, Any], ending: str, cycles: int, ctrl_c_raises: None
) -> None:
    # A loop that goes on after StopIteration or BadBatchError must still stop.
    check = (lambda batch: batch != 2) if ending == "a refused batch" else None
    pipe = Pipeline([echo_task()], check_batch=check, **options).blocking()
    source = iter([0, 1, 2] if check else [0, 1])
    try:
        assert [pipe.progress(source), pipe.progress(source)] == [0, 1]
        ctrl_c_after_cycles(pipe, cycles)
        with pytest.raises(KeyboardInterrupt) as interrupt:
            pipe.progress(source)
        if check:  # the refusal is not lost: in the traceback, and counted
            assert isinstance(interrupt.value.__context__, BadBatchError)
            assert pipe.statistics().refused == 1
        with pytest.raises(StopIteration):
            pipe.progress(source)
    finally:
        pipe.shutdown()
