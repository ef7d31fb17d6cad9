"""Bad input gets a clear error and loses nothing: empty sources, sources that raise,
batches ``check_batch`` refuses, and a source switched while batches are in flight."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch
from conftest import Recorder, collect

import aiopipe
from aiopipe import BadBatchError, Pipeline, PipelineStateError, Task

THREAD_MAP = {"load": "io", "prep": "io", "train": "compute"}


def tasks(recorder: Recorder) -> list[Task]:
    return [
        recorder.task("load", lookahead=2, stream="io", reads=("batch_cpu",), writes=("raw",)),
        recorder.task("prep", lookahead=1, stream="io", reads=("raw",), writes=("x",)),
        recorder.task("train", reads=("x",), writes=("step_result",)),
    ]


def results_of(numbers: list[int]) -> list[str]:
    return [f"result-{n}" for n in numbers]


def refuse_none(batch: Any) -> None:
    if batch is None:  # None is a batch to the engine: these tasks need a number
        raise TypeError("this pipeline needs numbered batches, got None")


@pytest.fixture(params=["sequential", "async"])
def pipe(request: pytest.FixtureRequest, recorder: Recorder) -> Iterator[Pipeline]:
    if request.param == "async":
        pipeline = Pipeline(tasks(recorder), thread_map=THREAD_MAP, check_batch=refuse_none)
    else:
        pipeline = Pipeline(tasks(recorder), executor="sequential", check_batch=refuse_none)
    yield pipeline
    pipeline.shutdown()


async def test_an_empty_source_ends_at_once_and_the_pipeline_stays_usable(pipe: Pipeline) -> None:
    empty: Iterator[int] = iter(())
    with pytest.raises(StopAsyncIteration):
        await pipe.progress(empty)
    with pytest.raises(StopAsyncIteration):
        await pipe.progress(empty)

    async def nothing() -> AsyncIterator[int]:
        return
        yield

    assert await collect(pipe, nothing()) == []
    assert await collect(pipe, iter(range(3))) == results_of([0, 1, 2])


async def test_a_source_that_raises_mid_epoch_loses_no_batch(pipe: Pipeline) -> None:
    def flaky() -> Iterator[int]:
        yield from range(4)
        raise OSError("the data server went away")

    source = flaky()
    got = [await pipe.progress(source), await pipe.progress(source)]
    # the third progress pulls past batch 3 and meets the error
    with pytest.raises(OSError, match="went away") as caught:
        await pipe.progress(source)
    assert caught.value.aiopipe_source_batch == 4  # type: ignore[attr-defined]
    assert caught.value.__notes__ == [
        "aiopipe: raised by the source, reading its batch 4 (counted from 0); the batches "
        "before it are not lost: drain() finishes any still in flight"
    ]
    assert pipe.statistics().broken is None  # no task had started: nothing to undo
    assert pipe.statistics().in_flight == 2
    # the generator is finished now: the batches in flight complete, then the end
    got += await collect(pipe, source)
    assert got == results_of([0, 1, 2, 3])


async def test_a_transient_source_error_can_be_retried(pipe: Pipeline) -> None:
    class Flaky:
        """Fails once at item 2, then goes on (a retrying client, say)."""

        def __init__(self) -> None:
            self.next_item, self.failed = 0, False

        def __iter__(self) -> Flaky:
            return self

        def __next__(self) -> int:
            if self.next_item == 2 and not self.failed:
                self.failed = True
                raise ConnectionError("timeout")
            if self.next_item == 5:
                raise StopIteration
            self.next_item += 1
            return self.next_item - 1

    source = Flaky()
    got: list[Any] = []
    while True:
        try:
            got.append(await pipe.progress(source))
        except ConnectionError:
            continue
        except StopAsyncIteration:
            break
    assert got == results_of([0, 1, 2, 3, 4])


async def test_a_refused_batch_is_skipped(pipe: Pipeline, recorder: Recorder) -> None:
    source = iter([0, 1, 2, None, 3])
    got = [await pipe.progress(source)]  # pulls batches 0..2 (lookahead 2)
    with pytest.raises(BadBatchError, match="got None.*2 batch\\(es\\) in flight are intact"):
        await pipe.progress(source)
    got += await collect(pipe, source)
    assert got == results_of([0, 1, 2, 3])
    assert recorder.batches_of("train") == [0, 1, 2, 3]  # ring positions: None took none


async def test_check_batch_refuses_malformed_batches(recorder: Recorder) -> None:
    def must_be_small_int(batch: Any) -> None:
        if not isinstance(batch, int):
            raise TypeError(f"expected an int, got {type(batch).__name__}")
        if batch > 100:
            raise ValueError(f"{batch} is out of range")

    pipe = Pipeline(tasks(recorder), thread_map=THREAD_MAP, check_batch=must_be_small_int)
    async with pipe:
        source = iter([0, 1, "two", 2, 999, 3])
        got = []
        errors: list[BaseException] = []
        while True:
            try:
                got.append(await pipe.progress(source))
            except BadBatchError as exc:
                errors.append(exc)
            except StopAsyncIteration:
                break
    assert got == results_of([0, 1, 2, 3])
    assert [type(e.__cause__) for e in errors] == [TypeError, ValueError]
    assert "expected an int, got str" in str(errors[0])
    assert isinstance(errors[0], ValueError)  # callers catching ValueError still do


async def test_a_check_batch_written_as_a_predicate_refuses_what_it_says_false_to(
    recorder: Recorder,
) -> None:
    """``check_batch=lambda b: b < 99``: the batch it returns False for is refused (it
    was trained, the predicate's answer ignored); True and None accept."""
    def small(batch: int) -> bool | None:
        return None if batch == 0 else batch < 99

    pipe = Pipeline(tasks(recorder), thread_map=THREAD_MAP, check_batch=small)
    async with pipe:
        source, got, refused = iter([0, 1, 99, 2, 3]), [], []
        while True:
            try:
                got.append(await pipe.progress(source))
            except BadBatchError as exc:
                refused.append(str(exc))
            except StopAsyncIteration:
                break
    assert got == results_of([0, 1, 2, 3])
    assert len(refused) == 1 and "check_batch returned False" in refused[0]


async def test_switching_the_source_mid_flight_takes_nothing_from_it(pipe: Pipeline) -> None:
    first = iter(range(5))
    assert await pipe.progress(first) == "result-0"
    second = iter(range(100, 105))
    with pytest.raises(PipelineStateError, match="in flight; none of its batches was taken"):
        await pipe.progress(second)
    assert next(second) == 100  # untouched
    assert await collect(pipe, first) == results_of([1, 2, 3, 4])


async def test_a_cancelled_pull_never_lands_inside_an_async_generator(pipe: Pipeline) -> None:
    release = asyncio.Event()

    async def slow_source() -> AsyncIterator[int]:
        yield 0
        await release.wait()  # a cancellation thrown in here would end the generator
        for n in range(1, 4):
            yield n

    source = slow_source()
    with pytest.raises(TimeoutError):  # the source never answers: the timeout must fire
        await asyncio.wait_for(pipe.progress(source), 0.05)
    release.set()
    # the pull runs in a task of its own, which the timeout left running: nothing lost
    assert await collect(pipe, source) == results_of([0, 1, 2, 3])


async def test_a_cancel_safe_source_survives_a_cancelled_pull(pipe: Pipeline) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()

    class FromQueue:
        def __aiter__(self) -> FromQueue:
            return self

        async def __anext__(self) -> int:
            item = await queue.get()
            if item < 0:
                raise StopAsyncIteration
            return item

    source = FromQueue()
    queue.put_nowait(0)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(pipe.progress(source), 0.05)
    for item in (1, 2, 3, -1):
        queue.put_nowait(item)
    assert await collect(pipe, source) == results_of([0, 1, 2, 3])


async def test_refused_batches_are_counted_for_the_source_position(pipe: Pipeline) -> None:
    source = iter([0, None, 1, None, 2])
    got: list[Any] = []
    while True:
        try:
            got.append(await pipe.progress(source))
        except BadBatchError:
            continue
        except StopAsyncIteration:
            break
    stats = pipe.statistics()
    assert got == results_of([0, 1, 2])
    assert stats.refused == 2 and stats.returned + stats.refused == 5


@pytest.mark.parametrize("build", ["basic", "Pipeline", "SchedulablePipeline"])
def test_a_misspelt_option_is_refused_with_the_name_it_meant(build: str) -> None:
    # read_ahead misspelt would otherwise be ignored without a word
    model = torch.nn.Linear(2, 1)
    builders = {
        "basic": lambda: aiopipe.basic(model, torch.optim.SGD(model.parameters()), readahead=2),
        "Pipeline": lambda: aiopipe.Pipeline([aiopipe.Task.from_fn("t", print)], readahead=2),
        "SchedulablePipeline": lambda: aiopipe.SchedulablePipeline(
            aiopipe.Schedule.of([aiopipe.Task.from_fn("t", print)]), readahead=2
        ),
    }
    with pytest.raises(aiopipe.ConfigurationTypeError,
                       match=rf"{build}\(\) got an unexpected keyword 'readahead' "
                             r"\(did you mean 'read_ahead'\?\)"):  # fmt: skip
        builders[build]()


@pytest.mark.parametrize(("build", "wrong", "meant"), [
    ("basic", "grad_accumulations", "grad_accumulation"), ("basic", "loss_func", "loss_fn"),
    ("Pipeline", "threadmap", "thread_map"), ("Pipeline", "executer", "executor"),
])  # fmt: skip
def test_a_misspelt_keyword_of_the_function_itself_is_named_too(
    build: str, wrong: str, meant: str
) -> None:
    # The hint and the list named only the pipeline options, never the function's
    # own keywords: a one-letter slip in loss_fn got no "did you mean".
    model = torch.nn.Linear(2, 1)
    builders = {
        "basic": lambda: aiopipe.basic(model, torch.optim.SGD(model.parameters()), **{wrong: 1}),
        "Pipeline": lambda: aiopipe.Pipeline([aiopipe.Task.from_fn("t", print)], **{wrong: 1}),
    }
    with pytest.raises(aiopipe.ConfigurationTypeError) as refused:
        builders[build]()
    assert f"unexpected keyword {wrong!r} (did you mean {meant!r}?)" in str(refused.value)
    first = "model" if build == "basic" else "tasks"
    assert f"its own keywords are {first}, " in str(refused.value)


@pytest.mark.parametrize("flag", ["prefetch", "memcpy_stream"])
def test_basic_s_flags_take_true_or_false_only(flag: str) -> None:
    # prefetch=2 read as True: one batch ahead, not two, without a word
    model = torch.nn.Linear(2, 1)
    with pytest.raises(aiopipe.ConfigurationTypeError, match=f"{flag} takes True or False, got 2"):
        aiopipe.basic(model, torch.optim.SGD(model.parameters()), **{flag: 2})


@pytest.mark.parametrize("reset_first", [False, True])
async def test_a_source_error_read_ahead_says_its_batch_when_raised_after_a_switch(
    reset_first: bool,
) -> None:
    """The read-ahead holds the source's error while another source runs; raised when
    the first comes back, it still says which batch the source was giving."""

    def flaky() -> Iterator[torch.Tensor]:
        yield from (torch.ones(2, 4) for _ in range(3))
        raise OSError("the data server went away")

    model = torch.nn.Linear(4, 1)
    pipe = aiopipe.basic(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         loss_fn=lambda out, batch: out.sum())  # fmt: skip
    source = flaky()
    for _ in range(3):
        await pipe.progress(source)
    if reset_first:
        pipe.reset()
    await pipe.progress(iter([torch.ones(2, 4)]))  # another source
    with pytest.raises(OSError, match="went away") as caught:
        await pipe.progress(source)
    assert caught.value.aiopipe_source_batch == 3  # type: ignore[attr-defined]
    note = caught.value.__notes__[0]
    assert note.startswith("aiopipe: raised by the source, reading its batch 3 (counted from 0)")
    pipe.shutdown()
