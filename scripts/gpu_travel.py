"""What travels to a CUDA machine that has no package index: the wheels the project
needs there, and why each one travels or stays behind.

The machine this is written for (one NVIDIA GPU, Python 3.12, a CUDA build of torch
2.11, no package index, at most 64 MiB of files sent with a command) has most of what
the project uses already; the rest travels as cp312 manylinux or pure-Python wheels.
fbgemm and torchrec are built for one torch release each, so their pins follow the
torch there, not the project's own pins (``requirements/``, for torch 2.13).
fbgemm's CUDA build is far too large to travel: its CPU build goes instead, which is
all ``import torchrec`` needs, so HSTU runs there with replicated tables
(``--replicate-tables``), whose step calls no fbgemm operator.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Where ``./dev gpu-prepare`` puts the wheels and ``./dev gpu-suite`` looks for them
#: (relative to the repository; ignored by git, so it travels only when carried).
WHEEL_DIR = ".gpu-wheels"
#: How much may travel with one command: the working tree plus the carried wheels.
LIMIT_BYTES = 64 * 2**20
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip
#: The torch release of the CUDA machine.
TARGET_TORCH = "2.11"

#: name -> (version, why it travels), whatever the torch there.
COMMON: dict[str, tuple[str, str]] = {
    "megatron-core": ("0.16.1", "Megatron DDP and its optimizer (hstu_tasks.megatron)"),
    "tensordict": ("0.15.3", "torchrec imports it"),
    "pyvers": ("0.2.3", "tensordict imports it"),
    "nvtx": ("0.2.17", "the engine's NVTX ranges (optional, but the GPU is where they matter)"),
    "pytest": ("9.2.0", "the project's pin: pytest-asyncio 1.5 needs pytest >= 8.4"),
    "pytest-asyncio": ("1.5.0", "the async tests and pyproject's asyncio_mode"),
    "pytest-timeout": ("2.4.0", "pyproject's per-test timeout"),
}
#: torch release -> {name: (version, why)}: the fbgemm CPU build made for that torch
#: (another one fails to load its libraries) and the torchrec made for that fbgemm.
FOR_TORCH: dict[str, dict[str, tuple[str, str]]] = {
    "2.11": {
        "fbgemm-gpu-cpu": ("1.6.0", "import torchrec needs fbgemm_gpu; 1.6 is the build for "
                                    "torch 2.11 (1.7 and 1.8 fail to load there)"),
        "torchrec": ("1.6.1", "the release for fbgemm 1.6 (1.8 imports modules fbgemm 1.6 lacks)"),
        "iopath": ("0.1.9", "torchrec 1.6 imports it"),
    },
    "2.13": {  # the project's own pins: what a rehearsal on the CPU stack installs
        "fbgemm-gpu-cpu": ("1.8.0", "import torchrec needs fbgemm_gpu"),
        "torchrec": ("1.8.0", "the HSTU adapter"),
    },
}  # fmt: skip
#: The project's pins (requirements/) that do not travel, and why.
STAYS: dict[str, str] = {
    "torch": "the machine's own CUDA build",
    "numpy": "installed there",
    "torchmetrics": "installed there (torchrec imports none of it for HSTU)",
    "tqdm": "installed there",
    "pyre-extensions": "installed there",
    "typing-inspect": "installed there",
    "typing-extensions": "installed there",
    "uvloop": "installed there",
    "setuptools": "installed there (the editable install builds with it)",
    "hypothesis": "installed there (the GPU tests use none of it)",
    "anyio": "installed there",
    "aiohttp": "installed there",
    "mypy": "type checking is done here, not there",
    "trio": "only the anyio tests use it, and they need no GPU",
    "pytest-randomly": "the GPU tests run in file order",
    "pytest-repeat": "only ./dev test --stress uses it",
}


def travelling(torch: str = TARGET_TORCH) -> dict[str, tuple[str, str]]:
    """name -> (version, why) of every wheel that travels to a machine with ``torch``."""
    if torch not in FOR_TORCH:
        raise ValueError(f"no wheel set for torch {torch}; known: {', '.join(FOR_TORCH)}")
    return {**COMMON, **FOR_TORCH[torch]}


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_pins() -> dict[str, str]:
    """name -> version of every ``name==version`` line of ``requirements/*.txt``."""
    pins = {}
    for path in sorted((ROOT / "requirements").glob("*.txt")):
        for line in path.read_text().splitlines():
            found = re.match(r"^\s*([A-Za-z0-9_.-]+)==(\S+)", line)
            if found:
                pins[canonical(found[1])] = found[2]
    return pins
