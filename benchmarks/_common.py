"""Shared helpers for the benchmark scripts: timing pipelines, interleaved rounds,
progress on stderr, and tables printed row by row with the spread over rounds."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from aiopipe import SchedulablePipeline


async def time_progress(pipe: SchedulablePipeline, iterations: int, warmup: int = 20,
                        steps_per_call: int = 1) -> float:  # fmt: skip
    """Seconds per step in steady state: ``progress()`` per step, or
    ``progress_many(source, steps_per_call)``."""
    source = iter(range(iterations + warmup + pipe.plan.max_lookahead + 1))
    for _ in range(warmup):
        await pipe.progress(source)
    start = time.perf_counter()
    if steps_per_call == 1:
        for _ in range(iterations):
            await pipe.progress(source)
    else:
        done = 0
        while done < iterations:
            done += len(await pipe.progress_many(source, min(steps_per_call, iterations - done)))
    return (time.perf_counter() - start) / iterations


#: The name :func:`thread_sched_s` gives the threads Python did not start: torch's OpenMP
#: workers, gloo's threads.
OTHER = "other threads (OpenMP, gloo)"


def thread_cpu_s() -> dict[str, tuple[str, float]]:
    """``{tid: (name, cpu seconds)}`` for every thread of this process (Linux's
    ``/proc/self/task``: the scheduler's nanoseconds on a CPU where it counts them,
    else user + system ticks; ``{}`` elsewhere)."""
    return {tid: (name, cpu) for tid, (name, cpu, _) in thread_sched_s().items()}


def thread_sched_s() -> dict[str, tuple[str, float, float]]:
    """``{tid: (name, cpu seconds, run-queue seconds)}``: as :func:`thread_cpu_s`, with
    the time each thread was ready to run but waited for a core (NaN where the kernel
    keeps no scheduler statistics)."""
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    threads = {}
    for tid in tids:
        try:
            threads[tid] = (names.get(tid, OTHER), *_sched_s(f"/proc/self/task/{tid}"))
        except OSError:  # the thread ended meanwhile
            continue
    return threads


def _sched_s(task: str) -> tuple[float, float]:
    try:
        with open(f"{task}/schedstat") as schedstat:
            on_cpu, waiting, _ = schedstat.read().split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except FileNotFoundError:  # a kernel without scheduler statistics
        with open(f"{task}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), math.nan


def run_on(loop_factory: Callable[[], asyncio.AbstractEventLoop], coro: Any) -> Any:
    loop = loop_factory()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


# When the benchmark started; spawned ranks inherit it, so their lines count alike.
_STARTED = float(os.environ.setdefault("AIOPIPE_BENCH_STARTED", str(time.time())))
Key = TypeVar("Key")


def progress(message: str) -> None:
    """One line on stderr, after the seconds since the benchmark started: long runs
    show they are moving while stdout keeps only the tables and the JSON line."""
    print(f"[{time.time() - _STARTED:5.0f} s] {message}", file=sys.stderr, flush=True)


def spread(values: Sequence[float]) -> str:
    """Half the range of ``values`` relative to their median, ``+-N%``: printed next
    to the median, it shows how far one round strays (one noisy round reads as noise)."""
    median = statistics.median(values)
    if len(values) < 2 or not median:
        return "--"
    return f"+-{50 * (max(values) - min(values)) / abs(median):.0f}%"


def with_spread(values: Sequence[float], digits: int = 3) -> str:
    """``median +-N%`` of ``values``, for one table cell."""
    return f"{statistics.median(values):.{digits}f} {spread(values)}"


def interleaved_rounds(
    configs: Mapping[Key, Callable[[], float]],
    repeats: int,
    *,
    warmup: bool = False,
    show: Callable[[float], str] = lambda value: f"{value:.3g}",
) -> dict[Key, list[float]]:
    """Measure every config once per round, ``repeats`` rounds, so that drift in the
    machine's speed hits all alike; ``warmup`` runs one round first and drops it.
    Each round ends with a progress line giving what every config measured in it."""
    samples: dict[Key, list[float]] = {key: [] for key in configs}
    first = 0 if warmup else 1
    for round_no in range(first, repeats + 1):
        measured = {key: measure() for key, measure in configs.items()}
        if round_no:
            for key, value in measured.items():
                samples[key].append(value)
        label = f"round {round_no}/{repeats}" + (" (warm-up, dropped)" if not round_no else "")
        progress(f"{label}: " + ", ".join(f"{_name(k)} {show(v)}" for k, v in measured.items()))
    return samples


def _name(key: Any) -> str:
    return "/".join(key) if isinstance(key, tuple) else str(key)


class Table:
    """A table printed row by row as results come in: a long benchmark shows each row
    as soon as it is measured.  Column widths are fixed up front (the headers', or
    ``widths`` where wider); a longer cell only shifts the rest of its row."""

    def __init__(self, title: str, headers: Sequence[str], widths: Sequence[int] = ()) -> None:
        self.widths = [max([len(str(h)), *widths[i:i + 1]]) for i, h in enumerate(headers)]
        print(f"\n{title}")
        self._print(headers)
        self._print(["-" * w for w in self.widths])

    def row(self, *cells: Any) -> None:
        self._print(cells)

    def _print(self, cells: Sequence[Any]) -> None:
        print("  ".join(str(c).ljust(w) for c, w in zip(cells, self.widths)).rstrip(), flush=True)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A table whose rows are all known: the columns fit the widest cell."""
    widths = [max(len(str(r[i])) for r in rows) if rows else 0 for i in range(len(headers))]
    table = Table(title, headers, widths)
    for row in rows:
        table.row(*row)


def print_json(name: str, payload: dict[str, Any]) -> None:
    print("JSON " + json.dumps({"benchmark": name, **payload}, sort_keys=True))


def add_hstu_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every multi-rank HSTU benchmark takes."""
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-history", type=int, default=48)


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now (for a
    process group's rank 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_ranks(worker: Callable[..., None], args: dict[str, Any]) -> Any:
    """Run ``worker(rank, port, ranks, args, out_path)`` on ``args["ranks"]`` spawned
    processes; return the JSON rank 0 wrote to ``out_path``."""
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.spawn(worker, args=(port, args["ranks"], args, out.name), nprocs=args["ranks"])
        return json.loads(Path(out.name).read_text())


def report_and_leave(rank: int, out: str, payload: Any) -> None:
    """End a ``spawn_ranks`` worker: rank 0 writes ``payload`` to ``out``, then every
    rank leaves the group with ``hstu_tasks.leave_and_exit`` (no native exit-time
    teardown, which aborted once in a benchmark rank)."""
    from hstu_tasks import leave_and_exit

    if rank == 0:
        Path(out).write_text(json.dumps(payload))
    leave_and_exit(0)


def _settled_spans(spans: Sequence[Any], skip: int) -> list[Any]:
    """The spans that ran to their end, the first ``skip`` iterations left out."""
    first = min(span.iteration for span in spans) + skip
    return [span for span in spans if span.iteration >= first and not span.failed]


def engine_host_ms(spans: Sequence[Any], skip: int = 5) -> tuple[float, float]:
    """``(engine ms, step ms)`` per step, from a tracer's spans of one run (the first
    ``skip`` iterations left out).

    The busiest lane thread (the most body time) runs the step's chain.  Between two
    of its bodies it was either waiting for another lane or a collective ticket (the
    later span's ``wait_ns``) or doing the engine's own work: handing the result over,
    starting the next iteration, waking up.  The engine's host time is the rest of
    those gaps; a step is the time from one iteration's last body on that thread to
    the next one's."""
    by_thread: dict[str, list[Any]] = collections.defaultdict(list)
    for span in _settled_spans(spans, skip):
        by_thread[span.thread].append(span)
    busiest = max(by_thread.values(), key=lambda s: sum(x.duration_ns for x in s), default=[])
    chain = sorted(busiest, key=lambda span: span.start_ns)
    ends: dict[int, int] = {}
    for span in chain:
        ends[span.iteration] = max(ends.get(span.iteration, 0), span.end_ns)
    if len(ends) < 2:
        raise ValueError(f"the spans cover less than two iterations after the first {skip}")
    steps = max(ends) - min(ends)
    start, end = ends[min(ends)], ends[max(ends)]
    gaps = sum(max(0, later.start_ns - later.wait_ns - earlier.end_ns)
               for earlier, later in zip(chain, chain[1:])
               if earlier.end_ns >= start and later.end_ns <= end)  # fmt: skip
    return gaps / steps / 1e6, (end - start) / steps / 1e6


def task_body_ms(spans: Sequence[Any], skip: int = 5) -> dict[str, float]:
    """Each task's body time per step in ms (host time on the thread that ran it, an
    ``async def`` body's suspended time left out), from a tracer's spans of one run
    (the first ``skip`` iterations left out)."""
    totals: dict[str, int] = collections.defaultdict(int)
    iterations = set()
    for span in _settled_spans(spans, skip):
        totals[span.task] += span.duration_ns - span.await_ns
        iterations.add(span.iteration)
    return {task: total / len(iterations) / 1e6 for task, total in totals.items()}


def step_boundaries_us(spans: Sequence[Any]) -> list[float]:
    """Each boundary between two iterations on the busiest lane thread (the most body
    time), in us: from one iteration's last body to the next iteration's first, less
    the time that body was ready but waiting for another lane or a ticket."""
    by_thread: dict[str, list[Any]] = collections.defaultdict(list)
    for span in spans:
        by_thread[span.thread].append(span)
    busiest = max(by_thread.values(), key=lambda s: sum(x.duration_ns for x in s), default=[])
    chain = sorted(busiest, key=lambda span: span.start_ns)
    return [max(0, later.start_ns - later.wait_ns - earlier.end_ns) / 1e3
            for earlier, later in zip(chain, chain[1:])
            if later.iteration == earlier.iteration + 1]  # fmt: skip
