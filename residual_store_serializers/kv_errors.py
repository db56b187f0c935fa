"""tensorstore's errors as the library's: what a kvstore's failure means to a caller.

tensorstore reports every failure as a ``ValueError`` whose message starts with an absl status
(``NOT_FOUND``, ``UNAVAILABLE``...) and may carry the OS error code. A caller of
:mod:`serializers.kv` gets instead :class:`~serializers.errors.CorruptDataError` (what is stored
is wrong or missing), :class:`~serializers.errors.DiskFullError` (no space to write),
:class:`~serializers.errors.UnavailableError` (the store did not answer) or ``PermissionError``:
errors it can act on without parsing messages.
"""

from __future__ import annotations

import errno
import re
from typing import Any, Final

from .errors import DISK_FULL_ERRNOS, CorruptDataError, DiskFullError, UnavailableError

__all__ = [
    "convert_read_error",
    "convert_write_error",
    "is_missing_bucket",
    "is_unavailable",
    "ts_errno",
    "ts_message",
    "unavailable_error",
    "wait_request",
]

_OS_ERROR_CODE: Final = re.compile(r"os_error_code=\\?'?(\d+)")
_CORRUPT_STATUS: Final = (
    "NOT_FOUND",
    "FAILED_PRECONDITION",
    "DATA_LOSS",
    "OUT_OF_RANGE",
    "INVALID_ARGUMENT",
)


_UNAVAILABLE_STATUS: Final = ("ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNAUTHENTICATED")
# what an object store answers when the bucket itself is not there: S3's error code, and the
# words of S3's and GCS's messages
_NO_BUCKET: Final = ("NoSuchBucket", "bucket does not exist")


def is_missing_bucket(e: BaseException) -> bool:
    """Whether ``e`` says the object store's bucket is not there (deleted, or a server that
    restarted without it): the whole store is out of reach, not one object of it missing (a
    missing object is no error: a read gives no value)."""
    message = ts_message(e)
    return "NOT_FOUND" in message and any(words in message for words in _NO_BUCKET)


def is_unavailable(e: BaseException) -> bool:
    """Whether ``e`` says the kvstore did not answer or gave up (connection refused and its
    retries exhausted, a timeout, the service unavailable) or is not there (its bucket gone),
    rather than what it holds being wrong."""
    if isinstance(e, (UnavailableError, TimeoutError)):
        return True
    message = ts_message(e)
    return isinstance(e, ValueError) and (
        message.startswith(_UNAVAILABLE_STATUS) or "CURL error" in message or is_missing_bucket(e)
    )


def unavailable_error(e: BaseException, what: str, timeout: float | None) -> UnavailableError:
    """``e`` (a timeout, or tensorstore giving up) as the :class:`UnavailableError` naming ``what``."""
    if isinstance(e, UnavailableError):
        return e
    if isinstance(e, TimeoutError):
        err = UnavailableError(errno.ETIMEDOUT, f"{what}: no answer within {timeout:g} s")
    else:
        err = UnavailableError(errno.EIO, f"{what}: {ts_message(e)}")
    err.__cause__ = e
    return err


def wait_request(future: Any, timeout: float | None = None, what: str = "kvstore request") -> Any:
    """``future.result()``, waiting at most ``timeout`` seconds (``None``: as long as it takes);
    :class:`UnavailableError` for a request that outlives it or that tensorstore gave up on."""
    try:
        return future.result(timeout=timeout)
    except Exception as e:  # noqa: BLE001 - tensorstore raises ValueError and others
        if is_unavailable(e):
            raise unavailable_error(e, what, timeout) from None
        raise


def ts_message(e: BaseException) -> str:
    """tensorstore's message without the (long) echo of the full spec."""
    return str(e).split(" [tensorstore_spec=", 1)[0]


def ts_errno(e: BaseException) -> int | None:
    """The OS error code tensorstore reports in ``e``'s message, if any."""
    m = _OS_ERROR_CODE.search(str(e))
    return int(m.group(1)) if m else None


def convert_write_error(e: BaseException, what: str) -> BaseException:
    """The error to raise for a failed write of ``what``: unavailable, disk full, or ``e``."""
    if is_unavailable(e):
        return unavailable_error(e, what, None)
    code = ts_errno(e)
    if code in DISK_FULL_ERRNOS:
        err = DiskFullError(code, f"{what}: disk full while writing: {ts_message(e)}")
        err.__cause__ = e
        return err
    return e


def convert_read_error(e: BaseException, what: str) -> BaseException:
    """The error to raise for a failed read of ``what``: unavailable, permission denied,
    corrupt (missing or malformed data), or ``e``."""
    if is_unavailable(e):
        return unavailable_error(e, what, None)
    code = ts_errno(e)
    message = ts_message(e)
    if code in (errno.EACCES, errno.EPERM) or message.startswith("PERMISSION_DENIED"):
        err: BaseException = PermissionError(code or errno.EACCES, f"{what}: {message}")
    elif message.startswith(_CORRUPT_STATUS) or code in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR):
        err = CorruptDataError(f"{what}: cannot read array ({message})")
    else:
        return e
    err.__cause__ = e
    return err
