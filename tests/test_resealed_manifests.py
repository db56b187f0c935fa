"""Resealed manifests: edits made by someone who can write the store and recompute a manifest's
self checksum (docs/format.md: it guards against damage, not against edits), so that only the
cross-checks stand.

A ``get`` checks a bundled residual's offset against the layout of its context's residuals and
its bytes against the CRC-32 its record keeps, in the one CRC-32 pass over the whole file that
lands it: no edit that ``verify`` reports gives a gradient, each is ``rs.CorruptContextError``
naming the context and the residual. A manifest listing 2^18 array records is refused before it
is decoded, in milliseconds and bounded memory. The CRC-32 arithmetic these checks stand on is
checked against zlib's.
"""

from __future__ import annotations

import os
import shutil
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
import residual_store_serializers as serializers
from residual_store_serializers.manifest import seal_manifest
from store_helpers import F32_TOL, assert_trees_close, read_manifest

LAYERS, WIDTH, BATCH = 4, 8, 3


def _loss(ws: list[jax.Array], x: jax.Array) -> jax.Array:
    """Residuals: the weights (shared), the input x and one (BATCH, WIDTH) tanh per layer (own:
    in the bundle, all of one shape)."""
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.sum(h**2)


def _inputs(key: jax.Array) -> tuple[list[jax.Array], jax.Array]:
    keys = jax.random.split(key, LAYERS + 1)
    ws = [jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH) for k in keys[:LAYERS]]
    return ws, jax.random.normal(keys[-1], (BATCH, WIDTH))


@pytest.fixture(scope="module")
def split() -> rs.Split:
    return rs.split(_loss, argnums=(0, 1))


@pytest.fixture
def stored(tmp_path: Path, split, rng) -> tuple[Path, dict[str, Any]]:
    """A store of contexts ``a`` and ``b`` (one signature, fresh random inputs), and the
    gradients ``jax.grad`` gives for each."""
    root = tmp_path / "store"
    inputs = dict(zip("ab", (_inputs(k) for k in jax.random.split(rng))))
    with rs.Store(root) as store:
        for key, args in inputs.items():
            store.put(split(*args)[1], key)
    want = {key: jax.grad(_loss, argnums=(0, 1))(*args) for key, args in inputs.items()}
    return root, want


def _manifest_path(root: Path, key: str) -> Path:
    return root / "contexts" / f"{key}.manifest"


def _reseal(root: Path, key: str, m: dict[str, Any]) -> None:
    """Writes ``m`` as ``key``'s manifest with a valid self checksum, under a new inode (so no
    parse of the old file can stand in)."""
    path = _manifest_path(root, key)
    tmp = path.with_name(f".{path.name}.test")
    tmp.write_bytes(seal_manifest(m))
    os.replace(tmp, path)


def _edited(m: dict[str, Any], i: int, **fields: Any) -> dict[str, Any]:
    arrays = [dict(r) for r in m["arrays"]]
    arrays[i].update(fields)
    return {**m, "arrays": arrays}


def _same_shape_pair(m: dict[str, Any]) -> tuple[int, int]:
    """Two bundled residuals of one shape and dtype (two of the tanh outputs)."""
    seen: dict[tuple[Any, ...], int] = {}
    for i, r in enumerate(m["arrays"]):
        if "offset" in r and r["nbytes"]:
            shape = (tuple(r["shape"]), r["dtype"])
            if shape in seen:
                return seen[shape], i
            seen[shape] = i
    raise AssertionError("no two bundled residuals of one shape")


def _first_bundled(m: dict[str, Any]) -> int:
    return min((r["offset"], i) for i, r in enumerate(m["arrays"]) if "offset" in r and r["nbytes"])[1]


def _gradients(root: Path, key: str) -> Any:
    with rs.Store(root, read_only=True, device_budget=0, host_budget=0) as store:
        return rs.backward(store.get(key))


def _refused(root: Path, key: str, residual: int | None, *words: str) -> str:
    """Asserts that ``get`` refuses ``key`` naming it and the residual (``None``: the whole
    bundle is at fault) and ``words``, and that ``verify`` reports it and no other context."""
    with rs.Store(root, read_only=True, device_budget=0, host_budget=0) as store:
        with pytest.raises(rs.CorruptContextError) as info:
            store.get(key)
        report = store.verify()
    message = str(info.value)
    named = (f"residual {residual} ",) if residual is not None else ()
    for word in (f"context {key!r}", *named, *words):
        assert word in message, (word, message)
    assert key in report.damaged and len(report.damaged) == 1, report
    return message


def test_intact_contexts_give_jax_grads_gradients(stored):
    root, want = stored
    for key in "ab":
        assert_trees_close(_gradients(root, key), want[key], **F32_TOL)


@pytest.mark.parametrize("checksums_too", [False, True], ids=["offsets", "offsets_and_checksums"])
def test_swapped_offsets_of_two_same_shape_residuals_are_refused(stored, checksums_too):
    """Each record then points at the other's bytes (with its checksum too: every checksum
    matches the bytes it points at, only the layout says they are swapped)."""
    root, want = stored
    m = read_manifest(root, "a")
    i, j = _same_shape_pair(m)
    ri, rj = m["arrays"][i], m["arrays"][j]
    swapped = _edited(_edited(m, i, offset=rj["offset"]), j, offset=ri["offset"])
    if checksums_too:
        swapped = _edited(_edited(swapped, i, checksum=rj["checksum"]), j, checksum=ri["checksum"])
    _reseal(root, "a", swapped)
    _refused(root, "a", i, "offsets are not where this layout puts them")
    assert_trees_close(_gradients(root, "b"), want["b"], **F32_TOL)


@pytest.mark.parametrize("where", ["next_header", "zip_headers"])
def test_an_offset_moved_into_headers_is_refused(stored, where):
    """One offset +64 (into the next entry's local header), or the first one 64 (the metadata
    entries at the start of the zip): still aligned, inside the file, over no other array."""
    root, want = stored
    m = read_manifest(root, "a")
    if where == "next_header":
        i = max((r["offset"], i) for i, r in enumerate(m["arrays"]) if "offset" in r and r["nbytes"])[1]
        offset = m["arrays"][i]["offset"] + 64
    else:
        i, offset = _first_bundled(m), 64
    _reseal(root, "a", _edited(m, i, offset=offset))
    _refused(root, "a", i, f"at byte {offset:,}", "offsets are not where this layout puts them")
    assert_trees_close(_gradients(root, "b"), want["b"], **F32_TOL)


def _copy_bundle_in(root: Path, into: str, source: str) -> dict[str, Any]:
    """``source``'s bundle copied over ``into``'s, and ``into``'s manifest resealed with the
    copied file's whole-file checksum (its residuals' checksums left as they were)."""
    m, other = read_manifest(root, into), read_manifest(root, source)
    shutil.copyfile(root / other["bundle"]["path"], root / m["bundle"]["path"])
    _reseal(root, into, {**m, "bundle": {**m["bundle"], "checksum": other["bundle"]["checksum"]}})
    return m


def test_another_contexts_bundle_copied_in_is_refused_naming_the_residual(stored):
    root, want = stored
    m = _copy_bundle_in(root, "a", "b")
    i = _first_bundled(m)
    _refused(root, "a", i, m["arrays"][i]["name"], "checksum mismatch")
    assert_trees_close(_gradients(root, "b"), want["b"], **F32_TOL)


def test_a_kvstore_get_refuses_a_copied_bundle_too(tmp_path, split, rng):
    """The same check where the bundle is one object read whole (a tensorstore kvstore)."""
    spec = {"driver": "file", "path": str(tmp_path / "kv"), "file_io_sync": False}
    inputs = dict(zip("ab", (_inputs(k) for k in jax.random.split(rng))))
    with rs.Store(spec) as store:
        for key, args in inputs.items():
            store.put(split(*args)[1], key)
    root = tmp_path / "kv"
    m = _copy_bundle_in(root, "a", "b")
    with rs.Store(spec, read_only=True, device_budget=0, host_budget=0) as store:
        assert_trees_close(rs.backward(store.get("b")), jax.grad(_loss, argnums=(0, 1))(*inputs["b"]), **F32_TOL)
        with pytest.raises(rs.CorruptContextError, match=f"residual {_first_bundled(m)} .*checksum mismatch"):
            store.get("a")


def test_a_bundle_size_other_than_its_layouts_is_refused_before_it_is_read(stored):
    """A longer file and a manifest resealed to say so (its size and whole-file checksum): the
    layout fixes the size."""
    root, _ = stored
    m = read_manifest(root, "a")
    bundle = root / m["bundle"]["path"]
    data = bundle.read_bytes() + bytes(64)
    bundle.write_bytes(data)
    _reseal(root, "a", {**m, "bundle": {**m["bundle"], "nbytes": len(data), "checksum": serializers.checksum(data)}})
    with rs.Store(root, read_only=True) as store, pytest.raises(rs.CorruptContextError, match="the layout of its residuals"):
        store.get("a")


def test_renamed_residuals_disagree_with_their_bundle(stored):
    """The bundle's headers hold each residual's name (what plain zarr shows): a spec renamed in
    a resealed manifest no longer describes the file, for get as for verify."""
    root, _ = stored
    m = read_manifest(root, "a")
    names = [f"renamed {n}" for n in m["spec"]["names"]]
    _reseal(root, "a", {**m, "spec": {**m["spec"], "names": names}})
    _refused(root, "a", None, "the layout of its residuals")


def test_a_bundled_residual_whose_checksum_is_not_its_crc32_is_refused(stored):
    root, _ = stored
    m = read_manifest(root, "a")
    i = _first_bundled(m)
    for bad in ("xxh3_64:0123456789abcdef", "crc32:0123456z"):
        _reseal(root, "a", _edited(m, i, checksum=bad))
        with rs.Store(root, read_only=True) as store, pytest.raises(rs.CorruptContextError, match=f"array {i}.*CRC-32"):
            store.get("a")


# ----------------------------------------------------------------------------------------------
# 2^18 array records


def _refused_fast(root: Path, key: str, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``get`` refuses ``key`` without decoding its manifest (the file itself is tens of MB: it
    is read, its lists counted, never decoded), tracing under 64 MB. (Counted, not timed: a
    timed bound fails on a machine busy with other work.)"""
    size = _manifest_path(root, key).stat().st_size
    decoded: list[int] = []
    real = serializers.decode_manifest

    def decode_manifest(data: Any, **kwargs: Any) -> Any:
        decoded.append(len(data))
        return real(data, **kwargs)

    monkeypatch.setattr(serializers, "decode_manifest", decode_manifest)
    tracemalloc.start()
    try:
        with rs.Store(root, read_only=True) as store, pytest.raises(rs.CorruptContextError, match=match):
            store.get(key)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size not in decoded, f"the manifest of {size} bytes was decoded"
    assert peak < size + (64 << 20), f"{peak >> 20} MB traced for a manifest of {size >> 20} MB"


def test_a_manifest_of_2_18_array_records_is_refused_before_it_is_decoded(stored, monkeypatch):
    """The records copied to 2^18 (listed first, before the spec they disagree with)."""
    root, _ = stored
    m = read_manifest(root, "a")
    _reseal(root, "a", {"arrays": [m["arrays"][-1]] * (1 << 18), **{k: v for k, v in m.items() if k != "arrays"}})
    _refused_fast(root, "a", f"262,144 array records for the {len(m['arrays'])} residuals of its spec", monkeypatch)


def test_2_18_residuals_of_a_signature_this_process_wrote_are_refused_before_decoding(stored, monkeypatch):
    """Records and spec lists agree on 2^18 residuals, each at its own folder: the signature is
    one this process wrote contexts of, with far fewer residuals."""
    root, _ = stored
    m = read_manifest(root, "a")
    n, j = 1 << 18, len(m["arrays"]) - 1
    own = {k: v for k, v in m["arrays"][j].items() if k != "offset"}
    arrays = [{**own, "path": f"{m['data_dir']}/{i}"} for i in range(n)]
    spec = {**m["spec"], **{f: [m["spec"][f][j]] * n for f in ("avals", "names", "input_paths", "kinds", "key_impls")}}
    _reseal(root, "a", {**{k: v for k, v in m.items() if k != "bundle"}, "spec": spec, "arrays": arrays})
    del arrays, spec
    _refused_fast(root, "a", f"262,144 array records, where contexts of its signature .* have {j + 1} residuals", monkeypatch)


def test_the_outline_counts_lists_without_decoding_and_never_raises():
    import msgpack

    from residual_store_serializers.manifest import manifest_outline

    data = msgpack.packb({"spec": {"names": ["x"], "avals": [[[2], "f4"]] * 3}, "signature": "rs2-x", "arrays": [{}] * 5})
    assert manifest_outline(data, lists=[("arrays",), ("spec", "avals")], values=[("signature",)]) == {
        ("arrays",): 5, ("spec", "avals"): 3, ("signature",): "rs2-x"}
    for bad in (b"", b"\xc1", data[:20], msgpack.packb([1, 2]), msgpack.packb({"arrays": 3})):
        assert manifest_outline(bad, lists=[("arrays",)]) == {}


# ----------------------------------------------------------------------------------------------
# The CRC-32 arithmetic


def test_crc32_of_zeros_and_extensions_are_zlibs():
    from residual_store_serializers.checksums import crc32_extend, crc32_extended_sum, crc32_extension_map, crc32_zeros

    rnd = np.random.default_rng(0)
    for n in (0, 1, 4, 63, 4096, 3_000_001):
        assert int(crc32_zeros(n)) == zlib.crc32(bytes(n)), n
    raw = lambda b: zlib.crc32(b) ^ zlib.crc32(bytes(len(b)))  # noqa: E731 - linear in b
    for _ in range(20):
        a, b = (rnd.bytes(int(rnd.integers(0, 200))) for _ in range(2))
        assert raw(a + b) == int(crc32_extend(raw(a), len(b))) ^ raw(b)
    distances = rnd.integers(0, 1 << 31, (30, 3))
    values = rnd.integers(0, 1 << 32, 30, dtype=np.uint64).astype(np.uint32)
    want = 0
    for v, row in zip(values, distances):
        for d in row:
            want ^= int(crc32_extend(v, d))
    assert crc32_extended_sum(crc32_extension_map(distances), values) == want


def test_a_bundles_crc32_follows_from_its_arrays_crc32s():
    """For bundles of random layouts (empty arrays, several dtypes, 0 to 12 arrays): the CRC-32
    bundle_crc works out from the arrays' CRC-32s is zlib's of the written file, and one flipped
    bit anywhere changes the file's."""
    from residual_store_serializers.bundle import bundle_crc, bundle_layout, bundle_parts

    rnd = np.random.default_rng(1)
    for trial in range(25):
        arrays, data = [], []
        for i in range(int(rnd.integers(0, 13))):
            shape = tuple(int(d) for d in rnd.integers(0, 6, int(rnd.integers(0, 3))))
            dtype = str(rnd.choice(["float32", "int8", "bool", "float16", "int64"]))
            arrays.append((f"a{i}", shape, dtype))
            data.append((rnd.normal(size=shape) * 10).astype(dtype))
        layout = bundle_layout(arrays, [{"i": i} for i in range(len(arrays))], {"trial": trial})
        parts, crcs = bundle_parts(layout, data)
        file = bytearray(b"".join(bytes(p) for p in parts))
        expected = bundle_crc(layout, crcs)
        assert zlib.crc32(file) == expected, trial
        at = int(rnd.integers(0, len(file)))
        file[at] ^= 1 << int(rnd.integers(0, 8))
        assert zlib.crc32(file) != expected
