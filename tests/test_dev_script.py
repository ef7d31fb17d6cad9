"""``./dev``: it runs in the caller's folder, lists its benchmarks, and the demo it
starts ends with a sensible line however little it had to do."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from test_doc_commands import ROOT, activated_env, venv_ready

DEV = str(ROOT / "dev")


@pytest.fixture(autouse=True)
def current_venv() -> None:
    why = venv_ready()
    if why:
        pytest.skip(why)


def dev(*args: str, cwd: Path, status: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([DEV, *args], cwd=cwd, env=activated_env(), capture_output=True,
                          text=True, timeout=280)  # fmt: skip
    assert done.returncode == status, f"./dev {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


def test_dev_python_runs_in_the_callers_folder(tmp_path: Path) -> None:
    (tmp_path / "my_script.py").write_text(
        "import os, pathlib\npathlib.Path('out.txt').write_text(os.getcwd())\n"
    )
    dev("python", "my_script.py", cwd=tmp_path)
    assert (tmp_path / "out.txt").read_text() == str(tmp_path)


def test_bench_lists_the_benchmarks(tmp_path: Path) -> None:
    listing = dev("bench", cwd=tmp_path).stdout.splitlines()
    names = [line.split()[0] for line in listing[1:]]
    runnable = sorted(p.stem for p in (ROOT / "benchmarks").glob("[!_]*.py")
                      if "__main__" in p.read_text())  # fmt: skip
    assert names == runnable and "presets" in names
    assert all(len(line.split(None, 1)) == 2 for line in listing[1:])  # each has its line
    presets = (ROOT / "benchmarks" / "presets.py").read_text().splitlines()[0].strip('"')
    assert listing[1:][names.index("presets")].split(None, 1)[1] == presets


def test_bench_names_the_benchmarks_for_an_unknown_one(tmp_path: Path) -> None:
    done = dev("bench", "nosuch", cwd=tmp_path, status=2)
    assert "no benchmark named 'nosuch'" in done.stderr and "presets" in done.stderr
    assert "Traceback" not in done.stderr and "can't open file" not in done.stderr
    dev("bench", "_common", cwd=tmp_path, status=2)  # helpers are not benchmarks


@pytest.mark.timeout(300)
def test_demo_with_no_steps_writes_its_report_in_the_callers_folder(tmp_path: Path) -> None:
    done = dev("demo", "--steps", "0", "--json", "run.json", cwd=tmp_path)
    assert "no steps run (--steps 0)" in done.stdout and "Traceback" not in done.stderr
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["steps"] == 0 and report["losses"] == []


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_rerunning_a_finished_checkpointed_demo_says_nothing_was_left(tmp_path: Path) -> None:
    flags = ("--steps", "2", "--checkpoint-dir", "ckpt", "--checkpoint-every", "1")
    first = dev("demo", *flags, cwd=tmp_path)
    assert "steps/s" in first.stdout and (tmp_path / "ckpt").is_dir()
    again = dev("demo", *flags, cwd=tmp_path)
    assert "nothing left to run: the checkpoint is at step 2 of 2" in again.stdout
    assert "steps/s" not in again.stdout.splitlines()[-1]
    # the same model: the checkpoint's parameters, not a fresh initialisation
    checksum = first.stdout.split("parameter checksum")[-1].splitlines()[0]
    assert again.stdout.split("parameter checksum")[-1].splitlines()[0] == checksum
