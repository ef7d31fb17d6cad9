"""The specification's threaded executor, re-created as a plug-in baseline.

A ``ThreadPoolExecutor`` with one worker per thread group; per iteration it
partitions the active tasks by thread, creates a ``threading.Event`` per task for
the CPU dependencies, submits one chain per thread, orders collectives with a
``Condition``-based ticket lock (notify-all), and blocks the driver on every
chain's future.  Used only to compare aiopipe's ``AsyncExecutor`` against it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor as _Pool

from aiopipe import ThreadMap
from aiopipe.executors.base import Iteration
from aiopipe.lanes import resolve_lane
from aiopipe.plan import ExecutionPlan


class _ConditionTicketLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0
        self._failed = False

    def reset(self) -> None:
        with self._cond:
            self._next, self._failed = 0, False

    def acquire(self, ticket: int) -> None:
        with self._cond:
            while self._next != ticket and not self._failed:
                self._cond.wait()
            if self._failed:
                raise RuntimeError("ticket lock aborted")

    def release(self, failed: bool = False) -> None:
        with self._cond:
            self._next += 1
            self._failed = self._failed or failed
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()


class ThreadedExecutor:
    def __init__(self, thread_map: ThreadMap = None) -> None:
        self.thread_map = thread_map
        self._lock = _ConditionTicketLock()

    def bind(self, plan: ExecutionPlan) -> None:
        self._plan = plan
        self._thread_of = [resolve_lane(t, self.thread_map) for t in plan.order]
        self._pool = _Pool(max_workers=len(set(self._thread_of)))

    async def run_iteration(self, iteration: Iteration) -> None:
        for active in iteration.active.stages:
            if active:
                self._execute_stage(iteration, active)

    def _execute_stage(self, iteration: Iteration, active: tuple[int, ...]) -> None:
        plan, thread_of = self._plan, self._thread_of
        active_set = set(active)
        completion = {i: threading.Event() for i in active}
        same_stream = plan.same_stream_predecessor(active)
        cpu_deps: dict[int, list[threading.Event]] = {}
        for i in active:
            preds = {p for p in plan.preds[i] if p in active_set}
            if i in same_stream:
                preds.add(same_stream[i])
            cpu_deps[i] = [completion[p] for p in preds if thread_of[p] != thread_of[i]]
        tickets = {i: k for k, i in enumerate(i for i in active if plan.nccl[i])}
        chains: dict[str, list[int]] = {}
        for i in active:
            chains.setdefault(thread_of[i], []).append(i)
        cancelled = threading.Event()
        errors: list[BaseException] = []
        errors_lock = threading.Lock()
        self._lock.reset()

        def run_chain(chain: list[int]) -> None:
            try:
                for i in chain:
                    if cancelled.is_set():
                        break
                    for event in cpu_deps[i]:
                        event.wait()
                    if cancelled.is_set():
                        break
                    ticket = tickets.get(i)
                    if ticket is not None:
                        self._lock.acquire(ticket)
                    try:
                        iteration.invoke(i)
                    except BaseException as exc:
                        cancelled.set()
                        self._lock.abort()
                        with errors_lock:
                            errors.append(exc)
                        break
                    finally:
                        if ticket is not None:
                            self._lock.release()
                        completion[i].set()
            finally:
                for i in chain:
                    completion[i].set()

        futures = [self._pool.submit(run_chain, chain) for chain in chains.values()]
        for future in futures:
            future.result()
        if errors:
            raise errors[0]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
