"""Plain zarr-python reading the ``ml_dtypes`` floats: zarr data types for them.

The arrays of :mod:`serializers.zarr` are plain zarr v3, and zarr-python (3.1 and later)
reads the numpy types as they are. It does not know the ``ml_dtypes`` floats
(``bfloat16``, ``float8_*``, ``float4_e2m1fn``) and refuses to open their metadata
until they are in its data type registry. This module defines one zarr data type class
per such name that zarr does not already know (where zarr knows one, the name here is
zarr's own class, so nothing of zarr's is ever replaced), and :func:`register_zarr_dtypes`
puts them in zarr's registry. ``int2``/``int4`` stay tensorstore-only.

The classes are declared as entry points of the group ``zarr.data_type`` (see
``pyproject.toml``), the group zarr-python collects data type plugins from. zarr-python (3.1.0
to at least 3.3.0) collects that group but never loads it, so :mod:`serializers.zarr_plugin`
registers them through a group zarr does load: wherever residual-store is installed, a process
that only imports zarr reads these arrays with no call once it has opened a group.
:func:`register_zarr_dtypes` does the same by hand, for a process whose first zarr call is
``zarr.open_array`` on such an array (zarr's documented way:
``zarr.dtype.data_type_registry.register``).

Only zarr's public modules are used: ``zarr.dtype`` and ``zarr.errors``. The classes derive from
``zarr.dtype.Float16``, zarr's public float class, for its JSON and fill value handling (the
generic base class of zarr's floats lives in the private ``zarr.core``); each overrides every
name and native type ``Float16`` has.

Importing this module imports zarr; ``import serializers`` does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final

import numpy as np
from zarr.dtype import Float16, data_type_registry

try:  # zarr >= 3.2 moved it here (and deprecates importing it from zarr.dtype)
    from zarr.errors import DataTypeValidationError
except ImportError:  # zarr 3.1
    from zarr.dtype import DataTypeValidationError  # type: ignore[attr-defined,no-redef]

from .zarr import SUPPORTED_DTYPES

__all__ = [
    "register_zarr_dtypes",
    "Bfloat16",
    "Float8E3M4",
    "Float8E4M3FN",
    "Float8E4M3FNUZ",
    "Float8E4M3B11FNUZ",
    "Float8E5M2",
    "Float8E5M2FNUZ",
    "Float8E8M0FNU",
    "Float4E2M1FN",
]


@dataclass(frozen=True, kw_only=True)
class _MlDtypesFloat(Float16):
    """A zarr data type for one ``ml_dtypes`` float: zarr v3 name ``_zarr_v3_name``, numpy
    dtype ``_native``, stored little endian (zarr v2 has no name for it)."""

    _native: ClassVar[np.dtype]
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> _MlDtypesFloat:
        if np.dtype(dtype) == cls._native:
            return cls(endianness="little")
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {cls._native}")

    def to_native_dtype(self) -> np.dtype:
        return self._native

    @property
    def item_size(self) -> int:
        return self._native.itemsize


def _zarr_float(name: str) -> type[Float16]:
    """The zarr data type class of the ``ml_dtypes`` float ``name``: zarr's own if it has one,
    else a :class:`_MlDtypesFloat` named after it (``float8_e4m3fn`` -> ``Float8E4M3FN``)."""
    known = data_type_registry.contents.get(name)
    if known is not None and not issubclass(known, _MlDtypesFloat):
        return known
    native = SUPPORTED_DTYPES[name]
    first, *rest = name.split("_")
    class_name = first.capitalize() + "".join(part.upper() for part in rest)
    namespace = {
        "dtype_cls": type(native),
        "_zarr_v3_name": name,
        "_native": native,
        "__module__": __name__,
        "__qualname__": class_name,
        "__doc__": f"The zarr data type ``{name}`` (``ml_dtypes.{name}``), little endian.",
    }
    return dataclass(frozen=True, kw_only=True)(type(class_name, (_MlDtypesFloat,), namespace))


# One class per ml_dtypes float of SUPPORTED_DTYPES; pyproject.toml names each as an entry point.
Bfloat16: Final = _zarr_float("bfloat16")
Float8E3M4: Final = _zarr_float("float8_e3m4")
Float8E4M3FN: Final = _zarr_float("float8_e4m3fn")
Float8E4M3FNUZ: Final = _zarr_float("float8_e4m3fnuz")
Float8E4M3B11FNUZ: Final = _zarr_float("float8_e4m3b11fnuz")
Float8E5M2: Final = _zarr_float("float8_e5m2")
Float8E5M2FNUZ: Final = _zarr_float("float8_e5m2fnuz")
Float8E8M0FNU: Final = _zarr_float("float8_e8m0fnu")
Float4E2M1FN: Final = _zarr_float("float4_e2m1fn")

_ZARR_FLOATS: Final[tuple[type[Float16], ...]] = (
    Bfloat16, Float8E3M4, Float8E4M3FN, Float8E4M3FNUZ, Float8E4M3B11FNUZ,
    Float8E5M2, Float8E5M2FNUZ, Float8E8M0FNU, Float4E2M1FN,
)  # fmt: skip
_ZARR_FLOAT_NAMES: Final[tuple[str, ...]] = tuple(cls._zarr_v3_name for cls in _ZARR_FLOATS)


def register_zarr_dtypes() -> tuple[str, ...]:
    """Teaches zarr-python the ``ml_dtypes`` floating types, so plain ``zarr.open_array`` reads
    ``bfloat16``, ``float8_*`` and ``float4_e2m1fn`` arrays.

    Idempotent; a name zarr already knows keeps zarr's own class. ``int2``/``int4`` are not
    registered. Returns the names registered.
    """
    for cls in _ZARR_FLOATS:
        if cls._zarr_v3_name not in data_type_registry.contents:  # never override zarr's own
            data_type_registry.register(cls._zarr_v3_name, cls)
    return _ZARR_FLOAT_NAMES
