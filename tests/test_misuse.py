"""Misuse is loud: coroutine APIs called with no running event loop, and the blocking
form called inside one."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch

import aiopipe
from aiopipe import ConfigurationError, ConfigurationTypeError, NoRunningLoopError, Pipeline
from aiopipe import PipelineStateError, Task, TaskContext
from aiopipe.dag import TaskGraph
from aiopipe.presets import basic


def pipeline() -> Pipeline:
    return Pipeline([Task.from_fn("t", lambda ctx: None)])


def preset() -> Any:
    model = torch.nn.Linear(2, 1)
    return basic(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lambda out: out.sum())


CALLS: dict[str, Callable[[Any], Any]] = {
    "progress": lambda pipe: pipe.progress(iter(range(2))),
    "step": lambda pipe: pipe.step(1),
    "drain": lambda pipe: pipe.drain(),
    "results": lambda pipe: pipe.results(iter(range(2))),
}


AWAITED = sorted(set(CALLS) - {"results"})


@pytest.mark.parametrize("make", [pipeline, preset], ids=["Pipeline", "basic"])
@pytest.mark.parametrize("api", AWAITED)
def test_a_coroutine_never_run_makes_the_next_loopless_call_name_the_blocking_form(
    make: Callable[[], Any], api: str
) -> None:
    pipe = make()
    try:
        first = CALLS[api](pipe)  # no loop: a coroutine, which asyncio.run() could run
        with pytest.raises(AttributeError, match=r"returned a coroutine.*\.blocking\(\)"):
            first.item()  # used as a value: says why it is none
        for as_a_value in (float, lambda x: 1 + x, lambda x: x[0], lambda x: f"{x:.3f}",
                           lambda x: x < 1):  # fmt: skip
            with pytest.raises(TypeError, match=r"not a value: .*returned a coroutine"):
                as_a_value(first)
        with pytest.raises(NoRunningLoopError, match=r"\.blocking\(\)") as caught:
            CALLS[api](pipe)  # the previous coroutine never ran: the sync trap
        assert isinstance(caught.value, TypeError)  # a programming error, not a state
        assert f".{api}()" in str(caught.value) and "aiopipe.run" in str(caught.value)
        assert "never ran" in str(caught.value)
        first.close()
        # and nothing ran: the pipeline is untouched
        assert pipe.statistics().pulled == 0
    finally:
        pipe.shutdown()


@pytest.mark.parametrize("make", [pipeline, preset], ids=["Pipeline", "basic"])
def test_results_without_a_loop_is_refused_at_once(make: Callable[[], Any]) -> None:
    pipe = make()
    try:
        with pytest.raises(NoRunningLoopError, match=r"async for result in pipe\.results"):
            pipe.results(iter(range(2)))  # an async generator cannot be run later
        assert pipe.statistics().pulled == 0
    finally:
        pipe.shutdown()


@pytest.mark.parametrize("make", [pipeline, preset], ids=["Pipeline", "basic"])
async def test_a_plain_for_over_results_names_async_for(make: Callable[[], Any]) -> None:
    # It said only "'Results' object is not iterable".
    pipe = make()
    try:
        results = pipe.results(iter(range(2)))
        with pytest.raises(TypeError, match=r"'async for result in pipe\.results") as refused:
            for _ in results:
                pass
        assert "pipe.blocking().results" in str(refused.value)
        assert pipe.statistics().pulled == 0  # nothing was read
    finally:
        pipe.shutdown()


def echo(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])


@pytest.mark.parametrize("run", [asyncio.run, aiopipe.run], ids=["asyncio.run", "aiopipe.run"])
def test_running_a_coroutine_made_without_a_loop_is_the_standard_idiom(
    run: Callable[[Any], Any],
) -> None:
    pipe, source = Pipeline([Task.from_fn("train", echo)]), iter(range(4))
    try:
        assert [run(pipe.progress(source)) for _ in range(3)] == [0, 1, 2]
        assert run(pipe.drain()) == [3]
        assert run(pipe.step(7)) == 7
    finally:
        pipe.shutdown()


def test_one_call_with_no_loop_dropped_unawaited_warns_with_the_fix() -> None:
    pipe = preset()
    try:
        with pytest.warns(RuntimeWarning) as caught:
            pipe.progress(iter([torch.ones(4, 2)]))  # the mistake, once: nothing raises
            gc.collect()
        messages = [str(w.message) for w in caught]
        assert any("never awaited, so nothing ran" in m and "pipe.blocking()" in m
                   for m in messages)  # fmt: skip
        assert not any(m.startswith("coroutine ") for m in messages)  # not Python's bare one
    finally:
        pipe.shutdown()


def test_the_specification_t1_loop_written_without_await_fails_at_the_second_call() -> None:
    pipe = preset()
    source = iter([torch.ones(4, 2)] * 3)
    with pytest.raises(NoRunningLoopError), pytest.warns(RuntimeWarning, match="never awaited"):
        for _ in range(3):
            pipe.progress(source)  # the mistake: no await, no blocking()
        gc.collect()
    with pipe.blocking() as blocking:  # the fix the message names
        assert len(list(blocking.results(source))) == 3


def test_task_graph_submit_without_a_loop_is_refused_at_the_second_call() -> None:
    graph = TaskGraph()
    made = graph.submit(lambda: None)  # never run
    with pytest.raises(NoRunningLoopError, match="submit"):
        graph.submit(lambda: None)
    made.close()  # dropped on purpose: no trap any more
    graph.submit(lambda: None).close()


def test_hstu_pipeline_coroutine_apis_without_a_loop_are_refused() -> None:
    hstu = pytest.importorskip("hstu_tasks")
    model = torch.nn.Linear(2, 1)
    pipe = hstu.HSTUPipeline(model, torch.optim.SGD(model.parameters(), lr=0.1), "cpu")
    made = pipe.progress(iter([]))  # never run
    with pytest.raises(NoRunningLoopError, match="HSTUPipeline.progress"):
        pipe.progress(iter([]))
    with pytest.raises(NoRunningLoopError, match="HSTUPipeline.drain"):
        pipe.drain()  # the previous coroutine, whichever API made it, never ran
    with pytest.raises(NoRunningLoopError, match="async for result in pipe.results"):
        pipe.results(iter([]))
    made.close()
    pipe.shutdown()


async def test_the_blocking_form_inside_a_running_loop_is_refused() -> None:
    blocking = pipeline().blocking()
    with pytest.raises(PipelineStateError, match="await pipe.progress"):
        blocking.progress(iter(range(2)))
    assert asyncio.get_running_loop().is_running()
    blocking.pipeline.shutdown()


@pytest.mark.parametrize("check", [5, "not a function"])
def test_a_check_batch_that_cannot_be_called_is_refused_when_built(check: object) -> None:
    # It was accepted, and then every batch was refused as bad data.
    with pytest.raises(ConfigurationTypeError, match="check_batch must be a function"):
        Pipeline([Task.from_fn("t", echo)], check_batch=check)  # type: ignore[arg-type]


def test_an_async_check_batch_is_refused_when_built() -> None:
    # Never awaited, it let every batch through (with a "never awaited" warning).
    async def check(batch: object) -> None:
        raise ValueError("refuse everything")

    with pytest.raises(ConfigurationTypeError, match="async def one would never be awaited"):
        Pipeline([Task.from_fn("t", echo)], check_batch=check)  # type: ignore[arg-type]


def test_a_thread_map_naming_no_task_of_the_pipeline_is_refused() -> None:
    # A misspelt name left its task on lane "default" without a word.
    with pytest.raises(ConfigurationError, match=r"\['forwrd'\].*did you mean 'forward'"):
        Pipeline([Task.from_fn("forward", echo)], thread_map={"forwrd": "compute"})


@pytest.mark.parametrize(
    ("model", "optimizer", "loss_fn", "says"),
    [
        (None, "opt", None, "takes a torch.nn.Module, got a NoneType"),
        ("model", "model", None, "takes an optimizer"),
        ("model", "opt", 5, "loss_fn must be callable, got an int"),
        ("model", "opt", lambda output, target, extra: output, "takes one argument"),
    ],
)
def test_basic_refuses_parts_that_could_only_fail_at_the_first_step(
    model: Any, optimizer: Any, loss_fn: Any, says: str
) -> None:
    # They raised bare AttributeError/TypeError at the first step, or not at all.
    linear = torch.nn.Linear(2, 1)
    parts = {"model": linear, "opt": torch.optim.SGD(linear.parameters(), lr=0.1), None: None}
    with pytest.raises(ConfigurationTypeError, match=says):
        basic(parts[model], parts[optimizer], loss_fn=loss_fn)


def test_basic_refuses_an_async_loss_fn_when_built() -> None:
    async def loss(output: torch.Tensor) -> torch.Tensor:
        return output.sum()

    linear = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigurationTypeError, match="not async def"):
        basic(linear, torch.optim.SGD(linear.parameters(), lr=0.1), loss_fn=loss)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"max_in_flight": "5"}, "max_in_flight takes an int"),
        ({"max_in_flight": 2.5}, "max_in_flight takes an int"),
        ({"submit_timeout_s": "x"}, "submit_timeout_s takes a number"),
        ({"submit_timeout_s": -1}, "submit_timeout_s must be >= 0"),
        ({"default_lane": 5}, "default_lane takes a non-empty str"),
    ],
)
def test_a_task_graph_refuses_options_of_the_wrong_kind(options: Any, says: str) -> None:
    with pytest.raises((ConfigurationError, ConfigurationTypeError), match=says):
        TaskGraph(**options)


async def test_a_task_graph_refuses_submissions_of_the_wrong_kind() -> None:
    async with TaskGraph() as graph:
        with pytest.raises(ConfigurationTypeError, match="lane takes a non-empty str"):
            await graph.submit(len, "ab", lane=5)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationTypeError, match="name takes a non-empty str"):
            await graph.submit(len, "ab", name=5)  # type: ignore[arg-type]
        for members in ([1, 2], "ab"):  # were a TypeError, and two one-letter members
            with pytest.raises(ConfigurationTypeError, match="a sequence of its arguments"):
                await graph.submit_group(len, members)  # type: ignore[arg-type]


def test_a_task_s_nccl_flag_takes_a_bool() -> None:
    # bool("no") made it a collective task.
    with pytest.raises(ConfigurationTypeError, match="nccl must be True or False"):
        Task.from_fn("t", echo, nccl="no")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_body_that_returns_its_value_is_told_once(kind: str) -> None:
    # The value was dropped without a word, and every result was None.
    def returns(ctx: TaskContext) -> int:
        return ctx.slots["batch_cpu"] * 10  # type: ignore[no-any-return]

    async def returns_async(ctx: TaskContext) -> int:
        return ctx.slots["batch_cpu"] * 10  # type: ignore[no-any-return]

    body = returns if kind == "sync" else returns_async
    pipe = Pipeline([Task.from_fn("t", body, writes=("step_result",))])  # type: ignore[arg-type]
    with pytest.warns(aiopipe.IgnoredReturnWarning, match="task 't' returned int") as told:
        async with pipe:
            assert [r async for r in pipe.results([1, 2, 3])] == [None, None, None]
    assert len([w for w in told if w.category is aiopipe.IgnoredReturnWarning]) == 1
