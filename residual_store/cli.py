"""The ``residual-store`` command line (also ``python -m residual_store``).

Commands: ``demo`` (the README's main job), and on a store (a folder, a kvstore URL such as
``s3://bucket/run-17``, or a tensorstore kvstore spec as JSON:
``'{"driver": "file", "path": "/data/s"}'``): ``ls``, ``inspect``, ``verify``,
``gc``, ``du``, ``rm``, ``export`` and ``diff``, built on the public methods of
:class:`residual_store.Store`. The commands that only read open the store read-only.

Conventions: every error is one line on stderr and exit status 2; exit status 1 says "found
something", as ``diff`` and ``git diff --exit-code`` do: ``verify`` and ``ls`` when a context is
damaged, ``diff`` when the contexts differ. A closed pipe (``| head``) ends the output quietly;
``--json`` gives the same facts, under the same words, as the text; sizes and ages are
human-readable; progress (in bytes) is drawn on stderr only where it is a terminal. ``--help``
and usage errors answer without importing JAX: every command imports what it needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from residual_store._src.cli_text import Progress as _Progress
from residual_store._src.cli_text import age as _age
from residual_store._src.cli_text import count as _count
from residual_store._src.cli_text import duration as _duration
from residual_store._src.cli_text import human as _human
from residual_store._src.cli_text import plural as _plural
from residual_store._src.cli_text import seconds as _seconds
from residual_store._src.cli_text import table as _table
from residual_store._src.interrupts import from_interrupt, interrupt_deferred, interrupted, interrupts_kept

if TYPE_CHECKING:
    import numpy as np

    from residual_store import BackwardInfo, ContextInfo, CorruptContextError, Store, StoreUnavailableError

__all__ = ["main"]


class _UsageError(Exception):
    """A bad path or key: reported as one line on stderr."""


# seconds each request to an object store may take unless --timeout says (rs.Store's default:
# the command line imports nothing of the library before a command runs)
DEFAULT_TIMEOUT_S = 30.0

# ``scheme://`` at the start of PATH: a kvstore URL, which rs.Store parses (or refuses)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _store_path(text: str) -> str | dict[str, Any]:
    """A folder (``~`` is the home folder, as in ``rs.Store``), a kvstore URL (``s3://b/p``,
    ``gs://``, ``file://``, ``memory://``), or a kvstore spec given as a JSON object."""
    if not text.strip():
        raise _UsageError("PATH is empty: give a store folder, a kvstore URL, or a kvstore spec as JSON")
    if not text.lstrip().startswith("{"):
        return text
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as err:
        raise _UsageError(f"PATH looks like a kvstore spec but is not valid JSON ({err})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("driver"), str):
        raise _UsageError('a kvstore spec is a JSON object with a "driver", e.g. \'{"driver": "file", "path": "/data/s"}\'')
    return spec


def _open(args: argparse.Namespace, *, read_only: bool = True) -> Store:
    """The store at ``args.path``: read-only for the commands that only read (nothing on disk
    changes, not even a marker), and never created."""
    import residual_store as rs

    where = _store_path(args.path)
    try:
        return rs.Store(where, create=False, read_only=read_only, timeout=args.timeout)
    except rs.ReadOnlyStoreError as err:  # (said in the command line's terms, not the API's)
        raise _UsageError(
            f"{err.reason or args.path + ' cannot be written'}: `residual-store {args.command}` changes the "
            "store; ls, inspect, verify, du, export and diff only read it"
        ) from None
    except rs.StoreNotFoundError:
        if isinstance(where, dict) or _URL.match(where):
            raise _UsageError(f"no residual store in the kvstore {args.path}; check PATH") from None
        folder = os.path.expanduser(where)
        what = "not a residual store" if os.path.exists(folder) else "no such folder"
        inside = _stores_inside(folder)
        if inside:  # an Orbax step folder holds its contexts item one level down
            what += f"; the store{'s' if len(inside) > 1 else ''} in it: {', '.join(inside)}"
        raise _UsageError(
            f"{args.path}: {what}; check PATH (a store folder, a kvstore URL, or a kvstore spec as JSON)"
        ) from None


def _stores_inside(folder: str) -> list[str]:
    """The stores one level below ``folder`` (an Orbax step's ``contexts`` item), by path."""
    import residual_store as rs

    found = []
    try:
        subfolders = sorted(e.path for e in os.scandir(folder) if e.is_dir())[:32]
    except OSError:
        return []
    for sub in subfolders:
        try:
            rs.Store(sub, read_only=True).close()
        except rs.ResidualStoreError:
            continue
        found.append(sub)
    return found


def _unavailable(args: argparse.Namespace, err: StoreUnavailableError) -> str:
    """An object store that did not answer, with command-line advice; what no wait heals (an
    unknown host, refused credentials) as the library says it."""
    if not err.timed_out:
        return str(err)
    cause = str(err.__cause__ or "").strip().splitlines()
    why = f" ({cause[0].split(' [', 1)[0]})" if cause else ""
    timeout = getattr(args, "timeout", None)
    within, advice = (
        (f" within --timeout {timeout:g} s", "a longer --timeout") if timeout
        else (f" within {DEFAULT_TIMEOUT_S:g} s (the default --timeout)", "--timeout SECONDS")
    )
    return (
        f"{args.path}: the object store did not answer{within} or refused the request{why}; check the "
        f"endpoint, the network and the credentials, or give {advice}"
    )


def _missing(store: Store, keys: Sequence[str]) -> list[str]:
    """The keys the store does not hold (a damaged context is held);
    :class:`~residual_store.InvalidKeyError` for a key outside the rules."""
    import residual_store as rs

    out = []
    for key in keys:
        try:
            store.info(key)
        except rs.ContextNotFoundError:
            out.append(key)
        except rs.CorruptContextError:
            pass
    return out


def _refuse_missing(args: argparse.Namespace, store: Store, keys: Sequence[str]) -> None:
    """One line naming the keys the store does not hold, if any."""
    missing = _missing(store, keys)
    if missing:
        raise _UsageError(
            f"no {'context' if len(missing) == 1 else 'contexts'} {', '.join(map(repr, missing))} in store {args.path}"
        )


def _info(args: argparse.Namespace, store: Store, key: str) -> ContextInfo:
    """The record of ``key``, or a one-line error for an unknown key."""
    _refuse_missing(args, store, [key])
    return store.info(key)


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if getattr(args, "json", False) else text)


# -- commands ---------------------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    from residual_store.demo import DemoConfig, run_demo

    plot = None if args.no_plot else args.plot
    if plot is not None:  # before the run, not after it
        folder = os.path.dirname(os.path.abspath(os.path.expanduser(plot)))
        if not os.path.isdir(folder):
            raise _UsageError(f"--plot {plot}: no folder {folder} to write it in; make it, or give --no-plot")
    cfg = DemoConfig(steps=args.steps, n_microbatches=args.microbatches)
    result = run_demo(cfg, store_path=args.store, plot_path=plot, timeout=args.timeout)
    worst = max(*result["max_rel_grad_diff"], result["zero_bubble"]["max_rel_grad_diff"])
    ok = worst < 1e-4
    print(f"gradient check against jax.grad: {'PASS' if ok else 'FAIL'} (max rel. diff {worst:.2e})")
    return 0 if ok else 1


def _backward_json(info: BackwardInfo) -> dict[str, Any]:
    """What ``--json`` shows of a stored backward."""
    data = {"stored": info.stored, "jax_version": info.jax_version}
    if info.stored:
        return {**data, "platforms": list(info.platforms), "left_out": dict(info.left_out)}
    return {**data, "reason": info.reason, "damaged": info.damaged}


def _backward_text(info: BackwardInfo) -> str:
    if info.stored:
        left = info.left_out
        note = f"; not for {', '.join(sorted(left))}" if left else ""
        return f"stored for {', '.join(info.platforms)} (jax {info.jax_version}{note})"
    if info.damaged:
        return f"DAMAGED ({(info.reason or '').removeprefix('damaged: ')})"
    return f"not stored: {info.reason}"


def _backward_step(args: argparse.Namespace) -> str:
    """What to do about a damaged stored backward."""
    return (
        f"next: `residual-store gc {shlex.quote(args.path)} --older-than 0` removes a damaged stored backward; "
        "the next put of its signature saves it again"
    )


def _cmd_ls(args: argparse.Namespace) -> int:
    """Lists the contexts; exit status 1 if one is damaged."""
    import residual_store as rs

    now = time.time()
    entries: list[dict[str, Any]] = []
    with _open(args) as store, _Progress("reading manifests") as progress:
        listed = 0
        for key in store.keys():
            try:
                info = store.info(key)
            except rs.ContextNotFoundError:
                continue  # removed meanwhile
            except rs.CorruptContextError as err:
                entries.append({"key": key, "error": err.damage or str(err)})
                continue
            entries.append({
                "key": key, "signature": info.signature, "residuals": len(info.residuals),
                "bytes": info.nbytes, "own_bytes": info.own_nbytes, "created": info.created,
                "age": now - (info.created or now),
                **({"error": info.damage} if info.damage is not None else {}),  # a file's size is wrong
            })
            listed += info.nbytes
            progress(listed)
        backwards = {sig: store.backward_info(sig) for sig in sorted({e["signature"] for e in entries if "signature" in e})}
    rows = [["key", "residuals", "bytes", "own bytes", "signature", "backward", "age", ""]]
    for e in entries:
        mark = "DAMAGED" if "error" in e else ""
        if "signature" not in e:  # its manifest is unreadable
            rows.append([e["key"], "-", "-", "-", "CORRUPT", "-", "-", mark])
            continue
        backward = backwards[e["signature"]]
        e["backward"] = _backward_json(backward)
        shown = ",".join(backward.platforms) if backward.stored else "DAMAGED" if backward.damaged else "no"
        rows.append([
            e["key"], str(e["residuals"]), _human(e["bytes"]), _human(e["own_bytes"]),
            e["signature"], shown, _age(e["age"]), mark,
        ])
    damaged = [e["key"] for e in entries if "error" in e]
    summary = _plural(len(entries), "context")
    if damaged:
        summary += f", {len(damaged)} damaged"
    lines = [summary] + [f"DAMAGED {e['key']}: {e['error']}" for e in entries if "error" in e]
    if damaged:
        lines.append(_next_step(args, damaged, checked=False))
    lines += [f"{sig}: backward {_backward_text(b)}" for sig, b in backwards.items()]
    broken = any(b.damaged for b in backwards.values())
    lines += [_backward_step(args)] if broken else []
    _emit(args, entries, _table(rows) + "\n" + "\n".join(lines))
    return 1 if damaged or broken else 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    """One row per residual; exit status 1 if a file of the context is missing or of the wrong
    size (what a look at the sizes shows: ``verify`` checks every byte)."""
    with _open(args) as store:
        info = _info(args, store, args.key)
        backward = store.backward_info(info.signature)
    rows = [["#", "name", "shape", "dtype", "bytes", "kind", "shared", "chunks", "path"]]
    data = []
    for i, r in enumerate(info.residuals):
        data.append({
            "index": i, "name": r.name, "shape": list(r.shape), "dtype": r.dtype, "bytes": r.nbytes,
            "kind": r.kind, "input_path": r.input_path, "shared": r.shared, "path": r.path,
            "checksum": r.checksum, "chunk_shape": list(r.chunk_shape) if r.chunk_shape is not None else None,
            "chunks": r.chunks, "bundle": r.bundle,
        })
        where = f"{r.bundle}:{r.path.rsplit('/', 1)[-1]}/" if r.bundle and r.path else r.path or "-"
        rows.append([
            str(i), r.name, str(r.shape), r.dtype, _human(r.nbytes), r.kind,
            "yes" if r.shared else "no", str(r.chunks), where,
        ])
    header = (
        f"context {info.key}: signature {info.signature}, jax {info.jax_version}, {_human(info.nbytes)} "
        f"({_human(info.own_nbytes)} its own)\nsaved for the backward: {info.save or 'unrecorded'}"
        f"\nbackward: {_backward_text(backward)}"
    )
    if any(r.bundle for r in info.residuals):
        header += "\n(a path FILE.zip:G/ is the group G/ inside that zip file, not a folder)"
    if info.damage is not None:
        header += f"\nDAMAGED {info.key}: {info.damage}\n{_next_step(args, [info.key], checked=False)}"
    if backward.damaged:
        header += f"\n{_backward_step(args)}"
    _emit(
        args,
        {"key": info.key, "signature": info.signature, "save": info.save, "backward": _backward_json(backward),
         "damage": info.damage, "residuals": data},
        header + "\n" + _table(rows),
    )
    return 0 if info.damage is None and not backward.damaged else 1


def _cmd_verify(args: argparse.Namespace) -> int:
    """Checks every byte; exit status 1 if anything is damaged (a damaged store marker or
    folder of the store: :func:`_report_damage`)."""
    with _open(args) as store, _Progress("verifying") as progress:
        if args.keys:
            _refuse_missing(args, store, args.keys)
        report = store.verify(args.keys or None, progress=progress)
    contexts = report.verified + len(report.damaged)
    backwards = report.backwards_verified + len(report.damaged_backwards)
    lines = [f"DAMAGED {key}: {why}" for key, why in report.damaged.items()]
    lines += [f"DAMAGED backward {sig}: {why}" for sig, why in report.damaged_backwards.items()]
    lines += [f"DAMAGED folder {folder}: {why}" for folder, why in report.damaged_folders.items()]
    lines.append(
        f"{report.verified} of {_plural(contexts, 'context')} verified, {report.backwards_verified} of "
        f"{_plural(backwards, 'stored backward')} verified, "
        f"{len(report.damaged) + len(report.damaged_backwards) + len(report.damaged_folders)} damaged"
    )
    steps = [_next_step(args, list(report.damaged), checked=True)] if report.damaged else []
    steps += [_backward_step(args)] if report.damaged_backwards else []
    steps += [
        f"next: replace the link {folder} with the folder it stands for (a store reads nothing through a link); "
        "a stored backward lost meanwhile is saved again by the next put of its signature"
        for folder in report.damaged_folders
    ]
    _emit(
        args,
        {
            "contexts": contexts,
            "verified": report.verified,
            "damaged": [{"key": k, "error": why} for k, why in report.damaged.items()],
            "stored_backwards": backwards,
            "backwards_verified": report.backwards_verified,
            "damaged_backwards": [{"signature": s, "error": why} for s, why in report.damaged_backwards.items()],
            "damaged_folders": [{"folder": f, "error": why} for f, why in report.damaged_folders.items()],
            "next": steps,
        },
        "\n".join(lines + steps),
    )
    return 0 if report.ok else 1


def _next_step(args: argparse.Namespace, keys: Sequence[str], *, checked: bool) -> str:
    """What to do about damaged contexts: remove them, or write them again (``checked``: every
    byte was read; otherwise, only sizes were looked at)."""
    them = "it" if len(keys) == 1 else "them"
    shown = " ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")
    look = "" if checked else f"`residual-store verify {shlex.quote(args.path)}` checks every byte; "
    return (
        f"next: {look}`residual-store rm {shlex.quote(args.path)} {shown}` removes {them} (`residual-store gc` "
        f"then frees {'its' if len(keys) == 1 else 'their'} files); or restore the checkpoint step that saved "
        f"{them}, or put {them} again"
    )


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
    label = "looking for what gc would remove" if args.dry_run else "removing"
    with _open(args, read_only=args.dry_run) as store, _Progress(label) as progress:
        removed = store.gc(older_than=args.older_than, dry_run=args.dry_run, progress=progress)
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
    with _open(args) as store:
        with _Progress("measuring") as progress:
            usage = store.usage(progress=progress)
        with _Progress("counting what gc would free") as progress:
            reclaim = store.gc(older_than=0, dry_run=True, progress=progress)
    unknown = reclaim["bytes"] < 0 or reclaim.get("skipped_corrupt")
    damaged = dict(usage.unreadable_manifests)
    data: dict[str, Any] = {
        "measured": usage.measured,
        "total": usage.total,
        **usage.parts,
        "recycled": usage.recycled,
        "gc_would_free": None if unknown else reclaim["bytes"],
        "signatures": {sig: dataclasses.asdict(u) for sig, u in usage.signatures.items()},
        "damaged": [{"key": k, "error": why} for k, why in damaged.items()],
    }
    rows = [["signature", "contexts", "intermediate", "inputs", "weights (once)"]]
    for sig, u in usage.signatures.items():
        rows.append([sig, str(u.contexts), _human(u.intermediate), _human(u.inputs), _human(u.weights)])
    total = usage.total
    if reclaim.get("skipped_corrupt"):
        disk_lines = [f"on disk: {_human(total)} in all" if total is not None else "",
                      "gc removes nothing while a manifest is unreadable:"]
    elif total is None:
        disk_lines = ["disk usage: not measurable on this kvstore (bytes above are as the manifests record them)"]
    else:
        sizes = ", ".join(f"{name} {_human(size or 0)}" for name, size in usage.parts.items())
        disk_lines = [
            f"on disk: {_human(total)} in all ({sizes}; of data, {_human(usage.recycled or 0)} recycled for reuse)",
            f"gc --older-than 0 would free {_human(reclaim['bytes'])} ({_gc_items(reclaim)})" if not unknown else "",
        ]
    disk_lines += [f"DAMAGED {key}: {why}" for key, why in damaged.items()]
    disk_lines += [_next_step(args, list(damaged), checked=False)] if damaged else []
    rows_note = "(weights (once): a weight that contexts of several signatures hold is counted under the first of them)"
    _emit(args, data, _table(rows) + "\n" + "\n".join(line for line in [rows_note, *disk_lines] if line))
    return 1 if damaged else 0


def _cmd_rm(args: argparse.Namespace) -> int:
    """Removes contexts, a damaged one included (its manifest goes; gc removes its data)."""
    keys = list(dict.fromkeys(args.keys))
    with _open(args, read_only=False) as store:
        _refuse_missing(args, store, keys)  # checked before any is removed
        for key in keys:
            store.delete(key)
    _emit(args, {"removed": keys}, f"removed {_plural(len(keys), 'context')}: {', '.join(keys)}")
    return 0


def _array_names(names: Sequence[str]) -> list[str]:
    """Unique names for the residuals of a context (a name repeats: ``#i`` added)."""
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return [n if counts[n] == 1 else f"{n} #{i}" for i, n in enumerate(names)]


def _read(args: argparse.Namespace, store: Store, key: str) -> tuple[ContextInfo, list[str], tuple[np.ndarray, ...]]:
    """The record of ``key``, unique names for its residuals, and its arrays (verified)."""
    info = _info(args, store, key)
    return info, _array_names([r.name for r in info.residuals]), store.arrays(key)


def _cmd_export(args: argparse.Namespace) -> int:
    import numpy as np

    out = _npz_output(args.output or f"{args.key}.npz")  # before the read, not after it
    with _open(args) as store:
        info, names, arrays = _read(args, store, args.key)
    chosen = list(range(len(arrays)))
    if args.residual is not None:
        pick = args.residual
        chosen = [i for i, n in enumerate(names) if n == pick or info.residuals[i].name == pick or str(i) == pick]
        if not chosen:
            raise _UsageError(f"context {info.key!r} has no residual {pick!r} (see `residual-store inspect`)")
    named: dict[str, Any] = {names[i]: arrays[i] for i in chosen}
    np.savez(out, **named)
    data = {"key": info.key, "file": out, "residuals": [names[i] for i in chosen]}
    _emit(args, data, f"wrote {_plural(len(chosen), 'residual')} of {info.key} to {out}")
    return 0


def _npz_output(path: str) -> str:
    """The file ``export`` writes for ``-o path``: ``.npz`` added where it lacks it (as NumPy
    adds it), checked for a folder to write it in."""
    out = path if path.endswith(".npz") else f"{path}.npz"
    folder = os.path.dirname(os.path.abspath(os.path.expanduser(out)))
    if not os.path.isdir(folder):
        raise _UsageError(f"-o {path}: no folder {folder} to write it in; make it first")
    if os.path.isdir(out):
        raise _UsageError(f"-o {path}: {out} is a folder; give a file name")
    return out


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
    """Compares two contexts residual by residual; exit status 1 if they differ."""
    with _open(args) as store:
        first, names_a, arrays_a = _read(args, store, args.key1)
        second, names_b, arrays_b = _read(args, store, args.key2)
    same_signature = first.signature == second.signature
    rows_data = []
    pairs: list[tuple[str, int | None, int | None]]
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
        f"signatures {first.signature} and {second.signature} (residuals matched by name)")
        + f"; {_plural(differing, 'residual')} of {len(rows_data)} differ"
    )
    _emit(args, {"key1": args.key1, "key2": args.key2, "same_signature": same_signature, "residuals": rows_data},
          head + "\n" + _table(rows))
    return 1 if differing else 0


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit status 2 (``--help`` shows the usage)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="residual-store",
        description="Split JAX forward from backward, with typed, storable residuals. PATH is a store "
        "folder, a kvstore URL (s3://bucket/path, gs://bucket/path, file:///path, memory://) or a "
        "tensorstore kvstore spec as JSON, e.g. '{\"driver\": \"file\", \"path\": \"/data/s\"}'.",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, run: Callable[[argparse.Namespace], int], json_flag: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(run=run)
        if json_flag:
            p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                       help="seconds each request to an object store may take, retries included "
                       f"(default {DEFAULT_TIMEOUT_S:g})")
        return p

    demo = command("demo", "train a small transformer with a pipeline schedule", _cmd_demo)
    demo.add_argument("--steps", type=_count, default=3, help="training steps (default 3)")
    demo.add_argument("--microbatches", type=_count, default=8, help="microbatches per step (default 8)")
    demo.add_argument("--store", default=None, help="store folder or kvstore URL (default: a temporary folder)")
    demo.add_argument("--plot", default="residual_store_demo.png", help="where to write the PNG (default residual_store_demo.png)")
    demo.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    command("ls", "list the contexts of a store; exit 1 if one is damaged", _cmd_ls, json_flag=True).add_argument("path")
    inspect = command("inspect", "one row per residual of a stored context; exit 1 if a file of it is missing "
                      "or of the wrong size", _cmd_inspect, json_flag=True)
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
    export.add_argument("-o", "--output", default=None, help="the .npz file, .npz added where it lacks it (default: KEY.npz)")
    export.add_argument("--residual", default=None, metavar="NAME", help="only this residual (its name or index)")
    diff = command("diff", "which residuals of two contexts differ, and by how much; exit 1 if any does",
                   _cmd_diff, json_flag=True)
    diff.add_argument("path")
    diff.add_argument("key1")
    diff.add_argument("key2")
    return parser


class _Version(argparse.Action):
    """``--version``: the versions of residual-store, JAX and jaxlib (JAX imported only then)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the versions of residual-store, JAX and jaxlib")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(_version())
        parser.exit()


def _version() -> str:
    import jax
    import jaxlib

    from residual_store import __version__

    return f"residual-store {__version__} (jax {jax.__version__}, jaxlib {jaxlib.__version__})"


def _report_damage(args: argparse.Namespace, err: CorruptContextError) -> int:
    """A damaged context (or store) a command met: its DAMAGED line and what to do next, as
    ``ls`` and ``verify`` say them; exit status 1 (damage found)."""
    if err.key is None:
        _emit(args, {"damaged_store": str(err)}, f"DAMAGED store: {err}")  # (the error names the store)
    else:
        step = _next_step(args, [err.key], checked=False)
        _emit(args, {"damaged": [{"key": err.key, "error": err.damage}], "next": [step]},
              f"DAMAGED {err.key}: {err.damage}\n{step}")
    return 1


def _quiet_stdout() -> None:
    """After a closed pipe (``| head``): later writes, and the flush at exit, go nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line (``argv``: its arguments, else the program's own); returns the exit
    status. Run as the program, after a Ctrl-C once JAX is imported, the process ends here with
    status 130 instead (see :func:`~residual_store._src.interrupts.interrupted`)."""
    # the command the arguments name, before they are parsed (a Ctrl-C may come while they are)
    command = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), "")
    try:
        args = _parser().parse_args(argv)
        command = args.command
        with interrupts_kept():
            return _run(args)
    except BaseException as err:
        if not from_interrupt(err):
            raise  # (argparse's SystemExit too)
        said = f"residual-store{' ' + command if command else ''}: interrupted (Ctrl-C)"
        return interrupted(said, as_program=argv is None)


def _run(args: argparse.Namespace) -> int:
    """Runs the parsed command; the library's errors said in one line (status 2, or 1 for damage)."""
    if args.command != "demo":
        # a store command reads into host memory: it starts no accelerator, nor takes its memory
        # from a job running on it (unless JAX_PLATFORMS says otherwise, or JAX runs already)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with interrupt_deferred():  # (only now: --help and usage errors never import JAX)
        import residual_store as rs

        damaged = rs.CorruptContextError  # the first name imports the library's modules, and JAX
    try:
        return args.run(args)
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except damaged as err:  # damage met: said as ls and verify say it, status 1
        return _report_damage(args, err)
    except (_UsageError, rs.ResidualStoreError, OSError) as err:
        text = _unavailable(args, err) if isinstance(err, rs.StoreUnavailableError) else str(err).strip()
        first = text.splitlines()[0] if text else type(err).__name__
        print(f"residual-store {args.command}: {first}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
