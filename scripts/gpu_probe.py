"""What this machine is, as one ``JSON`` line: Python, torch and its CUDA, the GPUs and
the driver, and which version of each package the project imports there.  Exits 1
when a package the GPU suite needs cannot be imported (the line is printed anyway).

    python scripts/gpu_probe.py
"""

from __future__ import annotations

import importlib
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

# import name -> distribution, for the packages whose versions the report shows
NEEDED = {"torch": "torch", "aiopipe": "aiopipe", "hstu_tasks": "aiopipe",
          "torchrec": "torchrec", "fbgemm_gpu": "fbgemm-gpu-cpu",
          "megatron.core": "megatron-core", "tensordict": "tensordict",
          "pytest": "pytest", "pytest_asyncio": "pytest-asyncio"}  # fmt: skip
OPTIONAL = {"nvtx": "nvtx", "uvloop": "uvloop", "numpy": "numpy"}


def driver() -> str | None:
    """The NVIDIA driver's version, from nvidia-smi (None without it)."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else None


def imported(modules: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(module -> version, module -> why it failed to import)."""
    from importlib.metadata import PackageNotFoundError, version

    versions, failures = {}, {}
    for module, distribution in modules.items():
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 -- any import failure is the finding
            failures[module] = f"{type(exc).__name__}: {exc}"
            continue
        try:
            versions[module] = version(distribution)
        except PackageNotFoundError:
            versions[module] = "?"
    return versions, failures


def facts() -> tuple[dict[str, Any], bool]:
    versions, failures = imported(NEEDED)
    optional, _ = imported(OPTIONAL)
    info: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(),
        "versions": {**versions, **optional}, "import_failures": failures,
        "driver": driver(), "cuda_available": False, "devices": [],
        "aiopipe_from": str(Path(sys.modules["aiopipe"].__file__ or "?").parent.parent)
        if "aiopipe" in versions else None,
    }  # fmt: skip
    if "torch" in versions:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        for index in range(torch.cuda.device_count() if info["cuda_available"] else 0):
            props = torch.cuda.get_device_properties(index)
            info["devices"].append({
                "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}",
                "multiprocessors": props.multi_processor_count,
            })  # fmt: skip
    return info, not failures


def main() -> None:
    info, complete = facts()
    print("JSON " + json.dumps(info, sort_keys=True), flush=True)
    for module, why in info["import_failures"].items():
        print(f"cannot import {module}: {why}", file=sys.stderr)
    sys.exit(0 if complete else 1)


if __name__ == "__main__":
    main()
