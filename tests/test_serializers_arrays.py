"""Tests for serializers.arrays: both paths, cross-path, plain zarr, corruption, disk full."""

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

import serializers.arrays as arrays_mod
from serializers import (
    SUPPORTED_DTYPES,
    CorruptDataError,
    DiskFullError,
    UnsupportedDTypeError,
    aligned_empty,
    checksum,
    chunk_key,
    encode_zarr_metadata,
    local_root,
    read_array,
    read_array_async,
    read_array_local,
    read_arrays,
    register_zarr_dtypes,
    write_array,
    write_array_async,
    write_array_local,
    write_arrays,
    write_arrays_local,
    zarr_dtype_name,
)

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
    write_array_local(tmp_path, "fast/x", a)
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
        write_array_local(tmp_path, f"a{i}", np.ones(shape, np.float32))
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
        write_array_local(tmp_path, f"f{i}", x)
        write_array(_kv(tmp_path), f"t{i}", x)
        want = np.ascontiguousarray(x).astype("<f4")
        _same_bits(read_array_local(tmp_path, f"f{i}", x.shape, np.float32), want)
        _same_bits(read_array_local(tmp_path, f"t{i}", x.shape, np.float32), want)


def test_overwrite_with_another_rank_replaces_chunks(tmp_path: Path) -> None:
    for shape in [(2, 3), (6,), (), (2, 1, 3), (0,), (4,)]:
        a = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
        write_array_local(tmp_path, "a", a)
        _same_bits(read_array(_kv(tmp_path), "a", shape, np.int32), a)
        write_array(_kv(tmp_path), "b", a)
        _same_bits(read_array_local(tmp_path, "b", shape, np.int32), a)
    assert _files(tmp_path / "a") == ["c.0", "zarr.json"]


def test_unsupported_dtype_and_unsafe_path(tmp_path: Path) -> None:
    for bad in [np.array(["a"]), np.array([object()]), np.array([1], "datetime64[s]")]:
        with pytest.raises(UnsupportedDTypeError):
            write_array_local(tmp_path, "a", bad)
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
            write_array_local(tmp_path, path, np.zeros(1))
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


@pytest.mark.parametrize("name", NUMPY_NAMES + list(arrays_mod._ZARR_FLOAT_NAMES))
def test_plain_zarr_reads_what_both_paths_wrote(tmp_path: Path, name: str) -> None:
    zarr = pytest.importorskip("zarr")
    register_zarr_dtypes()
    a = _array(name, (3, 4))
    write_array_local(tmp_path, "f", a)
    write_array(_kv(tmp_path), "t", a)
    write_array_local(tmp_path, "s", np.float64(2.5))
    write_array(_kv(tmp_path), "e", np.zeros((0, 3), np.int16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr warns about some dtypes' spec status
        for p in ("f", "t"):
            z = zarr.open_array(str(tmp_path / p), mode="r")
            _same_bits(np.asarray(z[...]), a)
        assert zarr.open_array(str(tmp_path / "s"), mode="r")[()] == 2.5
        assert zarr.open_array(str(tmp_path / "e"), mode="r")[...].shape == (0, 3)


def test_fast_reader_reads_plain_zarr_output(tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
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
    write_array_local(tmp_path, "a", a)

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
    write_array_local(tmp_path, "a", np.zeros((2, 3), np.float32))
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
    write_array_local(tmp_path, "a", np.zeros((2, 3), np.float32))
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
    monkeypatch.setattr(arrays_mod.os, "write", failing_write)
    with pytest.raises(DiskFullError) as info:
        write_arrays_local(tmp_path, {"ctx/a": np.ones(100, np.float32), "ctx/b": np.ones(3)})
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert _files(tmp_path) == ["keep"] and sorted(os.listdir(tmp_path)) == ["keep"]


def test_tensorstore_disk_full_error_is_classified() -> None:
    e = ValueError(
        "OUT_OF_RANGE: Error writing local file \"x\": File too large [os_error_code='27']"
    )
    assert isinstance(arrays_mod._convert_write_error(e, "array 'x'"), DiskFullError)
    e = ValueError("RESOURCE_EXHAUSTED: No space left on device [os_error_code=28]")
    assert arrays_mod._convert_write_error(e, "a").errno == errno.ENOSPC
    e = ValueError("INVALID_ARGUMENT: whatever")
    assert arrays_mod._convert_write_error(e, "a") is e


_EFBIG_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    import numpy as np
    from serializers import DiskFullError, write_array, write_array_local, write_arrays

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
    root = sys.argv[1]
    big = np.ones(1 << 18, np.float32)  # 1 MiB, over the 64 KiB limit
    small = np.ones(16, np.float32)
    results = {}
    for name, write in [
        ("fast", lambda: write_array_local(root + "/fast", "ctx/a", big, fsync=True)),
        ("fast_batch", lambda: __import__("serializers").write_arrays_local(
            root + "/fast_batch", {"s": small, "b": big})),
        ("ts", lambda: write_array({"driver": "file", "path": root + "/ts"}, "ctx/a", big)),
        ("ts_batch", lambda: write_arrays({"driver": "file", "path": root + "/ts_batch"},
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
    code = "import sys, serializers; print(sorted(m for m in sys.modules if m.split('.')[0] in "
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
    for source in (repo / "serializers").glob("*.py"):
        assert not pickling.search(source.read_text()), source


@pytest.mark.subprocess
def test_efbig_in_subprocess_raises_disk_full_and_leaves_nothing(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", _EFBIG_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("fast", "fast_batch", "ts", "ts_batch"):
        assert report["results"][name] == ["DiskFullError", errno.EFBIG], report
    assert report["left"] == [], report
