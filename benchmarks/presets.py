"""The basic() preset against the plain training loop it replaces.

CPU (default): a model of a few milliseconds per step; the pipeline's overhead is
the difference from the plain loop.  With ``--device cuda``: batches whose H2D copy
is a visible share of the step, where T2 (copy one batch ahead on its own stream)
should beat the plain loop; the copy of one batch is timed too, and its share of the
plain loop's step printed (the case T2 is for: a share of 30 % or more).  Every
config runs in a worker process of its own, in
short alternating chunks, ``--processes`` fresh sets of them
(``benchmarks/_chunks.py`` says why); each chunk's ratio to the plain loop's chunk
of the same round is the paired figure.

    ./dev bench presets [--device cpu|cuda] [--chunk 40] [--rounds 15] [--processes 5]
                        [--configs plain T1 T2 sequential T1-many blocking blocking-many
                                  blocking-sequential]
                        [--width 512] [--batch 256]

``T1-many`` and ``blocking-many`` ask for a whole chunk in one ``progress_many`` call
(the lanes chain its steps); a width of 256 and a batch of 128 make a step of about
0.7 ms, where the boundary between two steps shows most.  A second table gives each
kind of thread's CPU time per step (Linux): the main thread (the event loop, or the
plain loop itself), the lanes, and the rest (torch's OpenMP workers) -- where a
config's extra time goes on a host whose cores the step's own threads fill -- and
how long the lanes waited for a core (run-queue time: another thread had it).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _chunks import nothing_to_report, paired, print_thread_cpu, time_in_chunks  # noqa: E402
from _common import print_json, print_table, spread  # noqa: E402

from aiopipe import basic  # noqa: E402
from aiopipe._core.loops import LoopRunner

CONFIGS = {
    "plain": "plain loop",
    "T1": "T1 (default: compute on lane 'compute')",
    "T2": "T2 (default: h2d ahead; lane 'io' on a GPU, 'compute' on a CPU)",
    "sequential": "T1, executor='sequential' (opt-in: on the loop)",
    "T1-many": "T1, progress_many(source, chunk): the lanes chain the steps",
    "blocking": "T1, blocking form, progress() per step",
    "blocking-many": "T1, blocking form, progress_many(source, chunk)",
    "blocking-sequential": "T1, executor='sequential', blocking form, progress() per step",
}
# Steps before the first timed chunk: first-step costs (allocator, a lane thread's
# first OpenMP team, the pipeline filling up) are not per-step speed.
WARM_UP = 20


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


def _batches(device: torch.device, width: int, batch: int) -> Iterator[Any]:
    """Endless batches, up to 50 distinct ones (pinned for a CUDA device) over and
    over, at most about 1 GiB of them."""
    distinct = max(4, min(50, 2**30 // (batch * (width + 1) * 4)))
    data = [(torch.randn(batch, width), torch.randn(batch, 1)) for _ in range(distinct)]
    if device.type == "cuda":
        data = [(x.pin_memory(), y.pin_memory()) for x, y in data]
    return itertools.cycle(data)


def copy_ms(width: int, batch: int, repeats: int = 20) -> float:
    """Median device time of one batch's host-to-device copy from pinned memory."""
    x, y = torch.randn(batch, width).pin_memory(), torch.randn(batch, 1).pin_memory()
    times = []
    for _ in range(repeats + 2):  # the first two warm up
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.to("cuda", non_blocking=True)
        y.to("cuda", non_blocking=True)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times[2:])


def _build(config: str, rank: int, *, device: str, width: int,
           batch: int) -> tuple[Callable[[int], None], Callable[[], dict[str, Any]]]:  # fmt: skip
    """The chunk worker's ``run(n)``: the next ``n`` steps of ``config``, synchronised
    with the device at the end."""
    torch_device = torch.device(device)
    source = _batches(torch_device, width, batch)
    model, opt = setup(torch_device, width)
    if config == "plain":

        def plain(n: int) -> None:
            for batch_ in itertools.islice(source, n):
                x = batch_[0].to(torch_device, non_blocking=True)
                y = batch_[1].to(torch_device, non_blocking=True)
                opt.zero_grad()
                loss = loss_fn(model(x), (x, y))
                loss.backward()
                opt.step()
            sync(torch_device)

        return plain, nothing_to_report
    choices: dict[str, dict[str, Any]] = {
        "T2": {"prefetch": True, "memcpy_stream": True}, "sequential": {"executor": "sequential"},
        "blocking-sequential": {"executor": "sequential"},
    }  # fmt: skip
    options = choices.get(config, {})
    pipe = basic(model, opt, loss_fn=loss_fn, forward=forward, **options)
    if config.startswith("blocking"):
        blocking = pipe.blocking()

        def blocking_chunk(n: int) -> None:
            if config == "blocking-many":
                assert len(blocking.progress_many(source, n)) == n
            else:
                for _ in range(n):
                    blocking.progress(source)
            sync(torch_device)

        return blocking_chunk, nothing_to_report
    runner = LoopRunner()  # one loop for every chunk, as one aiopipe.run would be

    async def chunk(n: int) -> None:
        if config == "T1-many":
            assert len(await pipe.progress_many(source, n)) == n
        else:
            for _ in range(n):
                await pipe.progress(source)
        sync(torch_device)

    return (lambda n: runner.run(chunk, n)), nothing_to_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunk", type=int, default=40, help="steps per timed chunk")
    parser.add_argument("--rounds", type=int, default=15, help="chunks per config and process")
    parser.add_argument("--processes", type=int, default=5,
                        help="fresh processes per config, one set after another")  # fmt: skip
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    if min(args.chunk, args.rounds, args.processes) < 1:
        parser.error("--chunk, --rounds and --processes must be at least 1")
    configs = ["plain", *(c for c in args.configs if c != "plain")]  # the reference first
    build = functools.partial(_build, device=args.device, width=args.width, batch=args.batch)
    chunks = time_in_chunks(build, configs, chunk=args.chunk, rounds=args.rounds,
                            processes=args.processes, warm_up=WARM_UP)  # fmt: skip
    base = chunks.ms["plain"]
    rows, payload = [], {}
    for config, values in chunks.ms.items():
        median = statistics.median(values)
        ratio = paired(values, base)  # to the plain loop's chunk of the same round
        best = min(values) / min(base)
        cores = statistics.median(chunks.cores[config])
        rows.append([CONFIGS[config], f"{median:.3f}", spread(values), f"{1e3 / median:.1f}",
                     f"{ratio:.3f}", f"{best:.3f}", f"{cores:.2f}"])  # fmt: skip
        payload[config] = {"ms_per_step": values, "x_plain_paired": ratio,
                           "x_plain_fastest": best, "cores": chunks.cores[config]}  # fmt: skip
    print_table(
        f"basic() preset vs plain loop, {args.device}, {args.processes} process sets, "
        f"{args.rounds} alternating chunks of {args.chunk} steps per set",
        ["config", "ms / step", "spread", "steps / s", "time x plain (paired median)",
         "fastest chunk x plain's fastest", "cores busy (cpu/wall)"],
        rows,
    )  # fmt: skip
    for config, per_set in chunks.thread_cpu_us.items():
        payload[config]["cpu_us_per_step"] = per_set
    print_thread_cpu(chunks, CONFIGS.__getitem__)
    extra = {}
    if torch.device(args.device).type == "cuda":  # after the chunks, not among them
        copy = copy_ms(args.width, args.batch)
        share = copy / statistics.median(base)
        print(f"one batch's host-to-device copy: {copy:.3f} ms, {share:.0%} of the plain "
              "loop's step")  # fmt: skip
        extra = {"copy_ms": copy, "copy_share": share}
    print_json("presets", {"device": args.device, "args": vars(args), "results": payload,
                           **extra})  # fmt: skip


if __name__ == "__main__":
    main()
