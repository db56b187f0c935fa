"""The ``residual-store`` command line (also ``python -m residual_store``).

Commands: ``demo`` (the README's main job), and on a store (a folder, or a tensorstore kvstore
spec as JSON: ``'{"driver": "file", "path": "/data/s"}'``): ``ls``, ``inspect``, ``verify``,
``gc``, ``du``, ``rm``, ``export`` and ``diff``. The commands that only read open the store
read-only. Conventions: every error is one line on stderr and exit status 2 (``verify`` exits 1
when it finds damage); a closed pipe (``| head``) ends the output quietly; ``--json`` gives the
same facts, under the same words, as the text; sizes and ages are human-readable; progress is
drawn only on a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

__all__ = ["main"]

T = TypeVar("T")


class _UsageError(Exception):
    """A bad path or key: reported as one line on stderr."""


def _store_path(text: str) -> str | dict[str, Any]:
    """A folder, or a kvstore spec given as a JSON object."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as err:
        raise _UsageError(f"PATH looks like a kvstore spec but is not valid JSON ({err})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("driver"), str):
        raise _UsageError('a kvstore spec is a JSON object with a "driver", e.g. \'{"driver": "file", "path": "/data/s"}\'')
    return spec


def _open_disk(path: str, *, read_only: bool = True, timeout: float | None = None) -> Any:
    """The store at ``path``: read-only for the commands that only read (nothing on disk
    changes, not even a marker), and never created; ``timeout``: seconds each request to an
    object store may take."""
    from residual_store.errors import StoreNotFoundError
    from residual_store.store.disk import DiskTier

    try:
        return DiskTier(_store_path(path), create=False, read_only=read_only, timeout=timeout)
    except StoreNotFoundError as err:
        raise _UsageError(str(err)) from None


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float:
    """Seconds from ``"90"``, ``"90s"``, ``"15m"``, ``"1h"`` or ``"2d"`` (argparse type)."""
    t = text.strip().lower()
    scale = _DURATION_UNITS.get(t[-1:], None)
    number = t[:-1] if scale is not None else t
    try:
        value = float(number) * (scale or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: use seconds or 90s, 15m, 1h, 2d") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration is at least 0")
    return value


def _seconds(text: str) -> float:
    """A positive number of seconds (argparse type of ``--timeout``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a timeout is a positive number of seconds")
    return value


def _refuse_missing(disk: Any, missing: Sequence[str]) -> None:
    """One line naming the keys the store does not hold, if any."""
    if missing:
        raise _UsageError(
            f"no {'context' if len(missing) == 1 else 'contexts'} {', '.join(map(repr, missing))} in store {disk.description}"
        )


def _stored(disk: Any, key: str) -> Any:
    """The parsed manifest of ``key``, or a one-line error for an unknown or invalid key."""
    from residual_store.errors import ContextNotFoundError, InvalidKeyError
    from residual_store.store.keys import validate_key

    try:
        return disk.stat(validate_key(key))
    except (ContextNotFoundError, InvalidKeyError) as err:
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
    return f"{max(seconds, 0):.0f}s"


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

    disk = _open_disk(args.path, timeout=args.timeout)
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
                    "own_bytes": sum(r.nbytes for r in stored.records if not r.shared),
                    "created": stored.created,
                    "age": now - stored.created,
                }
            )
    statuses = {sig: _backward_status(disk, sig) for sig in sorted({e["signature"] for e in entries if "signature" in e})}
    rows = [["key", "residuals", "bytes", "own bytes", "signature", "backward", "age"]]
    for e in entries:
        if "error" in e:
            rows.append([e["key"], "-", "-", "-", "CORRUPT", "-", e["error"]])
        else:
            status = statuses[e["signature"]]
            e["backward"] = status
            rows.append([
                e["key"], str(e["residuals"]), _human(e["bytes"]), _human(e["own_bytes"]),
                e["signature"], ",".join(status["platforms"]) if status["stored"] else "no",
                _age(e["age"]),
            ])
    lines = [_plural(len(entries), "context")] + [f"{sig}: backward {_backward_text(st)}" for sig, st in statuses.items()]
    _emit(args, entries, _table(rows) + "\n" + "\n".join(lines))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    disk = _open_disk(args.path, timeout=args.timeout)
    stored = _stored(disk, args.key)
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
        disk = _open_disk(args.path, timeout=args.timeout)
    except CorruptContextError as err:
        return store_damaged(err)
    try:
        keys = [validate_key(k) for k in args.keys] if args.keys else disk.keys()
        missing = [k for k in keys if k not in disk]
    except InvalidKeyError as err:
        raise _UsageError(str(err)) from None
    except CorruptContextError as err:
        return store_damaged(err)
    _refuse_missing(disk, missing)
    check_metadata = getattr(disk.backend, "check_metadata", None)  # zarr.json, for plain zarr
    damaged, checked = [], 0
    for key in _progress(keys, "verifying", not args.json):
        try:
            stored, _ = disk.read(key, place=False)
            if check_metadata is not None:
                for r in {r.path: r for r in stored.records if not r.bundled}.values():
                    check_metadata(r.path, r.shape, r.dtype, r.chunk_shape)
            disk.check_bundle(key, stored)  # every byte, as plain zip readers will check it
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
        f"{checked} of {_plural(len(keys), 'context')} verified, {len(signatures) - len(broken)} of "
        f"{_plural(len(signatures), 'stored backward')} verified, {len(damaged) + len(broken)} damaged"
    )
    _emit(
        args,
        {
            "contexts": len(keys),
            "verified": checked,
            "damaged": damaged,
            "stored_backwards": len(signatures),
            "backwards_verified": len(signatures) - len(broken),
            "damaged_backwards": broken,
        },
        "\n".join(lines),
    )
    return 1 if damaged or broken else 0


_GC_KINDS = (
    ("weights", "unreferenced weight"),
    ("data", "unreferenced data folder"),
    ("recycled", "recycled folder"),
    ("backwards", "unneeded stored backward"),
    ("temporary", "temporary file"),
)


def _gc_items(removed: dict[str, int]) -> str:
    """``"1 unreferenced weight, 2 recycled folders"``, or ``"nothing"``."""
    return ", ".join(_plural(removed[k], word) for k, word in _GC_KINDS if removed[k]) or "nothing"


def _gc_text(removed: dict[str, int], older_than: float, dry_run: bool) -> str:
    freed = "" if removed["bytes"] <= 0 else f" ({_human(removed['bytes'])})"
    line = f"{'would remove' if dry_run else 'removed'} {_gc_items(removed)}{freed}"
    if removed["young"]:
        line += (
            f"; kept {_plural(removed['young'], 'unneeded item')} younger than {_age(older_than)} "
            "(writes in flight may need them; --older-than 0 removes them)"
        )
    return line


def _cmd_gc(args: argparse.Namespace) -> int:
    disk = _open_disk(args.path, timeout=args.timeout, read_only=args.dry_run)
    removed = disk.gc(older_than=args.older_than, dry_run=args.dry_run)
    if removed.get("skipped_corrupt"):
        raise _UsageError(
            "a manifest is unreadable, so nothing was removed (it may reference anything): run "
            "`residual-store verify` and `residual-store rm` the damaged context"
        )
    _emit(args, {**removed, "dry_run": args.dry_run}, _gc_text(removed, args.older_than, args.dry_run))
    return 0


def _cmd_du(args: argparse.Namespace) -> int:
    """Bytes on disk per part of the store (measured on a folder; as recorded on kvstores), per
    signature, and what gc would free."""
    from residual_store.store import layout
    from residual_store.store.records import StoredContext

    disk = _open_disk(args.path, timeout=args.timeout)
    per_sig: dict[str, dict[str, int]] = {}
    seen: set[str] = set()
    for _, stored in disk.iter_manifests():
        if not isinstance(stored, StoredContext):
            continue
        entry = per_sig.setdefault(
            stored.spec.signature, {"contexts": 0, "intermediate": 0, "inputs": 0, "weights": 0}
        )
        entry["contexts"] += 1
        for record, kind in zip(stored.records, stored.spec.kinds):
            if not record.shared:  # the context's own: intermediates and per-context inputs
                entry["inputs" if kind == "input" else "intermediate"] += record.nbytes
            elif record.path not in seen:
                seen.add(record.path)
                entry["weights"] += record.nbytes
    parts = {
        "data": layout.DATA,
        "weights": layout.WEIGHTS,
        "contexts": layout.CONTEXTS,
        "backwards": layout.BACKWARDS,
    }
    measured = {name: disk.backend.tree_bytes(prefix) for name, prefix in parts.items()}
    total = disk.backend.tree_bytes("")
    free = disk.backend.tree_bytes(layout.FREE_DIR)
    reclaim = disk.gc(older_than=0, dry_run=True)
    usage = {
        "measured": total is not None,
        "total": total,
        **{name: size for name, size in measured.items()},
        "recycled": free,
        "gc_would_free": None if reclaim["bytes"] < 0 or reclaim.get("skipped_corrupt") else reclaim["bytes"],
        "signatures": per_sig,
    }
    rows = [["signature", "contexts", "intermediate", "inputs", "weights (once)"]]
    for sig, e in sorted(per_sig.items()):
        rows.append([sig, str(e["contexts"]), _human(e["intermediate"]), _human(e["inputs"]), _human(e["weights"])])
    if reclaim.get("skipped_corrupt"):
        disk_lines = [f"on disk: {_human(total)} in all" if total is not None else "",
                      "gc removes nothing while a manifest is unreadable (see `residual-store verify`)"]
    elif total is None:
        disk_lines = ["disk usage: not measurable on this kvstore (bytes above are as the manifests record them)"]
    else:
        sizes = ", ".join(f"{name} {_human(size or 0)}" for name, size in measured.items())
        disk_lines = [
            f"on disk: {_human(total)} in all ({sizes}; of data, {_human(free or 0)} recycled for reuse)",
            f"gc --older-than 0 would free {_human(reclaim['bytes'])} ({_gc_items(reclaim)})"
            if reclaim["bytes"] >= 0 else "",
        ]
    text = _table(rows) + "\n" + "\n".join(line for line in disk_lines if line)
    _emit(args, usage, text)
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    """Removes contexts, a damaged one included (its manifest goes; gc removes its data)."""
    from residual_store.errors import InvalidKeyError
    from residual_store.store.keys import validate_key

    disk = _open_disk(args.path, timeout=args.timeout, read_only=False)
    try:
        missing = [k for k in args.keys if validate_key(k) not in disk]  # checked before any is removed
    except InvalidKeyError as err:
        raise _UsageError(str(err)) from None
    _refuse_missing(disk, missing)
    for key in args.keys:
        _, stale = disk.delete(key)
        if stale is not None:
            disk.drop_data(stale)
    _emit(args, {"removed": list(args.keys)}, f"removed {_plural(len(args.keys), 'context')}: {', '.join(args.keys)}")
    return 0


def _array_names(names: Sequence[str]) -> list[str]:
    """Unique names for the residuals of a context (a name repeats: ``#i`` added)."""
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return [n if counts[n] == 1 else f"{n} #{i}" for i, n in enumerate(names)]


def _read_residuals(disk: Any, key: str) -> tuple[Any, list[Any]]:
    import numpy as np

    stored = _stored(disk, key)
    _, arrays = disk.read(stored.key, place=False)
    return stored, [np.asarray(a) for a in arrays]


def _cmd_export(args: argparse.Namespace) -> int:
    import numpy as np

    disk = _open_disk(args.path, timeout=args.timeout)
    stored, arrays = _read_residuals(disk, args.key)
    names = _array_names(stored.spec.names)
    chosen = list(range(len(arrays)))
    if args.residual is not None:
        pick = args.residual
        chosen = [i for i, n in enumerate(names) if n == pick or stored.spec.names[i] == pick or str(i) == pick]
        if not chosen:
            raise _UsageError(f"context {stored.key!r} has no residual {pick!r} (see `residual-store inspect`)")
    out = args.output or f"{stored.key}.npz"
    np.savez(out, **{names[i]: arrays[i] for i in chosen})
    data = {"key": stored.key, "file": out, "residuals": [names[i] for i in chosen]}
    _emit(args, data, f"wrote {_plural(len(chosen), 'residual')} of {stored.key} to {out}")
    return 0


def _compare(a: Any, b: Any) -> dict[str, Any]:
    import numpy as np

    if a.shape != b.shape or a.dtype != b.dtype:
        return {"status": "differs", "why": f"{a.dtype}{list(a.shape)} against {b.dtype}{list(b.shape)}"}
    if np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
        return {"status": "same"}
    if a.dtype.kind not in "fciub":
        return {"status": "differs"}
    x, y = a.astype(np.float64), b.astype(np.float64)
    abs_diff = float(np.max(np.abs(x - y)))
    scale = float(max(np.max(np.abs(x)), np.max(np.abs(y)), np.finfo(np.float64).tiny))
    return {"status": "differs", "max_abs": abs_diff, "max_rel": abs_diff / scale}


def _cmd_diff(args: argparse.Namespace) -> int:
    disk = _open_disk(args.path, timeout=args.timeout)
    first, arrays_a = _read_residuals(disk, args.key1)
    second, arrays_b = _read_residuals(disk, args.key2)
    names_a, names_b = _array_names(first.spec.names), _array_names(second.spec.names)
    same_signature = first.spec.signature == second.spec.signature
    rows_data = []
    if same_signature:  # one layout: residual i against residual i
        pairs = [(n, i, i) for i, n in enumerate(names_a)]
    else:  # by name
        index_b = {n: i for i, n in enumerate(names_b)}
        pairs = [(n, i, index_b.get(n)) for i, n in enumerate(names_a)]
        pairs += [(n, None, j) for j, n in enumerate(names_b) if n not in set(names_a)]
    for name, i, j in pairs:
        if i is None or j is None:
            rows_data.append({"name": name, "status": f"only in {args.key1 if j is None else args.key2}"})
        else:
            rows_data.append({"name": name, **_compare(arrays_a[i], arrays_b[j])})
    rows = [["name", "status", "max abs diff", "max rel diff"]]
    for r in rows_data:
        rows.append([r["name"], r["status"] + (f" ({r['why']})" if "why" in r else ""),
                     f"{r['max_abs']:.3g}" if "max_abs" in r else "-", f"{r['max_rel']:.3g}" if "max_rel" in r else "-"])
    differing = sum(r["status"] != "same" for r in rows_data)
    head = (
        f"{args.key1} and {args.key2}: " + ("the same signature" if same_signature else
        f"signatures {first.spec.signature} and {second.spec.signature} (residuals matched by name)")
        + f"; {_plural(differing, 'residual')} of {len(rows_data)} differ"
    )
    _emit(args, {"key1": args.key1, "key2": args.key2, "same_signature": same_signature, "residuals": rows_data},
          head + "\n" + _table(rows))
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit status 2 (``--help`` shows the usage)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="residual-store",
        description="Split JAX forward from backward, with typed, storable residuals. PATH is a store "
        "folder or a tensorstore kvstore spec as JSON, e.g. '{\"driver\": \"file\", \"path\": \"/data/s\"}'.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, run: Callable[[argparse.Namespace], int], json_flag: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(run=run)
        if json_flag:
            p.add_argument("--json", action="store_true", help="machine-readable output")
        if name != "demo":
            p.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                           help="seconds each request to an object store may take, retries included "
                           "(default: tensorstore's retries, minutes for an unreachable store)")
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
    gc.add_argument("--older-than", type=_duration, default=3600.0, metavar="AGE",
                    help="only remove what is at least this old: seconds, or 90s, 15m, 1h, 2d (default 1h; 0: all)")
    gc.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    command("du", "disk usage per part of the store, per signature, and what gc would free", _cmd_du,
            json_flag=True).add_argument("path")
    rm = command("rm", "remove contexts (their data goes; shared weights stay until gc)", _cmd_rm, json_flag=True)
    rm.add_argument("path")
    rm.add_argument("keys", nargs="+")
    export = command("export", "write a context's residuals to a NumPy .npz file", _cmd_export, json_flag=True)
    export.add_argument("path")
    export.add_argument("key")
    export.add_argument("-o", "--output", default=None, help="the .npz file (default: KEY.npz)")
    export.add_argument("--residual", default=None, metavar="NAME", help="only this residual (its name or index)")
    diff = command("diff", "which residuals of two contexts differ, and by how much", _cmd_diff, json_flag=True)
    diff.add_argument("path")
    diff.add_argument("key1")
    diff.add_argument("key2")
    return parser


def _version() -> str:
    import jax
    import jaxlib

    from residual_store import __version__

    return f"residual-store {__version__} (jax {jax.__version__}, jaxlib {jaxlib.__version__})"


def _quiet_stdout() -> None:
    """After a closed pipe (``| head``): later writes, and the flush at exit, go nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    from residual_store.errors import ResidualStoreError

    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except (_UsageError, ResidualStoreError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"residual-store {args.command}: {first}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
