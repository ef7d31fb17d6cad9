"""aiopipe.dag: tags, groups, poisoning, back-pressure, scopes, random DAGs."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
import tracemalloc
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiopipe
from aiopipe import BackPressureTimeout, GraphError, PoisonedError
from aiopipe.dag import INOUT, INPUT, NO_DEP, OUTPUT, OUTPUT_EXISTING, TaskGraph


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def step(self, name: str, delay: float = 0.0):  # type: ignore[no-untyped-def]
        def body(*tensors: torch.Tensor) -> str:
            with self.lock:
                self.events.append(("start", name))
            time.sleep(delay)
            with self.lock:
                self.events.append(("end", name))
            return name

        body.__name__ = name
        return body

    def before(self, first: str, second: str) -> bool:
        """``first`` ended before ``second`` started."""
        return self.events.index(("end", first)) < self.events.index(("start", second))


async def test_read_after_write_waits_for_the_writer() -> None:
    log, x = Log(), torch.zeros(4)
    async with TaskGraph() as graph:
        await graph.submit(log.step("write", 0.05), OUTPUT(x), lane="a")
        await graph.submit(log.step("read"), INPUT(x), lane="b")
    assert log.before("write", "read")


async def test_inout_orders_after_the_previous_writer_and_becomes_the_writer() -> None:
    log, x = Log(), torch.zeros(4)
    async with TaskGraph() as graph:
        await graph.submit(log.step("w1", 0.03), OUTPUT(x), lane="a")
        await graph.submit(log.step("rw", 0.03), INOUT(x), lane="b")
        await graph.submit(log.step("r"), INPUT(x), lane="c")
    assert log.before("w1", "rw") and log.before("rw", "r")


@pytest.mark.parametrize("tag", [OUTPUT, OUTPUT_EXISTING])
async def test_output_is_a_pure_overwrite_that_replaces_the_producer(tag: object) -> None:
    log, x = Log(), torch.zeros(4)
    release = threading.Event()

    def slow_writer(t: torch.Tensor) -> None:
        release.wait(5)

    async with TaskGraph() as graph:
        first = await graph.submit(slow_writer, OUTPUT(x), lane="a", name="first")
        second = await graph.submit(log.step("second"), tag(x), lane="b")  # type: ignore[operator]
        assert await second == "second" and not first.done()  # did not wait
        await graph.submit(log.step("reader"), INPUT(x), lane="c")
        release.set()
    assert log.before("second", "reader")  # reads follow the latest writer


async def test_no_dep_never_orders() -> None:
    gate, x = threading.Event(), torch.zeros(2)
    async with TaskGraph() as graph:
        await graph.submit(lambda t: gate.wait(5), OUTPUT(x), lane="a")
        free = await graph.submit(lambda t: "ran", NO_DEP(x), lane="b")
        assert await free == "ran"
        gate.set()


async def test_tensors_are_keyed_by_their_data_address() -> None:
    log, x = Log(), torch.zeros(8)
    gate = threading.Event()
    async with TaskGraph() as graph:
        await graph.submit(log.step("write_all", 0.03), OUTPUT(x), lane="a")
        await graph.submit(log.step("read_view"), INPUT(x[:4]), lane="b")  # same start
        # disjoint rows of one buffer: independent writers, each awaited by its reader
        await graph.submit(lambda r: gate.wait(5), OUTPUT(x[4:6]), lane="c")
        row = await graph.submit(lambda r: "row 6", OUTPUT(x[6:]), lane="d")
        assert await row == "row 6"
        reader = await graph.submit(lambda a, b: "both", INPUT(x[4:6]), INPUT(x[6:]), lane="e")
        await asyncio.sleep(0.05)
        assert not reader.done()  # still waiting for the gated row
        gate.set()
        assert await reader == "both"
    assert log.before("write_all", "read_view")


async def test_values_reach_the_function_untagged_with_keywords() -> None:
    x, y = torch.ones(3), torch.empty(3)

    def scale(src: torch.Tensor, dst: torch.Tensor, *, factor: float) -> float:
        dst.copy_(src * factor)
        return factor

    async with TaskGraph() as graph:
        handle = await graph.submit(scale, INPUT(x), OUTPUT(y), factor=2.5)
        assert await handle == 2.5
    assert y.tolist() == [2.5, 2.5, 2.5]


async def test_tagged_keyword_arguments_are_untagged_and_ordered_like_positional_ones() -> None:
    x, total = torch.zeros(3), torch.zeros(3)
    gate = threading.Event()

    def fill(*, out: torch.Tensor) -> None:
        gate.wait(5)
        out.fill_(1.0)

    def add(*, src: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        acc.add_(src)  # a Tagged here would raise: the value is the tensor itself
        return acc.clone()

    async with TaskGraph() as graph:
        await graph.submit(fill, out=OUTPUT(x), lane="a")
        first = await graph.submit(add, src=INPUT(x), acc=INOUT(total), lane="b")
        second = await graph.submit(lambda *, t: t.clone(), t=INPUT(total), lane="c")
        assert graph.statistics().tracked_tensors == 2  # x and total, from keywords
        gate.set()
        assert (await first).tolist() == [1.0, 1.0, 1.0]  # ran after fill's write
        assert (await second).tolist() == [1.0, 1.0, 1.0]  # and after add's


async def test_async_functions_run_on_the_loop() -> None:
    seen = []

    async def work(x: torch.Tensor) -> str:
        await asyncio.sleep(0)
        seen.append(threading.current_thread().name)
        return "async"

    async with TaskGraph() as graph:
        assert await (await graph.submit(work, INPUT(torch.zeros(1)))) == "async"
    assert seen == [threading.current_thread().name]


async def test_group_completes_when_every_member_has() -> None:
    out = [torch.zeros(1) for _ in range(4)]

    def fill(t: torch.Tensor, value: float) -> float:
        t.fill_(value)
        return value

    async with TaskGraph() as graph:
        group = await graph.submit_group(fill, [(OUTPUT(t), float(i)) for i, t in enumerate(out)])
        total = await graph.submit(lambda *ts: sum(float(t) for t in ts), *(INPUT(t) for t in out))
        assert await group == [0.0, 1.0, 2.0, 3.0]
        assert await total == 6.0


async def test_group_failure_skips_later_members_and_poisons_consumers() -> None:
    ran: list[int] = []
    out = torch.zeros(3)

    def member(t: torch.Tensor, i: int) -> None:
        ran.append(i)
        if i == 1:
            raise ValueError("member 1")

    with pytest.raises(BaseExceptionGroup) as info:
        async with TaskGraph() as graph:
            group = await graph.submit_group(member, [(OUTPUT(out), i) for i in range(3)], name="g")
            after = await graph.submit(lambda t: None, INPUT(out), name="after")
            with pytest.raises(ValueError, match="member 1"):
                await group
            with pytest.raises(PoisonedError, match="'g'"):
                await after
    assert ran == [0, 1]
    assert [type(e) for e in info.value.exceptions] == [ValueError]


async def test_poisoning_spares_unrelated_work_and_scope_reports_originals() -> None:
    a, b, c = torch.zeros(1), torch.zeros(1), torch.zeros(1)

    def boom(t: torch.Tensor) -> None:
        raise KeyError("producer broke")

    with pytest.raises(BaseExceptionGroup) as info:
        async with TaskGraph() as graph:
            await graph.submit(boom, OUTPUT(a), name="producer")
            child = await graph.submit(lambda x, y: None, INPUT(a), OUTPUT(b), name="child")
            grandchild = await graph.submit(lambda y: None, INPUT(b), name="grandchild")
            other = await graph.submit(lambda z: "fine", OUTPUT(c), name="other")
            assert await other == "fine"
            with pytest.raises(PoisonedError, match="'grandchild' did not run: task 'producer'"):
                await grandchild
            with pytest.raises(PoisonedError):
                await child
    (error,) = info.value.exceptions
    assert isinstance(error, KeyError) and error.aiopipe_task == "producer"  # type: ignore[attr-defined]


async def test_back_pressure_waits_then_times_out_clearly() -> None:
    gate = threading.Event()
    async with TaskGraph(max_in_flight=2, submit_timeout_s=0.2) as graph:
        await graph.submit(lambda: gate.wait(5))
        await graph.submit(lambda: gate.wait(5), lane="other")
        loop = asyncio.get_running_loop()
        started = loop.time()  # the timer's own clock
        with pytest.raises(BackPressureTimeout, match="max_in_flight=2"):
            await graph.submit(lambda: None)
        # it waited for room before refusing (uvloop's timers are millisecond-grained,
        # so the bound leaves room below the 0.2 s timeout)
        assert loop.time() - started >= 0.15
        gate.set()
        await (await graph.submit(lambda: None))  # room again once they finish
    assert issubclass(BackPressureTimeout, TimeoutError)


async def test_a_cancelled_awaiter_of_a_handle_cancels_nothing_else() -> None:
    # One awaiter of a running task is cancelled: the task runs on, another awaiter
    # and a consumer of its output get what they would have, and its room comes back.
    started, release = threading.Event(), threading.Event()
    x = torch.zeros(2)

    def produce(out: torch.Tensor) -> str:
        started.set()
        assert release.wait(10)
        out.fill_(3)
        return "produced"

    async with TaskGraph(max_in_flight=2, submit_timeout_s=5) as graph:
        handle = await graph.submit(produce, OUTPUT(x), lane="a")
        consumer = await graph.submit(lambda t: float(t.sum()), INPUT(x), lane="b")
        cancelled = asyncio.ensure_future(_await(handle))
        other = asyncio.ensure_future(_await(handle))
        assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        await asyncio.sleep(0)  # both awaiters wait on the handle
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert not handle.done()  # the task still runs
        release.set()
        assert await other == "produced" and await handle == "produced"
        assert await consumer == 6.0
        assert graph.statistics().in_flight == 0
        await (await graph.submit(lambda: None))  # room for more


async def _await(handle: object) -> object:
    return await handle  # type: ignore[misc]


async def test_scopes_opened_by_two_tasks_at_once_keep_their_own_tasks() -> None:
    # A opens a scope, then B opens one; A submits a task, then B a failing one; A
    # leaves first.  A's scope waits for A's task and raises nothing; B's raises B's
    # failure (one stack shared by both put A's task in B's scope, and A raised it).
    steps = {name: asyncio.Event() for name in ("a_in", "b_in", "a_sent", "b_sent", "a_out")}
    outcomes: dict[str, object] = {}

    def boom() -> None:
        raise ValueError("b's task failed")

    async with TaskGraph() as graph:

        async def a() -> None:
            async with graph.scope():
                steps["a_in"].set()
                await steps["b_in"].wait()
                handle = await graph.submit(lambda: "a's", lane="a")
                steps["a_sent"].set()
                await steps["b_sent"].wait()
            outcomes["a"], outcomes["a_done"] = None, handle.done()
            steps["a_out"].set()

        async def b() -> None:
            await steps["a_in"].wait()
            try:
                async with graph.scope():
                    steps["b_in"].set()
                    await steps["a_sent"].wait()
                    await graph.submit(boom, lane="b")
                    steps["b_sent"].set()
                    await steps["a_out"].wait()
                outcomes["b"] = None
            except BaseException as exc:  # noqa: BLE001 -- inspected below
                outcomes["b"] = exc

        await asyncio.gather(a(), b())
    assert outcomes["a"] is None and outcomes["a_done"] is True
    errors = outcomes["b"]
    assert isinstance(errors, BaseExceptionGroup)
    assert [str(e) for e in errors.exceptions] == ["b's task failed"]


async def test_submit_outside_the_graph_is_an_error() -> None:
    graph = TaskGraph()
    with pytest.raises(GraphError, match="async with"):
        await graph.submit(lambda: None)


async def test_alloc_buffers_are_released_when_unreferenced() -> None:
    async with TaskGraph() as graph:
        buffer = graph.alloc((4, 4), torch.float64)
        assert buffer.dtype == torch.float64 and graph.statistics().live_allocations == 1
        def fill(t: torch.Tensor) -> None:  # returns nothing: the graph keeps results
            t.fill_(1)

        await (await graph.submit(fill, OUTPUT_EXISTING(buffer)))
        assert float(buffer.sum()) == 16
        del buffer
        gc.collect()
        assert graph.statistics().live_allocations == 0


@pytest.mark.one_loop
async def test_scopes_keep_a_long_running_graph_from_growing() -> None:
    """30 000 submissions: after each scope the graph tracks nothing, and the 20 000
    after the baseline leave under 12 bytes each behind (100 000 took 24 s in CI)."""
    buffers = [torch.zeros(1) for _ in range(64)]
    async with TaskGraph(max_in_flight=4096) as graph:
        tracemalloc.start()
        baseline = None
        for round_ in range(30):
            async with graph.scope():
                for i in range(1000):
                    t = buffers[(round_ * 7 + i) % 64]
                    await graph.submit(lambda x: None, INOUT(t), lane="loop")
            stats = graph.statistics()
            assert stats.in_flight == 0 and stats.tracked_tensors == 0 and stats.open_scopes == 1
            if round_ == 10:
                gc.collect()
                baseline = tracemalloc.get_traced_memory()[0]
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - (baseline or 0)
        tracemalloc.stop()
    assert grown < 240_000, f"memory grew by {grown} bytes over 20 000 submissions"


@st.composite
def programs(draw: st.DrawFn) -> list[tuple[str, int, list[int]]]:
    """Ops over 6 tensors: ("out", dst, srcs) fills a never-written tensor from
    sources, ("acc", dst, srcs) accumulates into a written one in place.  The tag
    table orders reads after writes and INOUT after the previous writer; OUTPUT is a
    pure overwrite and nothing orders writes after reads, so programs avoid both
    hazards, as a caller must."""
    ops: list[tuple[str, int, list[int]]] = []
    written: set[int] = set()
    read_since_write: set[int] = set()
    for _ in range(draw(st.integers(1, 25))):
        srcs = draw(st.lists(st.sampled_from(sorted(written)), max_size=3)) if written else []
        candidates = [t for t in range(6) if t not in read_since_write and t not in srcs]
        if not candidates:
            break
        dst = draw(st.sampled_from(candidates))
        kind = "acc" if dst in written else "out"
        ops.append((kind, dst, srcs))
        read_since_write |= set(srcs)
        written.add(dst)
    return ops


def apply(kind: str, dst: torch.Tensor, *srcs: torch.Tensor) -> None:
    time.sleep(random.random() * 1e-4)
    total = sum((s * (i + 2) for i, s in enumerate(srcs)), torch.ones(1))
    if kind == "acc":
        dst.mul_(3).add_(total)
    else:
        dst.copy_(total + 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs(), lanes=st.lists(st.sampled_from(["a", "b", "c", "loop"]), min_size=25, max_size=25))
def test_random_graphs_equal_a_sequential_reference(program: list, lanes: list[str]) -> None:
    reference = [torch.zeros(1) for _ in range(6)]
    for kind, dst, srcs in program:
        apply(kind, reference[dst], *(reference[s] for s in srcs))

    tensors = [torch.zeros(1) for _ in range(6)]

    async def run() -> None:
        async with TaskGraph() as graph:
            for (kind, dst, srcs), lane in zip(program, lanes):
                tag = INOUT if kind == "acc" else OUTPUT
                await graph.submit(apply, kind, tag(tensors[dst]),
                                   *(INPUT(tensors[s]) for s in srcs), lane=lane)  # fmt: skip

    aiopipe.run(run())
    assert [float(t) for t in tensors] == [float(t) for t in reference]


async def test_failures_name_their_task_and_submission() -> None:
    def boom(t: torch.Tensor) -> None:
        raise RuntimeError("no")

    with pytest.raises(BaseExceptionGroup) as info:
        async with TaskGraph() as graph:
            await graph.submit(lambda: None, name="first")
            await graph.submit(lambda: None, name="second")
            handle = await graph.submit(boom, OUTPUT(torch.zeros(1)), name="third")
            assert handle.submission == 2
    (error,) = info.value.exceptions
    assert error.aiopipe_task == "third" and error.aiopipe_submission == 2  # type: ignore[attr-defined]
    assert error.__notes__ == ["aiopipe: raised by task 'third' of a TaskGraph (submission 2)"]
    assert not hasattr(error, "aiopipe_iteration")  # graphs have no iterations


class Result:
    """A task's result, weakly referenced to see who still holds it."""


async def test_back_pressure_counts_unfinished_tasks_and_the_graph_keeps_no_finished_one() -> None:
    """Consumers that hold their producers' outputs fill the window; the producers,
    finished, neither count nor stay in the graph, so it cannot grow past it."""
    release_consumers = threading.Event()
    results: list[weakref.ref[Result]] = []

    def produce(t: torch.Tensor) -> Result:
        t.fill_(1)
        result = Result()
        results.append(weakref.ref(result))
        return result

    def consume(t: torch.Tensor) -> float:
        assert release_consumers.wait(10)
        return float(t)

    async with TaskGraph(max_in_flight=3, submit_timeout_s=0.1) as graph:
        consumers = []
        for _ in range(3):
            t = torch.zeros(1)
            await (await graph.submit(produce, OUTPUT(t), lane="producers"))
            consumers.append(await graph.submit(consume, INPUT(t), lane="consumers"))
        with pytest.raises(BackPressureTimeout):  # three held consumers fill the window
            await graph.submit(produce, OUTPUT(torch.zeros(1)), lane="producers")
        stats = graph.statistics()
        assert stats.in_flight == 3 and stats.tracked_tensors == 0  # only the consumers
        gc.collect()
        assert [ref() for ref in results] == [None] * 3  # no producer result held
        release_consumers.set()
        assert [await c for c in consumers] == [1.0] * 3
        await (await graph.submit(produce, OUTPUT(torch.zeros(1)), lane="producers"))


async def test_a_running_consumer_does_not_keep_its_producers_result() -> None:
    producer_may_run, consumer_runs, consumer_may_end = (threading.Event() for _ in range(3))
    results: list[weakref.ref[Result]] = []

    def produce(t: torch.Tensor) -> Result:
        assert producer_may_run.wait(10)
        result = Result()
        results.append(weakref.ref(result))
        return result

    async with TaskGraph() as graph:
        t = torch.zeros(1)
        producer = await graph.submit(produce, OUTPUT(t), lane="producer")
        consumer = await graph.submit(
            lambda t: consumer_runs.set() or consumer_may_end.wait(10), INPUT(t), lane="consumer"
        )
        producer_may_run.set()  # the consumer was registered while its producer ran
        assert isinstance(await producer, Result)
        del producer
        assert await asyncio.to_thread(consumer_runs.wait, 10)
        gc.collect()
        assert results[0]() is None and not consumer.done()
        consumer_may_end.set()
        assert await consumer is True


@pytest.mark.one_loop
async def test_an_open_scope_keeps_only_unfinished_and_failed_tasks() -> None:
    """10 000 tasks in the root scope alone: the graph stays flat; a failure among
    them is kept and reported when the scope closes."""
    def produce(t: torch.Tensor) -> torch.Tensor:
        return torch.ones(256)  # a 1 KiB result nobody keeps

    def consume(t: torch.Tensor) -> None:
        return None

    def boom() -> None:
        raise KeyError("kept")

    with pytest.raises(BaseExceptionGroup) as info:
        async with TaskGraph() as graph:
            await graph.submit(boom, lane="loop")
            tracemalloc.start()
            baseline = 0
            for block in range(5):
                consumers = []
                for _ in range(1000):
                    t = torch.zeros(1)
                    await graph.submit(produce, OUTPUT(t), lane="loop")
                    consumers.append(await graph.submit(consume, INPUT(t), lane="loop"))
                for consumer in consumers:  # and so their producers
                    await consumer
                del consumers
                if block == 0:
                    gc.collect()
                    baseline = tracemalloc.get_traced_memory()[0]
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - baseline
            tracemalloc.stop()
            stats = graph.statistics()
            assert stats.in_flight == 0 and stats.tracked_tensors == 0
            assert grown < 500_000, f"memory grew by {grown} bytes over 8 000 submissions"
    assert [type(e) for e in info.value.exceptions] == [KeyError]


async def test_max_lanes_bounds_the_lane_threads() -> None:
    async with TaskGraph(max_lanes=2) as graph:
        await graph.submit(lambda: None, lane="a")
        await graph.submit(lambda: None, lane="b")
        with pytest.raises(GraphError, match=r"\['c'\] would give the graph 3 lane threads, more than max_lanes=2"):
            await graph.submit(lambda: None, lane="c")
        with pytest.raises(GraphError, match="max_lanes=2"):
            await graph.submit_group(lambda: None, [(), ()], lanes=["a", "c"])
        assert await (await graph.submit(lambda: "inline", lane="loop")) == "inline"  # no thread

        async def on_the_loop() -> str:
            return "async"

        assert await (await graph.submit(on_the_loop, lane="c")) == "async"  # no thread either
        await (await graph.submit_group(lambda: None, [(), (), ()], lanes=["b", "a"]))
        assert graph.statistics().lanes == ("a", "b")


async def test_leaving_the_graph_by_cancellation_does_not_join_running_lanes() -> None:
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def held(x: torch.Tensor) -> None:
        started.set()
        release.wait(10)
        finished.set()

    async def use_graph() -> None:
        async with TaskGraph() as graph:
            await graph.submit(held, OUTPUT(torch.zeros(1)), lane="a")

    user = asyncio.ensure_future(use_graph())
    assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
    user.cancel()  # lands in the graph's exit, which waits for `held`
    with pytest.raises(asyncio.CancelledError):
        await user
    try:
        assert not finished.is_set()  # the loop came back while the body still ran
    finally:
        release.set()
        for thread in threading.enumerate():  # the lane stops once its body ends
            if thread.name == "aiopipe-lane-a":
                thread.join(10)
