"""``aiopipe plan``: the auto-scheduler's subcommand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiopipe.autosched import CostModel, EngineCosts, TaskCost
from aiopipe.cli import main

TARGET = '''
from aiopipe import Schedule, Task

def noop(ctx):
    pass

def schedule():
    return Schedule.of([
        Task.from_fn("prep", noop, stream="io", writes=("x",)),
        Task.from_fn("train", noop, reads=("x",)),
    ])
'''


@pytest.fixture
def target(tmp_path: Path) -> str:
    path = tmp_path / "plan_target.py"
    path.write_text(TARGET)
    return f"{path}:schedule"


@pytest.fixture
def costs(tmp_path: Path) -> Path:
    model = CostModel.from_host_ms({"prep": 3.0, "train": 3.0}, EngineCosts(0.01, 0.002, 0.05))
    return model.save(tmp_path / "costs.json")


def test_plan_from_a_cost_file_prints_a_table_and_json(
    target: str, costs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "plan.json"
    assert main(["plan", target, "--costs", str(costs), "--thread-map", "by_stream",
                 "--frozen", "train", "-o", str(out_file)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    table, json_line = out.rsplit("\n\n", 1)
    assert "predicted gain" in table and "0 -> 1" in table  # prep's lookahead raised
    plan = json.loads(json_line)
    assert plan == json.loads(out_file.read_text())
    assert plan["baseline"]["latency_ms"] > 6.0 > plan["best"]["latency_ms"] > 3.0
    assert plan["best"]["lookaheads"] == {"prep": 1, "train": 0}
    assert set(plan["best"]["thread_map"]) == {"prep", "train"}
    assert plan["best"]["fire_order"] and plan["best"]["stream_map"]["train"] == "default"


def test_plan_no_loop_keeps_every_task_on_a_thread_lane(
    target: str, costs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", target, "--costs", str(costs), "--thread-map", "prep=io,train=main",
                 "--no-loop", "--json"]) == 0  # fmt: skip
    kept_off = json.loads(capsys.readouterr().out)
    assert "loop" not in kept_off["best"]["thread_map"].values()
    assert kept_off["best"]["latency_ms"] < kept_off["baseline"]["latency_ms"]


def test_plan_profiles_when_no_costs_are_given(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "profiled.json"
    assert main(["plan", target, "--batches", "8", "--no-calibrate", "--save-costs", str(saved),
                 "--json"]) == 0  # fmt: skip
    plan = json.loads(capsys.readouterr().out)
    assert set(CostModel.load(saved).tasks) == {"prep", "train"}
    assert plan["best"]["latency_ms"] <= plan["baseline"]["latency_ms"]


def test_plan_exit_codes(target: str, costs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", target, "--costs", "missing.json"]) == 2
    assert main(["plan", "no_such_module_here:f", "--costs", str(costs)]) == 2
    assert main(["plan", target, "--costs", str(costs), "--frozen", "ghost"]) == 1
    err = capsys.readouterr().err
    assert "missing.json" in err and "ghost" in err


def test_plan_counts_lane_threads_in_words(
    target: str, costs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", target, "--costs", str(costs), "--thread-map", "prep=main,train=main",
                 "--max-threads", "1"]) == 0  # fmt: skip
    baseline = next(line for line in capsys.readouterr().out.splitlines()
                    if line.startswith("baseline"))  # fmt: skip
    assert baseline.endswith("(1 lane thread)")


ASYNC_FETCH = f"{Path(__file__).parents[1] / 'examples' / 'schedules.py'}:async_fetch"


def test_plan_gives_an_awaiting_fetch_a_stream_of_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue #32: an async fetch (0.1 ms host, 5 ms awaited) one batch ahead of a 5 ms
    step on the same stream.  The two run one after the other on any lanes, so the
    pick gives the fetch a stream of its own; moving both onto the loop gains nothing."""
    model = CostModel({"fetch": TaskCost(0.1, await_ms=5.0), "train": TaskCost(5.0)},
                      EngineCosts(0.01, 0.002, 0.05))  # fmt: skip
    costs = model.save(tmp_path / "costs.json")
    assert main(["plan", ASYNC_FETCH, "--costs", str(costs)]) == 0
    table, json_line = capsys.readouterr().out.rsplit("\n\n", 1)
    assert "0.100 (+5.000 await)" in table
    plan = json.loads(json_line)
    best = plan["best"]
    assert plan["baseline"]["latency_ms"] == pytest.approx(10.25, abs=0.1)
    assert best["stream_map"]["fetch"] not in ("default", best["stream_map"]["train"])
    assert best["thread_map"]["train"] != best["thread_map"]["fetch"]
    assert "loop" != best["thread_map"]["train"]  # a sync step on the loop would hold the fetch
    assert best["latency_ms"] == pytest.approx(5.15, abs=0.1)
    assert plan["task_await_ms"] == {"fetch": 5.0}


BROKEN = f"{Path(__file__).parents[1] / 'examples' / 'schedules.py'}:broken"


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--batches", "3", "argument --batches: must be >= 4, got 3"),
    ("--batches", "many", "argument --batches: takes a whole number, got 'many'"),
    ("--max-threads", "0", "argument --max-threads: must be >= 1, got 0"),
    ("--max-in-flight", "0", "argument --max-in-flight: must be >= 1, got 0"),
    ("--beam-width", "-1", "argument --beam-width: must be >= 1, got -1"),
    ("--rounds", "0", "argument --rounds: must be >= 1, got 0"),
])  # fmt: skip
def test_plan_numbers_out_of_range_are_usage_errors(
    target: str, flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # --batches 3 was "a task failed while profiling: AutoschedError ..." and exit 1.
    with pytest.raises(SystemExit) as exited:
        main(["plan", target, flag, value, "--no-calibrate"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"aiopipe plan: error: {message}"


def test_plan_help_names_the_fewest_batches(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "at least 4" in " ".join(capsys.readouterr().out.split())


def test_plan_of_a_schedule_that_breaks_a_rule_says_so_not_that_a_task_failed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", BROKEN, "--batches", "4", "--no-calibrate"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aiopipe plan: [rule 7]") and "a task failed" not in err
