"""Online training from a feature store slower than the step: ``fetch_ahead`` keeps
several fetches in flight.

Each batch is fetched by key from an async "feature store" that answers in
``--latency-ms`` (an ``await``, as a real client would). An async generator source
(``yield await fetch(key)``) runs one fetch at a time, so the pipeline's read-ahead
hides at most one fetch behind a step, and a fetch longer than the step sets the
pace. ``fetch_ahead(keys, fetch, in_flight=N)`` keeps N fetches in flight and hands
the batches over in key order, so a step can take as little as
``max(latency / N, compute)``. The script runs the three side by side and checks
that they train alike.

    python examples/online_fetch.py --steps 40 --latency-ms 8 --in-flight 4
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import torch

from aiopipe import Pipeline, Task, TaskContext, fetch_ahead
from async_fetch import fetch_batch, make_model, train_step  # the same store and model

Batch = tuple[torch.Tensor, torch.Tensor]


class FeatureStore:
    """``await store.fetch(key)``: async_fetch.py's feature store, counting the
    fetches that run at once."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.running = self.most_running = 0

    async def fetch(self, key: int) -> Batch:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            return await fetch_batch(key, self.latency_s)
        finally:
            self.running -= 1


async def plain_loop(steps: int, store: FeatureStore) -> list[float]:
    model, opt = make_model()
    return [train_step(model, opt, await store.fetch(key)) for key in range(steps)]


async def pipelined(source: AsyncIterator[Batch]) -> list[float]:
    model, opt = make_model()

    def train(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", train_step(model, opt, ctx.slots["batch_cpu"]))

    async with Pipeline([Task.from_fn("train", train, writes=("step_result",))]) as pipe:
        return [loss async for loss in pipe.results(source)]


async def one_at_a_time(steps: int, store: FeatureStore) -> AsyncIterator[Batch]:
    for key in range(steps):
        yield await store.fetch(key)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--latency-ms", type=float, default=8.0)
    parser.add_argument("--in-flight", type=int, default=4)
    args = parser.parse_args()
    if args.steps < 1 or args.in_flight < 1 or not args.latency_ms >= 0:
        parser.error("--steps and --in-flight must be >= 1, --latency-ms >= 0")
    latency_s = args.latency_ms / 1000
    torch.set_num_threads(1)  # the step's lane keeps a core busy; more threads oversubscribe

    async def with_fetch_ahead(store: FeatureStore) -> list[float]:
        async with fetch_ahead(range(args.steps), store.fetch, in_flight=args.in_flight) as source:
            return await pipelined(source)

    runs: dict[str, Callable[[FeatureStore], Coroutine[Any, Any, list[float]]]] = {
        "plain loop (fetch, then step)": lambda store: plain_loop(args.steps, store),
        "aiopipe, async generator source": lambda store: pipelined(one_at_a_time(args.steps, store)),
        f"aiopipe, fetch_ahead(in_flight={args.in_flight})": with_fetch_ahead,
    }
    model, opt = make_model()  # torch's first steps are slow: not timed
    for key in range(3):
        train_step(model, opt, await FeatureStore(0).fetch(key))
    losses = {}
    for name, run in runs.items():
        store = FeatureStore(latency_s)
        start = time.perf_counter()
        losses[name] = await run(store)
        elapsed = time.perf_counter() - start
        print(f"{name:<36} {1000 * elapsed / args.steps:6.2f} ms/step, "
              f"at most {store.most_running} fetch(es) at once")  # fmt: skip
    print(f"same losses in all three: {len({tuple(v) for v in losses.values()}) == 1}")


if __name__ == "__main__":
    asyncio.run(main())
