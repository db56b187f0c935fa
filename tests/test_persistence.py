"""A store's persistence, one class per mode (``residual_store/_src/store/persistence.py``): what
each tells the key table to do with what leaves memory (``keeping_for``), what a memory-only or a
read-only store answers, and the writable store's background writes and removals seen through
its disk (a fresh read-only store on the same folder)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import residual_store as rs
from residual_store._src.store.collective import committer_for
from residual_store._src.store.disk.tier import DiskTier
from residual_store._src.store.owed import Keeping
from residual_store._src.store.persistence import (
    MemoryOnlyPersistence,
    ReadOnlyPersistence,
    WritablePersistence,
    keeping_for,
)
from store_helpers import graded_version


def test_internals_each_mode_tells_the_table_what_leaves_memory(tmp_path):
    assert keeping_for(None, None, True) == Keeping(below_host=False)  # refuse what does not fit
    disk = DiskTier(str(tmp_path / "s"), create=True, read_only=False)
    committer = committer_for(disk, 30.0)
    assert keeping_for(disk, None, True) == Keeping(below_host=True)  # read only: nothing written
    assert keeping_for(disk, committer, True) == Keeping(below_host=True, writes_puts=True)
    assert keeping_for(disk, committer, False) == Keeping(below_host=True, writes_spills=True)


def test_internals_a_store_has_the_persistence_of_its_mode(tmp_path):
    with rs.Store(None) as memory:
        assert type(memory._persistence) is MemoryOnlyPersistence
    with rs.Store(tmp_path / "s") as writable:
        assert type(writable._persistence) is WritablePersistence
        writable.put(graded_version(0)[0], "k")
    with rs.Store(tmp_path / "s", read_only=True) as reader:
        assert type(reader._persistence) is ReadOnlyPersistence
        assert reader.keys() == ["k"]


def test_internals_a_memory_only_store_answers_that_nothing_is_on_disk():
    ctx, grad = graded_version(1)
    with rs.Store(None) as store:
        store.put(ctx, "k")
        assert store.stats()["disk"] == {
            "bytes": 0, "contexts": 0, "own_bytes": 0, "reads": 0, "bytes_read": 0, "writes": 0, "bytes_written": 0
        }
        assert store.usage().total == 0 and store.gc(0)["bytes"] == 0
        assert store.verify().ok and store.verify().verified == 1  # held in memory: nothing to check
        store.delete("k")  # nothing below memory: gone at once
        assert "k" not in store and store.keys() == []
        with pytest.raises(rs.ContextNotFoundError, match="no context 'k' in store"):
            store.info("k")


def test_internals_a_read_only_store_changes_nothing(tmp_path):
    ctx, grad = graded_version(2)
    with rs.Store(tmp_path / "s") as writer:
        writer.put(ctx, "k")
    with rs.Store(tmp_path / "s", read_only=True) as reader:
        for change in (lambda: reader.put(ctx, "k2"), lambda: reader.delete("k"), lambda: reader.pop("k"),
                       lambda: reader.gc(0)):
            with pytest.raises(rs.ReadOnlyStoreError, match="read_only=True"):
                change()
        np.testing.assert_allclose(np.asarray(rs.backward(reader.get("k"))), grad, rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in (tmp_path / "s" / "contexts").iterdir()) == ["k.manifest"]


def test_internals_a_writable_store_writes_and_removes_in_call_order(tmp_path):
    (a, _), (b, grad_b) = graded_version(3), graded_version(4)
    with rs.Store(tmp_path / "s") as store:
        store.put(a, "k")
        store.delete("k")
        store.put(b, "k")  # the removal of a, then b's write: b is what lands
        store.put(a, "gone")
        store.delete("gone")
        store.flush()
        stats = store.stats()["disk"]
        assert 1 <= stats["writes"] <= 3 and stats["contexts"] == 1  # (a superseded write may be skipped)
    with rs.Store(tmp_path / "s", read_only=True) as reader:
        assert reader.keys() == ["k"]
        np.testing.assert_allclose(np.asarray(rs.backward(reader.get("k"))), grad_b, rtol=1e-5, atol=1e-6)


def test_internals_gc_counts_after_the_janitor_disposed_of_what_a_delete_left(tmp_path):
    """A delete's data goes to the janitor, off the write path; gc (a dry run too) waits for it,
    else a folder being recycled is counted twice (as data, then as recycled) or not at all."""
    gate = threading.Event()
    with rs.Store(tmp_path / "s") as store:
        store.put(graded_version(1)[0], "a")
        store.flush()
        janitor = store._persistence.janitor
        janitor.submit(gate.wait)  # the janitor busy: the delete's disposal waits behind this
        store.delete("a")
        store.flush()
        counted: list[dict[str, int]] = []
        gc = threading.Thread(target=lambda: counted.append(store.gc(3600, dry_run=True)))
        gc.start()
        try:
            gc.join(0.5)
            assert gc.is_alive() and not counted  # waiting for the disposal, not counting half of it
        finally:
            gate.set()  # (the store's close waits for the janitor)
        gc.join(30)
        assert counted == [store.gc(3600, dry_run=True)]
        assert counted[0]["young"] == 2  # the recycled data folder and the unneeded stored backward
