"""Task and DataSlot: normalisation and the construction-time rules."""

from __future__ import annotations

import functools

import pytest

from aiopipe import DataSlot, Task, TaskDefinitionError


def noop(ctx: object) -> None:
    return None


async def async_noop(ctx: object) -> None:
    return None


def test_string_slots_take_the_task_lookahead() -> None:
    task = Task.from_fn("t", noop, lookahead=2, reads=("a", DataSlot("b", 2)), writes="c")
    assert task.reads == (DataSlot("a", 2), DataSlot("b", 2))
    assert task.writes == (DataSlot("c", 2),)


def test_lone_string_dependency_is_one_name_not_characters() -> None:
    task = Task.from_fn("t", noop, depends_on="producer", same_progress_sync="other")
    assert task.depends_on == ("producer",)
    assert task.same_progress_sync == ("other",)


def test_bare_cross_iter_name_means_previous_batch() -> None:
    task = Task.from_fn("t", noop, cross_iter_depends_on=("x", ("y", -3)))
    assert task.cross_iter_depends_on == (("x", -1), ("y", -3))


@pytest.mark.parametrize("offset", [0, 2])
def test_non_negative_cross_iter_offset_is_rejected_naming_the_task(offset: int) -> None:
    with pytest.raises(TaskDefinitionError, match=r"'consumer'.*\('x', " + str(offset)):
        Task.from_fn("consumer", noop, cross_iter_depends_on=(("x", offset),))


@pytest.mark.parametrize(
    "fields",
    [
        {"depends_on": ("x",), "cross_iter_depends_on": ("x",)},
        {"depends_on": ("x",), "same_progress_sync": ("x",)},
        {"cross_iter_depends_on": (("x", -2),), "same_progress_sync": ("x",)},
    ],
)
def test_producer_in_two_dependency_fields_is_rejected(fields: dict) -> None:
    with pytest.raises(TaskDefinitionError, match=r"'consumer' names \['x'\] in both"):
        Task.from_fn("consumer", noop, **fields)


def test_rejections_are_value_errors() -> None:
    with pytest.raises(ValueError):
        Task.from_fn("c", noop, cross_iter_depends_on=(("x", 0),))


def test_subclass_class_attributes_are_normalised_like_keywords() -> None:
    class CountTokens(Task):
        name = "count_tokens"
        lookahead = 1
        reads = ("batch_gpu",)
        writes = ("tokens",)
        cross_iter_depends_on = ("count_tokens",)

        def run(self, ctx: object) -> None:
            return None

    task = CountTokens()
    assert task.reads == (DataSlot("batch_gpu", 1),)
    assert task.writes == (DataSlot("tokens", 1),)
    assert task.cross_iter_depends_on == (("count_tokens", -1),)
    assert CountTokens.reads == ("batch_gpu",)  # the class itself is untouched
    assert not task.is_async


def test_subclass_keywords_override_class_attributes() -> None:
    class Base(Task):
        name = "base"
        stream = "memcpy"

    task = Base(lookahead=3, stream="default")
    assert (task.stream, task.lookahead) == ("default", 3)


def test_subclass_conflicting_fields_are_rejected() -> None:
    class Bad(Task):
        name = "bad"
        depends_on = ("x",)
        same_progress_sync = ("x",)

    with pytest.raises(TaskDefinitionError):
        Bad()


def test_name_is_required() -> None:
    with pytest.raises(TaskDefinitionError, match="name"):
        Task()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lookahead": "1"}, "lookahead must be an int"),
        ({"lookahead": True}, "lookahead must be an int"),
        ({"stream": ""}, "stream"),
        ({"reads": (1,)}, "reads entries"),
        ({"depends_on": (("x", -1),)}, "depends_on entries"),
        ({"cross_iter_depends_on": (("x", "-1"),)}, r"must be \(str, int\)"),
    ],
)
def test_bad_field_types_are_type_errors(fields: dict, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        Task.from_fn("t", noop, **fields)


def test_unknown_field_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unknown field"):
        Task("t", lookahaed=1)


def test_async_detection() -> None:
    assert Task.from_fn("a", async_noop).is_async
    assert Task.from_fn("p", functools.partial(async_noop)).is_async
    assert not Task.from_fn("s", noop).is_async

    class AsyncTask(Task):
        name = "at"

        async def run(self, ctx: object) -> None:
            return None

    assert AsyncTask().is_async


def test_dataslot_rejects_negative_offsets_and_empty_names() -> None:
    with pytest.raises(ValueError, match="offset must be >= 0"):
        DataSlot("x", -1)
    with pytest.raises(TypeError):
        DataSlot("", 0)
    assert DataSlot("x", 1) == DataSlot("x", 1) != DataSlot("x", 0)


def test_duplicate_entries_collapse() -> None:
    task = Task.from_fn("t", noop, reads=("a", "a"), depends_on=("x", "x"))
    assert task.reads == (DataSlot("a", 0),)
    assert task.depends_on == ("x",)


def test_negative_lookahead_is_refused_at_construction() -> None:
    with pytest.raises(TaskDefinitionError, match="'t': lookahead is -2; it must be >= 0"):
        Task.from_fn("t", noop, lookahead=-2)

    class Deep(Task):
        name = "deep"
        lookahead = -1

    with pytest.raises(TaskDefinitionError, match="'deep': lookahead is -1"):
        Deep()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", "other"), ("lookahead", 3), ("stream", "memcpy"), ("reads", ("x",)),
        ("writes", ("y",)), ("depends_on", ("p",)), ("cross_iter_depends_on", ("p",)),
        ("same_progress_sync", ("p",)), ("same_progress_sync_sides", {}), ("nccl", True),
        ("priority", 2),
    ],
)  # fmt: skip
def test_declared_fields_are_read_only_after_construction(field: str, value: object) -> None:
    task = Task.from_fn("t", noop, lookahead=1, writes=("w",))
    before = getattr(task, field)
    with pytest.raises(AttributeError, match=rf"'t': {field} is read-only.*task.replace\({field}="):
        setattr(task, field, value)
    with pytest.raises(AttributeError, match="read-only"):
        delattr(task, field)
    assert getattr(task, field) == before


def test_subclasses_set_fields_before_super_init_and_keep_their_own_attributes() -> None:
    class Prefetch(Task):
        name = "prefetch"
        stream = "prefetch"

        def __init__(self, depth: int) -> None:
            self.lookahead = depth  # before super().__init__: still being declared
            super().__init__()
            self.calls = 0  # not a declared field: free to change

        def run(self, ctx: object) -> None:
            self.calls += 1

    task = Prefetch(2)
    assert (task.lookahead, task.stream) == (2, "prefetch")
    task.run(None)
    assert task.calls == 1
    with pytest.raises(AttributeError, match="'prefetch': lookahead is read-only"):
        task.lookahead = 3


def test_replace_builds_a_normalised_copy_and_leaves_the_task_alone() -> None:
    task = Task.from_fn("t", noop, lookahead=1, reads=("x",), same_progress_sync=("p",))
    moved = task.replace(lookahead=2, reads=("x",), stream="memcpy", name="t2")
    assert (moved.name, moved.lookahead, moved.stream) == ("t2", 2, "memcpy")
    assert moved.reads == (DataSlot("x", 2),)  # bare names normalised again
    assert moved.same_progress_sync == ("p",)  # unchanged fields carried over
    assert (task.name, task.lookahead, task.reads) == ("t", 1, (DataSlot("x", 1),))
    with pytest.raises(AttributeError, match="read-only"):
        moved.lookahead = 0
    with pytest.raises(TaskDefinitionError, match="lookahead is -1"):
        task.replace(lookahead=-1)
    with pytest.raises(TypeError, match=r"unknown field.*did you mean 'lookahead'\?"):
        task.replace(lookahaed=1)


def test_same_progress_sync_sides_name_listed_producers_and_a_known_side() -> None:
    task = Task.from_fn("c", noop, same_progress_sync=("a", "b", "x"),
                        same_progress_sync_sides={"a": "cpu", "b": "device"})  # fmt: skip
    assert (task.sync_side("a"), task.sync_side("b"), task.sync_side("x")) == (
        "cpu", "device", "both",
    )  # fmt: skip
    with pytest.raises(TaskDefinitionError, match="names 'z', which is not in its same_progress_sync"):
        Task.from_fn("c", noop, same_progress_sync=("a",), same_progress_sync_sides={"z": "cpu"})
    with pytest.raises(TaskDefinitionError, match=r"\['a'\] is 'gpu'; use 'cpu'"):
        Task.from_fn("c", noop, same_progress_sync=("a",), same_progress_sync_sides={"a": "gpu"})
    with pytest.raises(TypeError, match="must map producer names"):
        Task.from_fn("c", noop, same_progress_sync=("a",), same_progress_sync_sides=["a"])  # type: ignore[arg-type]
    assert task.same_progress_sync_sides == (("a", "cpu"), ("b", "device"))  # sync order


def test_same_progress_sync_sides_as_a_class_attribute() -> None:
    sides = {"prefetch": "device"}

    class Backward(Task):
        name = "backward"
        same_progress_sync = ("prefetch",)
        same_progress_sync_sides = sides

    task = Backward()
    sides["prefetch"] = "cpu"  # the task keeps its own immutable copy
    assert task.same_progress_sync_sides == (("prefetch", "device"),)
    assert task.sync_side("prefetch") == "device"
    assert task.replace(stream="s").sync_side("prefetch") == "device"  # normalised again
