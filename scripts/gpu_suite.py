"""``./dev gpu-suite``: all the work that needs a GPU, in one command, with a report.

It installs what travelled (the wheels of ``./dev gpu-prepare`` and the project,
offline), probes the machine, runs the tests that need CUDA and the GPU benchmarks
(scripts/gpu_parts.py lists the parts), and writes ``gpu_report.md``,
``gpu_report.json`` and ``gpu_suite.log`` into ``$OUT`` (``--out``; default the
folder ``gpu-report``) -- after every part, so a run cut short still leaves one.
Each part runs within its own time budget and the whole within ``--deadline``
seconds; a part that fails or runs out of time is reported and the next one runs.
Where there is no CUDA device, the parts that need one are skipped, and their
commands are still checked to load and take their options.  ``--rehearse`` marks a
dress rehearsal on a machine without a GPU (``./dev gpu-suite --rehearse``).

    ./dev gpu-suite [--rehearse] [--out DIR] [--deadline 540] [--parts NAME ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import Any

import gpu_report
from gpu_parts import PARTS, Context, NotReady, Part, Reading, Step, last_json
from gpu_travel import ROOT, WHEEL_DIR

RESERVE_S = 15.0  # kept back from the deadline for the report itself
ARGCHECK_S = 120.0
LOG_LINES = 400  # of each command's output, in gpu_suite.log


def run_step(step: Step, cwd: Path, timeout: float) -> tuple[int | None, str]:
    """Run one command; ``(exit status, output)``, the status ``None`` when it ran out
    of time (it is killed with every process it started)."""
    env = {**os.environ, **step.env, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(step.argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # spawned ranks and workers too
        output, _ = process.communicate()
        return None, output
    return process.returncode, output


class Suite:
    def __init__(self, ctx: Context, out: Path, deadline_s: float, mode: str) -> None:
        self.ctx, self.out, self.deadline_s, self.mode = ctx, out, deadline_s, mode
        self.started = time.monotonic()
        self.report: dict[str, Any] = {
            "mode": mode, "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "deadline_s": deadline_s, "seconds": 0.0, "environment": {}, "parts": [],
        }  # fmt: skip
        self.log = out / "gpu_suite.log"
        out.mkdir(parents=True, exist_ok=True)
        self.log.write_text("")
        self.parts: list[Part] = []
        self.argchecks: dict[str, list[tuple[bool, str]]] | None = None  # part: per command

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.started) - RESERVE_S

    def say(self, message: str) -> None:
        print(f"[gpu-suite {time.monotonic() - self.started:5.0f} s] {message}", flush=True)

    def run_steps(self, label: str, steps: list[Step], budget: float) -> tuple[str, str, list[str]]:
        """``(status, reason, outputs)`` of running ``steps`` in order within ``budget``
        (their output goes to the log under ``label``)."""
        outputs: list[str] = []
        ends = time.monotonic() + budget
        for number, step in enumerate(steps, 1):
            status, output = run_step(step, self.ctx.root, ends - time.monotonic())
            outputs.append(output)
            with self.log.open("a") as log:
                tail = "\n".join(output.splitlines()[-LOG_LINES:])
                log.write(f"\n===== {label}: $ {shlex.join(step.argv)}\n{tail}\n")
            if status is None:
                return "timed out", f"command {number} ran past the part's {budget:.0f} s", outputs
            if status != 0:
                return "failed", f"command {number} exited with status {status}", outputs
        return "passed", "", outputs

    def run_part(self, part: Part) -> dict[str, Any]:
        began = time.monotonic()
        status, reason = "passed", ""
        outputs: list[str] = []
        steps: list[Step] = []
        try:
            steps = part.steps(self.ctx)
        except NotReady as exc:
            status, reason = "failed", str(exc)
        has_cuda = bool(self.report["environment"].get("cuda_available"))
        if status == "passed" and part.needs_cuda and not has_cuda:
            status, reason = self.check_without_cuda(part, steps)
        elif status == "passed" and self.left() < 10:
            status, reason = "skipped", "no time left before the suite's deadline"
        elif status == "passed":
            status, reason, outputs = self.run_steps(part.name, steps,
                                                     min(part.budget_s, self.left()))
        reading = Reading()
        if outputs:
            try:
                reading = part.read(outputs, self.ctx)
            except Exception as exc:  # noqa: BLE001 -- reported, and the suite goes on
                if status == "passed":
                    status, reason = "failed", f"its output could not be read: {exc!r}"
        if status == "passed" and reading.skipped:
            status, reason = "skipped", reading.skipped
        # Skipped for want of CUDA: a part that needs it, or one whose every test did.
        no_cuda = status == "skipped" and not has_cuda and (part.needs_cuda or bool(reading.skipped))
        return {
            "no_cuda": no_cuda,
            "name": part.name, "title": part.title, "status": status, "reason": reason,
            "seconds": round(time.monotonic() - began, 1), "needs_cuda": part.needs_cuda,
            "commands": [shlex.join(step.argv) for step in steps],
            "figures": [vars(figure) for figure in reading.figures], "facts": reading.facts,
            "output_tail": "\n".join("\n".join(outputs).splitlines()[-gpu_report.FAILED_LINES:]),
        }  # fmt: skip

    def check_without_cuda(self, part: Part, steps: list[Step]) -> tuple[str, str]:
        why = ("no CUDA device (torch.cuda.is_available() is False)"
               if self.report["environment"] else "no CUDA device known: the probe did not run")  # fmt: skip
        checks = self.check_commands().get(part.name, [])
        wrong = [f"command {n}: {what}" for n, (ok, what) in enumerate(checks, 1) if not ok]
        if wrong or len(checks) != len(steps):
            return "failed", f"{why}; and it does not load as written: {'; '.join(wrong) or '?'}"
        return "skipped", f"{why}; its commands load and take their options as written"

    def check_commands(self) -> dict[str, list[tuple[bool, str]]]:
        """Whether the commands of every part that needs CUDA load and take their
        options (scripts/gpu_argcheck.py), all in one process, checked once."""
        if self.argchecks is None:
            cuda_parts = [part for part in self.parts if part.needs_cuda]
            commands = {part.name: [step.argv[1:] for step in part.steps(self.ctx)]
                        for part in cuda_parts}  # fmt: skip
            flat = [argv for argvs in commands.values() for argv in argvs]
            check = Step([self.ctx.python, str(self.ctx.root / "scripts" / "gpu_argcheck.py"),
                          json.dumps(flat)])  # fmt: skip
            _, reason, outputs = self.run_steps("argcheck", [check], min(ARGCHECK_S, self.left()))
            try:
                results = iter(last_json(outputs[0]) if outputs else [])
            except ValueError:  # no result line: it broke before printing one
                results = iter([(False, reason or "it printed no result")] * len(flat))
            self.argchecks = {
                name: [(bool(ok), str(what)) for ok, what in islice(results, len(argvs))]
                for name, argvs in commands.items()
            }
        return self.argchecks

    def run(self, parts: list[Part]) -> int:
        self.parts = parts
        for part in parts:
            self.say(f"{part.name}: {part.title}")
            result = self.run_part(part)
            if part.name == "environment":
                self.report["environment"] = result["facts"]
            self.report["parts"].append(result)
            self.report["seconds"] = round(time.monotonic() - self.started, 1)
            markdown, _ = gpu_report.write(self.report, self.out)
            self.say(f"{part.name}: {result['status']}"
                     + (f" ({result['reason']})" if result["reason"] else ""))  # fmt: skip
        self.say(f"report: {markdown}")
        failed = [p["name"] for p in self.report["parts"] if p["status"] in ("failed", "timed out")]
        if failed:
            self.say(f"failed: {', '.join(failed)} (gpu_suite.log holds their output)")
        return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true",
                        help="a dress rehearsal on a machine without a GPU (marked in the report)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-report"),
                        help="the report's folder (default: $OUT, else gpu-report)")
    parser.add_argument("--deadline", type=float, default=540.0, metavar="SECONDS",
                        help="the whole suite's time (default 540: inside a 10-minute limit)")
    parser.add_argument("--parts", nargs="+", choices=[p.name for p in PARTS], metavar="NAME",
                        help=f"run only these parts (default all: {[p.name for p in PARTS]})")
    parser.add_argument("--wheels", type=Path,
                        default=Path(os.environ.get("AIOPIPE_GPU_WHEELS") or ROOT / WHEEL_DIR),
                        help=f"the wheels (default: $AIOPIPE_GPU_WHEELS, else {WHEEL_DIR})")
    args = parser.parse_args()  # fmt: skip
    parts = [p for p in PARTS if args.parts is None or p.name in args.parts]
    mode = "rehearsal without a GPU" if args.rehearse else "run on the machine at hand"
    with tempfile.TemporaryDirectory(prefix="aiopipe-gpu-") as work:
        ctx = Context(sys.executable, ROOT, Path(work), args.wheels.resolve())
        sys.exit(Suite(ctx, args.out.resolve(), args.deadline, mode).run(parts))


if __name__ == "__main__":
    main()
