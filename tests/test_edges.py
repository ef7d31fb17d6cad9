"""Dependency edges, topological order and cross-stream event waits."""

from __future__ import annotations

import pytest

from aiopipe import Schedule, ScheduleValidationError, Stage, Task
from aiopipe.edges import dependency_edges, infer_cross_stream_event_deps, topological_sort


def noop(ctx: object) -> None:
    return None


def t(name: str, la: int = 0, stream: str = "default", **fields: object) -> Task:
    return Task.from_fn(name, noop, lookahead=la, stream=stream, **fields)


def order(*tasks: Task) -> list[str]:
    return [task.name for task in topological_sort(Schedule.of(tasks))]


# -- topological order ------------------------------------------------------------------


def test_slot_edge_reorders_reader_after_writer() -> None:
    assert order(t("reader", reads=("x",)), t("writer", writes=("x",))) == ["writer", "reader"]


def test_declaration_order_breaks_ties() -> None:
    assert order(t("c"), t("a"), t("b")) == ["c", "a", "b"]


def test_priority_breaks_ties_before_declaration_order() -> None:
    assert order(t("c"), t("a", priority=5), t("b")) == ["a", "c", "b"]


def test_equal_lookahead_depends_on_is_an_edge() -> None:
    assert order(t("b", depends_on=("a",)), t("a")) == ["a", "b"]


def test_cross_lookahead_depends_on_is_not_an_edge() -> None:
    assert order(t("b", 0, depends_on=("a",)), t("a", 1)) == ["b", "a"]


def test_cross_lookahead_slot_read_is_not_an_edge() -> None:
    assert order(t("b", 0, reads=("x",)), t("a", 1, writes=("x",))) == ["b", "a"]


def test_same_progress_sync_is_an_edge_whatever_the_lookaheads() -> None:
    assert order(t("backward", 0, same_progress_sync=("prefetch",)), t("prefetch", 1)) == [
        "prefetch",
        "backward",
    ]


def test_delta_zero_cross_iter_is_promoted_to_an_edge() -> None:
    # forward (la 1) waits for update (la 0) of batch K-1: both run in this progress.
    fwd = t("forward", 1, cross_iter_depends_on=(("update", -1),))
    assert order(fwd, t("update", 0)) == ["update", "forward"]
    (edge,) = dependency_edges(Schedule.of([fwd, t("update", 0)]))
    assert (edge.delta, edge.slot_offset, edge.intra_progress) == (0, 0, True)


def test_delta_positive_cross_iter_is_not_an_edge() -> None:
    assert order(t("b", 1, cross_iter_depends_on=("a",)), t("a", 1)) == ["b", "a"]


def test_cycle_is_reported_with_its_path() -> None:
    tasks = (t("a", depends_on=("c",)), t("b", depends_on=("a",)), t("c", depends_on=("b",)))
    with pytest.raises(ScheduleValidationError) as info:
        topological_sort(Schedule.of(tasks))
    assert info.value.rule == 7
    assert "a -> b -> c -> a" in str(info.value)


def test_stages_keep_their_order_and_sort_inside() -> None:
    schedule = Schedule(
        stages=(Stage((t("s0b", reads=("x",)), t("s0a", writes=("x",)))), Stage((t("s1"),))),
    )
    assert [task.name for task in topological_sort(schedule)] == ["s0a", "s0b", "s1"]


def test_edge_pointing_back_across_stages_is_rejected() -> None:
    schedule = Schedule(stages=(Stage((t("early", depends_on=("late",)),)), Stage((t("late"),))))
    with pytest.raises(ScheduleValidationError, match="later stage") as info:
        topological_sort(schedule)
    assert info.value.rule == 7


# -- edges and Δ -------------------------------------------------------------------------


def test_edge_kinds_deltas_and_offsets() -> None:
    tasks = [
        t("h2d", 2, "memcpy", writes=("batch_gpu",)),
        t("dist", 1, "data_dist", reads=("batch_gpu",)),
        t("prefetch", 1, "prefetch", depends_on=("dist",)),
        t("forward", 0, depends_on=("prefetch",)),
        t("backward", 0, same_progress_sync=("prefetch",)),
        t("aux", 2, "stats", cross_iter_depends_on=("h2d",)),
    ]
    edges = {(e.producer, e.consumer): e for e in dependency_edges(Schedule.of(tasks))}
    summary = {k: (e.kind, e.delta, e.slot_offset) for k, e in edges.items()}
    assert summary == {
        ("h2d", "dist"): ("slot", 1, 1),
        ("dist", "prefetch"): ("depends_on", 0, 1),
        ("prefetch", "forward"): ("depends_on", 1, 0),
        ("prefetch", "backward"): ("same_progress_sync", 0, 1),
        ("h2d", "aux"): ("cross_iter", 1, 1),
    }
    assert edges[("h2d", "dist")].slot == "batch_gpu"


def test_depends_on_future_read_is_rejected() -> None:
    with pytest.raises(ScheduleValidationError, match="future read") as info:
        dependency_edges(Schedule.of([t("c", 1, depends_on=("p",)), t("p", 0)]))
    assert info.value.rule == 6


def test_unknown_dependency_name_is_rejected() -> None:
    with pytest.raises(ScheduleValidationError, match="'ghost'") as info:
        dependency_edges(Schedule.of([t("c", same_progress_sync=("ghost",))]))
    assert info.value.rule == 6


def test_waiting_for_oneself_in_the_same_progress_is_rejected() -> None:
    with pytest.raises(ScheduleValidationError, match="waits for itself"):
        dependency_edges(Schedule.of([t("c", depends_on=("c",))]))


def test_cross_iter_on_oneself_is_allowed() -> None:
    (edge,) = dependency_edges(Schedule.of([t("c", 1, cross_iter_depends_on=("c",))]))
    assert (edge.delta, edge.intra_progress) == (1, False)


# -- appendix A.5: the worked examples ----------------------------------------------------

A5 = [
    # X.la, consumer.la, N, Δ, slot_offset
    (1, 1, 1, 1, 0),
    (2, 2, 2, 2, 0),
    (3, 2, 2, 3, 0),
    (0, 1, 1, 0, 0),  # Δ = 0: promoted, event at slot[X.la]
]


@pytest.mark.parametrize(("x_la", "c_la", "n", "delta", "slot"), A5)
def test_appendix_a5_accepted_rows(x_la: int, c_la: int, n: int, delta: int, slot: int) -> None:
    tasks = [t("X", x_la, "memcpy"), t("C", c_la, cross_iter_depends_on=(("X", -n),))]
    (edge,) = dependency_edges(Schedule.of(tasks))
    assert (edge.delta, edge.slot_offset) == (delta, slot)
    assert infer_cross_stream_event_deps(Schedule.of(tasks)) == {"C": [("X", "memcpy", slot)]}


def test_appendix_a5_rotated_out_cross_stream_is_rejected_same_stream_accepted() -> None:
    cross = [t("X", 0, "memcpy"), t("C", 0, cross_iter_depends_on=("X",))]
    with pytest.raises(ScheduleValidationError, match="rotated out") as info:
        infer_cross_stream_event_deps(Schedule.of(cross))
    assert info.value.rule == 8
    same = [t("X", 0), t("C", 0, cross_iter_depends_on=("X",))]
    assert infer_cross_stream_event_deps(Schedule.of(same)) == {}


def test_appendix_a5_future_read_is_rejected() -> None:
    tasks = [t("X", 0, "memcpy"), t("C", 3, cross_iter_depends_on=("X",))]
    with pytest.raises(ScheduleValidationError, match="Δ=-2") as info:
        dependency_edges(Schedule.of(tasks))
    assert info.value.rule == 6


# -- event waits -------------------------------------------------------------------------


def test_three_sync_types_resolve_to_their_slots() -> None:
    tasks = [
        t("h2d", 2, "memcpy"),
        t("prefetch", 1, "prefetch"),
        t("forward", 0, depends_on=("prefetch",)),
        t("backward", 0, same_progress_sync=("prefetch",)),
        t("aux", 2, "stats", cross_iter_depends_on=(("h2d", -1),)),
    ]
    assert infer_cross_stream_event_deps(Schedule.of(tasks)) == {
        "forward": [("prefetch", "prefetch", 0)],
        "backward": [("prefetch", "prefetch", 1)],
        "aux": [("h2d", "memcpy", 1)],
    }


def test_same_stream_edges_need_no_event() -> None:
    tasks = [t("a", 1, writes=("x",)), t("b", 0, reads=("x",))]
    assert infer_cross_stream_event_deps(Schedule.of(tasks)) == {}


def test_one_wait_per_producer_stream_keeps_the_most_recent_event() -> None:
    # p_old recorded two progresses ago, p_new in this one: both on "memcpy".
    tasks = [
        t("p_old", 2, "memcpy", writes=("x",)),
        t("p_new", 0, "memcpy"),
        t("c", 0, reads=("x",), depends_on=("p_new",)),
    ]
    assert infer_cross_stream_event_deps(Schedule.of(tasks)) == {"c": [("p_new", "memcpy", 0)]}


def test_same_delta_keeps_the_later_task_in_topological_order() -> None:
    tasks = [t("p1", 0, "memcpy"), t("p2", 0, "memcpy"), t("c", 0, depends_on=("p2", "p1"))]
    assert infer_cross_stream_event_deps(Schedule.of(tasks)) == {"c": [("p2", "memcpy", 0)]}


def test_waits_on_several_streams_each_appear_once() -> None:
    tasks = [
        t("a", 1, "memcpy", writes=("x",)),
        t("b", 1, "data_dist", writes=("y",)),
        t("c", 1, reads=("x", "y")),
    ]
    assert infer_cross_stream_event_deps(Schedule.of(tasks)) == {
        "c": [("a", "memcpy", 1), ("b", "data_dist", 1)]
    }
