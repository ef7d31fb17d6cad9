"""``StageLayout``: how one stage's active tasks map onto the lanes of an
``AsyncExecutor`` -- built once per active set and cached by the executor."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._core.lanes import LOOP_LANE
from ..plan import ExecutionPlan

__all__ = ("StageLayout", "build_layout")


@dataclass(frozen=True)
class StageLayout:
    """How one stage's active tasks map onto lanes (cached per active set)."""

    thread_chains: tuple[tuple[str, tuple[int, ...]], ...]
    loop_chain: tuple[int, ...]
    cross_preds: dict[int, tuple[int, ...]]  # CPU predecessors on other lanes
    flagged: tuple[int, ...]  # tasks some other lane waits for
    tickets: dict[int, int]  # empty when all collectives share one lane
    collectives: tuple[int, ...]  # nccl tasks, topological order
    #: ``async def`` bodies at the head of a chain, waiting for no other lane and
    #: issuing no collective: the loop starts them with the stage (AsyncExecutor).
    async_heads: tuple[int, ...] = ()
    #: ``{first task of a thread chain: the task on another thread lane it waits for}``
    #: where the chain can start only once that one task is done (its cross-lane
    #: predecessors and the collective ticket before its own all end there): that
    #: task's lane hands the chain over as it finishes it (:func:`deferrals`).
    deferred: dict[int, int] = field(default_factory=dict)


def build_layout(
    plan: ExecutionPlan, lane_of: tuple[str, ...], active: tuple[int, ...]
) -> StageLayout:
    """How the active tasks ``active`` of one stage map onto lanes: one chain per
    lane in topological order, the cross-lane waits and the collective tickets."""
    active_set = set(active)
    same_stream = plan.same_stream_predecessor(active)
    chains: dict[str, list[int]] = {}
    cross_preds: dict[int, tuple[int, ...]] = {}
    for i in active:
        chains.setdefault(lane_of[i], []).append(i)
        preds = {p for p in plan.preds[i] if p in active_set}
        if i in same_stream:
            preds.add(same_stream[i])
        cross = tuple(sorted(p for p in preds if lane_of[p] != lane_of[i]))
        if cross:
            cross_preds[i] = cross
    collectives = tuple(i for i in active if plan.nccl[i])
    needs_lock = len({lane_of[i] for i in collectives}) > 1
    # The chain finishing this progress's batch is handed over first: its lane wakes
    # first and takes the GIL before lanes working on batches ahead.
    by_urgency = sorted(
        (lane for lane in chains if lane != LOOP_LANE),
        key=lambda lane: (min(plan.lookahead[i] for i in chains[lane]), chains[lane][0]),
    )
    heads = (chain[0] for chain in chains.values())
    async_heads = tuple(sorted(i for i in heads if plan.is_async[i] and i not in cross_preds
                               and not plan.nccl[i]))  # fmt: skip
    tickets = {i: k for k, i in enumerate(collectives)} if needs_lock else {}
    return StageLayout(
        thread_chains=tuple((lane, tuple(chains[lane])) for lane in by_urgency),
        loop_chain=tuple(chains.get(LOOP_LANE, ())),
        cross_preds=cross_preds,
        flagged=tuple(sorted({p for preds in cross_preds.values() for p in preds})),
        tickets=tickets,
        collectives=collectives,
        async_heads=async_heads,
        deferred=(
            {} if async_heads else deferrals(chains, lane_of, cross_preds, tickets, collectives)
        ),
    )


def deferrals(
    chains: dict[str, list[int]], lane_of: tuple[str, ...], cross_preds: dict[int, tuple[int, ...]],
    tickets: dict[int, int], collectives: tuple[int, ...],
) -> dict[int, int]:
    """The thread chains whose first task waits only for tasks of one other thread
    lane -- its cross-lane predecessors, and the holder of the collective ticket
    before its own -- each with the last of those tasks in that lane's chain.

    Handed over with the stage, such a chain's lane would wake, take the GIL, block
    at once, and be woken again when that task ends: two thread switches where one
    will do (a fifth of a no-op HSTU-shaped step's, docs/performance.md)."""
    deferred: dict[int, int] = {}
    for lane, chain in chains.items():
        first = chain[0]
        if lane == LOOP_LANE:
            continue
        waits_for = set(cross_preds.get(first, ()))
        ticket = tickets.get(first)
        if ticket:
            waits_for.add(collectives[ticket - 1])
        lanes = {lane_of[i] for i in waits_for}
        if len(lanes) == 1 and not lanes & {LOOP_LANE, lane}:
            deferred[first] = max(waits_for)  # chains run in the stage's (topological) order
    return deferred
