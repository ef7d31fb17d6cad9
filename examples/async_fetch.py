"""An ``async def`` fetch one batch ahead of a synchronous training step, overlapped.

Each batch comes from an async "feature store" that takes ``--latency-ms`` to answer
(an ``await``, as a real client would).  The plain loop fetches, then trains; the
pipeline fetches batch i+1 while batch i trains -- provided the fetch has a stream of
its own.  On the training step's stream the two run one after the other and the
pipeline warns (``SerializedAwaitWarning``); this script shows both, side by side.

    python examples/async_fetch.py --steps 60 --latency-ms 4
"""

from __future__ import annotations

import argparse
import asyncio
import time
import warnings

import torch

from aiopipe import Pipeline, SerializedAwaitWarning, Task, TaskContext


async def fetch_batch(index: int, latency_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The feature store's answer for batch ``index`` (deterministic)."""
    await asyncio.sleep(latency_s)
    generator = torch.Generator().manual_seed(index)
    x = torch.randn(256, 128, generator=generator)
    return x, x[:, :8].sum(dim=1, keepdim=True)


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 1),
    )  # fmt: skip
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = batch
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


async def plain_loop(steps: int, latency_s: float) -> list[float]:
    model, opt = make_model()
    return [train_step(model, opt, await fetch_batch(i, latency_s)) for i in range(steps)]


async def pipelined(steps: int, latency_s: float, fetch_stream: str) -> list[float]:
    model, opt = make_model()

    async def fetch(ctx: TaskContext) -> None:
        ctx.slots.set("batch", await fetch_batch(ctx.slots["batch_cpu"], latency_s))

    def train(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", train_step(model, opt, ctx.slots["batch"]))

    pipe = Pipeline([
        Task.from_fn("fetch", fetch, lookahead=1, stream=fetch_stream, writes=("batch",)),
        Task.from_fn("train", train, reads=("batch",), writes=("step_result",)),
    ])  # fmt: skip
    async with pipe:
        return [loss async for loss in pipe.results(range(steps))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--latency-ms", type=float, default=4.0)
    args = parser.parse_args()
    latency_s = args.latency_ms / 1000
    runs = {
        "plain loop (fetch, then step)": lambda: plain_loop(args.steps, latency_s),
        "aiopipe, fetch on the step's stream": lambda: pipelined(args.steps, latency_s, "default"),
        "aiopipe, fetch on stream 'io'": lambda: pipelined(args.steps, latency_s, "io"),
    }
    await plain_loop(5, latency_s)  # untimed: a process's first torch steps are slow
    losses = {}
    for name, run in runs.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SerializedAwaitWarning)
            start = time.perf_counter()
            losses[name] = await run()
            elapsed = time.perf_counter() - start
        serialized = any(issubclass(w.category, SerializedAwaitWarning) for w in caught)
        warned = " (warned: SerializedAwaitWarning)" if serialized else ""
        print(f"{name:<38} {1000 * elapsed / args.steps:6.2f} ms/step{warned}")
    print(f"same losses in all three: {len({tuple(v) for v in losses.values()}) == 1}")


if __name__ == "__main__":
    asyncio.run(main())
