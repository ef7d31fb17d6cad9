"""Time pipelines in short alternating chunks, each pipeline in worker processes of its
own (``lane_cost``, ``presets``, ``online_source``).

Between two whole runs a shared machine's speed can drift by more than the
differences these benchmarks look for (+-15-35 % on the 2-core machine of
docs/performance.md).  So every pipeline is built and warmed up in a worker process
of its own, and the coordinator asks each in turn for ``chunk`` steps, ``rounds``
times (every other round in reverse order), after one round that is run and not
timed (a set's first chunks ran up to twice as slow on two ranks): drift hits all
alike, and a per-round ratio pairs neighbours in time.  A process also keeps its own
luck for its whole life (where its threads and memory landed), so the whole set of
workers is built afresh ``processes`` times.  Separate processes also keep the
pipelines' torch threads apart: two pipelines in one process each keep an OpenMP
pool, and libgomp slows every pool down once it counts more pool threads than CPUs
(``aiopipe/_core/openmp.py``).

A benchmark names a module-level ``build(config, rank) -> (run, report)`` (spawned
workers import it by name): ``run(n)`` trains the next ``n`` batches, ``report()``
returns a dict sent back once the set ends (``{}`` for nothing); a report that
counts steps counts from :func:`first_timed_step` on.  ``gloo=True`` puts
each config's ``ranks`` workers in a gloo group of their own (torchrec's sharded
models need one on one rank too); a chunk's time is the slowest rank's.
"""

from __future__ import annotations

import argparse
import collections
import math
import multiprocessing
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from _common import OTHER, free_port, print_table, progress, thread_sched_s

from aiopipe._core.lanes import LANE_THREAD_PREFIX

Run = Callable[[int], None]
Build = Callable[[str, int], "tuple[Run, Callable[[], dict[str, Any]]]"]


def repeat(step: Callable[[], object]) -> Run:
    """``run(n)`` that calls ``step()`` ``n`` times."""

    def run(n: int) -> None:
        for _ in range(n):
            step()

    return run


def add_cycle_arguments(parser: argparse.ArgumentParser, latency_ms: float,
                        compute_ms: float) -> None:  # fmt: skip
    """The options of a benchmark that times a wait of ``--latency-ms`` beside a step of
    ``--compute-ms`` (a model of ``--width``) in chunks (``online_cycle``, ``async_task``)."""
    parser.add_argument("--latency-ms", type=float, default=latency_ms)
    parser.add_argument("--compute-ms", type=float, default=compute_ms)
    parser.add_argument("--width", type=int, default=None,
                        help="the model's width (default: calibrated to --compute-ms); fixed, "
                             "runs of two trees compare alike")  # fmt: skip
    parser.add_argument("--chunk", type=int, default=50, help="steps per timed chunk")
    parser.add_argument("--rounds", type=int, default=3, help="chunks per row and process")
    parser.add_argument("--processes", type=int, default=2, help="fresh process sets")


def check_cycle_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse the values of :func:`add_cycle_arguments` that cannot run."""
    if min(args.chunk, args.rounds, args.processes, args.width or 1) < 1 or args.latency_ms <= 0:
        parser.error("--chunk, --rounds, --processes and --width must be >= 1, "
                     "--latency-ms above 0")  # fmt: skip


def progress_calls(pipe: Any, source: Any) -> Run:
    """``run(n)``: ``n`` awaited ``pipe.progress(source)`` calls, on one event loop kept
    from chunk to chunk (the pipeline keeps its lanes and state between calls)."""
    from aiopipe._core.loops import LoopRunner

    runner = LoopRunner()

    async def steps_of(n: int) -> None:
        for _ in range(n):
            await pipe.progress(source)

    def run(n: int) -> None:
        runner.run(steps_of, n)

    return run


def progress_many_calls(pipe: Any, source: Any) -> Run:
    """``run(n)``: one awaited ``pipe.progress_many(source, n)`` call (the lanes chain
    its steps), on one event loop kept from chunk to chunk."""
    from aiopipe._core.loops import LoopRunner

    runner = LoopRunner()

    async def steps_of(n: int) -> None:
        assert len(await pipe.progress_many(source, n)) == n

    def run(n: int) -> None:
        runner.run(steps_of, n)

    return run


def nothing_to_report() -> dict[str, Any]:
    return {}


def paired(values: Sequence[float], base: Sequence[float]) -> float:
    """The median of each chunk's time over the base row's chunk of the same round:
    drift between rounds cancels."""
    return statistics.median(v / b for v, b in zip(values, base, strict=True))


#: In a worker, once its first timed chunk starts: the steps it ran before that
#: chunk's own (the warm-up, the untimed round, the settling steps).
_first_timed_step: int | None = None


def first_timed_step() -> int:
    """For a worker's ``report()``: the index of the first step of its first timed
    chunk (the steps before it -- warm-up, untimed round -- are not the row's)."""
    if _first_timed_step is None:
        raise RuntimeError("first_timed_step() before the worker's first timed chunk")
    return _first_timed_step


def _worker(build: Build, config: str, warm_up: int, settle: int, conn: Connection, rank: int,
            ranks: int, port: int | None) -> None:  # fmt: skip
    """Rank ``rank`` of ``config``'s group: build the pipeline, warm it up, then run
    each chunk asked for after ``settle`` untimed steps, timing the timed ones."""
    global _first_timed_step
    if port is not None:
        from hstu_tasks import join_local_group

        join_local_group(rank, ranks, port)
    run, report = build(config, rank)
    run(warm_up)
    ran = warm_up  # steps so far
    conn.send("ready")
    # CPU seconds while timed by kind of thread, and the lanes' run-queue seconds
    # (LANES_WAITING, not CPU: left out of any sum of the kinds)
    threads: collections.Counter[str] = collections.Counter()
    timed = 0
    while (asked := conn.recv()) is not None:
        steps, timed_chunk = asked
        # The chunk starts in the middle of a run: on a step the pipeline is in the
        # middle of, with what it read ahead while the other rows ran used up.
        if settle:
            run(settle)
        ran += settle
        if not timed_chunk:
            run(steps)
            ran += steps
            conn.send(None)
            continue
        if _first_timed_step is None:
            _first_timed_step = ran
            _reset_peak_rss()  # the build's and the untimed steps' transients are not the row's
        ran += steps
        before = thread_sched_s()  # outside the timed window: it reads every thread's file
        start, cpu_start = time.perf_counter(), time.process_time()
        run(steps)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        after = thread_sched_s()
        timed += steps
        for tid, (name, seconds, waited) in after.items():
            _, seconds_before, waited_before = before.get(tid, (name, 0.0, 0.0))
            kind = "lanes" if name.startswith(LANE_THREAD_PREFIX) else name
            threads[kind] += seconds - seconds_before
            if kind == "lanes":
                threads[LANES_WAITING] += waited - waited_before
        conn.send((1e3 * wall / steps, cpu / wall))
    per_step = {kind: 1e6 * seconds / timed for kind, seconds in threads.items()} if timed else {}
    conn.send((report(), _peak_rss_mib(), per_step))
    conn.close()
    if port is not None:
        from hstu_tasks import leave_and_exit

        leave_and_exit(0)  # no native teardown at exit (hstu_tasks.leave_and_exit says why)


_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _reset_peak_rss() -> None:
    """Start the peak resident memory afresh from the current one (Linux: writing 5 to
    ``clear_refs``); elsewhere the peak stays the process's whole life's."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass


def _peak_rss_mib() -> float:
    """The peak resident memory since :func:`_reset_peak_rss` (Linux's ``VmHWM``), or
    since the process started (``ru_maxrss``), MiB."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class Chunks:
    """What :func:`time_in_chunks` measured, per config, chunk by chunk."""

    #: Milliseconds per step (the slowest rank's).
    ms: dict[str, list[float]] = field(default_factory=dict)
    #: Cores kept busy: CPU time over wall time, summed over the ranks.
    cores: dict[str, list[float]] = field(default_factory=dict)
    #: Rank 0's ``report()`` at the end of each process set.
    reports: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: Each process set's peak resident memory of a worker while it was timed, MiB
    #: (the largest rank's; the interpreter, torch and the model included, so compare
    #: rows; on Linux from the end of the warm-up on).
    peak_rss_mib: dict[str, list[float]] = field(default_factory=dict)
    #: Each process set's CPU time per timed step of rank 0, microseconds, by kind of
    #: thread: ``MainThread``, ``lanes`` (every lane), :data:`_common.OTHER` (threads
    #: Python did not start: OpenMP workers, gloo), and any other by its name.
    thread_cpu_us: dict[str, list[dict[str, float]]] = field(default_factory=dict)


def time_in_chunks(
    build: Build,
    configs: Sequence[str],
    *,
    chunk: int,
    rounds: int,
    processes: int,
    ranks: int = 1,
    gloo: bool = False,
    warm_up: int = 20,
    settle: int = 2,
) -> Chunks:
    """Time ``configs`` in ``rounds`` alternating chunks of ``chunk`` steps, in
    ``processes`` fresh sets of workers, each warmed up with ``warm_up`` steps and one
    untimed round of chunks; before each chunk a worker runs ``settle`` untimed steps
    -- at least as many as it can read ahead while idle, so that no row starts a
    chunk with a store of batches the others lack (a prefetch thread keeps fetching
    between its chunks)."""
    if ranks > 1 and not gloo:
        raise ValueError("more than one rank needs a process group: pass gloo=True")
    if settle < 0:
        raise ValueError(f"settle must be >= 0, got {settle}")
    out = Chunks()
    for config in configs:
        out.ms[config], out.cores[config], out.reports[config] = [], [], []
        out.peak_rss_mib[config], out.thread_cpu_us[config] = [], []
    for set_no in range(1, processes + 1):
        _one_set(build, configs, ranks, gloo, chunk, rounds, warm_up, settle, set_no, out)
    return out


def _one_set(build: Build, configs: Sequence[str], ranks: int, gloo: bool, chunk: int,
             rounds: int, warm_up: int, settle: int, set_no: int, out: Chunks) -> None:  # fmt: skip
    """Build a group of ``ranks`` workers per config, time ``rounds`` alternating
    chunks, tear down."""
    context = multiprocessing.get_context("spawn")
    workers: dict[str, list[tuple[Any, Connection]]] = {}
    try:
        for config in configs:
            port = free_port() if gloo else None
            workers[config] = group = []  # in the dict at once: a failed start kills the rest
            for rank in range(ranks):
                ours, theirs = context.Pipe()
                process = context.Process(
                    target=_worker, args=(build, config, warm_up, settle, theirs, rank, ranks, port)
                )  # fmt: skip
                process.start()
                theirs.close()  # a worker that dies then ends recv() with EOFError, not a hang
                group.append((process, ours))
            if any(conn.recv() != "ready" for _, conn in group):
                raise RuntimeError(f"{config}: a worker did not start")
        progress(f"process set {set_no}: every pipeline built and warmed up")
        # Round 0 is run and not timed: a set's first chunks, just after its start-up,
        # ran up to twice as slow on two ranks (every row, the cause not established).
        for round_no in range(0, rounds + 1):
            timed = round_no > 0
            order = list(workers.items())
            if round_no % 2 == 0:  # every other round backwards: no row always follows another
                order.reverse()
            for config, group in order:
                for _, conn in group:
                    conn.send((chunk, timed))
                per_rank = [conn.recv() for _, conn in group]
                if timed:
                    out.ms[config].append(max(ms for ms, _ in per_rank))
                    out.cores[config].append(sum(cores for _, cores in per_rank))
            if timed:
                progress(f"set {set_no}, round {round_no}/{rounds}: "
                         + ", ".join(f"{c} {out.ms[c][-1]:.2f}" for c in configs))  # fmt: skip
        for config, group in workers.items():
            for _, conn in group:
                conn.send(None)
            finals = [conn.recv() for _, conn in group]  # every rank's, so none blocks
            out.reports[config].append(finals[0][0])
            out.peak_rss_mib[config].append(max(rss for _, rss, _ in finals))
            out.thread_cpu_us[config].append(finals[0][2])
            for process, _ in group:
                process.join()
    finally:
        for group in workers.values():
            for process, _ in group:
                if process.is_alive():
                    process.kill()


#: The lanes' time ready to run but without a core (another thread had it: the loop,
#: an OpenMP worker), kept beside the kinds of thread's CPU time.
LANES_WAITING = "lanes waiting for a core"
#: The kinds of thread :func:`print_thread_cpu` shows, and their column titles.
THREAD_KINDS = {"MainThread": "main thread (the loop; the plain loop's own)", "lanes": "lanes",
                OTHER: "the others (OpenMP workers, gloo)"}  # fmt: skip


def print_thread_cpu(chunks: Chunks, label: Callable[[str], str] = str) -> None:
    """Each config's CPU time a timed step by kind of thread (rank 0's, the median
    over the process sets) beside its wall time: where a config's extra time goes on
    a host whose cores the step's own threads fill."""
    rows = []
    for config, per_set in chunks.thread_cpu_us.items():
        cpu = {k: statistics.median(s.get(k, 0.0) for s in per_set)
               for k in (*THREAD_KINDS, LANES_WAITING)}  # fmt: skip
        every = statistics.median(  # named threads too
            sum(v for k, v in s.items() if k != LANES_WAITING) for s in per_set)
        wall = 1e3 * statistics.median(chunks.ms[config])
        waited = cpu[LANES_WAITING]  # NaN: the kernel keeps no scheduler statistics
        rows.append([label(config), f"{wall:.0f}", *(f"{cpu[k]:.0f}" for k in THREAD_KINDS),
                     f"{every:.0f}", "-" if math.isnan(waited) else f"{waited:.0f}"])  # fmt: skip
    print_table(
        "CPU time per step by thread, us (rank 0's, median over the process sets): how much "
        "of the cores each config keeps busy, and with what; the last column is not CPU "
        "time but the lanes' time ready to run with no core free (Linux schedstat)",
        ["config", "wall us / step", *THREAD_KINDS.values(), "all threads", LANES_WAITING],
        rows,
    )  # fmt: skip
