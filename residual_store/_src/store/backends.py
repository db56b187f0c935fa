"""Storage backends of the disk tier: a local folder (:mod:`~residual_store._src.store.local_backend`),
or any tensorstore kvstore (:mod:`~residual_store._src.store.kv_backend`); what both implement is
:mod:`~residual_store._src.store.backend_protocol`.

A local folder uses the serializers' fast path, atomic renames and fsync; any other kvstore
(``memory``, ``file`` with options, ``gcs``, ``s3``) goes through tensorstore.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import serializers
from residual_store._src.errors import InvalidArgumentError
from residual_store._src.store.backend_protocol import Backend
from residual_store._src.store.kv_backend import KvBackend
from residual_store._src.store.local_backend import LocalBackend

__all__ = ["check_path", "open_backend"]


def check_path(path: Any) -> None:
    """Raises :class:`InvalidArgumentError` unless ``path`` is one a store takes: a folder (a
    non-empty ``str`` or ``os.PathLike``), a kvstore spec (a mapping) or ``None``."""
    if path is None or isinstance(path, Mapping):
        return
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"Store path must be a folder (str or os.PathLike), a tensorstore kvstore spec (dict) or "
            f"None for memory only, got {type(path).__name__}: {path!r}"
        )
    if isinstance(os.fspath(path), bytes):
        raise InvalidArgumentError(f"Store path must be a str path, not bytes: {path!r}")
    if not os.fspath(path):
        raise InvalidArgumentError("Store path is empty: give a folder, or None for memory only")


def open_backend(path: str | os.PathLike[str] | Mapping[str, Any], *, timeout: float | None = None) -> Backend:
    """A backend for a folder path or a tensorstore kvstore spec; ``timeout``: seconds each
    request to an object store may take (a local folder has no requests to bound)."""
    if isinstance(path, Mapping):
        root = serializers.local_root(path)
        return LocalBackend(root) if root is not None else KvBackend(path, timeout)
    return LocalBackend(os.fspath(path))
