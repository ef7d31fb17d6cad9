"""``./dev gpu-prepare`` and ``./dev gpu-suite`` (scripts/gpu_*.py): what travels to a
CUDA machine, a suite that reports every part however it ends, and the dress
rehearsal on this machine, which has no GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_doc_commands import ROOT, activated_env, venv_ready

sys.path.insert(0, str(ROOT / "scripts"))

import gpu_prepare  # noqa: E402
import gpu_travel  # noqa: E402
from gpu_parts import Context, Figure, Part, Reading, Step, gpu_test_files  # noqa: E402
from gpu_suite import Suite  # noqa: E402

CUDA_SKIPIF = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)")


def test_tests_that_need_cuda_carry_the_marker_the_suite_selects() -> None:
    unmarked = [path.name for path in (ROOT / "tests").glob("test_*.py")
                if CUDA_SKIPIF.search(path.read_text())]  # fmt: skip
    assert not unmarked, f"mark CUDA-only tests @pytest.mark.cuda instead: {unmarked}"
    files = gpu_test_files(ROOT)
    for name in ("test_cuda", "test_watchdog", "test_presets", "test_hstu", "test_usage_examples"):
        assert f"tests/{name}.py" in files


def dev_pin(variable: str) -> str:
    found = re.search(rf"^{variable}=(\S+)", (ROOT / "dev").read_text(), re.M)
    assert found is not None
    return found[1]


def test_every_project_pin_travels_or_stays_behind_for_a_reason() -> None:
    pins = gpu_travel.project_pins()
    stays = {gpu_travel.canonical(name) for name in gpu_travel.STAYS}
    for torch in gpu_travel.FOR_TORCH:
        travels = {gpu_travel.canonical(name) for name in gpu_travel.travelling(torch)}
        assert not travels & stays
        assert set(pins) <= travels | stays, sorted(set(pins) - travels - stays)
    for name, (version, _) in gpu_travel.COMMON.items():
        assert pins.get(name, version) == version, name  # the project's own pin
    own = gpu_travel.travelling(".".join(pins["torch"].split(".")[:2]))  # the CPU stack's set
    assert own["fbgemm-gpu-cpu"][0] == dev_pin("FBGEMM_VERSION")
    assert own["torchrec"][0] == dev_pin("TORCHREC_VERSION")
    with pytest.raises(ValueError, match="no wheel set for torch 1.0"):
        gpu_travel.travelling("1.0")


def test_prepare_says_what_to_run_and_what_to_carry() -> None:
    text = gpu_prepare.instructions(gpu_travel.WHEEL_DIR)
    assert "\n    ./dev gpu-suite\n" in text and f"\n    {gpu_travel.WHEEL_DIR}\n" in text
    assert 0 < gpu_prepare.tree_bytes() < gpu_travel.LIMIT_BYTES
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", gpu_travel.WHEEL_DIR],
                             cwd=ROOT)  # fmt: skip
    assert ignored.returncode == 0  # it travels only when carried


def python_step(code: str) -> Step:
    return Step([sys.executable, "-c", code])


def benchmark_step(*args: str) -> Step:
    return Step([sys.executable, str(ROOT / "benchmarks" / "overlap.py"), *args])


def read_x(outputs: list[str], ctx: Context) -> Reading:
    value = json.loads(outputs[0].split("JSON ", 1)[1])["x"]
    return Reading([Figure("x", str(value), ">= 2", value >= 2)])


def test_a_part_that_fails_or_runs_out_of_time_is_reported_and_the_rest_still_run(
    tmp_path: Path,
) -> None:
    parts = [
        Part("broken", "exits 3", 30, False, lambda ctx: [python_step("print('oops'); exit(3)")],
             read_x),
        Part("slow", "outlives its budget", 2, False,
             lambda ctx: [python_step("import time; time.sleep(60)")], read_x),
        Part("fine", "prints a figure", 30, False,
             lambda ctx: [python_step("print('JSON {\"x\": 2}')")], read_x),
        Part("gpu", "needs CUDA", 30, True, lambda ctx: [benchmark_step("--iterations", "3")],
             read_x),
        Part("gpu-typo", "needs CUDA", 30, True, lambda ctx: [benchmark_step("--iterationz", "3")],
             read_x),
    ]  # fmt: skip
    ctx = Context(sys.executable, ROOT, tmp_path, tmp_path)
    suite = Suite(ctx, tmp_path / "out", 200.0, "test")
    suite.report["environment"] = {"cuda_available": False}
    assert suite.run(parts) == 1
    report = json.loads((tmp_path / "out" / "gpu_report.json").read_text())
    status = {p["name"]: (p["status"], p["reason"]) for p in report["parts"]}
    assert status["broken"] == ("failed", "command 1 exited with status 3")
    assert status["slow"] == ("timed out", "command 1 ran past the part's 2 s")
    assert status["fine"] == ("passed", "")
    assert status["gpu"][0] == "skipped" and "its commands load" in status["gpu"][1]
    assert status["gpu-typo"][0] == "failed" and "unrecognized arguments: --iterationz" in status[
        "gpu-typo"][1]  # fmt: skip
    fine = report["parts"][2]
    assert fine["figures"] == [{"name": "x", "value": "2", "target": ">= 2", "met": True}]
    markdown = (tmp_path / "out" / "gpu_report.md").read_text()
    assert "| fine | x | 2 | >= 2 | yes |" in markdown
    assert "## broken: failed" in markdown and "oops" in markdown  # its output, quoted
    assert sorted(os.listdir(tmp_path / "out")) == ["gpu_report.json", "gpu_report.md",
                                                    "gpu_suite.log"]  # fmt: skip


@pytest.mark.timeout(400)
def test_the_rehearsal_installs_offline_and_reports_what_it_skipped_for_want_of_cuda(
    tmp_path: Path,
) -> None:
    why = venv_ready()
    if why:
        pytest.skip(why)
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    env = {**activated_env(), "OUT": str(out), "AIOPIPE_GPU_WHEELS": str(wheels)}

    def dev(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(ROOT / "dev"), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=380)  # fmt: skip
        assert done.returncode == 0, f"./dev {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done

    prepared = dev("gpu-prepare", "--torch", "local", "--dest", str(wheels)).stdout
    assert "of 64.0 MiB" in prepared and "torchrec" in prepared
    dev("gpu-suite", "--rehearse")
    assert sorted(os.listdir(out)) == ["gpu_report.json", "gpu_report.md", "gpu_suite.log"]
    report = json.loads((out / "gpu_report.json").read_text())
    parts = {part["name"]: part for part in report["parts"]}
    assert report["mode"] == "rehearsal without a GPU"
    assert parts["install"]["status"] == "passed"
    assert len(parts["install"]["facts"]["wheels"]) == len(list(wheels.glob("*.whl")))
    environment = report["environment"]
    assert environment["cuda_available"] is False and not environment["import_failures"]
    assert environment["aiopipe_from"] == str(ROOT)  # the checkout, installed editable
    assert {"torchrec", "fbgemm_gpu", "megatron.core", "pytest_asyncio"} <= set(
        environment["versions"])  # fmt: skip
    tests = parts["gpu-tests"]
    assert (tests["status"], tests["reason"]) == ("skipped", "needs a CUDA device")
    assert any("test_cuda" in name for name in tests["facts"]["outcomes"])
    for name in ("hstu", "presets", "plan", "watchdog"):
        assert parts[name]["status"] == "skipped", parts[name]
        assert parts[name]["reason"].endswith("its commands load and take their options as written")
    markdown = (out / "gpu_report.md").read_text()
    assert "| device | no CUDA device |" in markdown
    assert f"| torch | {environment['torch']} |" in markdown
    assert "* for want of a CUDA device: gpu-tests, streams, hstu, presets, plan, watchdog\n" in markdown
    assert [p["name"] for p in report["parts"] if p["no_cuda"]] == [
        "gpu-tests", "streams", "hstu", "presets", "plan", "watchdog"]  # fmt: skip
