"""benchmarks/svg_chart.py draws docs/plan_curve.svg: a well-formed SVG whose points are the data's."""

from __future__ import annotations

import sys
import xml.dom.minidom
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from svg_chart import Line, Panel, chart  # noqa: E402


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


def test_named_lines_on_a_log_axis_have_a_legend_and_break_where_a_value_is_missing():
    svg = chart("t", "budget", [0, 1, 2], [Panel("ms", lines=[Line("plan", [32.7, 26.8, 27.0]),
                                                               Line("all", [456.1, None, 172.7])], log=True)])
    doc = xml.dom.minidom.parseString(svg)
    texts = [t.firstChild.data for t in doc.getElementsByTagName("text")]
    assert "plan" in texts and "all" in texts  # the legend
    assert [t for t in texts if t in ("20", "50", "100", "200", "500")] == ["20", "50", "100", "200", "500"]
    lines = doc.getElementsByTagName("polyline")
    assert len(lines) == 1  # "all" has no segment: its two points are apart
    assert len(doc.getElementsByTagName("circle")) == 5
    ys = [float(p.split(",")[1]) for p in lines[0].getAttribute("points").split()]
    assert ys[0] < ys[2] < ys[1]  # 32.7 drawn above 27.0, above 26.8


def test_a_log_axis_refuses_a_value_that_is_not_positive():
    with pytest.raises(ValueError, match="log"):
        chart("t", "x", [0, 1], [Panel("y", lines=[Line("a", [1.0, 0.0])], log=True)])
