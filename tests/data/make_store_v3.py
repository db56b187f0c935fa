"""Writes tests/data/store_v3: a store in the layout before bundles (manifest version 3, one zarr
array folder per residual), by residual-store at commit d5d3e32. Kept to show how the fixture was
made; run with that version on the path: ``PYTHONPATH=<checkout at d5d3e32> python make_store_v3.py``.
"""

import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np

import residual_store as rs


def loss(params, x, labels):
    """A two-layer MLP with a bf16 hidden layer: float32, bfloat16 and int32 residuals."""
    h = jnp.tanh(x @ params["w1"] + params["b1"]).astype(jnp.bfloat16)
    logits = (h @ params["w2"].astype(jnp.bfloat16)).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def inputs():
    rng = np.random.default_rng(20261203)
    params = {
        "w1": rng.standard_normal((6, 8)).astype(np.float32),
        "b1": rng.standard_normal((8,)).astype(np.float32),
        "w2": rng.standard_normal((8, 4)).astype(np.float32),
    }
    x = rng.standard_normal((5, 6)).astype(np.float32)
    labels = rng.integers(0, 4, (5,)).astype(np.int32)
    return params, x, labels


if __name__ == "__main__":
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_v3")
    shutil.rmtree(root, ignore_errors=True)
    params, x, labels = inputs()
    fwd = rs.split(loss)
    with rs.Store(root) as store:
        for k in range(2):
            _, ctx = fwd(params, x + k, labels)
            store.put(ctx, f"mb{k}")
    os.remove(os.path.join(root, ".gc.lock"))
    print("wrote", root, file=sys.stderr)
