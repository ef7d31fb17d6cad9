"""Specification §9.3: plugging in an executor of your own.

An executor decides where and when the active tasks of each iteration run.  It
implements ``bind(plan)`` (once), ``async run_iteration(iteration)`` (every iteration) and
``shutdown()``.  ``VerboseExecutor`` logs the tasks of each iteration, then hands the
iteration to the executor it wraps -- here the sequential one, the reference semantics.

    python examples/spec/custom_executor.py
"""

from __future__ import annotations

import torch

from aiopipe import Executor, SequentialExecutor, basic
from aiopipe.executors import Iteration
from aiopipe.plan import ExecutionPlan

import toy
from toy import train_plain  # the specification's loop, unpipelined


class VerboseExecutor:
    def __init__(self, inner: Executor) -> None:
        self._inner = inner
        self.log: list[str] = []

    def bind(self, plan: ExecutionPlan) -> None:
        self._inner.bind(plan)

    async def run_iteration(self, iteration: Iteration) -> None:
        names = [iteration.plan.order[index].name for index in iteration.active.all]
        self.log.append(f"[iteration {iteration.number}] {' -> '.join(names)}")
        await self._inner.run_iteration(iteration)

    def shutdown(self) -> None:
        self._inner.shutdown()


def train_pipelined(batches: list[torch.Tensor]) -> tuple[list[float], torch.nn.Module, list[str]]:
    model, opt = toy.model_and_optimizer()
    executor = VerboseExecutor(SequentialExecutor())
    pipe = basic(model, opt, loss_fn=lambda out: out.sum(), prefetch=True,
                                     executor=executor)  # fmt: skip
    with pipe.blocking() as blocking:
        losses = [loss.item() for loss in blocking.results(iter(batches))]
    return losses, model, executor.log


def main() -> None:
    batches = toy.cpu_batches(count=4)
    losses, model, log = train_pipelined(batches)
    print("\n".join(log))
    toy.report("VerboseExecutor", toy.same_training(losses, model, *train_plain(batches)))


if __name__ == "__main__":
    main()
