"""A store is used as the mapping API.md shows: ``store[key]``, ``store[key] = ctx``,
``del store[key]``, ``list(store)``, and the rest of ``collections.abc.MutableMapping`` (``get``
and ``pop`` with a default, ``items``, ``values``, ``update``, ``setdefault``, ``popitem``,
``clear``); a put with its arguments the wrong way round says the order; flags are booleans; a
closed store is not entered; the package ships ``py.typed`` for type checkers."""

from __future__ import annotations

import collections.abc
import tomllib
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest

import residual_store as rs
from models import init_mlp, mlp_loss
from store_helpers import jitted_grad

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
        out.append((ctx, jitted_grad(mlp_loss)(params, x, y)))
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


def _same_gradients(fwd, ctx, expected):
    got = fwd.backward(ctx)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, expected)


@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "disk"])
def test_the_store_is_a_mutable_mapping_with_every_method_it_implies(tmp_path, contexts, on_disk):
    fwd, [(c0, g0), (c1, g1)] = contexts
    with rs.Store(tmp_path / "s" if on_disk else None, device_budget=0) as store:
        assert isinstance(store, collections.abc.MutableMapping) and isinstance(store, collections.abc.Mapping)
        assert weakref.ref(store)() is store and hash(store) == hash(store)  # still hashable (no Mapping.__eq__)
        missing = object()
        assert store.get("mb0", None) is None and store.get("mb0", missing) is missing
        assert store.pop("mb0", missing) is missing
        with pytest.raises(rs.ContextNotFoundError):  # without a default: the store's contract
            store.get("mb0")
        store.update({"mb0": c0}, mb1=c1)
        assert sorted(store) == ["mb0", "mb1"]
        _same_gradients(fwd, store.get("mb1", None), g1)
        assert [k for k, _ in store.items()] == ["mb0", "mb1"] and len(store.values()) == 2
        for (key, ctx), expected in zip(store.items(), (g0, g1)):
            _same_gradients(fwd, ctx, expected)
        assert store.setdefault("mb0", c1) is not None and "mb0" in store
        _same_gradients(fwd, store.setdefault("mb0", c1), g0)  # there already: kept
        key, ctx = store.popitem()
        assert key == "mb0" and list(store) == ["mb1"]
        _same_gradients(fwd, ctx, g0)
        _same_gradients(fwd, store.pop("mb1", None), g1)
        assert len(store) == 0
        with pytest.raises(rs.ContextNotFoundError, match="empty"):
            store.popitem()
        assert store.setdefault("mb2", c0) is c0 and list(store) == ["mb2"]
        other = rs.Store(None)
        other.update(store)  # from another store: a mapping
        assert list(other) == ["mb2"]
        store.update([("mb3", c1)])  # from pairs
        store.clear()
        assert list(store) == [] and len(store) == 0 and list(other) == ["mb2"]


@pytest.mark.parametrize("flag", ["write_through", "durable", "create", "read_only"])
def test_flags_are_booleans(tmp_path, flag):
    with pytest.raises(rs.InvalidArgumentError, match=f"{flag} must be True or False, got str 'no'"):
        rs.Store(tmp_path / "s", **{flag: "no"})
    assert not (tmp_path / "s").exists()  # refused before anything is made
    with rs.Store(tmp_path / "s", **{flag: np.bool_(flag != "read_only")}):
        pass


def test_a_closed_store_is_not_entered_again(tmp_path):
    store = rs.Store(tmp_path / "s")
    with store:
        pass
    with pytest.raises(rs.InvalidArgumentError, match="is closed"):
        with store:
            pass
