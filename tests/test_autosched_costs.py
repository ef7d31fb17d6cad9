"""CostModel: validation, the JSON round trip, and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiopipe import PipelineError, Schedule, Task
from aiopipe.autosched import CostModel, CostModelError, EngineCosts, TaskCost
from aiopipe.autosched.costs import FORMAT

costs = st.builds(
    TaskCost,
    host_ms=st.floats(0, 1e4, allow_nan=False),
    gpu_ms=st.floats(0, 1e4, allow_nan=False),
    sync=st.booleans(),
    pcie=st.booleans(),
    comm=st.one_of(st.none(), st.sampled_from(["world", "dp"])),
    samples=st.integers(0, 1000),
    host_p90_ms=st.one_of(st.none(), st.floats(0, 1e4, allow_nan=False)),
    lane=st.one_of(st.none(), st.sampled_from(["io", "loop"])),
    stream=st.one_of(st.none(), st.just("memcpy")),
    await_ms=st.floats(0, 1e4, allow_nan=False),
)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8), costs, max_size=6),
       st.builds(EngineCosts, st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)))  # fmt: skip
def test_json_round_trip_is_exact(tasks: dict[str, TaskCost], engine: EngineCosts) -> None:
    model = CostModel(tasks, engine, {"source": "test"})
    again = CostModel.from_json(model.to_json())
    assert again == model


def test_save_and_load(tmp_path: Path) -> None:
    model = CostModel.from_host_ms({"a": 1.5, "b": 0.25}).with_task("b", gpu_ms=2.0, pcie=True)
    path = model.save(tmp_path / "costs.json")
    assert CostModel.load(path) == model
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT
    assert data["tasks"]["a"] == {"host_ms": 1.5, "samples": 0}  # defaults left out
    assert data["tasks"]["b"]["pcie"] is True


def test_awaited_time_round_trips_and_older_files_load_without_it() -> None:
    model = CostModel.from_host_ms({"fetch": 0.1, "train": 5.0}).with_task("fetch", await_ms=5.0)
    data = model.to_dict()
    assert data["tasks"] == {"fetch": {"host_ms": 0.1, "samples": 0, "await_ms": 5.0},
                             "train": {"host_ms": 5.0, "samples": 0}}  # fmt: skip
    assert CostModel.from_dict(data) == model
    older = {"format": FORMAT, "tasks": {"fetch": {"host_ms": 5.1}}}  # written before await_ms
    assert CostModel.from_dict(older).of("fetch") == TaskCost(5.1, await_ms=0.0)
    with pytest.raises(CostModelError, match="await_ms"):
        TaskCost(0.1, await_ms=-1.0)


def test_with_task_creates_and_updates() -> None:
    model = CostModel.from_host_ms({"a": 1.0})
    assert model.with_task("a", host_ms=2.0).of("a").host_ms == 2.0
    assert model.with_task("new", host_ms=3.0).of("new").host_ms == 3.0
    assert model.of("a").host_ms == 1.0  # immutable


@pytest.mark.parametrize(
    "payload, fragment",
    [
        ({"format": "other", "tasks": {}}, "unknown cost model format"),
        ({"format": FORMAT}, "needs a 'tasks' object"),
        ({"format": FORMAT, "tasks": {"a": {"host_ms": -1}}}, "finite number >= 0"),
        ({"format": FORMAT, "tasks": {"a": {"host_ms": "x"}}}, "number of ms"),
        ({"format": FORMAT, "tasks": {"a": {"host_ms": 1, "colour": 2}}}, "unknown field"),
        ({"format": FORMAT, "tasks": {"a": {}}}, "host_ms"),
        ({"format": FORMAT, "tasks": {}, "engine": {"handoff_ms": float("inf")}}, "finite"),
    ],
)
def test_malformed_json_is_refused_with_a_reason(payload: dict, fragment: str) -> None:
    with pytest.raises(CostModelError, match=fragment):
        CostModel.from_dict(payload)


def test_invalid_json_text() -> None:
    with pytest.raises(CostModelError, match="not valid JSON"):
        CostModel.from_json("{nope")


def test_missing_task_names_the_tasks() -> None:
    model = CostModel.from_host_ms({"a": 1.0})
    schedule = Schedule.of([Task.from_fn(n, lambda ctx: None) for n in ("a", "b")])
    with pytest.raises(CostModelError, match=r"\['b'\]"):
        model.check_covers(schedule)
    with pytest.raises(CostModelError, match="'zzz'"):
        model.of("zzz")


def test_errors_belong_to_the_root_family() -> None:
    assert issubclass(CostModelError, PipelineError)
    assert issubclass(CostModelError, ValueError)
