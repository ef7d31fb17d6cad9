"""What interrupts that leave the event loop do to the blocking form: a body raising
``KeyboardInterrupt``/``SystemExit``, Ctrl-C (real signals) and a lane body that never
returns.  Each runs in a subprocess: an interrupt must not reach the test runner."""

from __future__ import annotations

import subprocess
import sys

LEFT_THE_LOOP = """
import os, signal, sys
from aiopipe import Pipeline, Task, TaskContext

def case(error, lane):
    steps = []

    def train(ctx: TaskContext) -> None:
        batch = ctx.slots["batch_cpu"]
        steps.append(batch)
        if batch == 1 and steps.count(1) == 1:
            if error == "ctrl-c-twice":  # the first cancels the caller, the second lands here
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
            else:
                raise {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[error]()
        ctx.slots.set("step_result", batch)

    pipe = Pipeline([Task.from_fn("train", train, writes=("step_result",))],
                    thread_map={"train": lane}).blocking()
    source = iter(range(5))
    assert pipe.progress(source) == 0
    try:
        pipe.progress(source)
    except (KeyboardInterrupt, SystemExit) as exc:
        print(error, lane, "interrupted by", type(exc).__name__)
    pipe.reset()  # no call of the interrupted one is left to run on
    print(error, lane, "results", list(pipe.results(iter(range(3)))), "steps", steps)
    pipe.shutdown()

for error, lane in [("KeyboardInterrupt", "compute"), ("KeyboardInterrupt", "loop"),
                    ("SystemExit", "compute"), ("SystemExit", "loop"),
                    ("ctrl-c-twice", "loop")]:
    case(error, lane)
"""


def test_an_interrupt_that_left_the_loop_leaves_no_call_behind() -> None:
    out = subprocess.run(
        [sys.executable, "-c", LEFT_THE_LOOP], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for error, lane in [("KeyboardInterrupt", "compute"), ("KeyboardInterrupt", "loop"),
                        ("SystemExit", "compute"), ("SystemExit", "loop"),
                        ("ctrl-c-twice", "loop")]:  # fmt: skip
        raised = "SystemExit" if error == "SystemExit" else "KeyboardInterrupt"
        assert f"{error} {lane} interrupted by {raised}" in lines
        # batch 1's step is not run again by a call left behind
        assert f"{error} {lane} results [0, 1, 2] steps [0, 1, 0, 1, 2]" in lines
    assert "never retrieved" not in out.stderr
