"""``./dev gpu-prepare``: get ready for a run of the GPU suite on a CUDA machine.

Download the wheels that travel to the CUDA machine, check that they and the
working tree fit in what one command may take along, and print the command to run
there and the paths to carry with it.

    ./dev gpu-prepare [--torch 2.11] [--dest .gpu-wheels]

``--torch`` picks the wheel set (scripts/gpu_travel.py): the CUDA machine's torch and
Python by default; ``--torch local`` the set for this environment's torch and Python,
which is what a rehearsal on this machine installs (``./dev gpu-suite --rehearse``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import gpu_travel
from gpu_travel import ROOT, canonical

# Warnings of a pip configuration that lists index folders which are absent.
PIP_NOISE = re.compile(r"is ignored: it is neither a file nor a directory")


def local_torch() -> str:
    """``major.minor`` of the torch this interpreter imports."""
    import torch

    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def wheel_name(path: Path) -> tuple[str, str]:
    """(canonical name, version) of a wheel file."""
    name, version = path.name.split("-")[:2]
    return canonical(name), version


def download(wanted: dict[str, str], dest: Path, python: str) -> list[Path]:
    """Fetch ``name==version`` of each wanted wheel into ``dest`` with pip (files
    already there are kept), after removing every other wheel from it: two versions
    of one package would stop the install there.  Returns the wheels."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in dest.glob("*.whl"):
        name, version = wheel_name(path)
        if wanted.get(name) != version:
            path.unlink()
    platforms = [arg for platform in gpu_travel.PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
               "--no-deps", "--only-binary=:all:", "--python-version", python,
               "--implementation", "cp", "--abi", f"cp{python.replace('.', '')}", *platforms,
               "-d", str(dest),
               *(f"{name}=={version}" for name, version in sorted(wanted.items()))]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        noise = "\n".join(line for line in done.stderr.splitlines() if not PIP_NOISE.search(line))
        raise SystemExit(f"gpu-prepare: pip download failed:\n{noise}")
    wheels = sorted(dest.glob("*.whl"))
    missing = set(wanted) - {wheel_name(path)[0] for path in wheels}
    if missing:
        raise SystemExit(f"gpu-prepare: pip left out {sorted(missing)}")
    return wheels


def tree_bytes() -> int:
    """The size of what travels without being carried: the files git tracks and the
    untracked ones it does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout  # fmt: skip
    paths = {ROOT / name for name in listed.decode().split("\0") if name}
    return sum(path.stat().st_size for path in paths if path.is_file() and not path.is_symlink())


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"


def instructions(carry: str) -> str:
    """What to run on the CUDA machine, and what to carry along."""
    return (f"\nOn the CUDA machine, in the repository root, run:\n\n    ./dev gpu-suite\n\n"
            f"with these paths carried along (git ignores them):\n\n    {carry}\n\n"
            "It writes $OUT/gpu_report.md, $OUT/gpu_report.json and $OUT/gpu_suite.log "
            "(without OUT: the folder gpu-report).")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", default=gpu_travel.TARGET_TORCH,
                        help=f"the wheel set: {', '.join(gpu_travel.FOR_TORCH)} or 'local' "
                             f"(default {gpu_travel.TARGET_TORCH}, the CUDA machine's)")  # fmt: skip
    parser.add_argument("--dest", type=Path, default=ROOT / gpu_travel.WHEEL_DIR,
                        help=f"where the wheels go (default {gpu_travel.WHEEL_DIR})")  # fmt: skip
    args = parser.parse_args()
    torch, python = args.torch, gpu_travel.PYTHON
    if args.torch == "local":
        torch, python = local_torch(), "{}.{}".format(*sys.version_info)
    try:
        wanted = {canonical(name): version
                  for name, (version, _) in gpu_travel.travelling(torch).items()}  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    dest = args.dest.resolve()
    wheels = download(wanted, dest, python)
    wheel_bytes = sum(path.stat().st_size for path in wheels)
    tree = tree_bytes()
    total = tree + wheel_bytes
    print(f"{len(wheels)} wheels for torch {torch}, Python {python} in {dest}: "
          f"{mib(wheel_bytes)}")  # fmt: skip
    for path in wheels:
        print(f"  {path.name}  {mib(path.stat().st_size)}")
    print(f"what travels: the working tree {mib(tree)} + the wheels {mib(wheel_bytes)} = "
          f"{mib(total)} of {mib(gpu_travel.LIMIT_BYTES)}")  # fmt: skip
    if total > gpu_travel.LIMIT_BYTES:
        raise SystemExit("gpu-prepare: that is over the limit: drop wheels or files")
    try:
        carry = dest.relative_to(ROOT).as_posix()
    except ValueError:
        print(f"{dest} is outside the repository: it cannot travel; a rehearsal here reads it "
              f"with AIOPIPE_GPU_WHEELS={dest} ./dev gpu-suite --rehearse")  # fmt: skip
        return
    print(instructions(carry))

if __name__ == "__main__":
    main()
