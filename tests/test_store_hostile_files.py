"""A local store under hostile files: a FIFO, a folder, a symbolic link loop, a link to
``/dev/zero`` or a sparse 4 GiB file in place of each kind of file the store reads, and symbolic
links planted in each of its folders.

Every read gives a library error within seconds (never a hang, a raw ``OSError`` or a
``MemoryError``) with memory bounded, and ``residual-store verify`` reports the damage; no put,
flush, get, delete or gc ever reads, writes or removes anything outside the store's root.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import residual_store as rs
from residual_store import cli
from residual_store._src.store import backwards
from residual_store._src.store.disk.tier import DiskTier
from store_helpers import (
    F32_TOL,
    assert_contexts_identical,
    assert_trees_close,
    init_params,
    last_json_line,
    mlp_batch,
    mlp_loss,
    read_manifest,
    run_python,
    write_script,
)

SIZES = (4, 8, 2)
DEADLINE_S = 10.0  # far above what any refusal takes (milliseconds), far below a hang
MAX_TRACED_BYTES = 200 << 20
SPARSE_BYTES = 4 << 30

HAZARDS = ["fifo", "folder", "link_loop", "dev_zero", "sparse_4gib"]
FILE_KINDS = ["manifest", "marker", "bundle", "zarr_json", "weight_chunk", "backward_export", "backward_manifest"]


@pytest.fixture(scope="module")
def split():
    return rs.split(mlp_loss)


@pytest.fixture(scope="module")
def params():
    return init_params(jax.random.key(0), SIZES)


def _ctx(split, params, tag: int):
    x, y = mlp_batch(jax.random.fold_in(jax.random.key(1), tag), 2, SIZES)
    return split(params, x, y)[1]


def _within(fn: Callable[[], Any], seconds: float = DEADLINE_S) -> tuple[Any, BaseException | None, int]:
    """Runs ``fn`` on a daemon thread: (its result, its exception, peak traced bytes); fails the
    test if it is still running after ``seconds`` (a hang must fail, not stall the run)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out["error"] = err

    tracemalloc.start()
    try:
        t = threading.Thread(target=run, daemon=True)
        start = time.monotonic()
        t.start()
        t.join(seconds)
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not t.is_alive(), f"still running after {elapsed:.1f} s: it blocks"
    return out.get("result"), out.get("error"), peak


def _refused(fn: Callable[[], Any], error: type[BaseException] = rs.CorruptContextError) -> BaseException:
    """``fn`` raises ``error`` (a library error) quickly, with memory bounded."""
    result, err, peak = _within(fn)
    assert err is not None, f"no error; got {result!r}"
    assert isinstance(err, error) and isinstance(err, rs.ResidualStoreError), repr(err)
    assert peak < MAX_TRACED_BYTES, f"{peak:,} bytes traced"
    return err


def _verify(root: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code, err, _ = _within(lambda: cli.main(["verify", str(root)]))
    assert err is None, repr(err)
    return code, capsys.readouterr().out


def _plant(path: Path, hazard: str) -> None:
    """Replaces the file ``path`` by ``hazard``."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    if hazard == "fifo":
        os.mkfifo(path)
    elif hazard == "folder":
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    elif hazard == "link_loop":
        os.symlink(path.name, path)  # points at itself: ELOOP when followed
    elif hazard == "dev_zero":
        os.symlink("/dev/zero", path)
    else:
        with open(path, "wb") as f:
            f.truncate(SPARSE_BYTES)


class Stored:
    """A store holding one context ``k`` (and its stored backward), and where its files are."""

    def __init__(self, root: Path, split, params) -> None:
        self.root = root
        self.ctx = _ctx(split, params, 0)
        with rs.Store(root) as store:
            store.put(self.ctx, "k")
        m = read_manifest(root, "k")
        weight = next(r for r in m["arrays"] if r["shared"] and np.prod(r["shape"]) > 0)
        (self.sig,) = [n[: -len(".manifest")] for n in os.listdir(root / "backwards") if n.endswith(".manifest")]
        self.data_dir = root / m["data_dir"]
        self.files = {
            "manifest": root / "contexts" / "k.manifest",
            "marker": root / "residual-store.json",
            "bundle": root / m["bundle"]["path"],  # every own residual of the context
            "zarr_json": root / weight["path"] / "zarr.json",  # for plain zarr; the store's reads skip it
            "weight_chunk": root / weight["path"] / ("c" + ".0" * len(weight["shape"])),
            "backward_export": root / "backwards" / f"{self.sig}.export",
            "backward_manifest": root / "backwards" / f"{self.sig}.manifest",
        }
        for p in self.files.values():
            assert p.is_file(), p


@pytest.fixture
def stored(tmp_path, split, params):
    return Stored(tmp_path / "store", split, params)


# ----------------------------------------------------------------------------------------------
# Hostile files in place of each kind of file


@pytest.mark.slow
@pytest.mark.parametrize("hazard", HAZARDS)
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_internals_a_hostile_file_gives_a_library_error_quickly(stored, kind, hazard, capsys):
    _plant(stored.files[kind], hazard)
    root = stored.root

    def get() -> Any:
        with rs.Store(root) as store:
            return store.get("k")

    if kind == "marker":
        err = _refused(lambda: rs.Store(root))
        assert "residual-store.json" in str(err)
        _refused(lambda: rs.Store(root, read_only=True))
    elif kind in ("manifest", "bundle", "weight_chunk"):
        err = _refused(get)
        assert "'k'" in str(err) or "k.manifest" in str(err), str(err)
    elif kind == "zarr_json":
        # The store's own reads take shape and dtype from the manifest (whose checksums vouch for
        # the data): an intact context is read; verify reports what plain zarr cannot read.
        got, err, peak = _within(get)
        assert err is None, repr(err)
        assert_contexts_identical(got, stored.ctx)
        assert peak < MAX_TRACED_BYTES
    else:  # a damaged stored backward never blocks a get; a fresh load refuses it
        got, err, _ = _within(get)
        assert err is None, repr(err)
        assert_contexts_identical(got, stored.ctx)
        disk = DiskTier(root, read_only=True)
        err = _refused(lambda: backwards.read(disk, stored.sig))
        assert stored.sig in str(err)
    code, out = _verify(root, capsys)
    assert code == 1 and "DAMAGED" in out, out


def test_the_intact_store_verifies(stored, capsys):
    code, out = _verify(stored.root, capsys)
    assert code == 0 and "DAMAGED" not in out, out


def test_a_damaged_manifest_can_still_be_deleted(stored):
    _plant(stored.files["manifest"], "fifo")
    with rs.Store(stored.root) as store:
        assert store.keys() == ["k"]
        _within(lambda: (store.delete("k"), store.flush()))
        assert store.keys() == []
    assert not os.path.lexists(stored.files["manifest"])


@pytest.mark.parametrize("hazard", HAZARDS)
def test_a_put_replaces_a_hostile_manifest(stored, hazard):
    """A new put of the key writes a regular manifest in place of the hostile entry (a link is
    replaced itself, never written through)."""
    _plant(stored.files["manifest"], hazard)
    with rs.Store(stored.root) as store:
        _, err, _ = _within(lambda: (store.put(stored.ctx, "k"), store.flush()))
        assert err is None, repr(err)
    assert stored.files["manifest"].is_file() and not stored.files["manifest"].is_symlink()
    with rs.Store(stored.root, read_only=True) as store:
        assert_contexts_identical(store.get("k"), stored.ctx)


def test_a_declared_shape_is_checked_against_the_file_before_anything_is_allocated(tmp_path):
    import residual_store_serializers as serializers

    serializers.write_arrays_local(tmp_path, {"a/0": np.ones((4, 4), np.float32)})
    huge = (1 << 20, 1 << 20)  # 4 TiB of float32
    for read in (
        lambda: serializers.read_array_local(tmp_path, "a/0", huge, "float32", check_metadata=False),
        lambda: serializers.read_chunk_local(tmp_path, "a/0", huge, "float32", huge, (0, 0), check_metadata=False),
    ):
        _, err, peak = _within(read)
        assert isinstance(err, serializers.CorruptDataError) and "expected 4398046511104" in str(err), repr(err)
        assert peak < MAX_TRACED_BYTES


READER = """
import gc, json, os, resource, sys, time
import residual_store as rs

results = {}
for root in sys.argv[1:]:
    store = ctx = None  # the previous root's store and context, and the backward they loaded
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with rs.Store(root, read_only=True) as store:
        ctx = store.get("k")  # intact: the damaged backward does not block it
        try:
            rs.backward(ctx)
            outcome = "no error"
        except rs.ResidualStoreError as err:
            outcome = type(err).__name__
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    results[os.path.basename(root)] = [outcome, time.monotonic() - start, grew]
print(json.dumps(results))
"""


@pytest.mark.subprocess
def test_a_hostile_stored_backward_is_refused_by_a_process_without_the_model(tmp_path, split, params):
    roots = []
    for kind in ("backward_export", "backward_manifest"):
        for hazard in HAZARDS:
            s = Stored(tmp_path / f"{kind}-{hazard}", split, params)
            _plant(s.files[kind], hazard)
            roots.append(str(s.root))
    script = write_script(tmp_path, "reader.py", READER)
    results = last_json_line(run_python(script, *roots, timeout=120).stdout)
    for name, (outcome, seconds, grew_kib) in results.items():
        assert outcome == "CorruptContextError", (name, outcome)
        assert seconds < DEADLINE_S, (name, seconds)
        assert grew_kib < 200 * 1024, (name, grew_kib)


# ----------------------------------------------------------------------------------------------
# Symbolic links planted in the store's folders


def _snapshot(folder: Path) -> dict[str, Any]:
    """Every entry under ``folder`` (not following links): kind, size, mtime, content digest."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            digest = None
            if os.path.isfile(p) and not os.path.islink(p):
                digest = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            out[os.path.relpath(p, folder)] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    out["."] = os.lstat(folder).st_mtime_ns
    return out


class Outside:
    """A sentinel folder next to the store: nothing in it may be read, written or removed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        (path / "victim").write_bytes(b"do not touch " * 4)

    def copy_in(self, src: Path, name: str) -> Path:
        """A copy of ``src`` (a folder of the store) in here, for a link to point at."""
        dst = self.path / name
        shutil.copytree(src, dst, symlinks=True)
        return dst

    def freeze(self) -> None:
        time.sleep(0.01)  # an access would show in a later mtime
        self.before = _snapshot(self.path)

    def check_untouched(self) -> None:
        assert _snapshot(self.path) == self.before


def _link_folder(root: Path, name: str, outside: Outside) -> None:
    """Replaces the store folder ``root/name`` by a link to a copy of it outside the root."""
    target = outside.copy_in(root / name, name.replace("/", "_"))
    shutil.rmtree(root / name)
    os.symlink(target, root / name)


def _ops(root: Path, split, params, *, key: str = "k") -> list[BaseException]:
    """Put, flush, get, delete, gc on the store at ``root``: the library errors they raise (any
    other error fails the test)."""
    errors: list[BaseException] = []

    def attempt(fn: Callable[[], Any]) -> Any:
        result, err, _ = _within(fn)
        if err is not None:
            assert isinstance(err, rs.ResidualStoreError), repr(err)
            errors.append(err)
        return result

    store = attempt(lambda: rs.Store(root))
    if store is None:
        return errors
    try:
        attempt(lambda: store.keys())
        attempt(lambda: store.get(key))
        attempt(lambda: (store.put(_ctx(split, params, 7), "new"), store.flush()))
        attempt(lambda: (store.put(_ctx(split, params, 8), key), store.flush()))
        attempt(lambda: (store.delete("new"), store.flush()))
        attempt(lambda: store.gc(older_than=0))
        attempt(lambda: (store.delete(key), store.flush()))
        attempt(lambda: store.gc(older_than=0))
    finally:
        attempt(store.close)
    return errors


@pytest.mark.parametrize("folder", ["data", "contexts", "weights", "backwards", "context_data"])
def test_a_linked_folder_is_never_followed(stored, tmp_path, split, params, folder):
    outside = Outside(tmp_path / "outside")
    name = os.path.relpath(stored.data_dir, stored.root) if folder == "context_data" else folder
    _link_folder(stored.root, name, outside)
    outside.freeze()
    errors = _ops(stored.root, split, params)
    outside.check_untouched()
    assert errors, "a store with a linked folder refused nothing"
    described = [f"{type(e).__name__}: {e}" for e in errors]
    # refusals are damage; a delete of the context whose put was refused finds no such key
    assert all(isinstance(e, (rs.CorruptContextError, rs.ContextNotFoundError)) for e in errors), described
    assert any(isinstance(e, rs.CorruptContextError) and "symbolic link" in str(e) for e in errors), described


def test_a_linked_store_root_is_the_users_choice(tmp_path, split, params):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    ctx = _ctx(split, params, 3)
    with rs.Store(tmp_path / "link") as store:
        store.put(ctx, "k")
        store.flush()
    with rs.Store(tmp_path / "link", read_only=True) as store:
        assert_contexts_identical(store.get("k"), ctx)
    assert (real / "contexts" / "k.manifest").is_file()


def _recycled_folder(root: Path, store: rs.Store, split, params) -> Path:
    """Puts and deletes a context so that its data folder waits under data/.free for reuse."""
    store.put(_ctx(split, params, 1), "a")
    store.flush()
    store.delete("a")
    store.flush()
    free = root / "data" / ".free"
    for _ in range(500):
        if free.is_dir() and os.listdir(free):
            break
        time.sleep(0.01)
    (recycled,) = [free / n for n in os.listdir(free)]
    return recycled


@pytest.mark.slow
@pytest.mark.parametrize("what", ["bundle", "group_metadata", "folder", "hard_link"])
def test_a_link_in_a_recycled_folder_is_never_written_through(tmp_path, split, params, what):
    """A symbolic link is never written through: the put that claims the tampered folder puts
    it aside (the link itself unlinked, never its target) and writes a fresh folder, so its
    flush succeeds and a planted link cannot stop any put; a hard link (its bytes shared with a
    file outside) is replaced, never written into."""
    root, outside = tmp_path / "store", Outside(tmp_path / "outside")
    with rs.Store(root) as store:
        recycled = _recycled_folder(root, store, split, params)
        assert sorted(p.name for p in recycled.iterdir()) == ["bundle.zip", "zarr.json"]
        if what in ("bundle", "group_metadata", "hard_link"):  # of the file's size, so an
            # in-place write of the same layout would take it
            planted = recycled / ("zarr.json" if what == "group_metadata" else "bundle.zip")
            (outside.path / "victim").write_bytes(b"\0" * planted.stat().st_size)
            planted.unlink()
            (os.link if what == "hard_link" else os.symlink)(outside.path / "victim", planted)
        else:
            target = outside.copy_in(recycled, "recycled")
            shutil.rmtree(recycled)
            os.symlink(target, recycled)
        outside.freeze()
        ctx = _ctx(split, params, 2)
        store.put(ctx, "b")  # claims the recycled folder
        _, err, _ = _within(store.flush)
        assert err is None, repr(err)
        if what == "hard_link":
            assert os.stat(outside.path / "victim").st_nlink == 1
        outside.check_untouched()
        assert not recycled.exists() and not os.path.islink(recycled)  # claimed, renamed away
        data_dir = root / read_manifest(root, "b")["data_dir"]
        assert data_dir.is_dir() and not data_dir.is_symlink()
        assert_contexts_identical(store.get("b"), ctx)
        store.put(ctx, "c")  # and the store goes on
        store.flush()
        assert_contexts_identical(store.get("c"), ctx)
        store.gc(older_than=0)
    with rs.Store(root, read_only=True) as store:
        got = store.get("b")
        assert_contexts_identical(got, ctx)
        x, y = mlp_batch(jax.random.fold_in(jax.random.key(1), 2), 2, SIZES)
        assert_trees_close(rs.backward(got), jax.grad(mlp_loss)(params, x, y), **F32_TOL)
    outside.check_untouched()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            assert not os.path.islink(os.path.join(dirpath, name)), os.path.join(dirpath, name)


def test_a_linked_weight_folder_is_replaced_by_the_next_put(stored, tmp_path, split, params):
    """A weight folder that is a link (nothing a store makes) is never read through, and a put
    that needs the weight replaces the link (never its target) with the real array."""
    outside = Outside(tmp_path / "outside")
    m = read_manifest(stored.root, "k")
    weight = stored.root / next(r["path"] for r in m["arrays"] if r["shared"])
    target = outside.copy_in(weight, "weight")
    shutil.rmtree(weight)
    os.symlink(target, weight)
    outside.freeze()
    with rs.Store(stored.root) as store:
        _refused(lambda: store.get("k"))
        store.put(stored.ctx, "k2")
        store.flush()
        assert not weight.is_symlink() and weight.is_dir()
    with rs.Store(stored.root, read_only=True) as store:
        assert_contexts_identical(store.get("k"), stored.ctx)
        assert_contexts_identical(store.get("k2"), stored.ctx)
    outside.check_untouched()
