"""Fault tolerance: the fault matrix, peers that die or stall, SIGTERM, and a
``kill -9`` under ``torchrun --max-restarts 1`` resuming bit for bit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

import fault_workers

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(worker: Any, nprocs: int, *args: Any) -> Any:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return mp.start_processes(worker, args=(free_port(), *args), nprocs=nprocs, join=False,
                              start_method="spawn")  # fmt: skip


def wait_all(context: Any, timeout_s: float) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    for process in context.processes:
        process.join(max(deadline - time.monotonic(), 0.1))
    codes = [process.exitcode for process in context.processes]
    for process in context.processes:
        if process.is_alive():
            process.kill()
            process.join()
    return codes


def test_fault_matrix_every_hstu_task_in_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "matrix.json"
    codes = wait_all(start(fault_workers.matrix_worker, 1, str(out)), 240)
    assert codes == [0]
    report = json.loads(out.read_text())
    tasks, cases = report["tasks"], report["cases"]
    assert len(tasks) == 13 and len(cases) == 3 * len(tasks)
    assert report["lanes_at_end"] == []
    for case in cases:
        where = f"{case['task']} / {case['phase']}"
        assert case["seconds"] < 30, where
        assert case["lanes_after_reset"] == [], where
        assert case["after_reset"] == fault_workers.BATCHES, where  # reusable
        if not case["fired"]:
            # only tasks that are done before the source ends never run in the drain
            assert case["phase"] == "drain" and case["error"] is None, where
            assert case["results"] == fault_workers.BATCHES, where
            continue
        assert case["error"].startswith(case["task"]), where  # the original exception
        assert any(f"task {case['task']!r}" in note for note in case["notes"]), where
        assert "reset" in case["refused"], where  # refuses clearly until reset()
    fired_in_drain = {c["task"] for c in cases if c["phase"] == "drain" and c["fired"]}
    assert "optimizer_step" in fired_in_drain and "h2d" not in fired_in_drain
    # malformed batches: refused with what was wrong, skipped, every good batch trained
    bad = report["bad_input"]
    assert bad["results"] == 4
    assert len(bad["errors"]) == 4
    assert "labels must hold integer ids" in bad["errors"][0]
    assert "expected an HSTUBatch, got NoneType" in bad["errors"][1]  # check_batch's verdict
    assert "one per candidate" in bad["errors"][2]
    assert "expected action lengths + num_candidates" in bad["errors"][3]
    assert "first batch was refused: expected an HSTUBatch, got NoneType" in bad["first"]
    assert bad["after_first"] == 4 and bad["refused_first"] == 1
    # a bootstrap failing after it took the first batch loses nothing
    assert bad["failed_bootstrap"] == "injected bootstrap failure"
    assert bad["after_failed_bootstrap"] == 4
    assert bad["empty"] == "StopAsyncIteration"


@pytest.mark.parametrize("how", ["die", "stall"])
def test_a_peer_failing_mid_progress_fails_the_survivor_in_bounded_time(
    tmp_path: Path, how: str
) -> None:
    out = tmp_path / "peer.json"
    timeout_s = 4.0
    context = start(fault_workers.peer_worker, 2, str(out), how, timeout_s)
    if how == "stall":
        wait_all_rank0 = context.processes[0]
        wait_all_rank0.join(60)
        context.processes[1].kill()
    codes = wait_all(context, 60)
    report = json.loads(out.read_text())
    assert codes[0] == 3 and report["error"] is not None
    assert report["lanes"] == []  # every lane released
    if how == "die":
        assert codes[1] == -signal.SIGKILL
        assert "Connection closed by peer" in report["error"] or "reset" in report["error"]
        assert report["seconds"] < 30
    else:
        assert "imed out" in report["error"] or "Timeout" in report["error"], report["error"]
        assert report["seconds"] < 30  # the 4 s collective timeout, plus start-up
    assert any("raised by task" in note for note in report["notes"])


def test_sigterm_stops_a_rank_blocked_in_a_collective(tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    context = start(fault_workers.peer_worker, 2, str(out), "stall", 120.0)
    pid_file = Path(str(out) + ".pid")
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(3)  # rank 0 is now waiting for its stalled peer inside progress()
    pid = json.loads(pid_file.read_text())["pid"]
    sent = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    context.processes[0].join(10)
    stopped_after = time.monotonic() - sent
    codes = wait_all(context, 5)
    assert codes[0] == -signal.SIGTERM and stopped_after < 5
    assert not out.exists()  # it was stopped, not failed by the timeout


def torchrun(args: list[str], port: int | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    if port is not None:
        launcher += ["--max-restarts", "1", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"127.0.0.1:{port}"]  # fmt: skip
    else:
        launcher += ["--master-port", str(free_port())]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        launcher + [str(ROOT / "examples" / "train_hstu.py"), *args],
        capture_output=True, text=True, timeout=400, env=environment, cwd=ROOT,
    )  # fmt: skip


def test_kill_9_under_torchrun_resumes_and_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    common = ["--steps", "12", "--optimizer", "adam", "--batch-size", "8", "--max-history", "24"]
    plain = torchrun([*common, "--json", str(tmp_path / "plain.json")])
    assert plain.returncode == 0, plain.stderr[-3000:]
    faulty = torchrun(
        [*common, "--json", str(tmp_path / "faulty.json"), "--checkpoint-dir",
         str(tmp_path / "ckpt"), "--checkpoint-every", "3", "--kill-at", "1:7"],
        port=free_port(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )  # fmt: skip
    assert faulty.returncode == 0, faulty.stderr[-3000:]
    assert "exitcode: -9" in faulty.stderr  # rank 1 really was killed
    assert "resuming after step 6" in faulty.stdout
    expected = json.loads((tmp_path / "plain.json").read_text())
    resumed = json.loads((tmp_path / "faulty.json").read_text())
    assert resumed["resumed_from"] == 6
    assert resumed["losses"] == expected["losses"]  # every step once, same numbers
    assert resumed["parameters_sha256"] == expected["parameters_sha256"]  # bit for bit
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step-00000009", "step-00000012"
    ]
