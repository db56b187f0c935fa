"""The in-memory tiers: device (live ``jax.Array``s) and host memory, each an LRU under a budget.

A tier counts the bytes of its contexts' own residuals (intermediates and per-context inputs such
as a stage's input activation or the batch); the weights and constants a context holds by
reference are the model's memory and stay where they are. The host tier keeps arrays in JAX's
host memory space (``pinned_host``) where the backend has one, so the same code really offloads
on a GPU; otherwise it keeps NumPy copies.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from typing import Any

import jax
import numpy as np

from residual_store.context import OWN_KINDS, ResidualContext
from residual_store.errors import InvalidArgumentError

__all__ = ["MemoryTier", "own_nbytes", "to_host", "to_device", "host_memory_kind"]


def _nbytes(x: Any) -> int:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return int(np.prod(x.shape, dtype=np.int64)) * int(
            np.prod(jax.random.key_data(x).shape[x.ndim :], dtype=np.int64)
        ) * 4
    return int(x.nbytes)


def own_nbytes(ctx: ResidualContext) -> int:
    """Bytes of a context's own residuals (intermediates and inputs): what offloading it frees.

    Weights and constants are held by reference, belong to the model, and are neither counted
    against budgets nor moved between the memory tiers.
    """
    return sum(_nbytes(x) for x, k in zip(ctx.residuals, ctx.spec.kinds) if k in OWN_KINDS)


class MemoryTier:
    """An LRU of contexts with a byte budget (``None``: unbounded) on their own residuals."""

    def __init__(self, name: str, budget: int | None) -> None:
        if budget is not None and (
            not isinstance(budget, numbers.Integral) or isinstance(budget, (bool, np.bool_)) or budget < 0
        ):
            raise InvalidArgumentError(
                f"{name}_budget must be a non-negative int (bytes) or None (unbounded), got "
                f"{type(budget).__name__} {budget!r}"
            )
        self.name = name
        self.budget = None if budget is None else int(budget)
        self._entries: OrderedDict[str, tuple[ResidualContext, int]] = OrderedDict()
        self.nbytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more would stay within budget once the tier were emptied."""
        return self.budget is None or nbytes <= self.budget

    def over_budget(self) -> bool:
        return self.budget is not None and self.nbytes > self.budget

    def add(self, key: str, ctx: ResidualContext) -> None:
        self.remove(key)
        size = own_nbytes(ctx)
        self._entries[key] = (ctx, size)
        self.nbytes += size

    def get(self, key: str) -> ResidualContext | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def remove(self, key: str) -> ResidualContext | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.nbytes -= entry[1]
        return entry[0]

    def least_recent(self, exclude: str | None = None) -> str | None:
        return next((k for k in self._entries if k != exclude), None)


def host_memory_kind(device: Any) -> str | None:
    """``"pinned_host"`` if ``device`` has that memory space, else ``None``."""
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 - backends without memory spaces.
        return None
    return "pinned_host" if "pinned_host" in kinds else None


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_host(ctx: ResidualContext) -> ResidualContext:
    """A copy of ``ctx`` with its own residuals in host memory; weights stay where they are."""
    copies: dict[int, Any] = {}

    def move(x: Any, kind: str) -> Any:
        if kind not in OWN_KINDS:
            return x
        if id(x) in copies:
            return copies[id(x)]
        if isinstance(x, jax.Array) and not _is_key(x):
            sharding = x.sharding
            kind = host_memory_kind(next(iter(sharding.device_set)))
            if kind is not None and sharding.memory_kind != kind:
                moved = jax.device_put(x, sharding.with_memory_kind(kind))
            elif kind is None:
                moved = np.asarray(jax.device_get(x))
            else:
                moved = x
        else:
            moved = x  # numpy arrays are host memory; keys stay on device (a few bytes each)
        copies[id(x)] = moved
        return moved

    return ResidualContext.tree_unflatten(
        ctx.spec, [move(x, k) for x, k in zip(ctx.residuals, ctx.spec.kinds)]
    )


def to_device(ctx: ResidualContext) -> ResidualContext:
    """A copy of ``ctx`` in device memory (the default memory space); shared arrays stay shared."""
    copies: dict[int, Any] = {}

    def move(x: Any) -> Any:
        if id(x) in copies:
            return copies[id(x)]
        if isinstance(x, jax.Array):
            sharding = x.sharding
            default = next(iter(sharding.device_set)).default_memory().kind
            moved = x if sharding.memory_kind in (None, default) else jax.device_put(
                x, sharding.with_memory_kind(default)
            )
        else:
            moved = jax.device_put(x)
        copies[id(x)] = moved
        return moved

    return ResidualContext.tree_unflatten(ctx.spec, [move(x) for x in ctx.residuals])
