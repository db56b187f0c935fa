"""benchmarks/accelerator.py's report: issue 51's verdict read both ways, and the arguments its
children share (one compilation cache a run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import accelerator  # noqa: E402


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
