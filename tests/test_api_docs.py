"""docs/api.md is generated from the docstrings and must match them."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

@pytest.fixture(scope="module")
def builder() -> ModuleType:
    # docs/ is not a package: load the generator from its file.
    spec = importlib.util.spec_from_file_location("build_api", ROOT / "docs" / "build_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_up_to_date(builder: ModuleType) -> None:
    text, _ = builder.build()
    current = (ROOT / "docs" / "api.md").read_text()
    assert current == text, "docs/api.md is stale: run `python docs/build_api.py`"


def test_every_public_name_is_documented(builder: ModuleType) -> None:
    _, missing = builder.build()
    assert list(missing) == [], "add docstrings to these public names"


def test_the_reference_covers_every_exported_name(builder: ModuleType) -> None:
    import aiopipe

    text, _ = builder.build()
    headings = set(re.findall(r"^### (?:class )?`(\w+)(?:\(\))?`$", text, re.M))
    assert set(aiopipe.__all__) <= headings
    assert "```python\nTask.from_fn(" not in text  # methods are listed, not given headings
    assert "- *classmethod* `from_fn(name: str, fn: TaskBody, *, stream: str = 'default'" in text
    assert " at 0x" not in text  # no object addresses: the file must not change run to run


def test_hstu_guide_names_every_exported_name() -> None:
    import hstu_tasks  # documented by hand in docs/hstu.md (the generator imports no torchrec)

    guide = (ROOT / "docs" / "hstu.md").read_text()
    section = guide[guide.index("## Public names") :]
    named = set(re.findall(r"`(\w+)", section[: section.index("\n## ")]))
    assert set(hstu_tasks.__all__) <= named, set(hstu_tasks.__all__) - named


def test_docstring_markup_becomes_markdown(builder: ModuleType) -> None:
    doc = '''Title line.

    Uses ``code``, :class:`~aiopipe.trace.Tracer` and :func:`aiopipe.run`::

        pipe.run()

    ====  =====
    a     b
    ====  =====
    1     2
    ====  =====
    '''
    assert builder.markdown(doc) == (
        "Title line.\n\nUses `code`, `Tracer` and `aiopipe.run`:\n\n```text\npipe.run()\n```\n\n"
        "```text\n====  =====\na     b\n====  =====\n1     2\n====  =====\n```"
    )


def inline_code(page: str) -> list[str]:
    """The inline code spans of a guide (fenced blocks left out), newlines folded."""
    text = re.sub(r"^```.*?^```", "", (ROOT / "docs" / page).read_text(), flags=re.S | re.M)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text)]


#: Calls docs/sparse-dist.md names that are not members of the pipelines.
NOT_MEMBERS = {"iter": "the builtin", "model_fwd": "the model or custom_model_fwd"}


def test_every_call_the_sparse_dist_guide_names_is_a_member() -> None:
    """``drain()``, ``statistics()``, ``pipe.results(...)``: each exists on both
    pipelines (the blocking form's calls on ``blocking()``)."""
    from hstu_tasks import SparseDistEvalPipeline, SparseDistPipeline

    call = re.compile(r"(?:await |async for \w+ in )?(?:pipe\.)?([a-z_]\w*)\(")
    spans = inline_code("sparse-dist.md")
    called = {match.group(1) for span in spans if (match := call.match(span))}
    assert {"statistics", "drain", "detach", "attach", "reset", "aclose", "results"} <= called
    for pipeline in (SparseDistPipeline, SparseDistEvalPipeline):
        missing = {name for name in called - NOT_MEMBERS.keys() if not hasattr(pipeline, name)}
        assert not missing, f"{pipeline.__name__} lacks {sorted(missing)}"
    assert all(hasattr(SparseDistPipeline, name) for name in ("__aenter__", "eval_pipeline"))


def documented_parameters(page: str, name: str) -> list[list[str]]:
    """The parameter lists of every ``name(...)`` span of a guide (defaults dropped)."""
    found = []
    for span in inline_code(page):
        if span.startswith(f"{name}(") and span.endswith(")"):
            found.append([p.split("=")[0].strip() for p in span[len(name) + 1 : -1].split(",")])
    return found


@pytest.mark.parametrize("page, name", [
    ("sparse-dist.md", "SparseDistPipeline"), ("hstu.md", "SparseDistPipeline"),
    ("hstu.md", "SparseDistEvalPipeline"), ("hstu.md", "HSTUPipeline"),
])  # fmt: skip
def test_the_guides_give_the_adapter_constructors_parameters(page: str, name: str) -> None:
    import inspect

    import hstu_tasks

    parameters = inspect.signature(getattr(hstu_tasks, name)).parameters.values()
    actual = [p.name for p in parameters]
    first_keyword = next(i for i, p in enumerate(parameters) if p.kind is p.KEYWORD_ONLY)
    actual.insert(first_keyword, "*")
    documented = documented_parameters(page, name)
    assert documented, f"{page} gives no {name}(...) call"
    for listed in documented:
        if listed[-1] == "...":  # the rest as above
            assert listed[:-1] == actual[: len(listed) - 1], (page, listed)
        else:
            assert listed == actual, (page, listed)


#: Dotted spans of the guides that are not Python names.
NOT_NAMES = {"aiopipe.hstu": "a logger's name (docs/logging.md)"}


def dotted_names(span: str) -> str | None:
    """``aiopipe.basic``, ``SchedulablePipeline.blocking(...)``: the dotted name a
    span starts with, if it starts with the package or one of its exported names."""
    import aiopipe

    match = re.match(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)", span)
    if match is None:
        return None
    root = match.group(1).split(".")[0]
    return match.group(1) if root == "aiopipe" or root in aiopipe.__all__ else None


def resolves(dotted: str) -> bool:
    import aiopipe

    parts = dotted.split(".")
    target: object = aiopipe if parts[0] == "aiopipe" else getattr(aiopipe, parts[0])
    for index, part in enumerate(parts[1:], 1):
        if hasattr(target, part):
            target = getattr(target, part)
            continue
        try:  # a submodule: aiopipe.timeline.write_timeline
            target = importlib.import_module(".".join(parts[: index + 1]))
        except ImportError:
            return False
    return True


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_aiopipe_name_a_guide_gives_exists(page: str) -> None:
    """A renamed or removed name still named in a guide (``SchedulablePipeline.basic``
    outlived its move to ``aiopipe.basic`` in three guides)."""
    names = {name for span in inline_code(page) if (name := dotted_names(span))}
    missing = sorted(name for name in names - NOT_NAMES.keys() if not resolves(name))
    assert not missing, f"docs/{page} names {missing}, which do not exist"
