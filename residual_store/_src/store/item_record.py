"""The record a store keeps of what it holds once nothing may change it: an Orbax step's contexts
item (``residual_store.orbax``), sealed when its save commits.

Without it, an item that lost a manifest (a file removed, a step partly deleted by a crash during
``max_to_keep``'s delete) or that holds another step's contexts (a folder copied over) opens and
verifies as a smaller, or another, whole store: nothing in a store says what it should hold. The
record says it: the keys the save wrote, the checksum of each one's manifest, and the name of the
step folder the item was saved in, and the checksum of each stored backward's manifest. A
restore and ``verify`` compare the folder with it.

Invariants:
  - A sealed store's marker names its record's checksum (``"item_record"``): the record is
    written first, then the marker, both inside the step's temporary folder, which Orbax renames
    into place (or commits with its commit file) only once every item is written. A committed
    step's item is sealed whole or not at all.
  - Whatever a partial delete leaves cannot look whole: without the marker the folder is no store
    (it does not open); with it, the record it names must be there, be that record, and every
    key it lists must be there with the manifest it lists, and no other, and (where the storage
    gives sizes) every file each manifest names must be there at its size, and every stored
    backward the record lists must be there, whole: a delete walks the folder in no set order,
    so it can take data files or a backward before any manifest.

Record (``item-record.json``, JSON)::

  {"format": "residual-store item record", "version": 1, "step": "7",
   "manifests": {"mb0": "xxh3_64:<16 hex digits>", ...},
   "backwards": {"rs2-<32 hex digits>": "xxh3_64:<16 hex digits>", ...}}

``backwards`` (the checksum of each stored backward's manifest) was added within version 1: a
record without it (written before 2026-12-05) is checked without its backwards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Collection, Iterable, Mapping, Sequence

import residual_store_serializers as serializers
from residual_store._src.errors import ContextNotFoundError, CorruptContextError, InvalidKeyError, ResidualStoreWarning
from residual_store._src.store import backwards
from residual_store._src.store.disk import paths
from residual_store._src.store.disk.damage import size_damage
from residual_store._src.store.disk.folder import LocalBackend
from residual_store._src.store.disk.paths import ITEM_RECORD, STORE_MARKER, validate_key
from residual_store._src.store.disk.records import check_signature
from residual_store._src.store.disk.tier import DiskTier
from residual_store._src.store.workers import request_pool
from residual_store_serializers.checksums import parse_checksum

__all__ = ["Record", "check_item", "findings", "read", "seal"]

FORMAT = "residual-store item record"
VERSION = 1
_MARKER_FIELD = "item_record"  # the marker's field naming the record's checksum
_MARKER_MAX_BYTES = 1 << 16  # what layout.marker_version reads of a marker at most
_STEP_METADATA = "_CHECKPOINT_METADATA"  # the file Orbax writes in every step folder
_LISTED = 8  # keys a restore's error names before "and N more"


def _manifest_checksums(disk: DiskTier, keys: Iterable[str]) -> dict[str, str | None | CorruptContextError]:
    """key -> checksum of its manifest file (``None``: there is none; the error: it cannot be
    read), read one after another from a local folder, many at once from an object store (a
    thousand requests one after another would take tens of seconds)."""

    def one(key: str) -> str | None | CorruptContextError:
        try:
            data = disk.read_manifest_bytes(key)
        except CorruptContextError as err:
            return err
        return serializers.checksum(data) if data is not None else None

    keys = list(keys)
    return dict(zip(keys, request_pool().map(one, keys) if disk.backend.latency_bound else map(one, keys)))


@dataclasses.dataclass(frozen=True)
class Record:
    """What a sealed store holds: ``step``, the name of the step folder it was saved in,
    ``manifests``, key -> checksum of that key's manifest file, and ``backwards``, signature ->
    checksum of its stored backward's manifest (``None``: a record that does not list them)."""

    step: str
    manifests: Mapping[str, str]
    backwards: Mapping[str, str] | None = None


def seal(disk: DiskTier, keys: Sequence[str], step: str) -> None:
    """Records that ``disk`` holds exactly ``keys`` (committed: their manifests are there) as
    saved in step folder ``step``, then names the record in the store's marker, each write
    atomic and synced.

    Raises:
      CorruptContextError: a key has no manifest (the save did not write it): nothing is sealed.
    """
    manifests = _manifest_checksums(disk, sorted(keys))
    for key, checksum in manifests.items():
        if not isinstance(checksum, str):
            raise CorruptContextError(
                f"{disk.description}: context {key!r} was saved but its manifest is "
                f"{'missing' if checksum is None else checksum}; the item is not sealed"
            )
    stored = {sig: disk.backend.get_bytes(paths.backward_paths(sig)[1]) for sig in backwards.stored_signatures(disk)}
    backward_manifests = {sig: serializers.checksum(data) for sig, data in stored.items() if data is not None}
    record = json.dumps(
        {"format": FORMAT, "version": VERSION, "step": step, "manifests": manifests, "backwards": backward_manifests},
        sort_keys=True,
    ).encode()
    disk.backend.put_bytes(ITEM_RECORD, record, fsync=True)
    marker = {**_marker(disk), _MARKER_FIELD: serializers.checksum(record)}
    disk.backend.put_bytes(STORE_MARKER, json.dumps(marker).encode() + b"\n", fsync=True)


def _marker(disk: DiskTier) -> dict[str, object]:
    """The store marker's fields (the disk tier checked its format and version on opening)."""
    data = disk.backend.get_bytes(STORE_MARKER, max_bytes=_MARKER_MAX_BYTES)
    try:
        marker = json.loads(data.decode("utf-8")) if data is not None else None
    except (UnicodeDecodeError, ValueError):
        marker = None
    if not isinstance(marker, dict):
        raise CorruptContextError(f"{disk.description}: the store marker {STORE_MARKER} is missing or damaged")
    return marker


def read(disk: DiskTier) -> Record | None:
    """The record the store's marker names; ``None`` for a store that is not sealed.

    Raises:
      CorruptContextError: the marker names a record that is missing, is not that record, or is
        damaged.
    """
    expected = _marker(disk).get(_MARKER_FIELD)
    if expected is None:
        return None
    if not isinstance(expected, str):
        raise CorruptContextError(f"{disk.description}: the store marker {STORE_MARKER} is damaged ({_MARKER_FIELD})")
    where = f"{disk.description}: the record of what this sealed store holds ({ITEM_RECORD})"
    data = disk.backend.get_bytes(ITEM_RECORD)
    if data is None:
        raise CorruptContextError(
            f"{where} is missing: part of the item was deleted (a crash while Orbax's max_to_keep "
            "removed its step?) or the file removed; what is left cannot be trusted to be whole, "
            "restore another step"
        )
    try:
        serializers.verify(data, expected, what=where)
    except serializers.CorruptDataError as err:
        raise CorruptContextError(f"{err}: not the record this store was sealed with (replaced or damaged)") from None
    return _decode(data, where)


def _decode(data: bytes, where: str) -> Record:
    """The record in ``data`` (untrusted: every field is checked)."""
    try:
        fields = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        fields = None
    if not isinstance(fields, dict) or fields.get("format") != FORMAT:
        raise CorruptContextError(f"{where} is damaged (not a record)")
    if fields.get("version") != VERSION:
        raise CorruptContextError(
            f"{where} has version {fields.get('version')!r}; this residual-store reads version {VERSION}"
        )
    step, manifests, stored = fields.get("step"), fields.get("manifests"), fields.get("backwards", {})
    if not isinstance(step, str) or not isinstance(manifests, dict) or not isinstance(stored, dict):
        raise CorruptContextError(f"{where} is damaged (no step, or no manifests)")
    try:
        for key, checksum in manifests.items():
            validate_key(key)
            parse_checksum(checksum, what=f"{where}: {key!r}")
        for sig, checksum in stored.items():
            check_signature(sig, where)
            parse_checksum(checksum, what=f"{where}: backward {sig!r}")
    except (InvalidKeyError, serializers.CorruptDataError, CorruptContextError) as err:
        raise CorruptContextError(f"{where} is damaged: {err}") from None
    return Record(step, manifests, stored if "backwards" in fields else None)


def _step_here(disk: DiskTier) -> str | None:
    """The name of the Orbax step folder a local store lies in; ``None`` where it lies in none
    (an item copied out of its step, to look at) or is not a local folder (a restore, which
    knows its step, compares it there)."""
    backend = disk.backend
    if not isinstance(backend, LocalBackend):
        return None
    folder = os.path.dirname(backend.root)
    return os.path.basename(folder) if os.path.isfile(os.path.join(folder, _STEP_METADATA)) else None


def _check_step(disk: DiskTier, record: Record, step: str) -> None:
    if record.step != step:
        raise CorruptContextError(
            f"{disk.description} holds the contexts saved in step folder {record.step!r}, not those "
            f"of step {step!r} (an item copied from another step): they do not belong to this "
            f"step's state; restore step {record.step!r}, or save this step again"
        )


def _findings(disk: DiskTier, record: Record, present: Collection[str], checked: Collection[str]) -> dict[str, str]:
    """key -> why, for each key the store holds against its record: listed but not held
    (missing), held but not listed (foreign), or (among ``checked``) held with another manifest
    than the one listed."""
    step = record.step
    found = {
        key: f"missing: the record of step {step!r} lists it, but the item holds no manifest of it "
        "(removed, or the step partly deleted); restore the step from a copy"
        for key in sorted(set(record.manifests) - set(present))
    }
    foreign = sorted(key for key in checked if key not in record.manifests)
    for key in foreign:
        found[key] = (
            f"foreign: not among the contexts step {step!r} saved (its record does not list it): "
            "added to the item after its save, or copied from another step"
        )
    for key, actual in _manifest_checksums(disk, sorted(set(checked) - set(foreign))).items():
        expected = record.manifests[key]
        if isinstance(actual, CorruptContextError):
            found[key] = f"its manifest cannot be read ({actual})"
        elif actual is not None and actual != expected:  # (None: deleted meanwhile)
            found[key] = (
                f"its manifest is not the one step {step!r} saved (recorded {expected}, found {actual}): "
                "replaced after the save, or copied from another step"
            )
    return found


def _backward_damage(disk: DiskTier, record: Record) -> dict[str, str]:
    """signature -> why, for each stored backward the record lists that is missing, another
    than the one saved, or damaged (each read whole and checked: a few per store)."""
    found: dict[str, str] = {}
    for sig, expected in (record.backwards or {}).items():
        data = disk.backend.get_bytes(paths.backward_paths(sig)[1])
        try:
            if data is None:
                raise CorruptContextError("its manifest is missing")
            if serializers.checksum(data) != expected:
                raise CorruptContextError("its manifest is not the one the save wrote")
            backwards.read(disk, sig)
        except CorruptContextError as err:
            found[sig] = f"its stored backward (signature {sig}) is not whole: {err}"
    return found


def _file_damage(disk: DiskTier, record: Record, keys: Iterable[str]) -> dict[str, str]:
    """key -> the first of its files that is missing or of another size (one ``stat`` per file,
    nothing read; nothing found where the storage gives no sizes), or why the stored backward
    of its signature is not whole."""
    broken = _backward_damage(disk, record)

    def one(key: str) -> str | None:
        try:
            stored = disk.stat(key)
        except (ContextNotFoundError, CorruptContextError) as err:
            return str(err)
        damage = size_damage(disk.backend, stored)
        return f"its data is not whole: {damage}" if damage is not None else broken.get(stored.spec.signature)

    keys = list(keys)
    found = request_pool().map(one, keys) if disk.backend.latency_bound else map(one, keys)
    return {key: damage for key, damage in zip(keys, found) if damage is not None}


def check_item(disk: DiskTier, step: str) -> None:
    """Checks that ``disk`` holds what its record says step folder ``step`` saved (reads its
    record and each manifest, looks at the size of each file they name, and reads each stored
    backward the record lists; no arrays): what a restore of an Orbax step's item checks.

    Raises:
      CorruptContextError: the record of another step, or keys missing, foreign, with another
        manifest, with a file missing or of another size, or whose stored backward is not
        whole, each named. An item saved before records (its marker names no record) is
        restored unchecked, with a :class:`ResidualStoreWarning`.
    """
    record = read(disk)
    if record is None:
        # Saved before records (its marker names none: a sealed item's marker always does, and
        # is replaced whole, so no crash turns one into this). Readable, but nothing to check.
        warnings.warn(
            f"{disk.description}, the contexts item of step {step!r}, was saved by a residual-store "
            "before items recorded what they hold: restored as it is, unchecked",
            ResidualStoreWarning,
            stacklevel=3,
        )
        return
    _check_step(disk, record, step)
    present = disk.keys()
    found = _findings(disk, record, present, present)
    found.update(_file_damage(disk, record, sorted(set(present) - set(found))))
    if found:
        listed = [f"{key!r} {why}" for key, why in list(found.items())[:_LISTED]]
        more = f"; and {len(found) - _LISTED} more" if len(found) > _LISTED else ""
        raise CorruptContextError(
            f"{disk.description}, the contexts item of step {step!r}, does not hold what its save "
            f"recorded: {'; '.join(listed)}{more}"
        )


def findings(disk: DiskTier | None, keys: Collection[str], *, whole: bool) -> dict[str, str]:
    """What a sealed store's record finds damaged (key -> why) of a verify of ``keys`` (see
    :func:`~residual_store._src.store.inspection.with_damage`): ``keys`` that are foreign or
    hold another manifest than the step saved, and with ``whole`` (every key was verified) the
    keys the record lists that the store lost. Nothing for a store that is not sealed (``None``:
    a memory-only store).

    Raises:
      CorruptContextError: the record is missing or damaged, or is another step's (for a store
        in a local Orbax step folder); no key can be judged.
    """
    if disk is None:
        return {}  # memory only: nothing sealed
    record = read(disk)
    if record is None:
        return {}
    step = _step_here(disk)
    if step is not None:
        _check_step(disk, record, step)
    return _findings(disk, record, disk.keys() if whole else record.manifests, keys)
