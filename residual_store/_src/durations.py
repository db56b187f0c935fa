"""Durations as people write them: seconds (``90``, ``0.5``), or a number and a unit (``"90s"``,
``"15m"``, ``"1h"``, ``"2d"``). One parser for ``Store.gc(older_than=...)`` and the command
line's ``--older-than``, so both take the same forms and refuse the same ones. It imports nothing
of the library (the command line checks its arguments before it imports JAX or the store): a
refusal is a ``ValueError``, which each caller raises as its own kind of error."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["parse_duration"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
FORMS = "seconds, or 90s, 15m, 1h, 2d"


def parse_duration(value: Any, name: str) -> float:
    """``value`` (a number of seconds, or a string of one with a unit) as seconds.

    Example:
      >>> parse_duration("1h", "older_than"), parse_duration(90, "older_than"), parse_duration("0", "older_than")
      (3600.0, 90.0, 0.0)

    Raises:
      ValueError: a negative or non-finite duration, a ``bool``, an unknown unit, garbage.
    """
    if isinstance(value, str):
        text = value.strip().lower()
        scale = _UNITS.get(text[-1:])
        try:
            seconds = float(text[:-1] if scale is not None else text) * (scale or 1)
        except ValueError:
            raise ValueError(f"{name}: {value!r} is not a duration ({FORMS})") from None
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValueError(f"{name} must be a duration ({FORMS}), got {type(value).__name__} {value!r:.60}")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{name}: {value!r} is not a duration of at least 0 ({FORMS})")
    return seconds
