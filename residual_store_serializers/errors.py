"""Exceptions raised by :mod:`serializers`.

The hierarchy is small on purpose. Callers (the store) translate these into their
own public errors; every class also derives from the builtin exception a generic
caller would expect (``ValueError`` for bad data, ``OSError`` for a full disk,
``TypeError`` for a dtype we cannot store), so code written against builtins keeps
working.
"""

from __future__ import annotations

import errno
from typing import Final

__all__ = [
    "DISK_FULL_ERRNOS",
    "is_disk_full",
    "raise_if_disk_full",
    "SerializationError",
    "CorruptDataError",
    "ChecksumMismatchError",
    "UnsupportedVersionError",
    "DiskFullError",
    "UnavailableError",
    "UnsupportedDTypeError",
]


class SerializationError(Exception):
    """Base class of every error :mod:`serializers` raises on purpose."""


class CorruptDataError(SerializationError, ValueError):
    """Stored bytes cannot be trusted.

    Raised for a checksum mismatch, a truncated, oversized or missing chunk, and an
    unreadable or invalid manifest. The message names the array or file concerned.
    A missing chunk is corruption here (zarr itself would silently return the fill
    value), so a reader never hands back made-up data.
    """


class ChecksumMismatchError(CorruptDataError):
    """Bytes read back whole (of the right size) that do not match their stored checksum."""


class UnsupportedVersionError(CorruptDataError):
    """A manifest written by a newer format version than this library reads."""


class DiskFullError(SerializationError, OSError):
    """A write hit ``ENOSPC``, ``EFBIG`` or ``EDQUOT``.

    By the time this is raised, the files that the failed write had created are
    removed again, so a failed write leaves no bytes behind. ``errno`` and
    ``filename`` are set like on the ``OSError`` that caused it.
    """


class UnavailableError(SerializationError, OSError):
    """A kvstore did not answer within the caller's timeout, or refused the request: the
    connection failed and its retries ran out, the service said it is unavailable, or a wait
    timed out. Nothing is known of the request's outcome beyond that (a timed-out put may
    still land), so a caller commits nothing on top of it."""


class UnsupportedDTypeError(SerializationError, TypeError):
    """An array's dtype has no zarr v3 encoding that this module writes."""


DISK_FULL_ERRNOS: Final[frozenset[int]] = frozenset(
    {errno.ENOSPC, errno.EFBIG} | ({errno.EDQUOT} if hasattr(errno, "EDQUOT") else set())
)
"""The ``errno`` values that mean the disk (or a quota) is full: the one rule every writer uses."""


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` says the disk (or a quota) is full: a :class:`DiskFullError`, or an error
    whose ``errno`` is one of :data:`DISK_FULL_ERRNOS`."""
    return isinstance(err, DiskFullError) or getattr(err, "errno", None) in DISK_FULL_ERRNOS


def raise_if_disk_full(err: BaseException, writing: str) -> None:
    """Raises :class:`DiskFullError` (from ``err``) naming ``writing`` if ``err`` is a plain
    ``OSError`` that says the disk is full; returns otherwise (the caller re-raises ``err``)."""
    if isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS and not isinstance(err, DiskFullError):
        raise DiskFullError(err.errno, f"disk full while writing {writing}: {err.strerror}", err.filename) from err
