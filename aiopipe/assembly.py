"""``assemble``: the parts a :class:`~aiopipe.pipeline.SchedulablePipeline` is built
from -- the validated plan, the executor bound to it, the ring, the iteration driver
and the feeds -- from a schedule and the pipeline's options."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ._core.log import lanes_summary, pipeline_log
from ._core.nvtx import resolve_annotator
from .context import TaskContext
from .driver import IterationDriver
from .executors import Executor, resolve_executor
from .feeds import Feeds
from .options import checked_batch_check, read_ahead_depth
from .plan import ExecutionPlan
from .ring import BatchRing, RetiredStores
from .schedule import Schedule
from .streams import StreamPool
from .trace import Tracer, resolve_tracer
from .validate import validate_schedule, warn_serialized_awaits, warn_without_result

if TYPE_CHECKING:
    from .options import PipelineOptions

__all__ = ("Parts", "assemble")


@dataclass(frozen=True)
class Parts:
    plan: ExecutionPlan
    schedule: Schedule  # in execution order
    executor: Executor
    ring: BatchRing
    ctx: TaskContext
    tracer: Tracer | None
    retired: RetiredStores  # evicted, not yet droppable
    driver: IterationDriver
    feeds: Feeds


def assemble(
    name: str, schedule: Schedule, stream_pool: StreamPool | None, executor: str | Executor,
    options: PipelineOptions,
) -> Parts:  # fmt: skip
    """Validate ``schedule`` (warning where it makes no result or serializes its
    awaits) and build the parts that run it."""
    if stream_pool is None:
        stream_pool = StreamPool({slot: None for slot in schedule.stream_slots})
    validate_schedule(schedule, stream_pool)
    if options.get("expect_result", True):
        warn_without_result(schedule)
    warn_serialized_awaits(schedule)
    plan = ExecutionPlan(schedule, stream_pool)
    bound = resolve_executor(executor)
    bound.bind(plan)
    ring, ctx = BatchRing(plan.max_lookahead + 1), TaskContext(stream_pool)
    tracer = resolve_tracer(options.get("trace"))
    lane_of = getattr(bound, "lane_of", None)
    lane_names: tuple[str, ...] = (
        tuple(lane_of(task.name) for task in plan.order) if callable(lane_of) else ()
    )
    retired = RetiredStores(stream_pool)
    driver = IterationDriver(
        plan, ring, ctx, bound,
        annotator=resolve_annotator(options.get("nvtx"), gpu_present=torch.cuda.is_available),
        tracer=tracer, lane_names=lane_names, pipeline=name, retired=retired,
    )  # fmt: skip
    feeds = Feeds(
        name, lambda: retired.add_all(ring.reset()),
        read_ahead=read_ahead_depth(options.get("read_ahead", True)),
        check_batch=checked_batch_check(options.get("check_batch")),
        # A source's own torch work, on the loop's thread, must not leave an OpenMP
        # pool there that slows the lanes' (AsyncExecutor.release_loop_thread_pool).
        after_read=getattr(bound, "release_loop_thread_pool", None),
    )  # fmt: skip
    if pipeline_log.isEnabledFor(logging.INFO):
        pipeline_log.info(
            "%s: built with %d tasks (max lookahead %d), %s, lanes %s", name, len(plan),
            plan.max_lookahead, type(bound).__name__,
            lanes_summary([task.name for task in plan.order], lane_names),
        )  # fmt: skip
    return Parts(plan, schedule.in_order(plan.order), bound, ring, ctx, tracer, retired,
                 driver, feeds)  # fmt: skip
