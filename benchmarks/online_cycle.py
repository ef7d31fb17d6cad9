"""One read-bound online cycle taken apart: the wait, the build and the hand-off.

Where a source's wait is longer than the step (``online_matrix``'s 3 ms / 2.4 ms cell),
a step's cycle is the read: wait for the batch, build it, start the next wait.  The
source stamps each wait and each build; this prints, per row, the time a step, how
long the wait took, the build, and the gap from a build's end to the next wait's
start -- for the hand-written prefetch thread (``time.sleep`` in the thread) and for
``basic()`` fed by an async generator (``asyncio.sleep``), reading one and two ahead.
Each row runs in processes of its own, timed in chunks that alternate between the
rows (``_chunks.time_in_chunks``).

``--wait socket`` waits as a real client does instead: each row asks a server (a
process of its own, one thread a connection, ``time.sleep`` then one byte back) over
a TCP connection and wakes when the answer arrives -- the thread in a blocking
``recv``, the async generator in ``StreamReader.readexactly`` -- not on a timer.

    ./dev bench online_cycle [--latency-ms 3] [--compute-ms 2.4 | --width W] [--rounds 3]
                             [--wait timer|socket]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import multiprocessing
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
    time_in_chunks,
)
from _common import print_json, print_table, with_spread  # noqa: E402

ROWS = ("prefetch thread", "aiopipe async", "aiopipe async, 2 ahead")
COLUMNS = ("wait_ms", "build_ms", "gap_ms")
WARM_UP = 20  # untimed steps before a worker's first chunk


def serve(port: Any, latency_s: float) -> None:
    """The ``--wait socket`` server: for each byte a client sends, wait ``latency_s``
    and send one back (a thread per connection)."""
    server = socket.create_server(("127.0.0.1", 0))
    port.put(server.getsockname()[1])

    def answer(conn: socket.socket) -> None:
        with conn, contextlib.suppress(ConnectionError):  # a worker's exit ends it
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while conn.recv(1):
                time.sleep(latency_s)
                conn.sendall(b"x")

    while True:
        threading.Thread(target=answer, args=(server.accept()[0],), daemon=True).start()


def start_server(latency_s: float) -> int:
    """A ``serve`` process (ended with this one); its port."""
    context = multiprocessing.get_context("spawn")
    port = context.Queue()
    context.Process(target=serve, args=(port, latency_s), daemon=True).start()
    return int(port.get(timeout=60))


def build_row(
    row: str, rank: int, *, width: int, latency_s: float, port: int | None = None
) -> tuple[Any, Any]:
    """The chunk worker's ``run(n)`` for ``row``, and a report of the medians of every
    wait and build it stamped after the warm-up, and of the gaps between them.  With
    ``port``, each wait is a request to the ``serve`` process there."""
    import online_matrix as matrix

    net, opt = matrix.model(width)
    waits: list[tuple[float, float]] = []
    builds: list[tuple[float, float]] = []

    def build(generator: torch.Generator) -> Any:
        start = time.perf_counter()
        batch = matrix._batch(generator)
        builds.append((start, time.perf_counter()))
        return batch

    if row == "prefetch thread":
        ready: queue.Queue[Any] = queue.Queue(2)

        def fetch_forever() -> None:
            generator = torch.Generator().manual_seed(1)
            conn = None if port is None else socket.create_connection(("127.0.0.1", port))
            if conn is not None:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                start = time.perf_counter()
                if conn is None:
                    time.sleep(latency_s)
                else:
                    conn.sendall(b"x")
                    assert conn.recv(1) == b"x"
                waits.append((start, time.perf_counter()))
                ready.put(build(generator))

        threading.Thread(target=fetch_forever, daemon=True).start()

        def run(n: int) -> None:
            for _ in range(n):
                batch = ready.get()
                opt.zero_grad()
                matrix.loss_fn(matrix.forward(net, batch), batch).backward()
                opt.step()

    else:
        from aiopipe import basic

        async def source() -> Any:
            generator = torch.Generator().manual_seed(1)
            if port is not None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.transport.get_extra_info("socket").setsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
                )
            for _ in itertools.count():
                start = time.perf_counter()
                if port is None:
                    await asyncio.sleep(latency_s)
                else:
                    writer.write(b"x")
                    assert await reader.readexactly(1) == b"x"
                waits.append((start, time.perf_counter()))
                yield build(generator)

        pipe = basic(net, opt, loss_fn=matrix.loss_fn, forward=matrix.forward,
                     read_ahead=2 if row.endswith("2 ahead") else 1)  # fmt: skip
        run = progress_calls(pipe, source())

    def report() -> dict[str, float]:
        first = first_timed_step()  # the untimed steps' stamps are left out
        timed = list(zip(waits[first:], builds[first:]))
        gaps = [nxt[0][0] - cur[1][1] for cur, nxt in itertools.pairwise(timed)]
        return {
            "wait_ms": 1e3 * statistics.median(end - start for (start, end), _ in timed),
            "build_ms": 1e3 * statistics.median(end - start for _, (start, end) in timed),
            "gap_ms": 1e3 * statistics.median(gaps),
        }

    return run, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cycle_arguments(parser, latency_ms=3.0, compute_ms=2.4)
    parser.add_argument("--wait", choices=("timer", "socket"), default="timer",
                        help="how the source waits: a sleep, or a request to a server")
    args = parser.parse_args()
    check_cycle_arguments(parser, args)
    import online_matrix as matrix

    width = args.width or matrix.calibrate(args.compute_ms)
    latency_s = args.latency_ms / 1e3
    port = start_server(latency_s) if args.wait == "socket" else None
    build = functools.partial(build_row, width=width, latency_s=latency_s, port=port)
    chunks = time_in_chunks(build, ROWS, chunk=args.chunk, rounds=args.rounds,
                            processes=args.processes, warm_up=WARM_UP,
                            settle=matrix.SETTLE)  # fmt: skip
    thread = statistics.median(chunks.ms["prefetch thread"])
    rows = []
    for row in ROWS:
        reports = chunks.reports[row]
        cells = [with_spread(chunks.ms[row], 2),
                 *(with_spread([r[c] for r in reports], 2) for c in COLUMNS)]  # fmt: skip
        rows.append([row, *cells, f"{thread / statistics.median(chunks.ms[row]):.3f}"])
    print_table(
        f"one read-bound cycle: a {args.latency_ms:g} ms wait ({args.wait}), "
        f"a ~{args.compute_ms:g} ms step "
        f"(width {width}), {args.processes} process sets of {args.rounds} chunks of "
        f"{args.chunk} steps",
        ["row", "ms / step", "the wait took (ms)", "build (ms)", "build's end to next wait (ms)",
         "speed x prefetch thread (medians)"],
        rows,
    )  # fmt: skip
    print_json("online_cycle", {"width": width, "latency_ms": args.latency_ms, "wait": args.wait,
                                "ms_per_step": chunks.ms, "reports": chunks.reports})  # fmt: skip


if __name__ == "__main__":
    main()
