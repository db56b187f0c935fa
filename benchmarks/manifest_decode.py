"""What decoding and validating a context manifest costs: the hand-written schema checks that
``serializers.manifest`` had before msgspec, against the msgspec structs it has now.

A manifest is decoded and validated on every get of a stored context, so its cost is paid per
read. One run builds sealed context manifests of 10, 200 and 1000 array records (single-chunk
and chunked records, as a store writes them), then times :func:`decode_manifest` of each
(msgpack decode, seal check, field validation) with both implementations, round-robin, and
prints one table: median milliseconds and the ratio old / new (above 1: msgspec is faster).
Both read the same bytes; the new one must accept them and return the same map. The
"fields" columns time the part that changed alone: checking the decoded map's fields (the old
``_check_fields`` against msgspec's :func:`~serializers.manifest_schema.validate_fields`); the
rest (msgpack decoding with its caps, the seal) is the same code in both.

The old implementation is the module as it was at ``--old-rev`` (default: the commit before the
change), loaded from ``git show`` into a temporary file.

Usage: ``python benchmarks/manifest_decode.py [--repeats N] [--old-rev REV]``; seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import Case, interleaved_medians  # noqa: E402

from residual_store_serializers import manifest as new  # noqa: E402
from residual_store_serializers.manifest_schema import ContextFields, validate_fields  # noqa: E402

OLD_REV = "49c70b8"  # the last commit with the hand-written schema language
SIZES = (10, 200, 1000)


def old_module(rev: str) -> ModuleType:
    """The manifest module as it was at ``rev`` (then ``serializers/manifest.py``, since renamed
    ``residual_store_serializers/``), imported as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:serializers/manifest.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "old_manifest.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_manifest", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it is executed
    spec.loader.exec_module(module)
    return module


def records(n: int) -> list[dict[str, Any]]:
    """``n`` array records as a store writes them: every fourth one chunked on a 2x2 grid."""
    out = []
    for i in range(n):
        record: dict[str, Any] = {
            "name": f"tanh model.py:{i}",
            "path": f"data/k.{i}/{i}",
            "shape": [64, 128],
            "dtype": "float32",
            "nbytes": 64 * 128 * 4,
            "checksum": "xxh3_64:0123456789abcdef",
            "input_path": None,
            "shared": False,
        }
        if i % 4 == 3:
            sums = [((a, b), f"xxh3_64:{a:08x}{b:08x}") for a in range(2) for b in range(2)]
            record["chunk_shape"] = [32, 64]
            record["chunk_checksums"] = [[list(idx), cs] for idx, cs in sums]
            record["checksum"] = new.chunked_checksum(sums)
        out.append(record)
    return out


def manifest(n: int) -> bytes:
    """A sealed context manifest of ``n`` records."""
    return new.encode_manifest({
        "key": "k",
        "signature": "rs2-" + "0" * 32,
        "created": 1700000000.25,
        "jax_version": "0.10.2",
        "spec": {"treedef": b"\x00" * 200, "names": [f"r{i}" for i in range(n)]},
        "arrays": records(n),
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--old-rev", default=OLD_REV)
    args = parser.parse_args()
    old = old_module(args.old_rev)
    print(f"decode + validate one context manifest (median of {args.repeats}); old: {args.old_rev}")
    print(
        f"{'records':>8} {'bytes':>9} {'old ms':>9} {'msgspec ms':>11} {'old/new':>8}"
        f" {'fields old ms':>14} {'fields msgspec ms':>18} {'old/new':>8}"
    )
    for n in SIZES:
        data = manifest(n)
        doc = new.decode_manifest(data, what="m")
        assert old.decode_manifest(data, what="m") == doc
        times = interleaved_medians(
            {
                "old": Case(lambda: old.decode_manifest(data, what="m")),
                "new": Case(lambda: new.decode_manifest(data, what="m")),
                "old fields": Case(lambda: old._check_fields(doc, old.CONTEXT_SCHEMA.fields, "")),
                "new fields": Case(lambda: validate_fields(doc, ContextFields)),
            },
            args.repeats,
        )
        ms = {k: v * 1e3 for k, v in times.items()}
        print(
            f"{n:>8} {len(data):>9,} {ms['old']:>9.3f} {ms['new']:>11.3f} {ms['old'] / ms['new']:>8.2f}"
            f" {ms['old fields']:>14.3f} {ms['new fields']:>18.3f} {ms['old fields'] / ms['new fields']:>8.2f}"
        )

if __name__ == "__main__":
    main()
