"""Looking at a store tells damage it can see: a file a manifest names that is missing or of
another size than the manifest says shows in ``info``, ``ls`` and ``inspect`` (one ``stat`` per
file, nothing read), ``verify`` names the damaged file once and says what to do next, and a
folder of the tree that is a symbolic link is reported by ``Store.verify``, not raised."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from residual_store import cli
from store_helpers import read_manifest, wait_for


def _fill(path: str, keys=("good", "bad")) -> dict[str, rs.ResidualContext]:
    """A store at ``path``: one context per key (a shared weight, an input, intermediates)."""
    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w[0]) @ w[1]))
    w = jax.random.normal(jax.random.key(0), (3, 2)), jax.random.normal(jax.random.key(9), (2, 2))
    contexts = {k: fwd(w, jax.random.normal(jax.random.key(i + 1), (4, 3)))[1] for i, k in enumerate(keys)}
    with rs.Store(path) as store:
        for key, ctx in contexts.items():
            store.put(ctx, key)
    return contexts


def _truncate_bundle(root: str, key: str) -> tuple[str, int]:
    """Cuts ``key``'s bundle to half its size; its path in the store, and its full size."""
    rel = read_manifest(root, key)["bundle"]["path"]
    full = os.path.getsize(os.path.join(root, rel))
    os.truncate(os.path.join(root, rel), full // 2)
    return rel, full


def _run(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    status = cli.main(list(argv))
    return status, capsys.readouterr().out


@pytest.fixture
def truncated(tmp_path):
    root = str(tmp_path / "store")
    _fill(root)
    rel, full = _truncate_bundle(root, "bad")
    return root, rel, full


def test_ls_exits_1_and_marks_a_context_whose_bundle_is_truncated(truncated, capsys):
    root, rel, full = truncated
    status, out = _run(capsys, "ls", root)
    assert status == 1, out
    bad_row = next(line for line in out.splitlines() if line.startswith("bad "))
    good_row = next(line for line in out.splitlines() if line.startswith("good "))
    assert bad_row.rstrip().endswith("DAMAGED") and "DAMAGED" not in good_row
    assert "2 contexts, 1 damaged" in out
    assert f"DAMAGED bad: bundle {rel} is truncated ({full // 2:,} bytes on disk, the manifest says {full:,})" in out
    assert f"residual-store rm {root} bad" in out
    status, out = _run(capsys, "ls", root, "--json")
    entries = {e["key"]: e for e in json.loads(out)}
    assert status == 1 and "truncated" in entries["bad"]["error"] and "error" not in entries["good"]
    assert entries["bad"]["residuals"] == entries["good"]["residuals"] == 4  # its record is still listed


def test_inspect_shows_the_damage_and_exits_1(truncated, capsys):
    root, rel, _ = truncated
    status, out = _run(capsys, "inspect", root, "bad")
    assert status == 1
    assert f"DAMAGED bad: bundle {rel} is truncated" in out and "input x" in out  # and the residuals' rows
    status, out = _run(capsys, "inspect", root, "bad", "--json")
    assert status == 1 and json.loads(out)["damage"].startswith(f"bundle {rel} is truncated")
    status, out = _run(capsys, "inspect", root, "good", "--json")
    assert status == 0 and json.loads(out)["damage"] is None


def test_info_reports_what_a_stat_shows(truncated):
    root, rel, _ = truncated
    with rs.Store(root, read_only=True) as store:
        assert store.info("good").damage is None
        assert store.info("bad").damage.startswith(f"bundle {rel} is truncated")
        with pytest.raises(rs.CorruptContextError, match="truncated"):  # what get says too
            store.arrays("bad")


def test_verify_names_the_damaged_file_once_and_says_what_to_do(truncated, capsys):
    root, rel, full = truncated
    status, out = _run(capsys, "verify", root)
    assert status == 1
    assert out.count("bundle.zip") == 1 and "chunk file" not in out, out
    assert f"DAMAGED bad: bundle {rel} is truncated ({full // 2:,} bytes on disk, the manifest says {full:,})" in out
    assert f"next: `residual-store rm {root} bad` removes it" in out and "restore the checkpoint step" in out
    report = json.loads(_run(capsys, "verify", root, "--json")[1])
    assert [d["key"] for d in report["damaged"]] == ["bad"] and report["next"]
    # what the words say works: rm, and the store verifies again
    assert _run(capsys, "rm", root, "bad")[0] == 0
    assert _run(capsys, "verify", root)[0] == 0 and _run(capsys, "ls", root)[0] == 0


@pytest.mark.parametrize("damage", ["missing", "longer"])
def test_a_missing_or_longer_bundle_shows_in_ls(tmp_path, capsys, damage):
    root = str(tmp_path / "store")
    _fill(root)
    p = os.path.join(root, read_manifest(root, "bad")["bundle"]["path"])
    if damage == "missing":
        os.remove(p)
    else:
        with open(p, "ab") as f:
            f.write(b"\0")
    status, out = _run(capsys, "ls", root)
    assert status == 1 and ("is missing" if damage == "missing" else "is too long") in out, out
    with rs.Store(root, read_only=True) as store:
        assert store.verify().damaged.keys() == {"bad"}


def test_a_truncated_weight_damages_every_context_holding_it(tmp_path, capsys):
    """A file outside the bundle (a shared weight's chunk): its size is what its shape and dtype
    make it."""
    root = str(tmp_path / "store")
    _fill(root)
    weight = next(r for r in read_manifest(root, "good")["arrays"] if r["shared"])
    chunk = os.path.join(root, weight["path"], "c.0.0")
    os.truncate(chunk, 5)
    status, out = _run(capsys, "ls", root)
    assert status == 1 and "2 contexts, 2 damaged" in out
    assert f"residual 0 ({weight['name']}): file {weight['path']}/c.0.0 is truncated (5 bytes on disk" in out


def test_an_intact_store_shows_nothing(tmp_path, capsys):
    root = str(tmp_path / "store")
    contexts = _fill(root)
    status, out = _run(capsys, "ls", root)
    assert status == 0 and "DAMAGED" not in out and "next:" not in out
    with rs.Store(root, read_only=True) as store:
        assert all(store.info(k).damage is None for k in contexts)
        np.testing.assert_array_equal(store.arrays("bad")[1], np.asarray(contexts["bad"].residuals[1]))


def test_verify_reports_a_backwards_folder_that_is_a_link(tmp_path, capsys):
    root = str(tmp_path / "store")
    _fill(root)
    real = str(tmp_path / "elsewhere")
    shutil.move(os.path.join(root, "backwards"), real)
    os.symlink(real, os.path.join(root, "backwards"))
    with rs.Store(root, read_only=True) as store:
        report = store.verify()  # damage is reported, not raised
    assert not report.ok and report.verified == 2 and report.damaged == {}
    assert list(report.damaged_folders) == ["backwards"] and "symbolic link" in report.damaged_folders["backwards"]
    status, out = _run(capsys, "verify", root)
    assert status == 1 and "DAMAGED folder backwards" in out and "replace the link backwards" in out
    assert os.path.islink(os.path.join(root, "backwards")) and os.listdir(real)  # nothing changed


def test_internals_a_context_replaced_while_looked_at_is_not_called_damaged(tmp_path):
    """The look at the sizes runs on a manifest that may be replaced under it (its old files
    removed or recycled): only damage seen on a manifest that stayed the same is reported."""
    from residual_store._src.store import inspection
    from residual_store._src.store.disk.damage import size_damage

    root = str(tmp_path / "store")
    contexts = _fill(root, keys=("k", "other"))
    with rs.Store(root) as store:
        disk = store._persistence.disk
        old = disk.stat("k")
        store.put(contexts["other"], "k")  # a new data folder; the old one recycled
        store.flush()
        # the old folder is recycled by the store's janitor, after the write (flush does not wait)
        wait_for(lambda: not os.path.exists(os.path.join(root, old.bundle.path)), "the old bundle's removal")
        assert size_damage(disk.backend, old) is not None  # the old manifest's files are gone
        looks = iter([old])
        real_stat = disk.stat
        disk.stat = lambda key: next(looks, None) or real_stat(key)  # the first look: the old manifest
        try:
            stored, damage = inspection._sized_stat(disk, "k")
        finally:
            del disk.stat
        assert damage is None and stored.data_dir != old.data_dir


# -- one wording everywhere (issue 45, item 5) -------------------------------------------------


def test_every_read_says_the_damage_as_ls_says_it(truncated, capsys):
    """``get``, ``arrays``, ``verify`` and the command line's ``export`` and ``diff`` name the
    truncated bundle once, by its path in the store, in the words of ``ls``, with the next step."""
    root, rel, full = truncated
    words = f"bundle {rel} is truncated ({full // 2:,} bytes on disk, the manifest says {full:,})"
    with rs.Store(root) as store:
        for read in (store.get, store.arrays):
            with pytest.raises(rs.CorruptContextError) as info:
                read("bad")
            said = str(info.value)
            assert said.startswith(f"context 'bad' is damaged: {words}. Next: store.delete('bad') removes it")
            assert said.count("bundle.zip") == 1 and root not in said and "chunk file" not in said
            assert (info.value.key, info.value.damage) == ("bad", words)
        assert store.verify().damaged == {"bad": words}
    for argv in (("export", root, "bad", "-o", os.path.join(root, "..", "bad.npz")), ("diff", root, "good", "bad")):
        status, out = _run(capsys, *argv)
        assert status == 1, (argv, out)
        assert out.splitlines() == [
            f"DAMAGED bad: {words}",
            f"next: `residual-store verify {root}` checks every byte; `residual-store rm {root} bad` removes it "
            "(`residual-store gc` then frees its files); or restore the checkpoint step that saved it, or put it again",
        ]


def test_a_truncated_stored_backward_is_damaged_in_ls_and_inspect(tmp_path, capsys):
    root = str(tmp_path / "store")
    _fill(root)
    [export] = [os.path.join(root, "backwards", f) for f in os.listdir(os.path.join(root, "backwards"))
                if f.endswith(".export")]
    full = os.path.getsize(export)
    os.truncate(export, full - 100)
    rel = os.path.relpath(export, root)
    with rs.Store(root, read_only=True) as store:
        info = store.backward_info(store.info("good").signature)
    assert not info.stored and info.damaged
    assert info.reason == f"damaged: its export {rel} is truncated ({full - 100:,} bytes on disk, the manifest says {full:,})"
    for argv in (("ls", root), ("inspect", root, "good")):
        status, out = _run(capsys, *argv)
        assert status == 1 and f"DAMAGED (its export {rel} is truncated ({full - 100:,} bytes on disk" in out, out
        assert f"next: `residual-store gc {root} --older-than 0` removes a damaged stored backward" in out
    status, out = _run(capsys, "verify", root)
    assert status == 1 and "DAMAGED backward" in out


def test_a_damaged_store_marker_says_the_way_back_and_the_way_back_works(tmp_path, capsys):
    root = str(tmp_path / "store")
    _fill(root)
    marker = os.path.join(root, "residual-store.json")
    with open(marker, "w") as f:
        f.write("garbage")
    with pytest.raises(rs.CorruptContextError, match="write the file residual-store.json again") as info:
        rs.Store(root, read_only=True)
    assert info.value.key is None
    status, out = _run(capsys, "ls", root)
    assert status == 1 and out.startswith("DAMAGED store: ") and out.count(root) == 1, out
    line = '{"format": "residual-store", "version": 2}'
    assert f"the one line {line}" in out
    with open(marker, "w") as f:  # the way back the message gives
        f.write(line + "\n")
    status, out = _run(capsys, "verify", root)
    assert status == 0 and "2 of 2 contexts verified" in out


def test_du_names_the_unreadable_manifest(tmp_path, capsys):
    root = str(tmp_path / "store")
    _fill(root)
    with open(os.path.join(root, "contexts", "bad.manifest"), "r+b") as f:
        f.truncate(20)
    status, out = _run(capsys, "du", root)
    assert status == 1 and "DAMAGED bad: manifest contexts/bad.manifest: " in out, out
    assert f"`residual-store rm {root} bad`" in out
    assert "a weight that contexts of several signatures hold is counted under the first of them" in out
    with rs.Store(root, read_only=True) as store:
        usage = store.usage()
    assert usage.unreadable == 1 and list(usage.unreadable_manifests) == ["bad"]
