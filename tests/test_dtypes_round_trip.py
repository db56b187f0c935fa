"""Every dtype JAX makes comes back from every tier of a store exactly, or is refused at ``put``.

The tiers: the device tier, JAX's host memory (``device_budget=0``), the disk read back by this
process (``host_budget=0`` too; also placed with ``Store(device=...)``), and a fresh process that
reads the disk without the model (the stored backward). Each dtype is the residual of a
``custom_vjp`` whose backward scales by it, so a wrong byte is a wrong gradient: the residual
bytes are compared exactly, the gradients with ``jax.grad``'s.

The dtypes are enumerated from ``jax.numpy`` (what the installed JAX offers), so a JAX that adds
one fails :func:`test_the_dtypes_here_are_every_dtype_jax_numpy_offers` until it is placed here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
import residual_store_serializers as serializers
import residual_store_serializers.zarr
from platforms import cannot_compute, skip_what_cannot_compute
from store_helpers import assert_contexts_identical, raw, run_python, write_script

# XLA has no such type: JAX can neither place nor compute one, so no residual is one.
NOT_MADE = ("float6_e2m3fn", "float6_e3m2fn")
# XLA converts nothing to it: a residual of it is an input placed from the host as it is.
INPUT_ONLY = ("uint1",)
X64 = ("int64", "uint64", "float64", "complex128")
KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def _jax_numpy_dtypes() -> set[str]:
    """The name of every array dtype ``jax.numpy`` offers (its scalar types)."""
    names = set()
    for attr in dir(jnp):
        t = getattr(jnp, attr)
        if not isinstance(t, type) and type(t).__name__ != "_ScalarMeta":
            continue
        try:
            d = np.dtype(t)
        except TypeError:
            continue
        if d.kind in "biufcV" and d.itemsize:
            names.add(d.name)
    return names


DTYPES = sorted(_jax_numpy_dtypes() - set(NOT_MADE))
CASES = DTYPES + [f"key<{impl}>" for impl in KEY_IMPLS]


def test_the_dtypes_here_are_every_dtype_jax_numpy_offers() -> None:
    expected = {
        "bool", "int1", "int2", "int4", "int8", "int16", "int32", "int64",
        "uint1", "uint2", "uint4", "uint8", "uint16", "uint32", "uint64",
        "bfloat16", "float16", "float32", "float64", "complex64", "complex128",
        "float4_e2m1fn", "float8_e3m4", "float8_e4m3", "float8_e4m3fn", "float8_e4m3fnuz",
        "float8_e4m3b11fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    }  # fmt: skip
    assert set(DTYPES) == expected, "a dtype JAX now offers: test it below and add it to docs/format.md"
    for name in NOT_MADE:  # a JAX that makes one needs it stored (docs/format.md) or refused at put
        with pytest.raises(Exception):
            jax.block_until_ready(jax.device_put(np.zeros(2, jnp.dtype(name))))
    for name in INPUT_ONLY:
        with pytest.raises(Exception):
            jax.jit(lambda x: x.astype(jnp.dtype(name)))(jnp.ones(2))


def test_every_dtype_a_residual_can_have_is_a_documented_zarr_data_type() -> None:
    table = Path(__file__).resolve().parents[1].joinpath("docs", "format.md").read_text()
    for name in DTYPES:
        assert serializers.zarr_dtype_name(jnp.dtype(name)) == name
        assert f"`{name}`" in table, f"docs/format.md does not list {name}"
    for name in serializers.zarr.EXTENSION_DTYPES:
        assert f"`{name}`" in table


# ----------------------------------------------------------------------------------------------
# One model per dtype: a residual of that dtype that the backward scales by


@contextlib.contextmanager
def _x64(on: bool) -> Iterator[None]:
    """x64 on or off for this process (globally: a store's writer thread traces too)."""
    before = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", on)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


def _cast(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """``x`` as ``dtype``: a value of every sign the dtype holds, computed on the device."""
    if dtype == jnp.bool_:
        return x > 0
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return (x + 1j * x[::-1]).astype(dtype)
    if jnp.issubdtype(dtype, jnp.unsignedinteger) or dtype == jnp.float8_e8m0fnu:
        x = jnp.abs(x)  # (e8m0fnu: powers of two only)
    return (x * 1.5).astype(dtype)


def _scale(r: jax.Array) -> jax.Array:
    return jnp.real(r).astype(jnp.float32) if jnp.issubdtype(r.dtype, jnp.complexfloating) else r.astype(jnp.float32)


@functools.cache
def _model(case: str) -> Callable[[jax.Array, Any], jax.Array]:
    """``f(x, q)``: a ``custom_vjp`` keeps a residual of ``case`` (``x`` cast to it, or the
    input ``q`` where XLA casts nothing to it, or the key ``q``) and its backward scales the
    gradient by it. One per case, shared by the tests (their inputs are fresh each time)."""
    key = case.startswith("key<")
    dtype = None if key else jnp.dtype(case)

    @jax.custom_vjp
    def scaled(x: jax.Array, q: Any) -> jax.Array:
        return jnp.sin(x)

    def fwd(x: jax.Array, q: Any) -> tuple[jax.Array, Any]:
        kept = q if key or case in INPUT_ONLY else _cast(x, dtype)
        return jnp.sin(x), (jnp.cos(x), kept)

    def bwd(res: Any, g: jax.Array) -> tuple[jax.Array, None]:
        cos, kept = res
        if key:
            by = jax.random.uniform(kept, g.shape)
        elif case in INPUT_ONLY:
            by = jnp.float32(1)  # (nothing computes with it)
        else:
            by = _scale(kept)
        return g * cos * by, None

    scaled.defvjp(fwd, bwd)
    return lambda x, q: jnp.sum(scaled(x, q) ** 2)


@functools.cache
def _split(case: str) -> Any:
    """``rs.split`` of :func:`_model`, one per case: the tiers' tests of a case share its compiles."""
    return rs.split(_model(case), argnums=0)


@functools.cache
def _grad(case: str) -> Callable[[jax.Array, Any], jax.Array]:
    """``jax.grad`` of :func:`_model` (jitted once per case): what every tier must give back."""
    return jax.jit(jax.grad(_model(case)))


def _inputs(case: str, seed: int) -> tuple[jax.Array, Any]:
    x = jax.random.normal(jax.random.key(seed), (8,), jnp.float32)
    if case.startswith("key<"):
        return x, jax.random.key(seed, impl=case[4:-1])
    host = np.random.default_rng(seed).integers(0, 2, 8)
    return x, jax.device_put(host.astype(jnp.dtype(case)))


def _kept(ctx: rs.ResidualContext, case: str) -> list[int]:
    """The residuals of ``ctx`` of ``case``'s dtype."""
    if case.startswith("key<"):
        return [i for i, r in enumerate(ctx.residuals) if jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key)]
    return [i for i, r in enumerate(ctx.residuals) if r.dtype == jnp.dtype(case)]


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little") >> 1


# ----------------------------------------------------------------------------------------------
# This process: the device tier, host memory, the disk


def _device_tier(ctx: rs.ResidualContext, path: Path) -> rs.ResidualContext:
    with rs.Store() as store:
        store.put(ctx, "k")
        return store.get("k")


def _host_tier(ctx: rs.ResidualContext, path: Path) -> rs.ResidualContext:
    with rs.Store(device_budget=0) as store:
        store.put(ctx, "k")
        assert store.stats()["host"]["contexts"] == 1
        return store.get("k")


def _disk(ctx: rs.ResidualContext, path: Path, **options: Any) -> rs.ResidualContext:
    with rs.Store(path, device_budget=0, host_budget=0, **options) as store:
        store.put(ctx, "k")
        store.flush()
        assert store.stats()["device"]["contexts"] == store.stats()["host"]["contexts"] == 0
        return store.get("k")


TIERS: dict[str, Callable[[rs.ResidualContext, Path], rs.ResidualContext]] = {
    "device": _device_tier,
    "host": _host_tier,
    "disk": _disk,
    "disk-on-a-device": lambda ctx, path: _disk(ctx, path, device=jax.devices()[0]),
}


# The fast tier takes every dtype through the device tier, and through host memory and the disk
# the ones whose storage is special (sub-byte, zarr extension names, typed keys) and one of each
# kind; the slow tier takes every dtype through every tier.
_SPECIAL = {"int1", "int2", "int4", "uint1", "uint2", "uint4", "float4_e2m1fn", "float8_e4m3", "bool",
                 "bfloat16", "float32", "int8", "complex64", "key<threefry2x32>"}


def _fast(tier: str, case: str) -> bool:
    return tier == "device" or (tier in ("host", "disk") and case in _SPECIAL)


@pytest.mark.parametrize(
    "tier, case",
    [pytest.param(t, c, marks=() if _fast(t, c) else pytest.mark.slow) for t in TIERS for c in CASES],
)
def test_every_dtype_comes_back_exact_from_every_tier(tmp_path: Path, tier: str, case: str) -> None:
    skip_what_cannot_compute(case)
    seed = _seed()
    with _x64(case in X64):
        x, q = _inputs(case, seed)
        out, ctx = _split(case)(x, q)
        assert _kept(ctx, case), f"no residual is {case}: {[r.dtype for r in ctx.residuals]}"
        want = _grad(case)(x, q)
        got = TIERS[tier](ctx, tmp_path / "store")
        assert_contexts_identical(got, ctx)
        grads = rs.backward(got)
    np.testing.assert_allclose(grads, want, rtol=1e-6, err_msg=f"{case} after the {tier} tier (seed {seed})")


@pytest.mark.parametrize("case", ["int4", "uint2", "float4_e2m1fn", "int1"])
def test_a_sub_byte_residual_of_committed_inputs_comes_back_as_one_the_backward_takes(tmp_path: Path, case: str) -> None:
    """Inputs committed to a device make committed residuals, and compiled code on CPU refuses a
    committed sub-byte array (see ``COMMITMENT``): host memory and the disk give it back
    uncommitted, on the same device (the others as before: committed after host memory)."""
    skip_what_cannot_compute(case, committed=True)
    x, q = _inputs(case, _seed())
    device = jax.devices()[0]
    x = jax.device_put(x, device)
    # a split of its own: what a split first called with committed inputs keeps (the shared one
    # was called with uncommitted ones by the tests above)
    _, ctx = rs.split(_model(case), argnums=0)(x, q)
    (i,) = _kept(ctx, case)
    assert ctx.residuals[i].committed
    want = _grad(case)(x, q)
    for tier in ("host", "disk", "disk-on-a-device"):
        got = TIERS[tier](ctx, tmp_path / tier)
        assert_contexts_identical(got, ctx)
        assert not got.residuals[i].committed and got.residuals[i].devices() == {device}
        if tier == "host":
            assert all(g.committed for j, g in enumerate(got.residuals) if j != i)
        np.testing.assert_allclose(rs.backward(got), want, rtol=1e-6, err_msg=f"{case}, {tier}")


def test_a_put_of_a_dtype_no_store_writes_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """``float0`` (the tangent type of integers) has no bytes: a store with a path refuses it at
    put, naming the residual and the dtype, and holds what it held; a store without one keeps
    it in memory."""

    @jax.custom_vjp
    def scaled(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    scaled.defvjp(
        lambda x: (jnp.sin(x), (jnp.cos(x), np.zeros(x.shape, jax.dtypes.float0))),
        lambda res, g: (g * res[0],),
    )

    def f(x: jax.Array) -> jax.Array:
        return jnp.sum(scaled(x))

    x = jax.random.normal(jax.random.key(_seed()), (4,))
    _, bad = rs.split(f)(x)
    _, good = _split("int4")(*_inputs("int4", 1))
    for options in ({}, {"write_through": False, "device_budget": 0, "host_budget": 0}):
        path = tmp_path / str(len(options))
        with rs.Store(path, **options) as store:
            store.put(good, "good")
            with pytest.raises(rs.InvalidArgumentError, match=r"residual 1 \(.*\) is float0"):
                store.put(bad, "bad")
            with pytest.raises(rs.InvalidArgumentError, match="float0"):
                store.put(bad, "good")  # a key already held keeps its context
            store.flush()
            assert store.keys() == ["good"]
            assert_contexts_identical(store.get("good"), good)
        with rs.Store(path, read_only=True) as store:
            assert store.keys() == ["good"] and store.verify().ok
    with rs.Store(device_budget=0) as store:  # memory only: device and host tiers hold it
        store.put(bad, "bad")
        np.testing.assert_allclose(rs.backward(store.get("bad")), jax.grad(f)(x), rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# A fresh process, without the model, reading the disk


_READER = """
import json, sys
import numpy as np
import jax
import residual_store as rs

path, out, tests = sys.argv[1:]
sys.path.insert(0, tests)
import test_dtypes_round_trip as t  # the model, for the backward of a split defined here

results = {}
with rs.Store(path, read_only=True) as store:
    for case in t.CASES:
        if t.cannot_compute(case) is not None:
            continue
        jax.config.update("jax_enable_x64", case in t.X64)
        ctx = store.get(t._key(case))
        residuals = []
        for r in ctx.residuals:
            is_key = jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key)
            data = np.asarray(jax.random.key_data(r) if is_key else r)
            residuals.append({"dtype": str(r.dtype), "bytes": data.tobytes().hex(),
                              "impl": str(jax.random.key_impl(r)) if is_key else None})
        try:
            stored = np.asarray(rs.backward(ctx)).tolist()
        except rs.BackwardUnavailableError as err:
            stored = type(err).__name__
        split = np.asarray(rs.split(t._model(case), argnums=0).backward(ctx)).tolist()
        results[case] = {"residuals": residuals, "stored": stored, "split": split}
with open(out, "w") as f:
    json.dump(results, f)
"""

# jax.export (0.10) serializes no backward with these: a process without the model is told so
# (rs.BackwardUnavailableError, as for any backward that could not be exported).
NOT_EXPORTED = ("int1", "int2", "uint1", "uint2")


@pytest.fixture(scope="module")
def read_by_another_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case put in one store (each with its own x64 setting), then read by a fresh process
    that runs each backward without the model (the stored one) and with it (a split defined
    there): ``case -> (original context, jax.grad, what it read)``."""
    root = tmp_path_factory.mktemp("dtypes")
    made = {}
    with rs.Store(root / "store") as store:
        for case in CASES:
            if cannot_compute(case) is not None:
                continue
            with _x64(case in X64):
                x, q = _inputs(case, _seed())
                _, ctx = _split(case)(x, q)
                made[case] = (ctx, np.asarray(_grad(case)(x, q)))
                store.put(ctx, _key(case))
                store.flush()
    script = write_script(root, "reader.py", _READER)
    run_python(script, str(root / "store"), str(root / "read.json"), str(Path(__file__).parent), timeout=600)
    read = json.loads((root / "read.json").read_text())
    return {case: (*made[case], read.get(case)) for case in made}


def _key(case: str) -> str:
    return case.replace("<", ".").replace(">", "")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_every_dtype_comes_back_exact_in_a_fresh_process(read_by_another_process: dict[str, Any], case: str) -> None:
    skip_what_cannot_compute(case)
    ctx, want, read = read_by_another_process[case]
    assert read is not None, f"{case}: the other process found no context"
    assert len(read["residuals"]) == len(ctx.residuals)
    for i, (r, got) in enumerate(zip(ctx.residuals, read["residuals"])):
        assert got["dtype"] == str(r.dtype), (case, i)
        assert bytes.fromhex(got["bytes"]) == raw(r).tobytes(), f"{case}: residual {i} differs"
        if got["impl"] is not None:
            assert got["impl"] == str(jax.random.key_impl(r))
    np.testing.assert_allclose(np.asarray(read["split"], np.float32), want, rtol=1e-6, err_msg=case)
    if case in NOT_EXPORTED:
        assert read["stored"] == "BackwardUnavailableError", f"{case}: jax.export takes it now"
    else:
        np.testing.assert_allclose(np.asarray(read["stored"], np.float32), want, rtol=1e-6, err_msg=case)
