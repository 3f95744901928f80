"""The report's pictures as inline SVG, drawn here (no script, no library, nothing fetched): a line
chart of (x, y) series and a timeline of a run's attempts and story. Every text is escaped."""

from __future__ import annotations

import math
import time
from html import escape

W, H, PAD_L, PAD_R, PAD_T, PAD_B = 760, 240, 64, 16, 16, 36
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
VERDICT_COLOUR = {"finished": "#2ca02c", "stopped": "#7f7f7f", None: "#1f77b4"}
MAX_POINTS = 1500  # a series is thinned to this many points (every k-th, the last kept)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.2g}"
    return f"{v:.4g}"


def thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(points) <= MAX_POINTS:
        return points
    k = math.ceil(len(points) / MAX_POINTS)
    return points[::k] + ([points[-1]] if (len(points) - 1) % k else [])


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], x_label: str, y_label: str,
               marks: list[tuple[float, str]] = ()) -> str:
    """An SVG line chart (class "chart"): one polyline per series, axes with ticks, and dashed
    vertical marks (x, label), e.g. where an attempt resumed."""
    pts = [p for s in series.values() for p in s]
    if not pts:
        return f'<p class="empty">{escape(title)}: no data</p>'
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    iw, ih = W - PAD_L - PAD_R, H - PAD_T - PAD_B

    def sx(x: float) -> float:
        return PAD_L + (x - x0) / (x1 - x0) * iw

    def sy(y: float) -> float:
        return PAD_T + ih - (y - y0) / (y1 - y0) * ih

    out = [f'<svg class="chart" role="img" aria-label="{escape(title)}" viewBox="0 0 {W} {H}" '
           f'width="{W}" height="{H}" xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>',
           f'<rect x="{PAD_L}" y="{PAD_T}" width="{iw}" height="{ih}" fill="#fff" stroke="#ccc"/>']
    for t in _ticks(x0, x1):
        out.append(f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{PAD_T + ih}" y2="{PAD_T + ih + 4}" stroke="#666"/>'
                   f'<text x="{sx(t):.1f}" y="{PAD_T + ih + 16}" text-anchor="middle">{_fmt(t)}</text>')
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{PAD_L}" x2="{PAD_L + iw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#eee"/>'
                   f'<text x="{PAD_L - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for x, label in marks:
        if x0 <= x <= x1:
            out.append(f'<line class="mark" x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{PAD_T}" y2="{PAD_T + ih}" '
                       f'stroke="#999" stroke-dasharray="4 3"><title>{escape(label)}</title></line>')
    for i, (name, s) in enumerate(series.items()):
        d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in thin(sorted(s)))
        out.append(f'<polyline class="series" fill="none" stroke="{COLOURS[i % len(COLOURS)]}" stroke-width="1.5" '
                   f'points="{d}"><title>{escape(name)}</title></polyline>')
    out.append(f'<text x="{PAD_L + iw / 2}" y="{H - 4}" text-anchor="middle">{escape(x_label)}</text>'
               f'<text x="12" y="{PAD_T + ih / 2}" transform="rotate(-90 12 {PAD_T + ih / 2})" '
               f'text-anchor="middle">{escape(y_label)}</text></svg>')
    return "".join(out)


def timeline(start: float, end: float, attempts: list[dict], story: list[tuple[float, str, str | None]]) -> str:
    """The run's time left to right: one bar per attempt (its nodes and verdict on it), and below
    them one tick per story line (its text on hover; events coloured)."""
    end = max(end, start + 1)
    row, iw = 26, W - PAD_L - PAD_R
    h = PAD_T + row * (len(attempts) + 1) + PAD_B

    def sx(t: float) -> float:
        return PAD_L + (min(max(t, start), end) - start) / (end - start) * iw

    out = [f'<svg class="timeline" role="img" aria-label="timeline" viewBox="0 0 {W} {h}" width="{W}" height="{h}" '
           'xmlns="http://www.w3.org/2000/svg"><title>timeline</title>']
    for i, a in enumerate(attempts):
        y = PAD_T + i * row
        a0, a1 = a["started"] or start, a["ended"] or end
        colour = VERDICT_COLOUR.get(a["verdict"], "#d62728")
        label = f"attempt {a['attempt']}: {', '.join(a['nodes'])}" + (f" ({a['verdict']})" if a["verdict"] else "")
        out.append(f'<g class="attempt"><rect x="{sx(a0):.1f}" y="{y}" width="{max(2.0, sx(a1) - sx(a0)):.1f}" '
                   f'height="{row - 6}" fill="{colour}" fill-opacity="0.25" stroke="{colour}"/>'
                   f'<text x="{sx(a0) + 4:.1f}" y="{y + row - 11}">{escape(label)}</text>'
                   f'<title>{escape(label)}</title></g>')
    y = PAD_T + len(attempts) * row
    out.append(f'<line x1="{PAD_L}" x2="{PAD_L + iw}" y1="{y + 10}" y2="{y + 10}" stroke="#ccc"/>'
               f'<text x="{PAD_L - 6}" y="{y + 14}" text-anchor="end">story</text>')
    for at, text, kind in story:
        colour = "#d62728" if kind in ("node_lost", "attempt_failed", "hang", "failed") else "#555"
        out.append(f'<line class="told" x1="{sx(at):.1f}" x2="{sx(at):.1f}" y1="{y}" y2="{y + 20}" stroke="{colour}" '
                   f'stroke-width="2"><title>{escape(time.strftime("%H:%M:%S", time.localtime(at)))} '
                   f'{escape(text)}</title></line>')
    for t in _ticks(0, end - start):
        out.append(f'<text x="{sx(start + t):.1f}" y="{h - 6}" text-anchor="middle">+{_fmt(t)} s</text>')
    out.append("</svg>")
    return "".join(out)
