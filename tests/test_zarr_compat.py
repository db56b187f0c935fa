"""Plain zarr-python reading what the serializers write: ml_dtypes floats, attributes, groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
import warnings
from importlib.metadata import entry_points
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import zarr

import residual_store_serializers.zarr_compat as compat
from residual_store_serializers import (
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
# serializers itself, and calls nothing but zarr's open_group and open_array; warnings are errors.
# argv: the root (a group), "group" to open the root group first, or "array" to open an array first.
_PLAIN_ZARR_READER = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("error")
    import ml_dtypes, numpy as np, zarr
    assert not any(m.split(".")[0] in ("residual_store_serializers", "residual_store") for m in sys.modules)
    root, first = sys.argv[1], sys.argv[2]
    out = {}
    try:
        get = zarr.open_group(root, mode="r").__getitem__ if first == "group" else None
        for p in ("local/bf16", "local/f8", "kv/bf16", "kv/f8"):
            a = get(p) if get else zarr.open_array(root + "/" + p, mode="r")
            out[p] = [str(a.dtype), list(a.shape), np.asarray(a[...]).tobytes().hex()]
    except ValueError as e:
        sys.exit(f"refused: {e}")
    print(json.dumps(out))
    """
)


def _run_plain_python(
    script: str, *args: str, cwd: Path, pythonpath: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh interpreter, in ``cwd`` (not the repository: nothing of it is
    importable but what is installed, and ``pythonpath``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def _installed_entry_points(group: str) -> dict[str, str]:
    """The entry points of ``group`` the installed residual-store declares: name -> value."""
    return {e.name: e.value for e in entry_points(group=group) if e.value.startswith("residual_store_serializers.")}


def test_every_entry_point_of_pyproject_is_installed() -> None:
    """What pyproject.toml declares is what zarr finds (else: ``pip install -e .`` again)."""
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    for group in ("zarr.data_type", "zarr.buffer"):
        declared = pyproject["project"]["entry-points"][group]
        assert _installed_entry_points(group) == declared, f"{group}: reinstall: pip install -e ."


def test_every_ml_float_is_a_zarr_data_type_entry_point() -> None:
    declared = {e.name: e for e in entry_points(group="zarr.data_type") if e.value.startswith("residual_store_serializers.")}
    assert sorted(declared) == sorted(compat._ZARR_FLOAT_NAMES), "reinstall: pip install -e ."
    for name, e in declared.items():
        cls = e.load()
        assert cls._zarr_v3_name == name and cls.__module__ == compat.__name__
        assert cls.from_native_dtype(np.dtype(getattr(ml_dtypes, name))).to_native_dtype() == np.dtype(
            getattr(ml_dtypes, name)
        )


def test_the_buffer_entry_point_is_zarrs_own_buffer() -> None:
    """zarr registers what the ``zarr.buffer`` entry point names under the name it already has
    in zarr's buffer registry (its own CPU buffer): the registry gains nothing, and loading it
    registered the ml_dtypes floats."""
    from zarr.dtype import data_type_registry

    (e,) = [e for e in entry_points(group="zarr.buffer") if e.value.startswith("residual_store_serializers.")]
    loaded = e.load()
    assert loaded is zarr.buffer.cpu.Buffer
    assert f"{loaded.__module__}.{loaded.__qualname__}" == "zarr.core.buffer.cpu.Buffer"
    assert zarr.registry.get_buffer_class() is zarr.buffer.cpu.Buffer
    for cls in compat._ZARR_FLOATS:
        assert data_type_registry.get(cls._zarr_v3_name) is cls


@pytest.mark.subprocess
def test_plain_zarr_reads_ml_floats_with_no_call(tmp_path: Path) -> None:
    """A process that imports zarr and nothing of this repository opens a group and reads its
    bfloat16 and float8 arrays bit for bit, with no warning: zarr loads its ``zarr.buffer``
    plugins, serializers.zarr_plugin among them, before it reads the group's metadata."""
    arrays = _write_ml_floats(tmp_path)
    (tmp_path / "zarr.json").write_bytes(encode_group_metadata({}))
    proc = _run_plain_python(_PLAIN_ZARR_READER, str(tmp_path), "group", cwd=tmp_path)
    assert proc.returncode == 0, (
        "the installed residual-store predates its zarr.buffer entry point (pip install -e .), or "
        "ASSUMPTION BROKEN (residual_store_serializers/zarr_plugin.py): zarr's open_group parsed a data type "
        f"before it loaded its zarr.buffer entry points: {proc.stderr[-3000:]}"
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for p, a in arrays.items():
        assert got[p] == [str(a.dtype), list(a.shape), a.tobytes().hex()], p


@pytest.mark.subprocess
def test_open_array_as_the_first_call_still_needs_register_zarr_dtypes(tmp_path: Path) -> None:
    """zarr-python (3.1.0 to at least 3.3.0) reads an array's metadata with a fixed buffer
    prototype, consulting no plugin registry before it parses the data type: a process whose
    first zarr call is ``open_array`` (or ``open``) on such an array is refused, as docs/format.md
    says. The day this fails because the arrays were read, drop that caveat there."""
    _write_ml_floats(tmp_path)
    proc = _run_plain_python(_PLAIN_ZARR_READER, str(tmp_path), "array", cwd=tmp_path)
    assert proc.returncode != 0, f"zarr read the arrays with open_array first: {proc.stdout[-500:]}"
    assert "refused: No Zarr data type found that matches 'bfloat16'" in proc.stderr, proc.stderr[-3000:]


# One made-up zarr data type, declared only as a "zarr.data_type" entry point of a package.
_PROBE_MODULE = textwrap.dedent(
    """
    import dataclasses
    from zarr.dtype import Float32

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class ProbeFloat32(Float32):
        _zarr_v3_name = "rs_probe_float32"
    """
)
_PROBE_READER = textwrap.dedent(
    """
    import sys
    from importlib.metadata import entry_points
    import zarr
    found = [e.value for e in entry_points(group="zarr.data_type", name="rs_probe_float32")]
    assert found == ["rs_probe_dtype:ProbeFloat32"], found
    try:
        zarr.open_array(sys.argv[1], mode="r")
    except ValueError as e:
        print("refused:", e)
    else:
        print("read")
    """
)


@pytest.mark.subprocess
def test_zarr_still_does_not_load_data_type_entry_points_itself(tmp_path: Path) -> None:
    """Why residual_store_serializers/zarr_plugin.py exists: zarr-python (3.1.0 to at least 3.3.0) collects the
    ``zarr.data_type`` entry points but never loads them, so it refuses an array whose data type
    only such an entry point declares. The day this fails because the array was read, zarr loads
    them itself: drop residual_store_serializers/zarr_plugin.py and the ``zarr.buffer`` entry point (the
    ``zarr.data_type`` ones stay), and say so in docs/format.md."""
    site = tmp_path / "site"
    info = site / "rs_probe-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rs-probe\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[zarr.data_type]\nrs_probe_float32 = rs_probe_dtype:ProbeFloat32\n")
    (site / "rs_probe_dtype.py").write_text(_PROBE_MODULE)
    write_arrays_local(tmp_path, {"probe": np.arange(3, dtype=np.float32)})
    meta = json.loads((tmp_path / "probe" / "zarr.json").read_bytes())
    meta["data_type"] = "rs_probe_float32"
    (tmp_path / "probe" / "zarr.json").write_text(json.dumps(meta))
    proc = _run_plain_python(_PROBE_READER, str(tmp_path / "probe"), cwd=tmp_path, pythonpath=str(site))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("refused: No Zarr data type found that matches 'rs_probe_float32'"), (
        f"zarr now loads its zarr.data_type entry points itself ({proc.stdout.strip()!r}): "
        "residual_store_serializers/zarr_plugin.py and the zarr.buffer entry point can go"
    )


def test_register_zarr_dtypes_is_idempotent_and_never_overrides_zarr(monkeypatch: pytest.MonkeyPatch) -> None:
    from zarr.dtype import data_type_registry

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
