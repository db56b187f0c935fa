"""A context's residuals on the host, as the disk room writes and reads them: whole NumPy arrays,
or, for one sharded over several devices, the blocks of its distinct shards
(:class:`ShardedHost`), never gathered. The ground floor of the disk room: plain data, built and
placed on devices in ``host.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from jax.sharding import NamedSharding

__all__ = ["HostArrays", "ShardedHost", "chunk_index"]


HostArrays = list["np.ndarray | ShardedHost"]
"""A context's residuals on the host: whole arrays, or shards of a sharded one (a read given
``skip`` leaves ``None`` for each residual it skipped: the caller holds those)."""


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedHost:
    """A residual sharded over a mesh, on the host.

    Written and read as chunks of a regular grid whose chunk shape is the shard shape (``chunks``:
    chunk index -> block; a writer holds one per distinct shard, a reader those its devices
    need), or, for a sharding whose shards are no such grid (fully replicated, uneven, empty),
    as the ``whole`` array (``chunk_shape`` is then ``None``).

    Attributes:
      sharding: the manifest's record of the ``NamedSharding`` (see :func:`sharding_record`).
      placement: on a read that could rebuild the sharding here, the ``NamedSharding`` to place
        the array with (:func:`to_device_sharded`).
    """

    sharding: dict[str, Any]
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...] | None
    chunks: Mapping[Any, np.ndarray]  # chunk index (tuple of ints) -> block
    whole: np.ndarray | None = None
    placement: NamedSharding | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def chunk_index(region: Sequence[slice] | None, chunk_shape: Sequence[int]) -> tuple[int, ...]:
    """The index of the chunk that starts where ``region`` (a shard's slices) starts."""
    assert region is not None
    return tuple((s.start or 0) // c for s, c in zip(region, chunk_shape))
