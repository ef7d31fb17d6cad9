"""An HSTU-shaped schedule with pluggable bodies, for benchmarks.

The fourteen tasks of the HSTU ranking step (prefetch variant) with their lookaheads
(2/1/0), streams (memcpy, data_dist, prefetch, default), slots, dependencies and
collective flags -- but bodies supplied by the caller (no-ops, sleeps, ...).
"""

from __future__ import annotations

from collections.abc import Callable

from aiopipe import Schedule, Stage, Task, TaskContext

Body = Callable[[TaskContext], None]

#: (name, lookahead, stream, nccl, reads, writes, extra dependency fields)
HSTU_TASKS: tuple[tuple[str, int, str, bool, tuple[str, ...], tuple[str, ...], dict], ...] = (
    ("h2d", 2, "memcpy", False, ("batch_cpu",), ("batch_gpu",), {}),
    ("start_shuffle", 2, "memcpy", True, ("batch_gpu",), ("shuffle_work",), {}),
    ("finish_shuffle", 2, "memcpy", True, ("shuffle_work",), ("shuffled_batch",), {}),
    ("start_input_dist", 1, "data_dist", True, ("shuffled_batch",), ("dist_request",), {}),
    ("wait_input_dist", 1, "data_dist", False, ("dist_request",), ("dist_output",), {}),
    ("prefetch_embeddings", 1, "prefetch", False, ("dist_output",), ("prefetched",), {}),
    ("zero_grad", 0, "default", False, (), (), {}),
    ("global_tokens_allreduce", 0, "default", True, ("shuffled_batch",), ("global_tokens",), {}),
    ("nccl_safety_barrier", 0, "default", False, (), (), {"depends_on": ("finish_shuffle",)}),
    ("forward", 0, "default", False, ("prefetched",), ("losses",),
     {"depends_on": ("zero_grad", "nccl_safety_barrier")}),
    ("backward", 0, "default", False, ("losses", "global_tokens"), ("loss_sum",),
     {"same_progress_sync": ("prefetch_embeddings",)}),
    ("finalize_model_grads", 0, "default", True, (), (), {"depends_on": ("backward",)}),
    ("optimizer_step", 0, "default", False, ("loss_sum",), ("step_result",),
     {"depends_on": ("finalize_model_grads",)}),
    ("watchdog_step", 0, "default", False, (), (), {"depends_on": ("optimizer_step",)}),
)  # fmt: skip

IO_COMPUTE_THREAD_MAP = {
    name: ("io" if stream == "memcpy" else "compute") for name, _, stream, *_ in HSTU_TASKS
}
STREAMS = ("default", "memcpy", "data_dist", "prefetch")


def noop(ctx: TaskContext) -> None:
    """A body that does nothing: what is left is the engine's own work."""
    return None


def hstu_schedule(body: Callable[[str], Body]) -> Schedule:
    """The HSTU-shaped schedule; ``body(task_name)`` returns each task's function."""
    tasks = [
        Task.from_fn(name, body(name), lookahead=la, stream=stream, nccl=nccl,
                     reads=reads, writes=writes, **extra)
        for name, la, stream, nccl, reads, writes, extra in HSTU_TASKS
    ]  # fmt: skip
    return Schedule(stages=(Stage(tasks=tuple(tasks)),), stream_slots=STREAMS)
