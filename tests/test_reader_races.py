"""A reader racing a writer that replaces or deletes the same key sees one whole, verified
context (old or new, never a mix), or ``rs.ContextNotFoundError`` (deleted), never a
``serializers`` error, an ``OSError`` or a ``ValueError`` (issue 35, items 2 and 3).

A replaced context's data folder is recycled: the next write of the same layout renames it and
overwrites its files in place. A read that opened the old bundle before that sees torn bytes
(its whole-file checksum fails), and the file read again to name the damaged residual is gone
by then. That ``CorruptDataError`` escaped ``DiskTier.read``'s retry on a new manifest.

- Other processes: a writer process replaces one key (three versions in turn: with two, a
  recycled folder gets back the very bytes it held, and no read can tear) or deletes and puts
  it, while a reader process (``read_only=True``, no model code) gets it in a loop and compares
  every result with the versions, bit for bit, and ``rs.backward`` with ``jax.grad``.
- One process, deterministic: the reader's read of the bundle is held right after the file is
  opened (the buffer it reads into is asked for) while the writer replaces (or deletes) the key
  and recycles that very file; and a manifest that disappears, a file version that comes back
  for a new manifest (reused inode, coarse mtime), a kvstore whose old data is deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

import residual_store as rs
import residual_store_serializers as serializers
from models import init_mlp, mlp_loss
from store_helpers import jitted_grad, python_env, read_manifest, wait_for, write_script

TESTS = str(Path(__file__).resolve().parent)
SIZES = (8, 16, 16, 4)

# --------------------------------------------------------------------------------------------
# Other processes

# 32768 rows: 10 MB a context. The window is a read still running when the write after next
# overwrites its folder: with 300 KB contexts, measured once in about 15,000 gets on 2 cores (a
# test of seconds could not fail against the old code); with 10 MB, on a few in a hundred.
RACE_ROWS = 32768
READ_SECONDS = 3.5

WRITER = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import jax, numpy as np
import residual_store as rs
from models import init_mlp, mlp_loss

root, mode, seed, rows, folder = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
params = init_mlp(jax.random.key(seed), {sizes})
fwd = rs.split(mlp_loss)
contexts, saved = [], {{}}
for v in range(3):
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(seed), v + 1))
    x, y = jax.random.normal(kx, (rows, {sizes}[0])), jax.random.normal(ky, (rows, {sizes}[-1]))
    ctx = fwd(params, x, y)[1]
    contexts.append(ctx)
    saved.update({{f"v{{v}}_r{{i}}": np.asarray(r) for i, r in enumerate(ctx.residuals)}})
    saved.update({{f"v{{v}}_g{{i}}": np.asarray(g) for i, g in enumerate(jax.tree.leaves(jax.grad(mlp_loss)(params, x, y)))}})
np.savez(os.path.join(folder, "versions.npz"), **saved)
puts = deletes = 0
deadline = time.monotonic() + 60  # whatever happens to the test
with rs.Store(root, durable=False, device_budget=0, host_budget=0) as store:
    store.put(contexts[0], "k")
    store.flush()
    open(os.path.join(folder, "ready"), "w").close()
    while not os.path.exists(os.path.join(folder, "stop")) and time.monotonic() < deadline:
        if mode == "delete":
            store.delete("k")
            store.flush()
            deletes += 1
        store.put(contexts[(puts + 1) % 3], "k")
        store.flush()
        puts += 1
print(json.dumps({{"puts": puts, "deletes": deletes}}))
""".format(sizes=SIZES)

# knows neither the model nor the library's internals: what another team's process would run
READER = """
import collections, json, os, sys, time
import jax, numpy as np
import residual_store as rs

root, folder, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(folder, "ready")):
    assert time.monotonic() < deadline, "the writer never got ready"
    time.sleep(0.01)
saved = np.load(os.path.join(folder, "versions.npz"))
def version(v, kind):
    return [saved[f"v{v}_{kind}{i}"] for i in range(sum(1 for k in saved.files if k.startswith(f"v{v}_{kind}")))]
residuals = [version(v, "r") for v in range(3)]
grads = [version(v, "g") for v in range(3)]
manifest = os.path.join(root, "contexts", "k.manifest")

def token():
    try:
        st = os.stat(manifest)
        return st.st_ino, st.st_mtime_ns
    except FileNotFoundError:
        return None

seen, errors, samples = collections.Counter(), collections.Counter(), {}
overlapped = mixes = gets = 0
bad_grads = []
checked = set()
with rs.Store(root, read_only=True, device_budget=0, host_budget=0) as store:  # every get reads the disk
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        before = token()
        gets += 1
        try:
            ctx = store.get("k")
        except Exception as err:
            kind = type(err)
            name = kind.__name__ if kind.__module__.startswith("residual_store") else f"{kind.__module__}.{kind.__name__}"
            errors[name] += 1
            samples.setdefault(name, str(err)[:400])
            continue
        finally:
            overlapped += token() != before  # a commit or a delete landed while this get ran
        got = [np.asarray(r) for r in ctx.residuals]
        which = [v for v in range(3) if len(got) == len(residuals[v])
                 and all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(got, residuals[v]))]
        if not which:
            mixes += 1
            continue
        seen[which[0]] += 1
        if which[0] not in checked:  # the stored backward, no model code: jax.grad's gradients
            checked.add(which[0])
            g = [np.asarray(x) for x in jax.tree.leaves(rs.backward(ctx))]
            if not all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(g, grads[which[0]])):
                bad_grads.append(which[0])
print(json.dumps({"gets": gets, "seen": seen, "errors": errors, "samples": samples, "mixes": mixes,
                  "overlapped": overlapped, "bad_grads": bad_grads}))
"""


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"a subprocess ran past {timeout} s\nstdout:\n{out}\nstderr:\n{err[-3000:]}")


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=python_env(), cwd=TESTS,
    )


@pytest.mark.subprocess
@pytest.mark.parametrize("mode", ["replace", "delete"])
def test_a_reader_process_gets_whole_versions_while_a_writer_process_replaces_the_key(tmp_path, rng, mode):
    folder = tmp_path
    root = str(tmp_path / "store")
    writer_py = write_script(tmp_path, "writer.py", WRITER)
    reader_py = write_script(tmp_path, "reader.py", READER)
    seed = str(int(jax.random.randint(rng, (), 0, 2**30)))
    writer = _start(writer_py, TESTS, root, mode, seed, str(RACE_ROWS), str(folder))
    reader = _start(reader_py, root, str(folder), str(READ_SECONDS))
    try:
        out, err = _finish(reader, 90)
        assert reader.returncode == 0, f"the reader failed:\n{out}\n{err[-3000:]}"
    finally:
        (folder / "stop").touch()
        w_out, w_err = _finish(writer, 60)
    assert writer.returncode == 0, f"the writer failed:\n{w_out}\n{w_err[-3000:]}"
    got, wrote = json.loads(out.splitlines()[-1]), json.loads(w_out.splitlines()[-1])
    report = f"reader {got}, writer {wrote}"
    # what a read may give: a whole version, bit for bit, whose backward is jax.grad's ...
    assert got["mixes"] == 0 and got["bad_grads"] == [], report
    # ... or, for a key deleted under it, ContextNotFoundError; nothing else
    allowed = {"ContextNotFoundError"} if mode == "delete" else set()
    assert set(got["errors"]) <= allowed, report
    # the race was run: many commits, gets that overlapped them, every version read
    assert wrote["puts"] >= 20 and got["overlapped"] >= 10, report
    assert len(got["seen"]) == 3 and sum(got["seen"].values()) >= 20, report


# --------------------------------------------------------------------------------------------
# One process, deterministic


def _versions(rng: jax.Array, rows: int = 256) -> list[tuple[rs.ResidualContext, list[np.ndarray]]]:
    """Three contexts of one signature and layout (different inputs), each with jax.grad's
    gradients."""
    params = init_mlp(jax.random.fold_in(rng, 0), SIZES)
    fwd = rs.split(mlp_loss)
    out = []
    for v in range(3):
        kx, ky = jax.random.split(jax.random.fold_in(rng, v + 1))
        x, y = jax.random.normal(kx, (rows, SIZES[0])), jax.random.normal(ky, (rows, SIZES[-1]))
        out.append((fwd(params, x, y)[1], [np.asarray(g) for g in jax.tree.leaves(jitted_grad(mlp_loss)(params, x, y))]))
    return out


def _which(ctx: rs.ResidualContext, versions: list[tuple[rs.ResidualContext, list[np.ndarray]]]) -> int:
    """The version ``ctx`` is: every residual bit for bit, and ``rs.backward`` gives its
    ``jax.grad``."""
    got = [np.asarray(r).tobytes() for r in ctx.residuals]
    which = [v for v, (c, _) in enumerate(versions) if got == [np.asarray(r).tobytes() for r in c.residuals]]
    assert len(which) == 1, "a context that is no version put (a mix?)"
    grads = [np.asarray(g) for g in jax.tree.leaves(rs.backward(ctx))]
    for a, b in zip(grads, versions[which[0]][1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return which[0]


def _recycled(root: Path) -> list[str]:
    free = root / "data" / ".free"
    return os.listdir(free) if free.is_dir() else []


def _backend_of(store: rs.Store):
    """The storage backend of ``store``'s disk tier (wherever the store keeps its disk tier)."""
    disk = getattr(store, "_disk", None) or store._persistence.disk
    return disk.backend


def _bundle_path(root: Path, key: str) -> Path:
    return root / read_manifest(root, key)["bundle"]["path"]


def _hold_bundle_read(monkeypatch, reader: rs.Store, during) -> list[str]:
    """Runs ``during()`` once, inside the reader's first read of a bundle: after the file is
    opened and checked, before its bytes are read (when the buffer they go into is asked
    for). Returns the paths of every bundle read asked for."""
    backend = _backend_of(reader)
    real = backend.read_file
    asked: list[str] = []

    def read_file(key, nbytes, *, checksum=None, empty=None):
        asked.append(key)
        give = empty or serializers.aligned_empty

        def buffer(shape, dtype):
            if len(asked) == 1:
                during()
            return give(shape, dtype)

        return real(key, nbytes, checksum=checksum, empty=buffer)

    monkeypatch.setattr(backend, "read_file", read_file)
    return asked


def _replace_recycling(root: Path, writer: rs.Store, versions, key: str = "k") -> None:
    """Replaces ``key`` (version 0) by version 1, then by version 2, which recycles version 0's
    data folder: its bundle is overwritten in place (the same file, new bytes)."""
    old = os.stat(_bundle_path(root, key)).st_ino
    writer.put(versions[1][0], key)
    writer.flush()
    wait_for(lambda: _recycled(root), "version 0's folder to be recycled")
    writer.put(versions[2][0], key)
    writer.flush()
    assert os.stat(_bundle_path(root, key)).st_ino == old, "version 2 did not overwrite version 0's bundle"


@contextlib.contextmanager
def _version_0_written(where: Path | dict, versions: list) -> Iterator[tuple[rs.Store, rs.Store]]:
    """A writer and a reader of one store, the writer's version 0 of ``k`` committed."""
    writer = rs.Store(where, durable=False, device_budget=0, host_budget=0)
    reader = rs.Store(where, read_only=True, device_budget=0, host_budget=0)  # every get reads the disk
    with writer, reader:
        writer.put(versions[0][0], "k")
        writer.flush()
        yield writer, reader


def test_internals_a_bundle_recycled_under_a_read_is_read_again_from_the_new_manifest(tmp_path, rng, monkeypatch):
    versions = _versions(rng)
    with _version_0_written(tmp_path, versions) as (writer, reader):
        asked = _hold_bundle_read(monkeypatch, reader, lambda: _replace_recycling(tmp_path, writer, versions))
        # torn (version 2's bytes in version 0's file), its folder gone when read again: the
        # read starts over from the new manifest (before: serializers' CorruptDataError)
        assert _which(reader.get("k"), versions) == 2
        assert len(set(asked)) == 2, asked  # version 0's bundle, then version 2's


def test_internals_a_key_deleted_under_a_read_is_not_found(tmp_path, rng, monkeypatch):
    versions = _versions(rng)
    with _version_0_written(tmp_path, versions) as (writer, reader):

        def replace_and_delete() -> None:
            _replace_recycling(tmp_path, writer, versions)
            writer.delete("k")
            writer.flush()

        _hold_bundle_read(monkeypatch, reader, replace_and_delete)
        with pytest.raises(rs.ContextNotFoundError):
            reader.get("k")


def test_internals_a_manifest_deleted_between_its_version_and_its_read_is_not_found(tmp_path, rng, monkeypatch):
    versions = _versions(rng)
    with _version_0_written(tmp_path, versions) as (writer, reader):
        backend = _backend_of(reader)
        real = backend.get_bytes

        def get_bytes(key, **kwargs):
            if key.endswith(".manifest"):  # its version was looked up already
                writer.delete("k")
                writer.flush()
            return real(key, **kwargs)

        monkeypatch.setattr(backend, "get_bytes", get_bytes)
        with pytest.raises(rs.ContextNotFoundError):
            reader.get("k")


def test_internals_a_file_version_that_comes_back_does_not_make_a_replaced_context_corrupt(tmp_path, rng, monkeypatch):
    """A manifest's version (inode, size, mtime) can come back for a later commit: ext4 gives
    a freed inode to the next file, and a coarse clock two commits one mtime. The parsed
    manifest cached under it is then stale; the failed read must not call that corruption."""
    versions = _versions(rng)
    with _version_0_written(tmp_path, versions) as (writer, reader):
        backend = _backend_of(reader)
        real = backend.version
        monkeypatch.setattr(backend, "version", lambda key: ("always", "the same") if real(key) else None)
        assert _which(reader.get("k"), versions) == 0  # its manifest cached under that version
        _replace_recycling(tmp_path, writer, versions)
        assert _which(reader.get("k"), versions) == 2  # before: CorruptContextError


def test_internals_damage_under_an_unchanged_manifest_is_corruption_found_with_one_more_manifest_read(
    tmp_path, rng, monkeypatch
):
    versions = _versions(rng)
    with _version_0_written(tmp_path, versions) as (writer, reader):
        bundle = _bundle_path(tmp_path, "k")
        data = bytearray(bundle.read_bytes())
        data[len(data) // 2] ^= 0xFF  # a residual's bytes
        bundle.write_bytes(bytes(data))
        backend = _backend_of(reader)
        looked: list[str] = []

        def counting(name):
            real = getattr(backend, name)

            def look(key, **kwargs):
                if key == "contexts/k.manifest":
                    looked.append(name)
                return real(key, **kwargs)

            return look

        for name in ("version", "get_bytes"):
            monkeypatch.setattr(backend, name, counting(name))
        with pytest.raises(rs.CorruptContextError, match=r"residual \d+"):
            reader.get("k")
        # the manifest looked up to read, and once more after the failure: no retries
        assert looked.count("version") <= 2 and looked.count("get_bytes") <= 2, looked


def test_internals_a_kvstore_context_replaced_under_a_read_is_read_again(tmp_path, rng, monkeypatch):
    """On a kvstore nothing is recycled: the replaced context's objects are deleted."""
    versions = _versions(rng)
    spec = {"driver": "file", "path": str(tmp_path)}
    with _version_0_written(spec, versions) as (writer, reader):
        old = _bundle_path(tmp_path, "k")

        def replace() -> None:
            writer.put(versions[1][0], "k")
            writer.flush()
            wait_for(lambda: not old.exists(), "version 0's bundle to be deleted")

        backend = _backend_of(reader)
        real = backend.read_file
        asked: list[str] = []

        def read_file(key, nbytes, **kwargs):
            asked.append(key)
            if len(asked) == 1:
                replace()
            return real(key, nbytes, **kwargs)

        monkeypatch.setattr(backend, "read_file", read_file)
        assert _which(reader.get("k"), versions) == 1
        assert len(set(asked)) == 2, asked
