"""Tests for serializers.zarr, .local and .kv: both paths, cross-path, plain zarr, corruption, disk full."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr

import residual_store_serializers.kv as kv_mod
import residual_store_serializers.kv_errors as kv_errors
import residual_store_serializers.local as local_mod
from residual_store_serializers import (
    SUPPORTED_DTYPES,
    ChunkedArray,
    CorruptDataError,
    DiskFullError,
    UnsupportedDTypeError,
    aligned_empty,
    check_chunk_shape,
    checksum,
    chunk_grid,
    chunk_index_key,
    chunk_key,
    chunk_region,
    encode_group_metadata,
    encode_zarr_metadata,
    group_metadata,
    local_root,
    read_array,
    read_array_async,
    read_array_local,
    read_arrays,
    read_arrays_local,
    read_chunk,
    read_chunk_local,
    register_zarr_dtypes,
    write_array_async,
    write_arrays,
    write_arrays_kv,
    write_arrays_local,
    write_chunks_local,
    zarr_dtype_name,
    zarr_metadata,
)
from residual_store_serializers.local import check_array_metadata_local
from residual_store_serializers.zarr import EXTENSION_DTYPES
from residual_store_serializers.zarr_compat import _ZARR_FLOAT_NAMES
from zarr3_reference import chunk_indices, write_array, write_chunks

DTYPE_NAMES = list(SUPPORTED_DTYPES)
SHAPES = [(), (0, 3), (7,), (2, 3)]
NUMPY_NAMES = [n for n in DTYPE_NAMES if not hasattr(ml_dtypes, n)]
_SUB_BYTE = {"int2", "int4", "float4_e2m1fn"}  # not every byte is a valid value


def _array(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random data of every bit pattern (NaN payloads included) where valid."""
    d = SUPPORTED_DTYPES[name]
    n = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    if name == "bool":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if name in _SUB_BYTE:
        return (rng.integers(-1, 2, n)).astype(d).reshape(shape)
    return rng.integers(0, 256, n * d.itemsize, dtype=np.uint8).view(d).reshape(shape)


def _same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def _kv(root: Path) -> dict[str, Any]:
    return {"driver": "file", "path": str(root)}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# ----------------------------------------------------------------- round trips


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_round_trip_every_dtype_both_paths_and_across(
    tmp_path: Path, name: str, shape: tuple[int, ...]
) -> None:
    a = _array(name, shape)
    write_arrays_local(tmp_path, {"fast/x": a})
    if name in EXTENSION_DTYPES:  # no data type of tensorstore's zarr3 driver: the raw paths only
        _same_bits(read_array_local(tmp_path, "fast/x", shape, name), a)
        assert json.loads((tmp_path / "fast" / "x" / "zarr.json").read_bytes())["data_type"] == name
        return
    write_array(_kv(tmp_path), "ts/x", a)

    for written in ("fast/x", "ts/x"):
        _same_bits(read_array_local(tmp_path, written, shape, name), a)
        _same_bits(read_array(_kv(tmp_path), written, shape, name), a)

    # Same bytes on disk: chunk files identical, metadata identical.
    fast, tsd = tmp_path / "fast" / "x", tmp_path / "ts" / "x"
    assert _files(fast) == _files(tsd)
    assert (fast / "zarr.json").read_bytes() == (tsd / "zarr.json").read_bytes()
    assert json.loads((tsd / "zarr.json").read_bytes()) == json.loads(
        encode_zarr_metadata(shape, name)
    )
    key = chunk_key(shape)
    if key is None:
        assert _files(fast) == ["zarr.json"]
    else:
        chunk = (fast / key).read_bytes()
        assert chunk == (tsd / key).read_bytes() == a.tobytes()
        assert checksum(chunk) == checksum(a)


def test_chunk_keys(tmp_path: Path) -> None:
    assert chunk_key(()) == "c"
    assert chunk_key((5,)) == "c.0"
    assert chunk_key((2, 3, 4)) == "c.0.0.0"
    assert chunk_key((2, 0)) is None
    write_array(_kv(tmp_path), "a", np.zeros((2, 3, 4), np.float32))  # all fill value: still stored
    assert (tmp_path / "a" / "c.0.0.0").stat().st_size == 96


def test_read_result_is_aligned_and_writable(tmp_path: Path) -> None:
    for i, shape in enumerate([(), (1,), (3,), (17, 5)]):
        write_arrays_local(tmp_path, {f"a{i}": np.ones(shape, np.float32)})
        out = read_array_local(tmp_path, f"a{i}", shape, np.float32)
        assert out.ctypes.data % 64 == 0 and out.flags.writeable and out.flags.c_contiguous


def test_aligned_empty() -> None:
    for shape, dtype in [
        ((), np.float64),
        ((0, 4), np.int8),
        ((3, 5), ml_dtypes.bfloat16),
        ((9,), np.bool_),
    ]:
        for align in (64, 4096):
            a = aligned_empty(shape, dtype, align=align)
            assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous
            assert a.size == 0 or a.ctypes.data % align == 0  # no data, nothing to align


def test_memory_kvstore_default_and_explicit_context() -> None:
    a = _array("float32", (4, 5))
    write_array({"driver": "memory"}, "ctx/a", a)
    _same_bits(read_array({"driver": "memory"}, "ctx/a", (4, 5), "float32"), a)
    ctx = ts.Context()
    write_array({"driver": "memory", "path": "p/"}, "b", a, context=ctx)
    _same_bits(
        read_array({"driver": "memory", "path": "p/"}, "b", (4, 5), np.float32, context=ctx), a
    )
    with pytest.raises(CorruptDataError, match="'b'"):  # another context: another memory store
        read_array(
            {"driver": "memory", "path": "p/"}, "b", (4, 5), np.float32, context=ts.Context()
        )


@pytest.mark.parametrize("where", ["file", "memory"])
def test_many_arrays_concurrently(tmp_path: Path, where: str) -> None:
    kv = _kv(tmp_path) if where == "file" else {"driver": "memory", "path": str(tmp_path)[1:] + "/"}
    arrays = {
        f"c/{i}": _array(n, s, seed=i)
        for i, (n, s) in enumerate(
            [
                ("float32", (3, 4)),
                ("bfloat16", (5,)),
                ("int8", ()),
                ("bool", (0,)),
                ("uint64", (2, 2, 2)),
            ]
            * 3
        )
    }
    write_arrays(kv, arrays)
    out = read_arrays(kv, {p: (a.shape, a.dtype) for p, a in arrays.items()})
    for p, a in arrays.items():
        _same_bits(out[p], a)


def test_async_variants_are_tensorstore_futures(tmp_path: Path) -> None:
    a = np.arange(10, dtype=np.int16)
    f = write_array_async(_kv(tmp_path), "a", a)
    assert isinstance(f, ts.Future)
    assert f.result() is None
    r = read_array_async(_kv(tmp_path), "a", (10,), "int16")
    assert isinstance(r, ts.Future)
    _same_bits(r.result(), a)


def test_write_arrays_local_and_fsync(tmp_path: Path) -> None:
    arrays = {"x/0": _array("float64", (3,)), "x/1": _array("int32", (2, 2)), "y": np.float16(1.5)}
    write_arrays_local(tmp_path / "new", arrays, fsync=True)
    for p, a in arrays.items():
        _same_bits(
            read_array_local(tmp_path / "new", p, np.shape(a), np.asarray(a).dtype), np.asarray(a)
        )


def test_non_contiguous_and_big_endian_inputs(tmp_path: Path) -> None:
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    for i, x in enumerate([a.T, a[:, ::2], a.astype(">f4")]):
        write_arrays_local(tmp_path, {f"f{i}": x})
        write_array(_kv(tmp_path), f"t{i}", x)
        want = np.ascontiguousarray(x).astype("<f4")
        _same_bits(read_array_local(tmp_path, f"f{i}", x.shape, np.float32), want)
        _same_bits(read_array_local(tmp_path, f"t{i}", x.shape, np.float32), want)


def test_overwrite_with_another_rank_replaces_chunks(tmp_path: Path) -> None:
    for shape in [(2, 3), (6,), (), (2, 1, 3), (0,), (4,)]:
        a = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
        write_arrays_local(tmp_path, {"a": a})
        _same_bits(read_array(_kv(tmp_path), "a", shape, np.int32), a)
        write_array(_kv(tmp_path), "b", a)
        _same_bits(read_array_local(tmp_path, "b", shape, np.int32), a)
    assert _files(tmp_path / "a") == ["c.0", "zarr.json"]


def test_unsupported_dtype_and_unsafe_path(tmp_path: Path) -> None:
    for bad in [np.array(["a"]), np.array([object()]), np.array([1], "datetime64[s]")]:
        with pytest.raises(UnsupportedDTypeError):
            write_arrays_local(tmp_path, {"a": bad})
        with pytest.raises(UnsupportedDTypeError):
            write_array(_kv(tmp_path), "a", bad)
    assert isinstance(UnsupportedDTypeError("x"), TypeError)
    with pytest.raises(UnsupportedDTypeError):
        read_array_local(tmp_path, "a", (1,), "key<fry>")
    with pytest.raises(UnsupportedDTypeError):
        write_arrays(_kv(tmp_path), {"ok": np.zeros(3), "bad": np.array(["s"])})
    assert not (tmp_path / "ok").exists()  # nothing was started
    assert zarr_dtype_name(np.dtype(">i8")) == "int64"
    for path in ["../a", "/a", "a//b", "a/", ""]:
        with pytest.raises(ValueError, match="unsafe"):
            write_arrays_local(tmp_path, {path: np.zeros(1)})
        with pytest.raises(ValueError, match="unsafe"):
            write_array(_kv(tmp_path), path, np.zeros(1))
        with pytest.raises(ValueError, match="unsafe"):
            read_array_local(tmp_path, path, (1,), np.float64)


def test_local_root() -> None:
    assert local_root({"driver": "file", "path": "/data/s"}) == "/data/s"
    assert local_root("/data/s") == "/data/s"
    assert local_root(Path("/data/s")) == "/data/s"
    assert local_root({"driver": "memory"}) is None
    assert local_root({"driver": "file", "path": "/d", "context": {}}) is None


# ----------------------------------------------------------------- plain zarr


@pytest.mark.parametrize("name", NUMPY_NAMES + list(_ZARR_FLOAT_NAMES))
def test_plain_zarr_reads_what_both_paths_wrote(tmp_path: Path, name: str) -> None:
    register_zarr_dtypes()
    a = _array(name, (3, 4))
    write_arrays_local(tmp_path, {"f": a})
    write_array(_kv(tmp_path), "t", a)
    write_arrays_local(tmp_path, {"s": np.float64(2.5)})
    write_array(_kv(tmp_path), "e", np.zeros((0, 3), np.int16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr warns about some dtypes' spec status
        for p in ("f", "t"):
            z = zarr.open_array(str(tmp_path / p), mode="r")
            _same_bits(np.asarray(z[...]), a)
        assert zarr.open_array(str(tmp_path / "s"), mode="r")[()] == 2.5
        assert zarr.open_array(str(tmp_path / "e"), mode="r")[...].shape == (0, 3)


def test_fast_reader_reads_plain_zarr_output(tmp_path: Path) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z = zarr.create_array(
            str(tmp_path / "z"),
            shape=a.shape,
            dtype=a.dtype,
            chunks=a.shape,
            compressors=None,
            fill_value=0,
            chunk_key_encoding={"name": "default", "separator": "."},
        )
        z[...] = a
    _same_bits(read_array_local(tmp_path, "z", a.shape, np.float32), a)


# ----------------------------------------------------------------- corruption


def _readers(tmp_path: Path) -> list[Any]:
    return [
        lambda p, s, d: read_array_local(tmp_path, p, s, d),
        lambda p, s, d: read_array(_kv(tmp_path), p, s, d),
    ]


@pytest.mark.parametrize("reader", [0, 1], ids=["fast", "tensorstore"])
@pytest.mark.parametrize("shape", [(), (4, 5)], ids=str)
def test_truncated_long_and_missing_chunk(
    tmp_path: Path, reader: int, shape: tuple[int, ...]
) -> None:
    read = _readers(tmp_path)[reader]
    a = _array("float32", shape)
    chunk = tmp_path / "a" / chunk_key(shape)  # type: ignore[operator]
    write_arrays_local(tmp_path, {"a": a})

    with open(chunk, "r+b") as f:
        f.truncate(a.nbytes - 1)
    with pytest.raises(CorruptDataError, match="'a'"):
        read("a", shape, "float32")

    chunk.write_bytes(a.tobytes() + b"\x00")
    with pytest.raises(CorruptDataError, match="'a'"):
        read("a", shape, "float32")

    chunk.unlink()
    with pytest.raises(CorruptDataError, match="'a'.*missing|'a'.*NOT_FOUND"):
        read("a", shape, "float32")


@pytest.mark.parametrize("reader", [0, 1], ids=["fast", "tensorstore"])
def test_missing_or_mismatching_metadata(tmp_path: Path, reader: int) -> None:
    read = _readers(tmp_path)[reader]
    write_arrays_local(tmp_path, {"a": np.zeros((2, 3), np.float32)})
    with pytest.raises(CorruptDataError, match="'a'"):
        read("a", (3, 2), "float32")
    with pytest.raises(CorruptDataError, match="'a'"):
        read("a", (2, 3), "int32")
    with pytest.raises(CorruptDataError, match="'nope'"):
        read("nope", (2, 3), "float32")
    (tmp_path / "a" / "zarr.json").write_bytes(b"{not json")
    with pytest.raises(CorruptDataError, match="'a'"):
        read("a", (2, 3), "float32")


def test_fast_reader_refuses_other_layouts(tmp_path: Path) -> None:
    meta = tmp_path / "a" / "zarr.json"
    write_arrays_local(tmp_path, {"a": np.zeros((2, 3), np.float32)})
    good = json.loads(meta.read_bytes())
    for change in [
        {"codecs": [{"name": "bytes", "configuration": {"endian": "big"}}]},
        {"codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "gzip"}]},
        {"chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, 3]}}},
        {"chunk_key_encoding": {"name": "v2"}},
        {"chunk_key_encoding": {"name": "default"}},
        {"zarr_format": 2},
        {"storage_transformers": [{"name": "x"}]},
    ]:
        meta.write_text(json.dumps({**good, **change}))
        with pytest.raises(CorruptDataError, match="zarr metadata"):
            read_array_local(tmp_path, "a", (2, 3), np.float32)
    meta.write_text(json.dumps(good))
    read_array_local(tmp_path, "a", (2, 3), np.float32)


# ----------------------------------------------------------------- disk full


def test_enospc_fast_path_removes_partial_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] >= 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, memoryview(data)[:10])  # short writes first

    (tmp_path / "keep").write_bytes(b"old")
    monkeypatch.setattr(local_mod.os, "write", failing_write)
    with pytest.raises(DiskFullError) as info:
        write_arrays_local(tmp_path, {"ctx/a": np.ones(100, np.float32), "ctx/b": np.ones(3)})
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert _files(tmp_path) == ["keep"] and sorted(os.listdir(tmp_path)) == ["keep"]


def test_disk_full_names_a_bundle_written_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(local_mod.os, "write", full)
    monkeypatch.setattr(local_mod.os, "writev", full)
    with pytest.raises(DiskFullError) as info:  # no array of its own: once "writing  under"
        write_arrays_local(tmp_path, {}, files={"ctx/bundle.zip": b"x" * 100})
    assert f"disk full while writing 'ctx/bundle.zip' under {str(tmp_path)!r}:" in str(info.value), info.value
    assert "  " not in str(info.value)


def test_tensorstore_disk_full_error_is_classified() -> None:
    e = ValueError(
        "OUT_OF_RANGE: Error writing local file \"x\": File too large [os_error_code='27']"
    )
    assert isinstance(kv_errors.convert_write_error(e, "array 'x'"), DiskFullError)
    e = ValueError("RESOURCE_EXHAUSTED: No space left on device [os_error_code=28]")
    assert kv_errors.convert_write_error(e, "a").errno == errno.ENOSPC
    e = ValueError("INVALID_ARGUMENT: whatever")
    assert kv_errors.convert_write_error(e, "a") is e


_EFBIG_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    import numpy as np
    from residual_store_serializers import DiskFullError, write_arrays, write_arrays_kv, write_arrays_local
    from zarr3_reference import write_array

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
    root = sys.argv[1]
    big = np.ones(1 << 18, np.float32)  # 1 MiB, over the 64 KiB limit
    small = np.ones(16, np.float32)
    results = {}
    for name, write in [
        ("fast", lambda: write_arrays_local(root + "/fast", {"ctx/a": big}, fsync=True)),
        ("fast_batch", lambda: __import__("residual_store_serializers").write_arrays_local(
            root + "/fast_batch", {"s": small, "b": big})),
        ("ts", lambda: write_array({"driver": "file", "path": root + "/ts"}, "ctx/a", big)),
        ("ts_batch", lambda: write_arrays({"driver": "file", "path": root + "/ts_batch"},
                                          {"s": small, "b": big})),
        ("kv", lambda: write_arrays_kv({"driver": "file", "path": root + "/kv"}, {"ctx/a": big})),
        ("kv_batch", lambda: write_arrays_kv({"driver": "file", "path": root + "/kv_batch"},
                                             {"s": small, "b": big})),
    ]:
        try:
            write()
            results[name] = "no error"
        except DiskFullError as e:
            results[name] = ["DiskFullError", e.errno]
        except BaseException as e:
            results[name] = [type(e).__name__, str(e)]
    left = sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
    )
    print(json.dumps({"results": results, "left": left}))
    """
)


@pytest.mark.subprocess
def test_serializers_imports_neither_jax_nor_residual_store() -> None:
    repo = Path(__file__).resolve().parents[1]
    code = "import sys, residual_store_serializers; print(sorted(m for m in sys.modules if m.split('.')[0] in "
    code += "('jax', 'jaxlib', 'residual_store')))"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=repo,
        check=True,
    )
    assert proc.stdout.strip() == "[]", proc.stdout
    # numpy imports pickle itself; what matters is that no serializer uses it.
    pickling = re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b|allow_pickle", re.M)
    for source in (repo / "residual_store_serializers").glob("*.py"):
        assert not pickling.search(source.read_text()), source


@pytest.mark.subprocess
def test_efbig_in_subprocess_raises_disk_full_and_leaves_nothing(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(repo), str(repo / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-c", _EFBIG_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("fast", "fast_batch", "ts", "ts_batch", "kv", "kv_batch"):
        assert report["results"][name] == ["DiskFullError", errno.EFBIG], report
    assert report["left"] == [], report


# ----------------------------------------------------------------- chunked arrays (one chunk per shard)


def _blocks(a: np.ndarray, cs: tuple[int, ...]) -> dict[tuple[int, ...], np.ndarray]:
    return {idx: a[chunk_region(idx, cs)] for idx in chunk_indices(a.shape, cs)}


def test_chunk_grid_helpers() -> None:
    assert check_chunk_shape((8, 6), None) == (8, 6)
    assert check_chunk_shape((0, 3), None) == (1, 3)
    assert chunk_grid((8, 6), (2, 3)) == (4, 2)
    assert chunk_indices((4, 6), (2, 3)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert chunk_indices((), ()) == [()]
    assert chunk_indices((0, 3), (1, 3)) == []
    assert chunk_index_key((1, 0)) == "c.1.0" and chunk_index_key(()) == "c"
    assert chunk_region((1, 2), (2, 3)) == (slice(2, 4), slice(6, 9))
    for shape, cs in [((5,), (2,)), ((4, 4), (2,)), ((4,), (0,)), ((4,), (-2,))]:
        with pytest.raises(ValueError):
            check_chunk_shape(shape, cs)
    # The default chunk shape leaves single-chunk metadata exactly as it was.
    for shape in SHAPES:
        assert encode_zarr_metadata(shape, "float32") == encode_zarr_metadata(
            shape, "float32", check_chunk_shape(shape, None)
        )
    assert zarr_metadata((8, 6), "int8", (2, 3))["chunk_grid"]["configuration"] == {
        "chunk_shape": [2, 3]
    }


@pytest.mark.parametrize("name", ["float32", "bfloat16", "bool", "int8", "complex64"])
@pytest.mark.parametrize(("shape", "cs"), [((8, 6), (2, 3)), ((8, 6), (8, 6)), ((16,), (4,)), ((4, 2, 6), (1, 2, 3))], ids=str)
def test_chunked_round_trip_both_paths_and_across(
    tmp_path: Path, name: str, shape: tuple[int, ...], cs: tuple[int, ...]
) -> None:
    a = _array(name, shape)
    blocks = _blocks(a, cs)
    write_chunks_local(tmp_path, "fast/x", shape, name, cs, blocks, fsync=True)
    write_chunks(_kv(tmp_path), "ts/x", shape, name, cs, blocks)
    fast, tsd = tmp_path / "fast" / "x", tmp_path / "ts" / "x"
    keys = sorted(["zarr.json"] + [chunk_index_key(i) for i in blocks])
    assert _files(fast) == _files(tsd) == keys
    assert (fast / "zarr.json").read_bytes() == (tsd / "zarr.json").read_bytes()
    assert json.loads((tsd / "zarr.json").read_bytes()) == zarr_metadata(shape, name, cs)
    for idx, block in blocks.items():
        assert (fast / chunk_index_key(idx)).read_bytes() == block.tobytes()
        assert (tsd / chunk_index_key(idx)).read_bytes() == block.tobytes()
        for written in ("fast/x", "ts/x"):
            got = read_chunk_local(tmp_path, written, shape, name, cs, idx)
            assert got.ctypes.data % 64 == 0 and got.flags.writeable
            _same_bits(got, np.ascontiguousarray(block))
            _same_bits(read_chunk(_kv(tmp_path), written, shape, name, cs, idx), np.ascontiguousarray(block))
        # tensorstore reads the whole chunked array too
        _same_bits(read_array(_kv(tmp_path), "fast/x", shape, name), a)


def test_plain_zarr_reads_chunked_arrays(tmp_path: Path) -> None:
    register_zarr_dtypes()
    for name in ("float32", "bfloat16", "int32"):
        a = _array(name, (8, 6))
        write_chunks_local(tmp_path, f"f{name}", a.shape, name, (2, 3), _blocks(a, (2, 3)))
        write_chunks(_kv(tmp_path), f"t{name}", a.shape, name, (4, 6), _blocks(a, (4, 6)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for p in (f"f{name}", f"t{name}"):
                z = zarr.open_array(str(tmp_path / p), mode="r")
                _same_bits(np.asarray(z[...]), a)
    # and the other way round: a zarr-written chunked array, read chunk by chunk
    a = np.arange(48, dtype=np.float32).reshape(8, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z = zarr.create_array(
            str(tmp_path / "z"), shape=a.shape, dtype=a.dtype, chunks=(2, 3), compressors=None,
            fill_value=0, chunk_key_encoding={"name": "default", "separator": "."},
        )  # fmt: skip
        z[...] = a
    for idx, block in _blocks(a, (2, 3)).items():
        _same_bits(read_chunk_local(tmp_path, "z", a.shape, np.float32, (2, 3), idx), block)


@pytest.mark.parametrize("where", ["fast", "tensorstore", "memory"])
def test_several_writers_each_write_their_chunks(tmp_path: Path, where: str) -> None:
    """Chunks not given are left alone: writers (processes) holding disjoint shards fill one
    array between them; a missing chunk is an error, never zeros."""
    a = _array("float32", (4, 6))
    blocks = _blocks(a, (2, 3))
    first = {k: v for k, v in blocks.items() if k[0] == 0}
    second = {k: v for k, v in blocks.items() if k[0] == 1}
    kv = {"driver": "memory", "path": f"{tmp_path.name}/"} if where == "memory" else _kv(tmp_path)

    def write(part: dict, **kw: Any) -> None:
        if where == "fast":
            write_chunks_local(tmp_path, "x", a.shape, "float32", (2, 3), part, **kw)
        else:
            write_chunks(kv, "x", a.shape, "float32", (2, 3), part)

    def read(idx: tuple[int, int]) -> np.ndarray:
        if where == "fast":
            return read_chunk_local(tmp_path, "x", a.shape, "float32", (2, 3), idx)
        return read_chunk(kv, "x", a.shape, "float32", (2, 3), idx)

    write(first)
    with pytest.raises(CorruptDataError, match=r"c\.1\.0"):
        read((1, 0))
    write(second, **({"write_metadata": False} if where == "fast" else {}))
    for idx, block in blocks.items():
        _same_bits(read(idx), np.ascontiguousarray(block))
    if where != "memory":
        _same_bits(read_array(_kv(tmp_path), "x", a.shape, "float32"), a)


def test_chunked_arrays_in_batches_and_reused_in_place(tmp_path: Path) -> None:
    a, b = _array("float32", (4, 6), 1), _array("int16", (8,), 2)
    batch = {
        "d/a": ChunkedArray(a.shape, a.dtype, (2, 6), _blocks(a, (2, 6))),
        "d/b": b,
        "d/c": ChunkedArray(b.shape, b.dtype, (2,), _blocks(b, (2,))),
    }
    write_arrays_local(tmp_path, batch, fsync=True)
    write_arrays(_kv(tmp_path), {f"t{p[1:]}": v for p, v in batch.items()})
    for root in ("d", "t"):
        _same_bits(read_array(_kv(tmp_path), f"{root}/a", a.shape, a.dtype), a)
        _same_bits(read_array_local(tmp_path, f"{root}/b", b.shape, b.dtype), b)
        _same_bits(read_array(_kv(tmp_path), f"{root}/c", b.shape, b.dtype), b)
    inode = (tmp_path / "d" / "a" / "c.1.0").stat().st_ino
    a2 = a + 1
    write_arrays_local(tmp_path, {"d/a": ChunkedArray(a.shape, a.dtype, (2, 6), _blocks(a2, (2, 6)))}, reuse=True)
    assert (tmp_path / "d" / "a" / "c.1.0").stat().st_ino == inode  # overwritten in place
    _same_bits(read_array(_kv(tmp_path), "d/a", a.shape, a.dtype), a2)


def test_chunked_array_validation(tmp_path: Path) -> None:
    a = np.zeros((4, 6), np.float32)
    with pytest.raises(ValueError, match="edge chunks"):
        ChunkedArray((5, 6), np.float32, (2, 3), {})
    with pytest.raises(ValueError, match="outside the chunk grid"):
        ChunkedArray(a.shape, a.dtype, (2, 3), {(2, 0): a[:2, :3]})
    with pytest.raises(ValueError, match="expected"):
        ChunkedArray(a.shape, a.dtype, (2, 3), {(0, 0): a[:2, :2]})
    with pytest.raises(ValueError, match="expected"):
        ChunkedArray(a.shape, a.dtype, (2, 3), {(0, 0): a[:2, :3].astype(np.int32)})
    with pytest.raises(UnsupportedDTypeError):
        ChunkedArray((2,), "U3", (1,), {})
    with pytest.raises(ValueError):
        write_chunks(_kv(tmp_path), "x", (5,), np.float32, (2,), {})
    write_chunks_local(tmp_path, "x", a.shape, a.dtype, (2, 3), _blocks(a, (2, 3)))
    with pytest.raises(ValueError, match="outside"):
        read_chunk_local(tmp_path, "x", a.shape, a.dtype, (2, 3), (0, 2))
    assert repr(ChunkedArray(a.shape, a.dtype, (2, 3), {})) == "ChunkedArray(float32[4, 6], chunk_shape=[2, 3], 0 chunks)"


@pytest.mark.parametrize("reader", ["fast", "tensorstore"])
def test_chunked_corruption(tmp_path: Path, reader: str) -> None:
    a = _array("float32", (4, 6))
    write_chunks_local(tmp_path, "x", a.shape, "float32", (2, 3), _blocks(a, (2, 3)))

    def read(idx: tuple[int, int], cs: tuple[int, int] = (2, 3)) -> np.ndarray:
        if reader == "fast":
            return read_chunk_local(tmp_path, "x", a.shape, "float32", cs, idx)
        return read_chunk(_kv(tmp_path), "x", a.shape, "float32", cs, idx)

    chunk = tmp_path / "x" / "c.1.1"
    data = chunk.read_bytes()
    chunk.write_bytes(data[:-4])
    with pytest.raises(CorruptDataError, match=r"c\.1\.1"):
        read((1, 1))
    chunk.write_bytes(data + b"xx")
    with pytest.raises(CorruptDataError):
        read((1, 1))
    chunk.unlink()
    with pytest.raises(CorruptDataError, match=r"c\.1\.1"):
        read((1, 1))
    _same_bits(read((0, 1)), np.ascontiguousarray(a[0:2, 3:6]))
    # metadata for another chunk grid is refused
    with pytest.raises(CorruptDataError, match="chunk"):
        read((0, 0), (4, 3))


# ----------------------------------------------------------------- raw kvstore writer


def _file_bytes(root: Path) -> dict[str, bytes]:
    return {f: (root / f).read_bytes() for f in _files(root)}


def _collide(root: Path, key: str) -> None:
    """Makes a put of ``key`` under the file kvstore ``root`` fail: a folder holding a file is
    where the key's file would go (works as root too, unlike taking write permission away)."""
    (root / key).mkdir(parents=True)
    (root / key / "x").write_bytes(b"")


@pytest.mark.parametrize("name", ["float32", "bfloat16", "bool", "int8", "complex64", "uint64"])
def test_kv_writer_writes_the_local_writers_bytes(tmp_path: Path, name: str) -> None:
    a, m = _array(name, (2, 3), 1), _array(name, (8, 6), 2)
    arrays = {
        "p/a": a,
        "p/scalar": _array(name, (), 3),
        "p/empty": np.zeros((0, 3), SUPPORTED_DTYPES[name]),
        "p/t": a.T,  # not contiguous
        "p/m": ChunkedArray(m.shape, m.dtype, (2, 3), _blocks(m, (2, 3))),
        "p/whole": ChunkedArray(m.shape, m.dtype, (8, 6), _blocks(m, (8, 6))),
    }
    write_arrays_local(tmp_path / "local", arrays)
    write_arrays_kv(_kv(tmp_path / "kv"), arrays)
    local, kv = _file_bytes(tmp_path / "local"), _file_bytes(tmp_path / "kv")
    assert local == kv
    assert {f for f in kv if f.startswith("p/empty/")} == {"p/empty/zarr.json"}
    assert {f for f in kv if f.startswith("p/scalar/")} == {"p/scalar/c", "p/scalar/zarr.json"}
    assert len([f for f in kv if f.startswith("p/m/c.")]) == 8

    for p, want in [("p/a", a), ("p/scalar", arrays["p/scalar"]), ("p/t", np.ascontiguousarray(a.T))]:
        _same_bits(np.asarray(read_array(_kv(tmp_path / "kv"), p, want.shape, name)), want)
        _same_bits(read_array_local(tmp_path / "kv", p, want.shape, name), want)
    _same_bits(np.asarray(read_array(_kv(tmp_path / "kv"), "p/m", m.shape, name)), m)
    assert read_array(_kv(tmp_path / "kv"), "p/empty", (0, 3), name).shape == (0, 3)
    for idx, block in _blocks(m, (2, 3)).items():
        _same_bits(read_chunk(_kv(tmp_path / "kv"), "p/m", m.shape, name, (2, 3), idx), block)
        _same_bits(read_chunk_local(tmp_path / "kv", "p/m", m.shape, name, (2, 3), idx), block)

    if name in NUMPY_NAMES or name in _ZARR_FLOAT_NAMES:
        register_zarr_dtypes()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for p, want in [("p/a", a), ("p/m", m), ("p/whole", m)]:
                _same_bits(np.asarray(zarr.open_array(str(tmp_path / "kv" / p), mode="r")[...]), want)
            assert zarr.open_array(str(tmp_path / "kv" / "p/empty"), mode="r")[...].shape == (0, 3)


def test_kv_writer_puts_every_chunk_before_any_zarr_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = kv_mod._put_all
    phases: list[list[str]] = []

    def spy(kv: Any, items: Any, started: list[str], timeout: float | None = None) -> None:
        phases.append(sorted(items))
        if len(phases) == 2:  # a crash once the chunks are in, before any metadata
            raise KeyboardInterrupt
        real(kv, items, started, timeout)

    monkeypatch.setattr(kv_mod, "_put_all", spy)
    m = _array("float32", (4, 6))
    arrays = {"a": _array("int16", (3,)), "m": ChunkedArray(m.shape, m.dtype, (2, 6), _blocks(m, (2, 6)))}
    with pytest.raises(KeyboardInterrupt):
        write_arrays_kv(_kv(tmp_path), arrays, content_addressed=True)  # (which deletes nothing)
    assert phases == [["a/c.0", "m/c.0.0", "m/c.1.0"], ["a/zarr.json", "m/zarr.json"]]
    assert _files(tmp_path) == ["a/c.0", "m/c.0.0", "m/c.1.0"]  # chunks without metadata
    with pytest.raises(CorruptDataError, match="'a'"):  # no array, to any reader
        read_array(_kv(tmp_path), "a", (3,), "int16")


def test_kv_writer_failure_removes_its_own_keys_only(tmp_path: Path) -> None:
    kv = _kv(tmp_path)
    m = _array("float32", (4, 6))
    blocks = _blocks(m, (2, 3))
    write_arrays_kv(kv, {"x/m": ChunkedArray(m.shape, m.dtype, (2, 3), {(0, 1): blocks[(0, 1)]})}, write_metadata=False)
    _collide(tmp_path, "x/m/c.1.1")
    before = _files(tmp_path)
    mine = ChunkedArray(m.shape, m.dtype, (2, 3), {(0, 0): blocks[(0, 0)], (1, 1): blocks[(1, 1)]})
    with pytest.raises(ValueError, match=r"c\.1\.1"):
        write_arrays_kv(kv, {"x/a": _array("int32", (5,)), "x/m": mine, "x/s": np.float64(1)})
    assert _files(tmp_path) == before == ["x/m/c.0.1", "x/m/c.1.1/x"]  # the other writer's chunk stays
    assert not (tmp_path / "x" / "a").exists()
    # content-addressed: nothing deleted, so an array another writer completed stays whole
    write_arrays_kv(kv, {"w": np.arange(4.0)})
    with pytest.raises(ValueError):
        write_arrays_kv(kv, {"w": np.arange(4.0), "x/m": mine}, content_addressed=True)
    _same_bits(read_array(kv, "w", (4,), "float64"), np.arange(4.0))
    assert "x/m/zarr.json" not in _files(tmp_path) and "x/m/c.0.0" in _files(tmp_path)


def test_kv_writer_replaces_plain_arrays_but_not_other_chunks(tmp_path: Path) -> None:
    kv = _kv(tmp_path)
    m = _array("int32", (4, 6))
    write_arrays_kv(kv, {"a": ChunkedArray(m.shape, m.dtype, (2, 3), _blocks(m, (2, 3)))})
    write_arrays_kv(kv, {"a": m})  # another grid: no stale chunk may stay
    assert _files(tmp_path / "a") == ["c.0.0", "zarr.json"]
    _same_bits(read_array_local(tmp_path, "a", m.shape, "int32"), m)
    write_arrays_kv(kv, {"a": np.int32(7)})
    assert _files(tmp_path / "a") == ["c", "zarr.json"]
    write_arrays_kv(kv, {"a": np.zeros((0,), np.int32)})
    assert _files(tmp_path / "a") == ["zarr.json"]


@pytest.mark.parametrize("where", ["file", "memory"])
def test_kv_writers_of_disjoint_chunks_then_metadata(tmp_path: Path, where: str) -> None:
    """As a collective write does: each process puts its chunks without zarr.json; process 0 puts
    zarr.json once all are in, and only then is the array there."""
    ctx = ts.Context()
    kv = _kv(tmp_path) if where == "file" else {"driver": "memory", "path": "collective/"}
    m = _array("bfloat16", (4, 6))
    blocks = _blocks(m, (2, 3))

    def part(keep: Any) -> ChunkedArray:
        return ChunkedArray(m.shape, m.dtype, (2, 3), {i: b for i, b in blocks.items() if keep(i)})

    write_arrays_kv(kv, {"m": part(lambda i: i[0] == 0)}, context=ctx, write_metadata=False)
    write_arrays_kv(kv, {"m": part(lambda i: i[0] == 1)}, context=ctx, write_metadata=False)
    with pytest.raises(CorruptDataError):
        read_chunk(kv, "m", m.shape, "bfloat16", (2, 3), (0, 0), context=ctx)
    if where == "file":
        assert "m/zarr.json" not in _files(tmp_path) and len(_files(tmp_path)) == 4
    write_arrays_kv(kv, {"m": part(lambda i: False)}, context=ctx)
    _same_bits(np.asarray(read_array(kv, "m", m.shape, "bfloat16", context=ctx)), m)
    for idx, block in blocks.items():
        _same_bits(read_chunk(kv, "m", m.shape, "bfloat16", (2, 3), idx, context=ctx), block)


def test_kv_writer_memory_round_trip() -> None:
    arrays = {
        "r/a": _array("float16", (3, 4)),
        "r/s": _array("uint8", ()),
        "r/e": np.zeros((2, 0), np.float32),
        "r/b": _array("bool", (9,)),
    }
    kv = {"driver": "memory", "path": "kv-round-trip"}  # (no trailing slash)
    write_arrays_kv(kv, arrays)  # the default context, shared with the reader
    out = read_arrays(kv, {p: (a.shape, a.dtype) for p, a in arrays.items()})
    for p, a in arrays.items():
        _same_bits(np.asarray(out[p]), a)
    write_arrays_kv(kv, {"r/a": _array("float16", (6,), 5)})
    _same_bits(np.asarray(read_array(kv, "r/a", (6,), "float16")), _array("float16", (6,), 5))
    with pytest.raises(UnsupportedDTypeError):
        write_arrays_kv(kv, {"r/ok": np.zeros(2), "r/bad": np.array(["s"])})
    with pytest.raises(ValueError, match="unsafe"):
        write_arrays_kv(kv, {"../x": np.zeros(2)})
    with pytest.raises(CorruptDataError):  # nothing of the refused batches was written
        read_array(kv, "r/ok", (2,), "float64")


# ----------------------------------------------------------------- attributes and groups


def test_metadata_without_attributes_is_unchanged_and_with_them_deterministic() -> None:
    plain = encode_zarr_metadata((2, 3), "float32")
    assert encode_zarr_metadata((2, 3), "float32", None, None) == plain
    assert "attributes" not in zarr_metadata((2, 3), "float32")
    one = encode_zarr_metadata((2, 3), "float32", attributes={"b": [1, 2], "a": {"z": 1, "y": None}})
    other = encode_zarr_metadata((2, 3), "float32", attributes={"a": {"y": None, "z": 1}, "b": [1, 2]})
    assert one == other and json.loads(one) == {**json.loads(plain), "attributes": {"a": {"y": None, "z": 1}, "b": [1, 2]}}
    assert encode_zarr_metadata((2, 3), "float32", attributes={}) != plain  # an empty object is written
    assert group_metadata() == {"zarr_format": 3, "node_type": "group", "attributes": {}}
    assert encode_group_metadata({"k": "v", "a": 1}) == b'{"attributes":{"a":1,"k":"v"},"node_type":"group","zarr_format":3}'
    assert encode_group_metadata({}, no_members=True) == (
        b'{"attributes":{},"consolidated_metadata":{"kind":"inline","metadata":{},"must_understand":false},'
        b'"node_type":"group","zarr_format":3}'
    )
    for bad, err in [({"x": float("nan")}, ValueError), ({"x": object()}, ValueError), ({1: "x"}, TypeError)]:
        with pytest.raises(err):
            zarr_metadata((2,), "int8", attributes=bad)
        with pytest.raises(err):
            encode_group_metadata(bad)


def test_writers_write_attributes_and_every_reader_ignores_them(tmp_path: Path) -> None:
    a, m = _array("float32", (2, 3), 1), _array("bfloat16", (4, 6), 2)
    arrays = {"p/a": a, "p/m": ChunkedArray(m.shape, m.dtype, (2, 3), _blocks(m, (2, 3))), "p/s": np.int8(3)}
    attributes = {"p/a": {"name": "a", "index": 0}, "p/m": {"name": "m"}}
    write_arrays_local(tmp_path / "local", arrays, attributes=attributes)
    write_arrays_kv(_kv(tmp_path / "kv"), arrays, attributes=attributes)
    assert _file_bytes(tmp_path / "local") == _file_bytes(tmp_path / "kv")
    meta = json.loads((tmp_path / "local" / "p" / "a" / "zarr.json").read_bytes())
    assert meta["attributes"] == {"name": "a", "index": 0}
    assert "attributes" not in json.loads((tmp_path / "local" / "p" / "s" / "zarr.json").read_bytes())
    for root in (tmp_path / "local", tmp_path / "kv"):
        _same_bits(read_array_local(root, "p/a", a.shape, "float32"), a)
        _same_bits(np.asarray(read_array(_kv(root), "p/a", a.shape, "float32")), a)
        _same_bits(np.asarray(read_array(_kv(root), "p/m", m.shape, "bfloat16")), m)
        for idx, block in _blocks(m, (2, 3)).items():
            _same_bits(read_chunk_local(root, "p/m", m.shape, "bfloat16", (2, 3), idx), block)
            _same_bits(read_chunk(_kv(root), "p/m", m.shape, "bfloat16", (2, 3), idx), block)
        check_array_metadata_local(root, "p/m", m.shape, "bfloat16", (2, 3))
    write_arrays_local(tmp_path / "one", {"x": a}, attributes={"x": {"k": 1}})
    write_chunks_local(tmp_path / "one", "y", m.shape, m.dtype, (2, 3), _blocks(m, (2, 3)), attributes={"k": 2})
    for p, k in (("x", 1), ("y", 2)):
        assert json.loads((tmp_path / "one" / p / "zarr.json").read_bytes())["attributes"] == {"k": k}


def test_bad_attributes_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    arrays = {"a": np.zeros(3, np.float32), "b": np.ones(2, np.int8)}
    for bad in ({"a": {"x": float("inf")}}, {"c": {"x": 1}}, {"b": {"x": {1, 2}}}):
        with pytest.raises(ValueError):
            write_arrays_local(tmp_path / "local", arrays, attributes=bad)
        with pytest.raises(ValueError):
            write_arrays_kv(_kv(tmp_path / "kv"), arrays, attributes=bad)
    assert not (tmp_path / "local").exists() and _files(tmp_path) == []


def test_reuse_rewrites_zarr_json_only_when_its_bytes_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, m = _array("float32", (2, 3), 1), _array("int16", (4, 6), 2)

    def batch(seed: int) -> dict[str, Any]:
        m2 = m + seed
        return {"a": a + seed, "e": np.zeros((0, 2), np.int8), "m": ChunkedArray(m.shape, m.dtype, (2, 3), _blocks(m2, (2, 3)))}

    first = {"a": {"v": 1}, "e": {"v": 1}, "m": {"v": 1}}
    write_arrays_local(tmp_path, batch(0), attributes=first)
    written: list[str] = []
    real = local_mod.write_file

    def spy(p: str, *args: Any, **kwargs: Any) -> None:
        written.append(os.path.relpath(p, tmp_path))
        real(p, *args, **kwargs)

    monkeypatch.setattr(local_mod, "write_file", spy)
    write_arrays_local(tmp_path, batch(1), reuse=True, attributes=first)  # same attributes
    assert written == []  # every chunk overwritten in place, no zarr.json rewritten
    _same_bits(read_array_local(tmp_path, "a", a.shape, "float32"), a + 1)
    second = {"a": {"v": 2}, "m": {"v": 2}}  # "e" loses its attributes
    write_arrays_local(tmp_path, batch(2), reuse=True, attributes=second)
    assert sorted(written) == ["a/zarr.json", "e/zarr.json", "m/zarr.json"]
    for p, want in (("a", {"v": 2}), ("m", {"v": 2})):
        assert json.loads((tmp_path / p / "zarr.json").read_bytes())["attributes"] == want
    assert (tmp_path / "e" / "zarr.json").read_bytes() == encode_zarr_metadata((0, 2), "int8")
    _same_bits(read_array_local(tmp_path, "a", a.shape, "float32"), a + 2)
    _same_bits(np.asarray(read_array(_kv(tmp_path), "m", m.shape, "int16")), m + 2)


def test_reuse_with_keep_metadata_neither_reads_nor_writes_zarr_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = _array("float32", (2, 3), 1), _array("int16", (5,), 2)
    attrs = {"a": {"v": 1}, "b": {"v": 1}}
    write_arrays_local(tmp_path, {"a": a, "b": b}, attributes=attrs)
    before = {p: (tmp_path / p / "zarr.json").read_bytes() for p in ("a", "b")}
    touched: list[str] = []
    for name in ("write_file", "_holds"):
        real = getattr(local_mod, name)

        def spy(p: str, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            touched.append(os.path.relpath(p, tmp_path))
            return _real(p, *args, **kwargs)

        monkeypatch.setattr(local_mod, name, spy)
    write_arrays_local(tmp_path, {"a": a + 1, "b": b + 1}, reuse=True, keep_metadata=True, attributes=attrs)
    assert touched == []  # chunks overwritten in place; no zarr.json opened
    assert {p: (tmp_path / p / "zarr.json").read_bytes() for p in ("a", "b")} == before
    _same_bits(read_array_local(tmp_path, "a", a.shape, "float32"), a + 1)
    _same_bits(read_array_local(tmp_path, "b", b.shape, "int16"), b + 1)


def test_read_arrays_local_reads_in_order_and_names_the_first_bad_array(tmp_path):
    """Arrays of one folder read in one call, each checksum verified; a bad checksum or a
    folder that is a symbolic link fails naming that array, whatever came before it."""
    rng = np.random.default_rng(7)
    arrays = {f"ctx/{i}": rng.standard_normal((3 + i, 5)).astype(np.float32) for i in range(4)}
    write_arrays_local(tmp_path, arrays)
    items = [(p, a.shape, "float32", checksum(a)) for p, a in arrays.items()]
    for got, want in zip(read_arrays_local(tmp_path, items), arrays.values()):
        _same_bits(got, want)
        assert got.ctypes.data % 64 == 0
    wrong = list(items)
    wrong[2] = (*wrong[2][:3], checksum(arrays["ctx/1"]))
    with pytest.raises(CorruptDataError, match="'ctx/2'"):
        read_arrays_local(tmp_path, wrong)
    os.rename(tmp_path / "ctx" / "3", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "ctx" / "3")
    with pytest.raises(CorruptDataError, match="symbolic link"):
        read_arrays_local(tmp_path, items)
