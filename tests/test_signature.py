"""The signature: the same in every process for the same function and avals, different otherwise."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import namedtuple

import jax
import jax.numpy as jnp
import pytest

import residual_store as rs
from residual_store.signature import treedef_fingerprint

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    sys.path.insert(0, {tests!r})
    import residual_store as rs
    from models import init_mlp, mlp_loss
    params = init_mlp(jax.random.key(0))
    x, y = jnp.ones((3, 8)), jnp.ones((3, 4))
    print(rs.split(mlp_loss)(params, x, y)[1].spec.signature)
    """
)


def _signature_in_subprocess() -> str:
    import os

    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(tests=tests)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.subprocess
def test_same_signature_in_two_processes():
    from models import init_mlp, mlp_loss

    params = init_mlp(jax.random.key(0))
    here = rs.split(mlp_loss)(params, jnp.ones((3, 8)), jnp.ones((3, 4)))[1].spec.signature
    assert here.startswith("rs1-")
    assert _signature_in_subprocess() == here


def _sig(fun, *args, **kw):
    return rs.split(fun, **kw)(*args)[1].spec.signature


def test_closures_over_different_weights_differ(rng):
    w1 = jax.random.normal(rng, (3, 3))
    w2 = w1.at[0, 0].add(1.0)
    make = lambda w: (lambda x: jnp.sum(jnp.tanh(x @ w)))
    x = jnp.ones((2, 3))
    assert _sig(make(w1), x) == _sig(make(w1), x)
    assert _sig(make(w1), x) != _sig(make(w2), x)


def test_what_changes_a_signature(rng):
    x = jax.random.normal(rng, (4,))
    base = _sig(lambda x: jnp.sum(jnp.sin(x)), x)
    assert base == _sig(lambda x: jnp.sum(jnp.sin(x)), x)
    assert base != _sig(lambda x: jnp.sum(jnp.cos(x)), x)  # code
    assert base != _sig(lambda x: jnp.sum(jnp.sin(x)), x[:3])  # shape
    assert base != _sig(lambda x: jnp.sum(jnp.sin(x)), x.astype(jnp.bfloat16))  # dtype
    assert base != _sig(lambda x: jnp.sum(jnp.sin(x)), 1.0 * x, argnums=(0,))  # argnums
    leaf_sum = lambda t: sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(t))
    assert _sig(leaf_sum, x) != _sig(leaf_sum, (x,))  # tree structure
    assert _sig(lambda x, n: jnp.sum(x**n), x, 2, static_argnums=1) != _sig(
        lambda x, n: jnp.sum(x**n), x, 3, static_argnums=1
    )


def test_treedef_fingerprint_has_no_addresses():
    Point = namedtuple("Point", "x y")
    tree = {"a": [1, Point(2, 3)], "b": (None, 4)}
    text = treedef_fingerprint(jax.tree.structure(tree))
    assert "0x" not in text
    assert "Point" in text and "'a'" in text
    assert text == treedef_fingerprint(jax.tree.structure({"b": (None, 5), "a": [6, Point(7, 8)]}))
    assert text != treedef_fingerprint(jax.tree.structure({"a": [1, (2, 3)], "b": (None, 4)}))
