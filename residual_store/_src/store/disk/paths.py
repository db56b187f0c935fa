"""Where each thing of a store lives, and the keys that name its contexts: every path of the
store's tree is spelled here and nowhere else (the other modules ask these functions and
constants)::

    residual-store.json                  store marker: format and version
    zarr.json                            zarr v3 root group (attributes: format, version)
    contexts/<key>.manifest              msgpack manifest; its presence is the commit
    data/zarr.json                       zarr v3 group of the contexts' own data
    data/<key>.<write id>/zarr.json      zarr v3 group of one write (attributes: key, signature,
                                         and every array of the context, weights included; no
                                         member where the folder holds no array)
    data/<key>.<write id>/bundle.zip     the bundle: a zarr v3 group in one zip holding the
                                         context's own single-chunk arrays, <i>/ for residual <i>
    data/<key>.<write id>/<i>/           zarr v3 array: residual <i>, the context's own, when not
                                         in the bundle (a sharded one, or one past its limits)
    data/.free/<layout>.<id>/            a replaced context's data folder, kept for reuse
    data/.trash/<id>/                    a folder gc took, being removed
    weights/zarr.json                    zarr v3 group of the shared arrays
    weights/<digest>/                    zarr v3 array: a weight or constant, stored once
    backwards/<signature>.export         the serialized backward (jax.export)
    backwards/<signature>.manifest       its manifest (written last)

Paths are relative to the store's root, ``/``-separated, and safe relative paths
(:func:`serializers.is_safe_relpath`) for every key :func:`validate_key` accepts.

A key names a context's files (``contexts/<key>.manifest``, ``data/<key>.<write id>/``), so its
rules live here with the paths it enters: 1 to 128 characters of ``[A-Za-z0-9._-]``, not starting
with ``.``. The rule keeps every key a single, safe file name on every kvstore: no separators, no
``..``, nothing hidden, nothing that could escape the store's folder.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

from residual_store._src.errors import InvalidKeyError
from residual_store_serializers.bundle import BUNDLE_FILE

__all__ = [
    "BACKWARDS",
    "CONTEXTS",
    "DATA",
    "FREE_DIR",
    "GROUPS",
    "MANIFEST_SUFFIX",
    "STORE_FORMAT",
    "STORE_MARKER",
    "STORE_VERSION",
    "TRASH_DIR",
    "WEIGHTS",
    "backward_paths",
    "bundle_path",
    "data_dir",
    "group_metadata_path",
    "in_bundle_name",
    "is_data_dir_of",
    "is_node_metadata",
    "is_weight_path",
    "manifest_path",
    "new_key",
    "new_write_id",
    "own_array_path",
    "put_key",
    "recycled_path",
    "staging_path",
    "trash_path",
    "validate_key",
    "weight_path",
]

STORE_MARKER = "residual-store.json"
STORE_VERSION = 2
"""Version 2 adds the zarr v3 groups; version 1 stores are read, and upgraded by a write."""
STORE_FORMAT = b'{"format": "residual-store", "version": 2}\n'
ITEM_RECORD = "item-record.json"
"""What a sealed store holds (an Orbax step's contexts item; see ``item_record.py``)."""

CONTEXTS = "contexts"
DATA = "data"
WEIGHTS = "weights"
BACKWARDS = "backwards"
FREE_DIR = f"{DATA}/.free"
TRASH_DIR = f"{DATA}/.trash"
MANIFEST_SUFFIX = ".manifest"
_EXPORT_SUFFIX = ".export"
_GROUP_METADATA = "zarr.json"  # zarr v3's name for a node's metadata

GROUPS = ("", DATA, WEIGHTS)
"""The folders that are zarr groups in every store (the root, ``data``, ``weights``)."""


# -- keys ------------------------------------------------------------------------------------------

_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def validate_key(key: object) -> str:
    """``key`` as a plain ``str`` if it follows the rules; raises :class:`InvalidKeyError`
    otherwise.

    A ``str`` subclass is taken by its characters, and only where it says the same of itself
    (``str()``, ``format()`` and ``os.fspath()`` give those characters, as a ``StrEnum``
    member's do): one that says another key is refused, since which key it names is ambiguous,
    and the plain ``str`` is returned, so that nothing the subclass overrides can make the key
    used differ from the key checked.
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"store keys are str, got {type(key).__name__}")
    text = str.__str__(key)  # the characters themselves, whatever the subclass says of them
    if not _KEY.fullmatch(text):
        raise InvalidKeyError(
            f"invalid store key {str.__repr__(key)}: use 1 to 128 characters from [A-Za-z0-9._-], "
            "not starting with '.'"
        )
    if type(key) is not str and _what_it_says(key) != {text}:
        raise InvalidKeyError(
            f"store key {text!r} is a {type(key).__name__} (a str subclass) whose str(), format() or "
            "os.fspath() gives another text: pass the key as a plain str"
        )
    return text


def _what_it_says(key: str) -> set[object]:
    """What a ``str`` subclass's own methods make of it (its text where one raises)."""
    said: set[object] = set()
    conversions: list[Callable[[str], object]] = [str, lambda k: format(k, "")]
    if hasattr(type(key), "__fspath__"):
        conversions.append(lambda k: type(k).__fspath__(k))  # type: ignore[attr-defined]  # checked just above
    for convert in conversions:
        try:
            said.add(convert(key))
        except Exception:  # noqa: BLE001 - any failure of the subclass's code is a lie
            said.add(None)
    return said


def new_key() -> str:
    """A fresh unique key (32 hex digits)."""
    return uuid.uuid4().hex


def put_key(key: str | None) -> str:
    """The key a put of ``key`` stores under in a single process: ``key`` checked
    (:func:`validate_key`), or a fresh one (:func:`new_key`) for ``None``."""
    return new_key() if key is None else validate_key(key)


# -- paths -----------------------------------------------------------------------------------------


def new_write_id() -> str:
    """A fresh write id: 12 lowercase hex digits (what ``data_dir`` and recycled names take)."""
    return uuid.uuid4().hex[:12]


def manifest_path(key: str) -> str:
    return f"{CONTEXTS}/{key}{MANIFEST_SUFFIX}"


def data_dir(key: str, write_id: str) -> str:
    """The folder of one write's own arrays; ``write_id`` is 12 lowercase hex digits."""
    return f"{DATA}/{key}.{write_id}"


def own_array_path(folder: str, i: int) -> str:
    return f"{folder}/{i}"


def bundle_path(folder: str) -> str:
    """A write's bundle: its own single-chunk arrays in one file (:mod:`serializers.bundle`)."""
    return f"{folder}/{BUNDLE_FILE}"


def in_bundle_name(i: int) -> str:
    """What the layout digest calls residual ``i`` in the bundle (never a folder's name)."""
    return f"{BUNDLE_FILE}/{i}"


def weight_path(digest: str) -> str:
    return f"{WEIGHTS}/{digest}"


def staging_path(path: str, write_id: str) -> str:
    """Where a collective write assembles a sharded weight before renaming it into place."""
    return f"{path}.{write_id}.tmp"


def recycled_path(folder_shape: str, unique: str) -> str:
    return f"{FREE_DIR}/{folder_shape}.{unique}"


def trash_path(unique: str) -> str:
    return f"{TRASH_DIR}/{unique}"


def backward_paths(signature: str) -> tuple[str, str]:
    """The stored backward's export and its manifest (the manifest is its commit)."""
    return f"{BACKWARDS}/{signature}{_EXPORT_SUFFIX}", f"{BACKWARDS}/{signature}{MANIFEST_SUFFIX}"


def is_node_metadata(name: str) -> bool:
    """Whether an entry of a group's folder is the group's own metadata, not a child."""
    return name == _GROUP_METADATA


def group_metadata_path(folder: str) -> str:
    return f"{folder}/{_GROUP_METADATA}" if folder else _GROUP_METADATA


_WRITE_ID = re.compile(r"[0-9a-f]{12}")
_WEIGHT_PATH = re.compile(re.escape(WEIGHTS) + r"/[0-9a-f]{32}")


def is_data_dir_of(key: str, folder: object) -> bool:
    """Whether ``folder`` is a folder :func:`data_dir` makes for ``key`` (some write id): two
    keys never have one folder (the key is all of its name but the last 13 characters)."""
    prefix = f"{DATA}/{key}."
    return isinstance(folder, str) and folder.startswith(prefix) and bool(_WRITE_ID.fullmatch(folder[len(prefix):]))


def is_weight_path(path: object) -> bool:
    """Whether ``path`` is where :func:`weight_path` puts a weight (a 32-hex-digit digest)."""
    return isinstance(path, str) and bool(_WEIGHT_PATH.fullmatch(path))
