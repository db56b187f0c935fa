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

__all__ = ["enable_compilation_cache"]


def enable_compilation_cache(directory: str | os.PathLike[str], *, min_compile_time_secs: float = 0.0) -> None:
    """Caches compiled executables in ``directory`` for this and later processes.

    A process-wide JAX setting (it applies to every compile of this process from now on).

    Example:
      >>> import tempfile, residual_store as rs
      >>> rs.enable_compilation_cache(tempfile.mkdtemp())
    """
    path = os.fspath(directory)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
