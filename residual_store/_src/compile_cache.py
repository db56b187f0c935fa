"""JAX's persistent compilation cache, as an option.

A process that runs backwards from a store compiles each signature's backward once; with the
persistent cache, the next process (a restarted job, another worker) loads the executable from
disk instead of compiling it again. The cache is JAX's own (``jax_compilation_cache_dir``); this
module only switches it on with settings that suit residual-store: every executable is cached,
however quickly it compiled, since the split forward and backward of one signature are reused by
many processes.
"""

from __future__ import annotations

import os

import jax

from residual_store._src.errors import InvalidArgumentError

__all__ = ["enable_compilation_cache"]


def enable_compilation_cache(directory: str | os.PathLike[str], *, min_compile_time_secs: float = 0.0) -> None:
    """Caches compiled executables in ``directory`` for this and later processes.

    A process-wide JAX setting (it applies to every compile of this process from now on).

    Raises:
      InvalidArgumentError: ``directory`` is not a path, or not a folder nor one this process
        can make (a file, a file on the way to it, a read-only location), named in the message.

    Example:
      >>> import tempfile, residual_store as rs
      >>> rs.enable_compilation_cache(tempfile.mkdtemp())
    """
    path = _cache_folder(directory)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _cache_folder(directory: object) -> str:
    """``directory`` (a leading ``~`` expanded, as for a store's folder), made if missing; a
    path that cannot be a folder (a file, or a file on the way to it; a location that cannot be
    written to make it) is refused naming it, where ``os.makedirs`` raises a bare
    ``FileExistsError`` or ``NotADirectoryError``. An existing read-only folder is taken: JAX
    reads a cache it cannot write."""
    if not isinstance(directory, (str, os.PathLike)) or isinstance(os.fspath(directory), bytes):
        raise InvalidArgumentError(
            f"enable_compilation_cache takes a folder (str or os.PathLike), got {type(directory).__name__}"
        )
    path = os.path.expanduser(os.fspath(directory))
    if not path:
        raise InvalidArgumentError("enable_compilation_cache: the folder is empty: give a cache folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise InvalidArgumentError(
            f"enable_compilation_cache: cannot use {path!r} as the cache folder ({why}); give a folder "
            "this process can write"
        ) from None
    return path
