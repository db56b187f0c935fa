"""Garbage collection of a store's tree: what no committed context needs, removed safely.

Unneeded are weights no manifest references, data folders of no committed context, recycled
folders, stored backwards of signatures no context has (and damaged ones), and temporary files of
interrupted writes. Safe against writers in any process (see docs/format.md, "Garbage
collection"): :func:`collect` holds the store's gc lock exclusively, which writers hold shared
from checking which weights exist to committing; and each folder is removed by the medium's
strategy (:meth:`Atomicity.collect <residual_store._src.store.disk.protocol.Atomicity.collect>`): in a
local folder, a recycled folder is touched before a writer claims it, and a folder is first
renamed into ``data/.trash`` (atomic against a writer's claim) and only then removed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from residual_store._src.errors import CorruptContextError
from residual_store._src.logs import event
from residual_store._src.store import backwards
from residual_store._src.store.disk import paths
from residual_store._src.store.disk.protocol import Backend

if TYPE_CHECKING:
    from residual_store._src.store.disk.tier import DiskTier

__all__ = ["KINDS", "collect", "nothing_removed"]

KINDS = ("weights", "data", "recycled", "backwards", "temporary")  # what gc removes, by kind

Progress = Callable[[int, None], None]


def nothing_removed() -> dict[str, int]:
    """The counts of a gc that removed nothing (a memory-only store's)."""
    return {**dict.fromkeys(KINDS, 0), "young": 0, "bytes": 0}


def collect(
    disk: DiskTier, older_than: float = 3600.0, *, dry_run: bool = False, progress: Progress | None = None
) -> dict[str, int]:
    """Removes what no committed context of ``disk`` needs (see the module's docstring).

    Only items at least ``older_than`` seconds old are removed, so writes in flight in other
    processes are left alone (on kvstores without modification times, nothing is removed
    unless ``older_than`` is 0). A store holding an unreadable manifest is left alone (it may
    reference anything). Returns counts of what was removed (with ``dry_run``: of what would
    be, and nothing changes), ``"young"``: the unneeded items kept for being younger than
    ``older_than``, and ``"bytes"``: the bytes removed (-1 where the backend cannot say).
    ``progress`` is called with the bytes removed so far after each item (where the backend can
    say).
    """
    if not dry_run:
        disk.check_writable("gc")
    with disk.backend.gc_lock(exclusive=True) if not dry_run else contextlib.nullcontext():
        removed = _collect_locked(disk, older_than, dry_run, progress)
    event(logging.INFO, "gc", store=disk.description, older_than=older_than, dry_run=dry_run, **removed)
    return removed


def _collect_locked(disk: DiskTier, older_than: float, dry_run: bool, progress: Progress | None) -> dict[str, int]:
    """:func:`collect` under the gc lock (or none, for a dry run)."""
    backend = disk.backend
    removed = nothing_removed()
    found = disk.references()
    if found is None:
        return {**removed, "skipped_corrupt": 1}
    referenced, signatures = found

    def take(kind: str, items: Sequence[str], remove: Callable[[], bool]) -> None:
        """Removes one unneeded item (its paths, ``items``) if it is old enough, counting it."""
        if not all(_old_enough(backend, p, older_than) for p in items):
            removed["young"] += 1
            return
        sizes = [backend.tree_bytes(p) for p in items]
        if dry_run or remove():
            removed[kind] += 1
            removed["bytes"] = -1 if removed["bytes"] < 0 or None in sizes else removed["bytes"] + sum(sizes)  # type: ignore[arg-type]
            if progress is not None and removed["bytes"] >= 0:
                progress(removed["bytes"], None)

    if not dry_run:
        for name in backend.list_dir(paths.TRASH_DIR):  # left by a gc that was killed
            backend.delete_tree(paths.trash_path(name))
    for kind, prefix in (("weights", paths.WEIGHTS), ("data", paths.DATA)):
        for name in backend.list_dir(prefix):
            if paths.is_node_metadata(name):
                continue  # the group's own zarr.json
            path = f"{prefix}/{name}"
            if path not in referenced:
                take(kind, [path], functools.partial(disk.atomicity.collect, path))
    for name in backend.list_dir(paths.FREE_DIR):  # recycled folders kept for reuse
        path = f"{paths.FREE_DIR}/{name}"
        take("recycled", [path], functools.partial(disk.atomicity.collect, path))
    stems = {n.rsplit(".", 1)[0] for n in backend.list_dir(paths.BACKWARDS)}
    for sig in sorted(stems):
        if sig in signatures:
            try:
                if backwards.read(disk, sig) is not None:
                    continue  # intact and needed
            except CorruptContextError:
                pass  # damaged: removed, so a later put of this signature saves it again
        # unneeded, damaged, or a torn write (an export without its manifest)
        stored = [p for p in paths.backward_paths(sig) if backend.exists(p)]
        if stored:
            take("backwards", stored, functools.partial(_delete_all, backend, stored))
    for prefix in ("", paths.CONTEXTS, paths.BACKWARDS):
        for name in backend.list_temporary(prefix):
            path = f"{prefix}/{name}" if prefix else name
            take("temporary", [path], functools.partial(_delete_all, backend, [path]))
    return removed


def _old_enough(backend: Backend, path: str, older_than: float) -> bool:
    if older_than <= 0:
        return True
    age = backend.age_seconds(path)
    return age is not None and age >= older_than


def _delete_all(backend: Backend, items: Sequence[str]) -> bool:
    for p in items:
        backend.delete(p)
    return True
