"""One bundle per context against one folder per array, on the contexts users make.

A model written with its layers unrolled in Python makes contexts of hundreds of small residuals.
This script writes and reads such contexts, durably (every file fdatasynced, every folder that
gained an entry fsynced), three ways, and prints each as a ratio to the floor:

* **folders**: today's layout, one zarr v3 array folder per residual (``write_arrays_local``,
  ``read_arrays_local`` with each array's checksum);
* **bundle**: every residual in one zip of stored entries (``serializers.bundle``), written with
  ``writev`` from the arrays' own buffers (``write_file_local``), read with one bounded read and a
  whole-file checksum (``read_file_exact_local``), arrays as views (``bundle_views``);
  ``bundle+check`` also checks each array's CRC-32 and every header byte (``check_bundle``, what
  ``verify`` does);
* **raw**: the floor, the same bytes as one file written and fdatasynced, its folder fsynced, and
  read back with one ``readinto``.

Contexts: the 16- and 64-block stacks of the issue (13 residuals a block, ``(8, 64)`` float32),
the 24-block stack (d=256, batch 128: 313 residuals of 27 MiB) and a few large residuals
(4 x 16 MiB), for the rule of where large residuals go. Reads are from the page cache (CPU cost).

Usage: ``python benchmarks/bundle_formats.py [--dir DIR] [--repeats N]``; about a minute.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import timed  # noqa: E402

from residual_store_serializers import checksum, read_arrays_local, write_arrays_local  # noqa: E402
from residual_store_serializers.bundle import bundle_layout, bundle_parts, bundle_views, check_bundle, crc_checksum  # noqa: E402
from residual_store_serializers.checksums import checksum_parts  # noqa: E402
from residual_store_serializers.local import fsync_folder_local, read_file_exact_local, sync_data, write_file_local  # noqa: E402


def stack(blocks: int, d: int, batch: int, per_block: int = 13) -> list[np.ndarray]:
    """The residuals of an unrolled stack: ``per_block`` float32 arrays per block, mostly
    ``(batch, d)``, one ``(batch, 4 d)`` (the MLP's hidden activation), and per-row statistics."""
    rng = np.random.default_rng(0)
    shapes = [(batch, d)] * (per_block - 3) + [(batch, 4 * d), (batch, 1), (batch, 1)]
    return [rng.standard_normal(s).astype(np.float32) for _ in range(blocks) for s in shapes]


def contexts() -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(1)
    return {
        "16 blocks (d=64, batch 8)": stack(16, 64, 8),
        "64 blocks (d=64, batch 8)": stack(64, 64, 8),
        "24 blocks (d=256, batch 128)": stack(24, 256, 128)[:313],
        "4 large (16 MiB each)": [rng.standard_normal((2048, 2048)).astype(np.float32) for _ in range(4)],
    }


def run(root: Path, arrays: list[np.ndarray], repeats: int) -> dict[str, float]:
    paths = {f"c/{i}": a for i, a in enumerate(arrays)}
    sums = [checksum(a) for a in arrays]
    layout = bundle_layout([(str(i), a.shape, a.dtype) for i, a in enumerate(arrays)], [{"index": i} for i in range(len(arrays))])
    raw = b"".join(a.tobytes() for a in arrays)
    state: dict[str, object] = {}

    def fresh() -> None:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)

    def folders_write() -> None:
        write_arrays_local(root, paths, fsync=True)

    def bundle_write() -> None:
        parts, crcs = bundle_parts(layout, arrays)
        state["whole"] = checksum_parts(parts)
        state["crcs"] = [crc_checksum(c) if w.nbytes else None for c, w in zip(crcs, layout.arrays)]
        write_file_local(root, "c/bundle.zip", parts, fsync=True)

    def raw_write() -> None:
        os.makedirs(root / "c", exist_ok=True)
        fd = os.open(root / "c" / "raw", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, raw)
            sync_data(fd)
        finally:
            os.close(fd)
        fsync_folder_local(str(root / "c"))

    out = {
        "folders put": timed(folders_write, fresh, repeats),
        "bundle put": timed(bundle_write, fresh, repeats),
        "raw put": timed(raw_write, fresh, repeats),
    }
    fresh()
    folders_write()
    bundle_write()
    raw_write()
    folder_specs = [(p, a.shape, a.dtype, s) for (p, a), s in zip(paths.items(), sums)]
    buf = bytearray(len(raw))

    def raw_read() -> None:
        with open(root / "c" / "raw", "rb", buffering=0) as f:
            f.readinto(buf)

    def bundle_read(check: bool) -> Callable[[], object]:
        def read() -> object:
            data = read_file_exact_local(root, "c/bundle.zip", layout.nbytes, checksum=state["whole"])
            if check:
                check_bundle(layout, data, state["crcs"], what="bench")
            return bundle_views(layout.arrays, data)

        return read

    out |= {
        "folders get": timed(lambda: read_arrays_local(root, folder_specs), lambda: None, repeats),
        "bundle get": timed(bundle_read(False), lambda: None, repeats),
        "bundle+check get": timed(bundle_read(True), lambda: None, repeats),
        "raw get": timed(raw_read, lambda: None, repeats),
    }
    views = bundle_read(True)()
    assert all(v.tobytes() == a.tobytes() for v, a in zip(views, arrays)), "bundle read back differs"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="rs-bench-bundle-", dir=args.dir))
    try:
        print(f"{'context':30} {'arrays':>6} {'MiB':>7} | {'put: folders/raw':>16} {'bundle/raw':>10} "
              f"{'files':>9} | {'get: folders/raw':>16} {'bundle/raw':>10} {'+check/raw':>10} | raw put, get ms")
        for name, arrays in contexts().items():
            t = run(base / "c", arrays, args.repeats)
            mib = sum(a.nbytes for a in arrays) / 2**20
            print(
                f"{name:30} {len(arrays):>6} {mib:>7.2f} | {t['folders put'] / t['raw put']:>15.1f}x "
                f"{t['bundle put'] / t['raw put']:>9.2f}x {2 * len(arrays):>4} vs 1 | "
                f"{t['folders get'] / t['raw get']:>15.1f}x {t['bundle get'] / t['raw get']:>9.2f}x "
                f"{t['bundle+check get'] / t['raw get']:>9.2f}x | {t['raw put'] * 1e3:.2f}, {t['raw get'] * 1e3:.2f}"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
