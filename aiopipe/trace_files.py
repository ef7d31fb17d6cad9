"""``merge_traces``: trace files of several ranks (or tracers) joined into one, each
on process rows of its own (re-exported by :mod:`aiopipe.trace`)."""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .errors import ConfigurationError, ConfigurationTypeError

__all__ = ("merge_traces",)


def merge_traces(paths: Iterable[str | os.PathLike[str]], output: str | os.PathLike[str]) -> Path:
    """Join trace files (one per rank, or per tracer) into one, each file's processes
    on process rows of their own.

    Process ids are renumbered ``0, 1, ...`` in the order of the files (and of the
    processes within a file), so two files written by one OS process do not share a
    row; each keeps its ``process_name``, followed by its file's name and pipelines
    (``"aiopipe pid 4242 (train.json: train)"``) where two files have the same name.
    A file that is not a trace :meth:`~aiopipe.trace.Tracer.save` writes (a JSON object with a
    ``traceEvents`` list) raises :class:`~aiopipe.errors.ConfigurationError`."""
    if isinstance(paths, (str, bytes, os.PathLike)):  # iterated, a str gives its characters
        raise ConfigurationTypeError(
            f"merge_traces takes a list of trace files, got the single path {paths!r}; "
            f"pass [{str(paths)!r}]"
        )
    events: list[dict[str, Any]] = []
    files: list[str] = []  # by new pid
    names: dict[int, dict[str, Any]] = {}  # new pid -> the args of its process_name event
    pipelines: dict[int, dict[str, None]] = collections.defaultdict(dict)
    for path in paths:
        renumbered: dict[Any, int] = {}
        for event in _trace_events(path):
            if "pid" in event:
                pid = renumbered.setdefault(event["pid"], len(files))
                if pid == len(files):
                    files.append(Path(path).name)
                event, args = {**event, "pid": pid}, event.get("args")
                if event.get("name") == "process_name" and isinstance(args, dict):
                    names[pid] = event["args"] = dict(args)
                elif isinstance(args, dict) and isinstance(args.get("pipeline"), str):
                    pipelines[pid][args["pipeline"]] = None
            events.append(event)
    counts = collections.Counter(str(args.get("name")) for args in names.values())
    for pid, args in names.items():
        if counts[str(args.get("name"))] > 1:  # say which file (and pipelines) is which
            named = ", ".join(pipelines[pid])
            args["name"] = f"{args.get('name')} ({files[pid]}{': ' if named else ''}{named})"
    target = Path(output)
    target.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return target


def _trace_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of one trace file; a clear error for anything else."""
    try:
        data = json.loads(Path(path).read_text())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigurationError(f"{os.fspath(path)} is not a JSON trace file: {exc}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if isinstance(events, list) and all(isinstance(event, dict) for event in events):
        return events
    got = {"dict": "an object without one", "list": "a JSON array"}.get(type(data).__name__)
    raise ConfigurationError(f"{os.fspath(path)} is not a trace aiopipe writes: expected a JSON "
                             f"object with a \"traceEvents\" list of event objects, got "
                             f"{got or type(data).__name__}")  # fmt: skip
