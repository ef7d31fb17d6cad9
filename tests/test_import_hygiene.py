"""aiopipe imports only the standard library, torch, nvtx and uvloop."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

FORBIDDEN = ("torchrec", "megatron", "fbgemm_gpu", "hstu_tasks")
ALLOWED_THIRD_PARTY = {"torch", "nvtx", "uvloop", "exceptiongroup"}  # the last: 3.10 backport
PACKAGE = Path(__file__).resolve().parents[1] / "aiopipe"


def test_importing_aiopipe_loads_no_framework() -> None:
    code = (
        "import sys, aiopipe, aiopipe.executors; "
        f"print([m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_aiopipe_sources_import_only_allowed_packages() -> None:
    stdlib = set(sys.stdlib_module_names)
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                if root not in stdlib and root not in ALLOWED_THIRD_PARTY and root != "aiopipe":
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}: {root}")
    assert not offenders, offenders
