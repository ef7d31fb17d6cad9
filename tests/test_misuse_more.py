"""Misuse is refused when the object is built, with the house's errors: step hooks of
``basic()`` that could never train, numbers of the wrong type, misspelt names and
retired flags."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import aiopipe
from aiopipe import AsyncExecutor, ConfigurationError, ConfigurationTypeError, Pipeline, Task
from aiopipe import TaskContext
from aiopipe.dag import TaskGraph
from aiopipe.trace import Tracer, merge_traces


def build(**kwargs: Any) -> aiopipe.BasicPipeline:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs.setdefault("loss_fn", lambda out: out.sum())
    return aiopipe.basic(model, optimizer, **kwargs)


async def async_forward(model: torch.nn.Module, batch: Any) -> Any:
    return model(batch)


async def async_backward(loss: torch.Tensor) -> None:
    loss.backward()


async def async_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


class AsyncCall:
    async def __call__(self, loss: torch.Tensor) -> None:
        loss.backward()


# -- basic(): its parts ----------------------------------------------------------------


@pytest.mark.parametrize(("hook", "value"), [
    ("forward", async_forward),
    ("backward_fn", async_backward),
    ("backward_fn", AsyncCall()),
    ("optimizer_step_fn", async_step),
])  # fmt: skip
def test_basic_refuses_async_step_hooks_when_built(hook: str, value: object) -> None:
    # They were accepted: the coroutines were never awaited and nothing trained.
    with pytest.raises(ConfigurationTypeError, match=rf"^{hook} must be a plain function, "
                                                     r"not async def"):  # fmt: skip
        build(**{hook: value})


@pytest.mark.parametrize(("hook", "value", "described"), [
    ("forward", 3, "an int"),
    ("backward_fn", "x", "a str"),
    ("optimizer_step_fn", 1.5, "a float"),
])  # fmt: skip
def test_basic_refuses_step_hooks_that_are_not_callable(
    hook: str, value: object, described: str
) -> None:
    with pytest.raises(ConfigurationTypeError,
                       match=rf"^{hook} must be callable, got {described}; pass a function"):
        build(**{hook: value})


@pytest.mark.parametrize("value", [2.5, "2", True])
def test_basic_refuses_a_grad_accumulation_that_is_not_an_int(value: object) -> None:
    # 2.5 trained with one optimizer step in ten batches; "2" gave a bare TypeError.
    with pytest.raises(ConfigurationTypeError,
                       match=rf"grad_accumulation takes an int >= 1, got {value!r}"):
        build(grad_accumulation=value)


def test_basic_still_refuses_a_grad_accumulation_below_one() -> None:
    with pytest.raises(ConfigurationError, match="grad_accumulation must be >= 1, got 0"):
        build(grad_accumulation=0)


def test_basic_on_cuda_without_cuda_says_cuda_is_not_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It was a bare AssertionError ("Torch not compiled with CUDA enabled").
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigurationError, match=r"device 'cuda': CUDA is not available"):
        build(device="cuda")
    with pytest.raises(ConfigurationError, match=r"device 'bogus' is not a torch device"):
        build(device="bogus")


def test_basic_refuses_a_thread_map_naming_no_task() -> None:
    # A misspelt name was ignored: "forward" silently ran on the default lane.
    with pytest.raises(ConfigurationError, match=r"\['forwrd'\].*did you mean 'forward'"):
        build(prefetch=True, thread_map={"h2d": "io", "forwrd": "compute"})
    pipe = build(prefetch=True, thread_map={"h2d": "io", "forward": "compute"})
    pipe.shutdown()


def test_basic_says_threaded_is_gone_rather_than_suggest_another_option() -> None:
    with pytest.raises(ConfigurationTypeError, match=r"threaded=, which is gone") as caught:
        build(threaded=True)
    assert "did you mean" not in str(caught.value)
    assert "lane threads by default" in str(caught.value)


# -- numbers of the wrong type ---------------------------------------------------------


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda: AsyncExecutor(slow_wait_s="x"), ConfigurationTypeError,
     "slow_wait_s takes a number of seconds or None to turn it off, got 'x'"),
    (lambda: AsyncExecutor(slow_wait_s=-1), ConfigurationError,
     "slow_wait_s must be >= 0 seconds, got -1"),
    (lambda: AsyncExecutor(max_lanes="2"), ConfigurationTypeError,
     "max_lanes takes an int >= 1, got '2'"),
    (lambda: TaskGraph(max_lanes="4"), ConfigurationTypeError,
     "max_lanes takes an int >= 1, got '4'"),
    (lambda: TaskGraph(max_lanes=0), ConfigurationError, "max_lanes must be >= 1, got 0"),
    (lambda: Tracer(max_spans="10"), ConfigurationTypeError,
     "max_spans takes an int >= 1, got '10'"),
    (lambda: Tracer(max_spans=0), ConfigurationError, "max_spans must be >= 1, got 0"),
])  # fmt: skip
def test_numbers_of_the_wrong_type_are_refused_when_built(
    make: Callable[[], object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as caught:
        make()
    assert str(caught.value) == message


def test_executor_numbers_of_the_right_type_are_kept() -> None:
    assert AsyncExecutor(slow_wait_s=None).slow_wait_s is None
    assert AsyncExecutor(slow_wait_s=2).slow_wait_s == 2
    assert TaskGraph(submit_timeout_s=0).submit_timeout_s == 0
    assert Tracer(max_spans=5).max_spans == 5


# -- tracing -----------------------------------------------------------------------------


def one_task(trace: bool) -> Pipeline:
    def body(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", ctx.slots["batch_cpu"])

    return Pipeline([Task.from_fn("t", body, writes=("step_result",))], trace=trace)


def test_the_blocking_form_has_the_tracer() -> None:
    # pipe.blocking().tracer was an AttributeError while docs/tracing.md uses pipe.tracer.
    with one_task(trace=True).blocking() as pipe:
        assert pipe.tracer is pipe.pipeline.tracer and pipe.tracer is not None
        assert pipe.progress(iter(range(3))) == 0
        assert [span.task for span in pipe.tracer.spans] == ["t"]
    with one_task(trace=False).blocking() as untraced:
        assert untraced.tracer is None


@pytest.mark.parametrize("as_path", [str, Path])
def test_merge_traces_refuses_a_single_path(tmp_path: Path, as_path: Callable[[str], Any]) -> None:
    # A str was iterated character by character: IsADirectoryError: '/'.
    trace = tmp_path / "rank0.json"
    trace.write_text(json.dumps({"traceEvents": [{"name": "x"}]}))
    with pytest.raises(ConfigurationTypeError, match=r"takes a list of trace files, got the "
                                                     r"single path .*; pass \["):  # fmt: skip
        merge_traces(as_path(str(trace)), tmp_path / "out.json")
    merged = merge_traces([trace, trace], tmp_path / "out.json")
    assert len(json.loads(merged.read_text())["traceEvents"]) == 2
