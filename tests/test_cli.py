"""The command line, run as a user would: subprocesses against a real store."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import residual_store as rs

pytestmark = pytest.mark.subprocess


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "residual_store", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli-store"))
    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w[0]) @ w[1]))
    w = (jax.random.normal(jax.random.key(0), (3, 2)), jax.random.normal(jax.random.key(9), (2, 2)))
    with rs.Store(path) as store:
        for i in range(3):
            x = jax.random.normal(jax.random.key(i + 1), (4, 3))
            store.put(fwd(w, x)[1], f"mb{i}")
    return path


def test_ls_and_inspect(store_path):
    out = _cli("ls", store_path)
    assert out.returncode == 0, out.stderr
    assert "mb0" in out.stdout and "rs2-" in out.stdout and "3 contexts" in out.stdout
    listed = json.loads(_cli("ls", store_path, "--json").stdout)
    assert sorted(e["key"] for e in listed) == ["mb0", "mb1", "mb2"]
    inspected = json.loads(_cli("inspect", store_path, "mb1", "--json").stdout)
    kinds = {r["kind"] for r in inspected["residuals"]}
    assert all(r["chunks"] == 1 and r["chunk_shape"] is None for r in inspected["residuals"])
    assert kinds == {"weight", "input", "intermediate"}
    by_kind = {r["kind"]: r for r in inspected["residuals"]}
    assert by_kind["weight"]["shared"] and by_kind["weight"]["path"].startswith("weights/")
    assert by_kind["input"]["name"] == "input x" and not by_kind["input"]["shared"]  # its own
    assert by_kind["input"]["path"].startswith("data/mb1.")
    text = _cli("inspect", store_path, "mb1").stdout
    assert "tanh" in text and "intermediate" in text


def test_du_and_gc(store_path):
    du = json.loads(_cli("du", store_path, "--json").stdout)
    (entry,) = du.values()
    assert entry["contexts"] == 3 and entry["intermediate"] > 0 and entry["weights"] > 0
    assert entry["input"] == 3 * 4 * 3 * 4  # each context's batch x, float32[4, 3]
    orphan = os.path.join(store_path, "weights", "0" * 32)
    os.makedirs(orphan)
    gc = json.loads(_cli("gc", store_path, "--older-than", "0", "--json").stdout)
    assert gc["weights"] == 1 and not os.path.exists(orphan)
    assert gc["backwards"] == 0  # the one stored backward has its contexts
    assert json.loads(_cli("verify", store_path, "--json").stdout)["damaged"] == []


def test_verify_finds_damage(tmp_path):
    path = str(tmp_path / "store")
    fwd = rs.split(lambda x: jnp.sum(jnp.sin(x) ** 2))
    with rs.Store(path) as store:
        store.put(fwd(jnp.arange(4.0))[1], "good")
        store.put(fwd(jnp.arange(4.0) + 1)[1], "bad")
    clean = _cli("verify", path)
    assert clean.returncode == 0 and "0 damaged" in clean.stdout
    record_dir = [d for d in os.listdir(os.path.join(path, "data")) if d.startswith("bad.")][0]
    chunks = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(path, "data", record_dir)) for f in fs if f != "zarr.json"]
    with open(chunks[0], "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x10]))
    damaged = _cli("verify", path)
    assert damaged.returncode == 1
    assert "DAMAGED bad" in damaged.stdout and "checksum mismatch" in damaged.stdout
    assert "good" not in damaged.stdout.split("DAMAGED", 1)[1].split("\n")[0]
    report = json.loads(_cli("verify", path, "--json").stdout)
    assert [d["key"] for d in report["damaged"]] == ["bad"]


@pytest.mark.parametrize(
    "args, message",
    [
        (("ls", "/no/such/store"), "no such folder"),
        (("inspect", "{tmp}", "k"), "not a residual store"),
        (("gc", "{tmp}/typo"), "no such folder"),
        (("inspect", "{store}", "missing"), "no context 'missing'"),
        (("inspect", "{store}", "../escape"), "invalid store key"),
        (("verify", "{store}", "a/b"), "invalid store key"),
    ],
)
def test_bad_paths_and_keys_give_one_line(store_path, tmp_path, args, message):
    args = [a.format(tmp=str(tmp_path), store=store_path) for a in args]
    out = _cli(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
