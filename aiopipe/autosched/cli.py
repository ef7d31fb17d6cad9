"""``aiopipe plan``: the auto-scheduler on the command line.

::

    aiopipe plan TARGET [--costs costs.json | --batches N [--save-costs FILE]]
                 [--thread-map MAP] [--frozen a,b] [--no-loop] [--max-threads 4]
                 [--max-in-flight 5] [--beam-width 4] [--rounds 6]
                 [--json] [-o plan.json]

``TARGET`` is what the other subcommands take (``MODULE:FUNC`` or ``FILE.py:FUNC``,
see :func:`aiopipe.cli.load_target`).  Without ``--costs`` the schedule is profiled
on the spot: ``N`` batches on the async executor, traced, plus a calibration of the
engine's overheads.  The report is a table (per task: cost, lane, stream, lookahead
and fire position, baseline -> pick) followed by one JSON line; ``--json`` prints
only the JSON.  Exit status: 0 on success, 1 when the search finds no legal
candidate or the schedule breaks a rule (or a profiled task fails), 2 for
command-line errors (``--batches`` below 4, a bound below 1), loading and cost-file
errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

from .._target import Target, TargetError, check_writable, load_target, parse_thread_map
from ..errors import ScheduleValidationError
from ..lanes import ThreadMap
from ..runner import run
from .calibrate import calibrate_engine
from .costs import CostModel, EngineCosts
from .errors import AutoschedError, CostModelError
from .profiler import profile_schedule
from .search import SearchResult, joint_search

__all__ = ("add_arguments", "format_plan", "main", "report")


#: The fewest batches a profile can measure (its first iterations are warm-up).
MIN_BATCHES = 4


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number ``>= minimum``, else a usage error (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``aiopipe plan``."""
    parser.add_argument("target", metavar="TARGET", help="MODULE:FUNC or FILE.py:FUNC")
    source = parser.add_argument_group("costs")
    source.add_argument("--costs", metavar="FILE",
                        help="a cost model JSON (default: profile now)")  # fmt: skip
    source.add_argument("--batches", type=_at_least(MIN_BATCHES), default=40, metavar="N",
                        help=f"batches to profile without --costs, at least {MIN_BATCHES} "
                             f"(default 40)")  # fmt: skip
    source.add_argument("--save-costs", metavar="FILE",
                        help="write the profiled cost model here")  # fmt: skip
    source.add_argument("--no-calibrate", action="store_true",
                        help="use default engine overheads instead of measuring them")  # fmt: skip
    search = parser.add_argument_group("search")
    search.add_argument("--thread-map", metavar="MAP",
                        help="the baseline lanes: by_stream, per_task, a JSON object or "
                             "task=lane,... (default: the target's)")  # fmt: skip
    search.add_argument("--frozen", default="", metavar="TASKS",
                        help="tasks whose stream and lookahead must not change: a,b,c")  # fmt: skip
    search.add_argument("--no-loop", action="store_true",
                        help="never move a task onto the event loop's thread (keep it free "
                             "for async sources and serving)")  # fmt: skip
    search.add_argument("--max-threads", type=_at_least(1), default=4, metavar="N",
                        help="lane threads a candidate may use, >= 1 (default 4)")  # fmt: skip
    search.add_argument("--max-in-flight", type=_at_least(1), default=5, metavar="N",
                        help="batches in flight, max lookahead + 1, a candidate may keep, "
                             ">= 1 (default 5)")  # fmt: skip
    search.add_argument("--beam-width", type=_at_least(1), default=4, metavar="N",
                        help="candidates kept from one round to the next, >= 1 "
                             "(default 4)")  # fmt: skip
    search.add_argument("--rounds", type=_at_least(1), default=6, metavar="N",
                        help="search rounds at most, >= 1; it stops earlier after two rounds "
                             "without a gain (default 6)")  # fmt: skip
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print only the JSON report")
    output.add_argument("-o", "--output", metavar="FILE", help="also write the JSON report here")


def _costs(args: argparse.Namespace, target: Target, thread_map: ThreadMap) -> CostModel:
    if args.costs:
        return CostModel.load(args.costs)
    target.refuse_run("profile it (plan it from --costs of a traced run instead)")
    if args.batches < MIN_BATCHES:  # argparse refuses it; a Namespace built by hand may not
        raise AutoschedError(f"--batches must be >= {MIN_BATCHES} to profile, got {args.batches}")

    async def measure() -> CostModel:
        engine = EngineCosts() if args.no_calibrate else await calibrate_engine()
        batches = target.batches if target.batches is not None else range(args.batches)
        return await profile_schedule(
            target.schedule, thread_map=thread_map, stream_pool=target.stream_pool,
            source=batches, batches=args.batches, engine=engine, meta={"target": target.spec},
        )  # fmt: skip

    model: CostModel = run(measure())
    if args.save_costs:
        model.save(args.save_costs)
    return model


def report(result: SearchResult, costs: CostModel) -> dict[str, Any]:
    """The JSON report: baseline and pick, with the cost summary."""
    return {
        **result.to_dict(),
        "engine": {k: getattr(costs.engine, k) for k in ("progress_ms", "task_ms", "handoff_ms")},
        "task_host_ms": {name: cost.host_ms for name, cost in costs.tasks.items()},
        "task_await_ms": {name: cost.await_ms for name, cost in costs.tasks.items()
                          if cost.await_ms},  # fmt: skip
    }


def _lane_threads(count: int) -> str:
    return f"{count} lane thread{'' if count == 1 else 's'}"


def format_plan(result: SearchResult, costs: CostModel) -> str:
    """The readable table of a search result: per task, baseline -> pick."""
    base, best = result.baseline, result.best
    base_lane, best_lane = dict(base.thread_map), dict(best.thread_map)
    base_stream, best_stream = dict(base.streams), dict(best.streams)
    base_la, best_la = dict(base.lookaheads), dict(best.lookaheads)
    position = {name: k for k, name in enumerate(best.fire_order)}

    def change(before: Any, after: Any) -> str:
        return str(after) if before == after else f"{before} -> {after}"

    rows = [["task", "host ms", "lane", "stream", "lookahead", "fires"]]
    for name in best.fire_order:
        cost = costs.of(name)
        rows.append([
            name, f"{cost.host_ms:.3f}"
            + (f" (+{cost.await_ms:.3f} await)" if cost.await_ms else "")
            + (f" (+{cost.gpu_ms:.3f} dev)" if cost.gpu_ms else ""),
            change(base_lane[name], best_lane[name]), change(base_stream[name], best_stream[name]),
            change(base_la[name], best_la[name]), str(position[name] + 1),
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [
        "",
        f"baseline  {base.score:9.3f} ms per progress  ({_lane_threads(base.threads)})",
        f"pick      {best.score:9.3f} ms per progress  ({_lane_threads(best.threads)})  "
        f"predicted gain {result.predicted_gain:.1%}",
        f"searched  {result.evaluated} candidates in {result.rounds} rounds; pick made by: "
        f"{best.note}",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run ``aiopipe plan``; return the exit status."""
    try:
        target = load_target(args.target)
    except (TargetError, OSError) as exc:
        print(f"aiopipe plan: {exc}", file=sys.stderr)
        return 2
    try:
        return _plan(args, target)
    finally:
        target.shutdown()


def _plan(args: argparse.Namespace, target: Target) -> int:
    try:
        thread_map = parse_thread_map(args.thread_map) if args.thread_map else target.thread_map
        if args.output:
            check_writable(args.output)  # before the profile and the search
        costs = _costs(args, target, thread_map)
        frozen = [name.strip() for name in args.frozen.split(",") if name.strip()]
    except (TargetError, CostModelError, OSError) as exc:
        print(f"aiopipe plan: {exc}", file=sys.stderr)
        return 2
    except (AutoschedError, ScheduleValidationError) as exc:  # the schedule, not a task
        print(f"aiopipe plan: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a task failed while the profile ran it
        print(f"aiopipe plan: a task failed while profiling: {type(exc).__name__}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        result = joint_search(
            target.schedule, costs, thread_map=thread_map, frozen=frozen,
            max_threads=args.max_threads, max_in_flight=args.max_in_flight,
            beam_width=args.beam_width, rounds=args.rounds, allow_loop=not args.no_loop,
        )  # fmt: skip
    except CostModelError as exc:
        print(f"aiopipe plan: {exc}", file=sys.stderr)
        return 2
    except (AutoschedError, ScheduleValidationError) as exc:
        print(f"aiopipe plan: {exc}", file=sys.stderr)
        return 1
    payload = report(result, costs)
    if args.output:
        Path(args.output).write_text(json.dumps(payload, indent=2) + "\n")
    if not args.json:
        print(format_plan(result, costs))
        print()
    print(json.dumps(payload, sort_keys=True))
    return 0

