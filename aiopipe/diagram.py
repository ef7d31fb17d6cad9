"""Schedule diagrams: Graphviz DOT and Mermaid text, and pictures rendered by Graphviz.

One node per task, labelled with its name, lookahead and stream (plus ``nccl`` for
tasks that take a collective ticket and ``async`` for coroutine bodies); nodes are
grouped into one box per lane (the ``thread_map`` the async executor would use) or
per stream.  Every declared dependency is one edge, drawn by kind:

======================  ==========  ==========================================
kind                    line        label
======================  ==========  ==========================================
slot (reads/writes)     solid       the slot name(s)
depends_on              bold        ``depends_on``
cross_iter_depends_on   dashed      ``Δ=N`` (Δ=0 is promoted to a same-progress wait)
same_progress_sync      dotted      ``sync``
======================  ==========  ==========================================

A ``same_progress_sync`` that keeps one side (``same_progress_sync_sides``) is
labelled ``sync (cpu)`` or ``sync (device)``.

Edges with Δ >= 1 (satisfied by ring rotation, so they never order tasks inside a
progress) also carry ``Δ=N`` and, in DOT, do not constrain the layout: the picture
reads left to right in same-progress order.  Lanes are spaced so that the label of
an edge from one lane to the next sits in the gap, not on the next lane's title, and
a task's loop onto itself is drawn on its right-hand side, clear of the title above.

``to_dot`` and ``to_mermaid`` need nothing beyond the standard library; PNG, SVG and
PDF need the Graphviz ``dot`` program on ``PATH``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .errors import ConfigurationError, PipelineError
from .lanes import ThreadMap, resolve_lane
from .edges import Edge, dependency_edges
from .schedule import Schedule
from .task import Task

__all__ = (
    "RENDER_FORMATS",
    "TEXT_FORMATS",
    "GroupBy",
    "RenderError",
    "format_for",
    "render",
    "to_dot",
    "to_mermaid",
    "write",
)

#: How tasks are boxed together: by the lane that runs them, by stream, or not at all.
GroupBy = Literal["lane", "stream", "none"]
#: Formats produced without Graphviz.
TEXT_FORMATS = ("dot", "mermaid")
#: Formats rendered by the Graphviz ``dot`` program.
RENDER_FORMATS = ("svg", "png", "pdf")

_SUFFIXES = {".dot": "dot", ".gv": "dot", ".mmd": "mermaid", ".mermaid": "mermaid",
             ".svg": "svg", ".png": "png", ".pdf": "pdf"}  # fmt: skip

# Per edge kind: DOT attributes, Mermaid arrow, Mermaid link style.
_DOT_STYLE = {
    "slot": 'style=solid, color="#404040"',
    "depends_on": 'style=bold, color="#1f77b4"',
    "cross_iter": 'style=dashed, color="#9467bd"',
    "same_progress_sync": 'style=dotted, color="#d62728", penwidth=1.6',
}
_MERMAID_ARROW = {"slot": "-->", "depends_on": "==>", "cross_iter": "-.->",
                  "same_progress_sync": "-.->"}  # fmt: skip
_MERMAID_LINK_STYLE = {
    "slot": "stroke:#404040",
    "depends_on": "stroke:#1f77b4,stroke-width:3px",
    "cross_iter": "stroke:#9467bd,stroke-dasharray:8 4",
    "same_progress_sync": "stroke:#d62728,stroke-dasharray:2 3",
}
# Fill per lookahead: deeper tasks (further ahead of the step) are darker.
_FILLS = ("#ffffff", "#e3eefa", "#c6dcf4", "#a9caee", "#8cb8e8")


class RenderError(PipelineError, RuntimeError):
    """A picture could not be rendered: the Graphviz ``dot`` program is missing or
    failed, or the requested format is unknown."""


@dataclass(frozen=True)
class _Link:
    """One drawn edge: the declared edges of one kind between two tasks, merged."""

    producer: str
    consumer: str
    kind: str
    delta: int
    label: str


def _links(edges: Sequence[Edge]) -> list[_Link]:
    """Merge the slot edges between one producer and consumer (one arrow, every slot
    name on it); every other declared dependency stays its own arrow."""
    merged: dict[tuple[str, str, str, int], list[str]] = {}
    sides: dict[tuple[str, str, str, int], str] = {
        (e.producer, e.consumer, e.kind, e.delta): e.sides for e in edges
    }
    for edge in edges:
        key = (edge.producer, edge.consumer, edge.kind, edge.delta)
        names = merged.setdefault(key, [])
        if edge.slot is not None:
            names.append(edge.slot)
    links = []
    for (producer, consumer, kind, delta), slots in merged.items():
        if kind == "slot":
            label = ", ".join(slots)
        elif kind == "depends_on":
            label = "depends_on"
        elif kind == "cross_iter":
            label = "Δ=0 (sync)" if delta == 0 else ""
        else:  # a one-sided sync names the side it keeps
            side = sides[(producer, consumer, kind, delta)]
            label = "sync" if side == "both" else f"sync ({side})"
        if delta > 0:
            label = f"{label} Δ={delta}" if label else f"Δ={delta}"
        links.append(_Link(producer, consumer, kind, delta, label))
    return links


def _groups(
    tasks: Sequence[Task], group_by: GroupBy, thread_map: ThreadMap
) -> dict[str, list[Task]]:
    """Box title -> its tasks, in declaration order; ``{"": tasks}`` without boxes."""
    if group_by == "none":
        return {"": list(tasks)}
    groups: dict[str, list[Task]] = {}
    for task in tasks:
        if group_by == "lane":
            title = f"lane {resolve_lane(task, thread_map)}"
        elif group_by == "stream":
            title = f"stream {task.stream}"
        else:
            raise ConfigurationError(
                f"group_by must be 'lane', 'stream' or 'none', got {group_by!r}"
            )
        groups.setdefault(title, []).append(task)
    return groups


def _label_lines(task: Task, stage: int | None) -> list[str]:
    lines = [task.name, f"la {task.lookahead} · {task.stream}"]
    flags = [flag for flag, on in (("nccl", task.nccl), ("async", task.is_async)) if on]
    if stage is not None:
        flags.append(f"stage {stage}")
    if flags:
        lines.append(" ".join(flags))
    return lines


def _stage_of(schedule: Schedule) -> dict[str, int | None]:
    """Stage numbers, shown only when the schedule has more than one stage."""
    several = len(schedule.stages) > 1
    return {task.name: (i if several else None)
            for i, stage in enumerate(schedule.stages) for task in stage.tasks}  # fmt: skip


def _caption(schedule: Schedule, title: str | None) -> str:
    tasks = schedule.tasks
    summary = (f"{len(tasks)} tasks, max lookahead {schedule.max_lookahead} "
               f"({schedule.in_flight_batches} batches in flight)")  # fmt: skip
    return f"{title}: {summary}" if title else summary


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(
    schedule: Schedule,
    thread_map: ThreadMap = None,
    *,
    group_by: GroupBy = "lane",
    rankdir: str = "LR",
    title: str | None = None,
) -> str:
    """The schedule as a Graphviz DOT digraph.

    ``thread_map`` is the async executor's (``None``: one lane per stream); with
    ``group_by="lane"`` each lane is a ``cluster_*`` subgraph labelled ``lane NAME``,
    with ``"stream"`` each stream, with ``"none"`` there are no clusters.  Raises
    :class:`~aiopipe.ScheduleValidationError` when a dependency cannot be resolved
    (an unknown task, a future read).
    """
    stage_of = _stage_of(schedule)
    out = [
        "digraph schedule {",
        f"    rankdir={rankdir};",
        f"    label={_dot_quote(_caption(schedule, title))};",
        '    labelloc="t"; fontname="Helvetica";',
        # Lanes stack across the ranks: the gap between them holds the label of an
        # edge from one lane to the next, below the next lane's title, not on it.
        "    nodesep=0.6;",
        '    node [shape=box, style="rounded,filled", fontname="Helvetica"];',
        '    edge [fontname="Helvetica", fontsize=10];',
    ]

    def node(task: Task, indent: str) -> str:
        attrs = [
            f"label={_dot_quote(chr(10).join(_label_lines(task, stage_of[task.name])))}",
            f'fillcolor="{_FILLS[min(task.lookahead, len(_FILLS) - 1)]}"',
        ]
        if task.nccl:
            attrs.append("peripheries=2")
        return f"{indent}{_dot_quote(task.name)} [{', '.join(attrs)}];"

    for number, (box, tasks) in enumerate(_groups(schedule.tasks, group_by, thread_map).items()):
        if not box:
            out.extend(node(task, "    ") for task in tasks)
            continue
        out.append(f"    subgraph cluster_{number} {{")
        out.append(f"        label={_dot_quote(box)};")
        out.append('        style="rounded,dashed"; color="#7f7f7f"; labeljust="l"; '
                   'fontname="Helvetica-Bold"; fontcolor="#505050";')
        out.extend(node(task, "        ") for task in tasks)
        out.append("    }")
    for link in _links(dependency_edges(schedule)):
        attrs = [_DOT_STYLE[link.kind]]
        if link.label:
            attrs.append(f"label={_dot_quote(link.label)}")
        if link.delta > 0:
            attrs.append("constraint=false")  # ring rotation, not same-progress order
        if link.producer == link.consumer:  # a loop on the east side, clear of titles above
            attrs.append("tailport=e, headport=e")
        out.append(f"    {_dot_quote(link.producer)} -> {_dot_quote(link.consumer)} "
                   f"[{', '.join(attrs)}];")  # fmt: skip
    out.append("}")
    return "\n".join(out) + "\n"


def _mermaid_text(text: str) -> str:
    # Mermaid labels are HTML-ish: escape what would end the quoted label or a tag.
    return (text.replace("&", "#amp;").replace('"', "#quot;")
            .replace("<", "#lt;").replace(">", "#gt;"))  # fmt: skip


def _mermaid_ids(tasks: Sequence[Task]) -> dict[str, str]:
    """Mermaid node ids: ``t_`` + the name with odd characters replaced (the prefix
    keeps keywords such as ``end`` from being read as syntax), made unique."""
    ids: dict[str, str] = {}
    used: set[str] = set()
    for task in tasks:
        base = "t_" + "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_"
                              for c in task.name)  # fmt: skip
        candidate, n = base, 1
        while candidate in used:
            n += 1
            candidate = f"{base}_{n}"
        used.add(candidate)
        ids[task.name] = candidate
    return ids


def to_mermaid(
    schedule: Schedule,
    thread_map: ThreadMap = None,
    *,
    group_by: GroupBy = "lane",
    direction: str = "LR",
    title: str | None = None,
) -> str:
    """The schedule as a Mermaid flowchart (renders on GitHub, GitLab, most wikis).

    Same content as :func:`to_dot`: lanes or streams become ``subgraph`` boxes, edge
    kinds differ by arrow (``-->`` slot, ``==>`` depends_on, ``-.->`` cross-iteration
    and sync) and by ``linkStyle`` colour; collective (``nccl``) tasks are drawn with
    the double-sided subroutine shape.
    """
    ids = _mermaid_ids(schedule.tasks)
    stage_of = _stage_of(schedule)
    # Front matter is YAML: a JSON string is a valid YAML scalar whatever the title holds.
    caption = json.dumps(_caption(schedule, title), ensure_ascii=False)
    out = ["---", f"title: {caption}", "---", f"flowchart {direction}"]

    def node(task: Task, indent: str) -> str:
        lines = _label_lines(task, stage_of[task.name])
        label = "<br/>".join(_mermaid_text(line) for line in lines)
        opening, closing = ("[[", "]]") if task.nccl else ("[", "]")
        shade = f"la{min(task.lookahead, len(_FILLS) - 1)}"
        return f'{indent}{ids[task.name]}{opening}"{label}"{closing}:::{shade}'

    for number, (box, tasks) in enumerate(_groups(schedule.tasks, group_by, thread_map).items()):
        if not box:
            out.extend(node(task, "    ") for task in tasks)
            continue
        out.append(f'    subgraph g{number}["{_mermaid_text(box)}"]')
        out.extend(node(task, "        ") for task in tasks)
        out.append("    end")
    by_kind: dict[str, list[int]] = {}
    for index, link in enumerate(_links(dependency_edges(schedule))):
        arrow = _MERMAID_ARROW[link.kind]
        label = f'|"{_mermaid_text(link.label)}"|' if link.label else ""
        out.append(f"    {ids[link.producer]} {arrow}{label} {ids[link.consumer]}")
        by_kind.setdefault(link.kind, []).append(index)
    for kind, indices in by_kind.items():
        out.append(f"    linkStyle {','.join(map(str, indices))} {_MERMAID_LINK_STYLE[kind]}")
    for level in sorted({min(task.lookahead, len(_FILLS) - 1) for task in schedule.tasks}):
        out.append(f"    classDef la{level} fill:{_FILLS[level]},stroke:#404040")
    return "\n".join(out) + "\n"


def render(
    schedule: Schedule,
    format: str = "svg",
    thread_map: ThreadMap = None,
    *,
    dot: str = "dot",
    group_by: GroupBy = "lane",
    title: str | None = None,
    timeout: float = 60.0,
) -> bytes:
    """Render :func:`to_dot` to ``format`` (``"svg"``, ``"png"`` or ``"pdf"``) with the
    Graphviz program ``dot`` (a name looked up on ``PATH``, or a path).

    Raises :class:`RenderError` when Graphviz is not installed or fails.
    """
    if format not in RENDER_FORMATS:
        raise RenderError(
            f"cannot render {format!r}; pictures are {RENDER_FORMATS}, text is {TEXT_FORMATS}"
        )
    source = to_dot(schedule, thread_map, group_by=group_by, title=title)
    program = shutil.which(dot)
    if program is None:
        raise RenderError(
            f"rendering {format.upper()} needs the Graphviz program {dot!r}, which is not on "
            f"PATH. Install Graphviz (e.g. `apt install graphviz`, `brew install graphviz`, "
            f"`conda install graphviz`), or write DOT or Mermaid text instead."
        )
    try:
        done = subprocess.run(
            [program, f"-T{format}"], input=source.encode(), capture_output=True,
            timeout=timeout, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RenderError(f"running Graphviz ({program}) failed: {exc}") from exc
    if done.returncode != 0 or not done.stdout:
        message = done.stderr.decode(errors="replace").strip() or "no output"
        raise RenderError(f"Graphviz ({program}) exited with {done.returncode}: {message}")
    return done.stdout


def format_for(path: str | os.PathLike[str]) -> str:
    """The diagram format a file name asks for, from its suffix."""
    suffix = Path(path).suffix.lower()
    try:
        return _SUFFIXES[suffix]
    except KeyError:
        raise RenderError(
            f"cannot tell the diagram format of {os.fspath(path)!r}; use one of "
            f"{sorted(_SUFFIXES)} or name the format"
        ) from None


def write(
    schedule: Schedule,
    path: str | os.PathLike[str],
    format: str | None = None,
    thread_map: ThreadMap = None,
    *,
    group_by: GroupBy = "lane",
    title: str | None = None,
    dot: str = "dot",
) -> Path:
    """Write a diagram of ``schedule`` to ``path``; the format defaults to the one its
    suffix names (``.dot``/``.gv``, ``.mmd``/``.mermaid``, ``.svg``, ``.png``, ``.pdf``)."""
    format = format or format_for(path)
    target = Path(path)
    if format == "dot":
        target.write_text(to_dot(schedule, thread_map, group_by=group_by, title=title))
    elif format == "mermaid":
        target.write_text(to_mermaid(schedule, thread_map, group_by=group_by, title=title))
    else:
        target.write_bytes(
            render(schedule, format, thread_map, dot=dot, group_by=group_by, title=title)
        )
    return target
