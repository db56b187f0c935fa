"""Bytes on disk for residual-store: zarr v3 arrays, checksums, msgpack manifests.

This package knows nothing about JAX: it stores numpy arrays, dtypes, shapes and
bytes. ``residual_store`` builds its disk tier on top of it. No pickle anywhere:
manifests are msgpack validated against a schema, arrays are raw zarr chunks.
"""

from serializers.arrays import (
    SUPPORTED_DTYPES,
    KvStoreSpec,
    aligned_empty,
    chunk_key,
    chunk_shape,
    default_context,
    encode_zarr_metadata,
    local_root,
    numpy_dtype,
    read_array,
    read_array_async,
    read_array_local,
    read_arrays,
    register_zarr_dtypes,
    write_array,
    write_array_async,
    write_array_local,
    write_arrays,
    write_arrays_local,
    zarr_dtype_name,
    zarr_metadata,
)
from serializers.checksums import ALGORITHM, checksum, content_digest, verify
from serializers.errors import (
    CorruptDataError,
    DiskFullError,
    SerializationError,
    UnsupportedDTypeError,
    UnsupportedVersionError,
)
from serializers.manifest import (
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
    decode_manifest,
    encode_manifest,
    is_safe_relpath,
)

__all__ = [
    # errors
    "SerializationError",
    "CorruptDataError",
    "UnsupportedVersionError",
    "DiskFullError",
    "UnsupportedDTypeError",
    # checksums
    "ALGORITHM",
    "checksum",
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
    "encode_manifest",
    "decode_manifest",
    "is_safe_relpath",
    # arrays
    "SUPPORTED_DTYPES",
    "KvStoreSpec",
    "zarr_dtype_name",
    "numpy_dtype",
    "chunk_shape",
    "chunk_key",
    "zarr_metadata",
    "encode_zarr_metadata",
    "default_context",
    "local_root",
    "aligned_empty",
    "write_array",
    "write_array_async",
    "write_arrays",
    "read_array",
    "read_array_async",
    "read_arrays",
    "write_array_local",
    "write_arrays_local",
    "read_array_local",
    "register_zarr_dtypes",
]
