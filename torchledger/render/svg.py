"""Inline SVG charts, drawn in Python: no JavaScript, no fonts or styles from the network.

Every coordinate is rounded to 0.1 px so the same record always gives the same bytes.
Text is escaped here; callers pass plain strings.
"""
from __future__ import annotations

from html import escape

from ..units import fmt_bytes, fmt_count

__all__ = ["bar_chart", "timeline_chart", "scatter_chart", "legend", "PHASE_COLORS", "CATEGORY_COLORS"]

CATEGORY_COLORS = {
    "parameters": "#4e79a7", "buffers": "#76b7b2", "gradients": "#f28e2b", "optimizer_state": "#b07aa1",
    "activations": "#59a14f", "temporaries": "#edc948",
}
_SPARE_COLORS = ["#e15759", "#9c755f", "#bab0ac", "#ff9da7"]
PHASE_COLORS = {"forward": "#eef4fb", "backward": "#fbf1e8", "recompute": "#f3eef7",
                "optimizer": "#eef7ef", "other": "#f7f7ee", "end": "#f4f4f4"}
_FONT = 'font-family="system-ui, sans-serif" font-size="11"'


def _n(x: float) -> str:
    s = f"{x:.1f}"
    return s[:-2] if s.endswith(".0") else s


def _text(x, y, s, anchor="start", extra="") -> str:
    return (f'<text x="{_n(x)}" y="{_n(y)}" text-anchor="{anchor}" {_FONT}{extra}>'
            f"{escape(str(s))}</text>")


def _clip(label: str, n: int = 34) -> str:
    return label if len(label) <= n else "\u2026" + label[-(n - 1):]


def bar_chart(items, *, series, colors, unit="count", title="", width=760) -> str:
    """Horizontal stacked bars: ``items`` are ``(label, [value per series])``.

    ``unit`` is 'count' (FLOPs) or 'bytes'; the total is printed after each bar.
    """
    label_w, value_w, row_h, top = 230, 110, 18, 26
    fmt = (lambda v: fmt_bytes(v, binary=True)) if unit == "bytes" else fmt_count
    vmax = max((sum(v) for _, v in items), default=0) or 1
    plot_w = width - label_w - value_w
    height = top + row_h * len(items) + 8
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
           f"<title>{escape(title)}</title>"]
    x = label_w
    for name, color in zip(series, colors):        # legend
        out.append(f'<rect x="{x}" y="6" width="10" height="10" fill="{color}"/>')
        out.append(_text(x + 14, 15, name))
        x += 24 + 7 * len(name)
    for i, (label, values) in enumerate(items):
        y = top + i * row_h
        out.append(f"<g><title>{escape(label or '(root)')}: "
                   f"{escape(', '.join(f'{s} {fmt(v)}' for s, v in zip(series, values)))}</title>")
        out.append(_text(label_w - 6, y + 12, _clip(label or "(root)"), "end"))
        x = float(label_w)
        for v, color in zip(values, colors):
            w = plot_w * v / vmax
            if w > 0:
                out.append(f'<rect x="{_n(x)}" y="{y + 2}" width="{_n(max(w, 0.5))}" height="{row_h - 4}" '
                           f'fill="{color}"/>')
            x += w
        out.append(_text(x + 4, y + 12, fmt(sum(values))))
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _ticks(vmax: float, base: int, n: int = 4) -> list:
    """About ``n`` round tick values from 0 to at least ``vmax`` (steps 1, 2, 5 x 10^k in
    units of ``base``^j, so byte axes read 256 KiB, 512 KiB, ...)."""
    if vmax <= 0:
        return [0]
    unit = 1
    while base > 1 and vmax / unit >= base:
        unit *= base
    raw = vmax / unit / n
    mag = 10 ** len(str(int(raw))) / 10 if raw >= 1 else 1.0
    while mag > raw:
        mag /= 10
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw) * unit
    ticks, v = [], 0.0
    while v < vmax + step:
        ticks.append(v)
        if v >= vmax:
            break
        v += step
    return ticks


def _scales(left, top, pw, ph, xmax, ymax) -> tuple:
    """``(px, py)``: data x and y to pixels in a plot of ``pw`` x ``ph`` at ``(left, top)``, the y
    axis upwards."""
    return (lambda x: left + pw * x / xmax), (lambda y: top + ph - ph * y / ymax)


def _svg_open(width, height, title) -> list:
    """The opening ``<svg>`` element and its title, as a list of lines to append to."""
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
            f"<title>{escape(title)}</title>"]


def timeline_chart(rows, categories, *, title="", width=760, height=280) -> str:
    """Stacked live bytes per category over op index, with phase bands and the peak marked."""
    left, right, top, bottom = 70, 16, 30, 36
    pw, ph = width - left - right, height - top - bottom
    xs = [r.get("op_index", i) for i, r in enumerate(rows)]
    xmax = max(xs) or 1
    totals = [sum(r.get(c, 0) for c in categories) for r in rows]
    yt = _ticks(max(totals) or 1, 1024)
    ymax = yt[-1] or 1

    px, py = _scales(left, top, pw, ph, xmax, ymax)
    out = _svg_open(width, height, title)
    start = 0                                         # phase bands behind everything
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i].get("phase") != rows[start].get("phase"):
            phase = rows[start].get("phase", "")
            x0, x1 = px(xs[start]), px(xs[i] if i < len(rows) else xmax)
            out.append(f'<rect x="{_n(x0)}" y="{top}" width="{_n(max(x1 - x0, 0.5))}" height="{ph}" '
                       f'fill="{PHASE_COLORS.get(phase, "#f4f4f4")}"><title>{escape(phase)}</title></rect>')
            if x1 - x0 > 40:
                out.append(_text((x0 + x1) / 2, top - 6, phase, "middle", ' fill="#555"'))
            start = i
    for y in yt:                                      # grid and y labels
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{_n(py(y))}" y2="{_n(py(y))}" stroke="#ddd"/>')
        out.append(_text(left - 6, py(y) + 4, fmt_bytes(y, binary=True), "end"))
    for x in _ticks(xmax, 1, 6):
        if x <= xmax:
            out.append(_text(px(x), top + ph + 14, f"{x:g}", "middle"))
    out.append(_text(left + pw / 2, height - 6, "op index (dispatch order)", "middle"))
    below = [0] * len(rows)
    colors = _colors(categories)
    for c in categories:                              # stacked areas, bottom up
        above = [b + r.get(c, 0) for b, r in zip(below, rows)]
        if any(a != b for a, b in zip(above, below)):
            pts = [f"{_n(px(x))},{_n(py(a))}" for x, a in zip(xs, above)]
            pts += [f"{_n(px(x))},{_n(py(b))}" for x, b in zip(reversed(xs), reversed(below))]
            out.append(f'<polygon points="{" ".join(pts)}" fill="{colors[c]}" fill-opacity="0.85">'
                       f"<title>{escape(c)}</title></polygon>")
        below = above
    if rows:                                          # the peak
        k = max(range(len(rows)), key=lambda i: totals[i])
        x, y = px(xs[k]), py(totals[k])
        out.append(f'<line x1="{_n(x)}" x2="{_n(x)}" y1="{top}" y2="{top + ph}" stroke="#c00" '
                   f'stroke-dasharray="4 3"/>')
        out.append(f'<circle cx="{_n(x)}" cy="{_n(y)}" r="3.5" fill="#c00"/>')
        anchor = "end" if x > left + pw * 0.7 else "start"
        out.append(_text(x + (-6 if anchor == "end" else 6), max(y - 6, top + 12),
                         f"peak {fmt_bytes(totals[k], binary=True)} at op {xs[k]}", anchor,
                         ' fill="#c00"'))
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    out.append("</svg>")
    return "\n".join(out)


def legend(categories) -> str:
    """An HTML legend (swatch + name) for the timeline's categories."""
    colors = _colors(categories)
    return " ".join(f'<span class="swatch" style="background:{colors[c]}"></span>{escape(c)}'
                    for c in categories)


def _colors(categories) -> dict:
    spare = iter(_SPARE_COLORS * 4)
    return {c: CATEGORY_COLORS.get(c) or next(spare, "#888") for c in categories}


def scatter_chart(points, *, x_limit=None, title="", x_label="", y_label="", width=760, height=320) -> str:
    """Points ``(x bytes, y seconds, label, kind)`` (kind: ``fits``, ``over``, ``frontier``),
    the frontier joined by a line, and ``x_limit`` (bytes) as a dashed vertical line."""
    left, right, top, bottom = 70, 16, 30, 40
    pw, ph = width - left - right, height - top - bottom
    xs = [p[0] for p in points] + ([x_limit] if x_limit else [])
    xt = _ticks(max(xs or [1]) or 1, 1024)
    yt = _ticks(max([p[1] for p in points] or [1]) or 1, 1)
    xmax, ymax = xt[-1] or 1, yt[-1] or 1

    px, py = _scales(left, top, pw, ph, xmax, ymax)
    out = _svg_open(width, height, title)
    for y in yt:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{_n(py(y))}" y2="{_n(py(y))}" stroke="#ddd"/>')
        out.append(_text(left - 6, py(y) + 4, f"{y * 1e3:.3g} ms", "end"))
    for x in xt:
        out.append(_text(px(x), top + ph + 14, fmt_bytes(x, binary=True), "middle"))
    out.append(_text(left + pw / 2, height - 6, x_label, "middle"))
    out.append(_text(left, top - 8, y_label))
    if x_limit:
        out.append(f'<line x1="{_n(px(x_limit))}" x2="{_n(px(x_limit))}" y1="{top}" y2="{top + ph}" '
                   f'stroke="#c00" stroke-dasharray="4 3"/>')
        out.append(_text(px(x_limit) - 4, top + 12, f"memory limit {fmt_bytes(x_limit, binary=True)}", "end",
                         ' fill="#c00"'))
    front = sorted((p for p in points if p[3] == "frontier"), key=lambda p: p[0])
    if len(front) > 1:
        pts = " ".join(f"{_n(px(p[0]))},{_n(py(p[1]))}" for p in front)
        out.append(f'<polyline points="{pts}" fill="none" stroke="#4e79a7" stroke-width="1.5"/>')
    colors = {"fits": "#9ab7d3", "over": "#e15759", "frontier": "#4e79a7"}
    for x, y, label, kind in points:
        out.append(f'<circle cx="{_n(px(x))}" cy="{_n(py(y))}" r="{4 if kind == "frontier" else 3}" '
                   f'fill="{colors.get(kind, "#999")}"><title>{escape(label)}</title></circle>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    out.append("</svg>")
    return "\n".join(out)
