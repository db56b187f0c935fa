"""Resuming in a new process, the natural way: ``fwd = rs.split(loss); fwd.backward(store.get(k))``.

A writer process puts contexts of one model per library (plain JAX, Equinox, Flax NNX, Flax
linen, Haiku) and exits. A second process, under another ``PYTHONHASHSEED``, builds the same
models (never running a forward), makes fresh splits and runs their backwards on the loaded
contexts: the split rebuilds each backward from the avals the context records. The gradients
equal ``jax.grad`` here; no forward is compiled there (counted by the split and by
``jax.monitoring``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from libraries import MAKERS, batch, flat

pytestmark = pytest.mark.subprocess

TESTS = os.path.dirname(os.path.abspath(__file__))
N_MICROBATCHES = 2

WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    import residual_store as rs, libraries
    with rs.Store(sys.argv[1]) as store:
        for name, make in libraries.MAKERS.items():
            loss, params = make()
            fwd = rs.split(loss)
            for i in range({n}):
                store.put(fwd(params, *libraries.batch(i))[1], f"{{name}}-{{i}}")
    """
).format(n=N_MICROBATCHES)

RESUMER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[3])
    import jax, numpy as np
    import residual_store as rs, libraries

    compiles, counting = [], [False]  # a compile XLA runs, or one the suite's XLA cache answers
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, d, **kw: compiles.append(event)
        if counting[0] and event == "/jax/core/compile/backend_compile_duration" else None
    )
    report, grads = {{}}, {{}}
    with rs.Store(sys.argv[1], read_only=True) as store:
        for name, make in libraries.MAKERS.items():
            loss, params = make()  # the model as this process builds it; no forward runs
            fwd = rs.split(loss)
            for i in range({n}):
                ctx = store.get(f"{{name}}-{{i}}")
                counting[0] = True
                g = fwd.backward(ctx)
                jax.block_until_ready(g)
                counting[0] = False
                grads.update({{f"{{name}}-{{i}}" + k: np.asarray(v) for k, v in libraries.flat(g).items()}})
            report[name] = {{**fwd.cache_info()._asdict(), "compiles": len(compiles), "kinds": sorted(set(ctx.spec.kinds))}}
            compiles.clear()
        # a function this process defines differently never runs on another's context
        plain, _ = libraries.make_plain()
        other = rs.split(lambda p, x, y: 2 * plain(p, x, y))
        try:
            other.backward(store.get("plain-0"))
            report["other"] = "ran"
        except rs.SignatureMismatchError as err:
            report["other"] = str(err)
    np.savez(sys.argv[2], **grads)
    print(json.dumps(report))
    """
).format(n=N_MICROBATCHES)


def _run(script: str, *args: str, seed: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONHASHSEED": str(seed)},
    )


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    root, out = str(base / "store"), str(base / "grads.npz")
    wrote = _run(WRITER, root, TESTS, seed=0)
    assert wrote.returncode == 0, wrote.stderr
    done = _run(RESUMER, root, out, TESTS, seed=1)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), dict(np.load(out))


@pytest.mark.parametrize("library", sorted(MAKERS))
def test_fresh_split_in_a_new_process_resumes_every_library(resumed, library):
    report, grads = resumed
    info = report[library]
    assert info["forward_compiles"] == 0 and info["misses"] == 0  # never ran a forward
    assert info["backward_compiles"] == 1  # one signature, both microbatches
    assert info["compiles"] == 1, info  # nothing else compiled either (jax.monitoring)
    assert info["kinds"] == ["input", "intermediate", "weight"], info
    loss, params = MAKERS[library]()
    for i in range(N_MICROBATCHES):
        want = flat(jax.grad(loss)(params, *batch(i)))
        assert want and all(float(np.abs(v).max()) > 0 for v in want.values())
        for path, value in want.items():
            np.testing.assert_allclose(grads[f"{library}-{i}{path}"], value, rtol=2e-5, atol=1e-6)


def test_another_function_is_refused_with_the_reason(resumed):
    report, _ = resumed
    assert report["other"] != "ran"
    assert "this split computes signature rs2-" in report["other"]
    assert "another function" in report["other"]
