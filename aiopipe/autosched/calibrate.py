"""``calibrate_engine``: measure the engine's own overheads on this machine.

Three no-op schedules separate the three :class:`EngineCosts` terms:

* ``many`` no-op tasks on the loop lane cost ``progress + many * task`` per
  iteration, ``one`` such task ``progress + task``: the slope is the per-task cost,
  the intercept the per-iteration cost;
* a chain of ``many`` tasks alternating between two thread lanes, each depending on
  the one before, pays ``many + 1`` hand-offs (the first lane waking, each lane
  change, waking the loop) on top of its bodies.  Those bodies sleep ``idle_ms``:
  waking a thread whose core has gone idle costs several times more than waking
  one that is still spinning (tens of microseconds against a few on virtual
  machines), and real tasks leave cores idle the same way.

Each figure is the median of ``repeats`` timed runs, so a noisy neighbour costs
accuracy, not a wrong order of magnitude.  :func:`engine_costs_from_timings` turns
those medians into the three terms; a difference that noise makes negative (the
many-task run no slower than the one-task run, say) gives a term of 0 rather than
a negative cost.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence

from ..executors import AsyncExecutor
from ..lanes import ThreadMap
from ..pipeline import SchedulablePipeline
from ..schedule import Schedule
from ..task import Task
from .costs import EngineCosts
from .errors import AutoschedError

__all__ = ("calibrate_engine", "engine_costs_from_timings")


def _noop(ctx: object) -> None:
    return None


class _Sleeper:
    """A body that sleeps and adds up how long its sleeps really lasted."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.total = 0.0
        self._lock = threading.Lock()

    def __call__(self, ctx: object) -> None:
        start = time.perf_counter()
        time.sleep(self.seconds)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.total += elapsed


def _chain(count: int, body: Callable[[object], None] = _noop) -> Schedule:
    tasks = [Task.from_fn("t0", body)]
    for k in range(1, count):
        tasks.append(Task.from_fn(f"t{k}", body, depends_on=(f"t{k - 1}",)))
    return Schedule.of(tasks)


async def _ms_per_iteration(
    schedule: Schedule, thread_map: ThreadMap, iterations: int, sleeper: _Sleeper | None = None
) -> float:
    """Steady ms per progress, less the time the bodies spent sleeping."""
    pipe = SchedulablePipeline(schedule, executor=AsyncExecutor(thread_map), expect_result=False)
    source = iter(range(iterations + 20))
    try:
        for _ in range(20):  # warm-up: lanes started, layouts cached
            await pipe.progress(source)
        slept = sleeper.total if sleeper else 0.0
        start = time.perf_counter()
        for _ in range(iterations):
            await pipe.progress(source)
        elapsed = time.perf_counter() - start
        if sleeper is not None:
            elapsed -= sleeper.total - slept
        return elapsed * 1e3 / iterations
    finally:
        pipe.shutdown()


async def calibrate_engine(
    *, iterations: int = 200, repeats: int = 3, many: int = 8, idle_ms: float = 1.0
) -> EngineCosts:
    """Measure :class:`EngineCosts` on this machine (a few seconds: the hand-off
    figure needs ``repeats * iterations`` progresses of ``many`` sleeping tasks).
    Arguments it cannot measure with raise :class:`AutoschedError`."""
    if iterations < 1 or repeats < 1 or many < 2 or idle_ms < 0:
        raise AutoschedError(
            f"calibrate_engine needs iterations >= 1, repeats >= 1, many >= 2 (the task "
            f"term is the difference between one task and many) and idle_ms >= 0; got "
            f"iterations={iterations}, repeats={repeats}, many={many}, idle_ms={idle_ms}"
        )
    alternate: Callable[[Task], str] = lambda task: "a" if int(task.name[1:]) % 2 == 0 else "b"
    loop_lane: Callable[[Task], str] = lambda task: "loop"
    sleeper = _Sleeper(idle_ms / 1e3)
    one, chain, sleeping = _chain(1), _chain(many), _chain(many, sleeper)
    samples: dict[str, list[float]] = {"one": [], "many": [], "lanes": []}
    for _ in range(repeats):  # interleaved, so drift hits every figure alike
        samples["one"].append(await _ms_per_iteration(one, loop_lane, iterations))
        samples["many"].append(await _ms_per_iteration(chain, loop_lane, iterations))
        samples["lanes"].append(
            await _ms_per_iteration(sleeping, alternate, max(10, iterations // 4), sleeper)
        )
    return engine_costs_from_timings(samples["one"], samples["many"], samples["lanes"], many=many)


def engine_costs_from_timings(
    one_ms: Sequence[float], many_ms: Sequence[float], lanes_ms: Sequence[float], *, many: int
) -> EngineCosts:
    """The engine terms from the measured ms per progress of the three schedules
    (one sample per repeat; the median of each is used).

    ``one_ms``: one no-op task on the loop; ``many_ms``: a chain of ``many`` no-op
    tasks on the loop; ``lanes_ms``: that chain alternating between two thread lanes,
    with its bodies' sleep already taken out.  A term that noise makes negative is 0;
    ``progress_ms`` is what the one-task run costs beyond that (clamped) task term.
    Figures are rounded to 0.1 µs.  ``many`` below 2 or a run without samples raises
    :class:`AutoschedError`.
    """
    if many < 2 or not (one_ms and many_ms and lanes_ms):
        raise AutoschedError(
            f"the engine terms need many >= 2 (the task term is the difference between "
            f"one task and many) and at least one sample per run; got many={many} and "
            f"{len(one_ms)}, {len(many_ms)}, {len(lanes_ms)} samples"
        )
    one, chain, lanes = (statistics.median(ms) for ms in (one_ms, many_ms, lanes_ms))
    task_ms = max(0.0, (chain - one) / (many - 1))
    progress_ms = max(0.0, one - task_ms)
    handoff_ms = max(0.0, (lanes - chain) / (many + 1))
    return EngineCosts(
        progress_ms=round(progress_ms, 4),
        task_ms=round(task_ms, 4),
        handoff_ms=round(handoff_ms, 4),
    )
