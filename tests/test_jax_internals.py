"""Each assumption residual_store._src._jax_internals makes about JAX, checked by name.

When one of these fails after a JAX upgrade, the test name says which assumption broke; fix
the shim tagged with it in ``residual_store/_src/_jax_internals.py`` (the only module that touches
JAX internals; ``origins.py``, ``canonical.py``'s jaxpr text and ``jaxpr_walks.py`` are built
on its shims).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

from residual_store._src import _jax_internals as ji
from residual_store._src import jaxpr_walks
from residual_store._src.canonical import _jaxpr_hook, jaxpr_text
from residual_store._src.origins import output_origins


def test_assumption_EVAL_JAXPR():
    closed = jax.make_jaxpr(lambda x, y: (jnp.sin(x) * y, x + 1))(1.0, 2.0)
    out = ji.eval_jaxpr(closed.jaxpr, closed.consts, 0.5, 3.0)
    assert jnp.allclose(out[0], jnp.sin(0.5) * 3.0) and jnp.allclose(out[1], 1.5)


def _tanh(x):
    return jnp.tanh(x)


def test_assumption_EQN_SOURCE():
    line = _line() + 1
    closed = jax.make_jaxpr(lambda x: jnp.tanh(x))(1.0)
    origin = output_origins(closed, [0])[0]
    assert origin.primitive == "tanh"
    assert (origin.file, origin.line) == ("test_jax_internals.py", line), origin
    # The pieces residual names are built from, checked one by one so a change names itself.
    sui = ji._source_info_util
    tb = closed.jaxpr.eqns[0].source_info.traceback
    assert tb is not None and hasattr(tb, "raw_frames"), "EQN_SOURCE: no Traceback.raw_frames()"
    codes, lastis = tb.raw_frames()
    assert len(codes) == len(lastis) and codes, "EQN_SOURCE: raw_frames() is not (codes, lastis)"
    files = [c.co_filename for c in codes]
    assert not sui.is_user_filename(files[0]), f"EQN_SOURCE: innermost frame is not JAX's: {files[0]}"
    assert not sui.is_user_filename(jax.__file__), "EQN_SOURCE: is_user_filename accepts JAX's files"
    mine = [i for i, c in enumerate(codes) if c.co_filename == __file__]
    assert [codes[i].co_name for i in mine] == ["<lambda>"], mine
    nested = jax.make_jaxpr(lambda x: _tanh(x))(1.0).jaxpr.eqns[0].source_info.traceback.raw_frames()[0]
    assert [c.co_name for c in nested if c.co_filename == __file__] == ["_tanh", "<lambda>"], (
        "EQN_SOURCE: raw_frames() is not innermost first"
    )
    frame = sui.raw_frame_to_frame(codes[mine[0]], lastis[mine[0]])
    assert (frame.file_name, frame.start_line) == (__file__, line), "EQN_SOURCE: raw_frame_to_frame"
    assert ji.user_line(tb) == ("test_jax_internals.py", line) and ji.user_line(None) == (None, None)


def _line() -> int:
    import inspect

    return inspect.currentframe().f_back.f_lineno


def test_assumption_NAME_STACK():
    sui = ji._source_info_util

    def f(x):
        with jax.named_scope("outer"):
            y = jax.jit(lambda a: jnp.sin(a))(x)
            with jax.named_scope("inner"):
                z = jnp.cos(y)
        return jax.vmap(jnp.exp)(z)

    closed = jax.make_jaxpr(f)(jnp.ones(2))
    jit_eqn, cos_eqn, exp_eqn = closed.jaxpr.eqns
    for eqn in (jit_eqn, cos_eqn, exp_eqn):
        stack = eqn.source_info.name_stack.stack
        assert isinstance(stack, tuple) and all(isinstance(e, (sui.Scope, sui.Transform)) for e in stack), (
            f"NAME_STACK: name_stack.stack is not a tuple of Scope/Transform: {stack!r}"
        )
    assert ji.name_scopes(jit_eqn) == ("outer",) and ji.name_scopes(cos_eqn) == ("outer", "inner")
    assert any(isinstance(e, sui.Transform) for e in exp_eqn.source_info.name_stack.stack), (
        "NAME_STACK: vmap is no longer a Transform on the name stack"
    )
    assert ji.name_scopes(exp_eqn) == (), "NAME_STACK: transformations leak into the scopes"
    (sin_eqn,) = jit_eqn.params["jaxpr"].jaxpr.eqns
    assert ji.name_scopes(sin_eqn) == (), "NAME_STACK: inner name stacks are no longer relative"

    def h(a):
        with jax.named_scope("inner"):
            return jnp.cos(a)

    def g(x):
        with jax.named_scope("top"):
            return jax.jit(h)(x)

    origin = output_origins(jax.make_jaxpr(g)(1.0), [0])[0]
    assert origin.primitive == "cos" and origin.name_stack == ("top", "inner"), (
        f"NAME_STACK: inner name stacks are not relative to their equation: {origin}"
    )


def test_assumption_NAME_PRIMITIVE():
    closed = jax.make_jaxpr(lambda x: checkpoint_name(jnp.sin(x), "my_label"))(1.0)
    assert closed.jaxpr.eqns[-1].primitive.name == ji.NAME_PRIMITIVE
    assert output_origins(closed, [0])[0].label == "my_label"


def test_assumption_SUBJAXPR_OUTVARS():
    def f(x):
        y = jax.jit(lambda a: checkpoint_name(jnp.cos(a), "inside_jit"))(x)
        carry, ys = jax.lax.scan(lambda c, a: (c + a, jnp.exp(a)), 0.0, x)
        passthrough = jax.jit(lambda a, b: b)(y, x)
        return y, ys, passthrough

    closed = jax.make_jaxpr(f)(jnp.ones(3))
    jit_origin, scan_origin, through = output_origins(closed, [0, 1, 2])
    assert jit_origin.label == "inside_jit" and jit_origin.scopes == ("jit",)
    assert scan_origin.primitive == "exp" and scan_origin.scopes == ("scan",)
    assert through.primitive is None and through.invar == 0
    scan_eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")
    assert ji.body_for_outputs(scan_eqn) is scan_eqn.params["jaxpr"].jaxpr, (
        "SUBJAXPR_OUTVARS: a scan's outputs are not its body's"
    )


def test_assumption_REMAT_PRIMITIVE():
    closed = jax.make_jaxpr(jax.checkpoint(lambda x: jnp.sin(x)))(1.0)
    eqn = closed.jaxpr.eqns[0]
    assert eqn.primitive.name in ji.REMAT_PRIMITIVE_NAMES
    assert "jaxpr" in eqn.params


def _custom(optimize_remat):
    @jax.custom_vjp
    def k(x):
        return jnp.sin(x)

    k.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,), optimize_remat=optimize_remat)
    return k


def test_assumption_CUSTOM_VJP_THUNK():
    for optimize, expected in ((False, 1), (True, 0)):
        closed = jax.make_jaxpr(jax.checkpoint(_custom(optimize)))(1.0)
        eqn = closed.jaxpr.eqns[0].params["jaxpr"].eqns[0]
        assert eqn.primitive.name == ji.CUSTOM_VJP_PRIMITIVE
        assert "fwd_jaxpr_thunk" in eqn.params and "num_consts" in eqn.params
        found = jaxpr_walks.unoptimized_remat_custom_vjps(closed)
        assert len(found) == expected
        if found:
            assert found[0].startswith("k (defined at test_jax_internals.py:"), found
    # Not under remat: nothing to warn about.
    assert jaxpr_walks.unoptimized_remat_custom_vjps(jax.make_jaxpr(_custom(False))(1.0)) == []


def test_vjp_is_a_pytree_with_input_residuals_by_identity():
    """rs.split relies on jax.vjp returning a pytree whose leaves include the primal inputs
    themselves (same tracer objects) for residuals that are inputs."""
    box = {}

    def fwd(w, x):
        out, vjp = jax.vjp(lambda w: jnp.sum(jnp.tanh(x @ w)), w)
        leaves, treedef = jax.tree.flatten(vjp)
        box["identity"] = [leaf is x for leaf in leaves]
        return out, leaves

    jax.jit(fwd).trace(jnp.ones((3, 2)), jnp.ones((4, 3)))
    assert any(box["identity"])


def _vjp_jaxprs(f, *args):
    """The forward (under jax.vjp) and backward jaxprs of ``f``, as rs.split traces them."""
    box = {}

    def forward(*a):
        out, vjp = jax.vjp(f, *a)
        leaves, box["tree"] = jax.tree.flatten(vjp)
        return out, leaves

    fwd = jax.jit(forward).trace(*args)
    out, leaves = jax.eval_shape(forward, *args)
    bwd = jax.make_jaxpr(lambda res, ct: jax.tree.unflatten(box["tree"], res)(ct))(leaves, out)
    return fwd.jaxpr, bwd


def test_assumption_JAXPR_TEXT():
    import re

    first = jaxpr_text(jax.make_jaxpr(jax.checkpoint(_custom(False)))(1.0))
    again = jaxpr_text(jax.make_jaxpr(jax.checkpoint(_custom(False)))(1.0))
    assert not re.search(r"0x[0-9a-f]{6,}", first), first
    assert first == again
    assert "remat" in first or "checkpoint" in first
    # weak types and literals are written
    text = jaxpr_text(jax.make_jaxpr(lambda x: x * 2.5)(1.0))
    assert "~float32" in text and "lit(" in text
    # the internal types the text is written from are told apart
    closed = jax.make_jaxpr(lambda x: x * 2.5)(1.0)
    values = (closed, closed.jaxpr, closed.jaxpr.invars[0].aval, closed.jaxpr.eqns[0].primitive,
              jax.random.key(0).dtype, 1.0)
    kinds = [ji.internal_kind(v) for v in values]
    assert kinds == ["closed_jaxpr", "jaxpr", "aval", "primitive", "extended_dtype", None], (
        f"JAXPR_TEXT: JAX's internal types moved: {kinds}"
    )
    # a custom_vjp bwd rule is traced into the backward jaxpr, with the value it closes over
    def scaled(scale):
        @jax.custom_vjp
        def f(x):
            return jnp.sin(x)

        f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c * scale,))
        return f

    a, b = (_vjp_jaxprs(scaled(s), jnp.ones(3))[1] for s in (0.5, 2.0))
    assert jaxpr_text(a) != jaxpr_text(b)
    assert jaxpr_text(a) == jaxpr_text(_vjp_jaxprs(scaled(0.5), jnp.ones(3))[1])


def test_jaxpr_text_sorts_sets_in_params():
    """A remat policy holding a frozenset of names prints in string-hash order; the text sorts it."""
    policy = jax.checkpoint_policies.save_only_these_names("b", "a", "c")
    closed = jax.make_jaxpr(jax.checkpoint(lambda x: jnp.sin(x), policy=policy))(1.0)
    text = jaxpr_text(closed)
    assert "frozenset{s'a',s'b',s'c'}" in text, text


def test_assumption_HOST_CALLBACK():
    import numpy as np
    from jax.experimental import io_callback

    def f(x):
        jax.debug.print("x {}", x)
        y = jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        z = io_callback(lambda a: np.asarray(a), jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return jnp.sum(y * z)

    found = jaxpr_walks.host_callbacks(jax.make_jaxpr(f)(jnp.ones(3)))
    assert len(found) == 3 and set(found) <= ji.HOST_CALLBACK_PRIMITIVES, found
    assert jaxpr_walks.host_callbacks(jax.make_jaxpr(jnp.sin)(1.0)) == []


def test_assumption_DISTRIBUTED_CLIENT():
    """Checked without initializing a job: the attribute exists and is None in one process; the
    client's methods are checked by tests/test_multiprocess.py, which uses them."""
    from jax._src import distributed

    assert hasattr(distributed.global_state, "client")
    assert ji.distributed_client() is None
    import jaxlib  # the client's class lives in jaxlib's extension

    client_cls = next(
        (getattr(m, "DistributedRuntimeClient") for m in _extension_modules(jaxlib) if hasattr(m, "DistributedRuntimeClient")),
        None,
    )
    assert client_cls is not None
    for method in ("key_value_set", "blocking_key_value_get", "key_value_delete"):
        assert hasattr(client_cls, method), method


def _extension_modules(jaxlib):
    import importlib

    for name in ("jaxlib._jax", "jaxlib.xla_extension", "jaxlib.xla_client"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        yield module
        yield getattr(module, "distributed", module)


def test_assumption_TRACER_KINDS():
    seen = {}

    def record(tag):
        def f(x):
            seen[tag] = ji.transformation(x)
            return x

        return f

    jax.jit(record("jit"))(1.0)
    jax.eval_shape(record("eval_shape"), 1.0)
    jax.vmap(record("vmap"))(jnp.ones(2))
    jax.grad(record("grad"))(1.0)
    jax.jvp(record("jvp"), (1.0,), (1.0,))
    record("concrete")(jnp.ones(2))
    assert seen == {
        "jit": "jit",
        "eval_shape": "jit",
        "vmap": "jax.vmap",
        "grad": "jax.grad (or jax.jvp, jax.linearize)",
        "jvp": "jax.grad (or jax.jvp, jax.linearize)",
        "concrete": None,
    }, f"TRACER_KINDS: JAX's tracer classes changed: {seen}"


@pytest.mark.slow
def test_assumption_BIND_EQUATION():
    """Equations re-bound one by one compute what the jaxpr computes; a scan's parts run
    through ``jax.lax.scan``; a jit's and a checkpoint's bodies evaluated in place do too."""

    @jax.jit
    def inner(a, b):
        return jnp.sin(a) * b

    def f(x, ws):
        y = jax.checkpoint(lambda u: jnp.tanh(u) * 2.0)(inner(x, 3.0))
        carry, ys = jax.lax.scan(lambda c, w: (c @ w, jnp.sum(c)), y, ws, reverse=True)
        return carry, ys

    x, ws = jnp.linspace(0.1, 1.0, 4).reshape(1, 4), jnp.full((3, 4, 4), 0.3)
    closed = jax.make_jaxpr(f)(x, ws)
    by_name = {e.primitive.name: e for e in closed.jaxpr.eqns}
    assert {"jit", "scan"} <= set(by_name) and set(by_name) & ji.REMAT_PRIMITIVE_NAMES, (
        f"BIND_EQUATION: expected jit, scan and checkpoint equations, got {sorted(by_name)}"
    )

    def rebound(x, ws):
        env = dict(zip(closed.jaxpr.invars, (x, ws)))
        read = lambda v: v.val if ji.is_literal(v) else env[v]  # noqa: E731
        for eqn in closed.jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            scan, body = ji.scan_parts(eqn), ji.call_body(eqn)
            if scan is not None:
                assert (scan.num_consts, scan.num_carry, scan.length, scan.reverse) == (0, 1, 3, True), scan
                step = lambda c, w, s=scan: tuple(ji.eval_jaxpr(s.body, s.consts, c, w))  # noqa: E731
                outs = list(jax.lax.scan(step, invals[0], invals[1], length=scan.length, reverse=scan.reverse, unroll=scan.unroll))
            elif body is not None:
                outs = ji.eval_jaxpr(body[0], body[1], *invals)
            else:
                outs = ji.bind_equation(eqn, invals)
            assert len(outs) == len(eqn.outvars), f"BIND_EQUATION: {eqn.primitive.name} outputs"
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in closed.jaxpr.outvars]

    want = f(x, ws)
    for got in (rebound(x, ws), jax.jit(rebound)(x, ws)):
        for g, w in zip(got, want):
            assert jnp.allclose(g, w, atol=1e-6), "BIND_EQUATION: re-bound equations disagree"
    assert not ji.is_dropped(closed.jaxpr.outvars[0]) and ji.scan_parts(by_name["jit"]) is None


def test_assumption_BIND_EQUATION_inline_calls_and_callers():
    """``inline_calls`` puts jit bodies in place, at the top level and in scan bodies (same
    values, no jit equation left, checkpoint bodies kept whole), and an inlined ``jnp`` body's
    equations, which record only frames inside it, take the line that called it;
    ``has_inner_jaxprs`` sees higher-order equations."""
    inner = jax.jit(lambda a: jnp.tanh(a) * 3.0)

    def f(x):
        y = jax.checkpoint(lambda u: jnp.sin(u))(inner(x)) + 1.0
        return jax.lax.scan(lambda c, _: (jnp.where(c > 0.5, c, -c), None), y, length=2)[0]

    where_line = f.__code__.co_firstlineno + 2
    closed = jax.make_jaxpr(f)(jnp.ones(3))
    flat = jaxpr_walks.inline_calls(closed, [jax.ShapeDtypeStruct((3,), jnp.float32)])
    names = [e.primitive.name for e in flat.jaxpr.eqns]
    assert "jit" not in names and "pjit" not in names and set(names) & ji.REMAT_PRIMITIVE_NAMES, names
    body = next(e for e in flat.jaxpr.eqns if e.primitive.name == "scan").params["jaxpr"].jaxpr
    assert {"jit", "pjit"}.isdisjoint(e.primitive.name for e in body.eqns), "BIND_EQUATION: a jit in a scan body"
    select = next(e for e in body.eqns if e.primitive.name == "select_n")
    assert ji.equation_line(select) == ("test_jax_internals.py", where_line), "EQN_SOURCE: the caller's line"
    x = jnp.linspace(0.1, 1.0, 3)
    assert jnp.allclose(ji.eval_jaxpr(flat.jaxpr, flat.consts, x)[0], f(x))
    assert [ji.has_inner_jaxprs(e) for e in closed.jaxpr.eqns].count(True) == 3

def test_assumption_DEBUG_INFO():
    """A custom_vjp applied to a value not differentiated stays a ``custom_vjp_call`` in the
    forward of jax.vjp, its rules' debug info (with this file and line) in its params; the
    canonical text writes none of it, nor an equation's source info."""
    from residual_store._src.canonical import Canonicalizer

    assert "func_src_info" in ji._lu.DebugInfo._fields, "DEBUG_INFO: DebugInfo has no func_src_info"
    kernel = _custom(False)
    forward = lambda w, x: jax.vjp(lambda w: jnp.sum(w * kernel(x)), w)[0]  # noqa: E731 - x: no tangent
    fwd = jax.jit(forward).trace(jnp.ones(3), jnp.ones(3)).jaxpr
    eqns = [e for e in fwd.jaxpr.eqns if e.primitive.name == ji.CUSTOM_VJP_PRIMITIVE]
    assert eqns, "DEBUG_INFO: a custom_vjp on an undifferentiated value is no custom_vjp_call"
    info = eqns[0].source_info
    assert isinstance(info, ji._source_info_util.SourceInfo), f"DEBUG_INFO: source_info is {type(info)}"
    assert isinstance(info.traceback, ji._source_info_util.Traceback), "DEBUG_INFO: no Traceback type"
    assert ji.internal_kind(info) == ji.internal_kind(info.traceback) == "debug", "DEBUG_INFO: debug types"
    assert ji.internal_kind(eqns[0].params["bwd"]) == "wrapped_fun", "DEBUG_INFO: bwd is no WrappedFun"

    def written_whole(v, canon):
        return None if isinstance(v, ji._DEBUG_TYPES) else _jaxpr_hook(v, canon)

    raw = Canonicalizer(hook=written_whole).value(fwd)
    assert "test_jax_internals.py:" in raw, "DEBUG_INFO: the rule's source line is not in the params"
    assert "test_jax_internals" not in jaxpr_text(fwd)


def test_assumption_HOST_TO_DEVICE():
    """``device_put_many`` makes what ``jax.device_put`` makes, aliasing an aligned CPU buffer
    as it does."""
    import residual_store_serializers as serializers

    device = jax.devices()[0]
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((), np.int32),
              np.ones((0, 2), jnp.bfloat16), np.array([True, False])]
    aligned = serializers.aligned_empty((8, 8), np.float32)
    aligned[...] = 1.5
    arrays.append(aligned)
    for committed, target in ((False, None), (True, device)):
        got = ji.device_put_many(arrays, device, committed)
        want = jax.device_put(arrays, target)
        for g, w, a in zip(got, want, arrays):
            assert isinstance(g, jax.Array) and (g.aval, g.sharding, g.committed) == (w.aval, w.sharding, w.committed), (
                f"HOST_TO_DEVICE: batched_device_put made {g.aval} {g.sharding} committed={g.committed}, "
                f"jax.device_put {w.aval} {w.sharding} committed={w.committed}"
            )
            np.testing.assert_array_equal(np.asarray(g), a, err_msg="HOST_TO_DEVICE: values differ")
        assert np.shares_memory(np.asarray(got[-1]), aligned) == np.shares_memory(np.asarray(want[-1]), aligned), (
            "HOST_TO_DEVICE: batched_device_put and jax.device_put disagree on aliasing a host buffer"
        )
    assert ji.any_tracer([jnp.ones(2), 1.0]) is False
    assert jax.jit(lambda x: jnp.asarray(ji.any_tracer([x, 1.0])))(1.0), "TRACER_KINDS: a jit value is not a Tracer"


def test_assumption_COMMITMENT():
    """``with_commitment`` re-wraps an array's own buffers committed or not, and compiled code
    takes an uncommitted sub-byte array (the store places sub-byte residuals so)."""
    device = jax.devices()[0]
    values = np.arange(-4, 4)
    for dtype in (jnp.int4, jnp.float32):
        x = jax.device_put(values.astype(dtype), device)
        assert x.committed, "COMMITMENT: jax.device_put onto a device commits"
        u = ji.with_commitment(x, False)
        assert not u.committed and (u.aval, u.sharding) == (x.aval, x.sharding), "COMMITMENT: aval or sharding changed"
        assert u.unsafe_buffer_pointer() == x.unsafe_buffer_pointer(), "COMMITMENT: the buffer was copied"
        assert ji.with_commitment(x, True) is x and ji.with_commitment(u, True).committed
        np.testing.assert_array_equal(np.asarray(u), np.asarray(x))
    pinned = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    assert ji.with_commitment(pinned, False).sharding.memory_kind == "pinned_host"
    compiled = jax.jit(lambda q: q.astype(jnp.float32) * 2).lower(jax.ShapeDtypeStruct((8,), jnp.int4)).compile()
    got = compiled(ji.with_commitment(jax.device_put(values.astype(jnp.int4), device), False))
    np.testing.assert_array_equal(got, values * 2, err_msg="COMMITMENT: compiled code refuses an uncommitted int4 array")


def test_assumption_HOST_AVAL():
    """``host_aval`` traces as a host buffer that a donated, pinned argument fills: the program
    writes a value moved to host memory into it in place (aliased), and keeps its memory kind."""
    device = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")

    def write(x, buf):
        return x * 2, jax.lax.dynamic_update_slice(buf, jax.device_put(x, jax.memory.Space.Host), (0, 0))

    aval = ji.host_aval(jax.ShapeDtypeStruct((4, 3), jnp.float32))
    here = jax.sharding.SingleDeviceSharding(device, memory_kind=device.default_memory().kind)
    # every placement given: JAX pairs the donated buffer with the output of its memory kind
    # (else with the first output of its shape, by hash order: the device one aborts the call)
    placed = jax.jit(write, donate_argnums=1, in_shardings=(here, pinned), out_shardings=(here, pinned))
    traced = placed.trace(jnp.ones((4, 3)), aval)
    assert traced.jaxpr.in_avals[1].memory_space == jax.memory.Space.Host, (
        f"HOST_AVAL: a ShapedArray with memory_space=Host traced as {traced.jaxpr.in_avals[1]}"
    )
    compiled = traced.lower().compile()
    assert "input_output_alias" in compiled.as_text(), "HOST_AVAL: the donated host buffer is not aliased"
    buf = jax.device_put(np.zeros((4, 3), np.float32), pinned)
    x = jax.random.normal(jax.random.key(0), (4, 3))
    _, out = compiled(x, buf)
    assert buf.is_deleted() and out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
