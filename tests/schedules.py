"""Hypothesis strategies: random valid schedules and thread maps, and a recording run.

Every generated schedule is valid by construction: same-progress (Δ = 0) edges only
point from an earlier-declared task to a later one, reads and ``depends_on`` never
read the future, and cross-stream cross-iteration waits stay inside the ring.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from aiopipe import Schedule, Task, TaskContext
from aiopipe.edges import dependency_edges

STREAMS = ("default", "memcpy", "data_dist")


@dataclass
class Spec:
    """A generated task: enough to build it (and rebuild it for another executor)."""

    name: str
    lookahead: int
    stream: str
    is_async: bool
    reads: list[str] = field(default_factory=list)
    depends_on: list[str] = field(default_factory=list)
    same_progress_sync: list[str] = field(default_factory=list)
    cross_iter: list[tuple[str, int]] = field(default_factory=list)


@st.composite
def schedule_specs(draw: st.DrawFn, max_tasks: int = 7) -> list[Spec]:
    count = draw(st.integers(1, max_tasks))
    specs: list[Spec] = []
    for i in range(count):
        spec = Spec(
            name=f"t{i}",
            lookahead=draw(st.integers(0, 3)),
            stream=draw(st.sampled_from(STREAMS)),
            is_async=draw(st.booleans()),
        )
        for j, producer in enumerate(specs):
            kind = draw(st.sampled_from(["none", "none", "read", "depends", "sync", "cross"]))
            earlier = j < i
            if kind == "read" and producer.lookahead >= spec.lookahead and (
                producer.lookahead > spec.lookahead or earlier
            ):
                spec.reads.append(f"s{j}")
            elif kind == "depends" and producer.lookahead >= spec.lookahead:
                spec.depends_on.append(producer.name)
            elif kind == "sync":
                spec.same_progress_sync.append(producer.name)
            elif kind == "cross":
                n = draw(st.integers(1, 2))
                delta = producer.lookahead + n - spec.lookahead
                cross_stream = producer.stream != spec.stream
                if delta >= 1 and (not cross_stream or spec.lookahead - n >= 0):
                    spec.cross_iter.append((producer.name, -n))
                elif delta == 0:
                    spec.cross_iter.append((producer.name, -n))
        if draw(st.booleans()):  # "after my own previous batch": same stream, always valid
            spec.cross_iter.append((spec.name, -1))
        specs.append(spec)
    # a sink that returns each batch's index, so results can be checked
    specs.append(Spec(name="sink", lookahead=0, stream="default", is_async=False))
    return specs


def thread_maps(specs: list[Spec]) -> st.SearchStrategy[Any]:
    names = [s.name for s in specs]
    lanes = st.sampled_from(["loop", "a", "b", "c"])
    return st.one_of(
        st.just(None),
        st.just("by_stream"),
        st.just("per_task"),
        st.dictionaries(st.sampled_from(names), lanes),
        st.sampled_from(["loop", "a"]).map(lambda lane: (lambda task: lane)),
        st.just(lambda task: "loop" if task.lookahead == 0 else task.stream),
    )


class Trace:
    """A global, ordered log of task starts and ends."""

    def __init__(self) -> None:
        self.counter = itertools.count()
        self.lock = threading.Lock()
        self.events: list[tuple[int, str, str, int, int]] = []  # (seq, kind, task, iter, batch)

    def mark(self, kind: str, ctx: TaskContext) -> None:
        with self.lock:
            self.events.append((next(self.counter), kind, ctx.task.name, ctx.iter_count, ctx.batch_index))


def build_tasks(specs: list[Spec], trace: Trace) -> list[Task]:
    tasks = []
    for spec in specs:
        reads = tuple(spec.reads)

        def sync_body(ctx: TaskContext, spec: Spec = spec, reads: tuple[str, ...] = reads) -> None:
            trace.mark("start", ctx)
            batch = ctx.batch_index
            assert ctx.slots["batch_cpu"] == batch
            for slot in reads:
                assert ctx.slots[slot] == (slot, batch), (spec.name, slot, ctx.slots[slot], batch)
            ctx.slots.set(f"s{spec.name[1:]}" if spec.name != "sink" else "step_result",
                          (f"s{spec.name[1:]}", batch) if spec.name != "sink" else batch)
            trace.mark("end", ctx)

        async def async_body(ctx: TaskContext, sync_body: Any = sync_body) -> None:
            await asyncio.sleep(0)
            sync_body(ctx)

        writes = ("step_result",) if spec.name == "sink" else (f"s{spec.name[1:]}",)
        tasks.append(
            Task.from_fn(
                spec.name,
                async_body if spec.is_async else sync_body,
                lookahead=spec.lookahead,
                stream=spec.stream,
                reads=("batch_cpu", *reads),
                writes=writes,
                depends_on=tuple(spec.depends_on),
                same_progress_sync=tuple(spec.same_progress_sync),
                cross_iter_depends_on=tuple(spec.cross_iter),
            )
        )
    return tasks


def check_trace(trace: Trace, schedule: Schedule, order: list[str], batches: int) -> None:
    """Every task ran every batch once, in batch order, and no edge was violated."""
    starts: dict[tuple[str, int], int] = {}
    ends: dict[tuple[str, int], int] = {}
    per_task: dict[str, list[int]] = {}
    per_iteration: dict[int, list[str]] = {}
    for seq, kind, task, iteration, batch in trace.events:
        if kind == "start":
            assert (task, batch) not in starts, f"{task} ran batch {batch} twice"
            starts[(task, batch)] = seq
            per_task.setdefault(task, []).append(batch)
            per_iteration.setdefault(iteration, []).append(task)
        else:
            ends[(task, batch)] = seq
    for task in order:
        assert per_task.get(task, []) == list(range(batches)), (task, per_task.get(task))
    lookahead = {t.name: t.lookahead for t in schedule.tasks}
    for edge in dependency_edges(schedule):
        for batch in range(batches):
            # the batch of the consumer, and the producer batch it depends on
            if edge.kind == "cross_iter":
                n = dict(schedule.task(edge.consumer).cross_iter_depends_on)[edge.producer]
                produced = batch + n
            elif edge.kind == "same_progress_sync":
                produced = batch + lookahead[edge.producer] - lookahead[edge.consumer]
            else:
                produced = batch
            if 0 <= produced < batches:
                assert ends[(edge.producer, produced)] < starts[(edge.consumer, batch)], (
                    f"{edge} violated for batch {batch}"
                )
    stream = {t.name: t.stream for t in schedule.tasks}
    position = {name: i for i, name in enumerate(order)}
    for iteration, names in per_iteration.items():
        ranked = sorted(names, key=position.__getitem__)
        last_on: dict[str, str] = {}
        for name in ranked:  # same-stream FIFO: submissions follow topological order
            previous = last_on.get(stream[name])
            if previous is not None:
                b_prev = iteration - (max(lookahead.values()) - lookahead[previous])
                b_this = iteration - (max(lookahead.values()) - lookahead[name])
                assert ends[(previous, b_prev)] < starts[(name, b_this)], (previous, name)
            last_on[stream[name]] = name
