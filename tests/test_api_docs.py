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
