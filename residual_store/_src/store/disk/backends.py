"""Storage backends of the disk tier: a local folder (:mod:`~residual_store._src.store.disk.folder`),
or any tensorstore kvstore (:mod:`~residual_store._src.store.disk.kvstore`); what both implement is
:mod:`~residual_store._src.store.disk.protocol`.

A local folder uses the serializers' fast path, atomic renames and fsync; any other kvstore
(``memory``, ``file`` with options, ``gcs``, ``s3``) goes through tensorstore. What a user
writes as a store's path (a folder, ``~/runs``, ``s3://bucket/run``, a spec) becomes one of the
two in :func:`resolve_path`, once, when the store opens.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import residual_store_serializers as serializers
from residual_store._src.errors import InvalidArgumentError
from residual_store._src.store.disk.folder import LocalBackend, check_writable
from residual_store._src.store.disk.kvstore import KvBackend, is_remote, url_spec
from residual_store._src.store.disk.protocol import Backend
from residual_store._src.store.disk.sdk_logs import sdk_logs_to_logger

__all__ = ["check_path", "open_backend", "opening", "resolve_path"]

Location = str | Mapping[str, Any] | None

# ``scheme://`` at the start of a path: a URL (RFC 3986's scheme characters), never a folder
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# ``scheme:`` as a path's whole first part (then ``/`` or nothing): a URL that lost a slash, as
# ``pathlib.Path("s3://bucket/x")`` makes it (``s3:/bucket/x``); two letters at least, so that a
# drive letter (``C:/``) is not one
_LOST_SLASH = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):(?:/|$)")


def check_path(path: Any) -> None:
    """Raises :class:`InvalidArgumentError` unless ``path`` is of a kind a store takes: a folder
    or a kvstore URL (a non-empty ``str`` or ``os.PathLike``), a kvstore spec (a mapping) or
    ``None``."""
    if path is None or isinstance(path, Mapping):
        return
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"Store path must be a folder (str or os.PathLike), a kvstore URL (str), a tensorstore "
            f"kvstore spec (dict) or None for memory only, got {type(path).__name__}: {path!r}"
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


def opening(path: str | os.PathLike[str] | Mapping[str, Any]) -> AbstractContextManager[None]:
    """Where a store at ``path`` makes its opening requests: an object store's in one window of
    :func:`~residual_store._src.store.disk.sdk_logs.sdk_logs_to_logger`, from the first contact
    to the marker read or written (the SDKs' credential lookups log their last lines as a
    refused request fails, before the next request's own window opens); a folder's as they are."""
    if isinstance(path, Mapping) and serializers.local_root(path) is None and is_remote(path):
        return sdk_logs_to_logger()
    return contextlib.nullcontext()


def resolve_path(path: Any, *, read_only: bool = False, create: bool = True) -> Location:
    """Where a store at ``path`` opens: ``None`` (memory only), a kvstore spec as given, the spec
    of a kvstore URL (``file://``, ``memory://``, ``s3://``, ``gs://``, parsed by tensorstore), or
    a folder with a leading ``~`` expanded to the user's home.

    A path is never taken literally where it means something else: ``"s3://bucket/run"`` as a
    folder would be ``./s3:/bucket/run``, ``"~/runs"`` a folder named ``~``; and a path whose
    first part is ``scheme:`` (``s3:/bucket/run``, what ``pathlib.Path`` makes of the URL) is
    refused with the URL it probably meant. Opened to write
    (``read_only=False``), a local folder that cannot be written is refused here, before
    anything is written.

    Raises:
      InvalidArgumentError: not a path (:func:`check_path`), a URL of another scheme, a URL
        tensorstore refuses, a URL that lost a slash, or a ``~user`` with no such user.
      ReadOnlyStoreError: opened to write where nothing can be written
        (:func:`~residual_store._src.store.disk.folder.check_writable`).
    """
    check_path(path)
    if path is None:
        return None
    location = path if isinstance(path, Mapping) else _from_text(os.fspath(path))
    folder = _local_folder(location)
    if folder is not None and not read_only:
        check_writable(folder, create=create)
    return location


def _from_text(text: str) -> str | dict[str, Any]:
    """The spec of the URL ``text``, or the folder ``text`` with a leading ``~`` expanded."""
    url = _URL_SCHEME.match(text)
    if url is not None:
        return url_spec(text, url.group(1))
    lost = _LOST_SLASH.match(text)
    if lost is not None:
        raise InvalidArgumentError(_lost_slash(text, lost.group(1)))
    folder = os.path.expanduser(text)
    if folder.startswith("~"):
        user = folder[1:].split(os.sep, 1)[0]
        raise InvalidArgumentError(
            f"store path {text!r}: no home folder for user {user!r} to expand ~{user} to"
            if user else f"store path {text!r}: no home folder to expand ~ to (HOME is not set)"
        )
    return folder


def _lost_slash(text: str, scheme: str) -> str:
    """The refusal of ``text``, a path whose first part is ``scheme:``: the URL it probably
    meant, and how to name such a folder if a folder was meant."""
    rest = text[len(scheme) + 1 :].lstrip("/")
    meant = f"{scheme}:///{rest}" if scheme.lower() == "file" else f"{scheme}://{rest}"
    return (
        f"store path {text!r} looks like a URL that lost a slash (as pathlib.Path makes of {meant!r}): "
        f"give {meant!r}; a local folder of that name is {'./' + text!r}"
    )


def _local_folder(location: str | Mapping[str, Any]) -> str | None:
    """The local folder of ``location``: a path, or a ``file`` kvstore spec's path (with
    options or without); ``None`` for any other kvstore."""
    if isinstance(location, str):
        return location
    folder = location.get("path")
    return folder if location.get("driver") == "file" and isinstance(folder, str) and folder else None
