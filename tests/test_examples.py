"""Every script in examples/ runs as a user would run it and passes its own check."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 300


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(EXAMPLES / name), *args]
    done = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ}
    )
    assert done.returncode == 0, (
        f"{name} exited with status {done.returncode}\n--- stdout ---\n{done.stdout}\n"
        f"--- stderr ---\n{done.stderr}"
    )
    return done


@pytest.mark.subprocess
def test_pipeline_two_stages():
    out = run_example("pipeline_two_stages.py", "--small").stdout
    assert "1F1B over 8 microbatches" in out
    assert "peak live contexts: stage 1 2, stage 2 1" in out
    assert "OK: pipeline gradients match jax.grad" in out


@pytest.mark.subprocess
def test_zero_bubble():
    out = run_example("zero_bubble.py", "--small").stdout
    assert "ZB-H1 (27 time units)" in out and "1F1B (33 time units" in out
    assert "cotangent for params['w1']" in out and "cotangent of the output" in out
    assert "OK: every order's gradients match jax.grad" in out


@pytest.mark.subprocess
def test_resume_in_new_process():
    out = run_example("resume_in_new_process.py", "--small").stdout
    assert "residual_store.demo is not importable here" in out
    assert "backward mb000" in out
    assert "OK: gradients from the backward process (no model) match jax.grad" in out
    assert "8 backwards by a fresh split: 0 forward compiles, 1 backward compile" in out
    assert "OK: gradients from the resume process (fresh split) match jax.grad" in out


@pytest.mark.subprocess
def test_offload_under_budget():
    out = run_example("offload_under_budget.py", "--small").stdout
    assert "[FAILED]" not in out
    assert "OK: offloaded under budget, gradients unchanged" in out


@pytest.mark.subprocess
def test_custom_kernel():
    out = run_example("custom_kernel.py", "--small").stdout
    assert "rs.RecomputeWarning: 1 jax.custom_vjp call(s)" in out
    assert "OK: kernel call counts as documented" in out


LIBRARY_EXAMPLES = {  # script: what its PASS line starts with (the libraries are test dependencies)
    "flax_nnx.py": "PASS: Flax NNX gradients match jax.grad",
    "flax_linen.py": "PASS: Flax linen gradients match jax.grad",
    "equinox_model.py": "PASS: Equinox gradients match jax.grad",
    "haiku_model.py": "PASS: Haiku gradients match jax.grad",
}


@pytest.mark.subprocess
@pytest.mark.parametrize("name", sorted(LIBRARY_EXAMPLES))
def test_library_example(name, tmp_path):
    out = run_example(name, "--store", str(tmp_path / "store")).stdout
    assert "[new process] 4 backwards from the store, no model code" in out
    assert LIBRARY_EXAMPLES[name] in out
    assert (tmp_path / "store").is_dir()  # --store keeps the store


@pytest.mark.subprocess
@pytest.mark.multiprocess
def test_data_parallel_two_processes():
    out = run_example("data_parallel_two_processes.py", "--small").stdout
    assert "mb0 loaded whole: True" in out
    assert "backward mb0: this process holds [2, 2, 2, 2, 2] shards" in out
    assert "OK: gradients resumed by a new pair of processes match jax.grad" in out
