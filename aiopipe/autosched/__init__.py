"""Schedules that tune themselves from measured costs.

* :class:`CostModel` (costs.py) -- per-task host/device costs and engine overheads,
  with a JSON round trip; :class:`CostProfiler` (profiler.py) measures one from real
  progresses.
* :func:`simulate` (simulate.py) -- the steady-state latency a schedule would have on
  the async executor, under a thread map, from those costs.
* :func:`fire_order` (listsched.py) -- critical-path list scheduling of the ready
  tasks; :func:`auto_assign_lookaheads` (lookahead.py) -- lookaheads under a
  ``max_in_flight`` bound.
* :func:`joint_search` (search.py) -- beam search over thread map x stream map x fire
  order, each candidate given its lookaheads and scored by the simulator.

Every prediction here is meant to be checked against a measured run: see
``benchmarks/autosched_sim.py`` and ``benchmarks/autosched_search.py``.
"""

from __future__ import annotations

from .calibrate import calibrate_engine as calibrate_engine
from .costs import CostModel as CostModel
from .costs import EngineCosts as EngineCosts
from .costs import TaskCost as TaskCost
from .errors import AutoschedError as AutoschedError
from .errors import CostModelError as CostModelError
from .listsched import FIRE_POLICIES as FIRE_POLICIES
from .listsched import fire_order as fire_order
from .listsched import task_levels as task_levels
from .lookahead import auto_assign_lookaheads as auto_assign_lookaheads
from .profiler import CostProfiler as CostProfiler
from .profiler import profile_schedule as profile_schedule
from .rebuild import rebuild_schedule as rebuild_schedule
from .search import Candidate as Candidate
from .search import SearchResult as SearchResult
from .search import joint_search as joint_search
from .simulate import SimResult as SimResult
from .simulate import TaskTiming as TaskTiming
from .simulate import overlap_matrix as overlap_matrix
from .simulate import simulate as simulate
from .simulate import thread_count as thread_count

__all__ = (
    "FIRE_POLICIES",
    "AutoschedError",
    "Candidate",
    "CostModel",
    "CostModelError",
    "CostProfiler",
    "EngineCosts",
    "SearchResult",
    "SimResult",
    "TaskCost",
    "TaskTiming",
    "auto_assign_lookaheads",
    "calibrate_engine",
    "fire_order",
    "joint_search",
    "overlap_matrix",
    "profile_schedule",
    "rebuild_schedule",
    "simulate",
    "task_levels",
    "thread_count",
)
