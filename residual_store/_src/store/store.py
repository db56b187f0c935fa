"""``rs.Store``: contexts kept on device, in host memory and on disk, within byte budgets."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, overload

import jax

from residual_store._src import _jax_internals
from residual_store._src.context import ResidualContext
from residual_store._src.errors import ContextNotFoundError, InvalidArgumentError
from residual_store._src.store import inspection
from residual_store._src.store.budgets import (
    Headroom,
    check_flags,
    parse_age,
    parse_budget,
    parse_bytes,
    parse_seconds,
    parse_size,
)
from residual_store._src.store.calls import Calls, store_call
from residual_store._src.store.collective import TIMEOUT_S, committer_for
from residual_store._src.store.copies import BudgetCopies
from residual_store._src.store.critical import critical_section, defer_keyboard_interrupt
from residual_store._src.store.disk.backends import resolve_path
from residual_store._src.store.disk.buffers import DEFAULT_READ_BUFFER_BYTES
from residual_store._src.store.disk.paths import validate_key
from residual_store._src.store.disk.tier import DiskTier
from residual_store._src.store.host import read_device
from residual_store._src.store.inspection import Progress
from residual_store._src.store.mapping import StoreMapping
from residual_store._src.store.persistence import Persistence, keeping_for, persistence_for
from residual_store._src.store.pinned import HostPool, capacity_for
from residual_store._src.store.reads import Reads
from residual_store._src.store.reports import StoreReports
from residual_store._src.store.table import KeyTable
from residual_store._src.store.weights import LiveWeights
from residual_store._src.store.workers import exit_limit

__all__ = ["Store"]

StorePath = str | os.PathLike[str] | Mapping[str, Any] | None

DEFAULT_MAX_PENDING_BYTES = 1 << 30

T = TypeVar("T")
_NO_DEFAULT: Any = object()  # get and pop without a default raise for a missing key


def _shut_down(persistence: Persistence, loads: ThreadPoolExecutor, landings: ThreadPoolExecutor) -> None:
    """Finalizer of a collected store: its threads stop once their queued work is done.

    Never waits: the collection may run on one of these threads, or on a thread holding a lock
    their work needs. Writes still complete (the writer runs its queue before it stops, and the
    exit drain waits for it); a failed one is reported on stderr.
    """
    persistence.close_later()
    loads.shutdown(wait=False)
    landings.shutdown(wait=False)


class Store(StoreMapping, StoreReports):
    """Residual contexts by key, in tiers: device -> host memory -> disk.

    Args:
      path: a local folder (a leading ``~`` is the user's home), a kvstore URL as tensorstore
        reads them (``"file:///runs/a"``, ``"memory://"``, ``"s3://bucket/runs/a"``,
        ``"gs://bucket/runs/a"``; any other ``scheme://`` raises :class:`InvalidArgumentError`),
        a tensorstore kvstore spec (``{"driver": "file", "path": ...}``, ``{"driver": "memory"}``,
        ``gcs``/``s3`` specs pass through), or ``None`` for memory only; a first part that looks
        like a scheme without ``//`` (``s3:/bucket/x``, what ``pathlib.Path`` makes of a URL)
        raises :class:`InvalidArgumentError` naming the URL it probably meant. Opened to write, a
        folder that cannot be written (a read-only mount, no permission) raises
        :class:`ReadOnlyStoreError` at once: pass ``read_only=True`` to read it.
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
        ``gcs``) may take, tensorstore's retries included (``None``: 30 s). A request that
        outlives it, or that the store refuses, raises :class:`StoreUnavailableError` (from
        ``Store(...)``, ``get`` and the like, or from ``flush`` for a background write); what no
        retry heals (an unknown host, refused credentials) is reported at the first request, not
        retried. A local folder has no requests to bound.

    With ``write_through=True`` (the default), nothing put is lost on a normal exit: pending
    writes complete at interpreter exit (the end of the script, ``sys.exit``, an uncaught
    exception) and when the store is garbage-collected; a write that fails then is printed on
    stderr and the process ends with status 1. Only a killed process (``kill -9``, an unhandled
    ``SIGTERM``) loses what was put after the last ``flush``;
    :func:`residual_store.flush_on_sigterm` makes ``SIGTERM`` complete the writes. With
    ``write_through=False`` the disk holds only what the budgets pushed out, and ``close`` (or
    the exit) drops the rest by design.

    The store is a :class:`collections.abc.MutableMapping` from key to context
    (:mod:`~residual_store._src.store.mapping`), except that ``get(key)`` without a default
    raises for a missing key, as ``store[key]`` does.

    Example:
      >>> import jax.numpy as jnp, residual_store as rs, tempfile
      >>> fwd = rs.split(lambda w: jnp.sum(jnp.sin(w) ** 2))
      >>> _, ctx = fwd(jnp.arange(3.0))
      >>> with tempfile.TemporaryDirectory() as path, rs.Store(path, device_budget=0) as store:
      ...     key = store.put(ctx, "step0-mb0")
      ...     grads = rs.backward(store.get(key))
    """

    _description = "not opened"  # where it is, once open

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
        self._calls = Calls()  # the calls in progress; close() and the exit stop them first (calls.py)
        check_flags(write_through=write_through, durable=durable, create=create, read_only=read_only)
        self._read_only = bool(read_only)
        if path is None and self._read_only:
            raise InvalidArgumentError("a memory-only store (path=None) cannot be read_only")
        # a folder ("~" expanded) or a kvstore spec (a URL parsed); refused here if not writable
        location = resolve_path(path, read_only=self._read_only, create=create)
        # Arguments first: a refused one must not leave a new store on disk.
        if device is not None and not isinstance(device, jax.Device):
            raise InvalidArgumentError(f"device must be a jax.Device or None, got {type(device).__name__}")
        self._target = device
        device_budget = parse_budget(device_budget, "device_budget", read_device(device))
        headroom = Headroom.of(device_headroom, read_device(device))
        host_budget = parse_size(host_budget, "host_budget")
        max_pending_bytes = parse_bytes(max_pending_bytes, "max_pending_bytes")
        read_buffer_bytes = parse_bytes(read_buffer_bytes, "read_buffer_bytes")
        collective_timeout = parse_seconds(collective_timeout, "collective_timeout")
        timeout = parse_seconds(timeout, "timeout", optional=True)
        disk = DiskTier(
            location, create=create, read_only=read_only, read_buffer_bytes=read_buffer_bytes, timeout=timeout,
        ) if location is not None else None
        # how writes and deletes reach the disk (collectively, in a job of several processes)
        committer = committer_for(disk, collective_timeout) if disk is not None and not read_only else None
        self._weights = LiveWeights()  # hashed once, not per put; read back without reading
        # every key's state, under the store's one lock (table.py), told what leaves memory
        self._table = KeyTable(
            device_budget, host_budget, keeping_for(disk, committer, write_through),
            device_limit=headroom.device_limit if headroom is not None else None,
            where=disk.description if disk is not None else "memory only",
        )
        self._disk = disk  # read by gets, and by the reports (inspection.py) whatever the mode
        self._persistence = persistence_for(
            disk, committer, table=self._table, weights=self._weights, durable=durable,
            max_pending_bytes=max_pending_bytes,
        )
        self._description = self._persistence.description
        self._loads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="residual-store-load")  # loads ahead
        # the pinned host memory the host tier and pending writes' copies draw on (pinned.py)
        self._pool = HostPool(capacity_for(host_budget, max_pending_bytes))
        self._landings = ThreadPoolExecutor(max_workers=1, thread_name_prefix="residual-store-landing")
        self._copies = BudgetCopies(
            table=self._table, queue=self._persistence.schedule, target=self._target, pool=self._pool,
            landings=self._landings,
        )
        self._reads = Reads(
            table=self._table, disk=self._disk, backward_for=self._persistence.backward_for,
            copies=self._copies, weights=self._weights, target=self._target, loads=self._loads, pool=self._pool,
        )
        self._closed = False
        defer_keyboard_interrupt()  # Ctrl-C waits until a put is whole (critical.py, rule 6)
        # A collected store's pending writes still complete (the writer runs its queue first).
        self._finalizer = weakref.finalize(self, _shut_down, self._persistence, self._loads, self._landings)

    # -- context manager ----------------------------------------------------------------------

    def __enter__(self) -> Store:
        self._calls.check()
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
        where = self._description
        if self._closed:
            return f"Store({where}, closed)"
        return f"Store({where}, contexts={len(self)})"

    # -- put ----------------------------------------------------------------------------------

    @store_call
    def put(self, ctx: ResidualContext, key: str | None = None) -> str:
        """Adds ``ctx`` under ``key`` (a fresh unique key if ``None``) and returns the key.

        Returns once what it leaves on the device fits the device budget: where the budget
        pushes a context off the device, once its copy to host memory has landed (a copy that
        failed is raised by the next call); with a path, writing continues in the background
        (``flush`` waits). A later ``put`` of the same key replaces the context.

        Raises:
          StoreFullError: a memory-only store whose budgets cannot take ``ctx``; the store is
            unchanged. Disk-full errors of background writes surface from ``flush``/``close``.
          InvalidArgumentError: not a context, or no ``key`` for a store with a path in a
            multi-process job (see docs/store.md).
          ReadOnlyStoreError: the store was opened ``read_only=True``.
        """
        if isinstance(key, ResidualContext) and not isinstance(ctx, ResidualContext):
            raise InvalidArgumentError(
                f"put takes the context first, then the key: put(ctx, {ctx!r}), got put({ctx!r}, ctx)"
            )
        if not isinstance(ctx, ResidualContext):
            raise InvalidArgumentError(f"put expects a rs.ResidualContext, got {type(ctx).__name__}")
        if _jax_internals.any_tracer(ctx.residuals):
            raise InvalidArgumentError(
                "put cannot store a context inside jax.jit or another transformation (its residuals "
                "are tracers, not arrays): return the context from the jitted function and put it there"
            )
        key, staged = self._persistence.prepare_put(ctx, key)  # checked; the weights' host copies
        if self._table.leaving.count:  # the device holds its budget and at most one context leaving
            self._copies.wait_landed()
        # From the transition until its write is queued, a put is one change: a signal waits for
        # it (critical.py), and a copy that fails on the way still leaves the put whole.
        with critical_section():
            moves = self._table.put(key, ctx)  # bookkeeping only: the copies it owes are made after
            try:
                self._copies.settle(moves)
            finally:
                if moves.own is not None:
                    self._persistence.schedule([moves.own], staged)
        if self._table.leaving.count:  # what it leaves on the device fits the budget once they land
            self._copies.wait_landed(raise_failed=False)  # (a failed copy: the next call raises it)
        return key

    # -- get, prefetch, pop, delete -----------------------------------------------------------

    @overload
    def get(self, key: str) -> ResidualContext: ...
    @overload
    def get(self, key: str, default: T) -> ResidualContext | T: ...
    @store_call
    def get(self, key: str, default: Any = _NO_DEFAULT) -> Any:
        """The context under ``key``, on device: waits for a prefetch, verifies what it reads.
        With a ``default``, a missing key returns it, as a mapping's ``get`` does.

        Raises:
          ContextNotFoundError: no such key (and no ``default``). CorruptContextError: stored
          data failed verification (the message names the key and the residual).
        """
        try:
            ctx = self._reads.get(validate_key(key))
        except ContextNotFoundError:
            if default is _NO_DEFAULT:
                raise
            return default
        # only now: a load ahead may push out the context just got (the schedule is done with it)
        self._reads.ahead()
        return ctx

    @store_call
    def prefetch(self, key: str) -> None:
        """Starts bringing ``key`` to the device in the background; the next ``get`` takes it.

        The prefetched context is held for that ``get`` even if the budgets cannot keep it. Under
        a device budget it starts only where the budget has room for it beside what the store's
        contexts hold on the device (``stats()["device"]["held"]``); else the ``get`` reads it.
        """
        self._reads.prefetch(validate_key(key), self._persistence.holds)

    @store_call
    def schedule(self, keys: Sequence[str]) -> None:
        """Declares the order of the coming gets: ``keys`` as they will be got, keys not yet put
        included (a pipeline knows its whole order before its first forward); an empty list
        forgets it.

        The store then loads ahead of need (as many of the next contexts as the room the device
        budget has left holds, at most two loads at a time, and the very next one while what
        the store's contexts hold on the device is within the budget) and, when a tier is
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
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise InvalidArgumentError(
                f"schedule expects a sequence of keys in the order they will be got, got {type(keys).__name__}"
            )
        self._table.declare([validate_key(k) for k in keys])
        self._reads.ahead()

    @overload
    def pop(self, key: str) -> ResidualContext: ...
    @overload
    def pop(self, key: str, default: T) -> ResidualContext | T: ...
    @store_call
    def pop(self, key: str, default: Any = _NO_DEFAULT) -> Any:
        """``get`` then ``delete``; with a ``default``, a missing key returns it. What it reads
        is its caller's alone: it never enters the device tier (nor pushes a context out of it).

        Under a device budget the context returned counts against it (as ``lent`` in
        ``stats()["device"]``) until nothing refers to it and the backward that read it
        (``rs.backward`` or a split's) has run; a ``get`` or ``pop`` that must bring a context
        to the device where the budget has no room for it first waits for those backwards (JAX
        dispatches asynchronously: without it a loop of pops would bring every context back
        before the first backward ran). And it returns once at most one backward on what the
        store handed out is still running: each backward's outputs and working memory are
        allocated when it is dispatched, and the budget bounds the chip only if few are.

        Example::

            for key in reversed(keys):  # the backwards of a pipeline stage, in reverse
                grads = fwd.backward(store.pop(key), ct)
        """
        self._persistence.check_writable("pop")
        try:  # (a read for a pop never enters the device tier: it would push out a context kept)
            ctx = self._reads.get(validate_key(key), taking=True)
        except ContextNotFoundError:
            if default is _NO_DEFAULT:
                raise
            return default
        self.delete(key)
        self._reads.lend(ctx)  # no tier counts it now: it counts until its memory can go
        self._reads.ahead()  # (with room for what is lent: see get)
        return ctx

    @store_call
    def delete(self, key: str) -> None:
        """Removes ``key`` from every tier; the disk removal runs in the background, after any
        pending write of it (``flush`` waits). Unknown key: :class:`ContextNotFoundError`."""
        self._persistence.check_writable("delete")
        key = validate_key(key)
        # In a multi-process job the delete is collective, in call order with the puts: every
        # process checks here, and process 0 removes the manifest only once all have begun.
        with critical_section():  # hidden and its removal queued, or neither (a signal waits)
            version = self._table.delete(key)
            if version is None:  # not in memory: the disk tells
                if not self._persistence.holds(key):
                    raise ContextNotFoundError.of(key, self._description)
                version = self._table.delete(key, stored=True)
                assert version is not None  # (a stored delete always deletes)
            self._persistence.delete(key, version)

    # -- listing ------------------------------------------------------------------------------

    @store_call
    def keys(self) -> list[str]:
        """Every key: in memory, pending, and committed on disk (by any process)."""
        live, deleted = self._table.keys()  # before the listing: a removal done meanwhile must not bring a key back
        return sorted((live | set(self._persistence.keys())) - deleted)

    @store_call
    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        held = self._table.held(key)
        if held is not None:
            return held
        try:
            key = validate_key(key)
        except ValueError:
            return False
        return self._persistence.holds(key)

    def __len__(self) -> int:
        return len(self.keys())

    # -- the mapping protocol: store[key], store[key] = ctx, del store[key], iteration ---------
    # (the rest of collections.abc.MutableMapping: mapping.py)

    __getitem__ = get  # store[key]: ContextNotFoundError (a KeyError) for a missing key

    def __setitem__(self, key: str, ctx: ResidualContext) -> None:
        """``store[key] = ctx`` is ``store.put(ctx, key)``, but a mapping's key is a string:
        ``store[None] = ctx`` raises :class:`InvalidKeyError` (``put(ctx)`` makes a key)."""
        self.put(ctx, validate_key(key))

    __delitem__ = delete  # del store[key]

    def __iter__(self) -> Iterator[str]:
        """The keys, as :meth:`keys` lists them when iteration starts."""
        return iter(self.keys())

    @store_call
    def stats(self) -> dict[str, dict[str, int]]:
        """Bytes and contexts per tier (disk ``bytes`` count each shared weight once; its
        ``own_bytes`` only the contexts' own arrays, as the memory tiers count), and what this
        store moved since it was opened: per memory tier ``bytes_in`` (put, promoted or spilled
        into it) and ``bytes_out`` (moved to another tier); on the device ``leaving``, the bytes
        of contexts whose copy to host memory is still in flight (their device memory is not
        free yet: the store waits for them before it adds more), ``lent``, the bytes of contexts a
        ``get`` or ``pop`` handed out that no tier counts, until nothing refers to them and the
        backward that read them has run (counted under a device budget only), and ``held``, all
        the device bytes of the store's contexts (``bytes``, ``leaving``, ``lent`` and loads
        ahead not yet got): what the chip holds for them; on disk ``reads`` and ``bytes_read``
        (contexts read back, and the bytes of their arrays; weights already on the device are
        not read), ``writes`` and ``bytes_written`` (contexts committed, and their own bytes).
        ``pending``: the contexts waiting for their disk write that no memory tier holds, kept
        as host copies until written (``bytes``, ``contexts``; bounded by ``max_pending_bytes``),
        and ``reads``: the gets (and loads ahead) served from such a copy, as a disk read would
        have been had the write been done (``disk["reads"] + pending["reads"]`` counts the
        contexts brought back from below the memory tiers, however fast the disk is).
        Bytes in memory are the contexts' own (intermediates and inputs), as the budgets count.
        A context deleted or popped leaves ``disk`` when the call returns, as it leaves
        ``keys()``, before the writer has removed its files.
        """
        result = self._table.stats()
        device = result["device"]
        device["lent"] = self._reads.lent()
        device["held"] = self._table.device_held() + device["lent"]
        io, deleted = result.pop("io"), result.pop("deleted")
        result["disk"] = {**inspection.disk_bytes(self._disk, leaving=deleted), **io}
        return result

    # -- flush, close -------------------------------------------------------------------------

    @store_call
    def flush(self, *keys: str) -> None:
        """Returns once every acknowledged write is complete (and durable with ``durable=True``),
        and, without keys, every copy to host memory in flight has landed: the device memory of
        the contexts that left the device is free.

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
          was not committed); without keys, then the error of a copy to host memory that failed
          (its context is back on the device, intact). ContextNotFoundError: a key this store was never given.
        """
        checked = [validate_key(k) for k in keys]
        self._flush(checked)

    def _flush(self, checked: Sequence[str] = ()) -> None:
        had_writes = self._persistence.flush(checked)
        if not checked:
            self._copies.wait_landed()
        for key, had in zip(checked, had_writes):
            if not had and key not in self:
                raise ContextNotFoundError.of(key, self._description)

    @store_call
    def gc(
        self, older_than: float | str = 3600.0, *, dry_run: bool = False, progress: Progress | None = None
    ) -> dict[str, int]:
        """Removes what no committed context needs: unreferenced weights and data, recycled
        folders, stored backwards of signatures no context has (and damaged ones), temporary
        files of interrupted writes; only items at least ``older_than`` old: seconds (``0``:
        all), or a string as the command line's ``--older-than`` takes (``"90s"``, ``"15m"``,
        ``"1h"``, ``"2d"``).

        Returns how many of each kind it removed (``dry_run``: would remove, changing nothing),
        ``"young"``, the unneeded items it kept for being younger, and ``"bytes"``, what it
        freed (-1 on kvstores, which do not say). ``progress`` is called with the bytes freed so
        far after each item (see :meth:`verify`).
        """
        older_than = parse_age(older_than, "older_than")
        check_flags(dry_run=dry_run)
        if not dry_run:
            self._persistence.check_writable("gc")
        return self._persistence.gc(older_than, dry_run=dry_run, progress=progress)

    def close(self) -> None:
        """Flushes and stops the background threads; the store cannot be used afterwards.

        Calls that other threads make from the moment ``close`` is called raise
        :class:`InvalidArgumentError` and change nothing; those already in progress complete
        first, and what they put is flushed with the rest: a ``put`` that returned is on disk
        when ``close`` returns. A second ``close`` (from another thread too) returns once the
        first is done."""
        with self._calls.ending():  # one close at a time: a second waits for the first to be done
            if self._closed:
                return
            # (after a SIGTERM that bounds the exit, the wait for other threads' calls is bounded too)
            self._calls.stop(f"this store ({self._description}) is closed: open a new rs.Store to use it again",
                             exit_limit)
            try:
                self._flush()
            finally:
                self._closed = True
                self._finalizer.detach()
                try:
                    self._persistence.close()
                finally:
                    self._loads.shutdown(wait=True)
                    self._landings.shutdown(wait=True)
                    self._pool.release()
                    self._table.forget()  # (a closed store holds no device or host memory)


MutableMapping.register(Store)  # (registered, not derived: see mapping.py)
