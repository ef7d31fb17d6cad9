"""Misuse is refused when the object is built, with the house's errors: step hooks of
``basic()`` that could never train, numbers of the wrong type, misspelt names and
retired flags."""

from __future__ import annotations

import asyncio
import gc
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


# -- slips a newcomer makes, each said with its fix ----------------------------------


def _echo(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ctx.slots["batch_cpu"])


def test_an_executor_class_instead_of_an_instance_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigurationTypeError, match=r"pass SequentialExecutor\(\)"):
        Pipeline([Task.from_fn("t", _echo)], executor=aiopipe.SequentialExecutor)


def test_a_loss_module_class_instead_of_an_instance_is_refused_with_the_fix() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigurationTypeError, match=r"loss_fn=torch\.nn\..*MSELoss\(\)"):
        aiopipe.basic(model, optimizer, loss_fn=torch.nn.MSELoss)


def test_run_given_the_coroutine_function_says_to_call_it() -> None:
    async def main() -> None:
        return None

    with pytest.raises(ConfigurationTypeError, match=r"aiopipe\.run\(main\(\)\)"):
        aiopipe.run(main)  # type: ignore[arg-type]


def test_writing_a_slot_by_item_says_to_call_set() -> None:
    def train(ctx: TaskContext) -> None:
        ctx.slots["step_result"] = 1  # type: ignore[index]

    pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",))],
                    executor="sequential").blocking()  # fmt: skip
    with pytest.raises(TypeError, match=r"ctx\.slots\.set\('step_result', value\)"):
        pipe.progress(iter([1]))
    pipe.pipeline.reset()
    pipe.shutdown()


def test_step_while_an_iterator_s_batches_are_in_flight_names_step_and_drain() -> None:
    pipe = Pipeline([Task.from_fn("t", _echo, writes=("step_result",))]).blocking()
    try:
        assert pipe.progress(iter([1, 2, 3])) == 1  # batch 2 read ahead
        with pytest.raises(aiopipe.PipelineStateError, match=r"step\(\) cannot run .* drain\(\)"):
            pipe.step(9)
        assert pipe.drain() == [2]
        assert pipe.step(9) == 9  # refused, not owed: it ran now, once
        assert pipe.statistics().discarded == 0
    finally:
        pipe.shutdown()


@pytest.mark.parametrize("batch", [torch.zeros(8, 4), {"x": torch.zeros(2)}],
                         ids=["tensor", "dict"])  # fmt: skip
def test_one_batch_passed_as_a_source_points_to_step(batch: Any) -> None:
    pipe = Pipeline([Task.from_fn("t", _echo, writes=("step_result",))]).blocking()
    try:
        with pytest.raises(ConfigurationTypeError, match=r"for a single batch call step\(batch\)"):
            pipe.progress(batch)
    finally:
        pipe.shutdown()


async def test_an_async_generator_read_by_another_pipeline_is_refused_not_blamed() -> None:
    gate = asyncio.Event()

    async def numbers() -> Any:
        for number in range(4):
            if number == 1:
                await gate.wait()  # pipeline A's read-ahead waits here
            yield number

    source = numbers()
    async with Pipeline([Task.from_fn("t", _echo, writes=("step_result",))]) as a, \
            Pipeline([Task.from_fn("t", _echo, writes=("step_result",))]) as b:  # fmt: skip
        assert await a.progress(source) == 0
        with pytest.raises(aiopipe.PipelineStateError, match="one source feeds one pipeline"):
            await b.progress(source)
        gate.set()
        assert [n async for n in a.results(source)] == [1, 2, 3]  # A lost nothing


def test_swapped_arguments_are_said_swapped() -> None:
    with pytest.raises(ConfigurationTypeError, match=r"name first.*from_fn\('t', _echo"):
        Task.from_fn(_echo, "t")  # type: ignore[arg-type]

    async def fetch(key: int) -> int:
        return key

    with pytest.raises(ConfigurationTypeError, match="keys first, then the fetch function"):
        aiopipe.fetch_ahead(fetch, range(3), in_flight=2)  # type: ignore[arg-type]


def test_a_fetch_called_instead_of_passed_is_refused_without_a_never_awaited_warning(
    recwarn: pytest.WarningsRecorder,
) -> None:
    async def fetch(key: int) -> int:
        return key

    with pytest.raises(ConfigurationTypeError, match=r"pass fetch, not fetch\(key\)"):
        aiopipe.fetch_ahead(range(3), fetch(0), in_flight=2)  # type: ignore[arg-type]
    gc.collect()
    assert not [w for w in recwarn if "never awaited" in str(w.message)]
