"""The plugin zarr-python loads by itself: it registers the ``ml_dtypes`` floats, so that a
process that only imports zarr opens a group and reads its ``bfloat16`` and ``float8_*`` arrays
with no call.

zarr-python (3.1.0 to at least 3.3.0) collects the ``zarr.data_type`` entry points, where
``pyproject.toml`` declares these data types, into a list that only the private
``data_type_registry._lazy_load()`` reads: no public call or setting loads them, and reading an
array whose data type is not registered fails. What zarr does load by itself is its
``zarr.buffer`` group: ``zarr.registry.get_buffer_class()`` registers every entry point of that
group on its first call, through ``zarr.core.buffer.default_buffer_prototype()``, which
``zarr.open_group`` calls before it reads the group's ``zarr.json`` (and every read of array
data calls).

So ``pyproject.toml`` declares :data:`Buffer` in the group ``zarr.buffer``. Loading it imports
this module, which registers the floats through zarr's documented call
(:func:`serializers.zarr_compat.register_zarr_dtypes`); zarr then registers :data:`Buffer`,
which *is* zarr's own CPU buffer class, under the name it already has there
(``zarr.core.buffer.cpu.Buffer``): zarr's buffer registry is left as it was, and zarr's
``buffer`` setting still chooses the buffer.

Measured limits: ``zarr.open_array`` (and ``zarr.open``) read an array's metadata with a fixed
buffer prototype and consult no plugin registry before they parse its data type, so a process
whose first zarr call is one of them on such an array is still refused; one that opened a group
first is not. Importing this module imports ``serializers`` (tensorstore and msgpack among its
dependencies), once per process that reads with zarr.

Nothing here is private to zarr; ``tests/test_zarr_compat.py`` checks the one assumption (the
buffer plugins load before ``open_group`` parses a data type), and says when zarr starts
loading ``zarr.data_type`` itself and this module can go.
"""

from __future__ import annotations

from typing import Final

from zarr.buffer.cpu import Buffer as _ZarrCpuBuffer

from .zarr_compat import register_zarr_dtypes

__all__ = ["Buffer"]

Buffer: Final = _ZarrCpuBuffer
"""zarr's own CPU buffer class, the object the ``zarr.buffer`` entry point names."""

register_zarr_dtypes()
