"""Bytes on disk for residual-store: zarr v3 arrays, checksums, msgpack manifests.

This package knows nothing about JAX: it stores numpy arrays, dtypes, shapes and
bytes. ``residual_store`` builds its disk tier on top of it. No pickle anywhere:
manifests are msgpack validated against a schema, arrays are raw zarr chunks.

One module a job, peers over shared format modules (none imports another's private names):

* :mod:`serializers.zarr`: the zarr v3 format (dtypes, chunk grid, metadata, what every
  writer stores and every reader checks), shared by the three writers below;
* :mod:`serializers.local`: zarr arrays in a plain local folder, with ``os`` calls only;
* :mod:`serializers.kv`: zarr arrays through tensorstore, any kvstore, with
  :mod:`serializers.kv_errors` (tensorstore's errors as the library's) and
  :mod:`serializers.kv_futures` (chaining tensorstore futures);
* :mod:`serializers.bundle`: many arrays as one zip that zarr and tensorstore read;
* :mod:`serializers.files`: local files read and written safely (no link followed, exact
  sizes, fsync, undo on failure), used by :mod:`serializers.local` and the store;
* :mod:`serializers.aligned`: 64-byte aligned buffers every reader reads into;
* :mod:`serializers.manifest`: msgpack manifests, sealed, decoded into typed records;
* :mod:`serializers.checksums`, :mod:`serializers.errors`;
* :mod:`serializers.zarr_compat` (plain zarr-python and the ``ml_dtypes`` floats) and
  :mod:`serializers.zarr_plugin` (the plugin zarr loads that registers them).
"""

from typing import Any

from . import kv
from .aligned import aligned_empty
from .checksums import ALGORITHM, Verifier, checksum, content_digest, verify
from .errors import (
    DISK_FULL_ERRNOS,
    ChecksumMismatchError,
    CorruptDataError,
    DiskFullError,
    SerializationError,
    UnavailableError,
    UnsupportedDTypeError,
    UnsupportedVersionError,
    is_disk_full,
)
from .kv import *  # noqa: F403 - tensorstore I/O, the whole of serializers.kv (its __all__)
from .local import (
    read_array_local,
    read_arrays_local,
    read_chunk_local,
    write_arrays_local,
    write_chunks_local,
)
from .manifest import (
    ARRAY_RECORD_FIELDS,
    BACKWARD_FORMAT,
    BACKWARD_SCHEMA,
    CONTEXT_FORMAT,
    CONTEXT_SCHEMA,
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    ArrayRecord,
    Field,
    ManifestSchema,
    chunked_checksum,
    decode_manifest,
    encode_manifest,
    is_safe_relpath,
)
from .zarr import (
    SUPPORTED_DTYPES,
    ChunkedArray,
    check_chunk_shape,
    chunk_grid,
    chunk_index_key,
    chunk_key,
    chunk_region,
    chunk_shape,
    encode_group_metadata,
    encode_zarr_metadata,
    group_metadata,
    numpy_dtype,
    zarr_dtype_name,
    zarr_metadata,
)

__all__ = [
    # errors
    "SerializationError",
    "ChecksumMismatchError",
    "CorruptDataError",
    "UnsupportedVersionError",
    "DiskFullError",
    "DISK_FULL_ERRNOS",
    "is_disk_full",
    "UnavailableError",
    "UnsupportedDTypeError",
    # checksums
    "ALGORITHM",
    "checksum",
    "Verifier",
    "content_digest",
    "verify",
    # manifest
    "FORMAT_VERSION",
    "CONTEXT_FORMAT",
    "BACKWARD_FORMAT",
    "MAX_MANIFEST_BYTES",
    "Field",
    "ManifestSchema",
    "CONTEXT_SCHEMA",
    "BACKWARD_SCHEMA",
    "ARRAY_RECORD_FIELDS",
    "ArrayRecord",
    "chunked_checksum",
    "encode_manifest",
    "decode_manifest",
    "is_safe_relpath",
    # zarr v3 format (serializers.zarr)
    "SUPPORTED_DTYPES",
    "zarr_dtype_name",
    "numpy_dtype",
    "chunk_shape",
    "chunk_key",
    "check_chunk_shape",
    "chunk_grid",
    "chunk_index_key",
    "chunk_region",
    "ChunkedArray",
    "zarr_metadata",
    "encode_zarr_metadata",
    "group_metadata",
    "encode_group_metadata",
    # tensorstore I/O: every public name of serializers.kv
    *kv.__all__,
    # the local fast path (serializers.local)
    "aligned_empty",
    "write_arrays_local",
    "read_array_local",
    "read_arrays_local",
    "write_chunks_local",
    "read_chunk_local",
    # plain zarr-python (serializers.zarr_compat, which imports zarr: loaded when first asked for)
    "register_zarr_dtypes",  # noqa: F405 - defined on first use, by __getattr__ below
]


def __getattr__(name: str) -> Any:
    """``register_zarr_dtypes``, imported from :mod:`serializers.zarr_compat` on first use, so
    that ``import serializers`` does not import zarr."""
    if name == "register_zarr_dtypes":
        from .zarr_compat import register_zarr_dtypes

        globals()[name] = register_zarr_dtypes
        return register_zarr_dtypes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
