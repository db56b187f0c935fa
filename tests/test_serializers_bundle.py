"""The bundle format (serializers.bundle): many arrays in one zip that plain zarr and tensorstore
read by name, written from the arrays' own buffers and checked byte for byte on the way back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr
from zarr.storage import ZipStore

from residual_store_serializers import CorruptDataError, checksums, register_zarr_dtypes
from residual_store_serializers.bundle import (
    BUNDLE_ALIGNMENT,
    MAX_BUNDLE_ENTRIES,
    bundle_layout,
    bundle_parts,
    bundle_views,
    check_bundle,
    crc_checksum,
)
from residual_store_serializers.local import read_file_exact_local, write_file_local


def _mixed(rng: np.random.Generator) -> list[np.ndarray]:
    """One array of every kind a context holds: floats of each width, ints, bools, a 0-d array,
    empty arrays, and uint32 key data (how a store keeps typed PRNG keys)."""
    return [
        rng.standard_normal((8, 16)).astype(np.float32),
        rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        rng.standard_normal((7,)).astype(np.float16),
        rng.standard_normal((2, 2, 3)).astype(np.float64),
        rng.standard_normal((4,)).astype(ml_dtypes.float8_e4m3fn),
        rng.integers(-100, 100, (5, 3)).astype(np.int32),
        rng.integers(0, 255, (9,)).astype(np.uint8),
        rng.random((3, 3)) > 0.5,
        np.asarray(rng.standard_normal(), np.float32).reshape(()),
        np.zeros((0, 3), np.float32),
        np.zeros((4, 0), np.int8),
        rng.integers(0, 2**32, (3, 2), dtype=np.uint32),
    ]


def _attrs(arrays: list[np.ndarray]) -> list[dict]:
    return [{"index": i, "name": f"residual {i}", "kind": "intermediate"} for i in range(len(arrays))]


def _bundle(arrays: list[np.ndarray]):
    layout = bundle_layout([(str(i), a.shape, a.dtype) for i, a in enumerate(arrays)], _attrs(arrays), {"key": "k", "arrays": len(arrays)})
    parts, crcs = bundle_parts(layout, arrays)
    sums = [crc_checksum(c) if w.nbytes else None for c, w in zip(crcs, layout.arrays)]
    return layout, parts, sums


def test_round_trip_through_a_folder_is_bitwise_and_aligned(tmp_path: Path) -> None:
    arrays = _mixed(np.random.default_rng())
    layout, parts, sums = _bundle(arrays)
    whole = checksums.checksum_parts(parts)
    write_file_local(tmp_path, "data/k.0123/bundle.zip", parts, fsync=True)
    assert os.path.getsize(tmp_path / "data/k.0123/bundle.zip") == layout.nbytes
    buf = read_file_exact_local(tmp_path, "data/k.0123/bundle.zip", layout.nbytes, checksum=whole)
    check_bundle(layout, buf, sums, what="k")
    views = bundle_views(layout.arrays, buf)
    for a, v in zip(arrays, views):
        assert v.dtype == a.dtype and v.shape == a.shape
        assert v.tobytes() == a.tobytes()
        if a.size:
            assert v.ctypes.data % BUNDLE_ALIGNMENT == 0
            assert np.shares_memory(v, buf)  # views, not copies
    # one file, whatever the number of arrays
    assert [p.name for p in (tmp_path / "data/k.0123").iterdir()] == ["bundle.zip"]


def test_a_layout_is_a_pure_function_and_equal_arrays_give_equal_bytes() -> None:
    arrays = _mixed(np.random.default_rng(1))
    a, b = (_bundle([x.copy() for x in arrays]) for _ in range(2))
    assert a[0].text == b[0].text and a[0].spans == b[0].spans
    assert b"".join(map(bytes, a[1])) == b"".join(map(bytes, b[1]))


def test_plain_zarr_and_tensorstore_read_every_array_by_name(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    # and byte arrays of every length up to 70: every padding an entry can need, before its data
    arrays = _mixed(rng) + [rng.integers(0, 255, (n,), dtype=np.uint8) for n in range(1, 71)]
    layout, parts, _ = _bundle(arrays)
    write_file_local(tmp_path, "b.zip", parts)
    assert zipfile.ZipFile(tmp_path / "b.zip").testzip() is None  # every entry's CRC-32 holds
    register_zarr_dtypes()
    group = zarr.open_group(ZipStore(tmp_path / "b.zip", mode="r"), mode="r")
    assert group.attrs["key"] == "k"
    for i, a in enumerate(arrays):
        got = group[str(i)]
        assert got.attrs["name"] == f"residual {i}"
        assert got.dtype == a.dtype and got[...].tobytes() == a.tobytes()
        zip_file = {"driver": "file", "path": str(tmp_path / "b.zip")}
        spec = {"driver": "zarr3", "kvstore": {"driver": "zip", "base": zip_file, "path": f"{i}/"}}
        t = ts.open(spec, open=True).result()
        assert t.read().result().tobytes() == a.tobytes()


@pytest.mark.subprocess
def test_a_process_without_this_library_reads_a_bundle(tmp_path: Path) -> None:
    """Plain zarr and tensorstore, in a process that never imports serializers nor
    residual_store, read the arrays of numpy types by name from the group's attributes."""
    rng = np.random.default_rng()
    arrays = [rng.standard_normal((5, 7)).astype(np.float32), np.arange(6, dtype=np.int64), rng.random(4) > 0.5]
    layout, parts, _ = _bundle(arrays)
    write_file_local(tmp_path, "b.zip", parts)
    code = """
import json, sys, numpy as np, zarr, tensorstore as ts
from zarr.storage import ZipStore
path = sys.argv[1]
assert "residual_store_serializers" not in sys.modules and "residual_store" not in sys.modules
g = zarr.open_group(ZipStore(path, mode="r"), mode="r")
out = {}
for name, arr in g.arrays():
    kvstore = {"driver": "zip", "base": {"driver": "file", "path": path}, "path": name + "/"}
    t = ts.open({"driver": "zarr3", "kvstore": kvstore}, open=True).result()
    a = arr[...]
    assert np.array_equal(a, t.read().result())
    out[arr.attrs["name"]] = [a.dtype.str, list(a.shape), a.tobytes().hex()]
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "b.zip")], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    for i, a in enumerate(arrays):
        assert got[f"residual {i}"] == [a.dtype.str, list(a.shape), a.tobytes().hex()]


def test_every_flipped_bit_is_found() -> None:
    """Each bit of the file is either in an array (its checksum) or in the headers (compared with
    the layout's): flipping any one of them is damage."""
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([True]), np.zeros((0,), np.int8), np.int32(7).reshape(())]
    layout, parts, sums = _bundle(arrays)
    data = bytearray(b"".join(map(bytes, parts)))
    check_bundle(layout, np.frombuffer(bytes(data), np.uint8), sums, what="k")
    for pos in range(len(data)):
        for bit in (0, 7):
            data[pos] ^= 1 << bit
            with pytest.raises(CorruptDataError, match="k: "):
                check_bundle(layout, np.frombuffer(bytes(data), np.uint8), sums, what="k")
            data[pos] ^= 1 << bit


def test_a_flip_in_an_array_names_it_and_fails_the_whole_file_checksum(tmp_path: Path) -> None:
    arrays = _mixed(np.random.default_rng())
    layout, parts, sums = _bundle(arrays)
    whole = checksums.checksum_parts(parts)
    write_file_local(tmp_path, "b.zip", parts)
    where = layout.arrays[5]
    with open(tmp_path / "b.zip", "r+b") as f:
        f.seek(where.offset + 3)
        byte = f.read(1)
        f.seek(where.offset + 3)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptDataError, match="checksum mismatch"):
        read_file_exact_local(tmp_path, "b.zip", layout.nbytes, checksum=whole, what="context 'k'")
    buf = read_file_exact_local(tmp_path, "b.zip", layout.nbytes)
    with pytest.raises(CorruptDataError, match="array 5: checksum mismatch"):
        check_bundle(layout, buf, sums, what="context 'k'")


@pytest.mark.parametrize("change", [-1, +1, -10_000])
def test_a_truncated_or_longer_bundle_is_refused_before_reading(tmp_path: Path, change: int) -> None:
    arrays = _mixed(np.random.default_rng())
    layout, parts, _ = _bundle(arrays)
    write_file_local(tmp_path, "b.zip", parts)
    size = max(0, layout.nbytes + change)
    with open(tmp_path / "b.zip", "r+b") as f:
        f.truncate(size)
    with pytest.raises(CorruptDataError, match="truncated" if change < 0 else "too long"):
        read_file_exact_local(tmp_path, "b.zip", layout.nbytes)


def test_links_are_never_followed(tmp_path: Path) -> None:
    arrays = _mixed(np.random.default_rng())
    layout, parts, _ = _bundle(arrays)
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    store = tmp_path / "store"
    store.mkdir()
    os.symlink(outside, store / "b.zip")
    with pytest.raises(CorruptDataError, match="symbolic link"):
        read_file_exact_local(store, "b.zip", layout.nbytes)
    with pytest.raises(CorruptDataError, match="symbolic link"):
        write_file_local(store, "b.zip", parts)
    os.symlink(tmp_path, store / "d")
    with pytest.raises(CorruptDataError, match="symbolic link"):
        write_file_local(store, "d/b.zip", parts)
    assert outside.read_bytes() == b"precious" and not (tmp_path / "b.zip").exists()


def test_a_thousand_residuals_and_the_entry_limit() -> None:
    rng = np.random.default_rng()
    arrays = [rng.standard_normal((rng.integers(1, 9), 4)).astype(np.float32) for _ in range(1000)]
    layout, parts, sums = _bundle(arrays)
    buf = np.frombuffer(b"".join(map(bytes, parts)), np.uint8)
    check_bundle(layout, buf, sums, what="k")
    assert all(v.tobytes() == a.tobytes() for v, a in zip(bundle_views(layout.arrays, buf), arrays))
    many = (MAX_BUNDLE_ENTRIES // 2) + 1
    with pytest.raises(ValueError, match="zip entries"):
        bundle_layout([(str(i), (1,), np.float32) for i in range(many)])


def test_arrays_that_are_not_the_layouts_are_refused() -> None:
    arrays = [np.zeros((2, 3), np.float32)]
    layout = bundle_layout([("0", (2, 3), np.float32)])
    with pytest.raises(ValueError, match="bundle layout has float32"):
        bundle_parts(layout, [np.zeros((3, 2), np.float32)])
    with pytest.raises(ValueError, match="bundle layout has float32"):
        bundle_parts(layout, [np.zeros((2, 3), np.int32)])
    with pytest.raises(ValueError, match="2 arrays"):
        bundle_parts(layout, arrays * 2)


def test_short_writes_resume_and_a_full_disk_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import residual_store_serializers.files as local_mod
    from residual_store_serializers.errors import DiskFullError

    arrays = _mixed(np.random.default_rng())
    layout, parts, sums = _bundle(arrays)
    real_writev = os.writev

    def short_writev(fd: int, buffers: list) -> int:  # at most 7 bytes a call, across buffers
        return real_writev(fd, [memoryview(b"".join(bytes(b) for b in buffers[:2]))[:7]])

    monkeypatch.setattr(local_mod.os, "writev", short_writev)
    write_file_local(tmp_path, "a/b.zip", parts)
    check_bundle(layout, read_file_exact_local(tmp_path, "a/b.zip", layout.nbytes), sums, what="k")

    def full_writev(fd: int, buffers: list) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(local_mod.os, "writev", full_writev)
    with pytest.raises(DiskFullError, match="disk full"):
        write_file_local(tmp_path, "new/b.zip", parts, fsync=True)
    assert not (tmp_path / "new").exists()  # the folder it made is gone too
