"""benchmarks/accelerator.py's report: issue 51's verdict read both ways, the chart of a run's
plan part, and the arguments its children share (one compilation cache a run); and its model,
timed bare by benchmarks/bench_model.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import xml.dom.minidom
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import accelerator  # noqa: E402
import pytest  # noqa: E402


def _row(row: str, ms: float, gib: float) -> accelerator.Row:
    return accelerator.Row(row, 3, 3 * ms / 1e3, 0, int(gib * 2**30), row=row)


def test_the_verdict_names_the_fastest_baseline_and_the_fastest_at_no_higher_peak():
    rows = [_row("plan:1", 26.8, 2.69), _row("hand-dots:1", 27.8, 2.53), _row("hand-nothing:1", 30.4, 1.33),
            _row("store:1@all", 317.0, 5.78), _row("plan:0", 40.0, 1.0), _row("hand-nothing:0", 35.0, 1.2),
            _row("hand-dots:0", 38.0, 0.9)]
    fastest, lower = [line for line in accelerator.verdicts(rows, _row("remat", 72.0, 1.17), [1]) if line.startswith("budget 1")]
    assert fastest.startswith(f"budget 1: plan {26.8 / 27.8:.3f}x the fastest baseline (hand-dots:1)")
    assert "peak 2.69 GiB against 2.53" in fastest
    assert lower.startswith(f"budget 1: plan {26.8 / 27.8:.3f}x the fastest at no higher peak (hand-dots:1)")
    # at budget 0 the fastest baseline peaks higher than the plan: the second reading takes the next
    fastest, lower = accelerator.verdicts(rows, _row("remat", 72.0, 1.17), [0])
    assert f"{40.0 / 35.0:.3f}x the fastest baseline (hand-nothing:0)" in fastest
    assert f"{40.0 / 38.0:.3f}x the fastest at no higher peak (hand-dots:0)" in lower
    assert accelerator.verdicts(rows, None, [2]) == ["budget 2: not run"]


def test_every_child_of_a_run_shares_one_compilation_cache(tmp_path):
    parser_args = argparse.Namespace(repeats=3, quick=False, wide=True, compile_cache=None)
    common = accelerator._common(parser_args, tmp_path)
    assert common[common.index("--compile-cache") + 1] == str(tmp_path / "compiled")
    assert "--wide" in common and "--quick" not in common
    given = argparse.Namespace(repeats=1, quick=True, wide=False, compile_cache=tmp_path / "kept")
    common = accelerator._common(given, tmp_path)
    assert common[common.index("--compile-cache") + 1] == str(tmp_path / "kept")


def test_a_runs_json_is_drawn_with_a_line_a_baseline_and_gaps_where_a_row_did_not_run(tmp_path):
    rows = [_row("fused", 27.1, 1.17), _row("plan:0", 32.7, 0.98), _row("plan:1", 26.8, 2.69),
            _row("hand-nothing:0", 43.9, 0.87), _row("hand-nothing:1", 30.4, 1.33), _row("store:0@all", 456.1, 3.56)]
    failed = accelerator.Row("hand-dots:1", 3, None, 0, None, row="hand-dots:1", note="out of memory")
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"rows": {"plan": [dataclasses.asdict(r) for r in [*rows, failed]],
                                          "remat": [dataclasses.asdict(_row("remat", 72.0, 1.17))]}}))
    svg = tmp_path / "run.svg"
    assert accelerator.main(["--draw", str(saved), "--svg", str(svg)]) == 0
    doc = xml.dom.minidom.parse(str(svg))
    legend = {t.firstChild.data for t in doc.getElementsByTagName("text")}
    assert {"rs.plan", "nothing_saveable", 'save="all"', "JAX remat offload", "fused value_and_grad"} <= legend
    assert "dots" not in legend and 'save="auto"' not in legend  # never measured: no line
    # two panels, each: plan and nothing_saveable joined over budgets 0 and 1; all a point alone; two flat lines
    assert len(doc.getElementsByTagName("polyline")) == 2 * 4
    assert len(doc.getElementsByTagName("circle")) == 2 * (2 + 2 + 1 + 2 + 2)


@pytest.mark.slow
def test_the_model_is_timed_bare_with_nothing_of_the_library_in_the_process():
    """bench_model.py's floor is the fused step alone: the process that times it never imports
    residual_store (nor the benchmark's sampler), and prints both steps' times."""
    bench = Path(accelerator.__file__).resolve().parent / "bench_model.py"
    script = "\n".join([
        "import runpy, sys",
        "sys.argv = ['bench_model.py', '--quick', '--repeats', '2']",
        "try:",
        f"    runpy.run_path({str(bench)!r}, run_name='__main__')",
        "except SystemExit as ended:",
        "    assert not ended.code, ended.code",
        "print('IMPORTED', sorted(m for m in sys.modules if m.split('.')[0] == 'residual_store'))",
    ])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "IMPORTED []" in done.stdout, done.stdout
    times = re.findall(r"^(fused jax.value_and_grad|the forward alone) +([0-9.]+) ms a microbatch", done.stdout, re.M)
    assert [name for name, _ in times] == ["fused jax.value_and_grad", "the forward alone"], done.stdout
    assert all(float(ms) > 0 for _, ms in times)
