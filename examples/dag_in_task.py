"""A pipeline task that fans out a dynamic task graph per batch.

Each batch carries a different number of "tables" (per-table work whose shape
changes batch to batch).  The ``per_table`` task, an ``async def`` body, submits one
graph task per table (normalise it into its own output row), then one task that
reduces the rows it just wrote -- ordering comes from the tensors' tags, not from
the code.  One graph lives as long as the pipeline; a scope per batch keeps it from
growing.

    python examples/dag_in_task.py [--batches 8]
"""

from __future__ import annotations

import argparse

import torch

import aiopipe
from aiopipe import Pipeline, Task, TaskContext
from aiopipe.dag import INPUT, OUTPUT, TaskGraph

graph = TaskGraph(max_in_flight=256)


def normalise(table: torch.Tensor, row: torch.Tensor) -> None:
    row.copy_((table - table.mean()) / (table.std() + 1e-6))


def reduce_rows(*rows_and_out: torch.Tensor) -> None:
    *rows, out = rows_and_out
    out.copy_(torch.stack(rows).sum(dim=0))


async def per_table(ctx: TaskContext) -> None:
    tables: list[torch.Tensor] = ctx.slots["batch_cpu"]
    rows = torch.empty(len(tables), tables[0].shape[0])
    total = torch.empty(tables[0].shape[0])
    async with graph.scope():  # waits for this batch's tasks, then forgets them
        for i, table in enumerate(tables):
            await graph.submit(normalise, table, OUTPUT(rows[i]), lane=f"worker{i % 2}")
        done = await graph.submit(reduce_rows, *(INPUT(rows[i]) for i in range(len(tables))),
                                  OUTPUT(total))  # fmt: skip
        await done
    ctx.slots.set("step_result", (len(tables), float(total.abs().sum())))


def batches(count: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [[torch.randn(16, generator=generator) for _ in range(2 + b % 4)] for b in range(count)]


async def main(count: int = 8) -> list[tuple[int, float]]:
    tasks = [Task.from_fn("per_table", per_table, writes=("step_result",))]
    async with graph, Pipeline(tasks, executor="async") as pipe:
        return [result async for result in pipe.results(iter(batches(count)))]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="A pipeline task that fans out a dynamic task graph per batch: one "
        "graph task per table, then one that reduces their rows."
    )
    parser.add_argument("--batches", type=_positive, default=8, metavar="N",
                        help="batches to run (default 8)")  # fmt: skip
    args = parser.parse_args()
    for tables, magnitude in aiopipe.run(main(args.batches)):
        print(f"{tables} tables -> |sum of normalised rows| = {magnitude:.3f}")
