"""The persistent compilation cache option: a second process loads the backward's executable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.subprocess

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    import residual_store as rs

    events = []
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
    rs.enable_compilation_cache(sys.argv[1])
    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))
    _, ctx = fwd(jnp.ones((16, 8)), jnp.linspace(-1, 1, 64 * 16).reshape(64, 16))
    grads = fwd.backward(ctx)
    print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                      "misses": events.count("/jax/compilation_cache/cache_misses"),
                      "sum": float(grads.sum())}))
    """
)


def _run(cache_dir: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, cache_dir],
        capture_output=True, text=True, timeout=120, check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_hits_the_cache(tmp_path):
    cache = str(tmp_path / "xla-cache")
    first = _run(cache)
    assert first["misses"] >= 2 and first["hits"] == 0  # forward and backward compiled
    assert os.listdir(cache)
    second = _run(cache)
    assert second["hits"] >= 2 and second["misses"] == 0
    assert second["sum"] == first["sum"]
