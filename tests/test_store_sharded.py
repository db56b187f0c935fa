"""Sharded residuals: written shard by shard (one zarr chunk per shard), loaded back with their
sharding where the devices exist, whole where they do not.

The test process has one CPU device, so the multi-device parts run in subprocesses with
``--xla_force_host_platform_device_count=4``: a writer (which also checks the round trip in its
own process), a 4-device reader that never imports the model, and a plain 1-device reader.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import residual_store as rs
import residual_store_serializers as serializers
from residual_store_serializers.manifest import seal_manifest
from store_helpers import python_env, raw, read_manifest, write_script

SUBPROCESS_TIMEOUT = 120

# ----------------------------------------------------------------------------------------------
# Scripts

_PRELUDE = """
import json, os, sys
if sys.argv[1] == "4":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import residual_store as rs

root, out = sys.argv[2], sys.argv[3]
KEYS = ("k", "k2", "ke")


def describe(x):
    s = x.sharding
    if not isinstance(s, NamedSharding):
        return type(s).__name__
    spec = [list(e) if isinstance(e, tuple) else e for e in s.spec]
    return {"axes": list(s.mesh.axis_names), "sizes": list(s.mesh.devices.shape),
            "types": [t.name for t in s.mesh.axis_types], "spec": spec,
            "ids": [d.id for d in s.mesh.devices.flat]}


def raw(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)
"""

_MODEL = """
assert jax.device_count() == 4
auto = (AxisType.Auto,)
mesh = jax.make_mesh((4,), ("data",), axis_types=auto)
mesh2 = jax.make_mesh((2, 2), ("data", "model"), axis_types=auto * 2)
mesh_e = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))


def dropout(h, keys):
    mask = jax.vmap(lambda k: jax.random.bernoulli(k, 0.8, h.shape[1:]))(keys)
    return jnp.where(mask, h, 0.0)


def loss(params, x, y, keys):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    h = jax.checkpoint(dropout, policy=jax.checkpoint_policies.nothing_saveable)(h, keys)
    return jnp.mean((h @ params["w2"] - y) ** 2)
"""

WRITER = _PRELUDE + _MODEL + """

def inputs(m, w2_spec, seed):
    k = jax.random.split(jax.random.key(seed), 6)
    put = lambda a, *spec: jax.device_put(a, NamedSharding(m, P(*spec)))
    params = {
        "w1": put(jax.random.normal(k[0], (8, 16)), None, None),
        "b1": put(jax.random.normal(k[1], (16,)) * 0.1),
        "w2": put(jax.random.normal(k[2], (16, 4)), *w2_spec),
    }
    return (params, put(jax.random.normal(k[3], (32, 8)), "data"),
            put(jax.random.normal(k[4], (32, 4)), "data", None),
            put(jax.random.split(k[5], 32), "data"))


fwd = rs.split(loss)
cases = {  # key -> (mesh, inputs)
    "k": (mesh, inputs(mesh, ("data", None), 0)),
    "k2": (mesh2, inputs(mesh2, ("model", None), 1)),
    "ke": (mesh_e, inputs(mesh_e, ("data", None), 2)),
}
contexts, grads = {}, {}
for key, (m, args) in cases.items():
    with jax.set_mesh(m):
        contexts[key] = fwd(*args)[1]
        grads[key] = jax.grad(loss)(*args)

# Writing never gathers a sharded array into one host buffer: watch every conversion to NumPy.
ArrayImpl = type(contexts["k"].residuals[0])
gathered, to_numpy = [], ArrayImpl.__array__


def watched(self, *args, **kwargs):
    if len(self.sharding.device_set) > 1 and not self.sharding.is_fully_replicated:
        gathered.append(self.shape)
    return to_numpy(self, *args, **kwargs)


ArrayImpl.__array__ = watched
result = {"keys": {}}
with rs.Store(root) as store:
    for key in KEYS:
        store.put(contexts[key], key)
    store.flush()
assert not gathered, gathered
np.asarray(next(x for x in contexts["k"].residuals if not x.sharding.is_fully_replicated))
assert gathered  # (the watch sees a gather)
ArrayImpl.__array__ = to_numpy
with rs.Store(root) as store:  # a new store: everything comes from disk
    for key in KEYS:
        want, got = contexts[key], store.get(key)
        for i, (a, b) in enumerate(zip(got.residuals, want.residuals)):
            assert a.sharding == b.sharding, (key, i, a.sharding, b.sharding)
            assert raw(a).tobytes() == raw(b).tobytes(), (key, i)
            assert [s.data.shape for s in a.addressable_shards] == [s.data.shape for s in b.addressable_shards]
        with jax.set_mesh(cases[key][0]):
            g = rs.backward(got)
        for p in grads[key]:
            np.testing.assert_allclose(np.asarray(g[p]), np.asarray(grads[key][p]), rtol=1e-5, atol=1e-6)
        result["keys"][key] = {
            "names": list(want.spec.names),
            "kinds": list(want.spec.kinds),
            "shardings": [describe(x) for x in want.residuals],
        }

# a tensorstore kvstore (the chunk-by-chunk tensorstore path)
mem = {"driver": "memory", "path": "sharded/"}
with rs.Store(mem) as store:
    store.put(contexts["k2"], "m")
with rs.Store(mem) as store:
    got = store.get("m")
    assert [a.sharding for a in got.residuals] == [b.sharding for b in contexts["k2"].residuals]
    assert all(raw(a).tobytes() == raw(b).tobytes() for a, b in zip(got.residuals, contexts["k2"].residuals))

# written from the host tier (pinned host memory, still sharded) when the budget pushes it out
size = sum(raw(x).nbytes for x, k in zip(contexts["k"].residuals, contexts["k"].spec.kinds) if k == "intermediate")
offload = os.path.join(out, "offload")
with rs.Store(offload, device_budget=0, host_budget=size, write_through=False) as store:
    store.put(contexts["k"], "a")
    held = store.get("a")  # from host memory, back to the devices with its sharding
    assert [x.sharding for x in held.residuals] == [x.sharding for x in contexts["k"].residuals]
    store.put(contexts["k"], "b")  # pushes "a" out of host memory: written from there
    store.flush()
with rs.Store(offload) as store:
    assert "a" in store.keys()
    got = store.get("a")
    assert [x.sharding for x in got.residuals] == [x.sharding for x in contexts["k"].residuals]

# a replaced context's data folder is recycled: chunks overwritten in place, exactly
with rs.Store(root) as store:
    for seed in (10, 11):
        store.put(fwd(*inputs(mesh, ("data", None), seed))[1], "again")
        store.flush()
    store._persistence.janitor.submit(lambda: None).result()  # recycling runs off the write path
    free = os.path.join(root, "data", ".free")
    (recycled,) = os.listdir(free)
    inode = os.stat(os.path.join(free, recycled)).st_ino
    last = fwd(*inputs(mesh, ("data", None), 12))[1]
    store.put(last, "other")  # same layout: takes the recycled folder
    store.flush()
    (reused,) = [d for d in os.listdir(os.path.join(root, "data")) if d.startswith("other.")]
    assert os.stat(os.path.join(root, "data", reused)).st_ino == inode
with rs.Store(root) as store:
    got = store.get("other")
    assert all(raw(a).tobytes() == raw(b).tobytes() for a, b in zip(got.residuals, last.residuals))
    assert [a.sharding for a in got.residuals] == [b.sharding for b in last.residuals]

np.savez(os.path.join(out, "expected.npz"), **{
    **{f"{k}/r{i}": raw(x) for k in KEYS for i, x in enumerate(contexts[k].residuals)},
    **{f"{k}/g/{p}": np.asarray(v) for k in KEYS for p, v in grads[k].items()},
})
print(json.dumps(result))
"""

READER = _PRELUDE + """
exp = np.load(os.path.join(out, "expected.npz"))
summary = json.loads(open(os.path.join(out, "summary.json")).read())
result = {"devices": jax.device_count(), "keys": {}}
with rs.Store(root) as store:
    for key in KEYS:
        ctx = store.get(key)
        got = {"shardings": [describe(x) for x in ctx.residuals]}
        for i, x in enumerate(ctx.residuals):
            assert raw(x).tobytes() == exp[f"{key}/r{i}"].tobytes(), (key, i)
        try:
            g = rs.backward(ctx)
            for p, v in g.items():
                np.testing.assert_allclose(np.asarray(v), exp[f"{key}/g/{p}"], rtol=1e-5, atol=1e-6)
            got["backward"] = "ok"
        except rs.BackwardUnavailableError as err:
            got["backward"] = f"unavailable: {err}"
        result["keys"][key] = got
if len(sys.argv) > 4:  # a flipped bit in one chunk, read shard by shard
    with rs.Store(sys.argv[4]) as store:
        try:
            store.get("k")
            result["corrupt"] = None
        except rs.CorruptContextError as err:
            result["corrupt"] = str(err)
print(json.dumps(result))
"""


SPLIT_READER = _PRELUDE + _MODEL + """
# A process with the model that never ran its forward: fresh splits rebuild each backward from
# the context's record (the mesh the forward ran under is re-entered), and only it is compiled.
exp = np.load(os.path.join(out, "expected.npz"))
result = {}
with rs.Store(root, read_only=True) as store:
    for key in KEYS:
        fwd = rs.split(loss)
        g = fwd.backward(store.get(key))
        for p, v in g.items():
            np.testing.assert_allclose(np.asarray(v), exp[f"{key}/g/{p}"], rtol=1e-5, atol=1e-6)
        result[key] = fwd.cache_info()._asdict()
print(json.dumps(result))
"""


def _run(script: str, devices: int, *args: str) -> dict[str, Any]:
    env = python_env()
    env.pop("XLA_FLAGS", None)  # the 4-device scripts set it themselves, before importing JAX
    proc = subprocess.run(
        [sys.executable, script, str(devices), *args],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A store written by a 4-device process: contexts "k" (mesh data=4), "k2" (mesh 2x2,
    partly replicated shardings) and "ke" (explicit axis types)."""
    base = tmp_path_factory.mktemp("sharded")
    out = base / "out"
    out.mkdir()
    script = write_script(base, "writer.py", WRITER)
    summary = _run(script, 4, str(base / "store"), str(out))
    (out / "summary.json").write_text(json.dumps(summary))
    return {
        "root": base / "store",
        "out": out,
        "summary": summary,
        "expected": dict(np.load(out / "expected.npz")),
        "reader": write_script(base, "reader.py", READER),
        "split_reader": write_script(base, "split_reader.py", SPLIT_READER),
    }


def _sharded(summary: dict[str, Any], key: str) -> list[int]:
    """Residuals of ``key`` whose sharding splits the array (not fully replicated)."""
    return [
        i
        for i, s in enumerate(summary["keys"][key]["shardings"])
        if isinstance(s, dict) and any(e is not None for e in s["spec"])
    ]


def _trim(spec: list[Any]) -> list[Any]:
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def _flip_bit_in_a_chunk(written: dict[str, Any], dest: Path) -> tuple[int, str]:
    shutil.copytree(written["root"], dest)
    manifest = read_manifest(dest, "k")
    i = next(i for i in _sharded(written["summary"], "k") if not manifest["arrays"][i]["shared"])
    chunk = dest / manifest["arrays"][i]["path"] / "c.2.0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    return i, manifest["arrays"][i]["name"]


# ----------------------------------------------------------------------------------------------
# Tests


@pytest.mark.subprocess
def test_four_devices_round_trip_keeps_shardings(written: dict[str, Any]) -> None:
    """(The writer asserts equal shardings, values and gradients itself; here: what it wrote.)"""
    summary = written["summary"]["keys"]
    for key, mesh in (("k", [4]), ("k2", [2, 2]), ("ke", [4])):
        shardings = summary[key]["shardings"]
        assert all(isinstance(s, dict) and s["sizes"] == mesh for s in shardings), shardings
        assert _sharded(written["summary"], key), key
        kinds = dict(zip(summary[key]["names"], summary[key]["kinds"]))
        assert "intermediate" in kinds.values() and "input" in kinds.values()


@pytest.mark.subprocess
def test_chunks_on_disk_one_per_shard_and_plain_zarr_reads_them(written: dict[str, Any]) -> None:
    root, summary, expected = written["root"], written["summary"], written["expected"]
    for key, n_chunks in (("k", 4), ("k2", None)):
        manifest = read_manifest(root, key)
        shardings = manifest["spec"]["shardings"]
        sharded = _sharded(summary, key)
        assert any(not manifest["arrays"][i]["shared"] for i in sharded)
        for i, record in enumerate(manifest["arrays"]):
            folder = root / record["path"]
            chunks = sorted(p.name for p in folder.iterdir() if p.name != "zarr.json")
            desc = summary["keys"][key]["shardings"][i]
            assert shardings[i]["mesh_axis_names"] == desc["axes"]
            assert shardings[i]["mesh_axis_sizes"] == desc["sizes"]
            # (a typed key's record describes its key data: the same spec, maybe a trailing None)
            assert _trim(shardings[i]["spec"]) == _trim(desc["spec"])
            if i in sharded:
                # one chunk per distinct shard: 4 on the data mesh; on the 2x2 mesh, the number
                # of blocks the spec's axes make (replicas are written once)
                axes = [a for e in desc["spec"] if e is not None for a in ([e] if isinstance(e, str) else e)]
                want = n_chunks or int(np.prod([desc["sizes"][desc["axes"].index(a)] for a in axes]))
                assert len(chunks) == want, (key, record["name"], chunks)
                assert len(record["chunk_checksums"]) == want
                assert record["checksum"] == serializers.chunked_checksum(
                    [(tuple(idx), c) for idx, c in record["chunk_checksums"]]
                )
                shard = list(record["shape"])
                shard[0] //= 4 if key == "k" else 2
                assert record["chunk_shape"][0] == shard[0]
            else:
                assert chunks == ["c" + ".0" * len(record["shape"])] and "chunk_shape" not in record
            z = zarr.open_array(str(folder), mode="r")
            assert np.asarray(z[...]).tobytes() == expected[f"{key}/r{i}"].tobytes(), (key, i)
    # sharded weights are content-addressed over their chunks: stored once however often put
    weights = {r["path"] for k in ("k", "k2", "ke") for r in read_manifest(root, k)["arrays"] if r["shared"]}
    assert weights <= {f"weights/{d.name}" for d in (root / "weights").iterdir()}


@pytest.mark.subprocess
def test_one_device_process_loads_whole(written: dict[str, Any]) -> None:
    """A plain process (1 device) reads every chunk and loads each residual whole on its device.
    The backward exported under an ``Auto`` mesh runs there; one exported under a mesh with
    explicit axis types needs its 4 devices: BackwardUnavailableError, with the reason."""
    result = _run(written["reader"], 1, str(written["root"]), str(written["out"]))
    assert result["devices"] == 1
    for key in ("k", "k2", "ke"):
        got = result["keys"][key]
        assert all(s == "SingleDeviceSharding" for s in got["shardings"]), got["shardings"]
    assert result["keys"]["k"]["backward"] == "ok"
    assert result["keys"]["k2"]["backward"] == "ok"
    assert result["keys"]["ke"]["backward"].startswith("unavailable: ")
    assert "exported for 4 devices" in result["keys"]["ke"]["backward"]


@pytest.mark.subprocess
def test_four_device_process_without_the_model(written: dict[str, Any], tmp_path: Path) -> None:
    """Another 4-device process that never imported the model: each residual comes back with an
    equal sharding (same mesh axes, sizes, types and spec), the exported backward runs on them,
    and a flipped bit in one chunk is caught reading shard by shard."""
    i, name = _flip_bit_in_a_chunk(written, tmp_path / "corrupt")
    result = _run(written["reader"], 4, str(written["root"]), str(written["out"]), str(tmp_path / "corrupt"))
    assert result["devices"] == 4
    for key in ("k", "k2", "ke"):
        assert result["keys"][key]["shardings"] == written["summary"]["keys"][key]["shardings"]
        assert result["keys"][key]["backward"] == "ok", result["keys"][key]["backward"]
    err = result["corrupt"]
    assert err is not None and "'k'" in err and f"residual {i} ({name})" in err and "chunk c.2.0" in err


@pytest.mark.subprocess
def test_four_device_process_with_the_model_resumes_with_fresh_splits(written: dict[str, Any]) -> None:
    """``rs.split(loss).backward(store.get(k))`` in a new 4-device process, for a mesh with Auto
    axes, a 2x2 mesh and a mesh with explicit axis types: the gradients of the writer, no forward
    compiled."""
    result = _run(written["split_reader"], 4, str(written["root"]), str(written["out"]))
    for key in ("k", "k2", "ke"):
        info = result[key]
        assert info["forward_compiles"] == 0 and info["backward_compiles"] == 1, (key, info)


@pytest.mark.subprocess
def test_flipped_bit_in_one_chunk_is_corruption(written: dict[str, Any], tmp_path: Path) -> None:
    """Here (one device) every chunk is read and verified: the error names key, residual, chunk."""
    i, name = _flip_bit_in_a_chunk(written, tmp_path / "s")
    with rs.Store(tmp_path / "s") as store:
        with pytest.raises(rs.CorruptContextError) as info:
            store.get("k")
        for other in ("k2", "ke"):
            store.get(other)  # the others are intact
    message = str(info.value)
    assert "'k'" in message and f"residual {i} ({name})" in message and "chunk c.2.0" in message
    # a missing chunk, and a manifest whose chunk list was tampered with
    manifest = read_manifest(tmp_path / "s", "k2")
    j = next(j for j in _sharded(written["summary"], "k2") if not manifest["arrays"][j]["shared"])
    (tmp_path / "s" / manifest["arrays"][j]["path"] / "c.1.0").unlink()
    # (said as ls says it: the file once, by its path in the store)
    missing = rf"context 'k2' is damaged: residual {j} \(.*\): file {manifest['arrays'][j]['path']}/c\.1\.0 is missing"
    with rs.Store(tmp_path / "s") as store, pytest.raises(rs.CorruptContextError, match=missing):
        store.get("k2")
    manifest = read_manifest(tmp_path / "s", "ke")
    k = next(k for k, r in enumerate(manifest["arrays"]) if "chunk_checksums" in r)
    manifest["arrays"][k]["chunk_checksums"] = manifest["arrays"][k]["chunk_checksums"][1:]
    (tmp_path / "s" / "contexts" / "ke.manifest").write_bytes(seal_manifest(manifest))
    with rs.Store(tmp_path / "s") as store, pytest.raises(rs.CorruptContextError, match="chunk_checksums"):
        store.get("ke")


def test_sharding_records_are_validated(tmp_path: Path) -> None:
    """A manifest's sharding map is untrusted input: malformed ones are CorruptContextError."""
    import jax.numpy as jnp

    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
    _, ctx = fwd(jnp.ones((3, 2)), jnp.arange(12.0).reshape(4, 3))
    with rs.Store(tmp_path) as store:
        store.put(ctx, "c")
    good = read_manifest(tmp_path, "c")
    assert "shardings" not in good["spec"]  # nothing sharded: the manifest is as before
    n = len(good["arrays"])
    mesh = {"mesh_axis_names": ["data"], "mesh_axis_sizes": [4], "spec": ["data"]}
    bad_maps = [
        [None] * (n + 1),
        [{**mesh, "spec": ["model"]}] + [None] * (n - 1),
        [{**mesh, "mesh_axis_sizes": [0]}] + [None] * (n - 1),
        [{**mesh, "spec": ["data", "data", None]}] + [None] * (n - 1),
        [{**mesh, "device_ids": [0]}] + [None] * (n - 1),
        ["data"] + [None] * (n - 1),
    ]
    for shardings in bad_maps:
        manifest = {**good, "spec": {**good["spec"], "shardings": shardings}}
        (tmp_path / "contexts" / "c.manifest").write_bytes(seal_manifest(manifest))
        with rs.Store(tmp_path) as store, pytest.raises(rs.CorruptContextError, match="invalid spec"):
            store.get("c")
    # a 4-device mesh recorded for a residual: this 1-device process loads it whole
    manifest = {**good, "spec": {**good["spec"], "shardings": [{**mesh, "spec": [None]}] + [None] * (n - 1)}}
    (tmp_path / "contexts" / "c.manifest").write_bytes(seal_manifest(manifest))
    with rs.Store(tmp_path) as store:
        got = store.get("c")
    assert [raw(x).tobytes() for x in got.residuals] == [raw(x).tobytes() for x in ctx.residuals]


def test_array_record_chunk_fields() -> None:
    sums = [((1, 0), "xxh3_64:0000000000000002"), ((0, 0), "xxh3_64:0000000000000001")]
    record = serializers.ArrayRecord(
        "h", "data/k.1/0", (4, 3), "float32", 48, serializers.chunked_checksum(sums),
        chunk_shape=(2, 3), chunk_checksums=sums,
    )  # fmt: skip
    assert record.chunked and record.chunk_checksums == tuple(sorted(sums))
    assert serializers.ArrayRecord.from_dict(record.to_dict()) == record
    plain = serializers.ArrayRecord("w", "weights/x", (4, 3), "float32", 48, "xxh3_64:0000000000000001")
    assert "chunk_shape" not in plain.to_dict() and not plain.chunked
    bad = [
        {"chunk_shape": [3, 3]},
        {"chunk_checksums": [[[0, 0], "xxh3_64:0000000000000001"]]},
        {"checksum": "xxh3_64:0000000000000000"},
        {"chunk_checksums": [[[0, 0], "a"], [[0, 0], "a"]]},
        {"chunk_checksums": [[[0, 0], "a"], [[2, 0], "b"]]},
        {"chunk_checksums": "x"},
    ]
    for change in bad:
        with pytest.raises(serializers.CorruptDataError):
            serializers.ArrayRecord.from_dict({**record.to_dict(), **change}, what="r")
    missing = record.to_dict()
    del missing["chunk_checksums"]
    with pytest.raises(serializers.CorruptDataError, match="together"):
        serializers.ArrayRecord.from_dict(missing)

