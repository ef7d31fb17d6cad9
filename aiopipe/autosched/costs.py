"""``CostModel``: what each task costs, and what the engine itself costs, in ms.

A cost model is plain data: per task the host time its body takes on its lane, the
time an ``async def`` body spends suspended at its awaits, the device time its
work takes on its stream, and a few resource facts (does the body
wait for its own device work, does that work cross the host link, which
communicator do its collectives use); plus three engine overheads the simulator adds
around the bodies.  It round-trips through JSON so a profile taken on one machine
can be planned against on another, and shipped with a workload.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..schedule import Schedule
from .errors import CostModelError

__all__ = ("FORMAT", "CostModel", "EngineCosts", "TaskCost")

#: The ``format`` tag of the JSON form; bumped when a field changes meaning.  A field
#: added with a default (``await_ms``) keeps it: files without it load as before.
FORMAT = "aiopipe.costs/1"


def _non_negative(owner: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CostModelError(f"{owner}: {name} must be a number of ms, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise CostModelError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")
    return number


@dataclass(frozen=True)
class TaskCost:
    """The cost of one run of one task.

    ``host_ms``: time the body works on its thread (for a collective on CPU, the wait
    for the peers included; for an ``async def`` body, the steps of the coroutine,
    on the loop's thread).  ``await_ms``: time an ``async def`` body spends suspended
    at its awaits (a fetch, a sleep): its consumers wait for it, as its lane does
    (the engine runs a lane's tasks in order), but the loop's thread is free
    meanwhile.  ``gpu_ms``: device time of the work it queues on its stream (0 on
    CPU).  ``sync``: the body blocks until its own device work is done
    (a ``.item()``, a D2H copy).  ``pcie``: that work moves data over the host link,
    so it contends with other such work.  ``comm``: the communicator its collectives
    use (tasks marked ``nccl`` default to ``"world"``); one communicator runs one
    collective at a time, whatever the stream.  ``samples``, ``host_p90_ms``, ``lane``
    and ``stream`` describe the measurement (what the profile saw), not the cost.
    """

    host_ms: float
    gpu_ms: float = 0.0
    sync: bool = False
    pcie: bool = False
    comm: str | None = None
    samples: int = 0
    host_p90_ms: float | None = None
    lane: str | None = None
    stream: str | None = None
    #: Last, so positional construction keeps its meaning; 0 in files written before it.
    await_ms: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_ms", _non_negative("TaskCost", "host_ms", self.host_ms))
        object.__setattr__(self, "gpu_ms", _non_negative("TaskCost", "gpu_ms", self.gpu_ms))
        awaited = _non_negative("TaskCost", "await_ms", self.await_ms)
        object.__setattr__(self, "await_ms", awaited)
        if self.host_p90_ms is not None:
            p90 = _non_negative("TaskCost", "host_p90_ms", self.host_p90_ms)
            object.__setattr__(self, "host_p90_ms", p90)
        if self.comm is not None and (not isinstance(self.comm, str) or not self.comm):
            raise CostModelError(f"TaskCost: comm must be a communicator name, got {self.comm!r}")


@dataclass(frozen=True)
class EngineCosts:
    """What the engine adds around task bodies (measured by ``calibrate_engine``).

    ``progress_ms``: fixed cost of one internal iteration (pull a batch, advance the
    ring, start and finish the stage).  ``task_ms``: per task run (context, events).
    ``handoff_ms``: waking a blocked thread -- paid when a lane receives its chain,
    when a lane or the loop waits for another lane's task or a ticket, and when the
    last lane wakes the loop.
    """

    progress_ms: float = 0.02
    task_ms: float = 0.004
    handoff_ms: float = 0.035

    def __post_init__(self) -> None:
        for item in fields(self):
            value = _non_negative("EngineCosts", item.name, getattr(self, item.name))
            object.__setattr__(self, item.name, value)


@dataclass(frozen=True)
class CostModel:
    """Per-task costs plus engine overheads.  Immutable; ``with_task`` makes variants."""

    tasks: Mapping[str, TaskCost]
    engine: EngineCosts = field(default_factory=EngineCosts)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, cost in self.tasks.items():
            if not isinstance(cost, TaskCost):
                raise CostModelError(f"cost of task {name!r} must be a TaskCost, got {cost!r}")
        object.__setattr__(self, "tasks", dict(self.tasks))
        object.__setattr__(self, "meta", dict(self.meta))

    @classmethod
    def from_host_ms(
        cls, host_ms: Mapping[str, float], engine: EngineCosts | None = None
    ) -> CostModel:
        """A CPU-only model from ``{task: host ms}``."""
        tasks = {name: TaskCost(ms) for name, ms in host_ms.items()}
        return cls(tasks, engine or EngineCosts())

    def of(self, name: str) -> TaskCost:
        cost = self.tasks.get(name)
        if cost is None:
            raise CostModelError(
                f"the cost model has no cost for task {name!r}; profile it (CostProfiler) "
                f"or add it with CostModel.with_task({name!r}, host_ms=...)"
            )
        return cost

    def __contains__(self, name: object) -> bool:
        return name in self.tasks

    def check_covers(self, schedule: Schedule | Iterable[str]) -> None:
        """Raise :class:`CostModelError` naming every task of ``schedule`` without a cost."""
        names = [t.name for t in schedule.tasks] if isinstance(schedule, Schedule) else schedule
        missing = [name for name in names if name not in self.tasks]
        if missing:
            raise CostModelError(
                f"the cost model lacks tasks {missing}; profile the schedule again or add "
                f"them with with_task()"
            )

    def with_task(self, name: str, **changes: Any) -> CostModel:
        """A copy where task ``name``'s cost has ``changes`` (created if absent)."""
        current = self.tasks.get(name)
        cost = replace(current, **changes) if current is not None else TaskCost(**changes)
        return replace(self, tasks={**self.tasks, name: cost})

    def with_engine(self, engine: EngineCosts) -> CostModel:
        return replace(self, engine=engine)

    # -- JSON --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "unit": "ms",
            "engine": asdict(self.engine),
            "tasks": {name: _compact(asdict(cost)) for name, cost in self.tasks.items()},
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        if not isinstance(data, Mapping):
            raise CostModelError(f"a cost model is a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise CostModelError(
                f"unknown cost model format {data.get('format')!r}; expected {FORMAT!r}"
            )
        tasks_data = data.get("tasks")
        if not isinstance(tasks_data, Mapping):
            raise CostModelError("a cost model needs a 'tasks' object {name: cost}")
        tasks = {
            name: _build(TaskCost, entry, f"task {name!r}") for name, entry in tasks_data.items()
        }
        engine = _build(EngineCosts, data.get("engine", {}), "engine")
        meta = data.get("meta", {})
        if not isinstance(meta, Mapping):
            raise CostModelError("'meta' must be a JSON object")
        return cls(tasks, engine, meta)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CostModelError(f"the cost model is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> Path:
        target = Path(path)
        target.write_text(self.to_json())
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        return cls.from_json(Path(path).read_text())


def _compact(entry: dict[str, Any]) -> dict[str, Any]:
    """Drop fields at their defaults, so shipped profiles stay readable."""
    defaults = {"gpu_ms": 0.0, "await_ms": 0.0, "sync": False, "pcie": False, "comm": None,
                "host_p90_ms": None, "lane": None, "stream": None}  # fmt: skip
    return {k: v for k, v in entry.items() if k not in defaults or defaults[k] != v}


def _build(kind: type[Any], entry: object, owner: str) -> Any:
    if not isinstance(entry, Mapping):
        raise CostModelError(f"{owner}: expected a JSON object, got {entry!r}")
    known = {item.name for item in fields(kind)}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise CostModelError(f"{owner}: unknown field(s) {unknown}; known: {sorted(known)}")
    try:
        return kind(**entry)
    except TypeError as exc:
        raise CostModelError(f"{owner}: {exc}") from None
