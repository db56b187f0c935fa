"""Stores of the earlier layout stay readable: tests/data/store_v3 was written by residual-store
before bundles (manifest version 3, one zarr array folder per residual; see make_store_v3.py)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import residual_store as rs
from store_helpers import assert_trees_close, read_manifest, tree_files

_DATA = Path(__file__).parent / "data"


def _maker():
    spec = importlib.util.spec_from_file_location("make_store_v3", _DATA / "make_store_v3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def old_store(tmp_path: Path) -> Path:
    root = tmp_path / "store_v3"
    shutil.copytree(_DATA / "store_v3", root)
    return root


def _expected(k: int):
    m = _maker()
    params, x, labels = m.inputs()
    return jax.grad(m.loss)(params, x + k, labels)


def test_the_fixture_is_of_the_old_layout(old_store: Path) -> None:
    manifest = read_manifest(old_store, "mb0")
    assert manifest["version"] == 3 and "bundle" not in manifest
    assert all("offset" not in r for r in manifest["arrays"])
    assert not any(f.endswith("bundle.zip") for f in tree_files(old_store))


@pytest.mark.slow
def test_old_contexts_run_backward_with_and_without_the_model(old_store: Path) -> None:
    fwd = rs.split(_maker().loss)
    with rs.Store(old_store, read_only=True) as store:
        assert sorted(store.keys()) == ["mb0", "mb1"]
        for k in range(2):
            ctx = store.get(f"mb{k}")
            want = _expected(k)
            assert_trees_close(rs.backward(ctx), want, rtol=2e-2, atol=2e-2)  # bf16 hidden layer
            assert_trees_close(fwd.backward(ctx), want, rtol=2e-2, atol=2e-2)
            assert float(np.abs(want["w1"]).max()) > 0


@pytest.mark.slow
def test_a_new_put_into_an_old_store_writes_a_bundle_beside_the_old_contexts(old_store: Path) -> None:
    m = _maker()
    params, x, labels = m.inputs()
    fwd = rs.split(m.loss)
    with rs.Store(old_store) as store:
        _, ctx = fwd(params, x + 5, labels)
        store.put(ctx, "mb5")
        store.flush()
    assert read_manifest(old_store, "mb5")["version"] == 4
    assert read_manifest(old_store, "mb0")["version"] == 3  # untouched
    cli = [sys.executable, "-m", "residual_store", "verify", str(old_store)]
    res = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 of 3 contexts verified" in res.stdout
    with rs.Store(old_store, read_only=True) as store:
        for key, k in (("mb0", 0), ("mb1", 1), ("mb5", 5)):
            assert_trees_close(rs.backward(store.get(key)), _expected(k), rtol=2e-2, atol=2e-2)
