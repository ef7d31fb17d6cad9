"""The SVG timeline: one row per lane (and GPU stream), bars where and as long as the
spans say, waits before their task, escaping, and the CLI's --svg."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from aiopipe.cli import main
from aiopipe.timeline import timeline_svg, write_timeline
from aiopipe.trace import Span

SVG = "{http://www.w3.org/2000/svg}"
MS = 1_000_000


def span(task: str, lane: str, start_ms: float, end_ms: float, iteration: int = 0,
         wait_ms: float = 0.0, **extra: object) -> Span:  # fmt: skip
    return Span(task, iteration, iteration, lane, f"aiopipe-lane-{lane}", "s",
                int(start_ms * MS), int(end_ms * MS), int(wait_ms * MS), **extra)  # type: ignore[arg-type]


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def rects(root: ET.Element, cls: str) -> list[ET.Element]:
    return [r for r in root.iter(f"{SVG}rect") if r.get("class") == cls]


def test_bars_sit_on_their_lane_row_at_their_time() -> None:
    spans = [span("load", "io", 0, 2), span("train", "compute", 2, 10, wait_ms=1.5),
             span("load", "io", 10, 12, iteration=1)]  # fmt: skip
    root = parse(timeline_svg(spans, width=1120))
    rows = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "row"]
    assert rows == ["lane io", "lane compute"]
    bars = rects(root, "task")
    assert len(bars) == 3
    x = [float(b.get("x", 0)) for b in bars]
    w = [float(b.get("width", 0)) for b in bars]
    # the plot spans 0..12 ms over 990 px (width minus labels and margin)
    px_per_ms = 990 / 12
    assert x[1] == pytest.approx(120 + 2 * px_per_ms, abs=0.05)
    assert w[1] == pytest.approx(8 * px_per_ms, abs=0.05)
    assert x[0] < x[1] < x[2]
    ys = [float(b.get("y", 0)) for b in bars]
    assert ys[0] == ys[2] != ys[1]  # both loads on the io row
    (wait,) = rects(root, "wait")
    assert float(wait.get("x", 0)) + float(wait.get("width", 0)) == pytest.approx(x[1], abs=0.05)
    titles = [b.find(f"{SVG}title") for b in bars]
    assert "train: batch 0, iteration 0, 8.000 ms" in (titles[1].text or "")  # type: ignore[union-attr]


def test_iterations_select_spans_and_gpu_times_get_stream_rows() -> None:
    spans = [span("a", "io", i * 10, i * 10 + 5, iteration=i) for i in range(5)]
    spans.append(span("k", "compute", 20, 21, iteration=2, gpu_ms=4.0, gpu_start_ns=22 * MS))
    root = parse(timeline_svg(spans, iterations=(2, 3)))
    assert len(rects(root, "task")) == 3
    (gpu,) = rects(root, "gpu")
    rows = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "row"]
    assert rows == ["lane io", "lane compute", "stream s"]
    with pytest.raises(ValueError, match="no spans"):
        timeline_svg(spans, iterations=(7, 9))


def test_names_are_escaped_and_failures_outlined(tmp_path: Path) -> None:
    spans = [span("<fetch & parse>", "io", 0, 5, failed=True)]
    path = write_timeline(spans, tmp_path / "t.svg", title="a <b> title")
    root = parse(path.read_text())  # well-formed despite < and &
    (bar,) = rects(root, "task")
    assert bar.get("stroke") == "#d00"
    assert any(t.text == "<fetch & parse>" for t in root.iter(f"{SVG}text"))


def test_cli_trace_draws_the_last_iterations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "tl_target.py"
    target.write_text(
        "from aiopipe import Schedule, Task\n"
        "def work(ctx):\n"
        "    ctx.slots.set('step_result', ctx.batch_index)\n"
        "def schedule():\n"
        "    return Schedule.of([Task.from_fn('work', work, writes=('step_result',))])\n"
    )
    svg = tmp_path / "t.svg"
    assert main(["trace", f"{target}:schedule", "--progresses", "6", "-o",
                 str(tmp_path / "t.json"), "--svg", str(svg)]) == 0  # fmt: skip
    assert "drew iterations 3-5" in capsys.readouterr().out
    assert len(rects(parse(svg.read_text()), "task")) == 3


def test_legend_columns_fit_the_names_and_gpu_bars_stay_right_of_the_labels() -> None:
    names = ["global_tokens_allreduce", "forward", "backward", "wait_input_dist", "x", "y"]
    spans = [span(name, "compute", i, i + 1) for i, name in enumerate(names)]
    # a device span estimated to start before any host span
    spans.append(span("k", "io", 3, 4, gpu_ms=1.0, gpu_start_ns=int(-2 * MS)))
    root = parse(timeline_svg(spans, width=800))
    legend = [r for r in root.iter(f"{SVG}rect") if r.get("width") == "10"]
    assert len(legend) == len(names) + 1
    xs = sorted({float(r.get("x", 0)) for r in legend})
    assert min(b - a for a, b in zip(xs, xs[1:])) >= len("global_tokens_allreduce") * 6
    assert max(xs) < 800
    for bar in rects(root, "task") + rects(root, "gpu"):
        assert float(bar.get("x", 0)) >= 120 and float(bar.get("width", 0)) > 0


def test_each_pipeline_gets_its_own_rows_with_room_for_their_names() -> None:
    spans = [span("train", "compute", 0, 5, pipeline="train"),
             span("train", "compute", 1, 6, pipeline="evaluation"),
             span("load", "io", 0, 1, pipeline="train")]  # fmt: skip
    root = parse(timeline_svg(spans))
    rows = [t for t in root.iter(f"{SVG}text") if t.get("class") == "row"]
    assert [t.text for t in rows] == [
        "train · lane compute", "train · lane io", "evaluation · lane compute"
    ]  # fmt: skip
    bars = rects(root, "task")
    assert bars[0].get("y") != bars[1].get("y")  # the overlapping runs sit on two rows
    # the time axis starts right of the longest row name
    assert min(float(b.get("x", 0)) for b in bars) >= len("evaluation · lane compute") * 6


def test_twenty_tasks_get_twenty_distinct_colours_and_readable_names() -> None:
    names = [f"task_{k:02d}" for k in range(20)]
    spans = [span(name, "compute", 10 * k, 10 * k + 9) for k, name in enumerate(names)]
    root = parse(timeline_svg(spans, width=4000))
    fills = [b.get("fill") or "" for b in rects(root, "task")]
    assert len(set(fills)) == 20 and "#bbbbbb" not in {f.lower() for f in fills}
    # and no two alike: CIE76 distance 20 and up (two similar pinks were 11.9 apart)
    assert min(lab_distance(a, b) for k, a in enumerate(fills) for b in fills[k + 1:]) >= 20
    labels = {t.text: t.get("fill") for t in root.iter(f"{SVG}text")
              if t.text in names and t.get("fill")}  # the bar labels, not the legend
    for name, fill in zip(names, fills):
        ink = labels[name]
        assert ink in ("black", "white")
        assert contrast(fill, "#000000" if ink == "black" else "#ffffff") >= 4.5  # WCAG AA


def linear_rgb(colour: str) -> list[float]:
    rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]


def contrast(first: str, second: str) -> float:
    """The WCAG contrast ratio of two sRGB colours."""

    def luminance(colour: str) -> float:
        r, g, b = linear_rgb(colour)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    high, low = sorted((luminance(first), luminance(second)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def lab_distance(first: str, second: str) -> float:
    """CIE76 colour difference (sRGB, D65 white)."""

    def lab(colour: str) -> tuple[float, float, float]:
        r, g, b = linear_rgb(colour)
        xyz = ((0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047,
               0.2126 * r + 0.7152 * g + 0.0722 * b,
               (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883)  # fmt: skip
        fx, fy, fz = (t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in xyz)
        return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)

    return math.dist(lab(first), lab(second))
