"""The kvstore backend of the disk tier: the local backend's bytes, ``zarr.json`` last (so
``array_exists`` means complete), ``write_metadata=False`` for collective writers, and shared
(content-addressed) arrays that a failing writer cannot tear."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import residual_store_serializers as serializers
from residual_store._src.store.disk.backends import open_backend
from residual_store._src.store.disk.kvstore import KvBackend
from residual_store._src.store.disk.protocol import ContextWrite, DamagedFileError
from zarr3_reference import chunk_indices


def _file_spec(root: Path) -> dict[str, Any]:
    return {"driver": "file", "path": str(root), "file_io_sync": False}  # options: not the fast path


def _kv_backend(spec: dict[str, Any]) -> KvBackend:
    backend = open_backend(spec)
    assert isinstance(backend, KvBackend)
    return backend


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _blocks(a: np.ndarray, cs: tuple[int, ...]) -> dict[tuple[int, ...], np.ndarray]:
    return {idx: a[serializers.chunk_region(idx, cs)] for idx in chunk_indices(a.shape, cs)}


def _collide(root: Path, key: str) -> None:
    """A folder holding a file where ``key``'s file would go: its put fails (even as root)."""
    (root / key).mkdir(parents=True)
    (root / key / "x").write_bytes(b"")


M = np.arange(24, dtype=np.float32).reshape(4, 6)


def _read_chunked(kv: KvBackend, path: str) -> np.ndarray:
    """``M``'s chunked array at ``path``, read as the store reads one: chunk by chunk."""
    out = np.empty_like(M)
    for idx in chunk_indices(M.shape, (2, 3)):
        out[serializers.chunk_region(idx, (2, 3))] = kv.read_chunk(path, M.shape, "float32", (2, 3), idx)
    return out


def _chunked(keep: Any = lambda idx: True) -> serializers.ChunkedArray:
    blocks = {i: b for i, b in _blocks(M, (2, 3)).items() if keep(i)}
    return serializers.ChunkedArray(M.shape, M.dtype, (2, 3), blocks)


def test_internals_kv_backend_writes_the_local_backends_bytes(tmp_path: Path) -> None:
    arrays = {"data/k/0": np.arange(5, dtype=np.int16), "data/k/1": np.float32(3), "data/k/2": _chunked()}
    local = open_backend(tmp_path / "local")
    kv = _kv_backend(_file_spec(tmp_path / "kv"))
    local.write_arrays(arrays, fsync=False)
    kv.write_arrays(arrays, fsync=False)
    local.write_shared_arrays({"weights/w": M}, fsync=False)
    kv.write_shared_arrays({"weights/w": M}, fsync=False)
    assert _files(tmp_path / "local") == _files(tmp_path / "kv")
    np.testing.assert_array_equal(kv.read_array("data/k/0", (5,), "int16"), arrays["data/k/0"])
    np.testing.assert_array_equal(kv.read_chunk("data/k/2", M.shape, "float32", (2, 3), (1, 1)), M[2:4, 3:6])
    np.testing.assert_array_equal(kv.read_array("weights/w", M.shape, "float32"), M)
    assert kv.array_exists("weights/w") and kv.array_exists("data/k/2")


def test_internals_kv_reads_are_one_request_and_refuse_what_does_not_fit(tmp_path: Path) -> None:
    """A read takes the chunk object alone (no zarr.json: the manifest gives shape and dtype);
    a missing, truncated or oversized chunk is a CorruptDataError naming the object, a missing
    zarr.json (what ``verify`` checks for plain zarr readers) a DamagedFileError."""
    kv = _kv_backend(_file_spec(tmp_path / "kv"))
    kv.write_arrays({"data/k/0": M, "data/k/1": np.zeros((0, 3), np.float32)}, fsync=False)
    (tmp_path / "kv" / "data/k/0/zarr.json").unlink()
    np.testing.assert_array_equal(kv.read_array("data/k/0", M.shape, "float32"), M)  # zarr.json unread
    assert kv.read_array("data/k/1", (0, 3), "float32").shape == (0, 3)
    with pytest.raises(DamagedFileError, match="metadata object .* is missing"):
        kv.check_metadata("data/k/0", M.shape, "float32")
    chunk = tmp_path / "kv" / "data/k/0/c.0.0"
    for data, message in ((M.tobytes()[:-4], "truncated"), (M.tobytes() + b"x", "too long")):
        chunk.write_bytes(data)
        with pytest.raises(serializers.CorruptDataError, match=f"chunk data/k/0/c.0.0 is {message}"):
            kv.read_array("data/k/0", M.shape, "float32")
    chunk.unlink()
    with pytest.raises(serializers.CorruptDataError, match="is missing"):
        kv.read_array("data/k/0", M.shape, "float32")


def test_internals_write_metadata_false_then_metadata_last() -> None:
    kv = _kv_backend({"driver": "memory", "path": f"kv-backend-{uuid.uuid4().hex}/"})
    kv.write_arrays({"data/c/0": _chunked(lambda i: i[0] == 0)}, fsync=False, write_metadata=False)
    kv.write_arrays({"data/c/0": _chunked(lambda i: i[0] == 1)}, fsync=False, write_metadata=False)
    assert not kv.array_exists("data/c/0")  # every chunk is in, but nobody said so yet
    kv.write_arrays({"data/c/0": _chunked(lambda i: False)}, fsync=False)
    assert kv.array_exists("data/c/0")
    np.testing.assert_array_equal(_read_chunked(kv, "data/c/0"), M)
    kv.check_metadata("data/c/0", M.shape, "float32", (2, 3))


def test_internals_failed_write_leaves_no_array_and_others_chunks(tmp_path: Path) -> None:
    kv = _kv_backend(_file_spec(tmp_path))
    kv.write_arrays({"data/c/0": _chunked(lambda i: i == (0, 1))}, fsync=False, write_metadata=False)
    _collide(tmp_path, "data/c/0/c.1.1")
    with pytest.raises(ValueError, match=r"c\.1\.1"):
        kv.write_arrays({"data/c/1": np.ones(3), "data/c/0": _chunked(lambda i: i != (0, 1))}, fsync=False)
    assert not kv.array_exists("data/c/0") and not kv.array_exists("data/c/1")
    assert sorted(_files(tmp_path)) == ["data/c/0/c.0.1", "data/c/0/c.1.1/x"]


def test_internals_failing_shared_write_cannot_tear_a_complete_weight(tmp_path: Path) -> None:
    kv = _kv_backend(_file_spec(tmp_path))
    kv.write_shared_arrays({"weights/w": M}, fsync=False)
    _collide(tmp_path, "weights/v/c.1.1")
    with pytest.raises(ValueError):  # the same weight again, in a batch that fails
        kv.write_shared_arrays({"weights/w": M, "weights/v": _chunked()}, fsync=False)
    np.testing.assert_array_equal(kv.read_array("weights/w", M.shape, "float32"), M)
    assert not kv.array_exists("weights/v")  # chunks without zarr.json: not there, to the store
    for p in (tmp_path / "weights/v/c.1.1").iterdir():
        p.unlink()
    (tmp_path / "weights/v/c.1.1").rmdir()
    kv.write_shared_arrays({"weights/v": _chunked()}, fsync=False)  # the next writer completes it
    np.testing.assert_array_equal(_read_chunked(kv, "weights/v"), M)


@pytest.mark.parametrize("where", ["file", "memory"])
def test_internals_delete_tree_removes_a_prefix_and_nothing_beside_it(tmp_path: Path, where: str) -> None:
    spec = _file_spec(tmp_path) if where == "file" else {"driver": "memory", "path": f"{uuid.uuid4().hex}/"}
    backend = _kv_backend(spec)
    a = np.arange(6, dtype=np.float32)
    backend.write_arrays({"data/k.1/0": a, "data/k.1/1": a, "data/k.10/0": a}, fsync=False)
    backend.delete_tree("data/k.1")
    assert backend.list_dir("data") == ["k.10"]
    assert not backend.array_exists("data/k.1/0")
    np.testing.assert_array_equal(backend.read_array("data/k.10/0", (6,), "float32"), a)
    if where == "file":  # the file driver deletes files; the folders it leaves go too
        assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["k.10"]


def test_internals_a_fresh_write_clears_nothing_and_a_replacing_one_clears_the_old_array(tmp_path: Path) -> None:
    """A context's write into a folder named for it alone (``ContextWrite.fresh``, what the
    store's puts are) skips the listing that clears a path; a plain write replaces whatever
    array was there."""
    kv = _kv_backend(_file_spec(tmp_path))
    kv.write_arrays({"data/a/0": _chunked()}, fsync=False)  # a chunked array: 4 chunk keys
    kv.write_arrays({"data/a/0": M}, fsync=False)  # replaced by a one-chunk array: the others go
    assert sorted(p.name for p in (tmp_path / "data/a/0").iterdir()) == ["c.0.0", "zarr.json"]
    np.testing.assert_array_equal(kv.read_array("data/a/0", M.shape, "float32"), M)
    kv.write_arrays({"data/b/0": _chunked()}, fsync=False)
    kv.write_context(ContextWrite({"data/b/0": M}, {}, {}, fsync=False))  # a fresh folder: nothing is cleared
    assert sorted(p.name for p in (tmp_path / "data/b/0").iterdir()) == ["c.0.0", "c.0.1", "c.1.0", "c.1.1", "zarr.json"]
