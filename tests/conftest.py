"""Shared fixtures and helpers.

Every async test runs twice, on plain asyncio and on uvloop (the loop aiopipe's own
entry points prefer), unless marked ``one_loop``.  A test marked ``cuda`` needs a
CUDA device and is skipped without one; ``./dev gpu-suite`` runs every such test.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import uvloop

from aiopipe import SchedulablePipeline, Task, TaskContext
from aiopipe._core.lanes import Lane


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    if item.get_closest_marker("one_loop"):
        return {"asyncio": asyncio.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "one_loop: run an async test on plain asyncio only")
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA device; skipped without one (./dev gpu-suite runs them all)"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterable[None]:
    """Every test must leave no aiopipe thread behind.  The test that does fails, and
    its lanes are stopped here, so that the tests after it are judged on their own."""
    yield
    leaked = [t for t in threading.enumerate() if t.name.startswith("aiopipe-lane")]
    if not leaked:
        return
    with warnings.catch_warnings():  # looking at every object touches deprecated ones
        warnings.simplefilter("ignore")
        lanes = [o for o in gc.get_objects() if isinstance(o, Lane) and o.is_alive()]
    for lane in lanes:
        lane.stop(timeout=10)
    assert not leaked, f"lane threads still alive after the test: {[t.name for t in leaked]}"


class Recorder:
    """Task bodies that log (task, batch, thread) and pass values through slots."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, str]] = []
        self.lock = threading.Lock()

    def body(
        self, name: str, reads: Iterable[str] = (), writes: Iterable[str] = (), is_async: bool = False
    ) -> Callable[[TaskContext], Any]:
        reads, writes = tuple(reads), tuple(writes)

        def work(ctx: TaskContext) -> None:
            batch = ctx.batch_index
            for slot in reads:
                value = ctx.slots[slot]
                if slot == "batch_cpu":
                    assert value == batch, (name, slot, value, batch)
                else:
                    assert value[1] == batch, f"{name} read {slot}={value} for batch {batch}"
            for slot in writes:
                ctx.slots.set(slot, (name, batch) if slot != "step_result" else f"result-{batch}")
            with self.lock:
                self.log.append((name, batch, threading.current_thread().name))

        if not is_async:
            return work

        async def async_work(ctx: TaskContext) -> None:
            await asyncio.sleep(0)
            work(ctx)

        return async_work

    def task(self, name: str, *, is_async: bool = False, **fields: Any) -> Task:
        reads = tuple(r for r in fields.get("reads", ()) if isinstance(r, str))
        writes = tuple(w for w in fields.get("writes", ()) if isinstance(w, str))
        return Task.from_fn(name, self.body(name, reads, writes, is_async), **fields)

    def batches_of(self, name: str) -> list[int]:
        return [batch for task, batch, _ in self.log if task == name]

    def threads_of(self, name: str) -> set[str]:
        return {thread for task, _, thread in self.log if task == name}


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


async def cancelled(call: asyncio.Future[Any]) -> None:
    """Cancel ``call`` and wait until it has raised ``CancelledError``."""
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def collect(pipe: SchedulablePipeline, source: Any) -> list[Any]:
    """Every result of ``source``, until StopAsyncIteration."""
    results = []
    while True:
        try:
            results.append(await pipe.progress(source))
        except StopAsyncIteration:
            return results


class CompletesOnWait:
    """A device event as a CUDA one behaves for a copy still under way: not done
    when queried, done once waited for."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True
