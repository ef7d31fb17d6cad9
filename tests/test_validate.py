"""The eight validation rules: each failure carries its rule number and names the culprits."""

from __future__ import annotations

import pytest

from aiopipe import (
    DataSlot,
    SchedulablePipeline,
    Schedule,
    ScheduleValidationError,
    StreamPool,
    Task,
    TaskDefinitionError,
    validate_schedule,
)


def noop(ctx: object) -> None:
    return None


def t(name: str, la: int = 0, stream: str = "default", **fields: object) -> Task:
    return Task.from_fn(name, noop, lookahead=la, stream=stream, **fields)


def rule_of(tasks: list[Task], pool: StreamPool | None = None, **schedule: object) -> tuple[int, str]:
    with pytest.raises(ScheduleValidationError) as info:
        validate_schedule(Schedule.of(tasks, **schedule), pool)  # type: ignore[arg-type]
    return info.value.rule, str(info.value)


def test_valid_schedule_passes() -> None:
    validate_schedule(
        Schedule.of([t("a", 1, "memcpy", writes=("x",)), t("b", reads=("x", "batch_cpu"))])
    )


def test_rule_1_duplicate_names() -> None:
    rule, message = rule_of([t("a"), t("a")])
    assert rule == 1 and "'a'" in message


def test_rule_1_an_empty_schedule_is_refused() -> None:
    rule, message = rule_of([])
    assert rule == 1 and "no tasks" in message


def test_a_negative_lookahead_is_refused_when_the_task_is_built() -> None:
    with pytest.raises(TaskDefinitionError, match="'a': lookahead is -1; it must be >= 0"):
        t("a", -1)


def test_rule_2_slot_offset_must_match_lookahead() -> None:
    rule, message = rule_of([t("a", 0, reads=(DataSlot("x", 2),)), t("w", 2, writes=("x",))])
    assert rule == 2 and "'a'" in message and "'x'" in message


def test_rule_3_stream_not_in_stream_slots() -> None:
    rule, message = rule_of([t("a", stream="memcpy")], stream_slots=("default",))
    assert rule == 3 and "'memcpy'" in message and "stream_slots" in message


def test_rule_3_stream_not_in_pool() -> None:
    rule, message = rule_of([t("a", stream="memcpy")], StreamPool({"default": None}))
    assert rule == 3 and "StreamPool" in message


def test_rule_4_two_writers_of_a_slot() -> None:
    rule, message = rule_of([t("a", 1, writes=("x",)), t("b", 0, writes=("x",))])
    assert rule == 4 and "'a'" in message and "'b'" in message and "'x'" in message


def test_rule_4_batch_cpu_is_the_engines() -> None:
    rule, message = rule_of([t("a", writes=("batch_cpu",))])
    assert rule == 4 and "batch_cpu" in message


def test_rule_5_read_without_writer() -> None:
    rule, message = rule_of([t("a", reads=("ghost",))])
    assert rule == 5 and "'ghost'" in message


def test_rule_5_read_whose_only_writer_is_shallower() -> None:
    rule, message = rule_of([t("w", 0, writes=("x",)), t("r", 1, reads=("x",))])
    assert rule == 5 and "'w'" in message and "'r'" in message and "not exist yet" in message


def test_rule_5_batch_cpu_needs_no_writer() -> None:
    validate_schedule(Schedule.of([t("a", 3, reads=("batch_cpu",))]))


@pytest.mark.parametrize("field", ["depends_on", "same_progress_sync", "cross_iter_depends_on"])
def test_rule_6_unknown_dependency(field: str) -> None:
    rule, message = rule_of([t("a", **{field: ("ghost",)})])
    assert rule == 6 and "'ghost'" in message and field in message


def test_rule_6_depends_on_future_read() -> None:
    rule, message = rule_of([t("c", 2, depends_on=("p",)), t("p", 1)])
    assert rule == 6 and "future read" in message


def test_rule_6_cross_iter_future_read() -> None:
    rule, message = rule_of([t("c", 3, cross_iter_depends_on=("p",)), t("p", 0)])
    assert rule == 6 and "Δ=-2" in message


def test_rule_7_cycle_names_the_cycle() -> None:
    rule, message = rule_of([t("a", reads=("y",), writes=("x",)), t("b", reads=("x",), writes=("y",))])
    assert rule == 7 and "a -> b -> a" in message


def test_rule_8_cross_stream_event_rotated_out() -> None:
    rule, message = rule_of([t("p", 0, "memcpy"), t("c", 0, cross_iter_depends_on=("p",))])
    assert rule == 8 and "'c'" in message and "'p'" in message


def test_rules_are_checked_in_order() -> None:
    rule, _ = rule_of([t("a", 0, reads=(DataSlot("ghost", 2),)), t("a")])
    assert rule == 1


def test_pipeline_constructor_validates() -> None:
    with pytest.raises(ScheduleValidationError):
        SchedulablePipeline(Schedule.of([t("a", reads=("ghost",))]))


def test_validation_error_is_a_value_error() -> None:
    assert issubclass(ScheduleValidationError, ValueError)
