"""Failures and cancellation: the original error, no hang, no leak, a clear state after."""

from __future__ import annotations

import asyncio
import copy
import pickle
import threading
import warnings
from collections.abc import Callable

import pytest
from conftest import collect

from aiopipe import (
    AsyncExecutor, FetchError, Pipeline, PipelineStateError, Schedule, SchedulablePipeline,
    ScheduleValidationError, SlotNotSetError, Task, TaskAbortedError, TaskContext,
    UndeclaredSlotWarning,
)

BATCHES = 6
MAX_LA = 2


class Boom(Exception):
    pass


def build(fail_task: str | None, fail_iteration: int, executor: str, log: list[tuple[str, int]]) -> Pipeline:
    lock = threading.Lock()
    armed = [True]  # fail once only, so the pipeline can be reused after reset()

    def body(ctx: TaskContext) -> None:
        with lock:
            log.append((ctx.task.name, ctx.iter_count))
        if armed[0] and ctx.task.name == fail_task and ctx.iter_count == fail_iteration:
            armed[0] = False
            raise Boom(f"{fail_task}@{fail_iteration}")

    async def async_body(ctx: TaskContext) -> None:
        await asyncio.sleep(0)
        body(ctx)

    tasks = [
        Task.from_fn("h2d", body, lookahead=2, stream="memcpy", writes=("gpu",)),
        Task.from_fn("shuffle", body, lookahead=2, stream="memcpy", nccl=True, reads=("gpu",)),
        Task.from_fn("input_dist", body, lookahead=1, stream="data_dist", nccl=True, reads=("gpu",)),
        Task.from_fn("forward", async_body, reads=("gpu",), writes=("loss",)),
        Task.from_fn("backward", body, reads=("loss",), nccl=True),
        Task.from_fn("optimizer", body, depends_on=("backward",)),
        Task.from_fn("metrics", body, same_progress_sync=("optimizer",)),
    ]
    if executor == "sequential":
        return Pipeline(tasks)
    thread_map = {"h2d": "io", "shuffle": "io", "input_dist": "compute", "forward": "compute",
                  "backward": "compute", "optimizer": "compute", "metrics": "loop"}  # fmt: skip
    return Pipeline(tasks, executor=AsyncExecutor(thread_map))


LOOKAHEAD = {"h2d": 2, "shuffle": 2, "input_dist": 1, "forward": 0, "backward": 0,
             "optimizer": 0, "metrics": 0}  # fmt: skip
PHASES = {"prefill": 1, "steady": 3, "drain": BATCHES + 1}


def cases() -> list[tuple[str, str, str]]:
    out = []
    for executor in ("sequential", "async"):
        for task, la in LOOKAHEAD.items():
            for phase, iteration in PHASES.items():
                batch = iteration - (MAX_LA - la)
                if 0 <= batch < BATCHES:  # the task fires in that iteration
                    out.append((executor, task, phase))
    return out


@pytest.mark.parametrize(("executor", "task", "phase"), cases())
async def test_failure_raises_the_original_error_and_refuses_until_reset(
    executor: str, task: str, phase: str
) -> None:
    iteration = PHASES[phase]
    log: list[tuple[str, int]] = []
    pipe = build(task, iteration, executor, log)
    try:
        source = iter(range(BATCHES))
        with pytest.raises(Boom, match=f"{task}@{iteration}") as info:
            await asyncio.wait_for(collect(pipe, source), timeout=20)
        assert info.value.aiopipe_task == task  # type: ignore[attr-defined]
        assert info.value.aiopipe_iteration == iteration  # type: ignore[attr-defined]
        assert any(task in note for note in info.value.__notes__)
        # nothing ran after the failing iteration; the failing task ran once there
        assert max(it for _, it in log) == iteration
        assert log.count((task, iteration)) == 1
        # the pipeline says why it will not go on, until reset
        with pytest.raises(PipelineStateError, match="reset"):
            await pipe.progress(source)
        pipe.reset()
        log.clear()
        clean = build(None, -1, executor, log)
        assert len(await collect(clean, iter(range(3)))) == 3
        clean.shutdown()
        assert len(await collect(pipe, iter(range(2)))) == 2  # the broken one is reusable too
    finally:
        pipe.shutdown()


async def test_the_note_names_the_source_s_batch_and_explains_the_iteration() -> None:
    """``forward`` (lookahead 0 of 2) failing at internal iteration 2 works on the
    source's first batch: the note says so in words a newcomer can follow."""
    pipe = build("forward", 2, "async", [])
    async with pipe:
        with pytest.raises(Boom) as info:
            await collect(pipe, iter(range(BATCHES)))
    assert info.value.__notes__ == [
        "aiopipe: raised by task 'forward' on batch 0 of the source (counted from 0), in the "
        "pipeline's internal iteration 2 (an iteration works on several batches at once)",
        "aiopipe: the pipeline stops here: call reset() to discard the batches in flight "
        "(untrained) and go on, or shutdown()",
    ]


async def test_a_failure_skips_later_tasks_of_the_same_lane_and_aborts_tickets() -> None:
    log: list[tuple[str, int]] = []
    pipe = build("input_dist", 3, "async", log)
    with pytest.raises(Boom):
        await collect(pipe, iter(range(BATCHES)))
    ran_at_3 = {name for name, it in log if it == 3}
    # forward/backward/optimizer follow input_dist on the compute lane: never started;
    # metrics (loop lane) waits on optimizer: released, sees the failure, never starts.
    assert ran_at_3.isdisjoint({"forward", "backward", "optimizer", "metrics"})
    pipe.shutdown()


async def test_a_failure_before_any_task_ran_does_not_break_the_pipeline() -> None:
    def batches():  # type: ignore[no-untyped-def]
        yield 0
        raise OSError("disk gone")

    pipe = build(None, -1, "async", [])
    source = batches()
    with pytest.raises(OSError, match="disk gone") as info:
        await collect(pipe, source)
    assert pipe.statistics().broken is None
    # Only where the source was: nothing to reset, it goes on.
    assert info.value.__notes__ == [
        "aiopipe: raised by the source, reading its batch 1 (counted from 0); the batches "
        "before it are not lost: drain() finishes any still in flight"
    ]
    pipe.shutdown()


@pytest.mark.parametrize("where", ["lane", "loop"])
async def test_a_timed_out_progress_leaves_its_iteration_running_and_returns_it_next(
    where: str,
) -> None:
    lane_gate, loop_gate = threading.Event(), asyncio.Event()
    started = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow(ctx: TaskContext) -> None:
        if ctx.batch_index == 1:
            loop.call_soon_threadsafe(started.set)
            assert lane_gate.wait(10)
        ctx.slots.set("step_result", ctx.batch_index)

    async def slow_async(ctx: TaskContext) -> None:
        if ctx.batch_index == 1:
            started.set()
            await loop_gate.wait()  # a cancellation delivered here would lose the body
        ctx.slots.set("step_result", ctx.batch_index)

    body = slow if where == "lane" else slow_async
    tasks = [
        Task.from_fn("slow", body, stream="a", writes=("step_result",)),
        Task.from_fn("other", lambda ctx: None, lookahead=1),
    ]  # fmt: skip
    pipe = Pipeline(tasks, thread_map={"slow": "worker", "other": "loop"})
    source = iter(range(10))
    assert await pipe.progress(source) == 0
    call = asyncio.ensure_future(pipe.progress(source))
    await started.wait()  # batch 1's body is running, held by its gate
    call.cancel()  # what asyncio.wait_for does on its timeout
    with pytest.raises(asyncio.CancelledError):
        await call
    assert pipe.statistics().broken is None
    lane_gate.set()
    loop_gate.set()
    # the interrupted iteration's result comes first, then the rest: once, in order
    assert await collect(pipe, source) == list(range(1, 10))
    await pipe.aclose()


def test_an_iteration_left_on_another_loop_is_refused_there_not_waited_for() -> None:
    """A call cancelled on one loop leaves its iteration running on that loop; a call
    from another loop cannot wait for it (nothing would wake it) and says so, and
    back on its own loop the iteration finishes and its result comes next."""
    gates: dict[str, asyncio.Future[None]] = {}

    async def held(ctx: TaskContext) -> None:
        if ctx.batch_index == 0:
            gates["entered"].set_result(None)
            await gates["release"]
        ctx.slots.set("step_result", ctx.batch_index)

    pipe = Pipeline([Task.from_fn("held", held, writes=("step_result",))])
    source = iter(range(3))

    async def abandon() -> None:
        loop = asyncio.get_running_loop()
        gates["entered"], gates["release"] = loop.create_future(), loop.create_future()
        call = asyncio.ensure_future(pipe.progress(source))
        await gates["entered"]
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    async def elsewhere() -> None:
        with pytest.raises(PipelineStateError, match="another event loop"):
            await pipe.progress(source)

    async def finish() -> list[int]:
        gates["release"].set_result(None)
        results = await collect(pipe, source)
        await pipe.aclose()
        return results

    own, other = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        own.run_until_complete(abandon())
        other.run_until_complete(elsewhere())
        assert own.run_until_complete(finish()) == [0, 1, 2]
    finally:
        own.close()
        other.close()


async def test_a_progress_cancelled_anywhere_loses_no_batch() -> None:
    def record(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", (ctx.batch_index, ctx.slots["batch_cpu"]))

    for yields_before_cancel in range(6):  # wherever the cancellation lands
        pipe = Pipeline([Task.from_fn("t", record)], thread_map="per_task")  # lane hand-offs
        source = iter(range(4))
        first = asyncio.ensure_future(pipe.progress(source))
        for _ in range(yields_before_cancel):
            await asyncio.sleep(0)
        first.cancel()
        got = []
        try:
            got.append(await first)
        except asyncio.CancelledError:
            pass
        # every batch once, in order: the cancelled call's result comes with the next
        assert got + await collect(pipe, source) == [(i, i) for i in range(4)]
        await pipe.aclose()


async def test_cancelling_while_waiting_for_a_ticket() -> None:
    gate, started = threading.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def hold(ctx: TaskContext) -> None:
        loop.call_soon_threadsafe(started.set)
        assert gate.wait(10)

    tasks = [
        Task.from_fn("first", hold, nccl=True, stream="a"),
        Task.from_fn("second", lambda ctx: None, nccl=True, stream="b"),
    ]
    pipe = Pipeline(tasks, thread_map={"first": "one", "second": "loop"})
    source = iter(range(3))
    call = asyncio.ensure_future(pipe.progress(source))
    await started.wait()  # "first" holds ticket 0; "second" waits for ticket 1
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # the caller left; the iteration did not: its collectives keep their order
    assert pipe.executor.statistics().tickets.waiting == (1,)  # type: ignore[attr-defined]
    gate.set()
    assert len(await collect(pipe, source)) == 3
    assert pipe.executor.statistics().tickets.waiting == ()  # type: ignore[attr-defined]
    await pipe.aclose()


async def test_a_cancelled_step_still_trains_its_batch_and_the_next_step_gets_its_own() -> None:
    gate, started = threading.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    trained: list[int] = []

    def train(ctx: TaskContext) -> None:
        if ctx.slots["batch_cpu"] == 1:
            loop.call_soon_threadsafe(started.set)
            assert gate.wait(10)
        trained.append(ctx.slots["batch_cpu"])
        ctx.slots.set("step_result", ctx.slots["batch_cpu"] * 10)

    async with Pipeline([Task.from_fn("train", train, writes=("step_result",))]) as pipe:
        call = asyncio.ensure_future(pipe.step(1))
        await started.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        gate.set()
        assert await pipe.step(2) == 20  # its own result, not the cancelled step's
        assert trained == [1, 2]  # the cancelled step's batch was trained, once


def test_a_loop_shut_down_mid_step_skips_what_had_not_started_and_waits_for_the_rest() -> None:
    """A step on lane threads runs on when its caller is cancelled.  If the loop then
    shuts down (``asyncio.run`` cancels every task left and waits for them), the
    step's tasks not yet started are skipped, the running one finishes, and the
    shutdown waits for it: no lane is left running user code after the loop."""
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []

    def first(ctx: TaskContext) -> None:
        started.set()
        gate.wait(30)
        ran.append("first")

    def second(ctx: TaskContext) -> None:
        ran.append("second")
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    pipe = Pipeline([Task.from_fn("first", first),
                     Task.from_fn("second", second, depends_on=("first",),
                                  writes=("step_result",))], executor="async")  # fmt: skip

    async def abandon() -> None:
        call = asyncio.ensure_future(pipe.progress(iter([0])))
        await asyncio.to_thread(started.wait, 30)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(abandon())
        # What asyncio.run does next: cancel every task left, then wait for them.
        left = asyncio.all_tasks(loop)
        assert len(left) == 1  # the one waiting for the step
        for task in left:
            task.cancel()
        loop.call_soon(gate.set)  # runs after that task has taken its cancellation
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        assert ran == ["first"]  # it finished before the shutdown went on; "second" skipped
    finally:
        loop.close()

    async def after() -> list[int]:
        with pytest.raises(PipelineStateError, match="interrupted by CancelledError"):
            await pipe.progress(iter([1]))
        pipe.reset()
        results = await collect(pipe, iter([1, 2]))
        await pipe.aclose()
        return results

    assert asyncio.run(after()) == [1, 2]


def test_asyncio_run_waits_for_a_step_whose_caller_its_shutdown_cancelled() -> None:
    """``main()`` returns with a ``progress()`` still running in a task of its own.
    ``asyncio.run`` cancels that task as it shuts down; the step on the lanes still
    ends while the loop is open, and its result comes from the next call."""
    started, gate, closed = threading.Event(), threading.Event(), threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []
    loop_closed_at_second: list[bool] = []

    class Loop(asyncio.SelectorEventLoop):
        def close(self) -> None:
            super().close()
            closed.set()

    def first(ctx: TaskContext) -> None:
        started.set()
        gate.wait(30)
        closed.wait(0.2)  # set only if the loop closes while the step runs

    def second(ctx: TaskContext) -> None:
        loop_closed_at_second.append(loops[0].is_closed())
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    pipe = Pipeline([Task.from_fn("first", first),
                     Task.from_fn("second", second, depends_on=("first",),
                                  writes=("step_result",))], executor="async")  # fmt: skip
    source = iter([7])

    async def main() -> None:
        loops.append(asyncio.get_running_loop())
        call = asyncio.ensure_future(pipe.progress(source))
        call.add_done_callback(lambda _: gate.set())  # once the shutdown has cancelled it
        await asyncio.to_thread(started.wait, 30)

    with asyncio.Runner(loop_factory=Loop) as runner:
        runner.run(main())
    assert loop_closed_at_second == [False]

    async def after() -> list[int]:
        results = await collect(pipe, source)
        await pipe.aclose()
        return results

    assert asyncio.run(after()) == [7]


def test_a_system_exit_from_a_body_leaves_the_loop_when_its_caller_is_gone() -> None:
    """As from a task: ``SystemExit``/``KeyboardInterrupt`` raised by a body on a lane
    is not kept for a later call (which may never come) but leaves the loop."""
    entered, gate = threading.Event(), threading.Event()

    def body(ctx: TaskContext) -> None:
        if ctx.batch_index == 1:
            entered.set()
            gate.wait(30)
            raise SystemExit(3)
        ctx.slots.set("step_result", ctx.batch_index)

    pipe = Pipeline([Task.from_fn("t", body, writes=("step_result",))], executor="async")

    async def main() -> None:
        source = iter(range(3))
        assert await pipe.progress(source) == 0
        call = asyncio.ensure_future(pipe.progress(source))
        await asyncio.to_thread(entered.wait, 30)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        gate.set()
        await asyncio.wait_for(asyncio.Event().wait(), 30)  # SystemExit ends this first

    with pytest.raises(SystemExit):
        asyncio.run(main())
    with pytest.raises(PipelineStateError, match="interrupted by SystemExit"):
        asyncio.run(_progress_once(pipe))
    pipe.reset()
    pipe.shutdown()


async def _progress_once(pipe: Pipeline) -> object:
    return await pipe.progress(iter([0]))


async def test_a_source_numbered_on_from_another_pipeline_names_its_batches_so() -> None:
    """``continue_numbering``: a source that gave 10 batches to an engine torn down
    (an adapter's reset()) is numbered on from 10 here, in ``ctx.batch_index`` and in
    a failure's note; ``statistics()`` counts only this pipeline's; another source
    starts at 0; refused once the pipeline has fed from the source, and for a bad count."""
    seen: list[int] = []

    def body(ctx: TaskContext) -> None:
        seen.append(ctx.batch_index)
        if ctx.slots["batch_cpu"] == "bad":
            raise RuntimeError("a bad batch")
        ctx.slots.set("step_result", ctx.batch_index)

    pipe = SchedulablePipeline(Schedule.of([Task.from_fn("body", body, writes=("step_result",))]))
    source = iter(["ok", "ok", "bad"])
    pipe.continue_numbering(source, 10)
    assert [await pipe.progress(source) for _ in range(2)] == [10, 11]
    with pytest.raises(PipelineStateError, match="fed from it already"):
        pipe.continue_numbering(source, 3)
    with pytest.raises(RuntimeError, match="a bad batch") as info:
        await pipe.progress(source)
    assert "on batch 12 of the source" in info.value.__notes__[0]
    assert (pipe.statistics().pulled, pipe.statistics().position) == (3, 2)  # its own counts
    pipe.reset()
    with pytest.raises(PipelineStateError, match="fed from it already"):
        pipe.continue_numbering(source, 5)  # after reset() (or drain()) it counts on itself
    other = iter(["ok"])
    pipe.continue_numbering(other, 5)  # for that source's next feed; another comes first
    assert await pipe.progress(iter(["ok"])) == 0
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="batches_before must be an int >= 0"):
            pipe.continue_numbering(source, bad)  # type: ignore[arg-type]
    await pipe.aclose()
    assert seen == [10, 11, 12, 0]


def produces(slot: str) -> Callable[[TaskContext], None]:
    def body(ctx: TaskContext) -> None:
        ctx.slots.set(slot, ctx.slots["batch_cpu"])

    return body


def reads_feature(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["feature"])


@pytest.mark.parametrize("declared", [True, False])
async def test_a_slot_read_unset_names_its_declared_producer_or_says_there_is_none(
    declared: bool,
) -> None:
    # It said "declare the producer in reads/writes so it runs first" even when the
    # producer was declared and had only not set it.
    writes = ("feature",) if declared else ()
    tasks = [Task.from_fn("make", lambda ctx: None, writes=writes),
             Task.from_fn("use", reads_feature, reads=writes, writes=("step_result",))]  # fmt: skip
    async with Pipeline(tasks) as pipe:
        with pytest.raises(KeyError) as refused:  # still a KeyError, for except clauses
            await pipe.progress(iter([1]))
    assert isinstance(refused.value, SlotNotSetError) and refused.value.slot == "feature"
    assert str(refused.value) == "slot 'feature' is not set for batch 0 (set: ['batch_cpu'])"
    note = next(n for n in refused.value.__notes__ if "writes=('feature',)" in n)
    if declared:
        assert "task 'make' declares writes=('feature',) but had not set it" in note
        assert "ctx.slots.set('feature', value)" in note
    else:
        assert "no task declares writes=('feature',)" in note and "reads=('feature',)" in note


async def test_a_slot_set_that_no_task_declares_is_warned_about_once() -> None:
    # Set without writes=, it orders nothing: here both tasks share a lane, so the
    # read finds it, and nothing said that another thread map would break it.
    tasks = [Task.from_fn("make", produces("feature")),
             Task.from_fn("use", reads_feature, writes=("step_result",))]  # fmt: skip
    async with Pipeline(tasks, executor="sequential") as pipe:
        with pytest.warns(UndeclaredSlotWarning, match=r"slot 'feature' was set .* no task "
                                                        r"declares writes=\('feature',\)"):
            assert [r async for r in pipe.results(range(3))] == [0, 1, 2]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: not again, nor for later batches
            assert [r async for r in pipe.results(range(3))] == [0, 1, 2]


async def test_slots_an_adapter_seeds_are_not_warned_about() -> None:
    async with Pipeline([Task.from_fn("use", produces("step_result"),
                                      writes=("step_result",))]) as pipe:  # fmt: skip
        pipe.seed_first_batch({"batch_cpu": 5, "prepared": True})
        with warnings.catch_warnings():
            warnings.simplefilter("error", UndeclaredSlotWarning)
            assert [r async for r in pipe.results(range(2))] == [5, 0, 1]


async def test_an_undeclared_slot_warning_made_an_error_loses_no_result() -> None:
    # Given at the start of the next call, before it takes anything: under -W error
    # that call raises it, and the results all come out after.
    tasks = [Task.from_fn("make", produces("feature")),
             Task.from_fn("use", reads_feature, writes=("step_result",))]  # fmt: skip
    async with Pipeline(tasks, executor="sequential") as pipe:
        source = iter(range(4))
        with warnings.catch_warnings():
            warnings.simplefilter("error", UndeclaredSlotWarning)
            got = [await pipe.progress(source)]
            with pytest.raises(UndeclaredSlotWarning):
                await pipe.progress(source)
            got += [r async for r in pipe.results(source)]
        assert got == [0, 1, 2, 3]


def makes_two_tasks() -> list[Task]:
    """One task that sets two slots no task declares."""

    def make(ctx: TaskContext) -> None:
        ctx.slots.set("first", 1)
        ctx.slots.set("second", 2)
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    return [Task.from_fn("make", make, writes=("step_result",))]


async def test_undeclared_slots_of_a_pipeline_s_only_call_are_warned_of_at_shutdown() -> None:
    # One progress_many() over the whole source, then the end of the block: no later
    # call gave the warnings, and they were lost.
    with pytest.warns(UndeclaredSlotWarning) as warned:
        async with Pipeline(makes_two_tasks(), executor="sequential") as pipe:
            assert await pipe.progress_many(iter(range(3)), 5) == [0, 1, 2]
    assert sorted(str(w.message).split("'")[1] for w in warned) == ["first", "second"]
    assert all(w.filename == __file__ for w in warned)  # the user's line, not aiopipe's


async def test_an_undeclared_slot_warning_made_an_error_leaves_the_others_for_later() -> None:
    raised: list[str] = []
    async with Pipeline(makes_two_tasks(), executor="sequential") as pipe:
        source = iter(range(5))
        with warnings.catch_warnings():
            warnings.simplefilter("error", UndeclaredSlotWarning)
            got = [await pipe.progress(source)]
            for _ in range(2):
                with pytest.raises(UndeclaredSlotWarning) as warning:
                    await pipe.progress(source)
                raised.append(str(warning.value).split("'")[1])
            got += [r async for r in pipe.results(source)]
    assert sorted(raised) == ["first", "second"] and got == [0, 1, 2, 3, 4]


class TwoArguments(Exception):
    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


@pytest.mark.parametrize("error", [
    SlotNotSetError("feature", 3, ["batch_cpu"]), FetchError("key", 2, ValueError("bad")),
    FetchError("key", 2, TwoArguments("fetch", "refused")),  # itself rebuilt from its message
    ScheduleValidationError(4, "two tasks write 'x'"),
    TaskAbortedError(asyncio.CancelledError("cancelled elsewhere")),
])  # fmt: skip
def test_errors_survive_pickling_and_copying(error: Exception) -> None:
    # Built from other arguments than their message, they could not be rebuilt: an
    # error crossing a process boundary (a DataLoader worker, a spawned rank) failed.
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(again) is type(error) and str(again) == str(error)
        assert again.__dict__ == error.__dict__


def test_the_blocking_form_s_undeclared_slot_warning_points_at_the_user_s_line() -> None:
    # It pointed at asyncio's events.py: the blocking call runs the coroutine on a loop.
    with pytest.warns(UndeclaredSlotWarning) as warned:
        with Pipeline(makes_two_tasks(), executor="sequential").blocking() as pipe:
            assert [pipe.progress(iter([5])), pipe.progress(iter([6]))] == [5, 6]
    assert warned and all(w.filename == __file__ for w in warned)


async def test_at_shutdown_an_undeclared_slot_warning_made_an_error_hides_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Raised by the exit of the block, it replaced the body's own error.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UndeclaredSlotWarning)
        with pytest.raises(ValueError, match="the body's own"):
            async with Pipeline(makes_two_tasks(), executor="sequential") as pipe:
                assert await pipe.progress_many(iter(range(2)), 5) == [0, 1]
                raise ValueError("the body's own")
    assert pipe.statistics().closed
    assert "slot 'first' was set" in caplog.text and "slot 'second' was set" in caplog.text
