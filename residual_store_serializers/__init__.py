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

The package's names are its modules' public names (each module's ``__all__``), so a name is
made public in one place, its module.
"""

from typing import Any

from . import checksums, errors, kv, local, manifest, zarr
from .checksums import *  # noqa: F403 - each module's public names (its __all__) are the package's
from .errors import *  # noqa: F403
from .kv import *  # noqa: F403 - tensorstore I/O
from .local import *  # noqa: F403 - the local fast path, with serializers.files and serializers.aligned
from .manifest import *  # noqa: F403
from .zarr import *  # noqa: F403 - the zarr v3 format

__all__ = list(dict.fromkeys([  # (a name two modules share, as local's of aligned, once)
    *errors.__all__,
    *checksums.__all__,
    *manifest.__all__,
    *zarr.__all__,
    *kv.__all__,
    *local.__all__,
    # plain zarr-python (serializers.zarr_compat, which imports zarr: loaded when first asked for)
    "register_zarr_dtypes",
]))


def __getattr__(name: str) -> Any:
    """``register_zarr_dtypes``, imported from :mod:`serializers.zarr_compat` on first use, so
    that ``import serializers`` does not import zarr."""
    if name == "register_zarr_dtypes":
        from .zarr_compat import register_zarr_dtypes

        globals()[name] = register_zarr_dtypes
        return register_zarr_dtypes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
