"""Byte budgets as people write them: ``8 * 2**30``, ``"8GiB"``, ``"512 MB"``, ``"50%"``.

A size is an ``int`` of bytes or a string of a number and a unit, binary (``KiB``, ``MiB``,
``GiB``, ``TiB``) or decimal (``kB``, ``MB``, ``GB``, ``TB``), the unit's case free; a share
(``"50%"``) is of a device's memory (``device.memory_stats()["bytes_limit"]``), worked out once
when the store opens. The store's other numbers (byte counts, seconds) are checked here too.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from typing import Any, Literal, overload

import numpy as np

from residual_store._src.durations import parse_duration
from residual_store._src.errors import InvalidArgumentError

__all__ = [
    "Headroom", "check_flags", "memory_stats", "parse_age", "parse_budget", "parse_bytes", "parse_seconds", "parse_size",
]

_UNITS = {
    "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,  # (a bare "8G" is ambiguous: refused)
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
_SHARE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*%\s*")
_FORMS = 'bytes as an int, a string with a unit ("512MiB", "8 GiB", "2GB")'


def parse_bytes(value: Any, name: str) -> int:
    """``value``, a count of bytes given as a non-negative ``int`` (no unit), as an ``int``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def check_flags(**flags: Any) -> None:
    """Raises :class:`InvalidArgumentError` for a flag that is not a ``bool`` (``"no"`` is a
    true string, and would be taken for ``True``)."""
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise InvalidArgumentError(f"{name} must be True or False, got {type(value).__name__} {value!r:.60}")


def parse_age(value: Any, name: str) -> float:
    """An age (``gc``'s ``older_than``) as the command line's ``--older-than`` takes it: seconds,
    or ``"90s"``, ``"15m"``, ``"1h"``, ``"2d"`` (:func:`~residual_store._src.durations.parse_duration`)."""
    try:
        return parse_duration(value, name)
    except ValueError as err:
        raise InvalidArgumentError(str(err)) from None


@overload
def parse_seconds(value: Any, name: str, *, optional: Literal[False] = False) -> float: ...
@overload
def parse_seconds(value: Any, name: str, *, optional: bool) -> float | None: ...
def parse_seconds(value: Any, name: str, *, optional: bool = False) -> float | None:
    """``value``, a positive finite number of seconds (or, if ``optional``, ``None``), as a float."""
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < float("inf"):
        raise InvalidArgumentError(
            f"{name} must be a positive number of seconds{' or None' if optional else ''}, got {value!r}"
        )
    return float(value)


def parse_size(value: Any, name: str) -> int | None:
    """``value`` (bytes, a string with a unit, or ``None``) as bytes.

    Example:
      >>> parse_size("1.5 GiB", "host_budget"), parse_size("2GB", "host_budget")
      (1610612736, 2000000000)

    Raises:
      InvalidArgumentError: a negative or fractional size, a float, an unknown unit, garbage.
    """
    if value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        if value < 0:
            raise InvalidArgumentError(f"{name} must be >= 0 bytes, got {value}")
        return int(value)
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        unit = _UNITS.get(m.group(2).lower()) if m else None
        if m and unit is not None:
            size = float(m.group(1)) * unit
            if size != int(size):
                raise InvalidArgumentError(f"{name} {value!r} is not a whole number of bytes")
            return int(size)
    raise InvalidArgumentError(f"{name} must be {_FORMS}, or None (unbounded); got {type(value).__name__} {value!r:.60}")


def parse_budget(value: Any, name: str, device: Any = None) -> int | None:
    """A budget: :func:`parse_size`, or for a ``device`` a share of its memory (``"50%"``).

    Raises:
      InvalidArgumentError: as :func:`parse_size`; a share outside (0, 100], a share where no
        device is given, or of a device whose backend reports no memory limit (CPU).
    """
    m = _SHARE.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        return parse_size(value, name)
    share = float(m.group(1))
    if not 0 < share <= 100:
        raise InvalidArgumentError(f"{name} {value!r}: a share of memory must be in (0%, 100%]")
    if device is None:
        raise InvalidArgumentError(f"{name} {value!r}: only a device budget can be a share of memory")
    return int(device_memory_limit(device, name) * share / 100)


def memory_stats(device: Any) -> dict[str, Any]:
    """``device.memory_stats()``, ``{}`` where the backend reports none."""
    try:
        return dict(device.memory_stats() or {})
    except Exception:  # noqa: BLE001 - backends without memory stats raise several types
        return {}


def device_memory_limit(device: Any, name: str) -> int:
    """``device.memory_stats()["bytes_limit"]``; :class:`InvalidArgumentError` naming memory where
    the backend reports none."""
    limit = memory_stats(device).get("bytes_limit")
    if not limit:
        raise InvalidArgumentError(
            f"{name}: a share of the device's memory needs its memory limit, and {device.platform} device "
            f"{device.id} reports none (memory_stats() gives no bytes_limit); give the budget in bytes "
            '(e.g. "8GiB")'
        )
    return int(limit)


@dataclasses.dataclass(frozen=True)
class Headroom:
    """Device memory to leave free for what is not the store's (the model's activations grow and
    shrink around it): where the device's free memory (``bytes_limit - bytes_in_use``) falls
    under ``nbytes``, the store's device tier gives back the difference."""

    device: Any
    nbytes: int

    @classmethod
    def of(cls, value: Any, device: Any) -> Headroom | None:
        """``device_headroom`` (a size, or ``None``) for ``device``.

        Raises:
          InvalidArgumentError: not a size, or a device that reports no ``bytes_limit`` and
            ``bytes_in_use`` (CPU).
        """
        nbytes = parse_size(value, "device_headroom")
        if nbytes is None:
            return None
        stats = memory_stats(device)
        if not stats.get("bytes_limit") or "bytes_in_use" not in stats:
            raise InvalidArgumentError(
                f"device_headroom needs the device's memory in use, and {device.platform} device {device.id} "
                "reports none (memory_stats() gives no bytes_limit and bytes_in_use)"
            )
        return cls(device, nbytes)

    def device_limit(self, held: int) -> int | None:
        """What the device tier may hold now that it holds ``held`` bytes: ``None`` while the
        device's free memory is at least the headroom."""
        stats = memory_stats(self.device)
        free = int(stats.get("bytes_limit", 0)) - int(stats.get("bytes_in_use", 0))
        short = self.nbytes - free
        return None if short <= 0 else max(0, held - short)
