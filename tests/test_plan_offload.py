"""A plan's offload inside the programs: the forward writes each offloaded value into a pinned
host buffer the split donates (a scan's stacks an iteration at a time) and reuses once nothing
holds it; the backward reads a scan's stacks a slice ahead; the context says which residuals
live in host memory (``spec.on_host``), and a store neither counts nor moves them, in memory or
through its disk. On a CPU, JAX's pinned host memory kind stands in for the host side.
"""

from __future__ import annotations

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from residual_store._src import scratch
from residual_store._src.store.disk import records
from store_helpers import TESTS_DIR, run_python, write_script
from test_plan import LINKED, _assert_grads, _grad, inputs, loss, stage

PINNED = "pinned_host"


def _planned(f, argnums=(0, 1)):
    return rs.split(f, argnums=argnums, save=rs.plan(device_budget=0, profile=LINKED))


def _kinds(ctx):
    return [r.sharding.memory_kind for r in ctx.residuals]


def _scratch(fwd):
    """The one signature's pinned buffers (a split's internals)."""
    (entry,) = fwd._cache.values()
    return entry.scratch


def test_offloaded_values_live_in_host_memory_and_the_spec_says_which():
    fwd = _planned(loss)
    p, x = inputs(11)
    _, ctx = fwd(p, x)
    on_host = ctx.spec.on_host
    assert on_host and all(ctx.spec.kinds[i] == "intermediate" for i in on_host)
    assert [i for i, k in enumerate(_kinds(ctx)) if k == PINNED] == list(on_host)
    assert ctx.spec.own_nbytes == 0 and ctx.spec.host_nbytes == rs.plan_of(ctx).host_bytes > 0
    assert "(host)" in ctx.describe()
    _assert_grads(fwd.backward(ctx), _grad(p, x))


def test_internals_the_forward_writes_into_donated_buffers_it_reuses_once_nothing_holds_them():
    fwd = _planned(loss)
    p, x = inputs(12)
    want = _grad(p, x)
    _, first = fwd(p, x)
    pool = _scratch(fwd)
    per_context = len(pool.avals)
    assert pool.made == per_context
    kept = [np.asarray(first.residuals[i]) for i in first.spec.on_host]
    for seed in (13, 14):  # while ``first`` lives, later forwards take new buffers, never its own
        fwd(*inputs(seed))
    assert pool.made == 2 * per_context  # the first later one's went back when it was dropped
    for i, before in zip(first.spec.on_host, kept):
        np.testing.assert_array_equal(np.asarray(first.residuals[i]), before)
    _assert_grads(fwd.backward(first), want)
    del first
    for _ in range(3):  # now a forward at a time: the buffers come back each time
        _assert_grads(fwd.backward(fwd(p, x)[1]), want)
    assert pool.made == 2 * per_context
    (entry,) = fwd._cache.values()  # the compiled forward writes in place: each buffer is an output
    aliases = entry.executable.as_text().split("input_output_alias={", 1)[1].split("}, entry", 1)[0]
    assert aliases.count("may-alias") + aliases.count("must-alias") == per_context, aliases


def test_a_store_neither_counts_nor_moves_offloaded_values(tmp_path):
    fwd = _planned(loss)
    p, x = inputs(15)
    want = _grad(p, x)
    _, ctx = fwd(p, x)
    with rs.Store(None, device_budget=0) as store:
        store.put(ctx, "k")
        device = store.stats()["device"]
        assert device["bytes"] == device["bytes_out"] == 0  # nothing of it counted, nothing copied
        back = store.pop("k")
        assert _kinds(back) == _kinds(ctx) and store.stats()["device"]["bytes_in"] == 0
        _assert_grads(fwd.backward(back), want)
    with rs.Store(tmp_path / "s", device_budget=0, host_budget=0) as store:
        store.put(ctx, "k")
        store.flush()
        assert store.stats()["disk"]["bytes_written"] >= ctx.spec.host_nbytes > 0  # written with the context
    with rs.Store(tmp_path / "s") as store:  # fresh: read from disk into host memory again
        back = store.get("k")
        assert back.spec.on_host == ctx.spec.on_host and _kinds(back) == _kinds(ctx)
        _assert_grads(fwd.backward(back), want)


def test_internals_a_manifest_whose_on_host_is_wrong_is_corrupt():
    fwd = _planned(loss)
    _, ctx = fwd(*inputs(16))
    good = json.loads(json.dumps(records.spec_to_map(ctx.spec, [None] * len(ctx.residuals))))  # as stored
    assert good["on_host"] == list(ctx.spec.on_host)
    arrays = [types.SimpleNamespace(shared=k in ("weight", "constant"), dtype=str(a.dtype), shape=list(a.shape))
              for a, k in zip(ctx.spec.avals, ctx.spec.kinds)]  # what the manifest's array records say
    assert records.spec_from_map(ctx.spec.signature, good, arrays, "k")[0] == ctx.spec
    weight = ctx.spec.kinds.index("weight")
    for bad in ([weight], list(reversed(ctx.spec.on_host)), [len(ctx.residuals)], "all", [-1]):
        with pytest.raises(rs.CorruptContextError, match="on_host"):
            records.spec_from_map(ctx.spec.signature, {**good, "on_host": bad}, arrays, "k")
    without = {k: v for k, v in good.items() if k != "on_host"}  # an older manifest: nothing on the host
    assert records.spec_from_map(ctx.spec.signature, without, arrays, "k")[0].on_host == ()


def _reverse_stage(p, x):
    def layer(h, w):
        return h + jnp.tanh(h @ w["a"]) @ w["b"], None

    return jax.lax.scan(layer, x, p, reverse=True)[0]


@pytest.mark.parametrize("layers", [1, 3], ids=["one-iteration", "three"])
def test_a_reverse_scan_and_a_single_iteration_offload_exactly(layers):
    p, x = inputs(17)
    p = jax.tree.map(lambda w: w[:layers], p)

    def f(p, x):
        return jnp.mean(_reverse_stage(p, x) ** 2)

    fwd = _planned(f)
    _, ctx = fwd(p, x)
    assert ctx.spec.on_host
    _assert_grads(fwd.backward(ctx), jax.grad(f, argnums=(0, 1))(p, x))


def test_inside_a_callers_jit_the_forward_makes_its_own_host_buffers():
    fwd = _planned(loss)
    p, x = inputs(18)
    ctx = jax.jit(lambda p, x: fwd(p, x)[1])(p, x)
    assert ctx.spec.on_host and all(_kinds(ctx)[i] == PINNED for i in ctx.spec.on_host)
    _assert_grads(fwd.backward(ctx), _grad(p, x))


def test_internals_pinned_like_wants_one_device_with_pinned_memory():
    avals = [jax.ShapeDtypeStruct((2, 3), jnp.float32)]
    got = scratch.pinned_like(avals, [jnp.ones(2)])
    assert got is not None and got[0].sharding.memory_kind == PINNED and got[0].shape == (2, 3)
    assert jax.jit(lambda x: jnp.asarray(scratch.pinned_like(avals, [x]) is None))(1.0)  # traced: none


_SAME_SHAPE = """
import sys, jax, jax.numpy as jnp, numpy as np, residual_store as rs
sys.path.insert(0, sys.argv[1])
from test_plan import LINKED, inputs, stage

def f(p, x):  # its output has the shape of the offloaded last layer's output
    h = stage(p, x)
    return h, jnp.mean(h ** 2)

fwd = rs.split(f, argnums=(0, 1), save=rs.plan(device_budget=0, profile=LINKED))
p, x = inputs(19)
(h, value), ctx = fwd(p, x)
assert h.sharding.memory_kind == "device" and ctx.spec.on_host
assert any(ctx.residuals[i].shape == h.shape for i in ctx.spec.on_host), ctx.describe()
cts = (jnp.ones_like(h), jnp.float32(1.0))
for _ in range(3):
    (h, value), ctx = fwd(p, x)
    got = fwd.backward(ctx, cts)
want = jax.vjp(f, p, x)[1](cts)
for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    # within 1e-6 of the leaf's largest gradient: a value summed from larger terms of either sign
    # (rounded by the program's order) is not relatively as exact as they are
    scale = float(np.max(np.abs(w)))
    assert scale > 0
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6 * scale)
print("ok", h.sharding.memory_kind)
"""


@pytest.mark.slow
@pytest.mark.parametrize("seed", ["0", "1", "2", "3"])
def test_a_donated_buffer_never_goes_to_a_device_output_of_its_shape(tmp_path, seed):
    """JAX pairs a donated buffer with an output by shape unless every placement is given; a
    pinned buffer given to a device output aborts the process (it did under some hash seeds)."""
    script = write_script(tmp_path, "same_shape.py", _SAME_SHAPE)
    proc = run_python(script, str(TESTS_DIR), env={"PYTHONHASHSEED": seed})
    assert "ok device" in proc.stdout


def test_the_stage_model_keeps_its_name_through_the_copy():
    fwd = _planned(lambda p, x: jnp.mean(stage(p, x) ** 2))
    _, ctx = fwd(*inputs(20))
    assert all("device_put" not in ctx.spec.names[i] for i in ctx.spec.on_host), ctx.describe()


def test_a_backward_takes_its_offloaded_values_on_the_device_too():
    """Each placement of the residuals compiles a backward of its own: a context whose offloaded
    values a caller moved to the device gives the same gradients (a program handed a buffer in
    another memory than it was compiled for would abort the process)."""
    fwd = _planned(loss)
    p, x = inputs(21)
    want = _grad(p, x)
    _, ctx = fwd(p, x)
    on_device = jax.device_put(ctx, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert set(_kinds(on_device)) == {"device"} and PINNED in _kinds(ctx)
    for moved in (on_device, ctx, on_device):
        _assert_grads(fwd.backward(moved), want)


@pytest.mark.slow  # real model libraries, seconds of compiling each: the fast tier aims at 90 s
@pytest.mark.parametrize("name", ["nnx_functional", "linen_scan", "eqx_transformer", "haiku_state"])
def test_real_models_offload_through_a_store_with_jax_grads_gradients(name):
    """Flax NNX and linen, Equinox and Haiku modules planned at budget 0 with a link: what the
    plan offloads stays in host memory through a store at budget 0, and the gradients are
    ``jax.grad``'s."""
    import library_models as lm
    from test_libraries import assert_close_by_path

    case = lm.MAKERS[name]()
    fwd = rs.split(case.fun, **case.options, save=rs.plan(device_budget=0, profile=LINKED))
    args = case.args(jax.random.key(22))
    _, ctx = fwd(*args)
    assert ctx.spec.on_host and rs.plan_of(ctx).host_bytes == ctx.spec.host_nbytes, ctx.describe()
    with rs.Store(None, device_budget=0) as store:
        store.put(ctx, "k")
        back = store.pop("k")
    assert [back.residuals[i].sharding.memory_kind for i in ctx.spec.on_host] == [PINNED] * len(ctx.spec.on_host)
    _, _, want = lm.reference(case)(*args)
    assert_close_by_path(fwd.backward(back), want, f"{name} planned")


def test_internals_the_stored_backward_takes_the_offloaded_residuals_in_host_memory():
    """The exported backward is given the residuals the forward put in host memory there, as
    the context holds them and as the backward inside moves them to the device: exported with
    them in device memory, XLA's host offloading refused to compile it on a TPU v5e (E1200,
    a tensor moved to host returned in device memory), so a process without the model could
    not run an offloading plan's backward there."""
    from jax import export as jax_export

    from residual_store._src.backward import backward_of
    from residual_store._src.store.backwards import serialize

    fwd = rs.split(loss, argnums=(0, 1), save=rs.plan(device_budget=0, profile=LINKED))
    p, x = inputs(23)
    _, ctx = fwd(p, x)
    assert ctx.spec.on_host
    data, _ = serialize(backward_of(ctx)[0], ctx.spec.avals, None, ctx.spec.on_host)
    artifact = jax_export.deserialize(bytearray(data))
    spaces = [a.memory_space for a in artifact.in_avals[: len(ctx.residuals)]]
    assert [i for i, s in enumerate(spaces) if s == jax.memory.Space.Host] == list(ctx.spec.on_host)
    grads = artifact.call(list(ctx.residuals), [jnp.float32(1.0)])
    for g, w in zip(grads, jax.tree.leaves(_grad(p, x)), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6 * float(np.max(np.abs(w))))


def test_threads_running_one_planned_split_at_once_never_share_a_live_buffer():
    """Four threads each run a planned forward three times, holding the contexts until their
    backwards: the pinned buffers the split lends are taken under its lock, so no two live
    contexts write one buffer (each context's host values are as its forward wrote them when its
    backward runs), and every gradient is ``jax.grad``'s. Buffers come back once dropped."""
    import threading

    fwd = _planned(loss)
    seeds = [[100 + 10 * t + i for i in range(3)] for t in range(4)]
    wants = {s: _grad(*inputs(s)) for row in seeds for s in row}
    fwd(*inputs(99))  # (compiled before the threads start, so they race on buffers, not on a compile)
    start = threading.Barrier(len(seeds))
    errors: list[BaseException] = []
    pointers: set[int] = set()
    lock = threading.Lock()

    def work(row):
        try:
            start.wait()
            held = [(s, fwd(*inputs(s))[1]) for s in row]
            written = [[np.asarray(ctx.residuals[i]) for i in ctx.spec.on_host] for _, ctx in held]
            with lock:
                for _, ctx in held:
                    for i in ctx.spec.on_host:
                        ptr = ctx.residuals[i].unsafe_buffer_pointer()
                        assert ptr not in pointers, "two live contexts share a pinned buffer"
                        pointers.add(ptr)
            for (s, ctx), before in zip(reversed(held), reversed(written)):
                for i, was in zip(ctx.spec.on_host, before):
                    np.testing.assert_array_equal(np.asarray(ctx.residuals[i]), was)
                _assert_grads(fwd.backward(ctx), wants[s])
            with lock:  # (out of the live set before they are dropped: then another may take them)
                pointers.difference_update(ctx.residuals[i].unsafe_buffer_pointer()
                                           for _, ctx in held for i in ctx.spec.on_host)
            held.clear()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(row,)) for row in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    pool = _scratch(fwd)
    made = pool.made
    assert 3 * len(pool.avals) <= made <= 13 * len(pool.avals)  # a thread's three alive at once at the least
    _assert_grads(fwd.backward(fwd(*inputs(100))[1]), wants[100])
    assert pool.made == made  # dropped, their buffers are lent again


_SHARDED_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
sys.path.insert(0, {tests!r})
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import residual_store as rs
from test_plan import LINKED, _grad, inputs, loss

root, step = sys.argv[1], sys.argv[2]
mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
p, x = inputs(31)
p = jax.device_put(p, NamedSharding(mesh, P()))
x = jax.device_put(x, NamedSharding(mesh, P("d", None)))
want = [np.asarray(w) for w in jax.tree.leaves(_grad(p, x))]

def check(ctx, grads, where):
    for i in ctx.spec.on_host:  # every offloaded value in host memory, on the forward's devices
        s = ctx.residuals[i].sharding
        assert s.memory_kind == "pinned_host" and s.device_set == set(mesh.devices.flat), (where, i, s)
    for g, w in zip(jax.tree.leaves(grads), want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(w))))

if step == "write":
    fwd = rs.split(loss, argnums=(0, 1), save=rs.plan(device_budget=0, profile=LINKED))
    _, ctx = fwd(p, x)
    assert ctx.spec.on_host
    check(ctx, fwd.backward(ctx), "made")
    _, ctx = fwd(p, x)
    with rs.Store(root, device_budget=0) as store:
        store.put(ctx, "k")
        store.flush()
    with rs.Store(root) as store:  # read back from disk by a store that never held it
        got = store.get("k")
        check(got, fwd.backward(got), "read with the model")
else:  # a fresh process, without the model's split
    with rs.Store(root) as store:
        got = store.get("k")
        check(got, rs.backward(got), "read without the model")
print("OK", step)
"""


@pytest.mark.subprocess
def test_a_sharded_contexts_offloaded_values_come_back_in_host_memory_on_its_devices(tmp_path):
    """A planned forward on two devices puts its offloaded values in their pinned host memory;
    read back from disk (by the writer with its split, and by a fresh process without the
    model), they are placed there again, sharded as they were, not in device memory (where a
    store would count them and a TPU program expecting host memory would refuse them), and the
    backward gives ``jax.grad``'s gradients."""
    script = write_script(tmp_path, "sharded_offload.py", _SHARDED_SCRIPT.format(tests=str(TESTS_DIR)))
    root = str(tmp_path / "store")
    for step in ("write", "read"):
        assert f"OK {step}" in run_python(script, root, step).stdout
