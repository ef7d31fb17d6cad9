"""The examples the README points at run as documented."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch

from hstu_tasks.machine_load import busy_machine_note

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_quickstart_matches_a_plain_loop() -> None:
    out = run("examples/quickstart.py", "--steps", "30")
    assert "yes (bit for bit)" in out


@pytest.mark.parametrize("script", ["examples/serve_hstu.py", "examples/serve_load.py"])
def test_serving_scripts_show_their_defaults(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exited:
        load_example(script).main()
    assert exited.value.code == 0
    options = " ".join(capsys.readouterr().out.split("options:")[1].split())  # unwrapped
    assert "--max-batch" in options and "(default: 8)" in options
    assert "(default: 2.0)" in options  # --max-wait-ms


def test_dag_in_task_orders_the_reduction_after_every_table() -> None:
    out = run("examples/dag_in_task.py")
    magnitudes = [float(line.rsplit("=", 1)[1]) for line in out.splitlines()]
    assert len(magnitudes) == 8
    # sums of 2-5 normalised rows of 16 values: bounded; reading an unwritten row
    # (a missed dependency) gives garbage magnitudes
    assert all(0 < m < 16 * 5 * 4 for m in magnitudes), magnitudes


def test_quickstart_help_describes_it_in_a_whole_sentence() -> None:
    # It used the docstring's first line: "... and check it against a".
    out = " ".join(run("examples/quickstart.py", "--help").split())
    assert "pipeline a small training loop with aiopipe, and check it against a plain loop." in out


def test_dag_in_task_answers_help_without_running() -> None:
    out = run("examples/dag_in_task.py", "--help")  # it ignored --help and ran
    assert "usage: dag_in_task.py" in out and "--batches" in out and "tables ->" not in out
    assert len(run("examples/dag_in_task.py", "--batches", "2").splitlines()) == 2


@pytest.mark.distributed
def test_train_hstu_demo_writes_its_report(tmp_path: Path) -> None:
    report = tmp_path / "run.json"
    trace, timeline = tmp_path / "trace.json", tmp_path / "steps.svg"
    out = run("examples/train_hstu.py", "--steps", "6", "--json", str(report), "--trace",
              str(trace), "--timeline", str(timeline))  # fmt: skip
    assert "parameter checksum" in out
    data = json.loads(report.read_text())
    assert data["pipeline"] == "aiopipe" and data["steps"] == 6 and len(data["losses"]) == 6
    assert data["steps_per_s"] > 0 and isinstance(data["checksum"], float)
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("cat") == "task" for e in events) == 6 * 13  # every task, every step
    assert timeline.read_text().count('class="task"') == 3 * 13  # iterations 3-5
    assert "torch DDP" in out  # "auto" on a CPU


def load_example(script: str) -> ModuleType:
    """``script`` imported in this process (its imports take seconds a process)."""
    spec = importlib.util.spec_from_file_location(f"example_{Path(script).stem}", ROOT / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def refusal(script: str, flags: Sequence[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """The message ``script`` exits with when it refuses ``flags``, run in this process.
    It must refuse before it joins the process group, where the other ranks would wait."""
    module = load_example(script)

    def joined(*_: object) -> None:
        raise AssertionError(f"{script} {' '.join(flags)}: went on to join the process group")

    monkeypatch.setattr(module, "init_distributed", joined)
    monkeypatch.setattr(sys, "argv", [script, *flags])
    with pytest.raises(SystemExit) as exited:
        module.main()
    assert isinstance(exited.value.code, str)  # a message and exit status 1, no traceback
    return exited.value.code


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("script", "flags", "message"),
    [
        ("train_hstu", ("--data-parallel", "megatron"), "needs a CUDA device"),
        ("train_hstu", ("--replicate-tables", "--pipeline", "torchrec"), "need sharded tables"),
        ("train_hstu", ("--data-parallel", "megatron", "--checkpoint-dir", "ckpt"),
         "need torch DDP"),
        ("train_hstu", ("--pipeline", "none", "--timeline", "t.svg"), "record aiopipe's tasks"),
        ("train_hstu", ("--pipeline", "torchrec", "--steps-per-call", "3"), "takes one"),
        ("train_dlrm", ("--pipeline", "torchrec", "--eval-every", "2"),
         "forward its training batches in flight"),
        ("train_dlrm", ("--pipeline", "torchrec-lite", "--steps-per-call", "2"), "takes one"),
        ("train_dlrm", ("--pipeline", "torchrec-prefetch"), "needs a GPU"),
        ("train_dlrm", ("--checkpoint-dir", "ckpt", "--grad-accumulation", "2"),
         "--grad-accumulation is not supported"),
        ("train_dlrm", ("--pipeline", "torchrec", "--uneven", "1"), "wait in a collective"),
        ("train_dlrm", ("--uneven", "1", "--checkpoint-dir", "ckpt"), "which rank was short"),
        ("train_dlrm", ("--uneven", "3"), "is more than --steps 2"),
        ("train_dlrm", ("--uneven", "1"), "--uneven needs more than one rank"),
    ],
)  # fmt: skip
def test_training_examples_explain_what_they_cannot_do(
    script: str, flags: tuple[str, ...], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.is_available() and ("megatron" in flags or "torchrec-prefetch" in flags):
        pytest.skip("this machine has a GPU: it would run")
    assert message in refusal(f"examples/{script}.py", ("--steps", "2", *flags), monkeypatch)


@pytest.mark.parametrize(
    ("script", "flags", "message"),
    [
        ("train_hstu", ("--steps", "-3"), "argument --steps: must be >= 0, got -3"),
        ("train_hstu", ("--steps-per-call", "0"), "argument --steps-per-call: must be >= 1"),
        ("train_hstu", ("--max-history", "3"), "argument --max-history: must be >= 4, got 3"),
        ("train_hstu", ("--collective-timeout", "-1"), "argument --collective-timeout: must be "
                                                        "a number of seconds above 0, got -1"),
        ("train_dlrm", ("--grad-accumulation", "0"), "argument --grad-accumulation: must be >= 1"),
        ("train_dlrm", ("--eval-batches", "0"), "argument --eval-batches: must be >= 1"),
        ("train_dlrm", ("--checkpoint-every", "0"), "argument --checkpoint-every: must be >= 1"),
        ("train_dlrm", ("--collective-timeout", "0"), "argument --collective-timeout"),
    ],
)  # fmt: skip
def test_training_examples_refuse_numbers_out_of_range_by_name(
    script: str, flags: tuple[str, ...], message: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    module = load_example(f"examples/{script}.py")
    monkeypatch.setattr(sys, "argv", [script, *flags])
    with pytest.raises(SystemExit) as exited:
        module.main()
    assert exited.value.code == 2  # argparse's usage error, before anything is built
    assert message in capsys.readouterr().err


def test_the_online_fetch_example_refuses_what_it_cannot_time(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # it imports async_fetch.py
    module = load_example("examples/online_fetch.py")
    for flags in (["--steps", "0"], ["--in-flight", "0"], ["--latency-ms", "-1"]):
        monkeypatch.setattr(sys, "argv", ["online_fetch.py", *flags])
        with pytest.raises(SystemExit) as exited:
            asyncio.run(module.main())
        assert exited.value.code == 2
        assert "--steps and --in-flight must be >= 1" in capsys.readouterr().err


@pytest.mark.distributed
def test_a_refusal_from_the_command_line_is_one_line_and_exit_status_1() -> None:
    result = subprocess.run(
        [sys.executable, "examples/train_dlrm.py", "--pipeline", "torchrec", "--eval-every", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    assert "forward its training batches in flight" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("script", ["train_dlrm", "train_hstu"])
@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_rank_0_alone_says_why_the_job_stops(
    script: str, rank: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", rank)
    said_why = (f"{script}.py: --steps-per-call asks aiopipe for several steps a call; "
                f"--pipeline torchrec takes one")
    module = load_example(f"examples/{script}.py")
    for flags, status in ((["--pipeline", "torchrec", "--steps-per-call", "2"],
                           said_why if rank == "0" else 1),
                          (["--steps", "-1"], 2)):  # fmt: skip
        monkeypatch.setattr(sys, "argv", [f"{script}.py", *flags])
        with pytest.raises(SystemExit) as exited:
            module.main()
        assert exited.value.code == status  # the same status on every rank
        said = capsys.readouterr().err
        assert ("must be >= 0" in said) == (rank == "0" and status == 2)


@pytest.mark.distributed
def test_a_refusal_under_torchrun_is_said_once() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "examples/train_dlrm.py", "--pipeline", "torchrec", "--steps-per-call", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.count("--pipeline torchrec takes one") == 1, result.stderr[-3000:]


@pytest.mark.distributed
def test_train_dlrm_demo_writes_its_report(tmp_path: Path) -> None:
    report = tmp_path / "run.json"
    out = run("examples/train_dlrm.py", "--steps", "6", "--eval-every", "3", "--eval-batches", "2",
              "--optimizer", "adagrad", "--json", str(report))  # fmt: skip
    assert "2 eval passes" in out and "parameter checksum" in out
    data = json.loads(report.read_text())
    assert data["pipeline"] == "aiopipe" and data["steps"] == 6 and len(data["losses"]) == 6
    assert len(data["eval_losses"]) == 2 and all(0 < loss < 5 for loss in data["eval_losses"])
    assert data["steps_per_s"] > 0 and isinstance(data["checksum"], float)


@pytest.mark.distributed
def test_train_dlrm_steps_chained_a_call_train_and_evaluate_the_same(tmp_path: Path) -> None:
    reports = {}
    for per_call in ("1", "4"):  # 4: calls of 3 and 3, ending on each eval pass
        reports[per_call] = tmp_path / f"k{per_call}.json"
        run("examples/train_dlrm.py", "--steps", "6", "--eval-every", "3", "--eval-batches", "2",
            "--steps-per-call", per_call, "--json", str(reports[per_call]))  # fmt: skip
    one, chained = (json.loads(reports[k].read_text()) for k in ("1", "4"))
    for key in ("losses", "eval_losses", "checksum", "parameters_sha256"):
        assert chained[key] == one[key], key  # bit for bit
    assert len(chained["eval_losses"]) == 2


@pytest.mark.distributed
def test_train_dlrm_demo_runs_a_schedule_of_the_family_by_name(tmp_path: Path) -> None:
    report = tmp_path / "lite.json"
    run("examples/train_dlrm.py", "--steps", "4", "--pipeline", "aiopipe-lite", "--json",
        str(report))  # fmt: skip
    data = json.loads(report.read_text())
    assert data["pipeline"] == "aiopipe-lite" and data["steps"] == 4 and len(data["losses"]) == 4
    assert data["steps_per_s"] > 0 and isinstance(data["checksum"], float)


@pytest.mark.distributed
def test_train_dlrm_on_uneven_ranks_ends_every_rank_on_the_shortest_s_step(tmp_path: Path) -> None:
    report = tmp_path / "uneven.json"
    out = run("-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/train_dlrm.py",
              "--steps", "6", "--uneven", "2", "--json", str(report))  # fmt: skip
    assert "had 2 batch(es) fewer: every rank trained 4 steps" in out
    data = json.loads(report.read_text())
    assert data["steps"] == 4 and len(data["losses"]) == 4 and data["world_size"] == 2


@pytest.mark.distributed
def test_train_dlrm_says_why_torchrec_s_semi_sync_accumulates_differently() -> None:
    out = run("examples/train_dlrm.py", "--steps", "4", "--pipeline", "torchrec-semi-sync",
              "--grad-accumulation", "2")  # fmt: skip
    assert "clear each group's first gradients, so this checksum differs" in out


def test_online_fetch_example_keeps_n_fetches_in_flight_and_matches_the_plain_loop() -> None:
    out = run("examples/online_fetch.py", "--steps", "12", "--latency-ms", "1", "--in-flight", "3")
    lines = out.splitlines()
    assert "at most 1 fetch(es) at once" in lines[0] and "at most 1 fetch(es) at once" in lines[1]
    assert "fetch_ahead(in_flight=3)" in lines[2] and "at most 3 fetch(es) at once" in lines[2]
    assert lines[-1] == "same losses in all three: True"


def test_async_fetch_example_warns_on_the_shared_stream_and_matches_the_plain_loop() -> None:
    out = run("examples/async_fetch.py", "--steps", "8", "--latency-ms", "1")
    lines = out.splitlines()
    assert "warned" not in lines[0] and "warned: SerializedAwaitWarning" in lines[1]
    assert "warned" not in lines[2]
    assert lines[-1] == "same losses in all three: True"


#: Runs the script of argv[1] as ``python SCRIPT ...`` would, Ctrl-C delivered: a
#: background job (CI's) starts with SIGINT ignored, and Python then leaves it so.
AS_IN_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


@pytest.mark.distributed
def test_ctrl_c_ends_a_training_run_with_one_line_and_status_130(tmp_path: Path) -> None:
    """SIGINT once the first checkpoint is written, into a run far too long to end first."""
    checkpoints = tmp_path / "ckpt"
    argv = ["examples/train_hstu.py", "--steps", "100000", "--checkpoint-every", "2",
            "--checkpoint-dir", str(checkpoints)]  # fmt: skip
    with subprocess.Popen(
        [sys.executable, "-c", AS_IN_A_TERMINAL, *argv],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as child:  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            while not (checkpoints.is_dir() and any(checkpoints.glob("step-*"))):
                assert child.poll() is None, "it ended before its first checkpoint"
                assert time.monotonic() < deadline, "no checkpoint written in 240 s"
                time.sleep(0.05)
            child.send_signal(signal.SIGINT)
            _, stderr = child.communicate(timeout=60)
        finally:
            child.kill()  # (a no-op once it exited)
    assert child.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "train_hstu.py: interrupted; with --checkpoint-dir the same command resumes from the "
        "newest checkpoint"
    )
    assert "Traceback" not in stderr


def test_a_busy_machine_is_said_beside_the_speed(monkeypatch: pytest.MonkeyPatch) -> None:
    # A newcomer's first demo printed 1.9 steps/s on a machine other work kept busy,
    # and nothing said why.
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.2, 4.0, 3.0))
    note = busy_machine_note()
    assert note is not None and "load average 5.2 on 2 cores" in note
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 3.0, 3.0))  # the run's own threads
    assert busy_machine_note() is None
