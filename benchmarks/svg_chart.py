"""A line chart as SVG text, written by hand (no plotting library in the benchmarks' needs):
panels stacked over one shared x axis, each one or more series of points joined and marked."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from html import escape

__all__ = ["Line", "Panel", "chart"]

_W, _PANEL_H, _LEFT, _RIGHT, _TOP, _GAP, _BOTTOM, _LEGEND = 640, 170, 70, 20, 40, 40, 50, 190
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#7f7f7f")


@dataclasses.dataclass(frozen=True)
class Line:
    """A named series over the chart's ``xs``; ``None`` where it has no value (a gap)."""

    name: str
    ys: Sequence[float | None]


@dataclasses.dataclass(frozen=True)
class Panel:
    """One panel on an axis named ``label``: ``ys`` (one series, no legend), or ``lines`` (named,
    with a legend); from 0, or on a log axis (``log``: every value positive)."""

    label: str
    ys: Sequence[float] = ()
    lines: Sequence[Line] = ()
    log: bool = False

    def series(self) -> list[Line]:
        """The panel's series: ``ys`` as one unnamed line, else ``lines``."""
        return [Line("", self.ys)] if self.ys else list(self.lines)


def _ticks(top: float, count: int = 4) -> list[float]:
    """``count`` + 1 round ticks from 0 that reach at least ``top``."""
    raw = max(top, 1e-9) / count
    step = next(m * 10**e for e in range(-3, 10) for m in (1, 2, 2.5, 5) if m * 10**e >= raw)
    return [i * step for i in range(count + 1)]


def _log_ticks(low: float, high: float) -> list[float]:
    """1-2-5 ticks from the one at or below ``low`` to the one at or above ``high``."""
    steps = [m * 10.0**e for e in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
             for m in (1, 2, 5)]
    first = max(t for t in steps if t <= low * (1 + 1e-9))
    last = min(t for t in steps if t >= high * (1 - 1e-9))
    return [t for t in steps if first <= t <= last]


def chart(title: str, x_label: str, xs: Sequence[float], panels: Sequence[Panel]) -> str:
    """The SVG document of ``panels`` stacked, sharing ``xs`` (increasing, at least two).

    Raises:
      ValueError: a series whose length is not ``xs``'s, a panel without values, or a value
        that is not positive on a log axis.
    """
    height = _TOP + len(panels) * (_PANEL_H + _GAP) + _BOTTOM - _GAP
    width = _W - _LEFT - _RIGHT
    total = _W + (_LEGEND if any(line.name for panel in panels for line in panel.series()) else 0)
    x_ticks = _ticks(max(xs))

    def sx(x: float) -> float:
        return _LEFT + width * x / x_ticks[-1]

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{total}" height="{height}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{total / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>']
    for i, panel in enumerate(panels):
        top = _TOP + i * (_PANEL_H + _GAP)
        lines = panel.series()
        if any(len(line.ys) != len(xs) for line in lines):
            raise ValueError(f"panel {panel.label!r}: every series needs one value per x ({len(xs)})")
        values = [y for line in lines for y in line.ys if y is not None]
        if not values or (panel.log and min(values) <= 0):
            raise ValueError(f"panel {panel.label!r}: no values, or a value not positive on a log axis")
        y_ticks = _log_ticks(min(values), max(values)) if panel.log else _ticks(max(values))
        if panel.log:
            lo, hi = math.log10(y_ticks[0]), math.log10(y_ticks[-1])

            def sy(y: float, top: float = top, lo: float = lo, hi: float = hi) -> float:
                return top + _PANEL_H * (1 - (math.log10(y) - lo) / (hi - lo))
        else:
            def sy(y: float, top: float = top, y_max: float = y_ticks[-1]) -> float:
                return top + _PANEL_H * (1 - y / y_max)

        for t in y_ticks:
            out.append(f'<line x1="{_LEFT}" x2="{_LEFT + width}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{_LEFT - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
        for t in x_ticks:
            out.append(f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{top}" y2="{top + _PANEL_H}" stroke="#eee"/>')
            out.append(f'<text x="{sx(t):.1f}" y="{top + _PANEL_H + 14}" text-anchor="middle">{t:g}</text>')
        out.append(f'<text x="16" y="{top + _PANEL_H / 2}" text-anchor="middle" '
                   f'transform="rotate(-90 16 {top + _PANEL_H / 2})">{escape(panel.label)}</text>')
        for k, line in enumerate(lines):
            color = _COLORS[k % len(_COLORS)]
            out += _drawn(line, xs, sx, sy, color)
            if line.name:  # the legend, right of the panel
                x, y = _W - _RIGHT + 10, top + 12 + 16 * k
                out.append(f'<line x1="{x}" x2="{x + 20}" y1="{y - 4}" y2="{y - 4}" stroke="{color}" stroke-width="2"/>')
                out.append(f'<text x="{x + 25}" y="{y}">{escape(line.name)}</text>')
    out.append(f'<text x="{_LEFT + width / 2}" y="{height - 10}" text-anchor="middle">{escape(x_label)}</text>')
    return "\n".join([*out, "</svg>"]) + "\n"


def _drawn(line: Line, xs: Sequence[float], sx: Callable[[float], float], sy: Callable[[float], float],
           color: str) -> list[str]:
    """A series' segments (broken where it has no value) and its points."""
    out: list[str] = []
    run: list[str] = []
    for x, y in [*zip(xs, line.ys), (None, None)]:
        if y is None or x is None:
            if len(run) > 1:
                out.append(f'<polyline points="{" ".join(run)}" fill="none" stroke="{color}" stroke-width="2"/>')
            run = []
            continue
        run.append(f"{sx(x):.1f},{sy(y):.1f}")
        out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>')
    return out
