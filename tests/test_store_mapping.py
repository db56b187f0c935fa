"""A store is used as the mapping API.md shows: ``store[key]``, ``store[key] = ctx``,
``del store[key]``, ``list(store)``; a put with its arguments the wrong way round says the
order; the package ships ``py.typed`` for type checkers."""

from __future__ import annotations

import tomllib
from pathlib import Path

import jax
import numpy as np
import pytest

import residual_store as rs
from models import init_mlp, mlp_loss

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def contexts(rng):
    params = init_mlp(jax.random.fold_in(rng, 0))
    fwd = rs.split(mlp_loss)
    out = []
    for i in range(2):
        x = jax.random.normal(jax.random.fold_in(rng, 1 + i), (3, 8))
        y = jax.random.normal(jax.random.fold_in(rng, 11 + i), (3, 4))
        _, ctx = fwd(params, x, y)
        out.append((ctx, jax.grad(mlp_loss)(params, x, y)))
    return fwd, out


@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "disk"])
def test_the_mapping_protocol_puts_gets_lists_and_deletes(tmp_path, contexts, on_disk):
    fwd, [(c0, g0), (c1, g1)] = contexts
    with rs.Store(tmp_path / "s" if on_disk else None, device_budget=0) as store:
        store["mb0"] = c0
        store["mb1"] = c1
        assert sorted(store) == ["mb0", "mb1"] == sorted(store.keys())
        got = fwd.backward(store["mb1"])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, g1)
        del store["mb1"]
        assert list(store) == ["mb0"] and "mb1" not in store and len(store) == 1
        with pytest.raises(KeyError):  # rs.ContextNotFoundError is a KeyError, as a mapping's is
            store["mb1"]
        with pytest.raises(rs.ContextNotFoundError):
            del store["mb1"]
        got = fwd.backward(store["mb0"])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, g0)


def test_iterating_while_deleting_sees_the_keys_of_its_start(contexts):
    _, [(c0, _), (c1, _)] = contexts
    store = rs.Store(None)
    store["a"], store["b"] = c0, c1
    for key in store:
        del store[key]  # no "changed size during iteration"
    assert list(store) == []


def test_a_put_with_the_key_first_says_the_order(tmp_path, contexts):
    _, [(c0, _), _] = contexts
    with rs.Store(tmp_path / "s") as store:
        with pytest.raises(rs.InvalidArgumentError, match=r"context first, then the key: put\(ctx, 'mb9'\)"):
            store.put("mb9", c0)
        assert list(store) == []


def test_the_package_ships_py_typed():
    assert (ROOT / "residual_store" / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["residual_store"]
