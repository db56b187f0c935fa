"""A line chart as SVG text, written by hand (no plotting library in the benchmarks' needs):
panels stacked over one shared x axis, each a series of points joined and marked."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from html import escape

__all__ = ["Panel", "chart"]

_W, _PANEL_H, _LEFT, _RIGHT, _TOP, _GAP, _BOTTOM = 640, 170, 70, 20, 40, 40, 50


@dataclasses.dataclass(frozen=True)
class Panel:
    """One panel: ``ys`` over the chart's ``xs``, on an axis from 0 named ``label``."""

    label: str
    ys: Sequence[float]


def _ticks(top: float, count: int = 4) -> list[float]:
    """``count`` + 1 round ticks from 0 that reach at least ``top``."""
    raw = max(top, 1e-9) / count
    step = next(m * 10**e for e in range(-3, 10) for m in (1, 2, 2.5, 5) if m * 10**e >= raw)
    return [i * step for i in range(count + 1)]


def chart(title: str, x_label: str, xs: Sequence[float], panels: Sequence[Panel]) -> str:
    """The SVG document of ``panels`` stacked, sharing ``xs`` (increasing, at least two)."""
    height = _TOP + len(panels) * (_PANEL_H + _GAP) + _BOTTOM - _GAP
    width = _W - _LEFT - _RIGHT
    x_ticks = _ticks(max(xs))

    def sx(x: float) -> float:
        return _LEFT + width * x / x_ticks[-1]

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{_W / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>']
    for i, panel in enumerate(panels):
        top = _TOP + i * (_PANEL_H + _GAP)
        y_ticks = _ticks(max(panel.ys))

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
        points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, panel.ys, strict=True))
        out.append(f'<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="#1f77b4"/>' for x, y in zip(xs, panel.ys)]
    out.append(f'<text x="{_LEFT + width / 2}" y="{height - 10}" text-anchor="middle">{escape(x_label)}</text>')
    return "\n".join([*out, "</svg>"]) + "\n"
