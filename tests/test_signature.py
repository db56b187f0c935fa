"""The signature: a digest of what is computed, the same in every process, different for any two
functions whose forward or backward differ."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import namedtuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from residual_store._src.canonical import Canonicalizer
from signature_cases import CASES, DISTINCT, SAME, inputs, signature_of

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def here() -> dict[str, str]:
    return {name: signature_of(name) for name in CASES}


@pytest.mark.slow
@pytest.mark.parametrize("a, b", DISTINCT, ids=[f"{a}|{b}" for a, b in DISTINCT])
def test_functions_that_compute_differently_get_distinct_signatures(here, a, b):
    assert here[a].startswith("rs2-") and here[b].startswith("rs2-")
    assert here[a] != here[b]


def test_equal_computations_get_one_signature(here):
    for a, b in SAME:
        assert here[a] == here[b], (a, b)
    assert len(set(here.values())) == len(here) - len(SAME)
    again = rs.split(CASES["bwd_closure_2.0"][0])(*inputs(1))[1].spec.signature
    assert again == here["bwd_closure_2.0"]  # other values, same avals: the same signature


@pytest.mark.subprocess
def test_every_signature_is_the_same_under_four_hash_seeds(here):
    """String hashing (set and dict order) changes with PYTHONHASHSEED: no signature may."""
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(TESTS, "signature_cases.py")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONPATH": TESTS},
        )
        for seed in range(4)
    ]
    for seed, proc in enumerate(procs):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == here, f"PYTHONHASHSEED={seed}"


@pytest.mark.slow
def test_the_issue_collision_gives_the_right_gradient_through_a_store(tmp_path):
    """Two losses that differ only in a custom_vjp bwd closure: each context's backward, loaded
    from the store where one backward is kept per signature, is its own function's."""
    w, x = inputs(3)
    la, lb = CASES["bwd_closure_0.5"][0], CASES["bwd_closure_2.0"][0]
    with rs.Store(tmp_path / "s") as store:
        store.put(rs.split(la)(w, x)[1], "a")
        store.put(rs.split(lb)(w, x)[1], "b")
    script = tmp_path / "reader.py"
    script.write_text(textwrap.dedent(
        """
        import sys, numpy as np, residual_store as rs
        with rs.Store(sys.argv[1], read_only=True) as store:
            np.savez(sys.argv[2], a=rs.backward(store.get("a")), b=rs.backward(store.get("b")))
        """
    ))
    out = tmp_path / "grads.npz"
    subprocess.run([sys.executable, str(script), str(tmp_path / "s"), str(out)], check=True, timeout=120)
    got = np.load(out)
    np.testing.assert_allclose(got["b"], jax.grad(lb)(w, x), rtol=1e-6)
    np.testing.assert_allclose(got["a"], jax.grad(la)(w, x), rtol=1e-6)
    np.testing.assert_allclose(got["b"], 4 * got["a"], rtol=1e-6)  # 2.0 vs 0.5: never the same


_SOURCE = '''
import jax.numpy as jnp

def loss(w, x):
    h = jnp.tanh(x @ w)
    return jnp.sum(h ** 2)
'''
_SOURCE_EDITED = '''
import jax.numpy as jnp
# a comment, and the function moved down by a few lines


def loss(w, x):
    # what it computes is unchanged
    h = jnp.tanh(x @ w)   # same op
    return jnp.sum(h ** 2)
'''


def test_comments_and_moved_lines_do_not_change_it_a_changed_op_does():
    def load(source, filename):
        namespace: dict = {}
        exec(compile(source, filename, "exec"), namespace)
        return namespace["loss"]

    w, x = inputs()
    sig = lambda f: rs.split(f)(w, x)[1].spec.signature
    base = sig(load(_SOURCE, "model.py"))
    assert sig(load(_SOURCE_EDITED, "model_v2.py")) == base
    assert sig(load(_SOURCE.replace("h ** 2", "h ** 3"), "model.py")) != base


def _sig(fun, *args, **kw):
    return rs.split(fun, **kw)(*args)[1].spec.signature


@pytest.mark.slow
def test_closures_over_different_weights_differ(rng):
    w1 = jax.random.normal(rng, (3, 3))
    w2 = w1.at[0, 0].add(1.0)
    make = lambda w: (lambda x: jnp.sum(jnp.tanh(x @ w)))
    x = jnp.ones((2, 3))
    assert _sig(make(w1), x) == _sig(make(w1), x)
    assert _sig(make(w1), x) != _sig(make(w2), x)


@pytest.mark.slow
def test_what_changes_a_signature(rng):
    x = jax.random.normal(rng, (4,))
    base = _sig(lambda x: jnp.sum(jnp.sin(x)), x)
    assert base == _sig(lambda x: jnp.sum(jnp.sin(x)), x)
    assert base != _sig(lambda x: jnp.sum(jnp.cos(x)), x)  # computation
    assert base != _sig(lambda x: jnp.sum(jnp.sin(x)), x[:3])  # shape
    assert base != _sig(lambda x: jnp.sum(jnp.sin(x)), x.astype(jnp.bfloat16))  # dtype
    assert base != _sig(lambda x: jnp.sum(jnp.sin(x)), 1.0 * x, argnums=(0,))  # argnums
    leaf_sum = lambda t: sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(t))
    assert _sig(leaf_sum, x) != _sig(leaf_sum, (x,))  # tree structure
    assert _sig(lambda x, n: jnp.sum(x**n), x, 2, static_argnums=1) != _sig(
        lambda x, n: jnp.sum(x**n), x, 3, static_argnums=1
    )


@pytest.mark.slow
def test_memory_kind_is_part_of_the_signature_and_both_backwards_are_right(rng):
    kw, kx = jax.random.split(rng)
    w, x = jax.random.normal(kw, (4, 3)), jax.random.normal(kx, (5, 4))
    device = jax.devices()[0]
    if "unpinned_host" not in {m.kind for m in device.addressable_memories()}:
        pytest.skip("this backend has no unpinned_host memory")
    x_host = jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind="unpinned_host"))
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
    fwd = rs.split(loss, argnums=(0, 1))
    _, ctx = fwd(w, x)
    _, ctx_host = fwd(w, x_host)
    assert ctx.spec.signature != ctx_host.spec.signature
    assert ctx_host.spec.call.in_avals[1].memory_kind == "unpinned_host"
    ref = jax.grad(loss, argnums=(0, 1))(w, x)
    for c in (ctx, ctx_host, ctx):
        for got, want in zip(fwd.backward(c), ref):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert fwd.cache_info().backward_compiles == 2


def test_internals_treedef_fingerprint_has_no_addresses():
    Point = namedtuple("Point", "x y")
    tree = {"a": [1, Point(2, 3)], "b": (None, 4)}
    text = Canonicalizer().value(jax.tree.structure(tree))
    assert "0x" not in text
    assert "Point" in text and "'a'" in text
    assert text == Canonicalizer().value(jax.tree.structure({"b": (None, 5), "a": [6, Point(7, 8)]}))
    assert text != Canonicalizer().value(jax.tree.structure({"a": [1, (2, 3)], "b": (None, 4)}))


def test_internals_scrub_takes_addresses_and_source_locations_out_of_reprs():
    """A value written by its repr (the last resort) loses what moves between processes and
    edits: memory addresses, decimal ids, file names with lines; a string value stays whole."""

    class Thing:
        def __init__(self, where):
            self.where = where

        def __repr__(self):
            return f"<Thing made at {self.where} id={id(self)} {hex(id(self))}>"

    a = Canonicalizer().value(Thing('/src/model.py:12, File "/src/model.py", line 12'))
    b = Canonicalizer().value(Thing('other_name.py:40, File "other_name.py", line 40'))
    assert a == b and ".py" not in a and "line" not in a, (a, b)
    assert Canonicalizer().value("model.py:12") != Canonicalizer().value("model.py:13")


# Two rules that tracing keeps in the forward's jaxpr as Python functions (each applied to a
# value that is not differentiated, so jax.vjp does not trace it into its rules) and traces into
# the backward where the other call is differentiated: one with nondiff_argnums, one whose fwd
# returns a dict residual. JAX holds each rule's source line (its debug info) beside it.
_RULES_SOURCE = '''
from functools import partial

import jax
import jax.numpy as jnp


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def clip(b, x):
    return jnp.sin(x)


clip.defvjp(lambda b, x: (jnp.sin(x), jnp.cos(x)), lambda b, c, g: (jnp.clip(g * c, -b, b),))


@jax.custom_vjp
def k(x):
    return jnp.sin(x)


k.defvjp(lambda x: (jnp.sin(x), {"c": jnp.cos(x), "s": x}), lambda r, g: (g * r["c"] + r["s"],))


def nondiff(w, x):
    return jnp.sum(clip(0.5, x @ w)) * jnp.sum(clip(0.5, x))


def dict_residual(w, x):
    return jnp.sum(k(x @ w)) * jnp.sum(k(x))
'''
_RULES_RUNNER = '''
import importlib.util, json, sys
import jax, residual_store as rs
spec = importlib.util.spec_from_file_location(sys.argv[1].rsplit("/", 1)[-1][:-3], sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
kw, kx = jax.random.split(jax.random.key(0))
w, x = jax.random.normal(kw, (4, 2)), jax.random.normal(kx, (3, 4))
print(json.dumps({n: rs.split(getattr(module, n))(w, x)[1].spec.signature for n in ("nondiff", "dict_residual")}))
'''


@pytest.mark.subprocess
def test_custom_rules_at_other_lines_and_in_other_files_keep_their_signature(tmp_path):
    """The same custom_vjp rules at other lines of a file of another name, under two hash seeds:
    one signature each; a changed bwd changes it."""
    (tmp_path / "rules.py").write_text(_RULES_SOURCE)
    (tmp_path / "moved_rules.py").write_text("# a comment\n\n# and another, moving every line\n" + _RULES_SOURCE)
    changed = _RULES_SOURCE.replace("jnp.clip(g * c, -b, b)", "jnp.clip(2 * g * c, -b, b)")
    (tmp_path / "changed_rules.py").write_text(changed.replace('r["c"] + r["s"]', 'r["c"] - r["s"]'))
    runner = tmp_path / "runner.py"
    runner.write_text(_RULES_RUNNER)
    runs = [("rules.py", 0), ("rules.py", 1), ("moved_rules.py", 0), ("moved_rules.py", 1), ("changed_rules.py", 0)]
    procs = [
        subprocess.Popen([sys.executable, str(runner), str(tmp_path / name)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONHASHSEED": str(seed)})
        for name, seed in runs
    ]
    got = []
    for (name, seed), proc in zip(runs, procs):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        got.append(json.loads(out.strip().splitlines()[-1]))
    *same, other = got
    assert all(s == same[0] for s in same), dict(zip(runs, got))
    assert all(other[n] != same[0][n] for n in other), (other, same[0])
