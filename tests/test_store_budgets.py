"""Budgets as people write them (units, shares of a device's memory) and ``flush(key)``, which
waits for those puts only: when it returns, another process opening the store sees them."""

from __future__ import annotations

import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

import residual_store as rs
from residual_store._src.store import budgets
from residual_store._src.store.disk import tier as disk
from store_helpers import assert_contexts_identical, graded_version, python_env


@pytest.mark.parametrize(
    "text, want",
    [
        ("512MiB", 512 << 20), ("8 GiB", 8 << 30), ("2GB", 2 * 10**9), ("1.5 GiB", 3 << 29),
        ("0b", 0), ("10 kB", 10_000), ("3 kib", 3 << 10), (" 4TiB ", 4 << 40), (7, 7), (np.int64(3), 3),
        (None, None),
    ],
)
def test_internals_sizes_with_units(text, want):
    assert budgets.parse_size(text, "host_budget") == want


@pytest.mark.parametrize(
    "bad", ["10", "8G", "1.5", "-1MiB", "1e9B", "GiB", "8 GiBs", "0.5B", "50%", 1.5, True, -1, [], b"1MiB"]
)
def test_internals_sizes_that_are_not_sizes_are_refused_by_name(bad):
    with pytest.raises(rs.InvalidArgumentError, match="host_budget"):
        budgets.parse_size(bad, "host_budget")


class _Device:
    """A device whose memory statistics the test decides."""

    platform, id = "gpu", 3

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_internals_a_share_is_of_the_devices_memory_limit():
    device = _Device({"bytes_limit": 80 << 30, "bytes_in_use": 1 << 30})
    assert budgets.parse_budget("50%", "device_budget", device) == 40 << 30
    assert budgets.parse_budget("12.5 %", "device_budget", device) == 10 << 30
    assert budgets.parse_budget("1GiB", "device_budget", device) == 1 << 30
    for bad in ("0%", "101%", "-5%", "%"):
        with pytest.raises(rs.InvalidArgumentError, match="device_budget"):
            budgets.parse_budget(bad, "device_budget", device)
    for stats in (None, {}, {"bytes_in_use": 5}):
        with pytest.raises(rs.InvalidArgumentError, match="memory"):
            budgets.parse_budget("50%", "device_budget", _Device(stats))


def test_store_budgets_take_strings_and_refuse_a_share_of_cpu_memory(tmp_path):
    with rs.Store(None, device_budget="1 KiB", host_budget="2MB") as store:
        assert (store._table.device.budget, store._table.host.budget) == (1024, 2_000_000)
    if jax.devices()[0].platform == "cpu":  # XLA's CPU client reports no memory limit
        with pytest.raises(rs.InvalidArgumentError, match="memory"):
            rs.Store(tmp_path / "s", device_budget="50%")
        assert not (tmp_path / "s").exists()
    with pytest.raises(rs.InvalidArgumentError, match="host_budget"):
        rs.Store(None, host_budget="50%")  # a share is of a device's memory


_KEYS_OF = """
import sys, residual_store as rs
with rs.Store(sys.argv[1], read_only=True) as store:
    print(",".join(sorted(store.keys())))
"""


def _keys_seen_by_another_process(path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _KEYS_OF, str(path)], env=python_env(),
                         capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    return out.split(",") if out else []


@pytest.mark.subprocess
def test_internals_flush_of_one_key_waits_for_its_put_only(tmp_path, monkeypatch):
    """k2's write is held at a gate: ``flush("k1")`` returns with k1 visible to another
    process and k2 not yet; ``flush("k2")`` waits for the gate; both read back bitwise."""
    gate, waiting = threading.Event(), threading.Event()
    commit = disk.DiskTier.commit

    def gated(self, plan, **kw):
        if plan.key == "k2":
            waiting.set()
            assert gate.wait(60)
        return commit(self, plan, **kw)

    monkeypatch.setattr(disk.DiskTier, "commit", gated)
    ctxs = {k: graded_version(i, rows=4)[0] for i, k in enumerate(("k1", "k2", "k3"))}
    path = tmp_path / "store"
    with rs.Store(path, device_budget=0, host_budget=0) as store:
        store.put(ctxs["k1"], "k1")
        store.flush("k1")
        store.put(ctxs["k2"], "k2")
        assert waiting.wait(60)
        store.put(ctxs["k3"], "k3")  # queued behind the held write
        store.flush("k1")  # done already: returns though k2 is held
        assert _keys_seen_by_another_process(path) == ["k1"]
        done = threading.Event()
        t = threading.Thread(target=lambda: (store.flush("k2"), done.set()))
        t.start()
        assert not done.wait(0.5), "flush('k2') returned while its write was held"
        gate.set()
        t.join(60)
        assert done.is_set()
        assert "k2" in _keys_seen_by_another_process(path)
        store.flush()
        for key, ctx in ctxs.items():
            assert_contexts_identical(store.get(key), ctx)
        with pytest.raises(rs.ContextNotFoundError):
            store.flush("never-put")
        with pytest.raises(rs.InvalidKeyError):
            store.flush("../k1")


def test_internals_flush_of_a_key_raises_its_writes_error(tmp_path, monkeypatch):
    commit = disk.DiskTier.commit

    def failing(self, plan, **kw):
        if plan.key == "bad":
            raise rs.StoreFullError("no room for 'bad' (simulated)")
        return commit(self, plan, **kw)

    monkeypatch.setattr(disk.DiskTier, "commit", failing)
    with rs.Store(tmp_path / "s") as store:
        store.put(graded_version(1, rows=4)[0], "good")
        store.put(graded_version(2, rows=4)[0], "bad")
        store.flush("good")
        with pytest.raises(rs.StoreFullError, match="bad"):
            store.flush("bad")
        with pytest.raises(rs.StoreFullError, match="bad"):
            store.flush()
        assert "bad" not in store and "good" in store


@pytest.mark.slow
def test_internals_device_headroom_spills_when_the_devices_free_memory_runs_low(tmp_path, monkeypatch):
    """A device whose memory statistics the test controls: while its free memory is above the
    headroom, contexts stay on the device (no budget); when the model's own memory grows into
    the headroom, the next put moves the store's contexts off until the shortfall is given back."""
    limit = 64 << 20
    in_use = {"bytes": 1 << 20}
    monkeypatch.setattr(budgets, "memory_stats", lambda device: {"bytes_limit": limit, "bytes_in_use": in_use["bytes"]})
    ctxs = [graded_version(i, rows=4)[0] for i in range(6)]
    one = ctxs[0].spec.own_nbytes
    with rs.Store(tmp_path / "s", device_headroom="8MiB", host_budget=0) as store:
        for i in range(3):
            store.put(ctxs[i], f"k{i}")
        assert store.stats()["device"]["contexts"] == 3
        # the model takes memory: free is 2.5 contexts short of the headroom
        in_use["bytes"] = limit - (8 << 20) + int(2.5 * one)
        store.put(ctxs[3], "k3")
        stats = store.stats()
        assert stats["device"]["bytes"] <= 4 * one - int(2.5 * one), stats["device"]
        assert stats["device"]["contexts"] == 1  # the newest stays: the shortfall left room for one
        in_use["bytes"] = 1 << 20  # and gives it back: nothing moves back by itself, new puts stay
        store.put(ctxs[4], "k4")
        assert store.stats()["device"]["contexts"] == 2
        store.flush()
        for i, ctx in enumerate(ctxs[:5]):
            assert_contexts_identical(store.get(f"k{i}"), ctx)
    with pytest.raises(rs.InvalidArgumentError, match="device_headroom"):
        rs.Store(None, device_headroom="lots")
    monkeypatch.setattr(budgets, "memory_stats", lambda device: {})
    with pytest.raises(rs.InvalidArgumentError, match="memory"):
        rs.Store(tmp_path / "t", device_headroom="1GiB")
    assert not (tmp_path / "t").exists()
