"""Load generator for examples/serve_hstu.py: concurrent ranking requests on loopback.

    python examples/serve_load.py --spawn --requests 2000 --concurrency 64
    python examples/serve_load.py --url http://127.0.0.1:8080 --requests 2000

``--spawn`` starts the server in a child process on a free port (``--max-batch`` and
``--max-wait-ms`` are passed on) and stops it afterwards.  Each of ``--concurrency``
clients sends its share of ``--requests`` back to back; the report gives throughput,
p50/p99 latency and the server's batch-size histogram, as a table and a JSON line.
A request that fails -- an HTTP error status, or the connection refused, dropped or
timed out (a server that went away mid-run) -- is counted as an error of its client,
by kind, and the run goes on; a server that does not answer the first ``GET /stats``
ends the run at once, with one line saying so (exit status 1).  Only loopback addresses
are accepted: this is a local benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ipaddress
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

SERVER = Path(__file__).resolve().with_name("serve_hstu.py")


@dataclass
class LoadReport:
    requests: int
    concurrency: int
    errors: int
    client_errors: list[int]  # per client
    error_kinds: dict[str, int]  # "http 503", "ServerDisconnectedError", ...
    seconds: float
    throughput_rps: float
    p50_ms: float | None  # None (JSON null) when no request was answered
    p99_ms: float | None
    server: dict[str, Any]  # empty when the server no longer answered /stats


def make_requests(count: int, seed: int = 0, max_history: int = 48) -> list[dict[str, list[int]]]:
    """Random users shaped like hstu_tasks' synthetic data (2000 items, 8 actions)."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(count):
        history = rng.randint(4, max_history)
        bodies.append({
            "items": [rng.randrange(2000) for _ in range(history)],
            "actions": [rng.randrange(8) for _ in range(history)],
            "candidates": [rng.randrange(2000) for _ in range(rng.randint(1, 4))],
        })  # fmt: skip
    return bodies


class ServerUnreachable(ConnectionError):
    """The server did not answer ``GET /stats`` before the run: nothing to measure."""


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * len(sorted_values)) - 1))
    return sorted_values[index]


def batches_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The server's statistics for the batches served between two /stats readings."""
    old = before["batch_size_histogram"]
    histogram = {size: n - old.get(size, 0) for size, n in after["batch_size_histogram"].items()}
    histogram = {size: n for size, n in histogram.items() if n}
    batches = sum(histogram.values())
    served = sum(int(size) * n for size, n in histogram.items())
    forward = after["forward_seconds"] - before["forward_seconds"]
    return {**after, "requests": served, "batches": batches,
            "mean_batch_size": served / batches if batches else 0.0,
            "batch_size_histogram": histogram, "forward_seconds": forward,
            "forward_ms_per_batch": 1e3 * forward / batches if batches else 0.0}  # fmt: skip


def require_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"{url}: only loopback servers (127.0.0.0/8, ::1, localhost)")


async def run_load(url: str, bodies: list[dict[str, Any]], concurrency: int,
                   timeout_s: float = 60.0) -> LoadReport:  # fmt: skip
    """Send every body to ``url``/rank from ``concurrency`` clients; bounded by
    ``timeout_s`` per request.  A failed request counts as an error of its client
    (see :class:`LoadReport`); only a server that does not answer ``GET /stats`` at
    the start raises, :class:`ServerUnreachable`."""
    require_loopback(url)
    latencies: list[float] = []
    client_errors = [0] * concurrency
    error_kinds: collections.Counter[str] = collections.Counter()
    next_index = iter(range(len(bodies)))
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:

        async def client(number: int) -> None:
            for index in next_index:  # shared: each body is sent once
                start = time.perf_counter()
                try:
                    async with session.post("/rank", json=bodies[index]) as response:
                        await response.read()
                        failure = None if response.status == 200 else f"http {response.status}"
                except (aiohttp.ClientError, TimeoutError) as exc:  # the server went away
                    failure = type(exc).__name__
                if failure is not None:
                    client_errors[number] += 1
                    error_kinds[failure] += 1
                    continue
                latencies.append(time.perf_counter() - start)

        try:
            async with session.get("/stats") as response:
                response.raise_for_status()
                before = await response.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            detail = str(exc) or type(exc).__name__
            raise ServerUnreachable(f"the server at {url} is not reachable: {detail}") from None
        start = time.perf_counter()
        await asyncio.gather(*(client(number) for number in range(concurrency)))
        seconds = time.perf_counter() - start
        try:
            async with session.get("/stats") as response:
                server = batches_since(before, await response.json())
        except (aiohttp.ClientError, TimeoutError):
            server = {}
    latencies.sort()
    p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
    return LoadReport(
        requests=len(bodies), concurrency=concurrency, errors=sum(client_errors),
        client_errors=client_errors, error_kinds=dict(error_kinds.most_common()), seconds=seconds,
        throughput_rps=len(latencies) / seconds if seconds else 0.0,
        p50_ms=None if p50 is None else p50 * 1e3, p99_ms=None if p99 is None else p99 * 1e3,
        server=server,
    )  # fmt: skip


def spawn_server(max_batch: int, max_wait_ms: float) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", "0", "--max-batch", str(max_batch),
         "--max-wait-ms", str(max_wait_ms)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    for line in process.stdout:  # the server prints its address once it listens
        if line.startswith("serving on "):
            return process, line.split()[-1]
    process.wait(10)
    raise SystemExit(f"the server exited with {process.returncode} before listening")


def print_report(report: LoadReport) -> None:
    server = report.server
    errors = "".join(f", {count} {kind}" for kind, count in report.error_kinds.items())
    rows = [("requests", f"{report.requests} ({report.errors} errors{errors})")]
    if report.errors:
        rows.append(("errors/client", " ".join(map(str, report.client_errors))))
    rows += [
        ("concurrency", str(report.concurrency)),
        ("throughput", f"{report.throughput_rps:.0f} requests/s"),
        ("latency p50", "-" if report.p50_ms is None else f"{report.p50_ms:.1f} ms"),
        ("latency p99", "-" if report.p99_ms is None else f"{report.p99_ms:.1f} ms"),
    ]
    if not server:
        rows.append(("server", "no statistics: the server stopped answering"))
    else:
        rows += [
            ("server batches", f"{server['batches']} (mean size {server['mean_batch_size']:.1f}, "
                               f"max {server.get('max_batch')}, wait {server.get('max_wait_ms')} ms)"),
            ("model time", f"{server['forward_ms_per_batch']:.1f} ms per batch, "
                           f"busy {server['forward_seconds'] / report.seconds:.0%} of the run"),
            ("batch sizes", " ".join(f"{size}:{count}" for size, count
                                     in server["batch_size_histogram"].items())),
        ]  # fmt: skip
    for name, value in rows:
        print(f"{name:>15}  {value}")
    print(json.dumps(asdict(report)))


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``low``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"  # argparse's "invalid int value" for what is not a number
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080",
                        help="the server (without --spawn)")  # fmt: skip
    parser.add_argument("--spawn", action="store_true", help="start a server on a free port")
    parser.add_argument("--requests", type=at_least(1), default=2000, help="requests timed")
    parser.add_argument("--concurrency", type=at_least(1), default=64,
                        help="client loops sending at once")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="of the random request bodies")
    parser.add_argument("--max-batch", type=int, default=8, help="with --spawn")
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="with --spawn")
    parser.add_argument("--warmup", type=at_least(0), default=100,
                        help="requests sent first, not counted")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    process = None
    url = args.url
    if args.spawn:
        process, url = spawn_server(args.max_batch, args.max_wait_ms)
    try:
        require_loopback(url)
        if args.warmup:
            asyncio.run(run_load(url, make_requests(args.warmup, args.seed + 1), args.concurrency))
        bodies = make_requests(args.requests, args.seed)
        print_report(asyncio.run(run_load(url, bodies, args.concurrency)))
    except ServerUnreachable as exc:
        raise SystemExit(f"serve_load: {exc}") from None
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(30)


if __name__ == "__main__":
    main()
