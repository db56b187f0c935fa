"""Coordination of the processes of a JAX multi-controller job (``jax.process_count() > 1``).

A store used by every process of such a job writes each context collectively: every process
calls ``put``/``flush`` with the same keys in the same order, writes the shards its devices own,
and process 0 commits the manifest once every process has said its shards are durable. The
processes agree through the key-value store and barriers of JAX's distributed client
(``jax.distributed.initialize``), which need no devices, so they run on the store's writer thread.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from typing import Any

import jax

from residual_store import _jax_internals
from residual_store.errors import ResidualStoreError

__all__ = ["TIMEOUT_S", "Collective", "is_multiprocess"]

TIMEOUT_S = float(os.environ.get("RESIDUAL_STORE_COLLECTIVE_TIMEOUT_S", "300"))
"""How long a process waits for the others at one step of a collective write."""

_SEQ = itertools.count()
_SEQ_LOCK = threading.Lock()


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


class Collective:
    """One collective operation: a name every process derives alike, and exchanges under it.

    Every process must create its ``Collective`` objects in the same order (the store's writer
    runs its jobs in ``put`` order, one at a time), so the sequence numbers agree.
    """

    def __init__(self, what: str, timeout_s: float | None = None) -> None:
        with _SEQ_LOCK:
            seq = next(_SEQ)
        self.prefix = f"residual_store/{seq}/{what}"
        self.what = what
        self.timeout_ms = int(1000 * (TIMEOUT_S if timeout_s is None else timeout_s))
        self.index = jax.process_index()
        self.count = jax.process_count()
        self._client = _client()

    def allgather(self, step: str, value: Any) -> list[Any]:
        """Every process's ``value`` (JSON-able), in process order; also a barrier."""
        self._client.key_value_set(
            f"{self.prefix}/{step}/{self.index}", json.dumps(value)
        )
        out = []
        for i in range(self.count):
            try:
                raw = self._client.blocking_key_value_get(
                    f"{self.prefix}/{step}/{i}", self.timeout_ms
                )
            except (
                Exception
            ) as err:  # JaxRuntimeError: deadline exceeded, or the service is gone
                raise ResidualStoreError(
                    f"collective write of {self.what}: process {i} did not reach step {step!r} within "
                    f"{self.timeout_ms / 1000:g} s (it died, or the processes did not call put/flush "
                    f"with the same keys in the same order): {err}"
                ) from err
            out.append(json.loads(raw))
        return out
