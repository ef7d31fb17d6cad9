"""The blocking form's own round trip: what one call costs beyond the step it runs.

Every blocking call (``pipe.blocking().progress(...)``) runs a coroutine to its end on
the pipeline's private loop and installs its Ctrl-C handler for the call.  The rows,
each a coroutine that returns at once, run on one thread in alternating rounds:

* ``run_until_complete``: asyncio's own floor, ``loop.run_until_complete(coro)``;
* ``LoopRunner.run``: the blocking form's runner as shipped, the handler set and
  restored through the C module ``_signal``;
* ``LoopRunner.run, signal's wrappers``: the same with ``signal.signal`` /
  ``signal.getsignal``, which convert every handler to an enum member where they can
  (a ValueError, with the handler's repr, for one that is none).

Each row is timed alone (wall time a call) and between two steps of the ``presets``
MLP (one torch thread; the thread's CPU a step, less the plain step's of the same
round, paired): the same Python costs more once torch's step has been through the
caches (docs/performance.md).

    ./dev bench blocking_round_trip [--calls 20000] [--steps 300] [--rounds 9]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _common import interleaved_rounds, print_json, print_table, with_spread  # noqa: E402
from presets import loss_fn, setup  # noqa: E402

from aiopipe._core import loops  # noqa: E402

ROWS = ("run_until_complete", "LoopRunner.run", "LoopRunner.run, signal's wrappers")


async def _nothing() -> None:
    return None


@contextlib.contextmanager
def _signal_module(module: object) -> Iterator[None]:
    """The runner's Ctrl-C handler set through ``module`` while the block runs."""
    shipped = loops._raw_signal
    loops._raw_signal = module  # type: ignore[assignment]
    try:
        yield
    finally:
        loops._raw_signal = shipped


def _calls() -> dict[str, Callable[[], None]]:
    runner = loops.LoopRunner(prefer_uvloop=False)  # the blocking form's loop
    loop = runner.loop

    def wrapped() -> None:
        with _signal_module(signal):
            runner.run(_nothing)

    return dict(zip(ROWS, (
        lambda: loop.run_until_complete(_nothing()), lambda: runner.run(_nothing), wrapped,
    )))  # fmt: skip


def _alone(call: Callable[[], None], calls: int) -> Callable[[], float]:
    def measure() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            call()
        return 1e6 * (time.perf_counter() - start) / calls

    return measure


def _between_steps(call: Callable[[], None] | None, steps: int) -> Callable[[], float]:
    model, optimizer = setup(torch.device("cpu"), 256)
    data = itertools.cycle([(torch.randn(128, 256), torch.randn(128, 1)) for _ in range(10)])

    def measure() -> float:
        start = time.thread_time_ns()
        for _ in range(steps):
            x, y = next(data)
            optimizer.zero_grad()
            loss_fn(model(x), (x, y)).backward()
            optimizer.step()
            if call is not None:
                call()
        return (time.thread_time_ns() - start) / steps / 1e3

    return measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls a row a round, alone")
    parser.add_argument("--steps", type=int, default=300, help="steps a row a round, between")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if min(args.calls, args.steps, args.rounds) < 1:
        parser.error("--calls, --steps and --rounds must be >= 1")
    torch.set_num_threads(1)
    calls = _calls()
    alone = interleaved_rounds({name: _alone(c, args.calls) for name, c in calls.items()},
                               args.rounds, warmup=True)  # fmt: skip
    between = interleaved_rounds(
        {"plain step": _between_steps(None, args.steps),
         **{name: _between_steps(c, args.steps) for name, c in calls.items()}},
        args.rounds, warmup=True,
    )  # fmt: skip
    plain = between["plain step"]
    extra = {name: [a - b for a, b in zip(between[name], plain)] for name in ROWS}
    shipped = statistics.median(alone["LoopRunner.run"])
    rows = [[name, with_spread(alone[name], 2), f"{statistics.median(alone[name]) / shipped:.2f}",
             with_spread(extra[name], 1)] for name in ROWS]  # fmt: skip
    print_table(
        f"One blocking call's round trip, median of {args.rounds} alternating rounds "
        f"(plain step {statistics.median(plain):.0f} us of CPU)",
        ["row", "us a call, alone", "x LoopRunner.run", "us a call between two steps (paired)"],
        rows,
    )  # fmt: skip
    print_json("blocking_round_trip", {
        "args": vars(args),
        "alone_us": {name: statistics.median(v) for name, v in alone.items()},
        "between_steps_extra_us": {name: statistics.median(v) for name, v in extra.items()},
    })  # fmt: skip


if __name__ == "__main__":
    main()
