"""The ``aiopipe`` command line: check, draw, trace and plan a schedule.

::

    aiopipe validate TARGET [--thread-map MAP] [--json]
    aiopipe graph    TARGET [--format dot|mermaid|svg|png|pdf] [-o FILE] [--thread-map MAP]
                     [--group-by lane|stream|none] [--title TEXT]
    aiopipe trace    TARGET [--progresses 20] -o trace.json [--executor async|sequential]
                     [--thread-map MAP] [--svg timeline.svg]
    aiopipe plan     ...    (the auto-scheduler: aiopipe.autosched)

``TARGET`` is ``MODULE:FUNC`` or ``FILE.py:FUNC``: a function (or attribute) giving
a ``Schedule``, a list of ``Task``, a ``SchedulablePipeline``, or a pair ``(one of
those, batches)``; :func:`load_target`, shared by every subcommand, states the
contract in full.

Exit status: 0 on success, 1 when the schedule breaks a rule or a task fails, 2 for
a command-line or loading error.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import itertools
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from . import __version__, diagram
from ._target import Target, TargetError, check_writable, load_target, parse_thread_map
from .errors import PipelineError, ScheduleValidationError
from .executors import resolve_executor
from .lanes import ThreadMap, resolve_lane
from .edges import dependency_edges, infer_cross_stream_event_deps, topological_sort
from .pipeline import SchedulablePipeline
from .runner import run
from .timeline import write_timeline
from .trace import Tracer
from .validate import serialized_awaits, validate_schedule

__all__ = ("Target", "TargetError", "load_target", "main", "parse_thread_map")


def _thread_map(args: argparse.Namespace, target: Target) -> ThreadMap:
    if not args.thread_map:
        return target.thread_map
    thread_map = parse_thread_map(args.thread_map)
    names = [task.name for task in target.schedule.tasks]
    mapped = thread_map if isinstance(thread_map, dict) else {}
    unknown = [name for name in mapped if name not in names]
    if unknown:  # a misspelt --thread-map: a command-line error
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TargetError(f"--thread-map names task(s) {unknown} that {target.spec} does not "
                          f"have{hint}; its tasks are {names}")  # fmt: skip
    return thread_map


# -- validate -----------------------------------------------------------------------------


def _report(target: Target, thread_map: ThreadMap) -> dict[str, Any]:
    """Everything the validator and the graph analysis say, as plain data."""
    schedule = target.schedule
    report: dict[str, Any] = {"target": target.spec, "ok": True, "violation": None}
    try:
        validate_schedule(schedule, target.stream_pool)
        order = topological_sort(schedule)
        edges, waits = dependency_edges(schedule), infer_cross_stream_event_deps(schedule)
    except ScheduleValidationError as exc:
        message = str(exc).removeprefix(f"[rule {exc.rule}] ")
        report.update(ok=False, violation={"rule": exc.rule, "message": message})
        order, edges, waits = schedule.tasks, [], {}
    report["order"] = "topological" if report["ok"] else "declared"
    report["tasks"] = [
        {"name": t.name, "lookahead": t.lookahead, "stream": t.stream,
         "lane": resolve_lane(t, thread_map), "nccl": t.nccl, "async": t.is_async}
        for t in order
    ]  # fmt: skip
    report["edges"] = [
        {"producer": e.producer, "consumer": e.consumer, "kind": e.kind, "delta": e.delta,
         "slot_offset": e.slot_offset, "slot": e.slot}
        for e in edges
    ]  # fmt: skip
    report["event_waits"] = {c: [list(w) for w in ws] for c, ws in waits.items()}
    report["streams"] = list(schedule.stream_slots)
    lanes: dict[str, int] = {}
    for row in report["tasks"]:
        lanes[row["lane"]] = lanes.get(row["lane"], 0) + 1
    report["lanes"] = lanes
    report["max_lookahead"] = schedule.max_lookahead
    report["advice"] = serialized_awaits(schedule)
    return report


def _print_report(report: dict[str, Any]) -> None:
    tasks = report["tasks"]
    width = max([len(t["name"]) for t in tasks] + [4])
    print(f"schedule {report['target']}: {len(tasks)} tasks, max lookahead "
          f"{report['max_lookahead']}, streams {', '.join(report['streams'])}")  # fmt: skip
    print(f"\ntasks ({report['order']} order):")
    print(f"  {'#':>3}  {'task':<{width}}  la  {'stream':<10}  {'lane':<10}  flags")
    for i, t in enumerate(tasks, 1):
        flags = " ".join(f for f in ("nccl", "async") if t[f])
        print(f"  {i:>3}  {t['name']:<{width}}  {t['lookahead']:>2}  {t['stream']:<10}  "
              f"{t['lane']:<10}  {flags}".rstrip())  # fmt: skip
    if report["edges"]:
        print(f"\nedges ({len(report['edges'])}):")
        for e in report["edges"]:
            what = f"slot {e['slot']}" if e["kind"] == "slot" else e["kind"]
            print(f"  {e['producer']} -> {e['consumer']}: {what}, Δ={e['delta']}, "
                  f"slot offset {e['slot_offset']}")  # fmt: skip
    if report["event_waits"]:
        print("\ncross-stream event waits:")
        for consumer, waits in report["event_waits"].items():
            for producer, stream, offset in waits:
                print(f"  {consumer} waits for {producer} (stream {stream}) "
                      f"at ring offset {offset}")  # fmt: skip
    lanes = ", ".join(f"{lane} ({n})" for lane, n in report["lanes"].items())
    print(f"\nlanes: {lanes}")
    for advice in report["advice"]:
        print(f"\nadvice: {advice}")
    violation = report["violation"]
    if violation is None:
        print("\nOK: the schedule satisfies rules 1-8")
    else:
        print(f"\nFAILED rule {violation['rule']}: {violation['message']}")


def _cmd_validate(args: argparse.Namespace, target: Target, tracer: Tracer | None) -> int:
    report = _report(target, _thread_map(args, target))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_report(report)
    return 0 if report["ok"] else 1


# -- graph --------------------------------------------------------------------------------


def _cmd_graph(args: argparse.Namespace, target: Target, tracer: Tracer | None) -> int:
    thread_map = _thread_map(args, target)
    try:
        fmt = args.format or (diagram.format_for(args.output) if args.output else "dot")
    except diagram.RenderError as exc:  # an unknown -o suffix is a command-line error
        raise TargetError(str(exc)) from None
    options: dict[str, Any] = {"group_by": args.group_by, "title": args.title or args.target}
    if fmt == "dot":
        data: str | bytes = diagram.to_dot(target.schedule, thread_map, **options)
    elif fmt == "mermaid":
        data = diagram.to_mermaid(target.schedule, thread_map, **options)
    else:
        data = diagram.render(target.schedule, fmt, thread_map, **options)
    if args.output:
        path = Path(args.output)
        check_writable(path)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)
        print(f"wrote {path} ({fmt}, {len(target.schedule.tasks)} tasks)", file=sys.stderr)
    elif isinstance(data, bytes):
        if sys.stdout.isatty():
            raise TargetError(f"refusing to write {fmt} bytes to a terminal; pass -o FILE")
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        sys.stdout.write(data)
    return 0


# -- trace --------------------------------------------------------------------------------


def _trace_pipeline(
    args: argparse.Namespace, target: Target, tracer: Tracer
) -> tuple[SchedulablePipeline, Tracer]:
    """The pipeline to run and its tracer: the target's own pipeline (which must
    trace), or a new one for a schedule."""
    target.refuse_run("trace it")
    if target.pipeline is not None:
        if args.executor or args.thread_map:
            raise TargetError(f"{target.spec} gave a pipeline, which brings its own executor; "
                              f"drop --executor/--thread-map")  # fmt: skip
        own = target.pipeline.tracer
        if own is None:
            raise TargetError(
                f"{target.spec} gave a pipeline built without tracing. Build it with "
                f"trace=True, or give the function a `trace` parameter and pass it on "
                f"(Pipeline(..., trace=trace)), or return its schedule instead."
            )
        return target.pipeline, own
    if args.executor == "sequential" and args.thread_map:
        raise TargetError("--thread-map configures the async executor; drop one of them")
    sequential = args.executor == "sequential"
    executor = resolve_executor(args.executor, None if sequential else _thread_map(args, target))
    # Traced for its timings: the results are not looked at.
    pipe = SchedulablePipeline(target.schedule, None, executor, trace=tracer, expect_result=False)
    return pipe, tracer


class _Batches:
    """The first ``count`` batches, remembering what their source raised: a source
    that fails is not a task that fails."""

    def __init__(self, batches: Iterable[Any], count: int) -> None:
        self._batches, self._count = batches, count
        self._iterator: Iterator[Any] | None = None
        self.error: BaseException | None = None

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> Any:
        try:
            if self._iterator is None:
                self._iterator = itertools.islice(self._batches, self._count)
            return next(self._iterator)
        except StopIteration:
            raise
        except Exception as exc:
            self.error = exc
            raise

    def raised(self, exc: BaseException) -> bool:
        """Whether ``exc`` is (or was raised from) what the source raised."""
        chain: list[BaseException] = []
        seen: BaseException | None = exc
        while seen is not None and not any(seen is link for link in chain):  # no cycles
            if seen is self.error:
                return True
            chain.append(seen)
            seen = seen.__cause__ or seen.__context__
        return False


async def _run_progresses(pipe: SchedulablePipeline, source: _Batches, count: int) -> int:
    done = 0
    async with pipe:
        while done < count:
            try:
                await pipe.progress(source)
            except StopAsyncIteration:
                break
            done += 1
    return done


def _cmd_trace(args: argparse.Namespace, target: Target, tracer: Tracer | None) -> int:
    for output in (args.output, args.svg):
        if output:
            check_writable(output)  # now, not after the run
    pipe, tracer = _trace_pipeline(args, target, tracer or Tracer())
    batches = target.batches if target.batches is not None else itertools.count()
    source = _Batches(batches, args.progresses)
    status = 0
    try:
        done = run(_run_progresses(pipe, source, args.progresses))
    except Exception as exc:
        what = "the batch source raised" if source.raised(exc) else "a task failed"
        print(f"aiopipe trace: {what}: {type(exc).__name__}: {exc}", file=sys.stderr)
        status, done = 1, -1
    path = tracer.save(args.output)
    spans = tracer.spans
    lanes = sorted({span.lane for span in spans})
    ran = f"{done} progress(es)" if done >= 0 else "a failed run"
    print(f"wrote {path}: {ran}, {len(spans)} task runs on lanes {', '.join(lanes) or '-'}")
    if 0 <= done < args.progresses:
        print(f"note: the batches ran out after {done} of {args.progresses} progresses")
    if args.svg and spans:
        last = max(span.iteration for span in spans)
        shown = (max(last - 2, 0), last)
        write_timeline(spans, args.svg, iterations=shown,
                       title=f"{target.spec}, iterations {shown[0]}-{shown[1]}")  # fmt: skip
        print(f"drew iterations {shown[0]}-{shown[1]} in {args.svg}")
    rows = tracer.summary()
    width = max([len(row["task"]) for row in rows] + [4])
    print(f"  {'task':<{width}}  runs  mean ms  total ms  wait ms")
    for row in rows:
        print(f"  {row['task']:<{width}}  {row['runs']:>4}  {row['mean_ms']:>7.3f}  "
              f"{row['mean_ms'] * row['runs']:>8.3f}  {row['mean_wait_ms']:>7.3f}")  # fmt: skip
    return status


# -- plan (aiopipe.autosched) -------------------------------------------------------------


def _cmd_plan(argv: Sequence[str]) -> int:
    try:
        # Imported by name and only here: the CLI works without the auto-scheduler.
        autosched_cli = importlib.import_module("aiopipe.autosched.cli")
    except ModuleNotFoundError as exc:
        if exc.name not in ("aiopipe.autosched", "aiopipe.autosched.cli"):
            raise
        print("aiopipe plan: the auto-scheduler (aiopipe.autosched) is not available in this "
              f"installation ({exc})", file=sys.stderr)  # fmt: skip
        return 2
    parser = argparse.ArgumentParser(prog="aiopipe plan", description="Search lookaheads, "
                                     "lanes and streams for a schedule (aiopipe.autosched).")
    autosched_cli.add_arguments(parser)
    return int(autosched_cli.main(parser.parse_args(list(argv))))


# -- entry point --------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiopipe", description="Check, draw, trace and plan aiopipe schedules.",
        epilog="TARGET is MODULE:FUNC or FILE.py:FUNC returning a Schedule, a list of "
               "Tasks, a SchedulablePipeline, or a (one of those, batches) pair.",
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=f"aiopipe {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.add_argument("target", metavar="TARGET", help="MODULE:FUNC or FILE.py:FUNC")
        return sub

    thread_map_help = ("the lanes: by_stream, per_task, a JSON object or task=lane,... "
                       "(default: the target's, else one lane per stream)")
    validate = command("validate", "check a schedule against rules 1-8 and report it")
    validate.add_argument("--thread-map", metavar="MAP", help=thread_map_help)
    validate.add_argument("--json", action="store_true", help="print the report as JSON")
    graph = command("graph", "draw a schedule as DOT, Mermaid, or an SVG/PNG/PDF picture")
    graph.add_argument("--format", choices=("dot", "mermaid", "svg", "png", "pdf"),
                       help="default: from the -o suffix, else dot")  # fmt: skip
    graph.add_argument("-o", "--output", metavar="FILE",
                       help="write here instead of standard output")  # fmt: skip
    graph.add_argument("--thread-map", metavar="MAP", help=thread_map_help)
    graph.add_argument("--group-by", choices=("lane", "stream", "none"), default="lane",
                       help="one box per lane (default), per stream, or no boxes")  # fmt: skip
    graph.add_argument("--title", help="caption (default: TARGET)")
    trace = command("trace", "run N progresses and write a Chrome trace (Perfetto)")
    trace.add_argument("--progresses", type=_positive, default=20, metavar="N",
                       help="progresses to run (default 20)")  # fmt: skip
    trace.add_argument("-o", "--output", required=True, metavar="FILE", help="the trace JSON file")
    trace.add_argument("--executor", choices=("async", "sequential"),
                       help="for a schedule target (default: async)")  # fmt: skip
    trace.add_argument("--thread-map", metavar="MAP", help=thread_map_help)
    trace.add_argument("--svg", metavar="FILE", help="also draw the last three iterations here")
    # Listed for --help only: main() hands "plan" and its arguments to aiopipe.autosched.
    commands.add_parser("plan", help="auto-schedule: `aiopipe plan --help` for its options",
                        add_help=False)  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit
    status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["plan"]:
            return _cmd_plan(argv[1:])
        args = _parser().parse_args(argv)
        handler = {"validate": _cmd_validate, "graph": _cmd_graph, "trace": _cmd_trace}
        tracer = Tracer() if args.command == "trace" else None
        target = load_target(args.target, tracer=tracer)
        try:
            return handler[args.command](args, target, tracer)
        finally:
            target.shutdown()
    except PipelineError as exc:
        print(f"aiopipe {argv[0]}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, TargetError) else 1
    except OSError as exc:  # an output file that cannot be written (-o)
        print(f"aiopipe {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
