"""The ``residual-store`` command line (also ``python -m residual_store``).

Commands: ``demo`` (the README's main job), ``ls``, ``inspect``, ``verify``, ``gc`` and ``du`` on
a store folder. Errors print one line on stderr and exit non-zero; ``--json`` gives scripts a
machine-readable form.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

__all__ = ["main"]

T = TypeVar("T")


class _UsageError(Exception):
    """A bad path or key: reported as one line on stderr."""


def _open_disk(path: str, *, read_only: bool = True) -> Any:
    """The store at ``path``: read-only for the commands that only read (nothing on disk
    changes, not even a marker), and never created."""
    from residual_store.errors import StoreNotFoundError
    from residual_store.store.disk import DiskTier

    try:
        return DiskTier(path, create=False, read_only=read_only)
    except StoreNotFoundError as err:
        raise _UsageError(str(err)) from None


def _progress(items: Sequence[T], label: str, enabled: bool) -> Iterable[T]:
    """Yields ``items``, drawing a progress line on stderr when it is a terminal."""
    show = enabled and sys.stderr.isatty() and len(items) > 1
    start = time.monotonic()
    for i, item in enumerate(items, 1):
        if show:
            sys.stderr.write(f"\r{label}: {i}/{len(items)} ({time.monotonic() - start:.1f} s)")
            sys.stderr.flush()
        yield item
    if show:
        sys.stderr.write("\n")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if getattr(args, "json", False) else text)


# -- commands ---------------------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    from residual_store.demo import DemoConfig, run_demo

    cfg = DemoConfig(steps=args.steps, n_microbatches=args.microbatches)
    result = run_demo(cfg, store_path=args.store, plot_path=None if args.no_plot else args.plot)
    worst = max(*result["max_rel_grad_diff"], result["zero_bubble"]["max_rel_grad_diff"])
    ok = worst < 1e-4
    print(f"gradient check against jax.grad: {'PASS' if ok else 'FAIL'} (max rel. diff {worst:.2e})")
    return 0 if ok else 1


def _backward_status(disk: Any, signature: str) -> dict[str, Any]:
    """Whether a backward of ``signature`` is stored, for which platforms and JAX, or why not."""
    from residual_store.errors import CorruptContextError
    from residual_store.store import backwards

    try:
        return backwards.describe(disk.backward_manifest(signature))
    except CorruptContextError as err:
        return {"stored": False, "reason": f"damaged: {err}"}


def _backward_text(status: dict[str, Any]) -> str:
    if status["stored"]:
        left = status["left_out"]
        note = f"; not for {', '.join(sorted(left))}" if left else ""
        return f"stored for {', '.join(status['platforms'])} (jax {status['jax_version']}{note})"
    return f"not stored: {status['reason']}"


def _cmd_ls(args: argparse.Namespace) -> int:
    from residual_store.errors import CorruptContextError

    disk = _open_disk(args.path)
    now = time.time()
    entries = []
    for key, stored in _progress(list(disk.iter_manifests()), "reading manifests", not args.json):
        if isinstance(stored, CorruptContextError):
            entries.append({"key": key, "error": str(stored)})
        else:
            entries.append(
                {
                    "key": key,
                    "signature": stored.spec.signature,
                    "residuals": len(stored.records),
                    "bytes": stored.nbytes,
                    "intermediate_bytes": sum(r.nbytes for r in stored.records if not r.shared),
                    "created": stored.created,
                }
            )
    statuses = {sig: _backward_status(disk, sig) for sig in sorted({e["signature"] for e in entries if "signature" in e})}
    rows = [["key", "residuals", "size", "own", "signature", "backward", "age"]]
    for e in entries:
        if "error" in e:
            rows.append([e["key"], "-", "-", "-", "CORRUPT", "-", e["error"]])
        else:
            status = statuses[e["signature"]]
            e["backward"] = status
            rows.append([
                e["key"], str(e["residuals"]), _human(e["bytes"]), _human(e["intermediate_bytes"]),
                e["signature"], ",".join(status["platforms"]) if status["stored"] else "no",
                _age(now - e["created"]),
            ])
    lines = [f"{len(entries)} contexts"] + [f"{sig}: backward {_backward_text(st)}" for sig, st in statuses.items()]
    _emit(args, entries, _table(rows) + "\n" + "\n".join(lines))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from residual_store.errors import ContextNotFoundError, InvalidKeyError
    from residual_store.store.keys import validate_key

    disk = _open_disk(args.path)
    try:
        stored = disk.stat(validate_key(args.key))
    except (ContextNotFoundError, InvalidKeyError) as err:
        raise _UsageError(str(err)) from None
    rows = [["#", "name", "shape", "dtype", "bytes", "kind", "shared", "chunks", "path"]]
    data = []
    for i, (record, aval, kind) in enumerate(zip(stored.records, stored.spec.avals, stored.spec.kinds)):
        item = {
            "index": i,
            "name": record.name,
            "shape": list(aval.shape),
            "dtype": str(aval.dtype),
            "bytes": record.nbytes,
            "kind": kind,
            "input_path": record.input_path,
            "shared": record.shared,
            "path": record.path,
            "checksum": record.checksum,
            "chunk_shape": list(record.chunk_shape) if record.chunk_shape is not None else None,
            "chunks": len(record.chunk_checksums) if record.chunk_checksums is not None else 1,
        }
        data.append(item)
        rows.append([
            str(i), record.name, str(tuple(aval.shape)), str(aval.dtype), f"{record.nbytes:,}",
            kind, "yes" if record.shared else "no", str(item["chunks"]), record.path,
        ])
    status = _backward_status(disk, stored.spec.signature)
    header = (
        f"context {stored.key}: signature {stored.spec.signature}, jax {stored.jax_version}, "
        f"{_human(stored.nbytes)}\nbackward: {_backward_text(status)}"
    )
    _emit(
        args,
        {"key": stored.key, "signature": stored.spec.signature, "backward": status, "residuals": data},
        header + "\n" + _table(rows),
    )
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from residual_store.errors import ContextNotFoundError, CorruptContextError, InvalidKeyError
    from residual_store.store import backwards
    from residual_store.store.keys import validate_key

    def store_damaged(err: CorruptContextError) -> int:  # the marker or a folder of the store
        _emit(args, {"damaged_store": str(err)}, f"DAMAGED store {args.path}: {err}")
        return 1

    try:
        disk = _open_disk(args.path)
    except CorruptContextError as err:
        return store_damaged(err)
    try:
        keys = [validate_key(k) for k in args.keys] if args.keys else disk.keys()
    except InvalidKeyError as err:
        raise _UsageError(str(err)) from None
    except CorruptContextError as err:
        return store_damaged(err)
    check_metadata = getattr(disk.backend, "check_metadata", None)  # zarr.json, for plain zarr
    damaged, checked = [], 0
    for key in _progress(keys, "verifying", not args.json):
        try:
            stored, _ = disk.read(key, place=False)
            if check_metadata is not None:
                for r in {r.path: r for r in stored.records}.values():
                    check_metadata(r.path, r.shape, r.dtype, r.chunk_shape)
            checked += 1
        except (CorruptContextError, ContextNotFoundError) as err:
            damaged.append({"key": key, "error": str(err)})
    # every stored backward too: a damaged one cannot be run by processes without the model
    try:
        signatures = disk.backward_signatures()
    except CorruptContextError as err:
        return store_damaged(err)
    broken = []
    for sig in _progress(signatures, "verifying backwards", not args.json):
        try:
            stored = disk.read_backward(sig)
            if stored is not None:
                backwards.check_records(sig, stored[0])
        except CorruptContextError as err:
            broken.append({"signature": sig, "error": str(err)})
    lines = [f"DAMAGED {d['key']}: {d['error']}" for d in damaged]
    lines += [f"DAMAGED backward {b['signature']}: {b['error']}" for b in broken]
    lines.append(
        f"{checked} of {len(keys)} contexts verified, {len(signatures) - len(broken)} of "
        f"{len(signatures)} stored backwards verified, {len(damaged) + len(broken)} damaged"
    )
    _emit(
        args,
        {"checked": len(keys), "ok": checked, "damaged": damaged, "backwards": len(signatures), "damaged_backwards": broken},
        "\n".join(lines),
    )
    return 1 if damaged or broken else 0


def _cmd_gc(args: argparse.Namespace) -> int:
    disk = _open_disk(args.path, read_only=False)
    removed = disk.gc(older_than=args.older_than)
    if removed.get("skipped_corrupt"):
        print(
            f"residual-store gc: {args.path} holds an unreadable manifest, so nothing was removed "
            "(it may reference anything); run `residual-store verify` and remove the damaged context",
            file=sys.stderr,
        )
        return 1
    _emit(
        args,
        removed,
        f"removed {removed['weights']} unreferenced weights, {removed['data']} data folders, "
        f"{removed['recycled']} recycled folders, {removed['backwards']} stored backwards and "
        f"{removed['temporary']} temporary files",
    )
    return 0


def _cmd_du(args: argparse.Namespace) -> int:
    from residual_store.store.records import StoredContext

    disk = _open_disk(args.path)
    per_sig: dict[str, dict[str, int]] = {}
    seen: set[str] = set()
    for _, stored in disk.iter_manifests():
        if not isinstance(stored, StoredContext):
            continue
        entry = per_sig.setdefault(
            stored.spec.signature, {"contexts": 0, "intermediate": 0, "input": 0, "weights": 0}
        )
        entry["contexts"] += 1
        for record, kind in zip(stored.records, stored.spec.kinds):
            if not record.shared:  # the context's own: intermediates and per-context inputs
                entry["input" if kind == "input" else "intermediate"] += record.nbytes
            elif record.path not in seen:
                seen.add(record.path)
                entry["weights"] += record.nbytes
    rows = [["signature", "contexts", "intermediate", "inputs", "weights (once)"]]
    for sig, e in sorted(per_sig.items()):
        rows.append([sig, str(e["contexts"]), _human(e["intermediate"]), _human(e["input"]), _human(e["weights"])])
    _emit(args, per_sig, _table(rows))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="residual-store",
        description="Split JAX forward from backward, with typed, storable residuals.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, run: Callable[[argparse.Namespace], int], json_flag: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(run=run)
        if json_flag:
            p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    demo = command("demo", "train a small transformer with a pipeline schedule", _cmd_demo)
    demo.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    demo.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    demo.add_argument("--store", default=None, help="store folder (default: a temporary one)")
    demo.add_argument("--plot", default="residual_store_demo.png", help="where to write the PNG")
    demo.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    command("ls", "list the contexts of a store", _cmd_ls, json_flag=True).add_argument("path")
    inspect = command("inspect", "one row per residual of a stored context", _cmd_inspect, json_flag=True)
    inspect.add_argument("path")
    inspect.add_argument("key")
    verify = command("verify", "check every checksum; exit 1 if anything is damaged", _cmd_verify, json_flag=True)
    verify.add_argument("path")
    verify.add_argument("keys", nargs="*", help="keys to check (default: all)")
    gc = command("gc", "remove weights, data and backwards no context needs", _cmd_gc, json_flag=True)
    gc.add_argument("path")
    gc.add_argument("--older-than", type=float, default=3600.0, metavar="SECONDS",
                    help="only remove what is at least this old (default 3600; 0: everything unreferenced)")
    command("du", "bytes per signature: intermediates, inputs, and weights once", _cmd_du, json_flag=True).add_argument("path")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except _UsageError as err:
        print(f"residual-store {args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
