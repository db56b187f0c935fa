"""``weight_argnums``: weights are shared and held by reference; every other input residual (a
pipeline stage's input activation, the batch) is the context's own memory."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from residual_store._src.backward import lookup_backward
from residual_store._src.store.disk import folder as local_backend
from store_helpers import jitted_grad, run_python, write_script

# Shapes no other residual has, so jax.live_arrays() can find the activation by shape.
ACT, W, OUT = (37, 19), (19, 11), 11


def stage2(params, h):
    """A pipeline stage: parameters, and the activation the previous stage sent."""
    return jnp.sum(jnp.tanh(h @ params["w"] + params["b"]) ** 2)


def _stage_inputs(rng):
    kw, kb, kh = jax.random.split(rng, 3)
    params = {"w": jax.random.normal(kw, W) * 0.3, "b": jax.random.normal(kb, (OUT,)) * 0.1}
    return params, jax.random.normal(kh, ACT)


def _live_of_shape(shape):
    """Live arrays of ``shape`` in device memory (not in a host memory space)."""
    return [a for a in jax.live_arrays() if a.shape == shape and a.sharding.memory_kind in (None, "device")]


@pytest.mark.slow
def test_a_stage_input_is_the_contexts_own_and_is_freed_when_offloaded(tmp_path, rng):
    params, h = _stage_inputs(rng)
    # copies: on a CPU np.asarray shares the device buffer, which would keep an array of ACT alive
    want = [np.array(g, copy=True) for g in jax.tree.leaves(jitted_grad(stage2, (0, 1))(params, h))]
    fwd = rs.split(stage2, argnums=(0, 1))  # weight_argnums: argnums[0], the parameters
    _, ctx = fwd(params, h)
    kinds = dict(zip(ctx.spec.names, ctx.spec.kinds))
    assert kinds["input h"] == "input" and kinds["input params['w']"] == "weight"
    own = sum(x.nbytes for x, k in zip(ctx.residuals, ctx.spec.kinds) if k in ("input", "intermediate"))
    assert own >= h.nbytes
    with rs.Store(tmp_path / "s", device_budget=0, host_budget=0) as store:
        store.put(ctx, "mb0")
        store.flush()
        stats = store.stats()
        # zero budgets: the context never entered a memory tier, it went straight to disk
        assert stats["device"] == {"bytes": 0, "contexts": 0, "bytes_in": 0, "bytes_out": 0, "leaving": 0,
                                   "lent": 0, "held": 0}
        assert stats["host"] == {"bytes": 0, "contexts": 0, "bytes_in": 0, "bytes_out": 0}
        assert stats["disk"]["writes"] == 1 and stats["disk"]["bytes_written"] == own
        del ctx, h
        gc.collect()
        assert _live_of_shape(ACT) == []  # the activation left the device with its context
        got = fwd.backward(store.get("mb0"))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # on disk: the activation with the context, the parameters once under weights/
    manifest = _manifest(tmp_path / "s", "mb0")
    by_name = {r["name"]: r for r in manifest["arrays"]}
    assert not by_name["input h"]["shared"] and by_name["input h"]["path"].startswith("data/mb0.")
    assert by_name["input params['w']"]["shared"]
    assert by_name["input params['w']"]["path"].startswith("weights/")


@pytest.mark.slow
def test_a_stage_input_spilled_to_host_memory_leaves_the_device(rng):
    params, h = _stage_inputs(rng)
    fwd = rs.split(stage2, argnums=(0, 1))
    _, ctx = fwd(params, h)
    want = np.array(fwd.backward(ctx)[1], copy=True)
    with rs.Store(None, device_budget=0) as store:  # host memory only
        store.put(ctx, "mb0")
        del ctx, h
        store.flush()  # the copy to host memory has landed (put returned once it started)
        gc.collect()
        assert _live_of_shape(ACT) == []
        assert store.stats()["host"]["contexts"] == 1
        np.testing.assert_allclose(fwd.backward(store.get("mb0"))[1], want, rtol=1e-6)


def test_budgets_count_inputs_and_not_weights(tmp_path, rng):
    params, h = _stage_inputs(rng)
    fwd = rs.split(stage2, argnums=(0, 1))
    _, ctx = fwd(params, h)
    own = sum(x.nbytes for x, k in zip(ctx.residuals, ctx.spec.kinds) if k in ("input", "intermediate"))
    with rs.Store(None) as store:
        store.put(ctx, "a")
        assert store.stats()["device"] == {"bytes": own, "contexts": 1, "bytes_in": own, "bytes_out": 0, "leaving": 0,
                                           "lent": 0, "held": own}
    with rs.Store(None, device_budget=own - 1) as store:  # the activation alone does not fit
        store.put(ctx, "a")
        assert store.stats()["host"] == {"bytes": own, "contexts": 1, "bytes_in": own, "bytes_out": 0}
        assert store.get("a").residuals[ctx.spec.names.index("input h")].shape == ACT


def test_weight_argnums_makes_an_argument_a_weight(tmp_path, rng):
    params, h = _stage_inputs(rng)
    shared = rs.split(stage2, argnums=(0, 1), weight_argnums=(0, 1))
    _, ctx = shared(params, h)
    assert {k for n, k in zip(ctx.spec.names, ctx.spec.kinds) if n.startswith("input")} == {"weight"}
    with rs.Store(None) as store:
        store.put(ctx, "a")
        own = sum(x.nbytes for x, k in zip(ctx.residuals, ctx.spec.kinds) if k == "intermediate")
        assert store.stats()["device"]["bytes"] == own
    with pytest.raises(rs.InvalidArgumentError, match="not in argnums"):
        rs.split(stage2, argnums=0, weight_argnums=1)


@pytest.mark.subprocess
def test_du_and_inspect_tell_inputs_from_weights(tmp_path, rng):
    params, h = _stage_inputs(rng)
    fwd = rs.split(stage2, argnums=(0, 1))
    root = str(tmp_path / "s")
    with rs.Store(root) as store:
        for i in range(3):
            store.put(fwd(params, h + i)[1], f"mb{i}")
    cli = [sys.executable, "-m", "residual_store"]
    du = json.loads(subprocess.run([*cli, "du", root, "--json"], capture_output=True, text=True, check=True).stdout)
    (entry,) = du["signatures"].values()
    assert entry["inputs"] == 3 * int(np.prod(ACT)) * 4  # each context's own activation
    assert entry["weights"] == int(np.prod(W)) * 4  # the weight matrix, once (b is no residual)
    rows = json.loads(
        subprocess.run([*cli, "inspect", root, "mb1", "--json"], capture_output=True, text=True, check=True).stdout
    )["residuals"]
    kinds = {r["name"]: (r["kind"], r["shared"]) for r in rows}
    assert kinds["input h"] == ("input", False)
    assert kinds["input params['w']"] == ("weight", True)


@pytest.mark.slow
def test_internals_a_deleted_split_is_collected_and_its_contexts_keep_their_backward(rng):
    x = jax.random.normal(rng, (5,))
    fwd = rs.split(lambda v: jnp.sum(jnp.sin(v) ** 2))
    _, ctx = fwd(x)
    want = np.asarray(fwd.backward(ctx))
    sig, alive = ctx.spec.signature, weakref.ref(fwd)
    del fwd
    gc.collect()
    assert alive() is None  # the registry does not hold the split, its executables or constants
    np.testing.assert_allclose(rs.backward(ctx), want, rtol=1e-6)  # the context holds its backward
    del ctx
    gc.collect()
    assert lookup_backward(sig) is None


def _manifest(root, key):
    import msgpack

    with open(os.path.join(root, "contexts", f"{key}.manifest"), "rb") as f:
        return msgpack.unpackb(f.read())


@pytest.mark.slow
def test_internals_a_context_read_back_holds_the_callers_live_weights_not_copies(tmp_path, rng, monkeypatch):
    """A store's get of a context it wrote takes the weights from the live arrays the put held
    (no read, no second copy on the device) while the caller holds them; a weight deleted
    (donated) since is read from disk again. Gradients: bit for bit the in-memory ones."""
    params, h = _stage_inputs(rng)
    fwd = rs.split(stage2, argnums=(0, 1), weight_argnums=0)
    _, ctx = fwd(params, h)
    want = fwd.backward(ctx)
    batches = []
    real = local_backend.LocalBackend.read_arrays
    monkeypatch.setattr(
        local_backend.LocalBackend, "read_arrays", lambda self, arrays, **kw: batches.append(list(arrays)) or real(self, arrays, **kw)
    )

    def weight_reads():
        return sum(1 for batch in batches for path, *_ in batch if path.startswith("weights/"))

    with rs.Store(tmp_path / "s", device_budget=0, host_budget=0) as store:
        store.put(ctx, "k")
        store.flush()
        del ctx
        got = store.get("k")
        (weight,) = [x for x, k in zip(got.residuals, got.spec.kinds) if k == "weight"]
        assert weight is params["w"]  # the caller's array: b is no residual of this backward
        assert weight_reads() == 0
        assert_equal_trees(fwd.backward(got), want)
        del got, weight
        params["w"].delete()  # as a donation to an optimizer step would
        got = store.get("k")
        assert weight_reads() == 1
        assert_equal_trees(fwd.backward(got), want)
        del got
        gc.collect()
        got = store.get("k")  # the copy read before went with its context: read again
        assert weight_reads() == 2
        assert_equal_trees(fwd.backward(got), want)


def assert_equal_trees(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


_WEIGHTS_ELSEWHERE = """
import sys, jax
jax.config.update("jax_num_cpu_devices", 2)
import jax.numpy as jnp, numpy as np, residual_store as rs

def stage(p, x):
    return jnp.sum(jnp.tanh(x @ p["w"]) ** 2)

dev0, dev1 = jax.devices()
fwd = rs.split(stage, argnums=(0, 1), weight_argnums=0)
p = {"w": jax.device_put(jax.random.normal(jax.random.key(0), (8, 16)), dev0)}
x = jax.device_put(jax.random.normal(jax.random.key(1), (4, 8)), dev0)
_, ctx = fwd(p, x)
want = fwd.backward(ctx)
# the stage's store reads onto dev1: the caller's weight, on dev0, is not what a read gives
with rs.Store(sys.argv[1], device_budget=0, host_budget=0, device=dev1) as store:
    store.put(ctx, "k")
    store.flush()
    got = store.get("k")
    assert {next(iter(r.devices())) for r in got.residuals} == {dev1}, [r.devices() for r in got.residuals]
    assert all(r is not p["w"] for r in got.residuals)
    for a, b in zip(jax.tree.leaves(fwd.backward(got)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
# on dev0, the caller's own array
with rs.Store(sys.argv[1] + "-0", device_budget=0, host_budget=0, device=dev0) as store:
    store.put(ctx, "k")
    store.flush()
    assert any(r is p["w"] for r in store.get("k").residuals)
print("ok")
"""


@pytest.mark.slow
def test_live_weights_on_another_device_than_the_stores_are_read_onto_its_device(tmp_path):
    script = write_script(tmp_path, "weights_elsewhere.py", _WEIGHTS_ELSEWHERE)
    proc = run_python(script, str(tmp_path / "store"))
    assert proc.stdout.strip() == "ok", proc.stdout + proc.stderr


# -- weights donated between put and the write ----------------------------------------------


def _gated(store):
    """Holds the store's writer until the returned event is set: the put's write waits behind
    it, so what the test does next happens before the write, as on a slow disk."""
    import threading

    gate = threading.Event()
    store._persistence.writer.submit(lambda: gate.wait(60), 0)
    return gate


def _donate(params):
    """The optimizer's step, with the parameters donated (their buffers taken)."""
    return jax.jit(lambda p: jax.tree.map(lambda w: w * 0.9, p), donate_argnums=0)(params)


@pytest.mark.parametrize("how", ["donate", "delete"])
def test_weights_donated_after_put_before_the_write_are_stored_right(tmp_path, rng, how):
    """A put takes its weights' host copies at once: a donation (or ``delete``) after ``put``
    returns, before the slow writer reached the context, neither fails nor changes what is
    stored. Read back in a new store: the very residuals, and jax.grad's gradients."""
    from store_helpers import F32_TOL, assert_contexts_identical, assert_trees_close

    params, h = _stage_inputs(rng)
    want_grads = jitted_grad(stage2, (0, 1))(params, h)
    fwd = rs.split(stage2, argnums=(0, 1))
    _, ctx = fwd(params, h)
    want = fwd(jax.tree.map(jnp.copy, params), h)[1]  # the same context, on arrays kept alive
    assert any(k == "weight" for k in ctx.spec.kinds)
    with rs.Store(tmp_path / "s") as store:
        gate = _gated(store)
        store.put(ctx, "mb0")
        if how == "donate":
            _donate(params)
        else:
            for w in jax.tree.leaves(params):
                w.delete()
            assert all(w.is_deleted() for w, k in zip(ctx.residuals, ctx.spec.kinds) if k == "weight")
        # (donated on a CPU, XLA copies the buffer a host view of the put still holds, instead of
        # taking it; on an accelerator the buffer goes, and the put's host copy is its own)
        gate.set()
        store.flush()
    with rs.Store(tmp_path / "s", read_only=True) as store:
        got = store.get("mb0")
        assert_contexts_identical(got, want)
        assert_trees_close(rs.backward(got), want_grads, **F32_TOL)


def test_a_weight_donated_before_put_is_refused_by_name(tmp_path, rng):
    params, h = _stage_inputs(rng)
    fwd = rs.split(stage2, argnums=(0, 1))
    _, ctx = fwd(params, h)
    _donate(params)
    with rs.Store(tmp_path / "s") as store:
        with pytest.raises(rs.InvalidArgumentError, match=r"params\['w'\].*deleted"):
            store.put(ctx, "mb0")
        assert store.keys() == []


def test_an_own_residual_donated_before_the_write_is_a_library_error_naming_it(tmp_path, rng):
    """The stage's input activation is the context's own (written in the background): donated
    before the write, the flush raises the library's error naming it, and the put is not in the
    store (never a silently wrong or half-written context)."""
    params, h = _stage_inputs(rng)
    fwd = rs.split(stage2, argnums=(0, 1))
    _, ctx = fwd(params, h)
    with rs.Store(tmp_path / "s") as store:
        gate = _gated(store)
        store.put(ctx, "mb0")
        jax.jit(lambda x: x * 2, donate_argnums=0)(h)
        gate.set()
        with pytest.raises(rs.InvalidArgumentError, match=r"input h.*deleted"):
            store.flush()
        assert "mb0" not in store
    with rs.Store(tmp_path / "s", read_only=True) as store:
        assert store.keys() == []
