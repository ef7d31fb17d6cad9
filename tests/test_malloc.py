"""Freed host memory stays in the process once a pipeline runs lanes (aiopipe/_core/malloc.py).

Each case runs in a fresh interpreter: the malloc settings are process-wide and
applied once, so a case in this process would see what earlier tests left.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="glibc's malloc on Linux only",
)

# 200 blocks of 1 MiB, every page written, freed together: three times after a first.
FAULTS_PER_CYCLE = """
import resource, torch
from aiopipe._core.malloc import keep_freed_memory
applied = keep_freed_memory()
def cycle():
    blocks = [torch.ones(1 << 18) for _ in range(200)]
    del blocks
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    cycle()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

APPLIED_BY_A_PIPELINE = """
import asyncio
from aiopipe import Pipeline, Task
from aiopipe._core import malloc as _malloc
tasks = [Task.from_fn("train", lambda ctx: ctx.slots.set("step_result", ctx.slots["batch_cpu"]))]
async def main():
    async with Pipeline(tasks, {EXECUTOR}) as pipe:
        assert [r async for r in pipe.results([1, 2])] == [1, 2]
asyncio.run(main())
print(_malloc._applied)
"""


def run_python(code: str, **env: str) -> str:
    ours = ("MALLOC_", "GLIBC_TUNABLES", "AIOPIPE_KEEP_FREED_MEMORY")  # only what a case sets
    environment = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    done = subprocess.run([sys.executable, "-c", code], env={**environment, **env},
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    return done.stdout.strip()


def test_freed_memory_is_reused_instead_of_faulted_in_again() -> None:
    applied, faults = run_python(FAULTS_PER_CYCLE).split()
    assert applied == "True"
    assert int(faults) < 2_000  # a few pages of bookkeeping, not 600 MiB of tensors
    applied, faults = run_python(FAULTS_PER_CYCLE, AIOPIPE_KEEP_FREED_MEMORY="0").split()
    assert applied == "False"
    # glibc's own thresholds serve the first round with mmap, so the next one takes
    # fresh heap pages (51 200 faults) at least; later rounds fault again where it trims.
    assert int(faults) > 40_000


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "1000000"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"}])  # fmt: skip
def test_a_process_that_chose_its_own_malloc_settings_is_left_alone(env: dict[str, str]) -> None:
    assert run_python(FAULTS_PER_CYCLE, **env).split()[0] == "False"


@pytest.mark.parametrize(("executor", "applied"), [
    ("thread_map=lambda task: 'compute'", "True"),  # a lane thread: applied
    ("executor='sequential'", "None"),  # everything inline: not decided, not applied
])  # fmt: skip
def test_the_first_pipeline_with_a_lane_thread_applies_it(executor: str, applied: str) -> None:
    assert run_python(APPLIED_BY_A_PIPELINE.replace("{EXECUTOR}", executor)) == applied
