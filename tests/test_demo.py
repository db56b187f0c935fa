"""The README's main job, with small settings: gradients match, budgets hold, one compile each."""

from __future__ import annotations

import pytest

from residual_store.demo import DemoConfig, run_demo

SMALL = DemoConfig(vocab=32, d_model=32, n_heads=2, d_ff=64, n_layers=2, seq_len=8, microbatch=2, n_microbatches=4, steps=2)


@pytest.mark.slow
def test_demo_small(tmp_path):
    lines: list[str] = []
    png = tmp_path / "demo.png"
    result = run_demo(SMALL, store_path=str(tmp_path / "store"), plot_path=str(png), print_fn=lines.append)
    assert max(result["max_rel_grad_diff"]) < 1e-4
    assert len(result["losses"]) == 2 and all(loss > 0 for loss in result["losses"])
    assert result["cache_info"].forward_compiles == 1 and result["cache_info"].backward_compiles == 1
    for tier in ("device", "host"):
        assert 0 < result["peak_bytes"][tier] <= result["budgets"][tier]
    assert result["peak_bytes"]["disk"] > 0
    text = "\n".join(lines)
    assert "peak bytes" in text and "compiles" in text and "max rel. grad diff" in text
    zb = result["zero_bubble"]  # the same model as two stages, B and W split, W deferred
    assert zb["max_rel_grad_diff"] < 1e-4
    assert zb["compiles"] == {"stage 1": (1, 2), "stage 2": (1, 2)}
    assert [s.op for s in zb["steps"]].count("W") == 2 * SMALL.n_microbatches
    assert "zero-bubble step" in text
    # the store given is kept, with the last step's contexts and nothing unreferenced
    import residual_store as rs

    with rs.Store(tmp_path / "store", read_only=True) as store:
        assert store.keys() == [f"step1-mb{i}" for i in range(SMALL.n_microbatches)]
        assert store.gc(older_than=0, dry_run=True)["bytes"] == 0
    assert f"residual-store ls {tmp_path / 'store'}" in text and "residual-store du" in text
    # save="all" against save="auto", the layers under the demo's checkpoint policy and plain
    rows = {(r["layers"].split()[0], r["save"]): r for r in result["save"]}
    assert set(rows) == {(layers, save) for layers in ("jax.checkpoint,", "plain") for save in ("all", "auto")}
    assert all(r["max_rel_grad_diff"] < 1e-4 and r["ms_in_memory"] > 0 and r["ms_spilled"] > 0 for r in rows.values())
    assert rows["jax.checkpoint,", "auto"]["own_bytes"] < rows["jax.checkpoint,", "all"]["own_bytes"]
    assert rows["plain", "auto"]["own_bytes"] <= 0.6 * rows["plain", "all"]["own_bytes"]
    assert "save='all' vs save='auto'" in text
    # each phase is announced as it starts and its table printed as it ends, in order
    order = ["[1/3] training", "peak bytes", "[2/3] zero-bubble", "zero-bubble step", "[3/3] save=", "MiB/context"]
    at = [next(i for i, line in enumerate(lines) if marker in line) for marker in order]
    assert at == sorted(at), list(zip(order, at))
    assert "pending" in result["peak_bytes"]  # host copies waiting for their writes, drawn and counted
    assert result["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_config_of_nothing_to_run_is_refused_before_anything_runs():
    import residual_store as rs

    for bad in ({"steps": 0}, {"n_microbatches": 0}, {"steps": 1.5}, {"n_microbatches": True}):
        with pytest.raises(rs.InvalidArgumentError, match=next(iter(bad)).replace("n_", "")):
            DemoConfig(**bad)


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--microbatches", "0"], ["--steps", "-1"], ["--steps", "two"]])
def test_the_command_checks_its_arguments_first(argv):
    import subprocess
    import sys
    import time

    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "residual_store", "demo", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and argv[0] in done.stderr
    assert time.monotonic() - start < 10  # no JAX import, no compile


# ``python -m residual_store demo ARGV`` with Ctrl-C reaching it as it reaches a program started
# from a terminal, also where this suite runs in the background (a shell's background jobs start
# with SIGINT ignored, and Python then never raises KeyboardInterrupt)
_DEMO = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = ['residual-store', 'demo', *sys.argv[1:]]; runpy.run_module('residual_store', run_name='__main__')"
)


def _demo(*argv: str, cwd=None):
    import subprocess
    import sys

    from store_helpers import python_env

    return subprocess.Popen([sys.executable, "-c", _DEMO, *argv], cwd=cwd, env=python_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_plot_folder_or_store_it_cannot_use_is_refused_before_the_run(tmp_path):
    import time

    start = time.monotonic()
    runs = {
        "plot": _demo("--plot", str(tmp_path / "missing" / "demo.png"), cwd=tmp_path),
        "store": _demo("--store", "s3:/bucket/run", "--no-plot", cwd=tmp_path),
    }
    said = {}
    for name, run in runs.items():
        out, err = run.communicate(timeout=120)
        assert run.returncode == 2 and "Traceback" not in err, (name, out, err)
        assert len(err.strip().splitlines()) == 1 and "step 1/" not in out, (name, out, err)
        said[name] = err
    assert time.monotonic() - start < 60  # no training ran
    assert "--plot" in said["plot"] and "make it, or give --no-plot" in said["plot"]
    assert "give 's3://bucket/run'" in said["store"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no ./s3:, no missing/


# moments of the demo's start for a Ctrl-C: (after what, seconds); "start": the process's start,
# while it imports NumPy, jaxlib and JAX; "header": its first line (the forward's first compile
# starts about 0.5 s after it, on two idle cores)
_CTRL_C_MOMENTS = (
    ("start", 0.3), ("start", 0.6), ("start", 1.0),
    *(("header", s) for s in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.3, 1.6, 2.0, 2.5, 3.5)),
)


def _ctrl_c_at(moment, cwd):
    """``residual-store demo`` started as a shell starts a program (SIGINT at its default, also
    where this suite runs in the background), sent SIGINT at ``moment``; its status and stderr."""
    import signal
    import subprocess
    import sys
    import time

    from store_helpers import python_env

    run = subprocess.Popen(
        [sys.executable, "-m", "residual_store", "demo", "--store", str(cwd / "store"), "--no-plot"],
        cwd=cwd, env={**python_env(), "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    after, seconds = moment
    if after == "header":
        assert "residual-store demo:" in run.stdout.readline()  # running
    time.sleep(seconds)
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=180)
    return run.returncode, err


@pytest.mark.slow
@pytest.mark.subprocess
def test_ctrl_c_at_any_moment_of_the_start_says_so_and_exits_130(tmp_path):
    """A Ctrl-C while XLA still compiles (the forward's first compile) once ended in a
    segmentation fault at the interpreter's end, after the message (status 139); one while it
    imported JAX, in a traceback (status 1) or jaxlib's abort (SIGABRT)."""
    from concurrent.futures import ThreadPoolExecutor

    folders = [tmp_path / f"run{i}" for i in range(len(_CTRL_C_MOMENTS))]
    for folder in folders:
        folder.mkdir()
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(_ctrl_c_at, _CTRL_C_MOMENTS, folders))
    for moment, (status, err) in zip(_CTRL_C_MOMENTS, results):
        assert status == 130, (moment, status, err)  # never a signal's death (-11, -2)
        assert err.strip().splitlines()[-1] == "residual-store demo: interrupted (Ctrl-C)", (moment, err)
        assert "Traceback" not in err and "Fatal Python error" not in err and "Exception ignored" not in err, err
