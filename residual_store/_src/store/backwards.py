"""Stored backwards: once per signature and store, the backward serialized with ``jax.export``, so
a process without the model can run ``rs.backward(store.get(key))``.

Saving (:class:`BackwardSaver`, one per writable store) runs on the store's writer thread (exporting
takes tens of milliseconds; ``put`` returns at once). Loading (:class:`StoredBackwardLoader`, one per
store, registered weakly with :func:`residual_store._src.backward.register_loader` while the store is
open): ``get`` reads and checks the stored backward and hands the context a
:class:`StoredBackward`; it is deserialized only when ``rs.backward`` needs it. Loading checks a
stored backward like data (its manifest, its checksum, that it names its signature) and matches
it to this process's platform and device count. A damaged, unreadable or unsuitable stored
backward never blocks ``get``: it is registered as a backward that raises when run, so only
``rs.backward`` in a process without a live split of that signature ever sees it
(:class:`~residual_store._src.errors.CorruptContextError` for damage,
:class:`~residual_store._src.errors.BackwardUnavailableError` otherwise). A split in the
process (``Split.backward``, or one that traced the signature) never consults it.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

import residual_store_serializers as serializers
from residual_store._src.backward import Backward, find_backward, lookup_backward, register_backward
from residual_store._src.context import backward_of
from residual_store._src.errors import (
    BackwardUnavailableError,
    CorruptContextError,
    ResidualStoreError,
    ResidualStoreWarning,
)
from residual_store._src.export import export_backward, load_backward
from residual_store._src.keypaths import PathStructure
from residual_store._src.placement import has_explicit_axes
from residual_store._src.signature import is_current
from residual_store._src.store.critical import StoreLock
from residual_store._src.store.disk import paths

if TYPE_CHECKING:
    from residual_store._src.context import ResidualContext
    from residual_store._src.store.disk.tier import DiskTier
    from residual_store._src.store.workers import Writer

__all__ = [
    "BackwardSaver", "StoredBackward", "StoredBackwardLoader", "check_records", "describe", "explicit_mesh", "is_stored",
    "read", "read_manifest", "serialize", "stored_signatures", "structures", "unavailable_manifest", "write",
]

_INTERFACE = "flat"  # how the artifact is called (see serializers.BACKWARD_SCHEMA)
_OLD_INTERFACE = (
    "its backward was exported by an earlier development version with pytree arguments, which "
    "this version does not run: put a context of this signature again, or run it with the split"
)


def explicit_mesh(residuals: Sequence[Any]) -> Any:
    """The mesh of a residual sharded over a mesh with explicit axis types, if any."""
    for x in residuals:
        sharding = getattr(x, "sharding", None)
        if sharding is not None and has_explicit_axes(sharding):
            return sharding.mesh
    return None


def _aval_records(avals: Sequence[Any]) -> list[list[Any]]:
    return [[list(a.shape), str(a.dtype)] for a in avals]


def _avals_from_records(records: Any) -> list[jax.ShapeDtypeStruct]:
    if not isinstance(records, list):
        raise ValueError("avals must be a list")
    avals = []
    for r in records:
        if not (isinstance(r, list) and len(r) == 2 and isinstance(r[0], list) and isinstance(r[1], str)):
            raise ValueError("each aval must be [shape, dtype]")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in r[0]):
            raise ValueError("a shape must hold ints >= 0")
        avals.append(jax.ShapeDtypeStruct(tuple(r[0]), jax.numpy.dtype(r[1])))
    return avals


def _manifest(signature: str, **fields: Any) -> bytes:
    return serializers.encode_manifest(
        {"signature": signature, "jax_version": jax.__version__, "platform": jax.default_backend(), **fields},
        schema=serializers.BACKWARD_SCHEMA,
    )


def unavailable_manifest(signature: str, reason: str) -> bytes:
    """The manifest recording that the backward of ``signature`` could not be exported, and why:
    ``ls``/``inspect`` show it, and a process without the model gets it as the reason."""
    return _manifest(signature, available=False, reason=reason)


def serialize(bwd: Backward, avals: Sequence[Any], mesh: Any, on_host: Sequence[int] = ()) -> tuple[bytes, bytes]:
    """The exported backward and its manifest. A backward over residuals sharded with explicit
    axis types traces only inside their mesh: if the export fails, it is tried again under
    ``jax.set_mesh(mesh)`` (the artifact is then for that mesh's device count).

    Raises:
      BackwardUnavailableError: ``jax.export`` cannot serialize it (the message says why).
    """
    try:
        exported = export_backward(bwd, avals, on_host=on_host)
    except BackwardUnavailableError:
        set_mesh = getattr(jax, "set_mesh", None)
        if mesh is None or set_mesh is None:
            raise
        with set_mesh(mesh):
            exported = export_backward(bwd, avals, on_host=on_host)
    data = exported.data
    manifest = _manifest(
        bwd.signature,
        available=True,
        interface=_INTERFACE,
        platforms=list(exported.platforms),
        left_out=dict(exported.left_out),
        cotangent={**bwd.out_structure.record(), "avals": _aval_records(bwd.out_avals)},
        gradients=bwd.grad_structure.record(),
        checksum=serializers.checksum(np.frombuffer(data, np.uint8)),
        nbytes=len(data),
    )
    return data, manifest


def describe(m: dict[str, Any] | None) -> dict[str, Any]:
    """What ``ls`` and ``inspect`` show of a stored backward's manifest (``None``: none stored)."""
    if m is None:
        return {"stored": False, "reason": "no backward stored (the put that saves it has not run, or gc removed it)"}
    if m.get("available") is False:
        return {"stored": False, "jax_version": m["jax_version"], "reason": m.get("reason")}
    if m.get("interface") != _INTERFACE:
        return {"stored": False, "jax_version": m["jax_version"], "reason": _OLD_INTERFACE}
    return {
        "stored": True,
        "jax_version": m["jax_version"],
        "platforms": list(m.get("platforms") or [m.get("platform", "?")]),
        "left_out": dict(m.get("left_out") or {}),
        "gradient_leaves": len((m.get("gradients") or {}).get("paths") or []),
    }


def _exported_device_count(data: bytes) -> int:
    """How many devices a serialized backward was exported for (``jax.export.Exported.nr_devices``).

    A backward exported for one device (the usual case: ``jax.export`` of plain avals) runs on
    sharded residuals over any number of devices too; one exported for N > 1 devices (a backward
    with sharding constraints, or traced under a mesh with explicit axis types) needs N devices.
    """
    try:
        return int(jax.export.deserialize(bytearray(data)).nr_devices)
    except Exception:  # noqa: BLE001 - load_backward already accepted these bytes
        return 1


def _refusing(signature: str, error: ResidualStoreError) -> Backward:
    """A backward of ``signature`` that raises ``error`` when run."""

    def never(residuals: Any, cotangents: Any) -> Any:
        raise error

    return Backward(
        signature=signature,
        flat_fn=never,
        out_structure=PathStructure(paths=()),
        out_avals=(),
        grad_structure=PathStructure(paths=()),
        unavailable=error,
    )


class StoredBackward:
    """The stored backward of one signature as a store read and checked it, deserialized at its
    first :meth:`load_backward` (once) and held from then on: a context holds the one its store
    read for it, so neither closing nor deleting the store takes its backward away.

    Args:
      signature: the signature it serves.
      manifest: its manifest (``None`` with ``error``).
      data: the exported bytes (``None``: its manifest records why there are none).
      error: why the stored backward cannot be used (damage): every run raises it.
    """

    def __init__(
        self, signature: str, manifest: dict[str, Any] | None = None, data: bytes | None = None,
        error: ResidualStoreError | None = None,
    ) -> None:
        self.signature = signature
        self._manifest = manifest
        self._data = data
        self._error = error
        self._loaded: Backward | None = None
        self._lock = StoreLock()

    def load_backward(self, signature: str) -> Backward | None:
        """The backward (one that raises why, if it cannot run here), registered; ``None`` for
        another signature."""
        if signature != self.signature:
            return None
        with self._lock:
            if self._loaded is None:
                self._loaded = self._deserialized()
                self._manifest = self._data = None  # the bytes are done with
            register_backward(self._loaded)
            return self._loaded

    def _deserialized(self) -> Backward:
        if self._error is not None:
            return _refusing(self.signature, self._error)
        assert self._manifest is not None
        try:
            bwd = _loaded(self.signature, self._manifest, self._data)
        except (BackwardUnavailableError, CorruptContextError) as err:
            return _refusing(self.signature, err)
        needed = _exported_device_count(self._data) if self._data is not None else 1
        if needed > jax.device_count():
            return _refusing(
                self.signature,
                BackwardUnavailableError(
                    f"the stored backward of signature {self.signature} was exported for {needed} "
                    "devices (its avals or sharding constraints name a mesh of that size, e.g. "
                    f"explicit axis types), and this process has {jax.device_count()}: run it where "
                    "that many devices exist, or make the context with rs.split in this process"
                ),
            )
        return bwd


def _read(disk: DiskTier, signature: str) -> StoredBackward | None:
    """The stored backward of ``signature``, read and checked now; ``None`` if none is stored.
    Never raises for damage: a damaged one becomes one that raises when run."""
    try:
        stored = read(disk, signature)
    except CorruptContextError as err:
        damaged = CorruptContextError(
            f"{err}. The contexts of this signature are intact, but a process without the model "
            "cannot run their backward: run it with the split that makes them (split.backward); "
            "`residual-store gc` removes the damaged backward, and the next put of that "
            "signature saves it again"
        )
        return StoredBackward(signature, error=damaged)
    return None if stored is None else StoredBackward(signature, *stored)


class StoredBackwardLoader:
    """The loader of one store's stored backwards (a :class:`~residual_store._src.backward.BackwardLoader`):
    each signature's read once, at the first ``get`` of it or the first time ``rs.backward``
    asks for one this process has no live backward of.

    The store registers it while open; the registry holds it weakly, so a closed or collected
    store is not asked.
    """

    def __init__(self, disk: DiskTier) -> None:
        self._disk = disk
        self._lock = StoreLock()
        self._read: dict[str, StoredBackward] = {}

    def for_context(self, signature: str) -> StoredBackward | None:
        """What a context of ``signature`` that ``get`` returns holds to load its backward:
        read and checked now (so deleting the store later cannot take it away), not
        deserialized; ``None`` when a live backward exists, none is stored, or the signature is
        residual-store 0.1's (which could collide: never run)."""
        if lookup_backward(signature) is not None or not is_current(signature):
            return None
        return self._stored(signature)

    def load_backward(self, signature: str) -> Backward | None:
        """The stored backward of ``signature`` in this store, loaded; ``None`` if none is."""
        if not is_current(signature):
            return None
        stored = self._stored(signature)
        return None if stored is None else stored.load_backward(signature)

    def _stored(self, signature: str) -> StoredBackward | None:
        # A signature none is stored of is read again next time: a later put may save it.
        with self._lock:
            found = self._read.get(signature)
        if found is not None:
            return found
        stored = _read(self._disk, signature)  # outside the lock: a read of the disk
        if stored is None:
            return None
        with self._lock:
            return self._read.setdefault(signature, stored)


def structures(
    signature: str, manifest: dict[str, Any]
) -> tuple[PathStructure, list[jax.ShapeDtypeStruct], PathStructure]:
    """The cotangent's structure and avals and the gradients' structure a stored backward's
    manifest records (``verify`` checks them too).

    Raises:
      CorruptContextError: a record is damaged or names an unknown kind of node.
    """
    what = f"the stored backward of signature {signature}"
    cotangent = manifest.get("cotangent")
    try:
        out_avals = _avals_from_records(cotangent.get("avals") if isinstance(cotangent, dict) else None)
    except (ValueError, TypeError) as err:
        raise CorruptContextError(f"{what}: its cotangent record is damaged ({err})") from None
    out_structure = PathStructure.from_record(cotangent, f"{what} (cotangent)")
    if out_structure.num_leaves != len(out_avals):
        raise CorruptContextError(
            f"{what}: its cotangent record has {len(out_avals)} avals for {out_structure.num_leaves} leaves"
        )
    return out_structure, out_avals, PathStructure.from_record(manifest.get("gradients"), f"{what} (gradients)")


def check_records(signature: str, manifest: dict[str, Any]) -> None:
    """Raises :class:`CorruptContextError` if the structure records of a stored backward that
    has an export of this version's interface are damaged (what ``verify`` checks)."""
    if manifest.get("available") is not False and manifest.get("interface") == _INTERFACE:
        structures(signature, manifest)


def _loaded(signature: str, manifest: dict[str, Any], data: bytes | None) -> Backward:
    """The backward a stored manifest and export describe.

    Raises:
      BackwardUnavailableError: it records that no backward could be exported, or was exported
        in a form this version does not run, or not for this platform.
      CorruptContextError: its structure records are damaged.
    """
    what = f"the stored backward of signature {signature}"
    if data is None:
        raise BackwardUnavailableError(
            f"{what} could not be exported when its first context was put: {manifest.get('reason')}. "
            "Processes that define the function can run it with its split"
        )
    if manifest.get("interface") != _INTERFACE:
        raise BackwardUnavailableError(f"{what}: {_OLD_INTERFACE}")
    out_structure, out_avals, grad_structure = structures(signature, manifest)
    return load_backward(
        data, signature, out_structure=out_structure, out_avals=out_avals, grad_structure=grad_structure
    )


class BackwardSaver:
    """Saves the backward of each signature once per store, on the store's writer thread (in
    order with its writes), so other processes can run it without the model.

    A backward known to be unexportable (host callbacks) warns at the ``put``; other export
    failures warn at the next ``put``, ``flush`` or ``close`` (:meth:`emit_warnings`, on the
    caller's thread). A save that fails (a full disk, no answer) is tried again by the next
    ``put`` of that signature. Which process's puts reach it is the store's committer's call
    (in a job of several processes, process 0's only).
    """

    def __init__(self, disk: DiskTier, writer: Writer, *, durable: bool) -> None:
        self._disk = disk
        self._writer = writer
        self._durable = durable
        self._lock = StoreLock()
        self._seen: set[str] = set()  # signatures whose backward this store saved, or is saving
        self._warnings: list[str] = []  # from the writer thread, emitted on the caller's

    def save(self, ctx: ResidualContext) -> None:
        """Once per signature: queues the save of ``ctx``'s backward (the put's stack: warns
        at its caller)."""
        sig = ctx.spec.signature
        if sig in self._seen:  # (a set's membership is read whole: the lock guards adding)
            return
        with self._lock:
            if sig in self._seen:
                return
            self._seen.add(sig)
        bwd = backward_of(ctx)[0] or find_backward(sig)
        if bwd is None or bwd.unavailable is not None:
            return
        if bwd.unexportable is not None:
            reason = f"the backward of signature {sig} cannot be serialized with jax.export: {bwd.unexportable}"
            _warn_unexportable(f"{reason}; {_NO_MODEL}")
            self._writer.submit(functools.partial(self._record_unavailable, sig, reason), 0)
            return
        mesh = explicit_mesh(ctx.residuals)
        self._writer.submit(functools.partial(self._export, sig, bwd, ctx.spec.avals, mesh, ctx.spec.on_host), 0)

    def emit_warnings(self) -> None:
        """Warnings of background saves, on the caller's thread (stack level: its caller's call)."""
        if not self._warnings:  # (read whole: the lock guards the swap)
            return
        with self._lock:
            pending, self._warnings = self._warnings, []
        for message in pending:  # export's own errors, which say what a process without the model meets
            _warn_unexportable(message)

    def _export(self, sig: str, bwd: Backward, avals: Any, mesh: Any, on_host: Sequence[int] = ()) -> None:
        """On the writer thread: exports the backward of ``sig`` and stores it, unless stored."""
        try:
            if is_stored(self._disk, sig):
                return
            try:
                data, manifest = serialize(bwd, avals, mesh, on_host)
            except BackwardUnavailableError as err:
                with self._lock:
                    self._warnings.append(str(err))
                self._record_unavailable(sig, str(err))
                return
            write(self._disk, sig, data, manifest, fsync=self._durable)
        except BaseException:
            with self._lock:  # not saved (a full disk, no answer): the next put of this signature retries
                self._seen.discard(sig)
            raise

    def _record_unavailable(self, sig: str, reason: str) -> None:
        """Stores why the backward of ``sig`` could not be exported (``ls`` and ``inspect`` show
        it; a process without the model gets it as the reason)."""
        if not is_stored(self._disk, sig):
            write(self._disk, sig, None, unavailable_manifest(sig, reason), fsync=self._durable)


# -- the stored backward's files: an export and its manifest (the commit) ------------------------


def stored_signatures(disk: DiskTier) -> list[str]:
    """Signatures with a stored backward (a committed manifest)."""
    suffix = paths.MANIFEST_SUFFIX
    return [n[: -len(suffix)] for n in disk.backend.list_dir(paths.BACKWARDS) if n.endswith(suffix)]


def is_stored(disk: DiskTier, signature: str) -> bool:
    """Whether the backward of ``signature`` is stored (its manifest is committed)."""
    return disk.backend.exists(paths.backward_paths(signature)[1])


def write(disk: DiskTier, signature: str, data: bytes | None, manifest: bytes, *, fsync: bool) -> None:
    """The export, then its manifest (the commit: an export without one is a torn write).
    ``data`` is ``None`` for a backward that could not be exported: the manifest alone records
    why."""
    export_path, manifest_path = paths.backward_paths(signature)
    if data is not None:
        disk.write_blob(export_path, data, fsync=fsync)
    try:
        disk.write_blob(manifest_path, manifest, fsync=fsync)
    except BaseException:
        if data is not None:  # no bytes of a failed write stay behind
            disk.backend.delete(export_path)
        raise


def read_manifest(disk: DiskTier, signature: str) -> dict[str, Any] | None:
    """The decoded manifest of the stored backward of ``signature`` (the export itself is not
    read), or ``None`` if none is committed.

    Raises:
      CorruptContextError: the manifest is unreadable, of a future version or names another
        signature.
    """
    manifest = disk.backend.get_bytes(paths.backward_paths(signature)[1])
    if manifest is None:
        return None
    what = f"stored backward of signature {signature}"
    try:
        m = serializers.decode_manifest(manifest, what=what, schema=serializers.BACKWARD_SCHEMA)
        if m["signature"] != signature:
            raise serializers.CorruptDataError(f"{what}: its manifest names signature {m['signature']!r}")
    except serializers.CorruptDataError as err:
        raise CorruptContextError(str(err)) from err
    return m


def read(disk: DiskTier, signature: str) -> tuple[dict[str, Any], bytes | None] | None:
    """The manifest and verified export of the stored backward of ``signature`` (the export is
    ``None`` where the manifest records that it could not be exported), or ``None`` if none is
    committed.

    Raises:
      CorruptContextError: its export is missing, its manifest is unreadable, of a future
        version or names another signature, or the export fails its size or checksum.
    """
    m = read_manifest(disk, signature)
    if m is None or m.get("available") is False:
        return None if m is None else (m, None)
    export_path = paths.backward_paths(signature)[0]
    nbytes = m.get("nbytes")  # read no more than that (jax.export artifacts stay under 2 GiB)
    limit = nbytes if isinstance(nbytes, int) and not isinstance(nbytes, bool) and 0 <= nbytes < 1 << 31 else 1 << 31
    data = disk.backend.get_bytes(export_path, max_bytes=limit)
    what = f"stored backward of signature {signature}"
    try:
        if data is None:
            raise serializers.CorruptDataError(f"{what}: its export ({export_path}) is missing")
        if m.get("nbytes", len(data)) != len(data):
            raise serializers.CorruptDataError(f"{what}: {len(data)} bytes, its manifest says {m['nbytes']}")
        checksum = m.get("checksum")
        if not isinstance(checksum, str):
            raise serializers.CorruptDataError(f"{what}: its manifest has no checksum")
        serializers.verify(np.frombuffer(data, np.uint8), checksum, what=what)
    except serializers.CorruptDataError as err:
        raise CorruptContextError(str(err)) from err
    return m, data


_NO_MODEL = "processes without the model cannot run it"


def _warn_unexportable(message: str) -> None:
    """Warns, at the user's call, that a backward was not exported: ``message`` says why and
    what processes without the model meet."""
    warnings.warn(
        f"{message}. The context is stored; only "
        "processes that define the function can run its backward.",
        ResidualStoreWarning,
        stacklevel=_user_stacklevel(),
    )


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points ``warnings.warn``, called by our caller, at the first
    frame outside this package (the user's put or flush), however deep the library's calls."""
    frame: FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR + os.sep):
        frame, level = frame.f_back, level + 1
    return level
