"""How a stage's chains reach their lanes (:func:`hand_over`): each lane's chain as a
work item, run at once; or, where it must, once the stage before it has ended (a
stage queued behind another by ``progress_many``) and the loop has run the first
steps of the ``async def`` bodies heading chains (:mod:`.loop_bodies`).  A chain
whose first task waits for one task of another lane is handed over by that lane,
as it finishes that task (``StageLayout.deferred``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from .loop_bodies import heads_whole_chain, serve_before

if TYPE_CHECKING:
    from .._core.lanes import Lane
    from .stage import StageRun

__all__ = ("ChainRunner", "hand_over")

#: Runs one lane's chain of a stage, on that lane's thread (``AsyncExecutor``'s).
ChainRunner = Callable[["StageRun", "Lane", tuple[int, ...]], None]


def hand_over(
    run: StageRun, lanes: list[Lane], run_chain: ChainRunner, *, after: StageRun | None = None
) -> None:
    """Give each of ``lanes`` its chain of ``run`` (queued behind ``after``, if given).
    A chain that is one body the loop runs gets no work item: the body ends it."""
    heads = run.heads
    # (Traced, every chain is handed over at once: the trace shows its waits.)
    deferred = {} if run.iteration.tracing else run.layout.deferred
    now: list[tuple[Lane, Callable[[], None]]] = []
    for lane, (_, chain) in zip(lanes, run.layout.thread_chains):
        if heads and heads_whole_chain(run, chain):
            continue
        if after is not None:
            serve_before(after, lane)
        work: Callable[[], None]
        if run.gate is not None or heads and chain[0] not in heads:
            work = functools.partial(_run_when_free, run_chain, run, lane, chain)
        else:
            work = functools.partial(run_chain, run, lane, chain)
        trigger = deferred.get(chain[0])
        if trigger is None:
            now.append((lane, work))
        else:  # that task's lane hands it over as it finishes it
            with run.lock:  # a queued stage may be skipped meanwhile, from a lane
                run.deferred.setdefault(trigger, []).append((lane, work, chain[0]))
    if after is not None:  # its chains for these lanes reach them first
        after.release_deferred({lane for lane, _ in now})
    for lane, work in now:  # after the deferred ones are in place: their tasks may end at once
        lane.submit(work)
    if run.failed:  # skipped meanwhile (the stage it is queued behind failed)
        run.release_deferred()


def _run_when_free(
    run_chain: ChainRunner, run: StageRun, lane: Lane, chain: tuple[int, ...]
) -> None:
    """On ``lane``'s thread: once the stage before ``run`` has ended (its gate) and,
    unless a body heads this chain (the lane waits for that one anyway), once the
    loop has run the first steps of the bodies heading chains."""
    if run.gate is not None:
        run.gate.wait()
    if run.heads and chain[0] not in run.heads:
        run.heads_begun.wait()  # type: ignore[union-attr]
    run_chain(run, lane, chain)
