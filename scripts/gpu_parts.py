"""The parts of the GPU suite: what each runs and which figures it reads from the
output.  ``gpu_suite.py`` runs them in order, each within its own time budget.

Every part is a list of commands (run in the repository root with the suite's
interpreter) and a reader that turns their output -- the ``JSON`` line a benchmark
prints, the test report -- into figures, each with the target it is held to.
"""

from __future__ import annotations

import json
import statistics
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Figure:
    """One measured figure, as the report prints it."""

    name: str
    value: str
    target: str = ""
    met: bool | None = None  # None: no target, or nothing to hold it to


@dataclass
class Reading:
    """What a part's output says: its figures, raw facts for the JSON report, and
    why it skipped, when everything it ran skipped."""

    figures: list[Figure] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None


@dataclass(frozen=True)
class Context:
    python: str  # the suite's interpreter: the environment it installed into
    root: Path  # the repository
    work: Path  # a scratch folder for files the parts pass on (not part of the report)
    wheels: Path  # the prepared wheels


@dataclass(frozen=True)
class Step:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


class NotReady(Exception):
    """A part cannot start: what it needs is missing (the message says what to do)."""


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    budget_s: float  # at most this long; the suite's deadline may cut it shorter
    needs_cuda: bool
    steps: Callable[[Context], list[Step]]
    read: Callable[[list[str], Context], Reading]


def last_json(output: str) -> Any:
    """What the last ``JSON ...`` line of a program's output holds."""
    lines = [line[5:] for line in output.splitlines() if line.startswith("JSON ")]
    if not lines:
        raise ValueError("the output has no JSON line")
    return json.loads(lines[-1])


def at_least(name: str, value: float, target: float, unit: str = "x") -> Figure:
    return Figure(name, f"{value:.3f}{unit}", f">= {target:g}{unit}", value >= target)


#### install ############################################################################


def install_steps(ctx: Context) -> list[Step]:
    wheels = sorted(str(path) for path in ctx.wheels.glob("*.whl"))
    if not wheels:
        raise NotReady(f"no wheels in {ctx.wheels}: run ./dev gpu-prepare where a package "
                       "index is reachable, and carry the folder along")  # fmt: skip
    # --ignore-installed: into this environment even where the one below has the same
    # version, so what runs is what travelled.
    pip = [ctx.python, "-m", "pip", "install", "--disable-pip-version-check", "-q",
           "--no-index", "--no-deps", "--no-cache-dir", "--ignore-installed"]  # fmt: skip
    return [Step([*pip, *wheels]), Step([*pip, "--no-build-isolation", "-e", str(ctx.root)])]


def read_install(outputs: list[str], ctx: Context) -> Reading:
    return Reading(facts={"wheels": sorted(path.name for path in ctx.wheels.glob("*.whl"))})


#### environment ########################################################################


def read_environment(outputs: list[str], ctx: Context) -> Reading:
    return Reading(facts=last_json(outputs[0]))


#### tests that need CUDA ###############################################################

GPU_MARKER = "pytest.mark.cuda"
JUNIT = "gpu_tests.xml"
# Tests whose outcome is itself one of the figures.
TEST_FIGURES = {
    "test_megatron_ddp_on_gpu_trains_like_torch_ddp":
        "Megatron DDP + finalize_model_grads + Megatron's optimizer vs torch DDP "
        "(losses and parameters, rtol 1e-4, atol 1e-6)",
}  # fmt: skip


def gpu_test_files(root: Path) -> list[str]:
    """The test files holding tests marked ``cuda`` (skipped without a CUDA device)."""
    return sorted(str(path.relative_to(root)) for path in (root / "tests").glob("test_*.py")
                  if GPU_MARKER in path.read_text())  # fmt: skip


def test_steps(ctx: Context) -> list[Step]:
    # Only the project's plugins: an image's own pytest plugins stay out of the run.  A
    # file that cannot be imported (torchrec missing, say) is reported; the rest run.
    argv = [ctx.python, "-m", "pytest", "-m", "cuda", "-p", "pytest_asyncio.plugin",
            "-p", "pytest_timeout", "-p", "no:cacheprovider", "-q", "-rs",
            "--continue-on-collection-errors",
            f"--junitxml={ctx.work / JUNIT}", *gpu_test_files(ctx.root)]  # fmt: skip
    return [Step(argv, {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})]


def read_tests(outputs: list[str], ctx: Context) -> Reading:
    outcomes: dict[str, str] = {}
    reasons = set()
    for case in ElementTree.parse(ctx.work / JUNIT).iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                if child.tag == "skipped":
                    reasons.add(child.get("message", "").removeprefix("Skipped: "))
        outcomes[test] = outcome
    counts = {kind: sum(o == kind for o in outcomes.values())
              for kind in ("passed", "failed", "error", "skipped")}  # fmt: skip
    ran = counts["passed"] + counts["failed"] + counts["error"] > 0
    summary = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n) or "none collected"
    figures = [Figure("tests marked cuda", summary, "all pass",
                      not counts["failed"] + counts["error"] if ran else None)]  # fmt: skip
    for name, title in TEST_FIGURES.items():
        found = [o for test, o in outcomes.items() if test.split("::")[-1].startswith(name)]
        if found:
            met = all(o == "passed" for o in found) if "skipped" not in found else None
            figures.append(Figure(title, ", ".join(found), "passed", met))
    everything_skipped = counts["skipped"] == len(outcomes) > 0
    return Reading(figures, {"outcomes": outcomes},
                   "; ".join(sorted(reasons)) if everything_skipped else None)


#### benchmarks #########################################################################


def bench(ctx: Context, name: str, *args: str) -> Step:
    return Step([ctx.python, str(ctx.root / "benchmarks" / f"{name}.py"), *args])


# The last rows: the io/compute lanes, the default until the first GPU runs, and 20
# steps asked for a call (progress_many: the lanes chain them).
HSTU_ROWS = ("none", "aiopipe", "aiopipe-prefetch", "aiopipe, io/compute lanes",
             "aiopipe, 20 steps a call", "none, on a thread")  # fmt: skip
# The default row with torch.cuda.stream(s) around each body, as before the engine's own
# switch: paired by round with the default row.
BEFORE_ROW = "aiopipe, torch.cuda.stream a task"


def hstu_steps(ctx: Context) -> list[Step]:
    return [bench(ctx, "hstu_steps", "--ranks", "1", "--replicate-tables", "--steps", "200",
                  "--repeats", "5", "--engine-time",
                  "--configs", *HSTU_ROWS, BEFORE_ROW)]  # fmt: skip


def read_hstu(outputs: list[str], ctx: Context) -> Reading:
    result = last_json(outputs[0])
    rates = result["steps_per_s"]
    figures = [Figure(f"HSTU steps/s, {name}", f"{rates[name]:.1f}") for name in HSTU_ROWS]
    figures += [at_least(f"HSTU {name} x the plain loop", rates[name] / rates["none"], 1.0)
                for name in HSTU_ROWS[1:3]]  # fmt: skip
    figures.append(Figure(f"HSTU {HSTU_ROWS[3]} x the plain loop",
                          f"{rates[HSTU_ROWS[3]] / rates['none']:.3f}x"))
    figures.append(at_least(f"HSTU {HSTU_ROWS[4]} x the plain loop",
                            rates[HSTU_ROWS[4]] / rates["none"], 1.0))
    # What a lane's thread costs before any engine: the plain loop off the main thread.
    figures.append(Figure(f"HSTU {HSTU_ROWS[5]} x the plain loop",
                          f"{rates[HSTU_ROWS[5]] / rates['none']:.3f}x"))
    pairs = zip(result["samples"]["aiopipe"], result["samples"][BEFORE_ROW])
    figures.append(Figure(f"HSTU aiopipe x {BEFORE_ROW} (paired by round)",
                          f"{statistics.median(a / b for a, b in pairs):.3f}x"))
    # The default row's share: the benchmark's own "worst row" may be a row kept only
    # for comparison (the torch.cuda.stream one).
    share, host, step = result["engine_host"]["aiopipe"]
    figures.append(Figure("engine host time per step, aiopipe (tracer), share of the step",
                          f"{100 * share:.2f} % ({host:.3f} ms of {step:.3f} ms)",
                          "<= 2 %", share <= 0.02))  # fmt: skip
    return Reading(figures, result)


def presets_steps(ctx: Context) -> list[Step]:
    # A model whose GPU time exceeds the host's launch time (width 512), and a batch
    # whose copy is about a third of the step: the case T2 is for.  At width 256 the
    # plain loop is bound by the host's launches and no overlap can pay.
    return [bench(ctx, "presets", "--device", "cuda", "--configs", "plain", "T1", "T2", "--width",
                  "512", "--batch", "65536", "--chunk", "20", "--rounds", "8", "--processes", "1")]  # fmt: skip


def read_presets(outputs: list[str], ctx: Context) -> Reading:
    result = last_json(outputs[0])
    speed = 1 / result["results"]["T2"]["x_plain_paired"]
    share = result["copy_share"]
    return Reading([
        Figure("basic() preset: the batch's host-to-device copy, share of the plain step",
               f"{100 * share:.0f} % ({result['copy_ms']:.3f} ms)", ">= 30 %", share >= 0.3),
        at_least("basic() T2 speed x the plain loop (paired chunks)", speed, 1.3),
        Figure("basic() T1 (no copy ahead) speed x the plain loop (paired chunks)",
               f"{1 / result['results']['T1']['x_plain_paired']:.3f}x", "", None),
    ], result)  # fmt: skip


FROZEN = "forward,backward,finalize_model_grads,optimizer_step"


def plan_steps(ctx: Context) -> list[Step]:
    costs = str(ctx.work / "hstu_gpu.json")
    return [
        bench(ctx, "autosched_hstu_profile", "--ranks", "1", "--steps", "40", "--replicate-tables",
              "--gpu-timing", "--output", costs),
        Step([ctx.python, "-m", "aiopipe", "plan", f"{ctx.root / 'examples' / 'schedules.py'}:hstu",
              "--costs", costs, "--frozen", FROZEN, "--json"]),
    ]  # fmt: skip


def read_plan(outputs: list[str], ctx: Context) -> Reading:
    costs = json.loads((ctx.work / "hstu_gpu.json").read_text())["tasks"]
    device = {name: cost["gpu_ms"] for name, cost in costs.items() if cost.get("gpu_ms")}
    plan = json.loads(outputs[1].strip().splitlines()[-1])
    base, best = plan["baseline"]["latency_ms"], plan["best"]["latency_ms"]
    return Reading([
        Figure("HSTU tasks with device time (Tracer(gpu_timing=True))",
               f"{len(device)} of {len(costs)}, {sum(device.values()):.3f} ms a step", ">= 1",
               bool(device)),
        Figure("aiopipe plan from those timings: baseline -> pick (simulated)",
               f"{base:.3f} -> {best:.3f} ms, predicted gain {plan['predicted_gain']:.1%}"),
    ], {"device_ms": device, "plan": plan})  # fmt: skip


def streams_steps(ctx: Context) -> list[Step]:
    return [bench(ctx, "stream_cost", "--repeats", "5")]


def read_streams(outputs: list[str], ctx: Context) -> Reading:
    result = last_json(outputs[0])
    calls, tasks = result["us_per_call"], result["us_per_task"]
    figures = [Figure(f"{name}, us a call", f"{us:.2f}") for name, us in calls.items()]
    for label in ("lane (default)", "sequential"):
        null = tasks[f"{label}, null streams"]
        figures.append(Figure(
            f"{label}: stream and event work a no-op task, us (before: torch.cuda.stream; "
            "raw ids: a candidate switch)",
            f"{tasks[f'{label}, CUDA streams'] - null:.2f} "
            f"(before {tasks[f'{label}, CUDA streams, before'] - null:.2f}, "
            f"raw ids {tasks[f'{label}, CUDA streams, raw ids'] - null:.2f}) of {null:.2f}",
        ))  # fmt: skip
    return Reading(figures, result)


def watchdog_steps(ctx: Context) -> list[Step]:
    return [bench(ctx, "loop_latency", "--rows", "hstu", "--replicate-tables", "--steps", "60")]


def read_watchdog(outputs: list[str], ctx: Context) -> Reading:
    result = last_json(outputs[0])
    row = next(iter(result["results"].values()))
    return Reading([
        Figure("HSTU step on the GPU (batch 256), ms", f"{row['step_ms']:.2f}"),
        Figure("watchdog: losses copied, not yet checked after a step (host ahead), max / median",
               f"{row['pending_max']} / {statistics.median(row['pending']):g}"),
        Figure("event loop: 1 ms ticker's delay while GPU steps run, max / p99",
               f"{row['max_ms']:.2f} / {row['p99_ms']:.2f} ms"),
    ], result)  # fmt: skip


#### the suite ##########################################################################

PARTS = (
    Part("install", "install the wheels and the project, offline", 150, False, install_steps,
         read_install),
    Part("environment", "device, driver, torch and the packages imported", 60, False,
         lambda ctx: [Step([ctx.python, str(ctx.root / "scripts" / "gpu_probe.py")])],
         read_environment),
    Part("gpu-tests", "the tests that need CUDA (marked cuda)", 200, False, test_steps, read_tests),
    Part("streams", "the engine's stream and event work a task, and the CUDA calls in it", 90,
         True, streams_steps, read_streams),
    Part("hstu", "HSTU on one GPU, replicated tables, NCCL with one rank", 150, True, hstu_steps,
         read_hstu),
    Part("presets", "basic() T2 against the plain loop, copy-heavy batches", 100, True,
         presets_steps, read_presets),
    Part("plan", "Tracer(gpu_timing=True) profile of HSTU, then aiopipe plan", 120, True,
         plan_steps, read_plan),
    Part("watchdog", "the watchdog's host lead and the loop's latency during GPU steps", 90, True,
         watchdog_steps, read_watchdog),
)  # fmt: skip
