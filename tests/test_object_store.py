"""Stores on an S3-compatible object store, as a user opens one: moto's server on loopback, a
bucket made with one HTTP PUT, credentials from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``,
and the tensorstore spec ``{"driver": "s3", "bucket", "path", "endpoint", "aws_region"}``.

One process puts; new processes (with the model's code and without it, under other
``PYTHONHASHSEED``s) resume; a damaged object is found; ``gc`` keeps to its rule on a store with
no modification times; two processes on a 4-device mesh put sharded contexts and a new pair
resumes them with ``fwd.backward``; the command line reads the store by its spec. Nothing the AWS
SDK prints about missing ``~/.aws`` files reaches the user's terminal.
"""

from __future__ import annotations

import json
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

import residual_store as rs
import s3_server
from store_helpers import run_cli_process, run_python, write_script

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.skipif(not s3_server.available(), reason="moto[s3] and flask are in the test extra"),
]

SDK_NOISE = ("Failed to open file", "aws-error", "AuthCredentialsProvider")


@pytest.fixture(scope="module")
def server():
    """One moto server for the module, with the credentials in this process's environment (and
    so in its children's), stopped by its process id at the end."""
    with s3_server.serving("residuals") as s:
        yield s


@pytest.fixture
def spec(server) -> dict:
    """A fresh prefix in the bucket for each test: a store of its own."""
    return server.spec("residuals", f"run-{uuid.uuid4().hex[:8]}/")


def _kv(spec: dict) -> ts.KvStore:
    """The store's prefix as a tensorstore kvstore: what another writer, or damage, does to it."""
    return ts.KvStore.open({**spec, "aws_credentials": {"type": "environment"}}).result()


def _objects(spec: dict) -> list[str]:
    """Every key under the store's prefix, listed as the store sees them."""
    return sorted(k.decode() for k in _kv(spec).list().result())


def _mlp():
    def loss(p, x):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

    k = jax.random.split(jax.random.key(31), 3)
    params = {"w1": jax.random.normal(k[0], (8, 16)) / 3, "w2": jax.random.normal(k[1], (16, 4)) / 4}
    xs = [jax.random.normal(kk, (32, 8)) for kk in jax.random.split(k[2], 2)]
    return loss, params, xs


def _put_two(spec: dict):
    """The MLP's contexts of two microbatches put as ``mb0`` and ``mb1``; the model and data."""
    loss, params, xs = _mlp()
    fwd = rs.split(loss)
    with rs.Store(spec) as store:
        for i, x in enumerate(xs):
            store.put(fwd(params, x)[1], f"mb{i}")
    return loss, params, xs


_RESUME = """
import sys, json, jax, numpy as np, residual_store as rs
spec, out, with_model = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3] == "model"
grads = {}
with rs.Store(spec, read_only=True) as store:
    keys = store.keys()
    if with_model:  # a fresh split: it rebuilds the backward from the context's call record
        import jax.numpy as jnp
        def loss(p, x):
            return jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)
        fwd = rs.split(loss)
        for key in keys:
            grads[key] = fwd.backward(store.get(key))
        assert fwd.cache_info().forward_compiles == 0
    else:  # no model here: the backward the store saved
        for key in keys:
            grads[key] = rs.backward(store.get(key))
np.savez(out, **{f"{k}/{name}": np.asarray(v) for k, g in grads.items() for name, v in g.items()})
print(json.dumps(keys))
"""


def test_a_round_trip_and_backwards_in_new_processes_with_and_without_the_model(tmp_path, spec):
    loss, params, xs = _mlp()
    fwd = rs.split(loss)
    with rs.Store(spec) as store:
        for i, x in enumerate(xs):
            store.put(fwd(params, x)[1], f"mb{i}")
        store.flush()
        assert store.stats()["disk"]["contexts"] == 2
    objects = _objects(spec)
    assert {"contexts/mb0.manifest", "contexts/mb1.manifest"} <= set(objects)
    assert any(o.startswith("backwards/") for o in objects) and any(o.startswith("weights/") for o in objects)
    want = {f"mb{i}": jax.grad(loss)(params, x) for i, x in enumerate(xs)}
    script = write_script(tmp_path, "resume.py", _RESUME)
    for how, seed in (("model", "1"), ("no-model", "7")):
        out = tmp_path / f"{how}.npz"
        proc = run_python(script, json.dumps(spec), str(out), how, env={"PYTHONHASHSEED": seed})
        assert json.loads(proc.stdout) == ["mb0", "mb1"]
        assert not any(n in proc.stderr for n in SDK_NOISE), proc.stderr  # quiet opens
        got = np.load(out)
        for key, g in want.items():
            for name, v in g.items():
                np.testing.assert_allclose(got[f"{key}/{name}"], np.asarray(v), rtol=1e-5, atol=1e-6)


def _flip_a_byte(spec: dict, key: str, at: int = -1) -> None:
    kv = _kv(spec)
    data = bytearray(kv.read(key).result().value)
    data[at] ^= 0x40
    kv.write(key, bytes(data)).result()


def test_a_damaged_object_is_found_and_the_rest_still_reads(spec):
    loss, params, xs = _put_two(spec)
    import msgpack

    manifest = msgpack.unpackb(_kv(spec).read("contexts/mb0.manifest").result().value)
    i, own = next((i, r) for i, r in enumerate(manifest["arrays"]) if not r["shared"] and r["nbytes"])
    bundle = manifest["bundle"]["path"]  # one object holds every own residual
    assert bundle in _objects(spec) and not any(o.startswith(own["path"] + "/") for o in _objects(spec))
    _flip_a_byte(spec, bundle, own["offset"] + 1)
    with rs.Store(spec, read_only=True) as store:
        with pytest.raises(rs.CorruptContextError, match=rf"checksum mismatch.*|residual {i}"):
            store.get("mb0")
        g = rs.backward(store.get("mb1"))  # the other context is intact
    np.testing.assert_allclose(np.asarray(g["w1"]), np.asarray(jax.grad(loss)(params, xs[1])["w1"]), rtol=1e-5, atol=1e-6)
    verify = run_cli_process("verify", json.dumps(spec), "--json")
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert [d["key"] for d in json.loads(verify.stdout)["damaged"]] == ["mb0"]
    # a truncated manifest: a clear error naming it, never a wrong context
    _truncate(spec, "contexts/mb1.manifest", 17)
    with rs.Store(spec, read_only=True) as store, pytest.raises(rs.CorruptContextError):
        store.get("mb1")


def msgpack_records(spec: dict, key: str) -> list[dict]:
    import msgpack

    return msgpack.unpackb(_kv(spec).read(f"contexts/{key}.manifest").result().value)["arrays"]


def _truncate(spec: dict, key: str, n: int) -> None:
    kv = _kv(spec)
    kv.write(key, bytes(kv.read(key).result().value)[:n]).result()


def test_gc_on_an_object_store_removes_only_with_older_than_zero(spec):
    """An object store gives no modification times: gc cannot tell the objects of a put that a
    writer in another process is about to commit from those of a put that was interrupted, so by
    default it removes nothing and counts them as young; ``older_than=0`` (no writer running)
    removes them, and nothing a context needs."""
    loss, params, xs = _put_two(spec)
    # an interrupted put (another process killed before its commit): data objects, no manifest
    kv = _kv(spec)
    own = next(r["path"] for r in msgpack_records(spec, "mb0") if not r["shared"]).rsplit("/", 1)[0]
    orphan = "data/interrupted.0123456789ab"
    for o in _objects(spec):
        if o.startswith(own + "/"):
            kv.write(orphan + o[len(own):], kv.read(o).result().value).result()
    objects = _objects(spec)
    assert any(o.startswith(orphan + "/") for o in objects)
    with rs.Store(spec) as store:
        kept = store.gc()  # older_than=1h: the age of an object is unknown, so nothing goes
        assert {k: kept[k] for k in ("weights", "data", "recycled", "backwards", "temporary")} == dict.fromkeys(
            ("weights", "data", "recycled", "backwards", "temporary"), 0)
        assert kept["young"] == 1 and _objects(spec) == objects
        dry = store.gc(older_than=0, dry_run=True)
        assert dry["data"] == 1 and _objects(spec) == objects
        removed = store.gc(older_than=0)
        assert removed["data"] == 1 and removed["bytes"] == -1  # a listing gives no sizes
        assert [o for o in _objects(spec) if o not in objects] == []
        assert [o for o in objects if o not in _objects(spec)] == [o for o in objects if o.startswith(orphan + "/")]
        assert store.keys() == ["mb0", "mb1"]
        grads = [rs.backward(store.get(k)) for k in ("mb0", "mb1")]
    for g, x in zip(grads, xs):
        np.testing.assert_allclose(np.asarray(g["w2"]), np.asarray(jax.grad(loss)(params, x)["w2"]), rtol=1e-5, atol=1e-6)


def test_the_command_line_on_an_s3_spec(spec):
    _put_two(spec)
    path = json.dumps(spec)
    ls = run_cli_process("ls", path, "--json")
    assert ls.returncode == 0 and [e["key"] for e in json.loads(ls.stdout)] == ["mb0", "mb1"], ls.stderr
    verify = run_cli_process("verify", path)
    assert verify.returncode == 0 and "2 of 2 contexts verified" in verify.stdout, verify.stdout + verify.stderr
    inspect = run_cli_process("inspect", path, "mb1")
    assert inspect.returncode == 0 and "intermediate" in inspect.stdout and "weight" in inspect.stdout
    for out in (ls, verify, inspect):
        assert not any(n in out.stderr for n in SDK_NOISE), out.stderr


def test_internals_named_credentials_are_left_as_given():
    from residual_store._src.store.disk import kvstore as kv_backend

    given = {"driver": "s3", "bucket": "b", "aws_credentials": {"type": "anonymous"}}
    assert kv_backend._with_quiet_credentials(dict(given)) == given
    in_context = {"driver": "s3", "bucket": "b", "context": {"aws_credentials": {"type": "profile"}}}
    assert kv_backend._with_quiet_credentials(dict(in_context)) == in_context
    assert kv_backend._with_quiet_credentials({"driver": "gcs", "bucket": "b"}) == {"driver": "gcs", "bucket": "b"}


# -- a JAX multi-controller job on the object store ---------------------------------------------


@pytest.mark.multiprocess
def test_two_processes_put_and_a_new_pair_resumes_with_fwd_backward(tmp_path, spec):
    """Two processes with two CPU devices each (a 4-device mesh) put two sharded contexts into
    the object store; a new pair with the model, which never runs the forward, resumes them with
    ``fwd.backward(store.get(key))``: the gradients of ``jax.grad``, the backward compiled once."""
    import test_multiprocess as mp

    root = json.dumps(spec)
    written = mp._run_pair(tmp_path, "forward", root)
    assert written["sharded"] >= 1 and written["signatures_equal"]
    params = mp.init_params()
    expected = jax.tree.map(lambda *g: sum(g), *[jax.grad(mp.loss)(params, x, y) for x, y in mp.batches()])
    for i, (x, y) in enumerate(mp.batches()):
        np.testing.assert_allclose(written[f"loss{i}"], mp.loss(params, x, y), rtol=1e-5)
    records = msgpack_records(spec, "mb0")
    assert any(not r["shared"] and r.get("chunk_shape") for r in records)  # an input sharded over both
    resumed = mp._run_pair(tmp_path, "resume_split", root)
    assert (resumed["cache_info"]["forward_compiles"], resumed["cache_info"]["backward_compiles"]) == (0, 1)
    for name in ("w1", "w2"):
        np.testing.assert_allclose(np.asarray(resumed["grads"][name]), expected[name], rtol=1e-5, atol=1e-6)
    for i in range(2):
        log = (tmp_path / f"resume_split{i}.log").read_text()
        assert not any(n in log for n in SDK_NOISE), log[-2000:]


# -- an object store that goes away -------------------------------------------------------------


def test_a_store_whose_object_store_goes_away_raises_store_unavailable_within_the_timeout(spec, server):
    """Through a relay the test cuts: ``put`` + ``flush`` and ``get`` raise
    rs.StoreUnavailableError within a few timeouts (tensorstore alone would retry for minutes),
    the failed put is not in the store, and what was committed before is intact."""
    import time

    loss, params, xs = _mlp()
    fwd = rs.split(loss)
    proxy = s3_server.Proxy(server.port)
    relayed = {**spec, "endpoint": proxy.endpoint}
    store = rs.Store(relayed, timeout=1, device_budget=0, host_budget=0)  # gets read the store
    try:
        store.put(fwd(params, xs[0])[1], "mb0")
        store.flush()
        proxy.cut()
        store.put(fwd(params, xs[1])[1], "mb1")
        t0 = time.monotonic()
        with pytest.raises(rs.StoreUnavailableError, match="did not answer") as info:
            store.flush()
        assert isinstance(info.value, OSError) and time.monotonic() - t0 < 30
        t0 = time.monotonic()
        with pytest.raises(rs.StoreUnavailableError):
            store.get("mb0")
        assert time.monotonic() - t0 < 30
        assert store._table.locate("mb1")[0] is None  # a put whose write failed is in no memory tier
    finally:
        store.close()
    with rs.Store(spec, read_only=True) as direct:
        assert direct.keys() == ["mb0"]
        g = rs.backward(direct.get("mb0"))
    want = jax.grad(loss)(params, xs[0])
    for name in want:
        np.testing.assert_allclose(np.asarray(g[name]), np.asarray(want[name]), rtol=1e-5, atol=1e-6)


def test_a_store_that_goes_away_at_the_commit_leaves_no_half_written_context(spec, server):
    """The relay cuts as the manifest's PUT (the commit) arrives, after every array of the
    context went up: the flush raises rs.StoreUnavailableError, the context is not visible to
    any reader, the store verifies, and gc (older_than=0) removes the orphaned arrays."""
    loss, params, xs = _mlp()
    fwd = rs.split(loss)
    with rs.Store(spec) as direct:  # the signature's backward and weights are there already
        direct.put(fwd(params, xs[0])[1], "mb0")
    before = _objects(spec)
    proxy = s3_server.Proxy(server.port, cut_on=f"PUT /residuals/{spec['path']}contexts/mb1".encode())
    store = rs.Store({**spec, "endpoint": proxy.endpoint}, timeout=1)
    try:
        store.put(fwd(params, xs[1])[1], "mb1")
        with pytest.raises(rs.StoreUnavailableError):
            store.flush()
        assert proxy.is_cut
    finally:
        store.close()
    added = [o for o in _objects(spec) if o not in before]
    assert added and all(o.startswith("data/mb1.") for o in added), added  # its arrays, no manifest
    verify = run_cli_process("verify", json.dumps(spec))
    assert verify.returncode == 0 and "1 of 1 context verified" in verify.stdout, verify.stdout + verify.stderr
    with rs.Store(spec) as direct:
        assert direct.keys() == ["mb0"]
        assert direct.gc(older_than=0)["data"] == 1
        assert _objects(spec) == before


def test_the_command_line_on_a_store_that_does_not_answer(spec, server):
    """A listener that takes connections and never answers: the command line gives up after
    --timeout, with one line on stderr and status 2, and no AWS SDK noise."""
    import socket
    import time

    _put_two(spec)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never accepts nor answers
        path = json.dumps({**spec, "endpoint": f"http://127.0.0.1:{silent.getsockname()[1]}"})
        t0 = time.monotonic()
        out = run_cli_process("ls", path, "--timeout", "1")
        assert time.monotonic() - t0 < 60
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "did not answer within --timeout 1 s" in lines[0], out.stderr
    assert "give a longer --timeout" in lines[0] and "rs.Store" not in lines[0]  # command-line advice
    assert not any(n in out.stderr for n in SDK_NOISE)
