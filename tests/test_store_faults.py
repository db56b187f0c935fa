"""rs.Store under faults: kill -9 mid-write, concurrent writer processes, a full disk, many
threads, and two writers of one key."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import jax
import numpy as np
import pytest

import residual_store as rs
from residual_store._src.store import backwards
from store_helpers import (
    F32_TOL,
    TESTS_DIR,
    assert_contexts_identical,
    assert_trees_close,
    children,
    committed_keys,
    ended_at_exit,
    init_params,
    last_json_line,
    mlp_batch,
    mlp_loss,
    own_bytes,
    popen_python,
    read_manifest,
    run_python,
    tree_files,
    write_script,
)

SIZES = (32, 64, 64, 8)


def _counts(removed: dict) -> dict:
    """What gc removed, by kind (without its "young" and "bytes" totals)."""
    return {k: v for k, v in removed.items() if k not in ("young", "bytes")}


@pytest.fixture(scope="module")
def split():
    return rs.split(mlp_loss)


class Model:
    """Fresh random weights and batches from one seed, made the same way in every process."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.params = init_params(jax.random.key(seed), SIZES)

    def batch(self, tag: int, batch: int):
        return mlp_batch(jax.random.fold_in(jax.random.key(self.seed + 1), tag), batch, SIZES)

    def ctx(self, split, tag: int, batch: int):
        return split(self.params, *self.batch(tag, batch))[1]

    def check(self, store, key, split, tag, batch):
        """The stored context equals the one this process computes for the same inputs, and its
        gradients equal jax.grad."""
        x, y = self.batch(tag, batch)
        got = store.get(key)
        assert_contexts_identical(got, split(self.params, x, y)[1])
        assert_trees_close(rs.backward(got), jax.grad(mlp_loss)(self.params, x, y), **F32_TOL)


@pytest.fixture
def model(rng):
    return Model(int(jax.random.randint(rng, (), 0, 2**30)))


# A writer process: puts contexts of the test model (it may import it; the reader in test_store
# must not). argv: tests dir, seed, store root, mode, and mode arguments.
WRITER = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
SEED = int(sys.argv[2])
import jax
import residual_store as rs
from store_helpers import init_params, mlp_batch, mlp_loss

SIZES = (32, 64, 64, 8)
root, mode = sys.argv[3], sys.argv[4]
fwd = rs.split(mlp_loss)
params = init_params(jax.random.key(SEED), SIZES)

def ctx(tag, batch):
    x, y = mlp_batch(jax.random.fold_in(jax.random.key(SEED + 1), tag), batch, SIZES)
    return fwd(params, x, y)[1]

def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.002)

if mode == "forever":  # put until killed
    ctx(0, 64)
    print("ready", flush=True)
    with rs.Store(root) as store:
        for i in range(100000):
            store.put(ctx(i, 64), f"k{i:05d}")
elif mode == "distinct":  # argv: writer id, count, go file
    wid, n, go = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
    contexts = [ctx(1000 * wid + i, 16) for i in range(n)]
    wait_for(go)
    with rs.Store(root) as store:
        for i, c in enumerate(contexts):
            store.put(c, f"w{wid}-{i:03d}")
    print(json.dumps({"done": n}))
elif mode == "same_key":  # argv: writer id, count, go file
    wid, n, go = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
    mine = ctx(5000 + wid, 16)
    wait_for(go)
    with rs.Store(root) as store:
        for i in range(n):
            store.put(mine, "shared")
            store.flush()
    print(json.dumps({"done": n}))
"""


def _writer(tmp_path):
    return write_script(tmp_path, "writer.py", WRITER)


# ----------------------------------------------------------------------------------------------
# kill -9


@pytest.mark.subprocess
def test_kill_9_mid_write_leaves_only_whole_contexts(tmp_path, split, model):
    root = tmp_path / "store"
    proc = popen_python(_writer(tmp_path), str(TESTS_DIR), str(model.seed), str(root), "forever")
    guard = threading.Timer(120, proc.kill)  # a hung writer cannot hang the suite
    guard.start()
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while len(committed_keys(root)) < 6:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the writer committed nothing"
            time.sleep(0.01)
        time.sleep(float(np.random.default_rng().uniform(0.0, 0.05)))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    visible = sorted(n for n in os.listdir(root / "contexts") if not n.startswith("."))
    assert all(n.endswith(".manifest") for n in visible)
    keys = committed_keys(root)
    assert len(keys) >= 6
    for (
        key
    ) in keys:  # every manifest is whole (plain msgpack decodes it, every array it names exists)
        manifest = read_manifest(root, key)
        assert manifest["key"] == key
        for record in manifest["arrays"]:  # in the bundle, or a folder of its own (a weight)
            assert (root / (manifest["bundle"]["path"] if "offset" in record else f"{record['path']}/zarr.json")).is_file()
    with rs.Store(root) as store:
        assert store.keys() == keys
        for key in keys:
            model.check(store, key, split, int(key[1:]), 64)
        store.gc(older_than=0)  # what the killed write left behind is unreferenced
        assert store.keys() == keys
        referenced = {read_manifest(root, k)["data_dir"].split("/")[1] for k in keys}
        assert set(children(root / "data")) == referenced
    with rs.Store(root, device_budget=0, host_budget=0) as store:
        for key in keys[-3:]:
            model.check(store, key, split, int(key[1:]), 64)


# ----------------------------------------------------------------------------------------------
# concurrent writer processes


@pytest.mark.subprocess
def test_two_writer_processes_with_distinct_keys(tmp_path, split, model):
    root, go, n = tmp_path / "store", tmp_path / "go", 12
    script = _writer(tmp_path)
    procs = [
        popen_python(
            script, str(TESTS_DIR), str(model.seed), str(root), "distinct", str(w), str(n), str(go)
        )
        for w in (1, 2)
    ]
    with ended_at_exit(procs):
        time.sleep(0.5)
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert last_json_line(out) == {"done": n}
    expected = [f"w{w}-{i:03d}" for w in (1, 2) for i in range(n)]
    with rs.Store(root) as store:
        assert store.keys() == expected
        for key in expected:
            w, i = int(key[1]), int(key[3:])
            model.check(store, key, split, 1000 * w + i, 16)
        assert _counts(store.gc(older_than=0)) == {"weights": 0, "data": 0, "recycled": 0, "backwards": 0, "temporary": 0}


# ----------------------------------------------------------------------------------------------
# disk full: one process runs three scenarios, each in its own store, under RLIMIT_FSIZE

DISK_FULL = """
import json, os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE fails with EFBIG instead
sys.path.insert(0, sys.argv[1])
SEED = int(sys.argv[2])
import jax
import residual_store as rs
from store_helpers import init_params, mlp_batch, mlp_loss

SIZES = (32, 64, 64, 8)
base = sys.argv[3]
fwd = rs.split(mlp_loss)
params = init_params(jax.random.key(SEED), SIZES)

def ctx(tag, batch):
    x, y = mlp_batch(jax.random.fold_in(jax.random.key(SEED + 1), tag), batch, SIZES)
    return fwd(params, x, y)[1]

class limited:
    def __init__(self, limit):
        self.limit = limit
    def __enter__(self):
        self.soft, self.hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.hard))
    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.soft, self.hard))

def attempt(store, c, key):
    store.put(c, key)
    try:
        store.flush()
        return {"error": None}
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err)}

small = [ctx(i, 4) for i in range(3)]
results = {}

# 1. a context too big for the disk, after three that fit
with rs.Store(os.path.join(base, "context")) as store:
    for i, c in enumerate(small):
        store.put(c, f"s{i}")
    store.flush()
    with limited(64 << 10):
        results["context"] = attempt(store, ctx(99, 2048), "big")
        store.put(ctx(3, 4), "after")  # the store still works
        store.flush()
import shutil
shutil.copytree(os.path.join(base, "context"), os.path.join(base, "kept_backward"))  # before any gc

# 2. a context that fits, of a new signature whose serialized backward does not: the disk is
# full (files over 4 KiB fail) only while the backward is written (the bundle of the context's
# residuals is one file larger than that, written just before on the same thread)
from residual_store._src.store import backwards
write_backward = backwards.write
def write_backward_on_a_full_disk(*args, **kwargs):
    with limited(4 << 10):
        return write_backward(*args, **kwargs)
with rs.Store(os.path.join(base, "backward")) as store:
    for i, c in enumerate(small):  # the weights are stored now
        store.put(c, f"s{i}")
    store.flush()
    backwards.write = write_backward_on_a_full_disk
    results["backward"] = attempt(store, ctx(7, 3), "extra")
    backwards.write = write_backward

# 3. two writers race to store the same weights; the late one then fails
root = os.path.join(base, "race")
late = rs.Store(root)  # opened first: knows no weights
with rs.Store(root) as first:
    first.put(small[0], "a")
# The race: `late` looked for the shared weights just before `first` committed them, so it
# writes them too; then its write fails (the disk fills up).
late._persistence.disk.backend.array_exists = lambda path: False
with limited(4 << 10):
    results["race"] = attempt(late, small[1], "b")
late.close()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def disk_full(tmp_path_factory):
    """Runs the three disk-full scenarios once; returns (folder, their results, the model)."""
    import random

    base = tmp_path_factory.mktemp("disk_full")
    model = Model(random.SystemRandom().randrange(2**30))
    script = write_script(base, "disk_full.py", DISK_FULL)
    results = last_json_line(run_python(script, str(TESTS_DIR), str(model.seed), str(base)).stdout)
    return base, results, model


@pytest.mark.subprocess
def test_internals_disk_full_raises_store_full_and_leaves_nothing(disk_full, split):
    base, results, model = disk_full
    result, root = results["context"], base / "context"
    assert result["error"] == "StoreFullError", result
    assert "'big'" in result["message"]

    files = tree_files(root)
    assert "contexts/big.manifest" not in files
    assert not any(f.startswith("data/big.") for f in files), sorted(files)
    assert not any(".tmp" in f for f in files), sorted(files)
    assert max(files.values()) <= 64 << 10
    with rs.Store(root) as store:
        assert store.keys() == ["after", "s0", "s1", "s2"]
        for key, tag in (("s0", 0), ("s1", 1), ("s2", 2), ("after", 3)):
            model.check(store, key, split, tag, 4)
        # no bytes of the failed write: only the backward its put saved, which no context needs
        assert _counts(store.gc(older_than=0)) == {"weights": 0, "data": 0, "recycled": 0, "backwards": 1, "temporary": 0}


_WITHOUT_MODEL = """
import sys, jax, numpy as np, residual_store as rs
root, key, out = sys.argv[1:4]
with rs.Store(root, read_only=True) as store:
    grads = rs.backward(store.get(key))  # no split here: the stored backward
leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
np.savez(out, **{jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves})
"""


@pytest.mark.subprocess
def test_internals_a_put_that_failed_on_a_full_disk_keeps_its_valid_backward_for_later_contexts(disk_full, split, tmp_path):
    """The backward a put saved before its context failed to fit stays (docs/format.md says
    why: it is complete and verified, other writers may rely on it, gc removes it once no
    context has its signature). It verifies, a later put of the signature uses it as it is (not
    rewritten), and a process without the model runs it: jax.grad's gradients."""
    base, results, model = disk_full
    root = base / "kept_backward"  # the store right after the failed put, before any gc
    big = model.ctx(split, 99, 2048)
    sig = big.spec.signature
    paths = sorted(f for f in tree_files(root) if sig in f)
    assert paths == [f"backwards/{sig}.export", f"backwards/{sig}.manifest"], paths
    before = {p: (root / p).read_bytes() for p in paths}
    with rs.Store(root) as store:
        assert "big" not in store.keys()
        assert backwards.read(store._persistence.disk, sig) is not None  # size and checksum verified
        store.put(big, "big")
        store.flush()
    assert {p: (root / p).read_bytes() for p in paths} == before
    out = tmp_path / "grads.npz"
    run_python(write_script(tmp_path, "without_model.py", _WITHOUT_MODEL), str(root), "big", str(out))
    got = np.load(out)
    want = jax.tree_util.tree_flatten_with_path(jax.grad(mlp_loss)(model.params, *model.batch(99, 2048)))[0]
    assert sorted(got.files) == sorted(jax.tree_util.keystr(p) for p, _ in want)
    for p, v in want:
        np.testing.assert_allclose(got[jax.tree_util.keystr(p)], np.asarray(v), **F32_TOL)


@pytest.mark.subprocess
def test_internals_disk_full_while_saving_the_backward_is_store_full(disk_full, split):
    base, results, model = disk_full
    result, root = results["backward"], base / "backward"
    assert result["error"] == "StoreFullError", result
    files = tree_files(root)
    assert not any(".tmp" in f for f in files), sorted(files)
    signature = model.ctx(split, 7, 3).spec.signature
    assert not any(signature in f for f in files), sorted(files)  # no partial backward either
    assert sum(1 for f in files if f.startswith("backwards/")) == 2  # the small contexts' backward
    with rs.Store(root) as store:
        assert store.keys() == [
            "extra",
            "s0",
            "s1",
            "s2",
        ]  # the context itself fit, its backward did not
        model.check(store, "extra", split, 7, 3)
        for i in range(3):
            model.check(store, f"s{i}", split, i, 4)


@pytest.mark.subprocess
def test_internals_a_failed_write_of_shared_weights_never_damages_a_committed_context(disk_full, split):
    """A writer that races another to store the same weights, then fails, must leave the other
    writer's committed context intact (weights are never rewritten in place)."""
    base, results, model = disk_full
    assert results["race"]["error"] == "StoreFullError", results["race"]
    with rs.Store(base / "race") as store:
        assert store.keys() == ["a"]
        model.check(store, "a", split, 0, 4)
        assert _counts(store.gc(older_than=0)) == {"weights": 0, "data": 0, "recycled": 0, "backwards": 0, "temporary": 0}


# ----------------------------------------------------------------------------------------------
# threads


@pytest.mark.slow
@pytest.mark.parametrize("write_through", [True, False])
def test_many_threads_putting_and_getting(tmp_path, split, model, write_through):
    params = model.params
    n_threads, per_thread = 8, 6
    contexts = {
        f"t{t}-{i}": split(params, *model.batch(100 * t + i, 8))[1]
        for t in range(n_threads)
        for i in range(per_thread)
    }
    size = own_bytes(next(iter(contexts.values())))
    store = rs.Store(
        tmp_path / "s", device_budget=3 * size, host_budget=3 * size, write_through=write_through
    )

    def work(t):
        mine = [f"t{t}-{i}" for i in range(per_thread)]
        for round_ in range(2):
            for i, key in enumerate(mine):
                store.put(contexts[key], key)
                back = mine[(i * 5 + round_) % (i + 1)]  # some earlier key of this thread
                assert_contexts_identical(store.get(back), contexts[back])
                if i % 3 == 2:
                    store.prefetch(mine[0])
            for key in mine[::2]:
                assert_contexts_identical(store.pop(key), contexts[key])
            for key in mine[1::2]:
                assert_contexts_identical(store.get(key), contexts[key])
        return t

    try:
        with concurrent.futures.ThreadPoolExecutor(n_threads) as pool:
            assert sorted(pool.map(work, range(n_threads))) == list(range(n_threads))
        expected = sorted(f"t{t}-{i}" for t in range(n_threads) for i in range(1, per_thread, 2))
        assert store.keys() == expected
        for key in expected:
            assert_contexts_identical(store.get(key), contexts[key])
        store.flush()
        stats = store.stats()
        assert stats["device"]["bytes"] <= 3 * size and stats["host"]["bytes"] <= 3 * size
    finally:
        store.close()
    with rs.Store(tmp_path / "s") as other:
        on_disk = other.keys()
        if write_through:
            assert on_disk == expected
        assert set(on_disk) <= set(expected)
        for key in on_disk:
            assert_contexts_identical(other.get(key), contexts[key])
    x, y = model.batch(101, 8)
    assert_trees_close(rs.backward(contexts["t1-1"]), jax.grad(mlp_loss)(params, x, y), **F32_TOL)


@pytest.mark.parametrize("write_through", [True, False])
def test_put_while_a_get_of_the_same_key_reads_the_disk(tmp_path, split, model, write_through):
    """The newer context wins: a get that read the old one from disk may return it, but must not
    put it back in memory over the newer one (nor mark the key as already on disk)."""
    params = model.params
    old, new, other = (split(params, *model.batch(tag, 8))[1] for tag in (40, 41, 42))
    size = own_bytes(old)
    with rs.Store(tmp_path / "s") as first:
        first.put(old, "k")
    store = rs.Store(tmp_path / "s", device_budget=size, host_budget=0, write_through=write_through)
    reading, release = threading.Event(), threading.Event()
    read = store._persistence.disk.read  # hold the disk read of "k" until the put below is done

    def slow_read(key, **kwargs):
        result = read(key, **kwargs)
        reading.set()
        assert release.wait(30)
        return result

    store._persistence.disk.read = slow_read
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(store.get, "k")
            assert reading.wait(30)
            store.put(new, "k")
            release.set()
            got = pending.result(timeout=30)
        candidates = {0: old, 1: new}
        assert_contexts_identical(got, candidates[_which(got, candidates)])  # either, whole
        assert_contexts_identical(store.get("k"), new)
        store.put(other, "o")  # pushes "k" out of memory: to disk unless already there
        store.flush()
        assert_contexts_identical(store.get("k"), new)
    finally:
        store.close()
    with rs.Store(tmp_path / "s") as reader:
        assert_contexts_identical(reader.get("k"), new)


# ----------------------------------------------------------------------------------------------
# two writers, one key


def _which(ctx, candidates):
    """Which candidate's batch ``ctx`` holds (by its input x)."""
    i = ctx.spec.input_paths.index("x")
    which = [
        w
        for w, c in candidates.items()
        if np.array_equal(np.asarray(ctx.residuals[i]), np.asarray(c.residuals[i]))
    ]
    assert len(which) == 1
    return which[0]


@pytest.mark.subprocess
def test_two_writers_of_one_key_reader_sees_one_whole_context(tmp_path, split, model):
    root, go, n = tmp_path / "store", tmp_path / "go", 25
    params = model.params
    candidates = {w: split(params, *model.batch(5000 + w, 16))[1] for w in (1, 2)}
    script = _writer(tmp_path)
    procs = [
        popen_python(
            script, str(TESTS_DIR), str(model.seed), str(root), "same_key", str(w), str(n), str(go)
        )
        for w in (1, 2)
    ]
    seen = {1: 0, 2: 0}
    errors = []
    with ended_at_exit(procs):
        time.sleep(0.5)
        go.touch()
        deadline = time.monotonic() + 120
        with rs.Store(root, device_budget=0, host_budget=0) as reader:  # every get reads the disk
            while any(p.poll() is None for p in procs) or sum(seen.values()) == 0:
                assert time.monotonic() < deadline, "the writers did not finish"
                try:
                    got = reader.get("shared")
                except rs.ContextNotFoundError:
                    continue  # not yet committed by either
                except rs.CorruptContextError as err:
                    errors.append(str(err))
                    continue
                w = _which(got, candidates)
                assert_contexts_identical(got, candidates[w])  # never a mix
                seen[w] += 1
        outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert errors == [], errors[:3]
    assert sum(seen.values()) > 0
    with rs.Store(root) as store:
        assert store.keys() == ["shared"]
        w = _which(store.get("shared"), candidates)
        model.check(store, "shared", split, 5000 + w, 16)
        store.gc(older_than=0)
        # replaced data is gone (or kept for reuse in data/.free)
        assert len(children(root / "data")) == 1
