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

import hashlib
import itertools
import json
import os
import threading
from typing import Any

import jax

from residual_store import _jax_internals
from residual_store.errors import ResidualStoreError

__all__ = ["TIMEOUT_S", "Channel", "Collective", "is_multiprocess"]

TIMEOUT_S = float(os.environ.get("RESIDUAL_STORE_COLLECTIVE_TIMEOUT_S", "300"))
"""How long a process waits for the others at one step of a collective operation."""

_OPENED: dict[str, int] = {}  # channel name -> stores opened at that location by this process
_OPENED_LOCK = threading.Lock()


def is_multiprocess() -> bool:
    return jax.process_count() > 1


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

    def __init__(self, description: str) -> None:
        name = hashlib.sha256(description.encode()).hexdigest()[:16]
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
        coll = Collective(self, seq, what, timeout_s)
        theirs = coll.allgather("begin", [what, value])
        if seq > 0 and coll.index == 0:
            # every process has begun this operation, so all finished reading the previous one
            coll.forget(f"{self.prefix}/{seq - 1}")
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

    def forget(self, prefix: str) -> None:
        """Removes the exchanged values under ``prefix`` from the coordination service."""
        try:
            self._client.key_value_delete(prefix)
        except Exception:  # noqa: BLE001 - a leftover entry costs the coordinator a few bytes
            pass
