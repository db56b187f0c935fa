"""Store keys: 1 to 128 characters of ``[A-Za-z0-9._-]``, not starting with ``.``.

The rule keeps every key a single, safe file name on every kvstore: no separators, no ``..``,
nothing hidden, nothing that could escape the store's folder.
"""

from __future__ import annotations

import re
import uuid

from residual_store._src.errors import InvalidKeyError

__all__ = ["validate_key", "new_key"]

_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def validate_key(key: object) -> str:
    """Returns ``key`` if it follows the rules; raises :class:`InvalidKeyError` otherwise."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"store keys are str, got {type(key).__name__}")
    if not _KEY.fullmatch(key):
        raise InvalidKeyError(
            f"invalid store key {key!r}: use 1 to 128 characters from [A-Za-z0-9._-], "
            "not starting with '.'"
        )
    return key


def new_key() -> str:
    """A fresh unique key (32 hex digits)."""
    return uuid.uuid4().hex
