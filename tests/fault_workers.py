"""Worker processes for the fault-tolerance tests (spawned; each writes a JSON report)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import hstu_tasks.pipeline as hstu_pipeline
from aiopipe import BadBatchError, PipelineStateError
from hstu_tasks import (
    DataConfig,
    HSTUPipeline,
    ModelConfig,
    OptimizerConfig,
    SyntheticHSTUData,
    build_training,
    join_local_group,
    leave_and_exit,
    quiet_torchrec,
)

DATA = DataConfig(batch_size=4, max_history=12)
BATCHES = 6


class InjectedFault(RuntimeError):
    pass


def join(rank: int, world: int, port: int, timeout_s: float = 60.0) -> Any:
    faulthandler.enable()
    quiet_torchrec()
    join_local_group(rank, world, port, datetime.timedelta(seconds=timeout_s))
    return build_training(ModelConfig(), DATA, OptimizerConfig(), seed=1)


def lane_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiopipe-lane")]


def inject(task_name: str, should_fail: Any) -> None:
    """Make the next pipelines built wrap ``task_name`` so that it raises (or runs
    ``should_fail(ctx)`` for its side effect) when ``should_fail(ctx)`` is true."""
    original = hstu_pipeline.build_tasks

    def build(state: Any) -> Any:
        tasks = original(state)
        for task in tasks:
            if task.name == task_name:
                body = task.run

                def run(ctx: Any, body: Any = body) -> Any:
                    if should_fail(ctx):
                        raise InjectedFault(f"{task_name} at iteration {ctx.iter_count}")
                    return body(ctx)

                task.run = run  # type: ignore[method-assign]
        return tasks

    hstu_pipeline.build_tasks = build  # type: ignore[assignment]


def report(path: str, body: dict[str, Any]) -> None:
    with open(path, "w") as out:
        json.dump(body, out)


def leave() -> None:
    leave_and_exit(0, barrier=False)


# -- the fault matrix (one rank) ----------------------------------------------------------


def matrix_worker(rank: int, port: int, out: str) -> None:
    """An exception in each task x prefill / steady / drain: the original error,
    quickly, no leaked lane, the pipeline refusing until reset and reusable after."""
    setup = join(rank, 1, port)
    data = SyntheticHSTUData(DATA, BATCHES, seed=2)
    probe = HSTUPipeline(setup.model, setup.optimizer, setup.device)
    names = [task.name for task in hstu_pipeline.build_tasks(probe._state)]
    original_build = hstu_pipeline.build_tasks
    cases = []
    pipe = HSTUPipeline(setup.model, setup.optimizer, setup.device)
    for name in names:
        for phase in ("prefill", "steady", "drain"):
            hstu_pipeline.build_tasks = original_build
            state: dict[str, Any] = {}

            def should_fail(ctx: Any, phase: str = phase, state: dict[str, Any] = state) -> bool:
                # prefill: the task's first run (inside the first progress, which runs
                # iterations 0..2 at max lookahead 2); steady: iteration 3; drain: the
                # iterations after the source is exhausted (>= BATCHES)
                it = ctx.iter_count
                hit = {"prefill": True, "steady": it == 3, "drain": it >= BATCHES}[phase]
                if hit and not state:
                    state["fired"] = True
                    return True
                return False

            inject(name, should_fail)
            pipe.reset()
            started = time.perf_counter()
            outcome = asyncio.run(drive(pipe, iter(data)))
            outcome.update(task=name, phase=phase, seconds=time.perf_counter() - started,
                           fired=bool(state))  # fmt: skip
            hstu_pipeline.build_tasks = original_build
            pipe.reset()  # stops the engine's lanes
            outcome["lanes_after_reset"] = lane_threads()
            # reusable after reset: a clean run gives every result
            outcome["after_reset"] = len(asyncio.run(collect_all(pipe, iter(data))))
            cases.append(outcome)
    bad_input = asyncio.run(feed_bad_batches(pipe, data))
    pipe.shutdown()
    probe.shutdown()
    report(out, {"cases": cases, "tasks": names, "lanes_at_end": lane_threads(),
                 "bad_input": bad_input})  # fmt: skip
    leave()


async def feed_bad_batches(pipe: HSTUPipeline, data: SyntheticHSTUData) -> dict[str, Any]:
    """Malformed and None batches mid-epoch and first: refused with BadBatchError,
    skipped, nothing else lost."""
    good = [data.batch(i) for i in range(4)]
    float_labels = dataclasses.replace(good[1], labels=good[1].labels.float())
    short_labels = dataclasses.replace(good[2], labels=good[2].labels[:-1])
    item, action = good[3].features["item"], good[3].features["action"]
    item_lengths = item.lengths().clone()
    item_lengths[0] -= 1  # the first user is one item short: it would read the next's
    short_items = dataclasses.replace(good[3], features=KeyedJaggedTensor.from_lengths_sync(
        keys=["item", "action"], values=torch.cat([item.values()[1:], action.values()]),
        lengths=torch.cat([item_lengths, action.lengths()]),
    ))  # fmt: skip
    source = iter([good[0], good[1], float_labels, good[2], None, short_labels, short_items,
                   good[3]])  # fmt: skip
    pipe.reset()
    results, errors = 0, []
    while True:
        try:
            await pipe.progress(source)
            results += 1
        except BadBatchError as exc:
            errors.append(str(exc))
        except StopAsyncIteration:
            break
    pipe.reset()
    source = iter([None, *good])
    try:
        await pipe.progress(source)
        first = "accepted"
    except BadBatchError as exc:
        first = str(exc)
    after_first = len(await collect_all(pipe, source))  # the same source goes on
    assert pipe.engine is not None
    refused_first = pipe.engine.statistics().refused  # the source's position stays exact
    # a bootstrap that fails after taking the first batch keeps it for the next try
    pipe.reset()
    spec = pipe._spec

    def fail_once(*args: Any) -> Any:
        pipe._spec = spec
        raise RuntimeError("injected bootstrap failure")

    pipe._spec = dataclasses.replace(spec, rewrite_and_seed=fail_once)
    source = iter(good)
    try:
        await pipe.progress(source)
        failed_bootstrap = "no failure"
    except RuntimeError as exc:
        failed_bootstrap = str(exc)
    after_failed_bootstrap = len(await collect_all(pipe, source))
    pipe.reset()
    try:
        await pipe.progress(iter(()))
        empty = "accepted"
    except StopAsyncIteration:
        empty = "StopAsyncIteration"
    return {"results": results, "errors": errors, "first": first, "empty": empty,
            "after_first": after_first, "refused_first": refused_first,
            "failed_bootstrap": failed_bootstrap,
            "after_failed_bootstrap": after_failed_bootstrap}  # fmt: skip


async def drive(pipe: HSTUPipeline, source: Any) -> dict[str, Any]:
    results = 0
    try:
        while True:
            await pipe.progress(source)
            results += 1
    except StopAsyncIteration:
        return {"error": None, "results": results}
    except InjectedFault as exc:
        notes = getattr(exc, "__notes__", [])
        try:
            await pipe.progress(source)
            refused = "no"
        except PipelineStateError as again:
            refused = str(again)
        return {"error": str(exc), "notes": notes, "results": results, "refused": refused}


async def collect_all(pipe: HSTUPipeline, source: Any) -> list[Any]:
    results = []
    try:
        while True:
            results.append(await pipe.progress(source))
    except StopAsyncIteration:
        return results


# -- a peer dies or stalls (two ranks) ----------------------------------------------------


def peer_worker(rank: int, port: int, out: str, how: str, timeout_s: float) -> None:
    """Rank 1 dies (SIGKILL) or stalls in forward of batch 2; rank 0 must fail
    within the collective timeout with the original error, lanes released."""
    setup = join(rank, 2, port, timeout_s)
    data = SyntheticHSTUData(DATA, BATCHES, seed=2, rank=rank)
    if rank == 1:

        def misbehave(ctx: Any) -> bool:
            if ctx.batch_index == 2:
                if how == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                print(f"rank 1 pid {os.getpid()} stalls", flush=True)
                time.sleep(600)
            return False

        inject("forward", misbehave)
    pipe = HSTUPipeline(setup.model, setup.optimizer, setup.device)
    started = time.perf_counter()
    body: dict[str, Any] = {"pid": os.getpid()}
    if rank == 0:
        report(out + ".pid", body)

    async def train() -> None:
        source = iter(data)
        while True:
            await pipe.progress(source)

    try:
        asyncio.run(train())
        body["error"] = None
    except BaseException as exc:
        body.update(error=f"{type(exc).__name__}: {exc}", notes=getattr(exc, "__notes__", []))
    body["seconds"] = time.perf_counter() - started
    pipe.shutdown()
    body["lanes"] = lane_threads()
    report(out, body)
    sys.stdout.flush()
    os._exit(3)  # the group is broken: exit without collective teardown
