"""Plots as inline SVG made on the server: bar charts, histograms and scatter plots.

No JavaScript and no plotting library: each function returns an ``<svg>`` element as a string,
every text in it HTML-escaped, styled by classes of the packaged ``style.css`` (the page's
Content-Security-Policy allows no inline styles). Each bar and point carries a ``<title>`` (its
value on hover).
"""

from __future__ import annotations

import html
import math
from typing import Sequence

__all__ = ["bar_chart", "histogram_chart", "human_bytes", "number", "scatter"]

W, H = 560, 220  # the plot's box
ML, MR, MT, MB = 56, 12, 24, 42  # margins: left (y ticks), right, top (title), bottom (x ticks)


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def human_bytes(n: float) -> str:
    """``1.5 kB``, ``12 MB``... (decimal units)."""
    n = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"  # pragma: no cover - the loop returns


def _number(x: float) -> str:
    if float(x).is_integer() and abs(x) < 1e6:
        return str(int(x))
    return f"{x:.3g}"


def number(x: float) -> str:
    """A number shown short: ``12``, ``0.333``, ``1.5e+07``."""
    return _number(float(x))


def _open(title: str, kind: str) -> list[str]:
    return [
        f'<svg class="plot plot-{kind}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
        f'role="img" aria-label="{_e(title)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{_e(title)}</title>",
        f'<text class="plot-title" x="{ML}" y="16">{_e(title)}</text>',
    ]


def _y_axis(parts: list[str], top: float, label: str = "") -> None:
    """The y axis from 0 to ``top`` with a few ticks."""
    x0, y0, y1 = ML, H - MB, MT
    parts.append(f'<line class="axis" x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}"/>')
    parts.append(f'<line class="axis" x1="{x0}" y1="{y0}" x2="{W - MR}" y2="{y0}"/>')
    for t in _ticks(top):
        y = y0 - (y0 - y1) * (t / top if top else 0)
        parts.append(f'<line class="gridline" x1="{x0}" y1="{y:.1f}" x2="{W - MR}" y2="{y:.1f}"/>')
        parts.append(
            f'<text class="tick" x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end">{_number(t)}</text>'
        )
    if label:
        mid = f"{(y0 + y1) / 2:.0f}"
        parts.append(
            f'<text class="axis-label" x="12" y="{mid}" transform="rotate(-90 12 {mid})" '
            f'text-anchor="middle">{_e(label)}</text>'
        )


def _ticks(top: float, n: int = 4) -> list[float]:
    if top <= 0:
        return [0.0]
    raw = top / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((s * mag for s in (1, 2, 5, 10) if s * mag >= raw), default=raw)
    return [i * step for i in range(int(top / step) + 1)]


def bar_chart(
    labels: Sequence, values: Sequence[float], title: str, *, ylabel: str = "", max_bars: int = 60
) -> str:
    """One bar per label (the first ``max_bars``; the title says when more were left out)."""
    labels = [str(x) for x in labels]
    values = [float(v) for v in values]
    if len(labels) > max_bars:
        title = f"{title} (first {max_bars} of {len(labels)})"
        labels, values = labels[:max_bars], values[:max_bars]
    parts = _open(title, "bar")
    top = max(values, default=0.0) or 1.0
    _y_axis(parts, top, ylabel)
    n = max(1, len(values))
    width = (W - ML - MR) / max(n, 8)  # a few bars are not drawn a plot wide
    y0 = H - MB
    every = max(1, math.ceil(n / 12))  # at most ~12 x labels
    for k, (label, v) in enumerate(zip(labels, values)):
        h = (y0 - MT) * v / top
        x = ML + k * width
        parts.append(
            f'<rect class="bar" x="{x + width * 0.1:.1f}" y="{y0 - h:.1f}" '
            f'width="{max(width * 0.8, 0.5):.1f}" height="{h:.1f}">'
            f"<title>{_e(label)}: {_number(v)}</title></rect>"
        )
        if k % every == 0:
            text = label if len(label) <= 12 else label[:11] + "\u2026"
            parts.append(
                f'<text class="tick" x="{x + width / 2:.1f}" y="{y0 + 14}" '
                f'text-anchor="middle">{_e(text)}</text>'
            )
    parts.append("</svg>")
    return "".join(parts)


def histogram_chart(hist: dict, title: str, *, unit: str = "", ylabel: str = "samples") -> str:
    """A histogram as :func:`tarshards.web.data.histogram` gives it (edges, counts, log)."""
    edges = [float(e) for e in hist["edges"]]
    counts = [int(c) for c in hist["counts"]]
    if hist.get("log"):
        title += " (log scale)"
    parts = _open(title, "hist")
    top = float(max(counts, default=0)) or 1.0
    _y_axis(parts, top, ylabel)
    n = max(1, len(counts))
    width = (W - ML - MR) / max(n, 8)  # a few bins are not drawn a plot wide
    y0 = H - MB
    integers = bool(hist.get("integers"))  # one bin per integer value: labelled by the value

    def fmt(x: float) -> str:
        return human_bytes(x) if unit == "bytes" else _number(round(x, 3))

    if integers:
        for k, c in enumerate(counts):
            h = (y0 - MT) * c / top
            x = ML + k * width
            value = fmt(edges[k] + 0.5)
            parts.append(
                f'<rect class="bar" x="{x + width * 0.1:.1f}" y="{y0 - h:.1f}" '
                f'width="{max(width * 0.8, 0.5):.1f}" height="{h:.1f}"><title>{_e(value)}: '
                f"{c}</title></rect>"
            )
            if k % max(1, math.ceil(n / 10)) == 0:
                parts.append(
                    f'<text class="tick" x="{x + width / 2:.1f}" y="{y0 + 14}" '
                    f'text-anchor="middle">{_e(value)}</text>'
                )
        parts.append("</svg>")
        return "".join(parts)

    for k, c in enumerate(counts):
        h = (y0 - MT) * c / top
        x = ML + k * width
        parts.append(
            f'<rect class="bar" x="{x:.1f}" y="{y0 - h:.1f}" width="{max(width - 1, 0.5):.1f}" '
            f'height="{h:.1f}"><title>{_e(fmt(edges[k]))} \u2013 {_e(fmt(edges[k + 1]))}: '
            f"{c}</title></rect>"
        )
    for k in dict.fromkeys((0, n // 2, n)):  # three x labels: the ends and the middle
        x = ML + k * width
        anchor = "start" if k == 0 else "end" if k == n else "middle"
        parts.append(
            f'<text class="tick" x="{x:.1f}" y="{y0 + 14}" text-anchor="{anchor}">'
            f"{_e(fmt(edges[k]))}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def scatter(points: Sequence[tuple[float, float]], title: str, *, xlabel="", ylabel="") -> str:
    """Points ``(x, y)`` on axes from 0 to the largest value."""
    parts = _open(title, "scatter")
    xs = [float(p[0]) for p in points]
    ys = [float(p[1]) for p in points]
    xtop = max(xs, default=0.0) or 1.0
    ytop = max(ys, default=0.0) or 1.0
    _y_axis(parts, ytop, ylabel)
    y0 = H - MB
    for t in _ticks(xtop):
        x = ML + (W - ML - MR) * t / xtop
        parts.append(
            f'<text class="tick" x="{x:.1f}" y="{y0 + 14}" text-anchor="middle">{_number(t)}</text>'
        )
    if xlabel:
        parts.append(
            f'<text class="axis-label" x="{(ML + W - MR) / 2:.0f}" y="{H - 6}" '
            f'text-anchor="middle">{_e(xlabel)}</text>'
        )
    seen = set()
    for x, y in zip(xs, ys):
        if (x, y) in seen:  # one circle per distinct point
            continue
        seen.add((x, y))
        cx = ML + (W - ML - MR) * x / xtop
        cy = y0 - (y0 - MT) * y / ytop
        parts.append(
            f'<circle class="point" cx="{cx:.1f}" cy="{cy:.1f}" r="3">'
            f"<title>{_number(x)} \u00d7 {_number(y)}</title></circle>"
        )
    parts.append("</svg>")
    return "".join(parts)
