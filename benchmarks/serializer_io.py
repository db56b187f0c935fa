"""How much the array serializers cost over raw file I/O, and what checksums add.

One run writes and reads 12 arrays of mixed sizes and dtypes, totalling 4 MiB and
then 64 MiB, through:

* the fast local path (``write_arrays_local`` / ``read_array_local``),
* the tensorstore zarr3 path (``write_arrays`` / ``read_arrays``, all arrays at
  once), with tensorstore's default fsync-on-write and with ``file_io_sync`` off,

and compares each with raw numpy doing the same work: ``ndarray.tofile`` into one
file per array (plus ``os.fsync`` for the durable rows), and ``readinto`` into a
preallocated buffer. Ratios are time / baseline time (1.00 = as fast as raw numpy).
The "zarr-like folders" row is raw ``tofile`` into the same nested folders as
the zarr layout (``arrays/i/c/0/0``): creating folders costs, on some file
systems, as much as writing megabytes. Reads are from the page cache (the files
were just written), so they measure CPU cost, not the disk. The checksum row is
the time to checksum all 12 arrays as a fraction of the fast read time. Small
writes are dominated by file-system metadata and vary a lot between runs on a
shared machine.

Usage: ``python benchmarks/serializer_io.py [--dir DIR] [--repeats N]``; under a
minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import tensorstore as ts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import timed  # noqa: E402

from residual_store_serializers import (  # noqa: E402
    checksum,
    read_array_local,
    read_arrays,
    write_arrays,
    write_arrays_local,
)

# Relative sizes of the 12 arrays, and their dtypes: a few big weights, small biases.
_WEIGHTS = [40, 20, 10, 10, 6, 4, 3, 2, 2, 1, 1, 1]
_DTYPES = [np.float32, ml_dtypes.bfloat16, np.float32, np.int32, np.float16, np.float32,
           ml_dtypes.bfloat16, np.float32, np.int8, np.float32, np.float64, np.bool_]  # fmt: skip


def make_arrays(total_bytes: int) -> dict[str, np.ndarray]:
    """12 arrays of mixed sizes and dtypes whose sizes sum to about ``total_bytes``."""
    rng = np.random.default_rng(0)
    out = {}
    for i, (w, dt) in enumerate(zip(_WEIGHTS, _DTYPES, strict=False)):
        d = np.dtype(dt)
        n = max(1, total_bytes * w // sum(_WEIGHTS) // d.itemsize)
        raw = rng.integers(0, 256 if d != np.bool_ else 2, n * d.itemsize, dtype=np.uint8)
        out[f"arrays/{i}"] = raw.view(d).reshape(-1, 8) if n % 8 == 0 else raw.view(d)
    return out


def raw_write(root: Path, arrays: dict[str, np.ndarray], fsync: bool) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i, a in enumerate(arrays.values()):
        p = root / f"{i}.bin"
        with open(p, "wb") as f:
            a.tofile(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    if fsync:
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def raw_write_nested(root: Path, arrays: dict[str, np.ndarray]) -> None:
    """``tofile`` into the folders of the zarr layout: what the layout alone costs."""
    for i, a in enumerate(arrays.values()):
        folder = root / f"arrays/{i}/c/0"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "0", "wb") as f:
            a.tofile(f)


def raw_read(root: Path, arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    out = []
    for i, a in enumerate(arrays.values()):
        buf = np.empty(a.shape, a.dtype)
        with open(root / f"{i}.bin", "rb", buffering=0) as f:
            f.readinto(memoryview(buf.reshape(-1).view(np.uint8)))
        out.append(buf)
    return out


def run(total_bytes: int, base: Path, repeats: int) -> list[tuple[str, float, float]]:
    """Returns (operation, seconds, baseline seconds) rows for one total size."""
    arrays = make_arrays(total_bytes)
    specs = {p: (a.shape, a.dtype) for p, a in arrays.items()}
    nosync = ts.Context({"file_io_sync": False})
    synced = ts.Context()  # tensorstore's default: fsync on write

    def fresh(name: str) -> Callable[[], None]:
        return lambda: shutil.rmtree(base / name, ignore_errors=True)

    def noop() -> None:
        return None

    kv = {"driver": "file", "path": str(base / "ts")}
    kv_sync = {"driver": "file", "path": str(base / "ts_sync")}
    rows = []
    t_raw_w = timed(lambda: raw_write(base / "raw", arrays, False), fresh("raw"), repeats)
    t_raw_ws = timed(lambda: raw_write(base / "raws", arrays, True), fresh("raws"), repeats)
    t_raw_r = timed(lambda: raw_read(base / "raw", arrays), noop, repeats)

    t = timed(lambda: raw_write_nested(base / "rawn", arrays), fresh("rawn"), repeats)
    rows.append(("raw tofile into zarr-like folders", t, t_raw_w))
    t = timed(lambda: write_arrays_local(base / "fast", arrays), fresh("fast"), repeats)
    rows.append(("fast write", t, t_raw_w))
    t = timed(
        lambda: write_arrays_local(base / "fasts", arrays, fsync=True), fresh("fasts"), repeats
    )
    rows.append(("fast write, fsync", t, t_raw_ws))
    t = timed(lambda: write_arrays(kv, arrays, context=nosync), fresh("ts"), repeats)
    rows.append(("tensorstore write, no fsync", t, t_raw_w))
    t = timed(lambda: write_arrays(kv_sync, arrays, context=synced), fresh("ts_sync"), repeats)
    rows.append(("tensorstore write, fsync (default)", t, t_raw_ws))

    t_fast_r = timed(
        lambda: [read_array_local(base / "fast", p, *s) for p, s in specs.items()], noop, repeats
    )
    rows.append(("fast read", t_fast_r, t_raw_r))
    t = timed(
        lambda: [
            read_array_local(base / "fast", p, *s, check_metadata=False) for p, s in specs.items()
        ],
        noop,
        repeats,
    )
    rows.append(("fast read, no metadata check", t, t_raw_r))
    t = timed(lambda: read_arrays(kv, specs, context=nosync), noop, repeats)
    rows.append(("tensorstore read", t, t_raw_r))
    t = timed(lambda: [checksum(a) for a in arrays.values()], noop, repeats)
    rows.append(("checksum all (vs fast read)", t, t_fast_r))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="folder to write in (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="serializer_io_"))
    base.mkdir(parents=True, exist_ok=True)
    print(
        f"12 arrays, mixed sizes and dtypes, in {base}; median of {args.repeats}; "
        f"ratio = time / raw numpy time (tofile / readinto; +fsync for fsync rows)"
    )
    header = f"{'total':>7}  {'operation':<36}{'ms':>9}{'raw ms':>9}{'ratio':>8}{'GB/s':>8}"
    print(header)
    print("-" * len(header))
    try:
        for mib in (4, 64):
            total = mib << 20
            for op, t, t0 in run(total, base / f"{mib}MiB", args.repeats):
                times = f"{t * 1e3:>9.2f}{t0 * 1e3:>9.2f}"
                print(f"{mib:>4}MiB  {op:<36}{times}{t / t0:>8.2f}{total / t / 1e9:>8.2f}")
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
