"""The engine's loggers, and the wording of its lifecycle records.

Every logger is a child of ``"aiopipe"``, which carries a ``NullHandler`` only: the
application decides what is shown (docs/logging.md).  Records on paths that run per
task are guarded with ``isEnabledFor``, so a disabled level costs one check.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

__all__ = (
    "checkpoint_log", "executor_log", "lanes_summary", "next_pipeline_name", "pipeline_log",
)  # fmt: skip

logging.getLogger("aiopipe").addHandler(logging.NullHandler())

pipeline_log = logging.getLogger("aiopipe.pipeline")
executor_log = logging.getLogger("aiopipe.executors")
checkpoint_log = logging.getLogger("aiopipe.checkpoint")

_pipeline_numbers = itertools.count(1)


def next_pipeline_name() -> str:
    """``"pipeline N"``: the default name of the N-th pipeline built in this process."""
    return f"pipeline {next(_pipeline_numbers)}"


def lanes_summary(task_names: Sequence[str], lanes: Sequence[str]) -> str:
    """``"io: h2d, shuffle; compute: forward, backward"`` (lanes in first-use order);
    ``"none (every task on the event loop)"`` for executors without lanes."""
    if not lanes:
        return "none (every task on the event loop)"
    by_lane: dict[str, list[str]] = {}
    for name, lane in zip(task_names, lanes):
        by_lane.setdefault(lane, []).append(name)
    return "; ".join(f"{lane}: {', '.join(names)}" for lane, names in by_lane.items())
