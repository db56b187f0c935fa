"""The copies between device and host memory that the budgets owe (made by
``residual_store/_src/store/copies.py`` through the store's pool of pinned host memory): a
context's device bytes count until its copy has landed and the next put waits for them (the key
table's rule 7), a copy that fails leaves the context intact on the device, and threads racing
put, pop and delete through the pool never see a context change. On a CPU the pool's memory is
ordinary host memory and the same code runs; the TPU numbers are ``benchmarks/accelerator.py``'s.
"""

from __future__ import annotations

import random
import threading
import time

import jax
import numpy as np
import pytest

import residual_store as rs
from residual_store._src.store import copies
from store_helpers import graded_versions


@pytest.fixture(scope="module")
def versions() -> list[tuple[rs.ResidualContext, np.ndarray]]:
    return graded_versions(6, width=16, seed=3)


def _grad_of(ctx: rs.ResidualContext) -> np.ndarray:
    return np.asarray(rs.backward(ctx))


@pytest.fixture
def slow_copies(monkeypatch) -> threading.Event:  # noqa: ANN001
    """Each copy to host memory takes 0.2 s to land; the event is set once one has."""
    landed = threading.Event()
    real = copies.wait_copied

    def slow(ctx):  # noqa: ANN001
        time.sleep(0.2)
        real(ctx)
        landed.set()

    monkeypatch.setattr(copies, "wait_copied", slow)
    return landed


def _failed_copy(ctx):  # noqa: ANN001
    raise RuntimeError("the copy to host memory failed")


def test_internals_a_put_the_budget_cannot_keep_returns_once_its_copy_has_landed(versions, slow_copies):
    """Each copy to host memory takes 0.2 s to land here: a put over the budget returns only once
    its context's copy has landed (its device bytes no longer counted as leaving), so the caller's
    next forward is never dispatched beside a context still on its way out; a put the budget
    keeps copies nothing."""
    landed = slow_copies
    with rs.Store(None, device_budget=0) as store:
        store.put(versions[0][0], "a")
        assert landed.is_set() and store.stats()["device"]["leaving"] == 0
        landed.clear()
        store.put(versions[1][0], "b")
        assert landed.is_set() and store.stats()["device"]["leaving"] == 0
        for key, i in (("a", 0), ("b", 1)):
            np.testing.assert_allclose(_grad_of(store.get(key)), versions[i][1], rtol=1e-5, atol=1e-6)
        assert store.stats()["device"]["leaving"] == 0
    with rs.Store(None, device_budget=None) as store:
        landed.clear()
        store.put(versions[0][0], "a")
        assert not landed.is_set() and store.stats()["host"]["contexts"] == 0


def test_internals_flush_waits_until_the_copies_to_host_memory_have_landed_and_raises_a_failed_one_once(
    versions, slow_copies, monkeypatch
):
    """After ``flush()`` the device memory of what left the device is free; a copy that failed
    in flight is not raised by its put but by the next ``flush()``, once, its context intact."""
    landed = slow_copies
    with rs.Store(None, device_budget=0) as store:
        store.put(versions[0][0], "a")
        store.flush()
        assert landed.is_set() and store.stats()["device"]["leaving"] == 0
        monkeypatch.setattr(copies, "wait_copied", _failed_copy)
        store.put(versions[1][0], "b")  # (its copy failed: kept for the next call to raise)
        with pytest.raises(RuntimeError, match="copy to host memory failed"):
            store.flush()
        store.flush()  # (raised once)
        monkeypatch.undo()
        for key, i in (("a", 0), ("b", 1)):
            np.testing.assert_allclose(_grad_of(store.get(key)), versions[i][1], rtol=1e-5, atol=1e-6)


def test_internals_a_copy_that_fails_to_start_leaves_the_context_intact_on_the_device(versions, monkeypatch):
    def broken(ctx, pool=None):  # noqa: ANN001
        raise RuntimeError("pinned host memory exhausted")

    monkeypatch.setattr(copies, "to_host", broken)
    with rs.Store(None, device_budget=0) as store:
        with pytest.raises(RuntimeError, match="exhausted"):
            store.put(versions[0][0], "a")
        monkeypatch.undo()
        assert store.keys() == ["a"]
        np.testing.assert_allclose(_grad_of(store.get("a")), versions[0][1], rtol=1e-5, atol=1e-6)


def test_internals_a_copy_that_fails_in_flight_puts_the_context_back_intact_and_says_so(versions, monkeypatch):
    monkeypatch.setattr(copies, "wait_copied", _failed_copy)
    with rs.Store(None, device_budget=0) as store:
        store.put(versions[0][0], "a")  # returns at once; the copy fails in flight
        with pytest.raises(RuntimeError, match="copy to host memory failed"):
            store.put(versions[1][0], "b")  # the next put waits for it: the failure is raised
        monkeypatch.undo()
        got = store.get("a")
        assert all(x.sharding.memory_kind == "device" for x in got.residuals if isinstance(x, jax.Array))
        np.testing.assert_allclose(_grad_of(got), versions[0][1], rtol=1e-5, atol=1e-6)
        assert store.stats()["device"]["leaving"] == 0


@pytest.mark.parametrize("path", [None, "disk"])
def test_internals_threads_racing_put_pop_and_delete_through_the_pool_never_see_a_context_change(
    tmp_path, versions, path
):
    """Four threads, each its own keys, put, get, pop and delete for hundreds of rounds through
    a store whose budgets send every context through the pool (device budget 0; host memory for
    two contexts): every context got gives its own version's gradients."""
    size = versions[0][0].spec.own_nbytes
    root = None if path is None else tmp_path / "s"
    rounds = 120
    failures: list[str] = []
    with rs.Store(root, device_budget=0, host_budget=2 * size if root is not None else None) as store:

        def worker(t: int) -> None:
            rng = random.Random(t)
            held: dict[str, int] = {}
            for r in range(rounds):
                key = f"t{t}_{rng.randrange(3)}"
                choice = rng.random()
                try:
                    if key not in held or choice < 0.4:
                        i = rng.randrange(len(versions))
                        store.put(versions[i][0], key)
                        held[key] = i
                    elif choice < 0.7:
                        ctx = store.pop(key)
                        i = held.pop(key)
                        if not np.allclose(_grad_of(ctx), versions[i][1], rtol=1e-5, atol=1e-6):
                            failures.append(f"{key} round {r}: popped a changed context")
                    elif choice < 0.8:
                        store.delete(key)
                        held.pop(key)
                    else:
                        i = held[key]
                        if not np.allclose(_grad_of(store.get(key)), versions[i][1], rtol=1e-5, atol=1e-6):
                            failures.append(f"{key} round {r}: got a changed context")
                except Exception as err:  # noqa: BLE001 - collected for the assertion
                    failures.append(f"{key} round {r}: {type(err).__name__}: {err}")

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not failures, failures[:5]
        assert store.stats()["host"]["bytes_in"] > 0  # the contexts went through host memory
