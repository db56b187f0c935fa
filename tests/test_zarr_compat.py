"""Plain zarr-python reading what the serializers write: ml_dtypes floats, attributes, groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from importlib.metadata import entry_points
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import zarr

import serializers.zarr_compat as compat
from serializers import (
    encode_group_metadata,
    register_zarr_dtypes,
    write_arrays_kv,
    write_arrays_local,
)

_VALUES = np.array([-2.0, -0.5, 0.0, 0.25, 1.0, 3.0, 448.0])  # exact in bfloat16 and float8_e4m3fn


def _write_ml_floats(root: Path) -> dict[str, np.ndarray]:
    arrays = {
        "local/bf16": _VALUES.astype(ml_dtypes.bfloat16).reshape(7, 1),
        "local/f8": _VALUES.astype(ml_dtypes.float8_e4m3fn),
        "kv/bf16": _VALUES[::-1].astype(ml_dtypes.bfloat16),
        "kv/f8": _VALUES[::-1].astype(ml_dtypes.float8_e4m3fn).reshape(1, 7),
    }
    write_arrays_local(root, {p: a for p, a in arrays.items() if p.startswith("local/")})
    write_arrays_kv({"driver": "file", "path": str(root)}, {p: a for p, a in arrays.items() if p.startswith("kv/")})
    return arrays


# A fresh interpreter that imports zarr, numpy and ml_dtypes only, never residual_store or
# serializers itself; argv: the root, whether to run zarr's entry-point loader first.
_PLAIN_ZARR_READER = textwrap.dedent(
    """
    import json, sys, warnings
    import ml_dtypes, numpy as np, zarr
    root, load = sys.argv[1], sys.argv[2] == "load"
    assert not any(m.split(".")[0] in ("serializers", "residual_store") for m in sys.modules)
    if load:  # what zarr's loader of its "zarr.data_type" entry point group does
        from zarr.core.dtype import data_type_registry
        data_type_registry._lazy_load()
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for p in ("local/bf16", "local/f8", "kv/bf16", "kv/f8"):
            a = zarr.open_array(root + "/" + p, mode="r")
            out[p] = [str(a.dtype), list(a.shape), np.asarray(a[...]).astype(np.float64).ravel().tolist()]
    print(json.dumps(out))
    """
)


def _run_plain_zarr(root: Path, load: bool) -> subprocess.CompletedProcess[str]:
    """:data:`_PLAIN_ZARR_READER` on ``root``, in a process that cannot import this repository."""
    return subprocess.run(
        [sys.executable, "-c", _PLAIN_ZARR_READER, str(root), "load" if load else "no"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,  # not the repository: nothing of it is importable but what is installed
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )


def _read_in_plain_zarr(root: Path, load: bool) -> dict[str, list]:
    proc = _run_plain_zarr(root, load)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_values(got: dict[str, list], arrays: dict[str, np.ndarray]) -> None:
    for p, a in arrays.items():
        assert got[p] == [str(a.dtype), list(a.shape), a.astype(np.float64).ravel().tolist()], p


def test_every_ml_float_is_an_installed_zarr_data_type_entry_point() -> None:
    declared = {e.name: e for e in entry_points(group="zarr.data_type") if e.value.startswith("serializers.")}
    assert sorted(declared) == sorted(compat._ZARR_FLOAT_NAMES), "reinstall: pip install -e ."
    for name, e in declared.items():
        cls = e.load()
        assert cls._zarr_v3_name == name and cls.__module__ == compat.__name__
        assert cls.from_native_dtype(np.dtype(getattr(ml_dtypes, name))).to_native_dtype() == np.dtype(
            getattr(ml_dtypes, name)
        )


@pytest.mark.subprocess
def test_plain_zarr_reads_ml_floats_through_the_entry_points(tmp_path: Path) -> None:
    """A process that never imports residual_store nor serializers reads bfloat16 and float8
    arrays once zarr has loaded its data type plugins (the entry points pyproject declares)."""
    arrays = _write_ml_floats(tmp_path)
    _check_values(_read_in_plain_zarr(tmp_path, load=True), arrays)


@pytest.mark.subprocess
def test_plain_zarr_with_no_call_does_not_know_ml_floats_yet(tmp_path: Path) -> None:
    """zarr-python (3.1.0 to at least 3.3.0) collects the ``zarr.data_type`` entry points but
    never loads them itself: plain zarr needs ``serializers.register_zarr_dtypes()`` or its
    ``_lazy_load()``, as docs/format.md says. The day this fails because the read worked, zarr
    loads them itself: make this test assert the values are read, and drop that caveat."""
    _write_ml_floats(tmp_path)
    proc = _run_plain_zarr(tmp_path, load=False)
    assert proc.returncode != 0, f"plain zarr read the ml_dtypes floats with no call: {proc.stdout[-500:]}"
    assert "No Zarr data type found that matches 'bfloat16'" in proc.stderr, proc.stderr[-3000:]


def test_register_zarr_dtypes_is_idempotent_and_never_overrides_zarr(monkeypatch: pytest.MonkeyPatch) -> None:
    from zarr.core.dtype import data_type_registry

    float32 = data_type_registry.contents["float32"]
    assert register_zarr_dtypes() == register_zarr_dtypes() == compat._ZARR_FLOAT_NAMES
    assert data_type_registry.contents["float32"] is float32
    for cls in compat._ZARR_FLOATS:
        assert data_type_registry.contents[cls._zarr_v3_name] is cls
    # a name zarr knows itself keeps zarr's class: here too, and in what the entry point names
    zarrs_own = type("ZarrsOwnBfloat16", (), {"_zarr_v3_name": "bfloat16"})
    monkeypatch.setitem(data_type_registry.contents, "bfloat16", zarrs_own)
    register_zarr_dtypes()
    assert data_type_registry.contents["bfloat16"] is zarrs_own
    assert compat._zarr_float("bfloat16") is zarrs_own


def test_plain_zarr_sees_array_and_group_attributes(tmp_path: Path) -> None:
    register_zarr_dtypes()
    root = tmp_path / "store"
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = _VALUES.astype(ml_dtypes.bfloat16)
    write_arrays_local(root, {"g/a": a, "g/b": b}, attributes={"g/a": {"name": "a", "index": [0, 1]}})
    (root / "zarr.json").write_bytes(encode_group_metadata({"format": "residual-store", "version": 3}))
    (root / "g" / "zarr.json").write_bytes(encode_group_metadata({"key": "k"}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arr = zarr.open_array(str(root / "g" / "a"), mode="r")
        assert dict(arr.attrs) == {"name": "a", "index": [0, 1]}
        np.testing.assert_array_equal(arr[...], a)
        assert dict(zarr.open_array(str(root / "g" / "b"), mode="r").attrs) == {}
        top = zarr.open_group(str(root), mode="r")
        assert dict(top.attrs) == {"format": "residual-store", "version": 3}
        group = zarr.open_group(str(root / "g"), mode="r")
        assert dict(group.attrs) == {"key": "k"}
        assert sorted(group.array_keys()) == ["a", "b"]
        np.testing.assert_array_equal(np.asarray(group["b"][...]).astype(np.float64), _VALUES)
