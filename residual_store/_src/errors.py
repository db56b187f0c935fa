"""The exception hierarchy and the library's warning categories.

Every error that residual-store raises on purpose derives from :class:`ResidualStoreError`, so
``except rs.ResidualStoreError`` catches all of them. Each concrete error also derives from the
built-in exception a Python user would expect (``ValueError``, ``KeyError``, ``TypeError``), so
code written against the built-ins keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ResidualStoreError",
    "SignatureMismatchError",
    "InvalidArgumentError",
    "ContextNotFoundError",
    "InvalidKeyError",
    "CorruptContextError",
    "StoreFullError",
    "BackwardUnavailableError",
    "StoreNotFoundError",
    "ReadOnlyStoreError",
    "StoreUnavailableError",
    "ResidualStoreWarning",
    "RecomputeWarning",
]


class ResidualStoreError(Exception):
    """Base class of every error raised on purpose by residual-store."""


class SignatureMismatchError(ResidualStoreError, ValueError):
    """A context, cotangent or argument list does not match the signature it is used with."""


class InvalidArgumentError(ResidualStoreError, TypeError):
    """An argument is of a kind that cannot be traced or differentiated (named in the message)."""


class ContextNotFoundError(ResidualStoreError, KeyError):
    """No context is stored under the given key."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""

    @classmethod
    def of(cls, keys: str | Sequence[str], store: object, *, deleted: str = "") -> ContextNotFoundError:
        """The one message of a missing context: ``no context 'k' in store S``, or, for a key
        being deleted, ``context 'k' was deleted from store S`` (``deleted="already"``: ``was
        already deleted``, for a second delete)."""
        if deleted:
            when = "was already deleted" if deleted == "already" else "was deleted"
            return cls(f"context {keys!r} {when} from store {store}")
        names = ", ".join(map(repr, [keys] if isinstance(keys, str) else keys))
        return cls(f"no context {names} in store {store}")


class InvalidKeyError(ResidualStoreError, ValueError):
    """A store key breaks the key rules (1 to 128 of ``[A-Za-z0-9._-]``, not starting with ``.``)."""


class CorruptContextError(ResidualStoreError):
    """Stored data failed verification: checksum, truncation, a missing array, a bad manifest.

    Attributes:
      key: the damaged context's key, where the error is about one context (``None`` for the
        store's own files, such as its marker).
      damage: what is damaged, naming its file once, without the advice (a program that words
        its own, as the command line does, says it after the key).
    """

    key: str | None = None
    damage: str = ""


class StoreFullError(ResidualStoreError):
    """The disk or a budget cannot take a context; the store is left as it was before the write."""


class BackwardUnavailableError(ResidualStoreError):
    """No backward is available for a context's signature in this process."""


class StoreNotFoundError(ResidualStoreError, FileNotFoundError):
    """``create=False`` or ``read_only=True`` on a path that holds no store; nothing was created."""


class ReadOnlyStoreError(ResidualStoreError, PermissionError):
    """A write (``put``, ``pop``, ``delete``, ``gc``) on a store opened with ``read_only=True``,
    or a store opened to write where nothing can be written (a read-only mount, no permission).

    Attributes:
      reason: what cannot be written and why, without the advice (a program that words its own,
        as the command line does, says it in its own terms).
    """

    reason: str = ""


class StoreUnavailableError(ResidualStoreError, OSError):
    """An object store (a tensorstore kvstore such as ``s3`` or ``gcs``) did not answer within
    ``Store(..., timeout=...)`` or refused the request (connection refused, retries exhausted,
    an unknown host, credentials refused). A put that met it is not committed, and nothing
    half-written is ever visible; the message says what to check.

    Attributes:
      reason: what happened, without the advice (a program that words its own, as the command
        line does, says it after its own name for the store).
      timed_out: whether a longer timeout might have helped (the store did not answer in time,
        or tensorstore's retries ran out); ``False`` for what no wait heals (an unknown host,
        refused credentials, a bucket that is not there).
    """

    reason: str = ""
    timed_out: bool = False


class ResidualStoreWarning(UserWarning):
    """Base category of the warnings residual-store emits."""


class RecomputeWarning(ResidualStoreWarning):
    """The traced function will recompute work that a kernel author can avoid.

    Emitted once per signature when a ``jax.custom_vjp`` sits under ``jax.checkpoint`` (remat)
    without ``defvjp(..., optimize_remat=True)``: its fwd then runs once in the forward and again
    in the backward.
    """


# A traceback names each error as ``residual_store.X``, where a user finds it (``rs.X``), not by
# this private module; pickle finds it there too (the package imports it on first use).
for _name in __all__:
    globals()[_name].__module__ = "residual_store"
del _name
