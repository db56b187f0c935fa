"""Store keys: 1 to 128 characters of ``[A-Za-z0-9._-]``, not starting with ``.``.

The rule keeps every key a single, safe file name on every kvstore: no separators, no ``..``,
nothing hidden, nothing that could escape the store's folder.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

from residual_store._src.errors import InvalidKeyError

__all__ = ["new_key", "put_key", "validate_key"]

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
