"""Loading a command-line target, ``MODULE:FUNC`` or ``FILE.py:FUNC``: see
:func:`load_target`.  Public through :mod:`aiopipe.cli`."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PipelineError
from .executors import AsyncExecutor, Executor
from .lanes import ThreadMap
from .pipeline import SchedulablePipeline
from .schedule import Schedule
from .streams import StreamPool
from .task import Task
from .trace import Tracer

__all__ = ("Target", "TargetError", "check_writable", "load_target", "parse_thread_map")


class TargetError(PipelineError, ValueError):
    """A ``MODULE:FUNC`` target could not be found, imported or understood."""


@dataclass
class Target:
    """What a ``MODULE:FUNC`` target gave: always a schedule, and whatever else it
    brought (a pipeline, its thread map and streams, batches to run)."""

    spec: str
    schedule: Schedule
    pipeline: SchedulablePipeline | None = None
    batches: Iterable[Any] | None = None
    thread_map: ThreadMap = None
    stream_pool: StreamPool | None = None
    #: Why the schedule's bodies cannot be run apart from the object that gave it
    #: (a pipeline of an adapter layer that prepares its model on the first batch),
    #: if so: it is validated, drawn or planned from given costs only.
    not_runnable: str | None = None
    #: That object, shut down with the command (as :attr:`pipeline` is).
    owner: Any = None

    def shutdown(self) -> None:
        """Shut down the pipeline the target gave, if any (idempotent): its lanes must
        not outlive the command."""
        for pipeline in (self.pipeline, self.owner):
            if pipeline is not None:
                pipeline.shutdown()

    def refuse_run(self, what: str) -> None:
        """Refuse to ``what`` (run the bodies) a schedule that cannot run alone."""
        if self.not_runnable is not None:
            raise TargetError(f"{self.spec}: cannot {what}: {self.not_runnable}")


def _import_module(location: str) -> Any:
    if location.endswith(".py") or os.sep in location or "/" in location:
        path = Path(location).resolve()
        if not path.is_file():
            raise TargetError(f"no such file: {location}")
        folder = str(path.parent)
        if folder not in sys.path:  # sibling imports work as when running the file
            sys.path.insert(0, folder)
        name = path.stem
        loaded = sys.modules.get(name)
        if loaded is not None and getattr(loaded, "__file__", None) != str(path):
            name = f"_aiopipe_target_{path.stem}"  # keep an imported namesake intact
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise TargetError(f"cannot import {location} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look modules up by name
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:
            sys.modules.pop(name, None)
            if isinstance(exc, Exception):  # the file's own error: a loading error, said so
                raise _import_failed(location, exc) from exc
            raise
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if location == missing or location.startswith(missing + "."):
            raise TargetError(
                f"cannot import module {location!r} ({exc}); run from the folder that holds "
                f"it, or name a file: path/to/file.py:FUNC"
            ) from None
        raise _import_failed(location, exc) from exc
    except Exception as exc:
        raise _import_failed(location, exc) from exc


def _import_failed(location: str, exc: Exception) -> TargetError:
    """The module (or something it imports) raised, or is not valid Python."""
    return TargetError(f"importing {location} raised {type(exc).__name__}: {exc}")


def check_writable(path: str | os.PathLike[str]) -> None:
    """Refuse an output file now, before a run it would come after, if it cannot be
    written: its folder is missing or read-only, or it is a folder itself."""
    target = Path(path)
    folder = target.parent
    if not folder.is_dir():
        raise TargetError(f"cannot write {target}: no folder {folder}")
    if target.is_dir():
        raise TargetError(f"cannot write {target}: it is a folder")
    if not os.access(target if target.exists() else folder, os.W_OK):
        raise TargetError(f"cannot write {target}: permission denied")


def _on_loop(task: Task) -> str:
    return "loop"


def _lanes(executor: Executor) -> ThreadMap:
    """Only the async executor has lanes; the others run every body on the loop."""
    return executor.thread_map if isinstance(executor, AsyncExecutor) else _on_loop


def _normalise(spec: str, value: Any) -> Target:
    def form(obj: Any) -> Target | None:
        if isinstance(obj, Schedule):
            return Target(spec, obj)
        if isinstance(obj, SchedulablePipeline):
            return Target(spec, obj.schedule, pipeline=obj, thread_map=_lanes(obj.executor),
                          stream_pool=obj.stream_pool)
        schedule, executor = getattr(obj, "schedule", None), getattr(obj, "executor", None)
        if isinstance(schedule, Schedule) and isinstance(executor, Executor):
            # A pipeline of an adapter layer (hstu_tasks' sparse-dist family): its schedule
            # and lanes, but its bodies only run once it has traced its model.
            pool = getattr(obj, "stream_pool", None)
            return Target(spec, schedule, thread_map=_lanes(executor),
                          stream_pool=pool if isinstance(pool, StreamPool) else None,
                          owner=obj if callable(getattr(obj, "shutdown", None)) else None,
                          not_runnable=(
                f"its {type(obj).__name__} prepares its model on the first batch, so the "
                f"bodies of its schedule run only in it: build it with trace=True, run it, "
                f"and save its tracer (pipe.tracer.save(...))"
            ))  # fmt: skip
        if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, Task) for t in obj):
            return Target(spec, Schedule.of(obj))
        return None

    target = form(value)
    if target is None and isinstance(value, tuple) and len(value) == 2:
        target = form(value[0])
        if target is not None:
            if not isinstance(value[1], Iterable):
                raise TargetError(f"{spec}: the second item of the pair must be an iterable "
                                  f"of batches, got {type(value[1]).__name__}")  # fmt: skip
            target.batches = value[1]
    if target is None and isinstance(value, (list, tuple)) and not value:
        raise TargetError(
            f"{spec} gave an empty {type(value).__name__}: a schedule needs at least one "
            f"Task; return the list of its Tasks (or a Schedule, or a SchedulablePipeline)"
        )
    if target is None:
        raise TargetError(
            f"{spec} gave a {type(value).__name__}; expected a Schedule, a list of Tasks, a "
            f"SchedulablePipeline, or a pair (one of those, batches)"
        )
    return target


def load_target(spec: str, *, tracer: Tracer | None = None) -> Target:
    """Import and resolve a command-line target; raise :class:`TargetError` when it
    cannot be found, imported or understood.

    ``MODULE:FUNC`` is imported with the current directory on ``sys.path`` (as
    ``python -m`` does); ``FILE.py:FUNC`` is loaded from the file, whose folder goes
    on ``sys.path`` (as when running it as a script), so its sibling imports work.
    ``FUNC`` may be a dotted attribute path.  When it names a callable, it is called
    with no arguments -- except that a callable with a ``trace`` parameter is passed
    ``tracer`` when one is given (``aiopipe trace`` does); one that needs other
    arguments is a :class:`TargetError` -- and may return (or be):

    * a :class:`Schedule`, or a list of :class:`Task` (one stage);
    * a :class:`SchedulablePipeline` (e.g. a ``Pipeline``): its schedule, stream pool
      and thread map are used; ``aiopipe trace`` runs the pipeline itself, so it must
      be built with ``trace=True`` or with the tracer passed in;
    * a pair ``(one of those, batches)``: an iterable of batches for ``aiopipe
      trace`` to feed.  Without one it feeds synthetic batches, the integers
      ``0, 1, 2, ...`` (what ``ctx.slots["batch_cpu"]`` then holds).
    """
    location, colon, attribute = spec.rpartition(":")
    if not colon or not location or not attribute:
        raise TargetError(f"expected MODULE:FUNC or FILE.py:FUNC, got {spec!r}")
    obj = _import_module(location)
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetError(f"{location} has no attribute {attribute!r}") from None
    if callable(obj):
        try:
            signature: inspect.Signature | None = inspect.signature(obj)
        except (TypeError, ValueError):  # some builtins have none: just call them
            signature = None
        accepts_trace = signature is not None and "trace" in signature.parameters
        kwargs = {"trace": tracer} if accepts_trace and tracer is not None else {}
        if signature is not None:
            try:
                signature.bind(**kwargs)
            except TypeError:
                needed = ", ".join(name for name, p in signature.parameters.items()
                                   if p.default is p.empty and name not in kwargs
                                   and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))  # fmt: skip
                raise TargetError(
                    f"{spec} needs arguments ({needed}); the command calls it with none. "
                    f"Name a function that builds the schedule by itself (one that calls "
                    f"this one with your arguments)"
                ) from None
        try:
            obj = obj(**kwargs)
        except Exception as exc:  # the target's own error: a loading error, said so
            raise TargetError(f"{spec} raised while building: {type(exc).__name__}: {exc}") from exc
    return _normalise(spec, obj)


def parse_thread_map(text: str) -> ThreadMap:
    """``by_stream``, ``per_task``, a JSON object ``{"task": "lane"}``, or
    ``task=lane,task=lane`` (unmapped tasks go to lane ``default``)."""
    text = text.strip()
    if text in ("by_stream", "per_task"):
        return text
    if text.startswith("{"):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TargetError(f"--thread-map is not valid JSON: {exc}") from None
    elif "=" in text:
        mapping = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, equals, lane = item.partition("=")
            if not equals:
                raise TargetError(f"--thread-map entry {item!r} is not task=lane")
            mapping[name.strip()] = lane.strip()
    else:
        raise TargetError(f"--thread-map {text!r}: use by_stream, per_task, a JSON object "
                          f"or task=lane,task=lane")  # fmt: skip
    if not isinstance(mapping, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and v for k, v in mapping.items()
    ):
        raise TargetError("--thread-map must map task names to lane names")
    return mapping
