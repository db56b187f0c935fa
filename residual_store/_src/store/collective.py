"""Coordination of the processes of a JAX multi-controller job (``jax.process_count() > 1``).

A store used by every process of such a job writes and deletes each context collectively:
every process calls ``put``/``delete``/``flush`` with the same keys in the same order, writes the
shards its devices own, and process 0 commits (or removes) the manifest once every process has
said its part is done. The processes agree through the key-value store of JAX's distributed
client (``jax.distributed.initialize``), which needs no devices, so it runs on the store's writer
thread.

A store's first collective operation gives it a :class:`Channel`, named after the store's
location and how many stores at that location began collective operations in this process
before (every process opens and writes the same stores, as it runs the same program; a store a
single process opens only to read makes no channel).
Operations on a channel are numbered too; the first exchange of each names the operation
(``put 'mb3'``) beside its first payload, so processes that called ``put``/``delete`` with other keys or in another order
learn it at once, instead of waiting for one another until the timeout.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax

import residual_store_serializers as serializers
from residual_store._src import _jax_internals
from residual_store._src.context import ResidualContext, ResidualSpec
from residual_store._src.errors import InvalidArgumentError, ResidualStoreError, StoreFullError
from residual_store._src.logs import event
from residual_store._src.store.committer import Committer, SingleProcessCommitter
from residual_store._src.store.critical import StoreLock
from residual_store._src.store.disk import forms, layout, paths
from residual_store._src.store.disk.host_arrays import HostArrays, ShardedHost
from residual_store._src.store.disk.layout import HostWrite
from residual_store._src.store.disk.paths import validate_key
from residual_store._src.store.disk.protocol import ContextWrite, StaleData
from residual_store._src.store.disk.tier import DiskTier
from residual_store._src.store.host import host_arrays, stage_shared

if TYPE_CHECKING:
    from residual_store._src.store.backwards import BackwardSaver

__all__ = ["TIMEOUT_S", "Channel", "Collective", "CollectiveCommitter", "committer_for", "is_multiprocess"]

TIMEOUT_S = 300.0
"""How long a process waits for the others at one step of a collective operation, by default
(``rs.Store(..., collective_timeout=...)``)."""

_OPENED: dict[str, int] = {}  # channel name -> stores opened at that location by this process
_OPENED_LOCK = StoreLock()


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def committer_for(disk: DiskTier, timeout_s: float = TIMEOUT_S) -> Committer:
    """The committer of a store on ``disk``: a :class:`CollectiveCommitter` in a job of several
    processes, else a :class:`SingleProcessCommitter`."""
    return CollectiveCommitter(disk, timeout_s) if is_multiprocess() else SingleProcessCommitter(disk)


def _client() -> Any:
    client = _jax_internals.distributed_client()
    if client is None:
        raise ResidualStoreError(
            "jax.process_count() > 1 but there is no distributed client: call "
            "jax.distributed.initialize() before using a store"
        )
    return client


class Channel:
    """The sequence of collective operations of one store, in the order every process runs them.

    Operations must be begun one at a time (the store's writer runs its jobs in call order on one
    thread), so the sequence numbers agree across processes.
    """

    def __init__(self, description: str, timeout_s: float = TIMEOUT_S) -> None:
        name = hashlib.sha256(description.encode()).hexdigest()[:16]
        self.timeout_s = timeout_s
        with _OPENED_LOCK:
            number = _OPENED.get(name, 0)
            _OPENED[name] = number + 1
        self.description = description
        self.prefix = f"residual_store/{name}.{number}"
        self._ops = itertools.count()

    def begin(self, what: str, value: Any = None, timeout_s: float | None = None) -> tuple[Collective, list[Any]]:
        """Starts operation ``what`` (e.g. ``"put 'mb3'"``), which every process must begin alike,
        and exchanges its first ``value`` (JSON-able) in the same round trip.

        Returns the operation and every process's ``value``, in process order.

        Raises:
          ResidualStoreError: another process began a different operation at this point (its
            ``put``/``delete`` calls differ from this one's), or did not begin one in time.
        """
        seq = next(self._ops)
        coll = Collective(self, seq, what, self.timeout_s if timeout_s is None else timeout_s)
        theirs = coll.allgather("begin", [what, value])
        if seq > 0 and coll.index == 0:
            # every process has begun this operation, so all finished reading the previous one
            coll.clear(f"{self.prefix}/{seq - 1}")
        if any(w != what for w, _ in theirs):
            calls = ", ".join(f"process {i}: {w}" for i, (w, _) in enumerate(theirs))
            raise ResidualStoreError(
                f"collective operation #{seq} of store {self.description}: the processes disagree "
                f"({calls}); every process must call put/delete with the same keys in the same "
                "order. Nothing was written for it."
            )
        return coll, [v for _, v in theirs]


class Collective:
    """One collective operation of a :class:`Channel`: exchanges among all processes under its name."""

    def __init__(self, channel: Channel, seq: int, what: str, timeout_s: float | None = None) -> None:
        self.prefix = f"{channel.prefix}/{seq}"
        self.what = what
        self.timeout_ms = int(1000 * (TIMEOUT_S if timeout_s is None else timeout_s))
        self.index = jax.process_index()
        self.count = jax.process_count()
        self._client = _client()

    def allgather(self, step: str, value: Any) -> list[Any]:
        """Every process's ``value`` (JSON-able), in process order; also a barrier."""
        self._client.key_value_set(f"{self.prefix}/{step}/{self.index}", json.dumps(value))
        out = []
        for i in range(self.count):
            try:
                raw = self._client.blocking_key_value_get(f"{self.prefix}/{step}/{i}", self.timeout_ms)
            except Exception as err:  # JaxRuntimeError: deadline exceeded, or the service is gone
                raise ResidualStoreError(
                    f"collective {self.what}: process {i} did not reach step {step!r} within "
                    f"{self.timeout_ms / 1000:g} s (it died or hangs, or opened this store at "
                    f"another path): {err}"
                ) from err
            out.append(json.loads(raw))
        return out

    def clear(self, prefix: str) -> None:
        """Removes the exchanged values under ``prefix`` from the coordination service."""
        try:
            self._client.key_value_delete(prefix)
        except Exception:  # noqa: BLE001 - a leftover entry costs the coordinator a few bytes
            pass


def _process_local_sums(arrays: HostArrays) -> dict[str, str]:
    """Checksums of the residuals on this process's devices only (not global arrays): unlike
    a global array's, their values may differ between processes."""
    here = jax.process_index()
    owner = {d.id: d.process_index for d in jax.devices()}
    out = {}
    for i, x in enumerate(arrays):
        if isinstance(x, ShardedHost):
            if x.whole is None or any(owner.get(d) != here for d in x.sharding["device_ids"]):
                continue
            x = x.whole
        out[str(i)] = serializers.checksum(x)
    return out


def _check_same_everywhere(key: str, spec: ResidualSpec, local_sums: Sequence[Mapping[str, str]]) -> None:
    """Raises if a process-local residual differs between processes: a collective put stores one
    context for all of them (process 0 writes whole arrays), so the others' values would be lost."""
    for i in sorted({i for sums in local_sums for i in sums}, key=int):
        seen = [sums.get(i) for sums in local_sums]
        if len(set(seen)) > 1:
            raise ResidualStoreError(
                f"collective write of context {key!r}: residual {i} ({spec.names[int(i)]}) is an "
                "array on one process's devices only, and its values differ between processes "
                "(a store shared by the processes keeps one context per key, so all but one would "
                "be lost). Make the inputs global arrays (a sharding over every process's "
                "devices, e.g. jax.make_array_from_process_local_data), or give each process a "
                "store of its own. Nothing was written."
            )


def _gathered_sums(infos: Sequence[Mapping[str, Any]]) -> dict[int, dict[tuple[int, ...], tuple[str, str | None]]]:
    """Every process's chunk checksums, as :data:`~residual_store._src.store.disk.forms.ChunkSums`."""
    out: dict[int, dict[tuple[int, ...], tuple[str, str | None]]] = {}
    for info in infos:
        for i, entries in info["chunks"].items():
            for idx, chk, digest in entries:
                out.setdefault(int(i), {})[tuple(idx)] = (chk, digest)
    return out


def _of(attributes: Mapping[str, Any], arrays: Mapping[str, Any]) -> dict[str, Any]:
    """The attributes of the arrays among ``arrays``."""
    return {p: a for p, a in attributes.items() if p in arrays}


@dataclasses.dataclass
class _Share:
    """What one process writes of a :class:`~residual_store._src.store.disk.layout.WritePlan`."""

    own: dict[str, Any] = dataclasses.field(default_factory=dict)  # path -> array or its chunks
    shared_chunks: dict[str, Any] = dataclasses.field(default_factory=dict)  # chunks of weights, in place
    skipped: list[str] = dataclasses.field(default_factory=list)  # sharded weights found in place
    whole_weights: dict[str, Any] = dataclasses.field(default_factory=dict)  # whole weights (process 0)
    staged: dict[str, tuple[str, Any]] = dataclasses.field(default_factory=dict)  # weight -> (where its chunks go, array)
    chunked: dict[str, Any] = dataclasses.field(default_factory=dict)  # own chunked arrays, for their zarr.json


class CollectiveCommitter:
    """Writes and deletes contexts of a :class:`DiskTier` with every process of the job.

    The same :class:`~residual_store._src.store.disk.layout.WritePlan` as a single process, committed by
    many: each process holds, for a residual sharded over devices of several processes, only the
    chunks of its own devices (``replica_id == 0``); whole arrays (fully replicated, or on one
    device) are written by process 0 only. The processes exchange their chunks' checksums (and,
    for weights, content digests) and a write id, write their chunks, say whether that worked,
    and only when every process did, process 0 writes the arrays' ``zarr.json``, puts shared
    weights in place and commits the manifest; a last exchange tells every process the commit
    happened. A process that dies or fails leaves no manifest: the others time out or learn the
    failure and raise, and process 0 removes the data.

    A sharded weight goes where the medium's strategy stages it
    (:meth:`~residual_store._src.store.disk.protocol.Atomicity.shared_staging`): a staging folder
    renamed into place where the backend can rename (a local or shared file system); on other
    kvstores the weight's content address, where each process writes its chunks (the same bytes
    whoever writes them), and ``zarr.json``, written last by process 0, makes the weight exist.

    Every process holds the store's gc lock shared for the whole write: from the first look for
    a weight in any process to the commit, gc cannot remove one.

    Its policies (the :class:`Committer` methods) follow from the processes acting as one: every
    put needs a key and is written through, in put order, superseded or not; process 0 saves
    the backwards; replaced data is removed, never recycled.
    """

    def __init__(self, disk: DiskTier, timeout_s: float = TIMEOUT_S) -> None:
        self.disk = disk
        self.timeout_s = timeout_s
        self.backend = disk.backend
        self._channel: Channel | None = None  # made at the first collective operation
        self._lock = StoreLock()

    # -- policies -----------------------------------------------------------------------------

    def key_for(self, key: str | None) -> str:
        if key is None:  # a fresh key would differ between processes
            raise InvalidArgumentError(
                "in a multi-process job, put needs a key: every process puts the same context "
                "under the same key, and a fresh key would differ between processes"
            )
        return validate_key(key)

    def writes_through(self, asked: bool) -> bool:
        return True  # a spill would depend on one process's budgets

    def lands(self, *, superseded: bool) -> bool:
        return True  # every process takes part in every write and delete, in put order

    # each process writes the shards of its own devices
    stage_shared = staticmethod(functools.partial(stage_shared, partial=True))
    host_arrays = staticmethod(functools.partial(host_arrays, partial=True))

    def save_backward(self, saver: BackwardSaver, ctx: ResidualContext) -> None:
        if jax.process_index() == 0:  # one process saves them for the job
            saver.save(ctx)

    def dispose(self, stale: StaleData) -> None:
        # removed: to recycle it, each process would have to claim the same folder
        self.disk.atomicity.remove(stale)

    # -- writing and deleting -----------------------------------------------------------------

    def _begin(self, what: str, value: Any = None) -> tuple[Collective, list[Any]]:
        """Begins a collective operation on this store's channel; a store only read from (an
        inspection in one process) never makes one, so it cannot put the processes out of step."""
        with self._lock:
            if self._channel is None:
                self._channel = Channel(self.disk.description, self.timeout_s)
            channel = self._channel
        return channel.begin(what, value)

    def write(self, write: HostWrite) -> StaleData | None:
        """Writes and commits ``write`` with every process; returns the replaced data (process 0
        only)."""
        self.disk.check_writable(f"put {write.key!r}")
        with self.backend.gc_lock(exclusive=False):
            return self._write(write)

    def _write(self, write: HostWrite) -> StaleData | None:
        key, spec, fsync = write.key, write.spec, write.fsync
        local_sums = _process_local_sums(write.arrays)
        own_sums = {str(i): [[list(idx), chk, d] for idx, (chk, d) in t.items()]
                    for i, t in forms.chunk_sums(spec, write.arrays).items()}
        coll, infos = self._begin(
            f"put {key!r}", {"chunks": own_sums, "local": local_sums, "write_id": paths.new_write_id()}
        )
        lead = coll.index == 0
        _check_same_everywhere(key, spec, [info["local"] for info in infos])
        # the whole arrays' checksums: those of the arrays on this process (what every process
        # compared), for the weights' as well
        here = dataclasses.replace(write, whole_sums={int(i): c for i, c in local_sums.items()})
        plan = layout.plan_write(here, write_id=infos[0]["write_id"], sums=_gathered_sums(infos))
        if lead:
            self.disk.ensure_groups()
        share = self._share(plan, lead, infos[0]["write_id"])
        error: str | None = None
        full = False
        try:
            # process 0 writes the bundle of the whole own arrays; the group's zarr.json at the commit
            files = {plan.bundle.ref.path: plan.bundle.parts} if lead and plan.bundle is not None else {}
            self.backend.write_context(
                ContextWrite(share.own, _of(plan.attributes, share.own), files, fsync=fsync, write_metadata=False)
            )
            self.backend.write_shared_arrays(share.shared_chunks, fsync=fsync, write_metadata=False)
        except Exception as err:  # noqa: BLE001 - every process must learn of it
            error = f"process {coll.index}: {type(err).__name__}: {err}"
            full = serializers.is_disk_full(err)
        try:
            written = coll.allgather("written", {"error": error, "skipped": share.skipped})
        except ResidualStoreError:  # a process died or hung: no commit
            self._clean_up(plan, share, lead)
            raise
        errors = [w["error"] for w in written if w["error"] is not None]
        if errors:
            self._clean_up(plan, share, lead)
            kind_of = StoreFullError if full else ResidualStoreError
            raise kind_of(f"collective write of context {key!r} failed, nothing committed: {'; '.join(errors)}")
        previous = None
        if lead:
            try:
                previous = self._commit(plan, share, {p for w in written for p in w["skipped"]}, fsync=fsync)
            except Exception as err:  # noqa: BLE001
                self._clean_up(plan, share, lead)
                error = f"process 0: {type(err).__name__}: {err}"
        errors = [e for e in coll.allgather("committed", error if lead else None) if e is not None]
        if errors:
            event(logging.WARNING, "collective put failed", key=key, error=errors[0])
            raise ResidualStoreError(f"collective write of context {key!r} failed, nothing committed: {errors[0]}")
        event(logging.DEBUG, "collective commit", key=key, data_dir=plan.data_dir, processes=len(written))
        return self.disk.data_of(previous, key) if previous is not None else None

    def _share(self, plan: layout.WritePlan, lead: bool, write_id: str) -> _Share:
        """This process's part of ``plan``: its chunks of every chunked array, and with ``lead``
        the whole arrays."""
        share = _Share()
        atomicity = self.disk.atomicity
        for a in plan.arrays:
            if a.whole:
                if lead and not a.shared:
                    share.own[a.path] = a.data
                elif lead and not self.backend.array_exists(a.path):
                    share.whole_weights[a.path] = a.data
            elif not a.shared:
                share.own[a.path] = a.data
                share.chunked[a.path] = a.data
            else:
                target = atomicity.shared_staging(a.path, write_id)
                share.staged[a.path] = (target, a.data)
                if self.backend.array_exists(a.path):
                    share.skipped.append(a.path)
                elif target != a.path:  # a folder of this write alone
                    share.own[target] = a.data
                else:  # the weight's own address: content-addressed chunks, which no writer tears
                    share.shared_chunks[target] = a.data
        return share

    def _commit(self, plan: layout.WritePlan, share: _Share, skipped: set[str], *, fsync: bool) -> bytes | None:
        """Process 0, once every process's chunks are durable: the ``zarr.json`` of each chunked
        array (an array is complete once it is there), sharded weights put in place, whole
        weights, the group metadata, then the manifest. Returns the manifest it replaced."""
        meta = {p: serializers.ChunkedArray(a.shape, a.dtype, a.chunk_shape, {}) for p, a in share.chunked.items()}
        self.backend.write_context(ContextWrite(meta, _of(plan.attributes, meta), {}, fsync=fsync))
        atomicity = self.disk.atomicity
        for path, (target, data) in share.staged.items():
            if self.backend.array_exists(path):
                atomicity.drop_shared_staging(target, path)
                continue
            if path in skipped:
                raise ResidualStoreError(
                    f"weight {path} was removed (by gc?) while processes that found it in place "
                    "skipped writing their chunks of it; put the context again"
                )
            empty = {target: serializers.ChunkedArray(data.shape, data.dtype, data.chunk_shape, {})}
            atomicity.publish_shared(target, path, empty, fsync=fsync)  # its zarr.json makes it exist
        self.backend.write_shared_arrays(share.whole_weights, fsync=fsync)
        self.backend.put_bytes(paths.group_metadata_path(plan.data_dir), plan.group, fsync=fsync)
        previous = self.disk.read_manifest_bytes(plan.key)
        self.backend.put_bytes(paths.manifest_path(plan.key), plan.manifest, fsync=fsync)
        return previous

    def _clean_up(self, plan: layout.WritePlan, share: _Share, lead: bool) -> None:
        """Process 0: what a write left that does not commit."""
        if lead:
            self.backend.delete_tree(plan.data_dir)
            for path, (target, _) in share.staged.items():
                self.disk.atomicity.drop_shared_staging(target, path)

    def delete(self, key: str) -> tuple[bool, StaleData | None]:
        """:meth:`DiskTier.delete` by every process at once: process 0 removes the manifest once
        all have begun (so none can still be checking whether ``key`` exists), and all learn the
        outcome. Returns whether process 0 found it, and the removed context's data (process 0
        only)."""
        self.disk.check_writable(f"delete {key!r}")
        self.disk.forget_stat(key)
        coll, _ = self._begin(f"delete {key!r}")
        found, stale, error = False, None, None
        if coll.index == 0:
            try:
                found, stale = self.disk.delete(key)
            except Exception as err:  # noqa: BLE001 - every process must learn of it
                error = f"process 0: {type(err).__name__}: {err}"
        errors = [e for e in coll.allgather("deleted", error) if e is not None]
        if errors:
            raise ResidualStoreError(f"collective delete of context {key!r} failed: {errors[0]}")
        return found, stale
