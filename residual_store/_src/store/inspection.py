"""What a store holds, read without running anything: a context's record (no arrays read, its
files' sizes checked against its manifest), the stored backward of a signature, the bytes each
part of the store takes on disk, and verification reports.

The frozen records here are what :meth:`Store.info <residual_store.Store.info>`,
:meth:`~residual_store.Store.backward_info`, :meth:`~residual_store.Store.usage` and
:meth:`~residual_store.Store.verify` return; the functions build them (and the disk's part of
``stats``, and a context's arrays read as they are stored) from a
:class:`~residual_store._src.store.disk.tier.DiskTier` or a context in memory, and change nothing.
The store asks them itself, whatever its mode: ``None`` for the disk is a memory-only store's,
which holds nothing on disk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np

from residual_store._src.context import SHARED_KINDS, ResidualSpec
from residual_store._src.errors import ContextNotFoundError, CorruptContextError, InvalidArgumentError
from residual_store._src.store import backwards
from residual_store._src.store.disk import forms, paths
from residual_store._src.store.disk.damage import damaged_context, size_damage, size_words, without_key
from residual_store._src.store.disk.records import StoredContext, check_signature
from residual_store._src.store.disk.tier import DiskTier

__all__ = [
    "BackwardInfo",
    "ContextInfo",
    "Progress",
    "ResidualInfo",
    "SignatureUsage",
    "StoreUsage",
    "USAGE_PARTS",
    "VerifyReport",
    "backward_info",
    "context_info",
    "disk_bytes",
    "measure",
    "memory_info",
    "stored_arrays",
    "stored_info",
    "verify",
    "with_damage",
]

MEMORY_ONLY = "memory only"
"""The description of a store without a disk, as its errors name it."""

Progress = Callable[[int, int | None], None]
"""Called as work goes on with ``(bytes done, bytes in all)``; ``None`` where the whole is not
known beforehand (what ``gc`` removes, what ``usage`` measures)."""

USAGE_PARTS = {"data": paths.DATA, "weights": paths.WEIGHTS, "contexts": paths.CONTEXTS, "backwards": paths.BACKWARDS}
"""The parts of a store's tree :func:`measure` reports, by name."""


@dataclasses.dataclass(frozen=True)
class ResidualInfo:
    """One residual of a context, as its record says (no array read).

    Attributes:
      name: where it came from (``"tanh model.py:12"``, ``"input params['w']"``).
      shape, dtype: its shape, and its dtype's name (``"float32"``, ``"key<fry>"``).
      nbytes: bytes of its data (a typed key: its key data).
      kind: ``"weight"``, ``"input"``, ``"constant"`` or ``"intermediate"``.
      input_path: the key path of the primal input it is, or ``None``.
      shared: stored once for every context that holds it (a weight).
      path: where it lies in the store's tree (``None`` for a context not yet written).
      checksum: the checksum of its bytes (``None`` for a context not yet written).
      chunk_shape: the chunk shape of a residual stored as a grid of chunks, else ``None``.
      chunks: how many chunks it is stored as.
      bundle: the zip file that holds it, for a residual stored in its context's bundle (its
        ``path`` then names the group ``<last part of path>/`` inside that zip, not a folder on
        disk), else ``None``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str
    input_path: str | None
    shared: bool
    path: str | None = None
    checksum: str | None = None
    chunk_shape: tuple[int, ...] | None = None
    chunks: int = 1
    bundle: str | None = None


@dataclasses.dataclass(frozen=True)
class ContextInfo:
    """A context's record: what :meth:`Store.get <residual_store.Store.get>` would return,
    described without reading its arrays.

    Attributes:
      key: its key.
      signature: the signature of its forward/backward pair.
      residuals: one :class:`ResidualInfo` per residual, in the context's order.
      created: when it was committed (seconds since the epoch), ``None`` while it is only in
        memory (a memory-only store, or a put whose write is pending).
      jax_version: the JAX version that wrote it, ``None`` while it is only in memory.
      damage: why it is damaged, where a look at its files' sizes shows it (a file its manifest
        names is missing, or of another size than the manifest records or its layout implies);
        ``None`` where none is seen. Only sizes are looked at (one ``stat`` per file, on a local
        folder; a kvstore's listing gives no sizes): ``verify`` checks every byte.
      save: what its split kept for the backward, as the split's ``save`` record spells it
        (``"all"``, ``"auto"``, ``"policy:<name>"``, ``"plan:<options>"``; ``None`` for a context
        written before splits recorded how they were called).
    """

    key: str
    signature: str
    residuals: tuple[ResidualInfo, ...]
    created: float | None = None
    jax_version: str | None = None
    damage: str | None = None
    save: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of every residual, weights included."""
        return sum(r.nbytes for r in self.residuals)

    @property
    def own_nbytes(self) -> int:
        """Bytes of the residuals that are the context's own (not shared weights)."""
        return sum(r.nbytes for r in self.residuals if not r.shared)


@dataclasses.dataclass(frozen=True)
class BackwardInfo:
    """The stored backward of a signature: whether a process without the model can run it.

    Attributes:
      signature: the signature.
      stored: whether a runnable backward is stored.
      platforms: the platforms it was exported for (``("cpu", "cuda")``).
      left_out: platforms it could not be exported for, with why.
      jax_version: the JAX version that exported it (or recorded why it could not).
      reason: why none is runnable (``stored`` is ``False``): none stored yet, not exportable,
        damaged.
      damaged: whether one is stored but damaged: its manifest unreadable, or its export missing
        or of another size than its manifest says (what one ``stat`` shows; ``verify`` reads
        every byte). ``gc`` removes it; the next put of its signature saves it again.
    """

    signature: str
    stored: bool
    platforms: tuple[str, ...] = ()
    left_out: Mapping[str, str] = dataclasses.field(default_factory=dict)
    jax_version: str | None = None
    reason: str | None = None
    damaged: bool = False


@dataclasses.dataclass(frozen=True)
class SignatureUsage:
    """Bytes the contexts of one signature hold, as their records say.

    Attributes:
      contexts: how many contexts.
      intermediate: bytes of their intermediates (their own).
      inputs: bytes of their per-context inputs (their own).
      weights: bytes of the weights they hold, each counted once in the whole store: a weight
        that contexts of several signatures hold is counted under the first of them, in
        signature order.
    """

    contexts: int = 0
    intermediate: int = 0
    inputs: int = 0
    weights: int = 0


@dataclasses.dataclass(frozen=True)
class StoreUsage:
    """Bytes a store takes on disk.

    Attributes:
      total: bytes of every file of the store, or ``None`` where the storage cannot say (a
        kvstore listing gives no sizes).
      parts: bytes under each part of the tree (``"data"``, ``"weights"``, ``"contexts"``,
        ``"backwards"``), each ``None`` where not measurable.
      recycled: bytes of data folders kept for reuse (part of ``"data"``; ``gc`` frees them).
      signatures: per signature, what its contexts hold (:class:`SignatureUsage`).
      unreadable: contexts whose manifest could not be read (not counted in ``signatures``).
      unreadable_manifests: those contexts, key -> what is damaged (as ``verify`` says it).
    """

    total: int | None
    parts: Mapping[str, int | None]
    recycled: int | None
    signatures: Mapping[str, SignatureUsage]
    unreadable: int = 0
    unreadable_manifests: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def measured(self) -> bool:
        """Whether the bytes on disk could be measured (``total`` is known)."""
        return self.total is not None


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What :meth:`Store.verify <residual_store.Store.verify>` found.

    Attributes:
      verified: contexts whose every byte matched its checksums.
      damaged: key -> why, for each damaged context (the reason names the residual where one is
        at fault).
      backwards_verified: stored backwards found intact.
      damaged_backwards: signature -> why, for each damaged stored backward.
      damaged_folders: folder of the store's tree -> why, for each that could not be read (a
        symbolic link where the store keeps a folder: never followed); what lies in it went
        unchecked.

    Example:
      >>> import residual_store as rs
      >>> report = rs.VerifyReport(verified=2, damaged={"mb1": "residual 3 (tanh): checksum mismatch"})
      >>> report.ok, sorted(report.damaged)
      (False, ['mb1'])
    """

    verified: int
    damaged: Mapping[str, str] = dataclasses.field(default_factory=dict)
    backwards_verified: int = 0
    damaged_backwards: Mapping[str, str] = dataclasses.field(default_factory=dict)
    damaged_folders: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether nothing checked is damaged."""
        return not self.damaged and not self.damaged_backwards and not self.damaged_folders


# -- records ----------------------------------------------------------------------------------


def disk_bytes(disk: DiskTier | None, *, leaving: Collection[str] = ()) -> dict[str, int]:
    """What ``stats()`` reports of the committed contexts on ``disk`` (``None``: a memory-only
    store): ``bytes`` (each shared weight once), ``contexts``, and ``own_bytes`` (the contexts'
    own arrays); damaged manifests are left out, and so are the keys ``leaving`` (deleted or
    popped, their removal not yet done: the store already answers that they are gone)."""
    found = {"bytes": 0, "contexts": 0, "own_bytes": 0}
    if disk is None:
        return found
    seen: set[str] = set()
    for key, stored in disk.iter_manifests():
        if isinstance(stored, CorruptContextError) or key in leaving:
            continue
        found["contexts"] += 1
        for record in stored.records:
            if not record.shared:
                found["own_bytes"] += record.nbytes
            if record.path not in seen:
                seen.add(record.path)
                found["bytes"] += record.nbytes
    return found


def memory_info(key: str, spec: ResidualSpec) -> ContextInfo:
    """The record of a context held in memory only, from its spec."""
    residuals = tuple(
        ResidualInfo(name, tuple(aval.shape), str(aval.dtype), nbytes, kind, path, kind in SHARED_KINDS)
        for name, aval, nbytes, kind, path in zip(spec.names, spec.avals, spec.leaf_nbytes, spec.kinds, spec.input_paths)
    )
    return ContextInfo(key, spec.signature, residuals, save=None if spec.call is None else spec.call.save)


def context_info(stored: StoredContext) -> ContextInfo:
    """The record of a committed context: its spec's, with where and how each residual lies as
    its validated manifest says."""
    base = memory_info(stored.key, stored.spec)
    residuals = tuple(
        dataclasses.replace(
            info, nbytes=r.nbytes, shared=r.shared, path=r.path, checksum=r.checksum, chunk_shape=r.chunk_shape,
            chunks=len(r.chunk_checksums) if r.chunk_checksums is not None else 1,
            bundle=stored.bundle.path if r.bundled and stored.bundle is not None else None,
        )
        for info, r in zip(base.residuals, stored.records)
    )
    return dataclasses.replace(base, residuals=residuals, created=stored.created, jax_version=stored.jax_version)


def stored_info(disk: DiskTier | None, key: str) -> ContextInfo:
    """The record of the committed context ``key``, with the damage its files' sizes show."""
    if disk is None:
        raise ContextNotFoundError.of(key, MEMORY_ONLY)
    stored, damage = _sized_stat(disk, key)
    return dataclasses.replace(context_info(stored), damage=damage)


def stored_arrays(disk: DiskTier | None, key: str) -> tuple[np.ndarray, ...]:
    """The residuals of the committed context ``key`` as whole NumPy arrays, read and verified,
    not placed on a device."""
    if disk is None:
        raise ContextNotFoundError.of(key, MEMORY_ONLY)
    _, arrays = disk.read(key, place=False)
    return tuple(cast(list[np.ndarray], arrays))


_LOOKS = 4
"""How many times a context replaced while its files are looked at is looked at again."""


def _same_files(a: StoredContext, b: StoredContext) -> bool:
    return a is b or (a.data_dir, a.bundle, a.records) == (b.data_dir, b.bundle, b.records)


def _sized_stat(disk: DiskTier, key: str) -> tuple[StoredContext, str | None]:
    """``key``'s manifest and :func:`size_damage` of its files, judged only on a manifest that
    stayed the same across the look: a context replaced meanwhile (its old files removed or
    recycled) is looked at again, never called damaged; :class:`ContextNotFoundError` if it was
    deleted meanwhile."""
    stored = disk.stat(key)
    for _ in range(_LOOKS):
        damage = size_damage(disk.backend, stored)
        if damage is None:
            return stored, None
        disk.forget_stat(key)  # the manifest file itself again, not a cached parse
        again = disk.stat(key)
        if _same_files(stored, again):
            return again, damage
        stored = again
    return stored, None  # replaced on every look: busy, not seen damaged (verify reads it)


def backward_info(disk: DiskTier | None, signature: str) -> BackwardInfo:
    """The stored backward of ``signature`` (its manifest only; the export is not read).

    Raises:
      InvalidArgumentError: ``signature`` is not one this library writes.
    """
    try:
        check_signature(signature, "backward_info")
    except CorruptContextError:
        raise InvalidArgumentError(
            f"backward_info expects a context's signature (rs2- and 32 hex digits, as info(key).signature "
            f"gives), got {signature!r:.80}"
        ) from None
    if disk is None:
        return BackwardInfo(signature, False, reason="a memory-only store stores no backwards")
    try:
        manifest = backwards.read_manifest(disk, signature)
    except CorruptContextError as err:
        return BackwardInfo(signature, False, reason=f"damaged: {err}", damaged=True)
    status = backwards.describe(manifest)
    damage = _export_damage(disk, signature, manifest) if status["stored"] else None
    if damage is not None:
        return BackwardInfo(signature, False, jax_version=status.get("jax_version"), reason=f"damaged: {damage}",
                            damaged=True)
    return BackwardInfo(
        signature,
        status["stored"],
        platforms=tuple(status.get("platforms", ())),
        left_out=dict(status.get("left_out", {})),
        jax_version=status.get("jax_version"),
        reason=status.get("reason"),
    )


def _export_damage(disk: DiskTier, signature: str, manifest: Mapping[str, Any] | None) -> str | None:
    """The stored backward's export missing or of another size than its manifest says, in the
    words of :mod:`~residual_store._src.store.disk.damage` (one ``stat``; ``None`` where the
    storage gives no sizes, or all is well)."""
    expected = (manifest or {}).get("nbytes")
    if not isinstance(expected, int):
        return None  # an older manifest without it: verify reads the export
    export = paths.backward_paths(signature)[0]
    size = disk.backend.tree_bytes(export)
    if size is None or size == expected:
        return None
    if size == 0 and not disk.backend.exists(export):
        return f"its export {export} is missing"
    return size_words(f"its export {export}", size, expected)


# -- disk usage -------------------------------------------------------------------------------


def _signature_usage(manifests: Iterable[StoredContext], progress: Progress | None) -> dict[str, SignatureUsage]:
    """Per signature: its contexts, their own bytes by kind, the weights they hold once."""
    totals: dict[str, dict[str, int]] = {}
    seen: set[str] = set()
    counted = 0
    for stored in manifests:
        entry = totals.setdefault(stored.spec.signature, dict.fromkeys(("contexts", "intermediate", "inputs", "weights"), 0))
        entry["contexts"] += 1
        for record, kind in zip(stored.records, stored.spec.kinds):
            if not record.shared:  # the context's own: intermediates and per-context inputs
                entry["inputs" if kind == "input" else "intermediate"] += record.nbytes
            elif record.path not in seen:
                seen.add(record.path)
                entry["weights"] += record.nbytes
            else:
                continue
            counted += record.nbytes
        if progress is not None:
            progress(counted, None)
    return {sig: SignatureUsage(**entry) for sig, entry in sorted(totals.items())}


def measure(disk: DiskTier | None, progress: Progress | None = None) -> StoreUsage:
    """The bytes of each part of the store on disk (measured on a folder; ``None`` on kvstores,
    whose listings give no sizes) and what its manifests record per signature."""
    if disk is None:
        return StoreUsage(0, dict.fromkeys(USAGE_PARTS, 0), 0, {})
    unreadable: dict[str, str] = {}
    manifests = []
    for key, stored in disk.iter_manifests():
        if isinstance(stored, CorruptContextError):
            unreadable[key] = stored.damage or without_key(key, str(stored))
        else:
            manifests.append(stored)
    signatures = _signature_usage(manifests, progress)
    parts: dict[str, int | None] = {}
    for name, prefix in USAGE_PARTS.items():
        parts[name] = disk.backend.tree_bytes(prefix)
        if progress is not None and parts[name] is not None:
            progress(sum(p or 0 for p in parts.values()), None)
    return StoreUsage(
        total=disk.backend.tree_bytes(""),
        parts=parts,
        recycled=disk.backend.tree_bytes(paths.FREE_DIR),
        signatures=signatures,
        unreadable=len(unreadable),
        unreadable_manifests=unreadable,
    )


# -- verification -----------------------------------------------------------------------------


def _verify_context(disk: DiskTier, key: str) -> StoredContext:
    """Reads and checks every byte of ``key``: its files' sizes first (the damage ``ls`` shows, in
    its words), then its arrays, their zarr metadata and its bundle's headers as plain zip readers
    check them;
    :class:`CorruptContextError` names the damage. All of it inside the read's retry, as ``get``
    reads: a context replaced meanwhile (by another process) is read again, never called damaged."""

    def sizes(stored: StoredContext) -> None:
        damage = size_damage(disk.backend, stored)
        if damage is not None:
            raise damaged_context(key, damage)

    def the_rest(stored: StoredContext) -> None:
        check_metadata = getattr(disk.backend, "check_metadata", None)  # zarr.json, for plain zarr
        if check_metadata is not None:
            for r in {r.path: r for r in stored.records if not r.bundled}.values():
                check_metadata(r.path, r.shape, r.dtype, r.chunk_shape)
        forms.check_bundle(disk.backend, key, stored)

    stored, _ = disk.read(key, place=False, check=(sizes, the_rest))
    return stored


def _verify_backward(disk: DiskTier, signature: str) -> None:
    """Reads and checks the stored backward of ``signature``, if any."""
    stored = backwards.read(disk, signature)
    if stored is not None:
        backwards.check_records(signature, stored[0])


def _planned_bytes(disk: DiskTier, keys: Sequence[str]) -> int | None:
    """What reading ``keys`` reads, as their manifests say (``None`` if one is unreadable)."""
    try:
        return sum(disk.stat(k).nbytes for k in keys)
    except (ContextNotFoundError, CorruptContextError):
        return None


def _shared_weight_damage(disk: DiskTier, damaged: Mapping[str, str]) -> dict[str, str]:
    """``damaged``'s reasons, each whose damage is a shared weight's (named by its path in the
    store) saying so: one file, held by every context it names, which one put heals (a put
    writes a stored weight that fails its checksum again)."""
    holders: dict[str, list[str]] = {}
    for key, why in damaged.items():
        try:
            records = disk.stat(key).records
        except (ContextNotFoundError, CorruptContextError):
            continue
        path = next((r.path for r in records if r.shared and r.path in why), None)
        if path is not None:
            holders.setdefault(path, []).append(key)
    said = dict(damaged)
    for path, keys in holders.items():
        held = f"{len(keys)} context" if len(keys) == 1 else f"{len(keys)} contexts"
        for key in keys:
            said[key] = (f"{damaged[key]}; the damage is one shared weight, {path}, held by {held} "
                         "here: a put of a context holding it writes it again, which heals them all")
    return said


def verify(
    disk: DiskTier | None, keys: Sequence[str], *, every_backward: bool, progress: Progress | None = None
) -> VerifyReport:
    """Checks the committed ``keys`` and the stored backwards of their signatures (with
    ``every_backward``, every stored backward), changing nothing.

    A folder of the tree that cannot be listed (``backwards`` a symbolic link) is reported in
    :attr:`VerifyReport.damaged_folders`, not raised: damage is reported.
    """
    if disk is None:
        return VerifyReport(verified=0)
    total = _planned_bytes(disk, keys) if progress is not None else None
    damaged: dict[str, str] = {}
    signatures: set[str] = set()
    verified = done = 0
    for key in keys:
        try:
            stored = _verify_context(disk, key)
        except ContextNotFoundError:
            continue  # deleted meanwhile, by another process: nothing to check
        except CorruptContextError as err:
            damaged[key] = err.damage or without_key(key, str(err))
        else:
            verified += 1
            signatures.add(stored.spec.signature)
            done += stored.nbytes
        if progress is not None:
            progress(done, total)
    damaged = _shared_weight_damage(disk, damaged)
    folders: dict[str, str] = {}
    try:
        stored_backwards = set(backwards.stored_signatures(disk))
    except CorruptContextError as err:  # refused, never followed: its backwards go unchecked
        stored_backwards, folders[paths.BACKWARDS] = set(), str(err)
    broken: dict[str, str] = {}
    checked = sorted(stored_backwards if every_backward else stored_backwards & signatures)
    for signature in checked:
        try:
            _verify_backward(disk, signature)
        except CorruptContextError as err:
            broken[signature] = str(err)
    return VerifyReport(verified, damaged, len(checked) - len(broken), broken, folders)


def with_damage(report: VerifyReport, found: Mapping[str, str], keys: Collection[str]) -> VerifyReport:
    """``report`` (of a verify of ``keys``) with the damage ``found`` otherwise (key -> why; a
    sealed store's record, see :func:`~residual_store._src.store.item_record.findings`): a key
    of ``keys`` it counted verified is not, and each reason comes first."""
    if not found:
        return report
    damaged = dict(report.damaged)
    verified = report.verified
    for key, why in found.items():
        if key in keys and key not in damaged:
            verified -= 1  # verified by its checksums, but not what was recorded
        damaged[key] = why if key not in damaged else f"{why}; {damaged[key]}"
    return dataclasses.replace(report, verified=verified, damaged=damaged)
