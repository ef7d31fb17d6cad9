"""Schedule diagrams: DOT and Mermaid structure, and rendering through Graphviz."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schedules import Trace, build_tasks, schedule_specs, thread_maps

from aiopipe import Schedule, ScheduleValidationError, Stage, Task
from aiopipe.diagram import RenderError, format_for, render, to_dot, to_mermaid, write
from aiopipe.edges import dependency_edges
from aiopipe.lanes import resolve_lane


def noop(ctx: object) -> None:
    return None


async def async_noop(ctx: object) -> None:
    return None


def every_kind() -> Schedule:
    """One edge of each kind, two slots between one pair, three streams."""
    return Schedule.of([
        Task.from_fn("load", noop, lookahead=2, stream="memcpy", writes=("raw", "meta")),
        Task.from_fn("prep", noop, lookahead=1, stream="io", reads=("raw", "meta"),
                     writes=("features",), same_progress_sync=("forward",)),
        Task.from_fn("zero_grad", async_noop),
        Task.from_fn("forward", noop, reads=("features",), writes=("loss",),
                     depends_on=("zero_grad",), nccl=True),
        Task.from_fn("log", noop, cross_iter_depends_on=(("forward", -2),)),
        Task.from_fn("pace", noop, lookahead=1, stream="io", cross_iter_depends_on=("forward",)),
    ])  # fmt: skip


# -- a reader for the DOT this module writes (structure, not layout) ---------------------

ATTR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^,\]\s]+)')
NODE = re.compile(r'^\s*"((?:[^"\\]|\\.)*)" \[(.*)\];$')
LINK = re.compile(r'^\s*"((?:[^"\\]|\\.)*)" -> "((?:[^"\\]|\\.)*)" \[(.*)\];$')


def unquote(text: str) -> str:
    if text.startswith('"'):
        text = text[1:-1]
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


@dataclass
class Dot:
    nodes: dict[str, dict[str, str]] = field(default_factory=dict)
    cluster_of: dict[str, str] = field(default_factory=dict)  # node -> cluster label
    edges: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    clusters: int = 0


def parse_dot(text: str) -> Dot:
    dot = Dot()
    cluster: str | None = None
    assert text.startswith("digraph schedule {") and text.rstrip().endswith("}")
    for line in text.splitlines()[1:-1]:
        if line.strip().startswith("subgraph cluster_"):
            cluster, dot.clusters = "", dot.clusters + 1
        elif line.strip() == "}":
            cluster = None
        elif cluster is not None and line.strip().startswith("label="):
            cluster = unquote(line.strip()[len("label="):].rstrip(";"))
        elif match := LINK.match(line):
            attrs = {k: unquote(v) for k, v in ATTR.findall(match.group(3))}
            producer, consumer = (unquote(f'"{match.group(i)}"') for i in (1, 2))
            dot.edges.append((producer, consumer, attrs))
        elif match := NODE.match(line):
            name = unquote(f'"{match.group(1)}"')
            dot.nodes[name] = {k: unquote(v) for k, v in ATTR.findall(match.group(2))}
            if cluster is not None:
                dot.cluster_of[name] = cluster
    return dot


def edge(dot: Dot, producer: str, consumer: str) -> dict[str, str]:
    found = [attrs for p, c, attrs in dot.edges if (p, c) == (producer, consumer)]
    assert len(found) == 1, f"{producer} -> {consumer}: {found}"
    return found[0]


# -- DOT -----------------------------------------------------------------------------------


def test_dot_styles_each_edge_kind() -> None:
    dot = parse_dot(to_dot(every_kind()))
    slot = edge(dot, "load", "prep")
    assert slot["style"] == "solid" and slot["label"] == "raw, meta Δ=1"  # merged, rotated
    assert slot["constraint"] == "false"  # ring rotation must not bend the layout
    assert edge(dot, "prep", "forward")["label"] == "features Δ=1"
    depends = edge(dot, "zero_grad", "forward")
    assert depends["style"] == "bold" and depends["label"] == "depends_on"
    assert "constraint" not in depends  # a same-progress edge orders the picture
    cross = edge(dot, "forward", "log")
    assert cross["style"] == "dashed" and cross["label"] == "Δ=2"
    promoted = edge(dot, "forward", "pace")  # pace (la 1) on forward (la 0) one back: Δ=0
    assert promoted["style"] == "dashed" and promoted["label"] == "Δ=0 (sync)"
    assert "constraint" not in promoted
    sync = edge(dot, "forward", "prep")
    assert sync["style"] == "dotted" and sync["label"] == "sync"
    assert len({attrs["color"] for _, _, attrs in dot.edges}) == 4  # one colour per kind
    assert len(dot.edges) == 6


def test_dot_nodes_carry_lookahead_stream_and_flags() -> None:
    dot = parse_dot(to_dot(every_kind()))
    assert set(dot.nodes) == {t.name for t in every_kind().tasks}
    assert dot.nodes["load"]["label"] == "load\nla 2 · memcpy"
    assert dot.nodes["forward"]["label"] == "forward\nla 0 · default\nnccl"
    assert dot.nodes["forward"]["peripheries"] == "2"
    assert "peripheries" not in dot.nodes["load"]
    assert dot.nodes["zero_grad"]["label"].endswith("\nasync")
    fills = {name: attrs["fillcolor"] for name, attrs in dot.nodes.items()}
    assert fills["load"] != fills["prep"] != fills["forward"]  # shaded by lookahead
    assert fills["forward"] == fills["log"]


def test_dot_clusters_follow_lanes_or_streams() -> None:
    schedule = every_kind()
    by_stream_lanes = parse_dot(to_dot(schedule))  # default thread map: a lane per stream
    assert by_stream_lanes.cluster_of == {
        "load": "lane memcpy", "prep": "lane io", "pace": "lane io", "zero_grad": "lane default",
        "forward": "lane default", "log": "lane default",
    }  # fmt: skip
    mapped = parse_dot(to_dot(schedule, {"load": "io", "prep": "io", "forward": "compute"}))
    assert mapped.clusters == 3
    assert mapped.cluster_of["load"] == mapped.cluster_of["prep"] == "lane io"
    assert mapped.cluster_of["forward"] == "lane compute"
    assert mapped.cluster_of["log"] == mapped.cluster_of["pace"] == "lane default"  # unmapped
    per_task = parse_dot(to_dot(schedule, "per_task"))
    assert per_task.clusters == len(schedule.tasks)
    streams = parse_dot(to_dot(schedule, "per_task", group_by="stream"))
    assert streams.cluster_of["prep"] == streams.cluster_of["pace"] == "stream io"
    flat = parse_dot(to_dot(schedule, group_by="none"))
    assert flat.clusters == 0 and set(flat.nodes) == {t.name for t in schedule.tasks}


def test_dot_quotes_awkward_names_and_shows_stages() -> None:
    odd = 'say "hi"\\now'
    schedule = Schedule.of([Task.from_fn(odd, noop, writes=("x",)),
                            Task.from_fn("end", noop, reads=("x",))])  # fmt: skip
    dot = parse_dot(to_dot(schedule, title='a "title"'))
    assert set(dot.nodes) == {odd, "end"}
    assert edge(dot, odd, "end")["label"] == "x"
    staged = Schedule((Stage((Task.from_fn("a", noop),)), Stage((Task.from_fn("b", noop),))))
    labels = {n: a["label"] for n, a in parse_dot(to_dot(staged)).nodes.items()}
    assert labels == {"a": "a\nla 0 · default\nstage 0", "b": "b\nla 0 · default\nstage 1"}


def test_unresolvable_dependencies_raise_the_validation_error() -> None:
    schedule = Schedule.of([Task.from_fn("a", noop, depends_on=("ghost",))])
    with pytest.raises(ScheduleValidationError) as info:
        to_dot(schedule)
    assert info.value.rule == 6 and "ghost" in str(info.value)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_schedules_draw_every_dependency(data: st.DataObject) -> None:
    specs = data.draw(schedule_specs())
    schedule = Schedule.of(build_tasks(specs, Trace()))
    thread_map = data.draw(thread_maps(specs))
    dot = parse_dot(to_dot(schedule, thread_map))
    lanes = {t.name: f"lane {resolve_lane(t, thread_map)}" for t in schedule.tasks}
    assert dot.cluster_of == lanes
    expected = {(e.producer, e.consumer, e.kind, e.delta) for e in dependency_edges(schedule)}
    style_kind = {"solid": "slot", "bold": "depends_on", "dashed": "cross_iter",
                  "dotted": "same_progress_sync"}  # fmt: skip
    drawn = set()
    for producer, consumer, attrs in dot.edges:
        delta = int(attrs["label"].rsplit("Δ=", 1)[1].split()[0]) if "Δ=" in attrs["label"] else 0
        drawn.add((producer, consumer, style_kind[attrs["style"]], delta))
        assert (attrs.get("constraint") == "false") == (delta > 0)
    assert drawn == expected
    mermaid = to_mermaid(schedule, thread_map)
    assert len(re.findall(r"^    subgraph g\d+", mermaid, re.M)) == len(set(lanes.values()))
    assert len(re.findall(r"^ +t_\w+ (?:-->|==>|-\.->)", mermaid, re.M)) == len(drawn)


# -- Mermaid ---------------------------------------------------------------------------


def test_mermaid_structure() -> None:
    text = to_mermaid(every_kind(), {"load": "io", "prep": "io"}, title="demo: x")
    lines = text.splitlines()
    assert lines[:4] == ["---", 'title: "demo: x: 6 tasks, max lookahead 2 (3 batches in flight)"',
                         "---", "flowchart LR"]  # fmt: skip
    boxes = re.findall(r'subgraph (g\d+)\["([^"]+)"\]\n((?:\s+t_.*\n)+)\s+end', text)
    members = {label: re.findall(r"(t_\w+)[\[(]", body) for _, label, body in boxes}
    assert members == {"lane io": ["t_load", "t_prep"],
                       "lane default": ["t_zero_grad", "t_forward", "t_log", "t_pace"]}  # fmt: skip
    assert 't_forward[["forward<br/>la 0 · default<br/>nccl"]]:::la0' in text  # nccl: subroutine
    assert 't_load["load<br/>la 2 · memcpy"]:::la2' in text
    links = re.findall(r'^ +(t_\w+) (-->|==>|-\.->)(?:\|"([^"]*)"\|)? (t_\w+)$', text, re.M)
    arrows = {(p, c): (arrow, label) for p, arrow, label, c in links}
    assert arrows[("t_load", "t_prep")] == ("-->", "raw, meta Δ=1")
    assert arrows[("t_zero_grad", "t_forward")] == ("==>", "depends_on")
    assert arrows[("t_forward", "t_log")] == ("-.->", "Δ=2")
    assert arrows[("t_forward", "t_prep")] == ("-.->", "sync")
    # linkStyle indices point at the links of their kind, in declaration order
    index = {pair: i for i, (p, _, _, c) in enumerate(links) for pair in [(p, c)]}
    styles = dict(re.findall(r"^ +linkStyle ([\d,]+) (.+)$", text, re.M))
    style_of = {int(i): style for ids, style in styles.items() for i in ids.split(",")}
    assert len(style_of) == len(links)
    assert "stroke-dasharray:2 3" in style_of[index[("t_forward", "t_prep")]]  # sync: red dots
    assert "#d62728" in style_of[index[("t_forward", "t_prep")]]
    assert "stroke-width:3px" in style_of[index[("t_zero_grad", "t_forward")]]
    assert style_of[index[("t_forward", "t_log")]] == style_of[index[("t_forward", "t_pace")]]


def test_mermaid_ids_are_safe_and_unique() -> None:
    schedule = Schedule.of([
        Task.from_fn("end", noop, writes=("x",)),
        Task.from_fn("a-b", noop, reads=("x",)),
        Task.from_fn("a_b", noop),
        Task.from_fn('say "<hi>"', noop),
    ])  # fmt: skip
    text = to_mermaid(schedule, group_by="none")
    assert "subgraph" not in text
    assert re.search(r"^\s+t_end\[", text, re.M) and re.search(r"^\s+t_a_b\[", text, re.M)
    assert re.search(r"^\s+t_a_b_2\[", text, re.M)
    assert "t_end -->|\"x\"| t_a_b\n" in text
    assert 'say #quot;#lt;hi#gt;#quot;' in text and '"<hi>"' not in text


# -- rendering -------------------------------------------------------------------------


def fake_dot(folder: Path, body: str) -> Path:
    """A stand-in ``dot`` on PATH: a Python script with ``body``."""
    folder.mkdir(exist_ok=True)
    script = folder / "dot"
    script.write_text(f"#!{sys.executable}\nimport sys, json, pathlib\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_render_pipes_dot_to_graphviz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "calls.json"
    fake_dot(tmp_path / "bin", f"""
source = sys.stdin.read()
pathlib.Path({str(log)!r}).write_text(json.dumps({{"argv": sys.argv[1:], "stdin": source}}))
sys.stdout.buffer.write(b"<svg>" + str(source.count(" -> ")).encode() + b" edges</svg>")
""")  # fmt: skip
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    picture = render(every_kind(), "svg", {"load": "io"})
    assert picture == b"<svg>6 edges</svg>"
    call = json.loads(log.read_text())
    assert call["argv"] == ["-Tsvg"]
    assert call["stdin"] == to_dot(every_kind(), {"load": "io"})
    written = write(every_kind(), tmp_path / "schedule.png")
    assert written.read_bytes() == b"<svg>6 edges</svg>"
    assert json.loads(log.read_text())["argv"] == ["-Tpng"]


def test_render_without_graphviz_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no dot anywhere
    with pytest.raises(RenderError, match="Graphviz") as info:
        render(every_kind(), "png")
    assert "install graphviz" in str(info.value)
    assert not (tmp_path / "x.svg").exists()
    with pytest.raises(RenderError):
        write(every_kind(), tmp_path / "x.svg")
    # text formats need no Graphviz
    assert write(every_kind(), tmp_path / "x.mmd").read_text().startswith("---\n")
    assert write(every_kind(), tmp_path / "x.gv").read_text().startswith("digraph")


def test_render_reports_graphviz_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dot(tmp_path / "bin", 'sys.stderr.write("syntax error in line 3"); sys.exit(1)')
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(RenderError, match="exited with 1: syntax error in line 3"):
        render(every_kind(), "svg")
    with pytest.raises(RenderError, match="cannot render 'gif'"):
        render(every_kind(), "gif")


def test_format_for_reads_the_suffix() -> None:
    assert [format_for(f"a{s}") for s in (".dot", ".gv", ".mmd", ".SVG", ".png", ".pdf")] == [
        "dot", "dot", "mermaid", "svg", "png", "pdf"]  # fmt: skip
    with pytest.raises(RenderError, match="cannot tell"):
        format_for("a.txt")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_real_graphviz_reads_the_clusters_and_edges() -> None:
    schedule = every_kind()
    layout = subprocess.run(["dot", "-Tjson"], input=to_dot(schedule, {"load": "io"}),
                            capture_output=True, text=True, check=True, timeout=60,
                            env={**os.environ, "LC_ALL": "C.UTF-8"})  # fmt: skip
    graph = json.loads(layout.stdout)
    objects = graph["objects"]
    clusters = {o["label"]: {objects[i]["name"] for i in o.get("nodes", [])}
                for o in objects if o["name"].startswith("cluster_")}  # fmt: skip
    unmapped = {"prep", "pace", "zero_grad", "forward", "log"}
    assert clusters == {"lane io": {"load"}, "lane default": unmapped}
    names = [o["name"] for o in objects]
    pairs = {(names[e["tail"]], names[e["head"]]) for e in graph["edges"]}
    assert pairs == {(e.producer, e.consumer) for e in dependency_edges(schedule)}
    assert render(schedule, "svg").lstrip().startswith(b"<?xml")


def text_boxes(item: dict[str, object]) -> list[tuple[str, float, float, float, float]]:
    """The text Graphviz drew for a cluster or an edge: (text, x0, y0, x1, y1) in points,
    y upwards, from its xdot label operations."""
    boxes, size = [], 14.0
    for op in item.get("_ldraw_", []):  # type: ignore[attr-defined]
        if op["op"] == "F":
            size = op["size"]
        elif op["op"] == "T":
            x, y = op["pt"]
            left = {"l": x, "c": x - op["width"] / 2, "r": x - op["width"]}[op["align"]]
            boxes.append((op["text"], left, y - 0.25 * size, left + op["width"], y + 0.8 * size))
    return boxes


def example_schedules() -> dict[str, Schedule]:
    spec = importlib.util.spec_from_file_location(
        "example_schedules", Path(__file__).parents[1] / "examples" / "schedules.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    schedules = {"overlap": module.overlap(), "every_kind": every_kind()}
    for name, build in (("training", lambda: module.training()[0]), ("hstu", module.hstu),
                        ("hstu_prefetch", module.hstu_prefetch)):  # fmt: skip
        pipe = build()
        schedules[name] = pipe.schedule
        pipe.shutdown()
    return schedules


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
@pytest.mark.parametrize("thread_map", [None, "per_task"])
def test_edge_labels_keep_off_the_lane_titles(thread_map: str | None) -> None:
    for name, schedule in example_schedules().items():
        layout = subprocess.run(["dot", "-Tjson"], input=to_dot(schedule, thread_map),
                                capture_output=True, text=True, check=True, timeout=60,
                                env={**os.environ, "LC_ALL": "C.UTF-8"})  # fmt: skip
        graph = json.loads(layout.stdout)
        titles = [box for o in graph["objects"] if o["name"].startswith("cluster_")
                  for box in text_boxes(o)]  # fmt: skip
        labels = [box for e in graph["edges"] for box in text_boxes(e)]
        assert len(titles) >= 2 and labels, name
        overlaps = [(label[0], title[0]) for label in labels for title in titles
                    if label[1] < title[3] and title[1] < label[3]
                    and label[2] < title[4] and title[2] < label[4]]  # fmt: skip
        assert not overlaps, f"{name}: edge labels drawn over lane titles: {overlaps}"


def test_a_one_sided_sync_is_labelled_with_the_side_it_keeps() -> None:
    schedule = Schedule.of([
        Task.from_fn("h2d", noop, stream="memcpy"),
        Task.from_fn("step", noop, stream="memcpy"),
        Task.from_fn("forward", noop, same_progress_sync=("h2d", "step"),
                     same_progress_sync_sides={"h2d": "device", "step": "cpu"}),
        Task.from_fn("log", noop, same_progress_sync=("forward",)),
    ])  # fmt: skip
    dot = parse_dot(to_dot(schedule))
    assert edge(dot, "h2d", "forward")["label"] == "sync (device)"
    assert edge(dot, "step", "forward")["label"] == "sync (cpu)"
    assert edge(dot, "forward", "log")["label"] == "sync"  # both sides: as before
    mermaid = to_mermaid(schedule)
    assert '-.->|"sync (device)"| t_forward' in mermaid
    assert '-.->|"sync (cpu)"| t_forward' in mermaid
