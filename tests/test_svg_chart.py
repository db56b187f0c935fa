"""benchmarks/svg_chart.py draws docs/plan_curve.svg: a well-formed SVG whose points are the data's."""

from __future__ import annotations

import sys
import xml.dom.minidom
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from svg_chart import Panel, chart  # noqa: E402


def test_a_chart_is_svg_with_one_marked_line_a_panel():
    xs = [0, 0.5, 1, 3]
    svg = chart("t <&>", "budget", xs, [Panel("ms", [18.1, 13.7, 13.0, 13.0]), Panel("MiB", [0, 456, 648, 648])])
    doc = xml.dom.minidom.parseString(svg)
    lines = doc.getElementsByTagName("polyline")
    assert len(lines) == 2 and len(doc.getElementsByTagName("circle")) == 8
    first = [tuple(map(float, p.split(","))) for p in lines[0].getAttribute("points").split()]
    assert [x for x, _ in first] == sorted(x for x, _ in first) and first[0][0] == 70.0  # x = 0 at the axis
    ys = [y for _, y in first]
    assert ys[0] < ys[1] < ys[2] == ys[3]  # higher values drawn higher (SVG's y grows down)


def test_a_chart_of_mismatched_series_is_refused():
    with pytest.raises(ValueError):
        chart("t", "x", [0, 1], [Panel("y", [1.0])])


def test_the_docs_curve_is_well_formed_with_both_panels():
    svg = (Path(__file__).resolve().parents[1] / "docs" / "plan_curve.svg").read_text()
    assert len(xml.dom.minidom.parseString(svg).getElementsByTagName("polyline")) == 2
