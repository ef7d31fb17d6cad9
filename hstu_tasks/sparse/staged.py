"""torchrec's ``StagedTrainPipeline`` as tasks: its ``PipelineStage`` list, and the
training step its loop runs on each batch the stages give back.

torchrec's loop is ``while batch := pipe.progress(it): step(batch)``: ``progress``
runs every stage on the batches ahead and returns the one that has been through all
of them.  Here stage j of n is a task at lookahead n - j on a stream of its own (the
stage's), reading the previous stage's output, and ``step`` a task at lookahead 0
after them: ``await pipe.progress(it)`` runs the step and returns what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage

from aiopipe import ConfigurationTypeError, SchedulablePipeline, Schedule, StreamPool, Task
from aiopipe import TaskContext

__all__ = ("stage_tasks", "staged_pipeline")


def stage_tasks(stages: Sequence[PipelineStage]) -> tuple[list[Task], dict[str, Any]]:
    """One task per stage (named after it, on a stream named after it; the last
    stage's output in the slot ``staged_batch``) and the streams, by name (``None``:
    a CPU stage, which has no stream to run on).  Stages with torchrec's fill or
    data-exhausted callbacks (its ``SparseDataDistUtil``'s) are refused: those
    drive torchrec's input distribution, which ``SparseDistPipeline`` runs instead."""
    if not stages:
        raise ValueError("stage_tasks needs at least one PipelineStage")
    strays = [stage for stage in stages if not isinstance(stage, PipelineStage)]
    if strays:
        raise ConfigurationTypeError(
            f"stages must be torchrec's PipelineStage (torchrec.distributed.train_pipeline."
            f"pipeline_stage), got {type(strays[0]).__name__}"
        )
    names = [stage.name for stage in stages]
    if len(set(names)) != len(names) or "staged_batch" in names:
        raise ValueError(f"stage names must be distinct and not 'staged_batch': {names}")
    hooked = [stage.name for stage in stages if stage.fill_callback is not None
              or stage.data_exhausted_callback is not None]  # fmt: skip
    if hooked:
        raise ValueError(
            f"stages {hooked} have torchrec's fill or data-exhausted callbacks (its "
            f"SparseDataDistUtil's stages): they run torchrec's input distribution, which "
            f"SparseDistPipeline runs as tasks of its own; pass the other stages here"
        )
    tasks, streams = [], {}
    previous = "batch_cpu"  # the slot the engine puts each item of the source in
    for index, stage in enumerate(stages):
        output = "staged_batch" if index == len(stages) - 1 else stage.name
        tasks.append(Task.from_fn(stage.name, _runner(stage.runnable, previous, output),
                                  lookahead=len(stages) - index, stream=stage.name,
                                  reads=(previous,), writes=(output,)))  # fmt: skip
        device = getattr(stage.stream, "device", None)
        streams[stage.name] = stage.stream if device is not None and device.type != "cpu" else None
        previous = output
    return tasks, streams


def _runner(runnable: Callable[[Any], Any], source: str, output: str
            ) -> Callable[[TaskContext], None]:  # fmt: skip
    def run(ctx: TaskContext) -> None:
        ctx.slots.set(output, runnable(ctx.slots[source]))

    return run


def staged_pipeline(stages: Sequence[PipelineStage], step: Callable[[Any], Any],
                    **options: Any) -> SchedulablePipeline:  # fmt: skip
    """The pipeline torchrec's ``StagedTrainPipeline(stages)`` and the loop around it
    make: each ``progress`` returns ``step(batch)`` for the next batch that has been
    through every stage (the step runs on the default stream).  ``options`` go to
    :class:`~aiopipe.SchedulablePipeline` (``executor``, ``trace``, ``name``, ...)."""
    if not callable(step):
        raise ConfigurationTypeError(f"step must be callable (step(batch)), got {step!r}")
    tasks, streams = stage_tasks(stages)

    def train(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", step(ctx.slots["staged_batch"]))

    tasks.append(Task.from_fn("step", train, reads=("staged_batch",), writes=("step_result",)))
    default = torch.cuda.current_stream() if any(s is not None for s in streams.values()) else None
    pool = StreamPool({"default": default, **streams})
    return SchedulablePipeline(Schedule.of(tasks, stream_slots=tuple(pool.names())), pool,
                               **options)  # fmt: skip
