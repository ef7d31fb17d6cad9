"""The benchmarks' shared output helpers (benchmarks/_common.py): interleaved rounds
with a progress line each, the spread next to the median, rows printed as they come."""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _common import (  # noqa: E402
    Table,
    engine_host_ms,
    interleaved_rounds,
    print_table,
    spread,
    step_boundaries_us,
    with_spread,
)

from aiopipe import Span  # noqa: E402


def test_spread_is_half_the_range_over_the_median() -> None:
    assert spread([9.0, 10.0, 11.0]) == "+-10%"
    assert spread([10.0, 10.0]) == "+-0%"
    assert spread([5.0]) == "--"  # one round: no spread to speak of
    assert with_spread([1.0, 2.0, 3.0], 2) == "2.00 +-50%"


def test_rounds_interleave_drop_the_warmup_and_report_each_round(
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls: list[str] = []

    def counter(name: str) -> Callable[[], float]:
        values: Iterator[float] = iter(range(100))
        return lambda: calls.append(name) or float(next(values))

    samples = interleaved_rounds({"a": counter("a"), "b": counter("b")}, 2, warmup=True)
    assert calls == ["a", "b"] * 3  # interleaved, the warm-up round first
    assert samples == {"a": [1.0, 2.0], "b": [1.0, 2.0]}  # the warm-up dropped
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 3
    assert lines[0].endswith("round 0/2 (warm-up, dropped): a 0, b 0")
    assert lines[2].endswith("round 2/2: a 2, b 2")


def test_a_table_prints_each_row_when_it_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    table = Table("title", ["name", "ms"], [6])
    assert capsys.readouterr().out == "\ntitle\nname    ms\n------  --\n"
    table.row("plain", "1.5")
    assert capsys.readouterr().out == "plain   1.5\n"  # at once, in the fixed columns
    print_table("t", ["a", "b"], [["long cell", 1]])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:] == ["a          b", "---------  -", "long cell  1"]  # fitted to the cell


def _counting_build(
    config: str, rank: int
) -> tuple[Callable[[int], None], Callable[[], dict[str, object]]]:
    """A chunk worker's pipeline for the test below: counts the steps it is asked for,
    and reports where its timed steps began; config "b" also keeps 160 MiB resident
    (written, so the pages are the process's)."""
    from _chunks import first_timed_step

    done = [0]
    held = b"\x01" * (160 << 20) if config == "b" else b""  # written: resident

    def run(n: int) -> None:
        done[0] += n + 0 * len(held)

    return run, lambda: {"config": config, "steps": done[0], "first": first_timed_step()}


def test_chunks_alternate_in_worker_processes_and_report_time_cores_and_state() -> None:
    from _chunks import time_in_chunks

    chunks = time_in_chunks(_counting_build, ["a", "b"], chunk=5, rounds=3, processes=2,
                            warm_up=4, settle=3)  # fmt: skip
    for config in ("a", "b"):
        assert len(chunks.ms[config]) == len(chunks.cores[config]) == 6  # 3 rounds x 2 sets
        assert all(ms >= 0 for ms in chunks.ms[config])
        assert all(0 <= cores < 64 for cores in chunks.cores[config])
        # each set's worker: the warm-up, then the untimed first round and every timed
        # chunk, each after its three untimed steps; its timed steps begin after the
        # warm-up, that round and the first timed chunk's settling steps
        steps, first = 4 + (1 + 3) * (3 + 5), 4 + (3 + 5) + 3
        assert chunks.reports[config] == [{"config": config, "steps": steps, "first": first}] * 2
        assert len(chunks.peak_rss_mib[config]) == 2  # one per process set
        # CPU per timed step by kind of thread, one dict per set: the worker's own thread
        assert len(chunks.thread_cpu_us[config]) == 2
        assert all(s["MainThread"] >= 0 for s in chunks.thread_cpu_us[config])
    # each set's workers report their own peak: "b" holds 160 MiB more than "a"
    assert min(chunks.peak_rss_mib["b"]) > max(chunks.peak_rss_mib["a"]) + 100


def test_a_paired_ratio_is_the_median_of_the_per_round_ratios() -> None:
    from _chunks import paired

    # per-round ratios 0.5, 0.5 and 1.5: one disturbed round does not move the median
    assert paired([1.0, 4.0, 3.0], [2.0, 8.0, 2.0]) == 0.5
    with pytest.raises(ValueError):
        paired([1.0], [1.0, 2.0])  # rows of different lengths are a bug


def span(task: str, iteration: int, start_ms: float, end_ms: float, wait_ms: float = 0.0,
         thread: str = "compute") -> Span:  # fmt: skip
    return Span(task, iteration, iteration, thread, thread, None, int(start_ms * 1e6),
                int(end_ms * 1e6), int(wait_ms * 1e6))  # fmt: skip


def test_the_engine_host_time_is_the_busiest_lanes_gaps_less_their_waits() -> None:
    spans = []
    for i in range(4):  # a 10 ms step: forward 4 ms, 1 ms gap, backward 4 ms, 1 ms boundary
        t = 10.0 * i
        spans += [span("forward", i, t, t + 4), span("backward", i, t + 5, t + 9, wait_ms=0.5),
                  span("h2d", i, t, t + 1, thread="io")]  # fmt: skip
    host, step = engine_host_ms(spans, skip=1)  # iterations 1-3: two steps between them
    assert step == pytest.approx(10.0)
    assert host == pytest.approx(0.5 + 1.0)  # in-step gap less the wait, and the boundary
    with pytest.raises(ValueError, match="less than two iterations"):
        engine_host_ms(spans, skip=3)


def test_a_step_boundary_is_the_busiest_lanes_gap_between_two_iterations_less_its_wait() -> None:
    spans = []
    for i, end in enumerate((9.3, 9.45, 9.2)):  # backward's end; iteration i + 1 starts at 10
        t = 10.0 * i
        spans += [span("forward", i, t, t + 4), span("backward", i, t + 5, t + end),
                  span("h2d", i, t, t + 1, thread="io")]  # fmt: skip
    spans.append(span("forward", 3, 30.0, 34.0, wait_ms=0.1))  # waited 0.1 ms for the io lane
    assert step_boundaries_us(spans) == pytest.approx([700.0, 550.0, 700.0])


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux's /proc")
def test_each_thread_s_cpu_and_run_queue_time_are_read() -> None:
    from _common import thread_cpu_s, thread_sched_s

    main = str(threading.main_thread().native_id)
    name, cpu, waited = thread_sched_s()[main]
    assert name == "MainThread" and cpu > 0 and (waited >= 0 or math.isnan(waited))
    assert thread_cpu_s()[main][0] == "MainThread" and thread_cpu_s()[main][1] >= cpu
