"""The basic() preset against the plain training loop it replaces.

CPU (default): a model of a few milliseconds per step; the pipeline's overhead is
the difference from the plain loop.  With ``--device cuda``: batches whose H2D copy
is a visible share of the step, where T2 (copy one batch ahead on its own stream)
should beat the plain loop.

    ./dev bench presets [--device cpu|cuda] [--steps 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _common import interleaved_rounds, print_json, print_table, spread  # noqa: E402

import aiopipe  # noqa: E402
from aiopipe import SchedulablePipeline  # noqa: E402


def setup(device: torch.device, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
        torch.nn.ReLU(), torch.nn.Linear(width, 1),
    ).to(device)  # fmt: skip
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def loss_fn(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, batch[1])


def forward(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(batch[0])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Steps before the clock starts, in every config: first-step costs (allocator, a
# lane thread's first OpenMP team, the pipeline filling up) are not per-step speed.
WARM_STEPS = 10


def plain(data: list, device: torch.device, width: int) -> float:
    model, opt = setup(device, width)
    start = 0.0
    for step, batch in enumerate(data):
        if step == WARM_STEPS:
            sync(device)
            start = time.perf_counter()
        x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
        opt.zero_grad()
        loss = loss_fn(model(x), (x, y))
        loss.backward()
        opt.step()
    sync(device)
    return time.perf_counter() - start


def piped(data: list, device: torch.device, width: int, **options: object) -> float:
    model, opt = setup(device, width)
    pipe = SchedulablePipeline.basic(model, opt, loss_fn=loss_fn, forward=forward, **options)

    async def run() -> float:
        start = 0.0
        async with pipe:
            returned = 0
            async for _ in pipe.results(iter(data)):
                returned += 1
                if returned == WARM_STEPS:
                    sync(device)
                    start = time.perf_counter()
            sync(device)
            return time.perf_counter() - start

    return aiopipe.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    device = torch.device(args.device)
    pin = device.type == "cuda"
    data = [(torch.randn(args.batch, args.width), torch.randn(args.batch, 1)) for _ in range(args.steps)]
    if pin:
        data = [(x.pin_memory(), y.pin_memory()) for x, y in data]
    configs = {
        "plain loop": lambda: plain(data, device, args.width),
        "T1 (default: compute on lane 'compute')": lambda: piped(data, device, args.width),
        "T2 (default: h2d ahead; lane 'io' on a GPU, 'compute' on a CPU)": lambda: piped(
            data, device, args.width, prefetch=True, memcpy_stream=True
        ),
        "T1, executor='sequential' (opt-in: on the loop)": lambda: piped(
            data, device, args.width, executor="sequential"
        ),
    }
    if args.steps <= WARM_STEPS:
        parser.error(f"--steps must be more than the {WARM_STEPS} untimed steps")
    timed = args.steps - WARM_STEPS
    samples = interleaved_rounds(configs, args.repeats, warmup=True,
                                 show=lambda s: f"{s / timed * 1e3:.2f} ms/step")  # fmt: skip
    plain_s = samples["plain loop"]
    base = statistics.median(plain_s)
    rows, payload = [], {}
    for name, seconds in samples.items():
        median = statistics.median(seconds)
        # Each round's ratio to the plain loop's run next to it: drift between rounds,
        # which moves whole runs by more than the differences here, cancels out.
        paired = statistics.median(s / p for s, p in zip(seconds, plain_s, strict=True))
        rows.append([name, f"{median / timed * 1e3:.3f}", spread(seconds),
                     f"{timed / median:.1f}", f"{median / base:.3f}", f"{paired:.3f}"])  # fmt: skip
        payload[name] = {"ms_per_step": median / timed * 1e3, "x_plain": median / base,
                         "x_plain_paired": paired, "samples_s": seconds}  # fmt: skip
    print_table(
        f"basic() preset vs plain loop, {device}, {args.steps} steps (the first {WARM_STEPS} "
        f"untimed), median of {args.repeats} rounds (spread: half their range)",
        ["config", "ms / step", "spread", "steps / s", "time x plain", "paired x plain"],
        rows,
    )
    print_json("presets", {"device": str(device), "results": payload})


if __name__ == "__main__":
    main()
