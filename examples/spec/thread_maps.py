"""Specification §8.4: the four forms of ``thread_map``.

A thread map says which lane (GPU-submit thread) runs each task; it configures the
asynchronous executor, which ``basic()`` uses by default, so there is no
``threaded=True`` flag to set.  The four forms:

* ``"by_stream"`` -- one lane per stream;
* ``"per_task"`` -- one lane per task;
* a dict ``{task name: lane}`` -- a task it leaves out (``zero_grad`` here) runs on
  lane ``"default"``;
* a callable ``task -> lane``.

Lanes change where tasks run, never what they compute: every form trains exactly as
the plain loop does.

    python examples/spec/thread_maps.py
"""

from __future__ import annotations

import torch

from aiopipe import AsyncExecutor, Task, ThreadMap, basic

import toy
from toy import train_plain  # the specification's loop, unpipelined

TASKS = ("h2d", "zero_grad", "forward", "backward", "optimizer_step")


def copies_apart(task: Task) -> str:
    return "io" if task.stream == "memcpy" else "compute"


THREAD_MAPS: dict[str, ThreadMap] = {
    "by_stream": "by_stream",
    "per_task": "per_task",
    "dict": {"h2d": "io", "forward": "compute", "backward": "compute", "optimizer_step": "compute"},
    "callable": copies_apart,
}  # fmt: skip


def train_pipelined(
    batches: list[torch.Tensor], thread_map: ThreadMap
) -> tuple[list[float], torch.nn.Module, dict[str, str]]:
    """The losses, the trained model and the lane of every task."""
    model, opt = toy.model_and_optimizer()
    pipe = basic(model, opt, loss_fn=lambda out: out.sum(), prefetch=True,
                                     memcpy_stream=True, thread_map=thread_map)  # fmt: skip
    executor = pipe.executor
    assert isinstance(executor, AsyncExecutor)  # what a thread map configures
    lanes = {name: executor.lane_of(name) for name in TASKS}
    with pipe.blocking() as blocking:
        losses = [loss.item() for loss in blocking.results(iter(batches))]
    return losses, model, lanes


def main() -> None:
    batches = toy.cpu_batches()
    plain = train_plain(batches)
    for form, thread_map in THREAD_MAPS.items():
        losses, model, lanes = train_pipelined(batches, thread_map)
        print(f"{form:>9}: " + ", ".join(f"{task} on {lane}" for task, lane in lanes.items()))
        toy.report(f"thread_map {form}", toy.same_training(losses, model, *plain))


if __name__ == "__main__":
    main()
