"""What a pipeline checks when it is built (its task list, a missing step_result),
the schedule it reports, and ``None`` as an ordinary batch."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from conftest import collect

from aiopipe import (
    BadBatchError,
    NoStepResultWarning,
    Pipeline,
    SchedulablePipeline,
    Schedule,
    ScheduleValidationError,
    Stage,
    Task,
    TaskContext,
)
from aiopipe.edges import topological_sort


def noop(ctx: TaskContext) -> None:
    return None


def result_of_batch(ctx: TaskContext) -> None:
    ctx.slots.set("step_result", ("got", ctx.slots["batch_cpu"]))


# -- the task list ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (["not a task"], r"tasks\[0\] is 'not a task' \(str\), not a Task"),
        ([Task.from_fn("a", noop), 42], r"tasks\[1\] is 42 \(int\), not a Task"),
        ([Task], r"tasks\[0\] is the class Task, not a task: pass an instance, Task\(\)"),
        (Task.from_fn("a", noop), r"got the single task <Task 'a'.*wrap it, \[task\]"),
    ],
)
def test_a_non_task_entry_is_a_type_error_naming_it_and_its_position(
    entries: Any, message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        Pipeline(entries)


def test_stages_check_their_entries_too() -> None:
    with pytest.raises(TypeError, match=r"Stage.tasks\[1\] is None \(NoneType\)"):
        Stage(tasks=(Task.from_fn("a", noop), None))  # type: ignore[arg-type]


def test_a_subclass_that_skips_super_init_is_named() -> None:
    class Forgetful(Task):
        name = "forgetful"

        def __init__(self) -> None:  # never calls super().__init__
            pass

    with pytest.raises(TypeError, match=r"tasks\[0\] \(Forgetful\) .*super\(\).__init__"):
        Pipeline([Forgetful()])


@pytest.mark.parametrize("build", [lambda: Pipeline([]), lambda: SchedulablePipeline(Schedule.of([]))])
def test_an_empty_task_list_is_refused_at_construction(build: Any) -> None:
    with pytest.raises(ScheduleValidationError, match=r"\[rule 1\] the schedule has no tasks"):
        build()


# -- a schedule without step_result ------------------------------------------------------


def test_no_task_writing_step_result_warns_naming_the_tasks_and_the_fix() -> None:
    tasks = [Task.from_fn("load", noop, lookahead=1), Task.from_fn("train", noop)]
    with pytest.warns(NoStepResultWarning) as caught:
        Pipeline(tasks).shutdown()
    (warning,) = caught
    text = str(warning.message)
    assert "progress() will return None for every batch" in text
    assert "(tasks: load, train)" in text
    assert "writes=('step_result',)" in text and "expect_result=False" in text
    assert warning.filename == __file__  # it points at the line that built the pipeline


def test_expect_result_false_builds_a_side_effect_pipeline_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Pipeline([Task.from_fn("log", noop)], expect_result=False).shutdown()
        Pipeline([Task.from_fn("t", noop, writes=("step_result",))]).shutdown()


# -- the schedule property ---------------------------------------------------------------


def test_the_schedule_property_is_in_execution_order() -> None:
    tasks = [
        Task.from_fn("reader", noop, reads=("x",)),
        Task.from_fn("writer", noop, writes=("x",)),
        Task.from_fn("side", noop, priority=5),
    ]
    declared = Schedule.of(tasks)
    pipe = SchedulablePipeline(declared, expect_result=False)
    order = [t.name for t in pipe.plan.order]
    assert order == ["side", "writer", "reader"]
    assert [t.name for t in pipe.schedule.tasks] == order
    assert [t.name for t in topological_sort(pipe.schedule)] == order  # a fixed point
    assert pipe.plan.schedule is declared  # the declaration itself stays available
    assert pipe.schedule.stream_slots == declared.stream_slots
    pipe.shutdown()


def test_stages_keep_their_order_in_the_schedule_property() -> None:
    first = Stage(tasks=(Task.from_fn("b", noop, reads=("x",)), Task.from_fn("a", noop, writes=("x",))))
    second = Stage(tasks=(Task.from_fn("c", noop, writes=("step_result",)),))
    pipe = SchedulablePipeline(Schedule(stages=(first, second)))
    assert [[t.name for t in s.tasks] for s in pipe.schedule.stages] == [["a", "b"], ["c"]]
    pipe.shutdown()


# -- None is a batch -----------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["sequential", "async"])
async def test_step_none_runs_like_any_batch(executor: str) -> None:
    made: list[int] = []

    def make_own_data(ctx: TaskContext) -> None:
        assert ctx.slots["batch_cpu"] is None  # the slot is set, to None
        made.append(ctx.batch_index)
        ctx.slots.set("step_result", len(made))

    async with Pipeline([Task.from_fn("gen", make_own_data, writes=("step_result",))],
                        executor=executor) as pipe:  # fmt: skip
        assert await pipe.step(None) == 1
        assert await pipe.step(None) == 2
    assert made == [0, 0]  # each step() is a one-batch source


@pytest.mark.parametrize("executor", ["sequential", "async"])
async def test_a_source_yielding_none_is_read_to_the_end(executor: str) -> None:
    tasks = [
        Task.from_fn("peek", noop, lookahead=2, reads=("batch_cpu",)),
        Task.from_fn("result", result_of_batch, reads=("batch_cpu",), writes=("step_result",)),
    ]
    async with Pipeline(tasks, executor=executor) as pipe:
        results = await collect(pipe, iter([None, 1, None, None, 2, None]))
        stats = pipe.statistics()
    assert results == [("got", b) for b in (None, 1, None, None, 2, None)]
    assert (stats.pulled, stats.returned, stats.refused) == (6, 6, 0)


async def test_an_async_source_yielding_none_is_read_to_the_end() -> None:
    async def source() -> Any:
        for item in (None, None, 3):
            yield item

    tasks = [Task.from_fn("result", result_of_batch, writes=("step_result",), lookahead=0)]
    async with Pipeline(tasks) as pipe:
        assert await collect(pipe, source()) == [("got", None), ("got", None), ("got", 3)]


async def test_check_batch_may_still_refuse_none() -> None:
    def no_none(batch: Any) -> None:
        if batch is None:
            raise TypeError("this pipeline needs real batches")

    tasks = [Task.from_fn("result", result_of_batch, writes=("step_result",))]
    async with Pipeline(tasks, check_batch=no_none) as pipe:
        with pytest.raises(BadBatchError, match="needs real batches"):
            await pipe.step(None)
        assert await pipe.step(5) == ("got", 5)
