"""Misuse is loud: coroutine APIs called with no running event loop, and the blocking
form called inside one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from aiopipe import NoRunningLoopError, Pipeline, PipelineStateError, Task
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


@pytest.mark.parametrize("make", [pipeline, preset], ids=["Pipeline", "basic"])
@pytest.mark.parametrize("api", sorted(CALLS))
def test_a_coroutine_api_called_without_a_loop_names_the_blocking_form(
    make: Callable[[], Any], api: str
) -> None:
    pipe = make()
    try:
        with pytest.raises(NoRunningLoopError, match=r"\.blocking\(\)") as caught:
            CALLS[api](pipe)
        assert isinstance(caught.value, TypeError)  # a programming error, not a state
        assert f".{api}()" in str(caught.value) and "aiopipe.run" in str(caught.value)
        # and nothing ran: the pipeline is untouched
        assert pipe.statistics().pulled == 0
    finally:
        pipe.shutdown()


def test_the_specification_t1_loop_written_without_await_fails_at_once() -> None:
    pipe = preset()
    source = iter([torch.ones(4, 2)] * 3)
    with pytest.raises(NoRunningLoopError):
        for _ in range(3):
            pipe.progress(source)  # the mistake: no await, no blocking()
    with pipe.blocking() as blocking:  # the fix the message names
        assert len(list(blocking.results(source))) == 3


def test_task_graph_submit_without_a_loop_is_refused() -> None:
    graph = TaskGraph()
    with pytest.raises(NoRunningLoopError, match="submit"):
        graph.submit(lambda: None)


def test_hstu_pipeline_coroutine_apis_without_a_loop_are_refused() -> None:
    hstu = pytest.importorskip("hstu_tasks")
    model = torch.nn.Linear(2, 1)
    pipe = hstu.HSTUPipeline(model, torch.optim.SGD(model.parameters(), lr=0.1), "cpu")
    with pytest.raises(NoRunningLoopError, match="HSTUPipeline.progress"):
        pipe.progress(iter([]))
    with pytest.raises(NoRunningLoopError, match="HSTUPipeline.drain"):
        pipe.drain()
    with pytest.raises(NoRunningLoopError, match="async for result in pipe.results"):
        pipe.results(iter([]))
    pipe.shutdown()


async def test_the_blocking_form_inside_a_running_loop_is_refused() -> None:
    blocking = pipeline().blocking()
    with pytest.raises(PipelineStateError, match="await pipe.progress"):
        blocking.progress(iter(range(2)))
    assert asyncio.get_running_loop().is_running()
    blocking.pipeline.shutdown()
