"""Specification §9.2: a schedule built by hand, run on tasks that make their own data.

A ``producer`` on stream ``"memcpy"`` writes ``x``; a ``consumer`` on the default
stream reads it and writes ``step_result``.  The engine infers the cross-stream
event wait from the slot they share.  ``Schedule``/``Stage`` and the ``StreamPool``
are spelt out here (``Pipeline(tasks, device=...)`` builds both from a task list).
The tasks ignore the batch, so the pipeline is driven with ``step(None)``.

    python examples/spec/hand_built_schedule.py
"""

from __future__ import annotations

import torch

from aiopipe import DataSlot, SchedulablePipeline, Schedule, Stage, StreamPool, Task, TaskContext

import toy


def build_pipeline(generator: torch.Generator, device: torch.device) -> SchedulablePipeline:
    def produce(ctx: TaskContext) -> None:
        ctx.slots.set("x", torch.randn(8, generator=generator).to(device, non_blocking=True))

    def consume(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", ctx.slots["x"].sum())

    producer = Task.from_fn("producer", produce, stream="memcpy", writes=(DataSlot("x", 0),))
    consumer = Task.from_fn("consumer", consume, stream="default", reads=(DataSlot("x", 0),),
                            writes=(DataSlot("step_result", 0),))  # fmt: skip
    schedule = Schedule(stages=(Stage(tasks=(producer, consumer)),),
                        stream_slots=("default", "memcpy"))  # fmt: skip
    if device.type == "cuda":
        copies = torch.cuda.Stream(device, priority=-1)  # type: ignore[no-untyped-call]
        pool = StreamPool({"default": torch.cuda.current_stream(device), "memcpy": copies})
    else:
        pool = StreamPool({"default": None, "memcpy": None})  # CPU: no streams
    return SchedulablePipeline(schedule, pool, executor="async")


def compute_plain(steps: int) -> list[float]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(8, generator=generator).sum().item() for _ in range(steps)]


def compute_pipelined(steps: int) -> list[float]:
    pipe = build_pipeline(torch.Generator().manual_seed(0), toy.device()).blocking()
    with pipe:
        return [pipe.step(None).item() for _ in range(steps)]


def main() -> None:
    toy.report("hand-built schedule", compute_pipelined(5) == compute_plain(5))


if __name__ == "__main__":
    main()
