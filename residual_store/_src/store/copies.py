"""The copies between device memory and host memory that the memory tiers make: a context's own
residuals to ``pinned_host`` (through the pool's reused buffers where it takes them) and back,
a host copy for a write that has not run yet, a checkpoint's detached copies; and
:class:`BudgetCopies`, which makes the copies a key-table move owes, waits for them to land
(rule 7 of ``table.py``) and queues the writes of what left host memory.

A context is copied whole, each distinct array once however many residuals it is (its copies
stay one array); weights and constants stay where they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from residual_store._src.context import OWN_KINDS, SHARED_KINDS, ResidualContext, own_nbytes
from residual_store._src.scratch import pinned_memory_kind
from residual_store._src.store.host import (
    check_live,
    default_memory_kind,
    device_put_all,
    is_host_memory,
    is_key_dtype,
    is_whole_on,
    read_device,
    to_numpy,
    uncommitted_if_sub_byte,
)
from residual_store._src.store.owed import Moves, Owed, Write
from residual_store._src.store.pinned import HostPool, copies_done, poolable, returnable, wait_copies
from residual_store._src.store.table import KeyTable

__all__ = [
    "BudgetCopies",
    "copy_done",
    "detached",
    "for_writing",
    "holds_device_memory",
    "to_device",
    "to_host",
    "wait_copied",
]


def to_host(ctx: ResidualContext, pool: HostPool | None = None) -> ResidualContext:
    """A copy of ``ctx`` with its own residuals in host memory; weights stay where they are.

    ``pool``: the residuals it takes are copied into its reused pinned buffers, at the link's
    speed and asynchronously (:func:`copy_done` tells when the copy has finished); the others,
    and all of them without a pool, as before (``jax.device_put`` to ``pinned_host``)."""
    return _with_own(ctx, lambda arrays: _host_copies(arrays, pool))


def _with_own(ctx: ResidualContext, copy: Callable[[list[Any]], list[Any]]) -> ResidualContext:
    """``ctx`` with its own residuals replaced by ``copy`` of them, given each distinct array
    once however many residuals it is (its copies stay one array)."""
    own: dict[int, Any] = {}
    for x, kind in zip(ctx.residuals, ctx.spec.kinds):
        if kind in OWN_KINDS:
            own.setdefault(id(x), x)
    copies = dict(zip(own, copy(list(own.values()))))
    return ResidualContext.tree_unflatten(
        ctx.spec, [copies[id(x)] if k in OWN_KINDS else x for x, k in zip(ctx.residuals, ctx.spec.kinds)]
    )


def _host_copies(arrays: list[Any], pool: HostPool | None) -> list[Any]:
    """:func:`_host_copy` of each array, those ``pool`` takes copied by it in one program."""
    pooled = [i for i, x in enumerate(arrays) if pool is not None and poolable(x)]
    done = dict(zip(pooled, pool.to_host([arrays[i] for i in pooled]))) if pool is not None and pooled else {}
    return [done[i] if i in done else _host_copy(x) for i, x in enumerate(arrays)]


def copy_done(ctx: ResidualContext) -> bool:
    """Whether the copies that put ``ctx``'s own residuals in host memory (:func:`to_host`,
    :func:`for_writing`) have finished (or failed), without waiting. The device memory they
    were copied from is free from then on, once nothing else holds it: until then a store
    counts it as the device's. A residual held as a NumPy array counts as copied."""
    return copies_done([x for x, movable in zip(ctx.residuals, ctx.spec.movable) if movable])


def wait_copied(ctx: ResidualContext) -> None:
    """Waits until :func:`copy_done` is true of ``ctx``; raises what a failed copy raised."""
    wait_copies([x for x, movable in zip(ctx.residuals, ctx.spec.movable) if movable])


def _host_copy(x: Any) -> Any:
    """One residual in host memory, with its sharding (``pinned_host`` where the devices have
    it); a typed key stays where it is (a few bytes), a NumPy array is host memory."""
    if isinstance(x, jax.Array) and not is_key_dtype(x.dtype):
        sharding = x.sharding
        kind = pinned_memory_kind(next(iter(sharding.device_set)))
        if kind is not None and sharding.memory_kind != kind:
            return jax.device_put(x, sharding.with_memory_kind(kind))
        if kind is None:
            return to_numpy(x)
    return x


def detached(
    contexts: Mapping[str, ResidualContext], weights: dict[int, tuple[jax.Array, jax.Array]] | None = None
) -> dict[str, ResidualContext]:
    """Copies of ``contexts`` that share no buffer with them, for a checkpoint that writes after
    its ``save`` returned: deleting or donating the originals' arrays then cannot touch them.

    Every array, weights included, is copied once however many contexts hold it (a weight they
    all hold stays one array, which a store writes once), all in one ``jax.device_put``: to
    ``pinned_host`` memory with its sharding where the devices have it (asynchronously: JAX
    completes a copy before it frees its source), else on its devices; a typed key is copied
    where it is. NumPy residuals are kept as they are.

    ``weights``: the weights copied by earlier calls (id -> (array, copy)), reused and added to,
    so that contexts copied a few at a time (to bound the memory of the originals) still share
    one copy of each weight.

    Raises:
      InvalidArgumentError: an array was deleted (donated) already; it names it.
    """
    weights = {} if weights is None else weights
    copies: dict[int, jax.Array] = {}
    arrays: dict[int, jax.Array] = {}
    for ctx in contexts.values():
        check_live(ctx, "before it was saved")
        for x, kind in zip(ctx.residuals, ctx.spec.kinds):
            if not isinstance(x, jax.Array) or id(x) in copies or id(x) in arrays:
                continue
            known = weights.get(id(x)) if kind in SHARED_KINDS else None
            if known is not None and known[0] is x:
                copies[id(x)] = known[1]
            else:
                arrays[id(x)] = x
    sources = list(arrays.values())
    copies.update(zip(arrays, jax.device_put(sources, [_host_sharding(x) for x in sources], may_alias=False)))
    for ctx in contexts.values():
        for x, kind in zip(ctx.residuals, ctx.spec.kinds):
            if kind in SHARED_KINDS and id(x) in arrays:
                weights[id(x)] = (x, copies[id(x)])  # (the array kept: its id stays its own)
    return {
        key: ResidualContext.tree_unflatten(ctx.spec, [copies.get(id(x), x) for x in ctx.residuals])
        for key, ctx in contexts.items()
    }


def _host_sharding(x: jax.Array) -> Any:
    """Where :func:`detached` copies ``x``: its sharding in host memory, where it has one."""
    kind = None if is_key_dtype(x.dtype) else pinned_memory_kind(next(iter(x.sharding.device_set)))
    return x.sharding.with_memory_kind(kind) if kind is not None else x.sharding


def holds_device_memory(ctx: ResidualContext) -> bool:
    """Whether ``ctx``'s own residuals are in device memory (the first one's place tells: a
    context is moved whole), so that keeping it keeps device memory."""
    for x, movable in zip(ctx.residuals, ctx.spec.movable):
        if not movable or (isinstance(x, jax.Array) and is_key_dtype(x.dtype)):
            continue  # (a typed key stays on the device: a few bytes)
        if not isinstance(x, jax.Array):
            return False  # a host copy already
        sharding = x.sharding
        return sharding.memory_kind in (None, default_memory_kind(sharding))
    return False


def for_writing(
    ctx: ResidualContext, device: jax.Device | None = None, pool: HostPool | None = None
) -> ResidualContext:
    """A copy of ``ctx`` whose own residuals are in host memory, for a write that has not run
    yet, so that the device arrays can go now: an array on a CPU, where device memory is host
    memory, whole on the device a read would place it on (``device``, see :func:`read_device`)
    as a NumPy view of its buffer (no copy, and :func:`to_device` puts it back there); any other
    as :func:`to_host` copies it, through ``pool`` where given (asynchronously to
    ``pinned_host``, with its sharding; JAX completes the copy before it frees the source)."""
    target = read_device(device)

    def copy(arrays: list[Any]) -> list[Any]:
        views = [isinstance(x, jax.Array) and is_host_memory(target) and is_whole_on(x, target)
                 and not is_key_dtype(x.dtype) for x in arrays]
        copies = iter(_host_copies([x for x, view in zip(arrays, views) if not view], pool))
        return [to_numpy(x) if view else next(copies) for x, view in zip(arrays, views)]

    return _with_own(ctx, copy)


def to_device(
    ctx: ResidualContext, device: jax.Device | None = None, pool: HostPool | None = None
) -> ResidualContext:
    """A copy of ``ctx`` in device memory (the default memory space of its arrays' devices; a
    NumPy host copy goes to ``device``, else the default device); shared arrays stay shared,
    and the arrays the forward put in host memory (``spec.on_host``) stay there. ``pool``: the
    host arrays it takes go back in one program, at the link's speed (the pool's buffers are
    reused only once nothing holds them: the context, until it is dropped)."""
    stay = {id(x) for i in ctx.spec.on_host if isinstance(x := ctx.residuals[i], jax.Array)}
    distinct = [x for i, x in {id(x): x for x in ctx.residuals}.items() if i not in stay]
    back = [i for i, x in enumerate(distinct) if pool is not None and returnable(x)]
    placed = dict(zip(back, pool.to_device([distinct[i] for i in back]))) if pool is not None and back else {}
    moved = {id(x): placed[i] if i in placed else _moved(x, device) for i, x in enumerate(distinct)}
    return ResidualContext.tree_unflatten(ctx.spec, [moved.get(id(x), x) for x in ctx.residuals])


def _moved(x: Any, device: jax.Device | None) -> Any:
    """One residual in device memory (see :func:`to_device`)."""
    if not isinstance(x, jax.Array):
        return device_put_all([x], device)[0]
    sharding = x.sharding
    default = default_memory_kind(sharding)
    if sharding.memory_kind in (None, default):
        return x
    return uncommitted_if_sub_byte(jax.device_put(x, sharding.with_memory_kind(default)))


class BudgetCopies:
    """The copies the budgets owe (``Moves`` of the key table): made without the store's lock,
    waited for on the landings thread, their writes queued.

    Args:
      table: the store's key table.
      queue: queues the writes of contexts a move pushed out of host memory.
      target: the device contexts are placed on (``None``: JAX's default).
      pool: the pinned host memory copies to and from host memory go through.
      landings: the thread that waits for each copy to host memory to land.
    """

    def __init__(
        self,
        *,
        table: KeyTable,
        queue: Callable[[Sequence[Write]], None],
        target: Any,
        pool: HostPool,
        landings: ThreadPoolExecutor,
    ) -> None:
        self._table = table
        self._queue = queue
        self._target = target
        self._pool = pool
        self._landings = landings

    def settle(self, moves: Moves) -> None:
        """Without the lock: makes the copies ``moves`` owes, installs each where its context still
        is, then queues the writes of what left host memory. A pending write then holds host
        copies only, so the device budget bounds the device memory of the store's contexts,
        pending writes included."""
        try:
            if moves.owed.due:
                self._copy(moves.owed)
        finally:  # a copy that failed to start leaves what left host memory to write all the same
            if moves.spills:
                self._queue(moves.spills)

    def _copy(self, owed: Owed) -> None:
        """Makes the copies ``owed`` and tells the table; a copy that fails to start raises here,
        and the context it copies stays as it was."""
        demoted = [(key, ctx, to_host(ctx, self._pool)) for key, ctx in owed.demoted if holds_device_memory(ctx)]
        released = [(key, ctx, for_writing(ctx, self._target, self._pool)) for key, ctx in owed.released
                    if holds_device_memory(ctx)]
        landing = [(self._landings.submit(self._land, key, [ctx, copy]), own_nbytes(ctx))
                   for key, ctx, copy in (*demoted, *released)]
        self._table.settle(demoted, released, landing)
        for future, _ in landing:  # (at once if it has landed already)
            future.add_done_callback(self._table.leaving.landed)

    def _land(self, key: str, held: list[ResidualContext]) -> None:
        """On the landings thread: waits until the copy of a context (``held``: the context and
        its copy, taken out of the list at once, so that only this call holds them) has landed
        in host memory; the device memory it held is free once this returns, if nothing else
        holds the context. A failed copy puts the context back, intact on the device (rule 7)."""
        source, copy = held
        held.clear()  # (the pool's job keeps its arguments a while after it is done)
        try:
            wait_copied(copy)
        except BaseException:
            self._table.copy_failed(key, source, copy)
            raise

    def wait_landed(self, *, raise_failed: bool = True) -> None:
        """Waits until the copies to host memory in flight have landed, so that what comes to
        the device next is not on top of them (rule 7); their device bytes are then free.

        Raises:
          What a failed copy raised (the context it copied is back, intact on the device); with
          ``raise_failed=False`` nothing: the next call that waits raises it.
        """
        if not self._table.leaving.count:  # (read whole; the table answers again under its lock)
            return
        flying, failed = self._table.leaving.take(take_errors=raise_failed)
        for future in flying:
            future.exception()  # waits until it is done (what failed, the table keeps)
            self._table.leaving.landed(future)  # (its error kept once, whether its callback or this came first)
        failed += self._table.leaving.take(take_errors=raise_failed)[1]
        if failed:
            raise failed[0]
