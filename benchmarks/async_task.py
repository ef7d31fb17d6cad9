"""Does an ``async def`` fetch one batch ahead start as the torch step starts?

An ``async def`` fetch task one batch ahead of a synchronous torch step: does the
fetch of batch k+1 start when step k starts?

The fetch is a task of the pipeline (``lookahead=1``, a stream of its own, as
``examples/async_fetch.py`` writes it), not a source: it awaits ``--latency-ms``,
then builds a batch.  The training step is a synchronous task on its own lane.  Rows:

* ``plain loop``: await the fetch, then step (nothing overlaps);
* ``prefetch thread``: a thread sleeps and builds, a queue of two, the step in front
  (the hand-written reference);
* ``aiopipe, fetch on its stream's lane``: the default thread map, lane ``"io"``;
* ``aiopipe, fetch on the loop``: ``thread_map`` puts the fetch on lane ``"loop"``;
* ``aiopipe, its stream's lane, progress_many``: the default lanes, a whole chunk
  asked for in one ``progress_many`` call (the lanes chain its steps).

Each row runs in processes of its own, timed in alternating chunks
(``_chunks.time_in_chunks``).  Besides the time a step, each aiopipe row reports the
median *fetch lag*: from the start of step k to the start of the fetch of batch k+1,
which the same iteration runs.  Overlapped, it is near 0; serialised, it is the step.

``--wait socket`` waits as a client does, on a request to a server (``online_cycle``'s:
a process of its own that answers each byte after ``--latency-ms``), not on a timer.

    ./dev bench async_task [--latency-ms 4] [--compute-ms 2] [--width W] [--rounds 3]
                           [--wait timer|socket]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import queue
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _chunks import (  # noqa: E402
    add_cycle_arguments,
    check_cycle_arguments,
    first_timed_step,
    progress_calls,
    progress_many_calls,
    time_in_chunks,
)
from _common import print_json, print_table, with_spread  # noqa: E402

ROWS = ("plain loop", "prefetch thread", "aiopipe, fetch on its stream's lane",
        "aiopipe, fetch on the loop", "aiopipe, its stream's lane, progress_many")  # fmt: skip
WARM_UP = 20  # untimed steps before a worker's first chunk


def build_row(
    row: str, rank: int, *, width: int, latency_s: float, port: int | None = None
) -> tuple[Any, Any]:
    """The chunk worker's ``run(n)`` for ``row`` and its report (the median fetch lag).
    With ``port``, each wait is a request to ``online_cycle``'s server there."""
    import online_matrix as matrix

    from aiopipe import Pipeline, Task, TaskContext
    from aiopipe._core.loops import LoopRunner

    net, opt = matrix.model(width)
    fetch_starts: dict[int, float] = {}  # batch index: when its fetch started
    fetch_waits: dict[int, float] = {}  # batch index: how long its awaited latency took
    step_starts: dict[int, float] = {}  # batch index: when its step started

    streams: list[Any] = []  # the connection to the server, opened on the first fetch

    async def wait() -> None:
        if port is None:
            await asyncio.sleep(latency_s)
            return
        if not streams:
            streams.extend(await asyncio.open_connection("127.0.0.1", port))
            streams[1].transport.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )
        reader, writer = streams
        writer.write(b"x")
        assert await reader.readexactly(1) == b"x"

    async def fetch(index: int) -> Any:
        fetch_starts[index] = start = time.perf_counter()
        await wait()
        fetch_waits[index] = time.perf_counter() - start
        return matrix._batch(torch.Generator().manual_seed(index))

    def step(index: int, batch: Any) -> None:
        step_starts[index] = time.perf_counter()
        opt.zero_grad()
        matrix.loss_fn(matrix.forward(net, batch), batch).backward()
        opt.step()

    indices = itertools.count()
    if row == "plain loop":
        runner = LoopRunner()

        async def steps_of(n: int) -> None:
            for _ in range(n):
                index = next(indices)
                step(index, await fetch(index))

        def run(n: int) -> None:
            runner.run(steps_of, n)

    elif row == "prefetch thread":
        ready: queue.Queue[Any] = queue.Queue(2)

        def fetch_forever() -> None:
            conn = None if port is None else socket.create_connection(("127.0.0.1", port))
            if conn is not None:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for index in indices:
                if conn is None:
                    time.sleep(latency_s)
                else:
                    conn.sendall(b"x")
                    assert conn.recv(1) == b"x"
                ready.put((index, matrix._batch(torch.Generator().manual_seed(index))))

        threading.Thread(target=fetch_forever, daemon=True).start()

        def run(n: int) -> None:
            for _ in range(n):
                step(*ready.get())

    else:

        async def fetch_task(ctx: TaskContext) -> None:
            index = ctx.slots["batch_cpu"]
            ctx.slots.set("batch", (index, await fetch(index)))

        def train(ctx: TaskContext) -> None:
            step(*ctx.slots["batch"])

        on_loop = row.endswith("on the loop")
        pipe = Pipeline(
            [Task.from_fn("fetch", fetch_task, lookahead=1, stream="io", writes=("batch",)),
             Task.from_fn("train", train, reads=("batch",))],
            thread_map={"fetch": "loop", "train": "default"} if on_loop else None,
            expect_result=False,
        )  # fmt: skip

        if row.endswith("progress_many"):  # a whole chunk a call: the lanes chain its steps
            run = progress_many_calls(pipe, indices)
        else:
            run = progress_calls(pipe, indices)

    def report() -> dict[str, float]:
        first = first_timed_step()  # the untimed steps' stamps are left out
        lags = [fetch_starts[k + 1] - step_starts[k] for k in sorted(step_starts)
                if k >= first and k + 1 in fetch_starts]  # fmt: skip
        waits = [wait for k, wait in fetch_waits.items() if k >= first]
        return {"fetch_lag_ms": 1e3 * statistics.median(lags),
                "fetch_wait_ms": 1e3 * statistics.median(waits)} if lags else {}  # fmt: skip

    return run, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cycle_arguments(parser, latency_ms=4.0, compute_ms=2.0)
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), metavar="ROW",
                        help=f"rows to run (default: all of {list(ROWS)})")
    parser.add_argument("--wait", choices=("timer", "socket"), default="timer",
                        help="how the fetch waits: a sleep, or a request to a server "
                             "(online_cycle's)")  # fmt: skip
    args = parser.parse_args()
    check_cycle_arguments(parser, args)
    import online_cycle
    import online_matrix as matrix

    width = args.width or matrix.calibrate(args.compute_ms)
    step_ms = matrix.step_ms(width)
    latency_s = args.latency_ms / 1e3
    port = online_cycle.start_server(latency_s) if args.wait == "socket" else None
    build = functools.partial(build_row, width=width, latency_s=latency_s, port=port)
    chunks = time_in_chunks(build, args.rows, chunk=args.chunk, rounds=args.rounds,
                            processes=args.processes, warm_up=WARM_UP,
                            settle=matrix.SETTLE)  # fmt: skip
    ideal = max(args.latency_ms, step_ms)
    rows = []
    for row in args.rows:
        reports = [r for r in chunks.reports[row] if r]
        median = statistics.median(chunks.ms[row])
        cells = [with_spread([r[key] for r in reports], 2) if reports else "--"
                 for key in ("fetch_wait_ms", "fetch_lag_ms")]  # fmt: skip
        if not row.startswith("aiopipe"):
            cells[1] = "--"
        rows.append([row, with_spread(chunks.ms[row], 2), f"{ideal / median:.3f}", *cells])
    print_table(
        f"an async def fetch task ({args.latency_ms:g} ms awaited, {args.wait}) beside a "
        f"{step_ms:.2f} ms "
        f"step (width {width}), {args.processes} process sets of {args.rounds} chunks of "
        f"{args.chunk} steps",
        ["row", "ms / step", "x the ideal max(fetch, step)", "the awaited latency took (ms)",
         "fetch lag after its step starts (ms)"],
        rows,
    )
    print_json("async_task", {"args": vars(args), "width": width, "step_ms": step_ms,
                              "ms": chunks.ms, "reports": chunks.reports})  # fmt: skip


if __name__ == "__main__":
    main()
