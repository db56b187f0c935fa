"""``rs.Store``: contexts kept on device, in host memory and on disk, within byte budgets."""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from residual_store._src import _jax_internals
from residual_store._src.backward import register_loader, unregister_loader
from residual_store._src.context import ResidualContext
from residual_store._src.errors import ContextNotFoundError, InvalidArgumentError, ReadOnlyStoreError
from residual_store._src.store import backwards, gc
from residual_store._src.store.collective import TIMEOUT_S, committer_for
from residual_store._src.store.backends import check_path
from residual_store._src.store.budgets import Headroom, parse_budget, parse_bytes, parse_seconds, parse_size
from residual_store._src.store.committer import Committer
from residual_store._src.store.buffers import DEFAULT_READ_BUFFER_BYTES
from residual_store._src.store.disk import DiskTier
from residual_store._src.store.host import read_device, stage_shared, to_host, to_numpy
from residual_store._src.store import inspection
from residual_store._src.store.inspection import BackwardInfo, ContextInfo, Progress, StoreUsage, VerifyReport
from residual_store._src.store.keys import new_key, validate_key
from residual_store._src.store.tiers import Tiers, own_nbytes
from residual_store._src.store.pending import PendingWork
from residual_store._src.store.reads import Reads
from residual_store._src.store.weights import LiveWeights
from residual_store._src.store.workers import Loader, Writer

__all__ = ["Store"]

StorePath = str | os.PathLike[str] | Mapping[str, Any] | None

DEFAULT_MAX_PENDING_BYTES = 1 << 30


def _shut_down(writer: Writer | None, loader: Loader, janitor: Loader) -> None:
    """Finalizer of a collected store: its threads stop once their queued work is done.

    Never waits: the collection may run on one of these threads, or on a thread holding a lock
    their work needs. Writes still complete (the writer runs its queue before it stops, and the
    exit drain waits for it); a failed one is reported on stderr.
    """
    if writer is not None:
        writer.close(wait=False)
    loader.close(wait=False)
    janitor.close(wait=False)


class Store:
    """Residual contexts by key, in tiers: device -> host memory -> disk.

    Args:
      path: a local folder, a tensorstore kvstore spec (``{"driver": "file", "path": ...}``,
        ``{"driver": "memory"}``, ``gcs``/``s3`` specs pass through), or ``None`` for memory only.
      device_budget, host_budget: bytes of intermediates each memory tier may hold (``None``:
        unbounded): an ``int``, or a string with a unit (``"512MiB"``, ``"8 GiB"``, ``"2GB"``);
        ``device_budget`` may also be a share of the device's memory (``"50%"`` of its
        ``memory_stats()["bytes_limit"]``, fixed when the store opens). Over budget, the least
        recently used context moves down a tier. Weights a context holds by reference are the
        model's memory and are not counted.
      write_through: with a path, write every context to disk in the background (the default);
        ``False`` writes only what the budgets push out of host memory (pure offload).
      durable: fsync arrays and manifests before a write counts as done (``flush`` then means
        "survives a power loss"); ``False`` leaves that to the OS.
      max_pending_bytes: bytes of queued background writes before ``put`` waits (backpressure).
      device_headroom: device memory to leave free (a size, as the budgets), where the backend
        reports the memory in use: when the device's free memory falls under it, the store moves
        contexts off the device (at the next ``put`` or ``get``) until it is back, whatever the
        budget. ``None``: the budget alone.
      read_buffer_bytes: host memory the store keeps for the buffers its disk reads fill, each
        reused once no array refers to it any more (fresh pages cost the kernel a fault and a
        zeroing each); ``0``: a fresh buffer for every read. Given back at ``close``.
      create: with ``False``, a path that holds no store raises :class:`StoreNotFoundError`
        instead of becoming a new store (a resume loop over a mistyped path fails loudly).
      read_only: open an existing store to read: nothing on disk changes, and ``put``, ``pop``,
        ``delete`` and ``gc`` raise :class:`ReadOnlyStoreError`. Implies ``create=False``.
      collective_timeout: in a multi-process job, seconds a process waits for the others at one
        step of a collective put or delete before it raises (a peer died or hangs).
      device: the ``jax.Device`` that contexts read back from host memory or disk are placed on
        (``None``: JAX's default device): a pipeline stage's store gives its stage's device.
        Sharded residuals go back to their recorded mesh either way.
      timeout: seconds each request to an object store (a kvstore spec such as ``s3`` or
        ``gcs``) may take, tensorstore's retries included (``None``: tensorstore's own retries,
        which take minutes to give up on an unreachable store). A request that outlives it, or
        that the store refuses, raises :class:`StoreUnavailableError` (from ``Store(...)``,
        ``get`` and the like, or from ``flush`` for a background write). A local folder has no
        requests to bound.

    Nothing put is lost on a normal exit: pending writes complete at interpreter exit (the end
    of the script, ``sys.exit``, an uncaught exception) and when the store is garbage-collected.
    Only a killed process (``kill -9``, an unhandled ``SIGTERM``) loses what was put after the
    last ``flush``; :func:`residual_store.flush_on_sigterm` makes ``SIGTERM`` complete the writes.

    Example:
      >>> import jax.numpy as jnp, residual_store as rs, tempfile
      >>> fwd = rs.split(lambda w: jnp.sum(jnp.sin(w) ** 2))
      >>> _, ctx = fwd(jnp.arange(3.0))
      >>> with tempfile.TemporaryDirectory() as path, rs.Store(path, device_budget=0) as store:
      ...     key = store.put(ctx, "step0-mb0")
      ...     grads = rs.backward(store.get(key))
    """

    def __init__(
        self,
        path: StorePath = None,
        *,
        device_budget: int | str | None = None,
        host_budget: int | str | None = None,
        write_through: bool = True,
        durable: bool = True,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        read_buffer_bytes: int = DEFAULT_READ_BUFFER_BYTES,
        create: bool = True,
        read_only: bool = False,
        collective_timeout: float = TIMEOUT_S,
        device: jax.Device | None = None,
        timeout: float | None = None,
        device_headroom: int | str | None = None,
    ) -> None:
        self._closed = True  # until every part exists: a failed constructor leaves no threads
        self._read_only = bool(read_only)
        if path is None and self._read_only:
            raise InvalidArgumentError("a memory-only store (path=None) cannot be read_only")
        check_path(path)
        # Arguments first: a refused one must not leave a new store on disk.
        if device is not None and not isinstance(device, jax.Device):
            raise InvalidArgumentError(f"device must be a jax.Device or None, got {type(device).__name__}")
        self._target = device
        device_budget = parse_budget(device_budget, "device_budget", read_device(device))
        headroom = Headroom.of(device_headroom, read_device(device))
        host_budget = parse_size(host_budget, "host_budget")
        self._tiers = Tiers(device_budget, host_budget, demote=to_host)
        self._device, self._host = self._tiers.device, self._tiers.host
        max_pending_bytes = parse_bytes(max_pending_bytes, "max_pending_bytes")
        read_buffer_bytes = parse_bytes(read_buffer_bytes, "read_buffer_bytes")
        collective_timeout = parse_seconds(collective_timeout, "collective_timeout")
        timeout = parse_seconds(timeout, "timeout", optional=True)
        self._disk = DiskTier(
            path, create=create, read_only=read_only, read_buffer_bytes=read_buffer_bytes, timeout=timeout,
        ) if path is not None else None
        # how writes and deletes reach the disk (collectively, in a job of several processes)
        self._committer: Committer | None = (
            committer_for(self._disk, collective_timeout) if self._disk is not None else None
        )
        self._write_through = bool(write_through) or (self._committer is not None and self._committer.writes_through)
        self._durable = bool(durable)
        self._lock = threading.RLock()
        self._weights = LiveWeights()  # hashed once, not per put; read back without reading
        writes = self._disk is not None and not self._read_only
        # A burst of durable puts shares one sync of the manifests' folder, before flush returns.
        self._writer = Writer(max_pending_bytes, on_idle=self._disk.sync_commits) if writes else None
        # saves each signature's backward once, on the writer thread
        self._backwards = backwards.Saver(
            self._disk, self._writer, durable=self._durable, saves=self._committer.saves_backwards,
        ) if self._writer is not None else None
        # loads the stored backwards rs.backward asks for while the store is open (held weakly there)
        self._stored_backwards = backwards.StoredBackwards(self._disk) if self._disk is not None else None
        if self._stored_backwards is not None:
            register_loader(self._stored_backwards)
        self._loader = Loader()
        self._janitor = Loader(workers=1)  # removes replaced or deleted data off the write path
        self._work = PendingWork(
            lock=self._lock, tiers=self._tiers, disk=self._disk, committer=self._committer, writer=self._writer,
            janitor=self._janitor, weights=self._weights, target=self._target, headroom=headroom,
            write_through=self._write_through, durable=self._durable,
        )
        self._reads = Reads(
            lock=self._lock, tiers=self._tiers, work=self._work, disk=self._disk, weights=self._weights,
            target=self._target, loader=self._loader, stored_backwards=self._stored_backwards,
        )
        self._closed = False
        # A collected store's pending writes still complete (the writer runs its queue first).
        self._finalizer = weakref.finalize(self, _shut_down, self._writer, self._loader, self._janitor)

    # -- context manager ----------------------------------------------------------------------

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - do not mask the body's exception
                pass

    def __repr__(self) -> str:
        disk = getattr(self, "_disk", None)
        where = disk.description if disk is not None else "memory only"
        if self._closed:
            return f"Store({where}, closed)"
        return f"Store({where}, contexts={len(self)})"

    # -- put ----------------------------------------------------------------------------------

    def put(self, ctx: ResidualContext, key: str | None = None) -> str:
        """Adds ``ctx`` under ``key`` (a fresh unique key if ``None``) and returns the key.

        Returns at once: with a path, writing continues in the background (``flush`` waits).
        A later ``put`` of the same key replaces the context.

        Raises:
          StoreFullError: a memory-only store whose budgets cannot take ``ctx``; the store is
            unchanged. Disk-full errors of background writes surface from ``flush``/``close``.
          InvalidArgumentError: not a context, or no ``key`` for a store with a path in a
            multi-process job (see docs/store.md).
          ReadOnlyStoreError: the store was opened ``read_only=True``.
        """
        self._check_open()
        self._check_writable("put")
        if self._backwards is not None:
            self._backwards.emit_warnings()  # of earlier saves, at this put's caller
        if not isinstance(ctx, ResidualContext):
            raise InvalidArgumentError(f"put expects a rs.ResidualContext, got {type(ctx).__name__}")
        if _jax_internals.any_tracer(ctx.residuals):
            raise InvalidArgumentError(
                "put cannot store a context inside jax.jit or another transformation (its residuals "
                "are tracers, not arrays): return the context from the jitted function and put it there"
            )
        if key is None and self._committer is not None and self._committer.needs_keys:
            raise InvalidArgumentError(
                "in a multi-process job, put needs a key: every process puts the same context "
                "under the same key, and a fresh key would differ between processes"
            )
        key = new_key() if key is None else validate_key(key)
        # the weights' host copies, now: a donation after put returns cannot break the write
        staged = stage_shared(ctx, partial=self._committer.partial_arrays) if self._committer is not None and self._write_through else None
        if self._backwards is not None:
            self._backwards.save(ctx)
        size = own_nbytes(ctx)
        with self._lock:
            if self._disk is None:
                self._tiers.check_capacity(key, size)
            self._forget(key)  # a write or prefetch of an older context under this key is superseded
            self._work.deleting.pop(key, None)
            self._tiers.admit(key, ctx)
            spills = self._work.rebalance(protect=key if self._tiers.put_protects(key) else None)
            to_write = [self._work.mark(key, ctx)] if self._disk is not None and (
                self._write_through
                or (key not in self._device and key not in self._host and key not in self._work.pending)
            ) else []
            self._work.release()
        for write in to_write:
            self._work.schedule(*write, staged=staged)
        for write in spills:
            self._work.schedule(*write)
        return key

    # -- get, prefetch, pop, delete -----------------------------------------------------------

    def get(self, key: str) -> ResidualContext:
        """The context under ``key``, on device: waits for a prefetch, verifies what it reads.

        Raises:
          ContextNotFoundError: no such key. CorruptContextError: stored data failed
          verification (the message names the key and the residual).
        """
        self._check_open()
        key = validate_key(key)
        with self._lock:
            if key in self._work.deleting:
                raise ContextNotFoundError(f"context {key!r} was deleted from store {self!r}")
            prefetched = self._reads.loading.pop(key, None)
            self._tiers.schedule.consume(key)
        # a prefetched context is kept for this get even when the budgets could not hold it
        ctx = prefetched.result() if prefetched is not None else self._reads.load(key)
        # only now: a load ahead may push out the context just got (the schedule is done with it)
        self._reads.ahead()
        return ctx

    def prefetch(self, key: str) -> None:
        """Starts bringing ``key`` to the device in the background; the next ``get`` takes it.

        The prefetched context is held for that ``get`` even if the budgets cannot keep it.
        """
        self._check_open()
        key = validate_key(key)
        with self._lock:
            if key in self._device or key in self._reads.loading:
                return
            in_memory = (key in self._host or key in self._work.pending) and key not in self._work.deleting
        if not in_memory and (self._disk is None or key in self._work.deleting or key not in self._disk):
            raise ContextNotFoundError(f"no context {key!r} in store {self!r}")

        with self._lock:
            self._reads.start(key)

    def schedule(self, keys: Sequence[str]) -> None:
        """Declares the order of the coming gets: ``keys`` as they will be got, keys not yet put
        included (a pipeline knows its whole order before its first forward); an empty list
        forgets it.

        The store then loads ahead of need (as many of the next contexts as the device budget
        holds, at most two loads at a time, and always the very next one) and, when a tier is
        over budget, moves down the context needed last (Belady's rule) instead of the least
        recently used; contexts the schedule does not name (or no longer does: each ``get``
        consumes its key's next place) go first, least recently used first. The schedule is
        advice: a get out of its order, or of a key it does not name, works as always.

        Example:
          >>> import jax.numpy as jnp, residual_store as rs
          >>> fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x * w)))
          >>> order = [f"mb{i}" for i in (2, 1, 0)]            # F0, F1, F2 then B2, B1, B0
          >>> with rs.Store(None, device_budget=None) as store:
          ...     store.schedule(order)
          ...     for i in range(3):
          ...         _ = store.put(fwd(jnp.ones(3), jnp.full(3, float(i)))[1], f"mb{i}")
          ...     grads = [rs.backward(store.get(k)) for k in order]

        Raises:
          InvalidKeyError: a key outside the key rules (the previous schedule stays).
          InvalidArgumentError: ``keys`` is not a sequence of str.
        """
        self._check_open()
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise InvalidArgumentError(
                f"schedule expects a sequence of keys in the order they will be got, got {type(keys).__name__}"
            )
        checked = [validate_key(k) for k in keys]
        with self._lock:
            self._tiers.schedule.declare(checked)
        self._reads.ahead()

    def pop(self, key: str) -> ResidualContext:
        """``get`` then ``delete``."""
        self._check_open()
        self._check_writable("pop")
        ctx = self.get(key)
        self.delete(key)
        return ctx

    def delete(self, key: str) -> None:
        """Removes ``key`` from every tier; the disk removal runs in the background, after any
        pending write of it (``flush`` waits). Unknown key: :class:`ContextNotFoundError`."""
        self._check_open()
        self._check_writable("delete")
        key = validate_key(key)
        with self._lock:
            found = key not in self._work.deleting and (
                key in self._device or key in self._host or key in self._work.pending or key in self._reads.loading
            )
            self._forget(key)
        if self._disk is None or self._writer is None:
            if not found:
                raise ContextNotFoundError(f"no context {key!r} in store {self!r}")
            return
        # In a multi-process job the delete is collective, in call order with the puts: every
        # process checks here, and process 0 removes the manifest only once all have begun.
        with self._lock:
            if not found and key not in self._work.deleting and key not in self._disk:
                raise ContextNotFoundError(f"no context {key!r} in store {self!r}")
            if not found and key in self._work.deleting:
                raise ContextNotFoundError(f"context {key!r} was already deleted from store {self!r}")
            token = self._work.mark_deleting(key)
        self._work.schedule_delete(key, token)

    # -- listing ------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Every key: in memory, pending, and committed on disk (by any process)."""
        self._check_open()
        with self._lock:
            keys = set(self._device.keys()) | set(self._host.keys()) | set(self._work.pending)
            deleting = set(self._work.deleting)
        if self._disk is not None:
            keys.update(self._disk.keys())
        return sorted(keys - deleting)

    def __contains__(self, key: object) -> bool:
        self._check_open()
        if not isinstance(key, str):
            return False
        with self._lock:
            if key in self._work.deleting:
                return False
            if key in self._device or key in self._host or key in self._work.pending:
                return True
        try:
            validate_key(key)
        except ValueError:
            return False
        return self._disk is not None and key in self._disk

    def __len__(self) -> int:
        return len(self.keys())

    def stats(self) -> dict[str, dict[str, int]]:
        """Bytes and contexts per tier (disk ``bytes`` count each shared weight once; its
        ``own_bytes`` only the contexts' own arrays, as the memory tiers count), and what this
        store moved since it was opened: per memory tier ``bytes_in`` (put, promoted or spilled
        into it) and ``bytes_out`` (moved to another tier); on disk ``reads`` and ``bytes_read``
        (contexts read back, and the bytes of their arrays; weights already on the device are
        not read), ``writes`` and ``bytes_written`` (contexts committed, and their own bytes).
        ``pending``: the contexts waiting for their disk write that no memory tier holds, kept
        as host copies until written (``bytes``, ``contexts``; bounded by ``max_pending_bytes``),
        and ``reads``: the gets (and loads ahead) served from such a copy, as a disk read would
        have been had the write been done (``disk["reads"] + pending["reads"]`` counts the
        contexts brought back from below the memory tiers, however fast the disk is).
        Bytes in memory are the contexts' own (intermediates and inputs), as the budgets count.
        """
        self._check_open()
        with self._lock:
            result = {
                name: {"bytes": tier.nbytes, "contexts": len(tier), "bytes_in": tier.bytes_in, "bytes_out": tier.bytes_out}
                for name, tier in (("device", self._device), ("host", self._host))
            }
            io = dict(self._work.io)
            waiting = self._work.waiting()  # host copies, in no tier (see PendingWork.release)
            result["pending"] = {
                "bytes": sum(own_nbytes(c) for c in waiting), "contexts": len(waiting), "reads": self._reads.pending_reads,
            }
        result["disk"] = {**inspection.disk_bytes(self._disk), **io}
        return result

    # -- flush, close -------------------------------------------------------------------------

    def flush(self, *keys: str) -> None:
        """Returns once every acknowledged write is complete (and durable with ``durable=True``).

        ``flush(key, ...)`` waits for the puts of those keys only, as Orbax's
        ``wait_until_finished`` does for one save: when it returns, every other ``Store`` on the
        path sees them; the other writes go on in the background.

        Example:
          >>> import jax.numpy as jnp, residual_store as rs, tempfile
          >>> _, ctx = rs.split(lambda w: jnp.sum(jnp.sin(w)))(jnp.ones(3))
          >>> with tempfile.TemporaryDirectory() as path, rs.Store(path) as store:
          ...     store.put(ctx, "mb0")
          ...     store.flush("mb0")
          ...     "mb0" in rs.Store(path, read_only=True)
          'mb0'
          True

        Raises:
          The first error of a background write since the last ``flush()`` (with keys: the error of
          those keys' writes), e.g. :class:`StoreFullError` for a disk that filled up (that context
          was not committed). ContextNotFoundError: a key this store was never given.
        """
        self._check_open()
        try:
            if keys:
                self._flush_keys([validate_key(k) for k in keys])
            elif self._writer is not None:
                self._writer.flush()
        finally:
            if self._backwards is not None:
                self._backwards.emit_warnings()  # of background saves, at this flush's caller

    def _flush_keys(self, keys: Sequence[str]) -> None:
        futures = self._work.newest(keys)
        for key, future in zip(keys, futures):
            if future is None and key not in self:
                raise ContextNotFoundError(f"no context {key!r} in store {self!r}")
        for future in futures:
            if future is not None:
                future.result()  # its write's error, if it failed
        if any(f is not None for f in futures) and self._disk is not None and self._durable:
            self._disk.sync_commits()  # (else done once the writer runs out of work)

    def gc(
        self, older_than: float = 3600.0, *, dry_run: bool = False, progress: Progress | None = None
    ) -> dict[str, int]:
        """Removes what no committed context needs: unreferenced weights and data, recycled
        folders, stored backwards of signatures no context has (and damaged ones), temporary
        files of interrupted writes; only items at least ``older_than`` seconds old.

        Returns how many of each kind it removed (``dry_run``: would remove, changing nothing),
        ``"young"``, the unneeded items it kept for being younger, and ``"bytes"``, what it
        freed (-1 on kvstores, which do not say). ``progress`` is called with the bytes freed so
        far after each item (see :meth:`verify`).
        """
        self._check_open()
        if not dry_run:
            self._check_writable("gc")
        if self._disk is None:
            return gc.nothing_removed()
        self.flush()
        return gc.collect(self._disk, older_than, dry_run=dry_run, progress=progress)

    def close(self) -> None:
        """Flushes and stops the background threads; the store cannot be used afterwards."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._stored_backwards is not None:
                unregister_loader(self._stored_backwards)
            self._finalizer.detach()
            if self._writer is not None:
                self._writer.close()
            self._loader.close()
            self._janitor.close()
            if self._disk is not None and self._disk.buffers is not None:
                self._disk.buffers.clear()

    def _forget(self, key: str) -> None:
        """Drops every copy of ``key`` this store holds or is making: in the tiers, a pending
        write, a prefetch, and the note that it is on disk (under the lock)."""
        self._tiers.forget(key)
        self._work.pending.pop(key, None)
        self._reads.loading.pop(key, None)
        self._work.on_disk.discard(key)

    def _check_open(self) -> None:
        if self._closed:
            where = self._disk.description if getattr(self, "_disk", None) is not None else "memory only"
            raise InvalidArgumentError(f"this store ({where}) is closed: open a new rs.Store to use it again")

    def _check_writable(self, what: str) -> None:
        if self._read_only:
            where = self._disk.description if self._disk is not None else "memory"
            raise ReadOnlyStoreError(
                f"{what}: the store at {where} was opened read_only=True; open it with "
                "read_only=False to change it"
            )

    # -- inspection ---------------------------------------------------------------------------

    def _find(self, key: str) -> tuple[ResidualContext | None, bool]:
        """The context under ``key`` in memory (a memory tier's, or a put's waiting for its write)
        and whether that is newer than the disk's copy; :class:`ContextNotFoundError` for a key
        being deleted."""
        self._check_open()
        key = validate_key(key)
        with self._lock:
            if key in self._work.deleting:
                raise ContextNotFoundError(f"context {key!r} was deleted from store {self!r}")
            pending = self._work.pending.get(key)
            for ctx in (self._device.peek(key), self._host.peek(key), pending[0] if pending else None):
                if ctx is not None:
                    return ctx, pending is not None or key not in self._work.on_disk
        return None, False

    def info(self, key: str) -> ContextInfo:
        """The record of the context under ``key``: its signature and, per residual, name,
        shape, dtype, bytes, kind and where it lies; no array is read.

        Example:
          >>> import jax.numpy as jnp, residual_store as rs, tempfile
          >>> _, ctx = rs.split(lambda w: jnp.sum(jnp.sin(w)))(jnp.ones(3))
          >>> with tempfile.TemporaryDirectory() as path, rs.Store(path) as store:
          ...     info = store.info(store.put(ctx, "mb0"))
          >>> info.key, [(r.name, r.kind, r.shape, r.dtype) for r in info.residuals]
          ('mb0', [('cos ...', 'intermediate', (3,), 'float32')])

        Raises:
          ContextNotFoundError: no such key. InvalidKeyError: a key outside the key rules.
          CorruptContextError: its manifest is damaged.
        """
        ctx, newer = self._find(key)
        if ctx is not None and (newer or self._disk is None):
            return inspection.memory_info(key, ctx.spec)
        if self._disk is None:
            raise ContextNotFoundError(f"no context {key!r} in store {self!r}")
        return inspection.context_info(self._disk.stat(key))

    def arrays(self, key: str) -> tuple[np.ndarray, ...]:
        """The residuals of ``key`` as NumPy arrays in host memory, verified, in the order of
        :meth:`info`'s ``residuals`` (a typed PRNG key as its key data); nothing is placed on
        a device and the store's tiers are left as they were.

        Example:
          >>> import jax.numpy as jnp, residual_store as rs
          >>> _, ctx = rs.split(lambda w: jnp.sum(jnp.sin(w)))(jnp.zeros(3))
          >>> with rs.Store(None) as store:
          ...     [a.tolist() for a in store.arrays(store.put(ctx, "mb0"))]   # cos(w)
          [[1.0, 1.0, 1.0]]

        Raises:
          ContextNotFoundError: no such key. CorruptContextError: stored data failed
          verification (the message names the residual).
        """
        ctx, _ = self._find(key)
        if ctx is not None:
            return tuple(to_numpy(x) for x in ctx.residuals)
        if self._disk is None:
            raise ContextNotFoundError(f"no context {key!r} in store {self!r}")
        _, arrays = self._disk.read(key, place=False)
        return tuple(arrays)  # (with place=False: whole NumPy arrays)

    def backward_info(self, signature: str) -> BackwardInfo:
        """Whether a backward of ``signature`` is stored (processes without the model can run
        it), for which platforms and JAX version, or why not; reads its manifest only.

        Raises:
          InvalidArgumentError: ``signature`` is not a signature (``info(key).signature`` is one).
        """
        self._check_open()
        return inspection.backward_info(self._disk, signature)

    def usage(self, *, progress: Progress | None = None) -> StoreUsage:
        """Bytes the store takes on disk, per part of its tree and per signature (a memory-only
        store: none; see :meth:`stats` for memory). ``progress``: as in :meth:`verify`.

        Example:
          >>> import jax.numpy as jnp, residual_store as rs, tempfile
          >>> _, ctx = rs.split(lambda w: jnp.sum(jnp.sin(w)))(jnp.ones(3))
          >>> with tempfile.TemporaryDirectory() as path, rs.Store(path) as store:
          ...     _ = store.put(ctx, "mb0")
          ...     usage = store.usage()
          >>> usage.total > 0, [u.contexts for u in usage.signatures.values()]
          (True, [1])
        """
        self._check_open()
        if self._disk is None:
            return StoreUsage(0, dict.fromkeys(inspection.USAGE_PARTS, 0), 0, {})
        self.flush()  # what was put is on disk
        return inspection.measure(self._disk, progress)

    def verify(self, keys: Sequence[str] | None = None, *, progress: Progress | None = None) -> VerifyReport:
        """Reads and checks every byte of every context (or of ``keys``) against its checksums,
        and the stored backwards (of those contexts' signatures), changing nothing: damage is
        reported, never raised. Pending writes complete first; a context held in memory only
        has nothing on disk to check and counts as verified.

        ``progress``, if given, is called after each context with the bytes read so far and
        in all (for a progress bar).

        Example:
          >>> import jax.numpy as jnp, residual_store as rs, tempfile
          >>> _, ctx = rs.split(lambda w: jnp.sum(jnp.sin(w)))(jnp.ones(3))
          >>> with tempfile.TemporaryDirectory() as path:
          ...     with rs.Store(path) as store:
          ...         _ = store.put(ctx, "mb0")
          ...     with rs.Store(path, read_only=True) as reader:   # as another process would
          ...         report = reader.verify(["mb0"])
          >>> report.ok, report.verified, report.damaged
          (True, 1, {})

        Raises:
          ContextNotFoundError: a key the store does not hold (before anything is read).
          InvalidKeyError: a key outside the key rules. InvalidArgumentError: ``keys`` is not a
          sequence of keys.
        """
        self._check_open()
        if keys is not None and (isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence)):
            raise InvalidArgumentError(
                f"verify expects a sequence of keys (or None for all), got {type(keys).__name__}: {keys!r:.60}"
            )
        given = None if keys is None else [validate_key(k) for k in keys]
        self.flush()  # what was put is on disk, to be checked
        chosen = self.keys() if given is None else given
        missing = [] if given is None else [k for k in given if k not in self]
        if missing:
            raise ContextNotFoundError(f"no context {', '.join(map(repr, missing))} in store {self!r}")
        if self._disk is None:
            return VerifyReport(verified=len(chosen))
        on_disk = set(self._disk.keys())
        report = inspection.verify(
            self._disk, [k for k in chosen if k in on_disk], every_backward=keys is None, progress=progress
        )
        in_memory = sum(k not in on_disk for k in chosen)  # written with write_through=False, not spilled
        return dataclasses.replace(report, verified=report.verified + in_memory) if in_memory else report
