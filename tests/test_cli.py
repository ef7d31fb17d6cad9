"""The ``aiopipe`` command line, run for real against the example schedules."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import aiopipe
import aiopipe.cli
from aiopipe import Schedule
from aiopipe.cli import TargetError, load_target, main, parse_thread_map

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "schedules.py"
OVERLAP, TRAINING, BROKEN = (f"{EXAMPLES}:{name}" for name in ("overlap", "training", "broken"))


@pytest.fixture(autouse=True)
def restore_imports() -> Iterator[None]:
    """Targets put their folders on sys.path and their modules in sys.modules; undo
    that for the example and temporary modules."""
    path, modules = list(sys.path), set(sys.modules)
    yield
    sys.path[:] = path
    loaded_here = (str(ROOT / "examples"), tempfile.gettempdir())
    installed = (sys.prefix, sys.base_prefix)  # a virtualenv may itself live in /tmp
    for name in set(sys.modules) - modules:
        file = getattr(sys.modules[name], "__file__", None) or ""
        if file.startswith(loaded_here) and not file.startswith(installed):
            del sys.modules[name]


def write_target(folder: Path, body: str, name: str = "targets.py") -> Path:
    path = folder / name
    path.write_text("from aiopipe import Pipeline, Schedule, Task\n" + textwrap.dedent(body))
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


# -- python -m aiopipe, and the console script -------------------------------------------


def test_python_dash_m_reports_a_broken_schedule() -> None:
    command = [sys.executable, "-m", "aiopipe", "validate", "examples/schedules.py:broken"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert ("FAILED rule 7: cyclic dependency within one progress: backward -> step -> backward"
            in done.stdout)  # fmt: skip
    assert "tasks (declared order)" in done.stdout


def test_console_script_points_at_main() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    module, _, function = project["project"]["scripts"]["aiopipe"].partition(":")
    assert (module, function) == ("aiopipe.cli", "main")
    assert getattr(aiopipe.cli, function) is main


# -- validate ---------------------------------------------------------------------------


def test_validate_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "validate", OVERLAP, "--json", "--thread-map",
                             "load=io,prep=io,prefetch=io")  # fmt: skip
    assert status == 0
    report = json.loads(out)
    assert report["ok"] and report["violation"] is None and report["order"] == "topological"
    order = [t["name"] for t in report["tasks"]]
    assert order.index("prep") < order.index("load")  # the promoted Δ=0 wait orders them
    assert order.index("zero_grad") < order.index("forward") < order.index("backward")
    assert report["lanes"] == {"io": 3, "default": 5}
    kinds = {(e["producer"], e["consumer"]): (e["kind"], e["delta"]) for e in report["edges"]}
    assert kinds[("step", "report")] == ("cross_iter", 2)
    assert kinds[("forward", "prefetch")] == ("same_progress_sync", 0)
    assert kinds[("zero_grad", "forward")] == ("depends_on", 0)
    assert kinds[("load", "prep")] == ("slot", 1)
    assert report["event_waits"]["forward"] == [["prefetch", "io", 0]]
    assert {t["name"] for t in report["tasks"] if t["nccl"]} == {"forward", "backward"}


def test_validate_text_report_and_failure(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "validate", OVERLAP)
    assert status == 0 and out.rstrip().endswith("OK: the schedule satisfies rules 1-8")
    assert "step -> report: cross_iter, Δ=2, slot offset -2" in out
    assert "forward waits for prefetch (stream io) at ring offset 0" in out
    status, out, _ = run_cli(capsys, "validate", BROKEN, "--json")
    report = json.loads(out)
    assert status == 1 and not report["ok"] and report["edges"] == []
    assert report["violation"]["rule"] == 7
    assert "backward -> step -> backward" in report["violation"]["message"]


def test_validate_uses_a_pipelines_lanes(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "validate", TRAINING, "--json")
    lanes = {t["name"]: t["lane"] for t in json.loads(out)["tasks"]}
    assert status == 0 and lanes == {"prepare": "io", "train": "compute", "step": "compute"}


def test_the_real_hstu_schedule_validates(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchrec")
    from hstu_tasks import HSTU_DEFAULT_THREAD_MAP

    # The target brings the lanes HSTUPipeline runs it on: no --thread-map needed.
    status, out, _ = run_cli(capsys, "validate", f"{EXAMPLES}:hstu_prefetch", "--json")
    report = json.loads(out)
    assert status == 0 and len(report["tasks"]) == 14
    assert {t["name"]: t["lane"] for t in report["tasks"]} == HSTU_DEFAULT_THREAD_MAP
    order = [t["name"] for t in report["tasks"]]
    assert order.index("forward") < order.index("prefetch_embeddings") < order.index("backward")
    assert report["lanes"] == {"compute": 14}
    assert {t["name"]: t["lookahead"] for t in report["tasks"]}["h2d"] == 2


# -- graph ------------------------------------------------------------------------------


def test_graph_writes_dot_and_mermaid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "graph", OVERLAP, "--thread-map", "per_task")
    assert status == 0 and out.startswith("digraph schedule {")
    assert out.count("subgraph cluster_") == 8  # one lane per task
    assert '"step" -> "report" [style=dashed' in out
    status, _, err = run_cli(capsys, "graph", TRAINING, "-o", str(tmp_path / "t.mmd"),
                             "--title", "quick")  # fmt: skip
    text = (tmp_path / "t.mmd").read_text()
    assert status == 0 and "wrote" in err and text.startswith('---\ntitle: "quick: 3 tasks')
    assert 'subgraph g0["lane io"]' in text and 'subgraph g1["lane compute"]' in text
    assert 't_train ==>|"depends_on"| t_step' in text
    status, _, err = run_cli(capsys, "graph", TRAINING, "-o", str(tmp_path / "t.txt"))
    assert status == 2 and "cannot tell the diagram format" in err  # a command-line error


def test_graph_renders_through_graphviz(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "dot"  # echoes its format and the number of nodes it was given
    fake.write_text(f"#!{sys.executable}\nimport sys\nsource = sys.stdin.read()\n"
                    "sys.stdout.write(sys.argv[1] + ' ' + str(source.count('[label=')))\n"
                    )  # fmt: skip
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(bin_dir))
    status, _, _ = run_cli(capsys, "graph", OVERLAP, "-o", str(tmp_path / "o.svg"))
    assert status == 0 and (tmp_path / "o.svg").read_text() == "-Tsvg 8"
    status, _, _ = run_cli(capsys, "graph", OVERLAP, "--format", "png", "-o", str(tmp_path / "o"))
    assert status == 0 and (tmp_path / "o").read_text() == "-Tpng 8"
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    status, _, err = run_cli(capsys, "graph", OVERLAP, "-o", str(tmp_path / "p.png"))
    assert status == 1 and "needs the Graphviz program 'dot'" in err
    assert not (tmp_path / "p.png").exists()


# -- trace ------------------------------------------------------------------------------


def task_slices(path: Path) -> list[dict[str, Any]]:
    events = json.loads(path.read_text())["traceEvents"]
    return [e for e in events if e.get("cat") == "task"]


def test_trace_runs_a_pipeline_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "trace.json"
    status, out, _ = run_cli(capsys, "trace", TRAINING, "--progresses", "5", "-o", str(out_file))
    assert status == 0 and "5 progress(es), 15 task runs on lanes compute, io" in out
    slices = task_slices(out_file)
    assert sorted(e["args"]["batch"] for e in slices if e["name"] == "step") == [0, 1, 2, 3, 4]
    threads = {e["name"]: e["args"]["thread"] for e in slices}
    assert threads == {"prepare": "aiopipe-lane-io", "train": "aiopipe-lane-compute",
                       "step": "aiopipe-lane-compute"}  # fmt: skip


def test_trace_feeds_synthetic_batches_to_a_schedule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "trace.json"
    status, out, _ = run_cli(capsys, "trace", OVERLAP, "--progresses", "4", "-o", str(out_file),
                             "--executor", "sequential")  # fmt: skip
    assert status == 0 and "4 progress(es), 32 task runs on lanes loop" in out
    slices = task_slices(out_file)
    assert sorted(e["args"]["batch"] for e in slices if e["name"] == "load") == [0, 1, 2, 3]
    status, out, _ = run_cli(capsys, "trace", OVERLAP, "--progresses", "2", "-o", str(out_file),
                             "--thread-map", "load=io,prep=io,prefetch=io")  # fmt: skip
    assert status == 0 and "lanes default, io" in out


def test_trace_stops_when_the_batches_run_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = write_target(tmp_path, """
        def short():
            return [Task.from_fn("t", lambda ctx: ctx.slots.set("step_result", 1))], [10, 20]
    """)  # fmt: skip
    status, out, _ = run_cli(capsys, "trace", f"{target}:short", "--progresses", "5",
                             "-o", str(tmp_path / "t.json"))  # fmt: skip
    assert status == 0 and "2 progress(es)" in out
    assert "the batches ran out after 2 of 5 progresses" in out


def test_trace_failure_still_writes_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = write_target(tmp_path, """
        def fail(ctx):
            if ctx.batch_index == 1:
                raise ValueError("bad batch")
        def failing():
            return Schedule.of([Task.from_fn("boom", fail)])
    """)  # fmt: skip
    out_file = tmp_path / "t.json"
    status, _, err = run_cli(capsys, "trace", f"{target}:failing", "--progresses", "3",
                             "-o", str(out_file))  # fmt: skip
    assert status == 1 and "ValueError: bad batch" in err
    events = json.loads(out_file.read_text())["traceEvents"]
    failed = [e["args"].get("failed", False) for e in events if e.get("cat") == "task"]
    assert failed == [False, True]


def test_trace_needs_a_tracing_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = write_target(tmp_path, """
        def untraced():
            return Pipeline([Task.from_fn("t", lambda ctx: None)], expect_result=False)
    """)  # fmt: skip
    status, _, err = run_cli(capsys, "trace", f"{target}:untraced", "--progresses", "1",
                             "-o", str(tmp_path / "t.json"))  # fmt: skip
    assert status == 2 and "built without tracing" in err and "trace=True" in err
    status, _, err = run_cli(capsys, "trace", TRAINING, "--progresses", "1", "--executor", "async",
                             "-o", str(tmp_path / "t.json"))  # fmt: skip
    assert status == 2 and "brings its own executor" in err
    assert not (tmp_path / "t.json").exists()


# -- load_target ------------------------------------------------------------------------


def test_target_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write_target(package, """
        def _tasks():
            return [Task.from_fn("a", lambda ctx: None, writes=("x",)),
                    Task.from_fn("b", lambda ctx: None, reads=("x",))]
        SCHEDULE = Schedule.of(_tasks())
        class Factory:
            @staticmethod
            def build():
                return Schedule.of(_tasks()), iter([1, 2])
        def pipeline(trace=None):
            return Pipeline(_tasks(), executor="sequential", trace=trace, expect_result=False)
        def tasks():
            return _tasks()
    """, name="demo.py")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    plain = load_target("mypkg.demo:SCHEDULE")  # not callable: used as it is
    assert [t.name for t in plain.schedule.tasks] == ["a", "b"] and plain.pipeline is None
    pair = load_target("mypkg.demo:Factory.build")
    assert pair.batches is not None and list(pair.batches) == [1, 2]
    assert [t.name for t in load_target("mypkg.demo:tasks").schedule.tasks] == ["a", "b"]
    from aiopipe.trace import Tracer

    tracer = Tracer()
    traced = load_target("mypkg.demo:pipeline", tracer=tracer)
    assert traced.pipeline is not None and traced.pipeline.tracer is tracer
    assert traced.thread_map is not None and callable(traced.thread_map)  # sequential: the loop
    assert load_target("mypkg.demo:pipeline").pipeline.tracer is None  # type: ignore[union-attr]
    by_file = load_target(f"{package / 'demo.py'}:tasks")
    assert isinstance(by_file.schedule, Schedule)


@pytest.mark.parametrize(("spec", "message"), [
    ("examples/schedules.py", "expected MODULE:FUNC"),
    ("no/such/file.py:f", "no such file"),
    ("surely_not_a_module_xyz:f", "cannot import module 'surely_not_a_module_xyz'"),
    (f"{EXAMPLES}:nothing_here", "has no attribute 'nothing_here'"),
    (f"{EXAMPLES}:torch", "gave a module; expected a Schedule"),
])  # fmt: skip
def test_target_errors_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(TargetError, match=message):
        load_target(spec)


def test_target_pair_needs_batches(tmp_path: Path) -> None:
    target = write_target(tmp_path, """
        def bad():
            return Schedule.of([Task.from_fn("t", lambda ctx: None)]), 3
    """)  # fmt: skip
    with pytest.raises(TargetError, match="iterable of batches, got int"):
        load_target(f"{target}:bad")


def test_a_target_giving_an_empty_list_is_told_the_list_is_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It said "gave a list; expected ... a list of Tasks".
    target = write_target(tmp_path, """
        def nothing():
            return []
    """)  # fmt: skip
    status, _, err = run_cli(capsys, "validate", f"{target}:nothing")
    assert status == 2
    assert "gave an empty list: a schedule needs at least one Task" in err
    assert "gave a list;" not in err


def test_parse_thread_map() -> None:
    assert parse_thread_map("per_task") == "per_task"
    assert parse_thread_map('{"a": "io"}') == {"a": "io"}
    assert parse_thread_map("a=io, b = compute,") == {"a": "io", "b": "compute"}
    for bad in ("sideways", "a=io,b", '{"a": 1}', "{nope"):
        with pytest.raises(TargetError):
            parse_thread_map(bad)


# -- plan -------------------------------------------------------------------------------


def test_plan_delegates_to_the_auto_scheduler(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[Any] = []

    def add_arguments(parser: Any) -> None:
        parser.add_argument("target")
        parser.add_argument("--budget", type=int, default=1)

    fake = SimpleNamespace(add_arguments=add_arguments,
                           main=lambda args: seen.append(args) or 3)  # fmt: skip
    monkeypatch.setitem(sys.modules, "aiopipe.autosched.cli", fake)
    assert main(["plan", OVERLAP, "--budget", "7"]) == 3
    assert seen[0].target == OVERLAP and seen[0].budget == 7


def test_plan_without_the_auto_scheduler(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "aiopipe.autosched.cli", None)  # import fails
    status, _, err = run_cli(capsys, "plan", OVERLAP)
    assert status == 2 and "auto-scheduler (aiopipe.autosched) is not available" in err
    status, out, _ = run_cli(capsys, "validate", OVERLAP)  # the rest still works
    assert status == 0


def test_a_target_that_needs_arguments_is_a_loading_error() -> None:
    command = [sys.executable, "-m", "aiopipe", "validate", "examples/quickstart.py:build_pipeline"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "build_pipeline needs arguments (model, opt, executor)" in done.stderr


def test_a_trace_parameter_is_the_only_one_the_loader_fills(tmp_path: Path) -> None:
    target = write_target(tmp_path, """
        def needs_trace(trace):
            return [Task.from_fn("t", lambda ctx: None)]
    """)  # fmt: skip
    assert load_target(f"{target}:needs_trace", tracer=aiopipe.Tracer()).schedule.tasks
    with pytest.raises(TargetError, match=r"needs arguments \(trace\)"):
        load_target(f"{target}:needs_trace")  # validate and graph pass no tracer


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"aiopipe {aiopipe.__version__}\n"


def test_every_option_has_help() -> None:
    import argparse

    from aiopipe.autosched.cli import add_arguments

    plan = argparse.ArgumentParser()
    add_arguments(plan)
    subparsers = next(a for a in aiopipe.cli._parser()._actions
                      if isinstance(a, argparse._SubParsersAction))  # fmt: skip
    parsers = {name: p for name, p in subparsers.choices.items() if name != "plan"}
    parsers["plan"] = plan
    missing = [f"{name} {action.dest}" for name, parser in parsers.items()
               for action in parser._actions if not action.help]  # fmt: skip
    assert len(parsers) == 4 and not missing


def test_trace_runs_20_progresses_by_default(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "trace", OVERLAP, "-o", str(tmp_path / "t.json"))
    assert status == 0 and ": 20 progress(es)," in out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["graph"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main([])
    with pytest.raises(SystemExit):
        main(["trace", OVERLAP, "--progresses", "0", "-o", "x.json"])
    assert "--progresses: must be >= 1, got 0" in capsys.readouterr().err


def test_a_target_that_raises_while_building_is_a_loading_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It gave a raw traceback and exit status 1.
    path = write_target(tmp_path, """
        def broken():
            raise RuntimeError("no data here")
    """)  # fmt: skip
    status, _, err = run_cli(capsys, "validate", f"{path}:broken")
    assert status == 2
    assert "raised while building: RuntimeError: no data here" in err


@pytest.mark.parametrize("command", ["graph", "trace", "plan"])
def test_an_output_file_that_cannot_be_written_is_said_so(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A raw FileNotFoundError traceback, after the whole run for trace and plan.
    path = write_target(tmp_path, """
        def tasks():
            def step(ctx):
                ctx.slots.set("step_result", ctx.batch_index)
            return [Task.from_fn("step", step, writes=("step_result",))]
    """)  # fmt: skip
    missing = tmp_path / "no such folder" / "out.json"
    extra = ["--no-calibrate", "--batches", "4"] if command == "plan" else []
    status, _, err = run_cli(capsys, command, f"{path}:tasks", "-o", str(missing), *extra)
    assert status == 2 and "no such folder" in err


def test_a_thread_map_naming_no_task_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It was accepted without a word, the misspelt task on lane "default".
    path = write_target(tmp_path, """
        def tasks():
            return [Task.from_fn("step", lambda ctx: None)]
    """)  # fmt: skip
    status, _, err = run_cli(capsys, "validate", f"{path}:tasks", "--thread-map", "stpe=io")
    assert status == 2 and "did you mean 'step'" in err  # a command-line error (was 1)


@pytest.mark.parametrize(("body", "said"), [
    ("raise RuntimeError('module-level failure')\n", "RuntimeError: module-level failure"),
    ("def x(:\n", "SyntaxError: invalid syntax"),
    ("import nonexistent_module_zz\n", "ModuleNotFoundError: No module named 'nonexistent"),
])  # fmt: skip
@pytest.mark.parametrize("form", ["file", "module"])
def test_a_target_that_fails_to_import_is_a_loading_error(
    body: str, said: str, form: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # A raw traceback and exit status 1, where a target function that raises gave 2.
    path = tmp_path / "fails_to_import_zz.py"
    path.write_text(body + "def f():\n    return []\n")
    monkeypatch.chdir(tmp_path)
    spec = f"{path}:f" if form == "file" else "fails_to_import_zz:f"
    status, _, err = run_cli(capsys, "validate", spec)
    assert status == 2
    assert err.count("\n") == 1 and said in err
    assert ("fails_to_import_zz" in err) and "Traceback" not in err


def test_trace_refuses_a_thread_map_naming_no_task(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Exit status 1, as for a task that fails; it is a command-line error.
    path = write_target(tmp_path, """
        def tasks():
            return [Task.from_fn("step", lambda ctx: None)]
    """)  # fmt: skip
    out = tmp_path / "trace.json"
    status, _, err = run_cli(capsys, "trace", f"{path}:tasks", "--thread-map", "a=io,zzz=io",
                             "-o", str(out))  # fmt: skip
    assert status == 2 and "--thread-map names task(s) ['a', 'zzz']" in err
    assert not out.exists()


def test_trace_says_when_the_batch_source_raised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It said "a task failed: OSError: disk gone".
    path = write_target(tmp_path, """
        def batches():
            yield 0
            yield 1
            raise OSError("disk gone")

        def tasks():
            def use(ctx):
                ctx.slots.set("step_result", ctx.slots["batch_cpu"])
            return [Task.from_fn("use", use, writes=("step_result",))], batches()
    """)  # fmt: skip
    out = tmp_path / "trace.json"
    status, _, err = run_cli(capsys, "trace", f"{path}:tasks", "-o", str(out))
    assert status == 1
    assert "the batch source raised: OSError: disk gone" in err and "a task failed" not in err
    assert out.exists()  # the spans recorded so far are still written


@pytest.mark.parametrize("option", ["-o", "--svg"])
def test_trace_checks_its_output_files_before_running(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A missing folder was found only after the whole run.
    ran = tmp_path / "ran"
    path = write_target(tmp_path, f"""
        def tasks():
            def step(ctx):
                open({str(ran)!r}, "w").close()
                ctx.slots.set("step_result", 1)
            return [Task.from_fn("step", step, writes=("step_result",))]
    """)  # fmt: skip
    missing = str(tmp_path / "no such folder" / "out")
    outputs = {"-o": str(tmp_path / "trace.json"), "--svg": str(tmp_path / "t.svg")}
    outputs[option] = missing
    argv = [x for pair in outputs.items() for x in pair]
    status, _, err = run_cli(capsys, "trace", f"{path}:tasks", *argv)
    assert status == 2 and f"cannot write {missing}: no folder" in err
    assert err.count("\n") == 1 and not ran.exists()
