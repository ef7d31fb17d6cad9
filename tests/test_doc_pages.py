"""The guides stay guides: measurements live in docs/performance.md, which they link
to, and every link between the pages lands on a heading that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: Pages that are not guides: the measurements, and the generated reference.
NOT_GUIDES = {"performance.md", "api.md"}
GUIDES = sorted(p.name for p in DOCS.glob("*.md") if p.name not in NOT_GUIDES)
#: Column titles of a table of measurements.
MEASURED = re.compile(r"steps/s|req/s|throughput|busy|measured|\bms\b|x torchrec|x plain|p50|p99")
LINK = re.compile(r"\]\(([\w./-]*\.md)?(#[^)\s]*)?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def prose(path: Path) -> str:
    """The page without its fenced blocks."""
    return FENCE.sub("", path.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)$", prose(path), re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
    return {base if n == 0 else f"{base}-{n}" for base, total in seen.items() for n in range(total)}


@pytest.mark.parametrize("page", GUIDES)
def test_a_guide_links_its_measurements_instead_of_holding_them(page: str) -> None:
    text = prose(DOCS / page)
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    assert not [h for h in headings if h.startswith(("Measured", "Checked against"))], page
    header_rows = re.findall(r"^\|(.+)\|\n\|[-| ]+\|$", text, re.M)
    tables = [row for row in header_rows if MEASURED.search(row.lower())]
    assert not tables, f"{page}: move these tables to performance.md and link them: {tables}"


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in DOCS.glob("*.md"))])
def test_every_link_between_the_pages_lands_on_a_heading(page: str) -> None:
    path = ROOT / page if page == "README.md" else DOCS / page
    broken = []
    for target, anchor in LINK.findall(prose(path)):
        linked = (path.parent / target).resolve() if target else path
        if not linked.is_file():
            broken.append(f"{target}{anchor}")
        elif anchor and anchor[1:] not in anchors(linked):
            broken.append(f"{target}{anchor}")
    assert not broken, f"{page}: {broken}"
