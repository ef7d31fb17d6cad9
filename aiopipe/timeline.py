"""A timeline picture of traced spans, as a self-contained SVG.

Perfetto is the tool for exploring a trace; this is for looking at a few iterations
at a glance, in a document or a review, without leaving the repository: one row per
lane (and per stream for GPU times), each task run a coloured bar with its name, the
time it waited on another lane or a ticket a grey bar just before it, hover text with
the details.  (``async def`` bodies on one lane may overlap in time; their bars then
share the row and overlap too -- hover or use Perfetto to tell them apart.)::

    from aiopipe.timeline import write_timeline
    write_timeline(pipe.tracer.spans, "steps.svg", iterations=(20, 22))
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from html import escape
from pathlib import Path

from .errors import ConfigurationError
from .trace import Span, several_pipelines, track_numbers, track_name

__all__ = ("timeline_svg", "write_timeline")

ToX = Callable[[int], float]  # a time in ns to an x position in px

# Distinct hues for up to 20 tasks, then repeated: category10 without its grey (grey
# bars are waits), extended one colour at a time by the hue farthest (CIEDE2000) from
# every colour before it, from the wait grey and from the white background.  Task
# names print in black or white, whichever contrasts more with the bar.
_PALETTE = (
    "#1F77B4", "#FF7F0E", "#2CA02C", "#D62728", "#9467BD", "#8C564B", "#E377C2",
    "#BCBD22", "#17BECF", "#0F0F8A", "#736926", "#267369", "#75F0B7", "#8A0F61",
    "#D9968C", "#8CA1D9", "#6BE619", "#F0BF75", "#A86A24", "#E6196B",
)  # fmt: skip
_LABEL_WIDTH = 120  # px left of the time axis for row names (at least)
_CHAR_PX = 6.2  # rough width of one character of the 11 px label font


def timeline_svg(
    spans: Sequence[Span],
    *,
    iterations: tuple[int, int] | None = None,
    width: int = 1000,
    row_height: int = 24,
    title: str | None = None,
) -> str:
    """An SVG of ``spans`` (those of ``iterations=(first, last)`` inclusive, when
    given).  Raises :class:`~aiopipe.errors.ConfigurationError` (a ``ValueError``)
    when no span is left to draw."""
    if iterations is not None:
        first, last = iterations
        spans = [s for s in spans if first <= s.iteration <= last]
    if not spans:
        raise ConfigurationError("no spans to draw (is tracing on, and are the iterations traced?)")
    # the tracks of Tracer.chrome_trace, in its order: one row each
    rows = {name: number - 1 for name, number in track_numbers(spans).items()}
    several = several_pipelines(spans)
    colours: dict[str, str] = {}
    for span in spans:
        colours.setdefault(span.task, _PALETTE[len(colours) % len(_PALETTE)])

    begin = min(min(s.start_ns - s.wait_ns, _gpu_start(s)) for s in spans)
    end = max(max(s.end_ns, _gpu_end(s)) for s in spans)
    left = max(_LABEL_WIDTH, int(max(len(name) for name in rows) * _CHAR_PX) + 16)
    plot = width - left - 10
    scale = plot / max(end - begin, 1)  # px per ns

    def x(ns: int) -> float:
        return left + (ns - begin) * scale

    top = 28 if title else 8
    axis_y = top + len(rows) * row_height + 6
    legend_y = axis_y + 30
    # legend: as many columns as fit the plot, each as wide as the longest name
    column = int(max(len(task) for task in colours) * _CHAR_PX) + 30
    columns = max(1, min(len(colours), plot // column))
    legend_rows = -(-len(colours) // columns)
    height = legend_y + legend_rows * 18 + 6
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    if title:
        out.append(f'<text x="{left}" y="18" font-size="13">{escape(title)}</text>')
    for name, row in rows.items():
        y = top + row * row_height
        shade = "#f4f4f4" if row % 2 == 0 else "#ffffff"
        out.append(f'<rect x="0" y="{y}" width="{width}" height="{row_height}" fill="{shade}"/>')
        out.append(f'<text x="6" y="{y + row_height * 0.65:.1f}" class="row">{escape(name)}</text>')
    for span in spans:
        out.extend(_bars(span, several, rows, colours, x, top, row_height))
    out.extend(_axis(begin, end, x, axis_y, left, plot))
    for k, (task, colour) in enumerate(colours.items()):
        lx, ly = left + (k % columns) * column, legend_y + (k // columns) * 18
        out.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{lx + 14}" y="{ly}">{escape(task)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_timeline(
    spans: Sequence[Span],
    path: str | os.PathLike[str],
    *,
    iterations: tuple[int, int] | None = None,
    title: str | None = None,
) -> Path:
    """Write :func:`timeline_svg` to ``path`` and return it."""
    target = Path(path)
    target.write_text(timeline_svg(spans, iterations=iterations, title=title))
    return target


def _gpu_start(span: Span) -> int:
    return span.gpu_start_ns if span.gpu_start_ns is not None else span.start_ns


def _gpu_end(span: Span) -> int:
    if span.gpu_ms is None or span.gpu_start_ns is None:
        return span.end_ns
    return span.gpu_start_ns + int(span.gpu_ms * 1e6)


def _bars(span: Span, several: bool, rows: dict[str, int], colours: dict[str, str], to_x: ToX,
          top: int, row_height: int) -> list[str]:  # fmt: skip
    y = top + rows[track_name(span, several)] * row_height + 3
    h = row_height - 6
    tip = (f"{span.task}: batch {span.batch}, iteration {span.iteration}, "
           f"{span.duration_ns / 1e6:.3f} ms on {span.thread}"
           f"{f', waited {span.wait_ns / 1e6:.3f} ms' if span.wait_ns else ''}"
           f"{' (failed)' if span.failed else ''}")  # fmt: skip
    bars = []
    if span.wait_ns:
        wx = to_x(span.start_ns - span.wait_ns)
        bars.append(f'<rect class="wait" x="{wx:.2f}" y="{y + h / 3:.1f}" '
                    f'width="{to_x(span.start_ns) - wx:.2f}" height="{h / 3:.1f}" fill="#bbbbbb">'
                    f'<title>{escape(span.task)} waiting {span.wait_ns / 1e6:.3f} ms</title></rect>')  # fmt: skip
    sx, ex = to_x(span.start_ns), to_x(span.end_ns)
    stroke = ' stroke="#d00" stroke-width="2"' if span.failed else ""
    bars.append(f'<rect class="task" x="{sx:.2f}" y="{y}" width="{max(ex - sx, 0.5):.2f}" '
                f'height="{h}" fill="{colours[span.task]}"{stroke}>'
                f'<title>{escape(tip)}</title></rect>')  # fmt: skip
    if ex - sx > len(span.task) * _CHAR_PX + 4:
        ink = _ink_on(colours[span.task])
        bars.append(f'<text x="{sx + 3:.2f}" y="{y + h * 0.72:.1f}" fill="{ink}">'
                    f'{escape(span.task)}</text>')  # fmt: skip
    if span.gpu_ms is not None and span.gpu_start_ns is not None:
        gy = top + rows[track_name(span, several, gpu=True)] * row_height + 3
        gx = to_x(span.gpu_start_ns)
        gw = max(to_x(span.gpu_start_ns + int(span.gpu_ms * 1e6)) - gx, 0.5)
        bars.append(f'<rect class="gpu" x="{gx:.2f}" y="{gy}" width="{gw:.2f}" height="{h}" '
                    f'fill="{colours[span.task]}" fill-opacity="0.7">'
                    f'<title>{escape(span.task)} on the device: {span.gpu_ms:.3f} ms</title></rect>')  # fmt: skip
    return bars


def _ink_on(fill: str) -> str:
    """Black or white text, whichever has the higher WCAG contrast on ``fill``."""
    channels = (int(fill[i:i + 2], 16) / 255 for i in (1, 3, 5))
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    luminance = 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
    # contrast with black (L + 0.05) / 0.05 beats white's 1.05 / (L + 0.05) above ~0.18
    return "black" if (luminance + 0.05) ** 2 > 0.05 * 1.05 else "white"


def _axis(begin: int, end: int, to_x: ToX, y: int, left: int, plot: float) -> list[str]:
    total_ms = (end - begin) / 1e6
    step = _tick_step(total_ms)
    out = [f'<line x1="{left}" y1="{y}" x2="{left + plot:.1f}" y2="{y}" '
           f'stroke="#333"/>']  # fmt: skip
    tick = 0.0
    while tick <= total_ms + 1e-9:
        tx = to_x(begin + int(tick * 1e6))
        out.append(f'<line x1="{tx:.2f}" y1="{y}" x2="{tx:.2f}" y2="{y + 4}" stroke="#333"/>')
        out.append(f'<text x="{tx:.2f}" y="{y + 16}" text-anchor="middle">{tick:g} ms</text>')
        tick += step
    return out


def _tick_step(total_ms: float) -> float:
    """A 1-2-5 step giving at most about ten ticks."""
    step = 10 ** int(f"{total_ms / 10:e}".split("e")[1]) if total_ms > 0 else 1.0
    for factor in (1, 2, 5, 10):
        if total_ms / (step * factor) <= 10:
            return float(step * factor)
    return float(step * 10)
