"""The public surface: every public module declares __all__ and it is truthful."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import aiopipe

SPEC_NAMES = {
    "Task", "DataSlot", "Schedule", "Stage", "StreamPool", "TaskContext", "SchedulablePipeline",
    "Pipeline", "SequentialExecutor", "ScheduleValidationError", "AsyncExecutor",
    "ThreadMap", "Source", "AsyncPipeline",
}  # fmt: skip
# The engine's machinery: importable from its module, not exported at the top level.
INTERNALS = {
    "aiopipe.edges": (
        "Edge", "dependency_edges", "topological_sort", "infer_cross_stream_event_deps",
    ),
    "aiopipe.ring": ("BatchRing", "SlotStore"),
}


def public_modules() -> list[str]:
    names = ["aiopipe"]
    for info in pkgutil.walk_packages(aiopipe.__path__, "aiopipe."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


def test_the_specified_names_are_exported() -> None:
    assert SPEC_NAMES <= set(aiopipe.__all__)


@pytest.mark.parametrize("module_name", public_modules())
def test_all_is_declared_and_truthful(module_name: str) -> None:
    module = importlib.import_module(module_name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{module_name} has no __all__"
    assert isinstance(exported, tuple), f"{module_name}.__all__ should be a tuple"
    missing = [name for name in exported if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ names undefined {missing}"
    assert len(set(exported)) == len(exported)


@pytest.mark.parametrize("module_name", sorted(INTERNALS))
def test_internals_stay_in_their_modules(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in INTERNALS[module_name]:
        assert name in module.__all__
        assert name not in aiopipe.__all__


def test_one_root_exception() -> None:
    errors = [getattr(aiopipe, name) for name in aiopipe.__all__ if name.endswith("Error")]
    for error in errors:
        assert issubclass(error, aiopipe.PipelineError), error


def test_the_error_families_keep_their_builtin_bases() -> None:
    """``except ValueError`` / ``except TypeError`` still catch what they caught before."""
    assert issubclass(aiopipe.ConfigurationError, ValueError)
    assert issubclass(aiopipe.ConfigurationTypeError, TypeError)
    assert not issubclass(aiopipe.ConfigurationTypeError, ValueError)
    assert issubclass(aiopipe.PipelineStateError, RuntimeError)
    with pytest.raises(aiopipe.ConfigurationError, match="max_spans") as value_error:
        aiopipe.Tracer(max_spans=0)
    assert isinstance(value_error.value, ValueError)
    with pytest.raises(aiopipe.ConfigurationTypeError, match="a list of tasks") as type_error:
        aiopipe.Schedule.of(42)  # type: ignore[arg-type]
    assert isinstance(type_error.value, TypeError)
