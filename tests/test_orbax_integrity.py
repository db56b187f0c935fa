"""An Orbax step's contexts item holds what its save recorded, or says what it does not
(``residual_store.orbax``, issue 36 §2): the record written in the step's commit (keys, each
manifest's checksum, the step folder) is compared by a restore, which raises
``CorruptContextError``, and by ``verify``, which reports each key missing, foreign or changed
(and raises for an item with no record, or another step's). A manifest removed, another step's
item or manifest copied in, a context added, part of the item deleted, a process killed while
``max_to_keep`` deletes the step: never a smaller or another step's store handed over as whole."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import residual_store as rs
from libraries import BATCH, IN, OUT, flat, make_plain
from residual_store import cli
from residual_store import orbax as rso
from store_helpers import python_env, read_manifest, write_script

LOSS, PARAMS = make_plain()
FWD = rs.split(LOSS)
RECORD = "item-record.json"  # the item's record, beside the store marker


def _batches(rng: jax.Array, n: int) -> dict[str, tuple[jax.Array, jax.Array]]:
    """``n`` fresh microbatches ``(x, y)`` by key."""
    keys = jax.random.split(rng, 2 * n)
    return {
        f"mb{i}": (jax.random.normal(keys[2 * i], (BATCH, IN)), jax.random.normal(keys[2 * i + 1], (BATCH, OUT)))
        for i in range(n)
    }


def _save_steps(directory, rng: jax.Array, steps=(1, 2), n: int = 3, **options) -> dict[int, dict]:
    """Saves ``steps``, each with ``n`` contexts of fresh batches beside the state; returns the
    batches of each step."""
    batches = {step: _batches(r, n) for step, r in zip(steps, jax.random.split(rng, len(steps)))}
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(**options)) as mngr:
        for step in steps:
            contexts = {key: FWD(PARAMS, x, y)[1] for key, (x, y) in batches[step].items()}
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(PARAMS), contexts=rso.ContextsSave(contexts)))
        mngr.wait_until_finished()
    return batches


def _restore(directory, step: int) -> rs.Store:
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
        return mngr.restore(step, args=ocp.args.Composite(contexts=rso.ContextsRestore())).contexts


def _assert_gradients(store: rs.Store, batches: dict) -> None:
    """Every context of ``store`` is one of ``batches``, and its backward equals ``jax.grad``."""
    assert store.keys() == sorted(batches)
    for key, (x, y) in batches.items():
        got, want = flat(rs.backward(store.get(key))), flat(jax.grad(LOSS)(PARAMS, x, y))
        assert list(got) == list(want)
        for path in want:
            np.testing.assert_allclose(np.asarray(got[path]), np.asarray(want[path]), rtol=1e-5, atol=1e-6)


def _verify(item) -> rs.VerifyReport:
    with rs.Store(item, read_only=True) as store:
        return store.verify()


def _item(directory, step: int) -> str:
    return os.path.join(directory, str(step), "contexts")


# -- the record -------------------------------------------------------------------------------


def test_a_restored_step_holds_what_its_record_lists_and_gives_the_gradients_of_jax_grad(tmp_path, rng, capsys):
    batches = _save_steps(tmp_path, rng)
    with _restore(tmp_path, 2) as store:
        _assert_gradients(store, batches[2])
        assert store.verify().ok
    with open(os.path.join(_item(tmp_path, 2), RECORD)) as f:
        record = json.load(f)
    assert record["step"] == "2" and sorted(record["manifests"]) == sorted(batches[2])
    assert cli.main(["verify", _item(tmp_path, 2)]) == 0
    assert "3 of 3 contexts verified" in capsys.readouterr().out


def test_the_record_is_written_inside_the_steps_commit(tmp_path, rng, monkeypatch):
    """The record is in the item's temporary folder before Orbax renames the step into place."""
    seen = []
    write = rso._write

    def write_and_look(path, snapshot):
        write(path, snapshot)
        seen.append((os.path.basename(os.path.dirname(path)), os.path.exists(os.path.join(path, RECORD)), sorted(os.listdir(tmp_path))))

    monkeypatch.setattr(rso, "_write", write_and_look)
    batches = _save_steps(tmp_path, rng, steps=(0,), n=2)
    [(step_folder, recorded, committed)] = seen
    assert step_folder.startswith("0" + ocp.path.step.TMP_DIR_SUFFIX) and recorded and "0" not in committed
    with _restore(tmp_path, 0) as store:
        _assert_gradients(store, batches[0])


# -- edits of a committed step ----------------------------------------------------------------


def test_a_manifest_removed_from_a_committed_step_is_named_missing(tmp_path, rng, capsys):
    batches = _save_steps(tmp_path, rng, steps=(0,))
    item = _item(tmp_path, 0)
    os.remove(os.path.join(item, "contexts", "mb1.manifest"))
    with pytest.raises(rs.CorruptContextError, match=r"'mb1' missing"):
        _restore(tmp_path, 0)
    report = _verify(item)
    assert not report.ok and report.verified == 2 and list(report.damaged) == ["mb1"]
    assert report.damaged["mb1"].startswith("missing")
    assert cli.main(["verify", item]) == 1
    assert "DAMAGED mb1: missing" in capsys.readouterr().out
    with rs.Store(item, read_only=True) as store:  # the others are intact, read as they are
        _assert_gradients(store, {k: v for k, v in batches[0].items() if k != "mb1"})


def test_another_steps_item_copied_into_a_step_is_refused_naming_both_steps(tmp_path, rng, capsys):
    batches = _save_steps(tmp_path, rng)
    shutil.rmtree(_item(tmp_path, 2))
    shutil.copytree(_item(tmp_path, 1), _item(tmp_path, 2))
    with pytest.raises(rs.CorruptContextError, match=r"saved in step folder '1', not those of step '2'"):
        _restore(tmp_path, 2)
    with pytest.raises(rs.CorruptContextError, match=r"step folder '1'"):
        _verify(_item(tmp_path, 2))
    assert cli.main(["verify", _item(tmp_path, 2)]) == 1
    assert "step folder '1'" in capsys.readouterr().out
    with _restore(tmp_path, 1) as store:  # step 1 itself is intact
        _assert_gradients(store, batches[1])
    copy = tmp_path / "look" / "contexts"  # an item copied out of its step, to look at: intact
    shutil.copytree(_item(tmp_path, 1), copy)
    assert _verify(copy).ok


def test_a_manifest_copied_from_another_step_is_named_changed(tmp_path, rng):
    _save_steps(tmp_path, rng)
    source, target = _item(tmp_path, 1), _item(tmp_path, 2)
    data_dir = read_manifest(source, "mb0")["data_dir"]  # its arrays come along: it reads whole
    shutil.copytree(os.path.join(source, data_dir), os.path.join(target, data_dir))
    shutil.copy(os.path.join(source, "contexts", "mb0.manifest"), os.path.join(target, "contexts", "mb0.manifest"))
    with pytest.raises(rs.CorruptContextError, match=r"'mb0' its manifest is not the one step '2' saved"):
        _restore(tmp_path, 2)
    report = _verify(target)
    assert report.verified == 2 and list(report.damaged) == ["mb0"]
    assert "not the one step '2' saved" in report.damaged["mb0"]


def test_a_context_added_to_a_committed_item_is_named_foreign(tmp_path, rng):
    batches = _save_steps(tmp_path, rng, steps=(0,), n=2)
    item = _item(tmp_path, 0)
    with rs.Store(item) as store:
        store.put(FWD(PARAMS, *batches[0]["mb0"])[1], "mb9")
    with pytest.raises(rs.CorruptContextError, match=r"'mb9' foreign"):
        _restore(tmp_path, 0)
    report = _verify(item)
    assert report.verified == 2 and list(report.damaged) == ["mb9"]
    assert report.damaged["mb9"].startswith("foreign")


def _data_files(item: str, folder: str) -> list[str]:
    """The chunk and bundle files under ``folder`` of ``item`` (not zarr's metadata)."""
    return sorted(
        os.path.join(d, f) for d, _, files in os.walk(os.path.join(item, folder)) for f in files if f != "zarr.json"
    )


@pytest.mark.parametrize("folder", ["weights", "data", "backwards"])
def test_a_data_file_removed_from_a_committed_step_is_refused_at_the_restore(tmp_path, rng, folder):
    """A delete walks the folder in no set order: it can take a shared weight's file, a
    context's own, or the stored backward, before any manifest. The restore looks at every
    file's size and reads the backwards, and names what is lost, instead of handing back a store
    whose gets or backwards fail."""
    _save_steps(tmp_path, rng, steps=(0,), n=2)
    item = _item(tmp_path, 0)
    for gone in _data_files(item, folder):
        with open(gone, "rb") as f:
            kept = f.read()
        os.remove(gone)
        relative = os.path.relpath(gone, item)
        lost = "its stored backward .* is not whole" if folder == "backwards" else "its data is not whole: .*" + re.escape(relative)
        with pytest.raises(rs.CorruptContextError, match=rf"step '0'.*'mb\d' {lost}"):
            _restore(tmp_path, 0)
        with open(gone, "wb") as f:  # back as it was: the next file's loss is named alone
            f.write(kept)
    with _restore(tmp_path, 0) as store:
        assert store.keys() == ["mb0", "mb1"]


# -- part of the item deleted -----------------------------------------------------------------

PARTS = {
    "the record": [RECORD],
    "every manifest": ["contexts"],
    "the record and every manifest": [RECORD, "contexts"],
    "the store marker": ["residual-store.json"],
    "every file, its folders left": None,  # Orbax's parallel delete unlinks files, then folders
}


@pytest.mark.parametrize("part", list(PARTS))
def test_a_partly_deleted_item_is_reported_never_an_empty_success(tmp_path, rng, part, capsys):
    _save_steps(tmp_path, rng, steps=(0,), n=2)
    item = _item(tmp_path, 0)
    for name in PARTS[part] or [os.path.join(d, f) for d, _, files in os.walk(item) for f in files]:
        path = os.path.join(item, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    with pytest.raises(rs.CorruptContextError, match="step '0'|sealed store"):
        _restore(tmp_path, 0)
    assert cli.main(["verify", item]) != 0
    if PARTS[part] == ["contexts"]:  # the record stands: it names each context lost
        report = _verify(item)
        assert report.verified == 0 and sorted(report.damaged) == ["mb0", "mb1"]
        assert all(why.startswith("missing") for why in report.damaged.values())
    elif os.path.exists(os.path.join(item, "residual-store.json")):  # the marker names a record
        with pytest.raises(rs.CorruptContextError, match="record"):
            _verify(item)


def test_another_steps_record_copied_in_is_refused(tmp_path, rng):
    _save_steps(tmp_path, rng)
    shutil.copy(os.path.join(_item(tmp_path, 1), RECORD), os.path.join(_item(tmp_path, 2), RECORD))
    with pytest.raises(rs.CorruptContextError, match="not the record this store was sealed with"):
        _restore(tmp_path, 2)
    with pytest.raises(rs.CorruptContextError, match="not the record this store was sealed with"):
        _verify(_item(tmp_path, 2))


# -- a process killed while max_to_keep deletes a step ----------------------------------------

KILLED = """
    import os, signal, sys
    import jax, orbax.checkpoint as ocp
    import residual_store as rs
    from residual_store import orbax as rso
    sys.path.insert(0, sys.argv[4])
    from test_orbax_integrity import FWD, PARAMS, _batches

    directory, trigger, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    oldest = os.path.join(os.path.realpath(directory), "0") + os.sep
    unlink, unlinked = os.unlink, []

    def killing_unlink(path, *, dir_fd=None):
        # (shutil.rmtree unlinks names relative to an open folder, Orbax's threads whole paths)
        folder = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else ""
        full = os.path.join(folder, os.fspath(path))
        unlink(path, dir_fd=dir_fd)
        if full.startswith(oldest):
            unlinked.append(full)
            if full.endswith(trigger) if not trigger.isdigit() else len(unlinked) == int(trigger):
                os.kill(os.getpid(), signal.SIGKILL)  # kill -9, in the middle of the delete

    options = ocp.CheckpointManagerOptions(max_to_keep=1)
    with ocp.CheckpointManager(directory, options=options) as mngr:
        for step, rng in enumerate(jax.random.split(jax.random.key(seed), 2)):
            contexts = {k: FWD(PARAMS, x, y)[1] for k, (x, y) in _batches(rng, 3).items()}
            if step == 1:
                os.unlink = killing_unlink  # step 0 is committed; its delete comes after step 1's
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(PARAMS),
                                                    contexts=rso.ContextsSave(contexts)))
        mngr.wait_until_finished()
    print("the delete completed", len(unlinked), flush=True)
"""


def _killed_in_the_delete(tmp_path, trigger: str, seed: int) -> subprocess.CompletedProcess[str]:
    """Runs a process that saves steps 0 and 1 (``max_to_keep=1``) and kills itself with
    SIGKILL right after the retention delete of step 0 unlinks the file ending in ``trigger``
    (or its ``trigger``-th file, for digits)."""
    script = write_script(tmp_path, "killed.py", KILLED)
    args = [sys.executable, script, str(tmp_path / "ckpt"), trigger, str(seed), os.path.dirname(__file__)]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=python_env(), check=False)


def _step_one_is_whole(directory, seed: int) -> None:
    rngs = jax.random.split(jax.random.key(seed), 2)
    with _restore(directory, 1) as store:
        _assert_gradients(store, _batches(rngs[1], 3))


TRIGGERS = {
    "a manifest": "/contexts/contexts/mb1.manifest",
    "the record": "/contexts/" + RECORD,
    "the store marker": "/contexts/residual-store.json",
}


@pytest.mark.subprocess
@pytest.mark.parametrize("deleted", list(TRIGGERS))
def test_a_process_killed_while_max_to_keep_deletes_a_step_leaves_it_refused(tmp_path, deleted):
    proc = _killed_in_the_delete(tmp_path, TRIGGERS[deleted], seed=11)
    assert proc.returncode == -9, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    directory = tmp_path / "ckpt"
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
        assert mngr.all_steps() == [0, 1]  # step 0 still listed
    with pytest.raises(rs.CorruptContextError, match="step '0'|sealed store"):
        _restore(directory, 0)
    assert cli.main(["verify", _item(directory, 0)]) != 0
    _step_one_is_whole(directory, seed=11)


@pytest.mark.subprocess
def test_kill_9_at_random_points_of_the_delete_never_leaves_a_smaller_item(tmp_path):
    """Each trial kills the delete after a random number of files: step 0's contexts are then
    refused, or restored whole with their gradients (or, with the item's folder gone, Orbax
    refuses the item itself)."""
    for n in random.Random().sample(range(1, 36), 2):
        print(f"a trial killed after {n} files of step 0")  # (shown if it fails)
        folder = tmp_path / f"after{n}"
        folder.mkdir()
        proc = _killed_in_the_delete(folder, str(n), seed=n)
        assert proc.returncode in (0, -9), f"{n} files: exit {proc.returncode}\n{proc.stderr[-4000:]}"
        directory = folder / "ckpt"
        if (directory / "0").exists():
            try:
                store = _restore(directory, 0)
            except rs.CorruptContextError:
                pass
            except KeyError as err:  # the item's folder gone whole: Orbax names it, before any handler
                assert "Item \"contexts\" was not found" in str(err)
            else:
                with store:
                    _assert_gradients(store, _batches(jax.random.split(jax.random.key(n), 2)[0], 3))
        _step_one_is_whole(directory, seed=n)


# -- a kvstore (an object store's reads go out at once) ----------------------------------------


def test_internals_a_sealed_store_in_a_kvstore_names_what_it_lost_and_gained(rng):
    from residual_store._src.store import item_record
    from residual_store._src.store.disk.tier import DiskTier

    batches = _batches(rng, 3)
    spec = {"driver": "memory", "path": f"ckpt/{random.getrandbits(32)}/contexts/"}
    with rs.Store(spec) as store:
        for key, (x, y) in batches.items():
            store.put(FWD(PARAMS, x, y)[1], key)
    item_record.seal(DiskTier(spec, create=False), sorted(batches), "4")
    item_record.check_item(DiskTier(spec, read_only=True), "4")
    with pytest.raises(rs.CorruptContextError, match="step folder '4', not those of step '5'"):
        item_record.check_item(DiskTier(spec, read_only=True), "5")
    with rs.Store(spec) as store:
        store.delete("mb2")
        store.put(FWD(PARAMS, *batches["mb2"])[1], "mb7")
        _assert_gradients(store, {"mb0": batches["mb0"], "mb1": batches["mb1"], "mb7": batches["mb2"]})
        report = store.verify()
    assert report.verified == 2 and sorted(report.damaged) == ["mb2", "mb7"]
    with pytest.raises(rs.CorruptContextError, match=r"'mb2' missing.*'mb7' foreign"):
        item_record.check_item(DiskTier(spec, read_only=True), "4")


def test_an_item_saved_before_records_restores_unchecked_with_a_warning(tmp_path, rng):
    """An item of an earlier residual-store: its marker names no record (a sealed item's always
    does, and is replaced whole), so it is read as it is, with a warning, not refused."""
    batches = _save_steps(tmp_path, rng, steps=(0,), n=2)
    item = _item(tmp_path, 0)
    marker_path = os.path.join(item, "residual-store.json")
    with open(marker_path) as f:
        marker = json.load(f)
    sealed = [k for k in marker if k not in ("format", "version")]
    assert sealed  # the field naming the record
    with open(marker_path, "w") as f:  # the marker as residual-store wrote it before records
        json.dump({k: marker[k] for k in ("format", "version")}, f)
    os.remove(os.path.join(item, RECORD))
    with pytest.warns(rs.ResidualStoreWarning, match="before items recorded what they hold"):
        store = _restore(tmp_path, 0)
    with store:
        _assert_gradients(store, batches[0])
