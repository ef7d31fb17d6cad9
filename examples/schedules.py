"""Example targets for the ``aiopipe`` command line (``FILE.py:FUNC``).

    aiopipe validate examples/schedules.py:overlap
    aiopipe graph examples/schedules.py:overlap --format mermaid
    aiopipe graph examples/schedules.py:hstu_prefetch -o hstu.svg      # needs Graphviz
    aiopipe graph examples/schedules.py:lite --format mermaid          # torchrec's Lite
    aiopipe trace examples/schedules.py:training --progresses 20 -o trace.json
    aiopipe validate examples/schedules.py:broken                      # exits 1
    aiopipe plan examples/schedules.py:async_fetch                     # a stream of its own

Each function shows one form a target may take: a ``Schedule`` (``overlap``), a
pipeline that brings its lanes (``hstu``), a ``(pipeline, batches)`` pair from a
function that accepts the CLI's tracer (``training``), a schedule that breaks a rule
(``broken``), and an ``async def`` task that awaits (``async_fetch``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import torch

from aiopipe import AsyncExecutor, Pipeline, SchedulablePipeline, Schedule, Task, TaskContext


def overlap() -> Schedule:
    """Every kind of dependency on three streams, on synthetic integer batches.

    ``load`` copies batch K+2, ``prep`` and ``prefetch`` work on batch K+1 while
    ``forward``/``backward``/``step`` train batch K.
    """

    def load(ctx: TaskContext) -> None:
        ctx.slots.set("raw", torch.full((256, 64), float(ctx.slots["batch_cpu"])))

    def prep(ctx: TaskContext) -> None:
        raw = ctx.slots["raw"]
        ctx.slots.set("features", (raw - raw.mean()) / (raw.std() + 1.0))

    def prefetch(ctx: TaskContext) -> None:
        ctx.slots.set("cached", ctx.slots["features"] @ torch.ones(64, 16))

    def zero_grad(ctx: TaskContext) -> None:
        return None

    def forward(ctx: TaskContext) -> None:
        ctx.slots.set("loss", ctx.slots["cached"].square().mean())

    def backward(ctx: TaskContext) -> None:
        ctx.slots.set("grad_norm", ctx.slots["loss"].sqrt())

    def step(ctx: TaskContext) -> None:
        ctx.slots.set("step_result", float(ctx.slots["loss"]))

    def report(ctx: TaskContext) -> None:
        return None

    return Schedule.of([
        # Back-pressure: copy a new batch only once this progress's prep is done
        # (prep works on the batch before it: Δ = 0, a same-progress wait).
        Task.from_fn("load", load, lookahead=2, stream="memcpy", reads=("batch_cpu",),
                     writes=("raw",), cross_iter_depends_on=(("prep", -1),)),
        Task.from_fn("prep", prep, lookahead=1, stream="io", reads=("raw",),
                     writes=("features",)),
        # Like HSTU's embedding prefetch: after this progress's forward, whatever batch.
        Task.from_fn("prefetch", prefetch, lookahead=1, stream="io", reads=("features",),
                     writes=("cached",), same_progress_sync=("forward",)),
        Task.from_fn("zero_grad", zero_grad),
        Task.from_fn("forward", forward, reads=("cached",), writes=("loss",),
                     depends_on=("zero_grad",), nccl=True),
        Task.from_fn("backward", backward, reads=("loss",), writes=("grad_norm",), nccl=True),
        Task.from_fn("step", step, reads=("loss",), writes=("step_result",),
                     depends_on=("backward",)),
        # Logging may lag: it waits for the step of two batches back, not this one.
        Task.from_fn("report", report, cross_iter_depends_on=(("step", -2),)),
    ])  # fmt: skip


def training(trace: Any = None, steps: int = 64) -> tuple[Pipeline, Iterator[Any]]:
    """A small regression model on two lanes, with real batches: ``aiopipe trace``
    passes its tracer as ``trace``, and the pair's second item is what it feeds."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def prepare(ctx: TaskContext) -> None:
        x, y = ctx.slots["batch_cpu"]
        ctx.slots.set("features", ((x - x.mean(dim=0)) / (x.std(dim=0) + 1e-5), y))

    def train(ctx: TaskContext) -> None:
        x, y = ctx.slots["features"]
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ctx.slots.set("loss", loss.detach())

    def step(ctx: TaskContext) -> None:
        optimizer.step()
        ctx.slots.set("step_result", float(ctx.slots["loss"]))

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x = torch.randn(128, 32, generator=generator)
            yield x, x[:, :4].sum(dim=1, keepdim=True)

    pipe = Pipeline(
        [Task.from_fn("prepare", prepare, lookahead=1, stream="io", writes=("features",)),
         Task.from_fn("train", train, reads=("features",), writes=("loss",)),
         Task.from_fn("step", step, reads=("loss",), writes=("step_result",),
                      depends_on=("train",))],
        thread_map={"prepare": "io", "train": "compute", "step": "compute"},
        trace=trace,
    )  # fmt: skip
    return pipe, batches()


def hstu(prefetch: bool = False) -> SchedulablePipeline:
    """The real HSTU schedule of ``hstu_tasks`` (imports torchrec) on the lanes
    ``HSTUPipeline`` runs it on by default (``HSTU_DEFAULT_THREAD_MAP``: every task on
    lane ``compute``).  The task bodies need a sharded model, so validate, draw or
    plan it; do not trace it."""
    from hstu_tasks import HSTU_DEFAULT_THREAD_MAP
    from hstu_tasks.shuffler import IdentityShuffler
    from hstu_tasks.tasks import PipelineState, build_tasks

    model = torch.nn.Linear(1, 1)  # build_tasks only closes over the state
    state = PipelineState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          device=torch.device("cpu"), shuffler=IdentityShuffler(),
                          prefetch=prefetch)  # fmt: skip
    schedule = Schedule.of(build_tasks(state),
                           stream_slots=("default", "memcpy", "data_dist", "prefetch"))  # fmt: skip
    return SchedulablePipeline(schedule, executor=AsyncExecutor(HSTU_DEFAULT_THREAD_MAP))


def hstu_prefetch() -> SchedulablePipeline:
    """The HSTU schedule with embedding prefetch: all fourteen tasks."""
    return hstu(prefetch=True)


def async_fetch(fetch_ms: float = 5.0, train_ms: float = 5.0) -> Schedule:
    """An ``async def`` fetch one batch ahead, awaiting ``fetch_ms`` (a network fetch),
    and a synchronous training step of ``train_ms`` of CPU work, both on the default
    stream: there they run one after the other (``SerializedAwaitWarning``).  ``aiopipe
    plan`` on it gives the fetch a stream of its own; its awaits count as latency, not
    as work on the loop's thread (docs/autosched.md)."""

    async def fetch(ctx: TaskContext) -> None:
        await asyncio.sleep(fetch_ms / 1e3)
        ctx.slots.set("batch", ctx.slots["batch_cpu"])

    def train(ctx: TaskContext) -> None:
        deadline = time.perf_counter() + train_ms / 1e3
        while time.perf_counter() < deadline:  # stands for the step's CPU work
            pass
        ctx.slots.set("step_result", ctx.slots["batch"])

    return Schedule.of([
        Task.from_fn("fetch", fetch, lookahead=1, writes=("batch",)),
        Task.from_fn("train", train, reads=("batch",), writes=("step_result",)),
    ])  # fmt: skip


def sparse_dist(schedule: str = "sparse-dist") -> SchedulablePipeline:
    """A member of torchrec's family of train pipelines as ``SparseDistPipeline(...,
    schedule=...)`` runs it (``hstu_tasks.sparse.schedules``; imports torchrec), on
    the lanes it gets by default on a GPU.  Validate, draw or plan it; do not trace it
    (the task bodies need a sharded model)."""
    from hstu_tasks.sparse import SPARSE_DIST_THREAD_MAP, STREAMS, SparseDistState
    from hstu_tasks.sparse.schedules import train_schedule

    model = torch.nn.Linear(1, 1)  # the builders only close over the state
    state = SparseDistState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            device=torch.device("cpu"))  # fmt: skip
    tasks = train_schedule(schedule).build_tasks(state)
    return SchedulablePipeline(Schedule.of(tasks, stream_slots=STREAMS),
                               executor=AsyncExecutor(SPARSE_DIST_THREAD_MAP))  # fmt: skip


def lite() -> SchedulablePipeline:
    """torchrec's ``TrainPipelineSparseDistLite`` as a schedule."""
    return sparse_dist("lite")


def base() -> SchedulablePipeline:
    """torchrec's ``TrainPipelineBase`` as a schedule."""
    return sparse_dist("base")


def fused() -> SchedulablePipeline:
    """torchrec's ``TrainPipelineFusedSparseDist`` as a schedule."""
    return sparse_dist("fused")


def semi_sync() -> SchedulablePipeline:
    """torchrec's ``TrainPipelineSemiSync`` as a schedule."""
    return sparse_dist("semi-sync")


def pt2() -> SchedulablePipeline:
    """torchrec's ``TrainPipelinePT2`` as a schedule."""
    return sparse_dist("pt2")


def prefetch() -> SchedulablePipeline:
    """torchrec's ``PrefetchTrainPipelineSparseDist`` as a schedule."""
    return sparse_dist("prefetch")


def broken() -> Schedule:
    """A schedule the validator rejects (rule 7): ``backward`` waits for
    ``step`` in the same progress, and ``step`` reads what ``backward`` writes."""

    def body(ctx: TaskContext) -> None:
        return None

    return Schedule.of([
        Task.from_fn("forward", body, writes=("loss",)),
        Task.from_fn("backward", body, reads=("loss",), writes=("grads",),
                     depends_on=("step",)),
        Task.from_fn("step", body, reads=("grads",), writes=("step_result",)),
    ])  # fmt: skip
