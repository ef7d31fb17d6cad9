"""The GPU suite's report: ``gpu_report.json`` (everything, for scripts) and
``gpu_report.md`` (the machine, each part's status and each figure, for people).

Each part in the JSON: ``name``, ``title``, ``status`` (``passed``, ``failed``,
``timed out`` or ``skipped``), ``reason``, ``no_cuda`` (skipped for want of a CUDA
device), ``seconds``, ``needs_cuda``, ``commands``,
``figures`` (``name``, ``value``, ``target``, ``met``), ``facts`` (what the part's
output said, raw) and ``output_tail``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT = "aiopipe.gpu_report/1"
FAILED_LINES = 40  # lines of a failed part's output quoted in the Markdown report


def machine_rows(env: dict[str, Any]) -> list[tuple[str, str]]:
    devices = env.get("devices") or []
    names = ", ".join(f"{d['name']} ({d['memory_gib']} GiB, sm {d['capability']})" for d in devices)
    torch = env.get("torch", "not importable")
    if env.get("torch_cuda"):
        torch += f" (CUDA {env['torch_cuda']})"
    versions = env.get("versions", {})
    return [
        ("device", names or "no CUDA device"),
        ("driver", env.get("driver") or "none found (no nvidia-smi)"),
        ("torch", torch),
        ("python", f"{env.get('python', '?')} on {env.get('platform', '?')}"),
        ("packages", ", ".join(f"{name} {v}" for name, v in sorted(versions.items())) or "?"),
    ]


def markdown(report: dict[str, Any]) -> str:
    lines = ["# GPU report", "", "| | |", "|---|---|"]
    rows = machine_rows(report["environment"])
    rows.append(("run", f"{report['mode']}, {report['started']}, {report['seconds']:.0f} s "
                        f"(deadline {report['deadline_s']:.0f} s)"))  # fmt: skip
    lines += [f"| {key} | {value} |" for key, value in rows]
    lines += ["", "## Parts", "", "| part | status | seconds | what / why |", "|---|---|---|---|"]
    for part in report["parts"]:
        why = part["title"] + (f": {part['reason']}" if part["reason"] else "")
        lines.append(f"| {part['name']} | {part['status']} | {part['seconds']:.1f} | {why} |")
    lines += ["", "## Figures", "", "| part | figure | value | target | met |",
              "|---|---|---|---|---|"]  # fmt: skip
    for part in report["parts"]:
        for fig in part["figures"]:
            met = {True: "yes", False: "**no**", None: ""}[fig["met"]]
            cells = (part["name"], fig["name"], fig["value"], fig["target"], met)
            lines.append("| " + " | ".join(cells) + " |")
    skipped = [p for p in report["parts"] if p["status"] == "skipped"]
    if skipped:
        lines += ["", "## Skipped", ""]
        no_cuda = [p["name"] for p in skipped if p["no_cuda"]]
        if no_cuda:
            lines.append(f"* for want of a CUDA device: {', '.join(no_cuda)}")
        lines += [f"* {p['name']}: {p['reason']}" for p in skipped if not p["no_cuda"]]
    for part in report["parts"]:
        if part["status"] in ("failed", "timed out"):
            tail = part["output_tail"].splitlines()[-FAILED_LINES:]
            lines += ["", f"## {part['name']}: {part['status']}", "", "```text", *tail, "```"]
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write both forms into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    as_json, as_md = out / "gpu_report.json", out / "gpu_report.md"
    as_json.write_text(json.dumps({"format": FORMAT, **report}, indent=1, sort_keys=True) + "\n")
    as_md.write_text(markdown(report))
    return as_md, as_json
