"""Backwards in flight, bounded: the next one dispatched once few enough earlier ones still run.

JAX dispatches asynchronously, and a computation's outputs are allocated when it is dispatched.
A loop ``for ctx in contexts: grads = add(grads, backward(ctx))`` therefore allocates every
backward's gradients before the first one has run: on a TPU v5e, 12 microbatches of an 8-block
model planned at budget 0 (contexts that hold nothing on the device) peaked at 2.28 GiB, and at
0.92 GiB with each backward waited for. Where memory is bounded (a planned split with a device
budget, a store with one), a backward is dispatched only once at most ``running`` earlier ones
of the same kind on its device still run: one (the device never waits for the host, and the
gradients of the one dispatched ahead are allocated beside the running one's), or none (the
host's dispatch between two backwards is the price of the memory). With none, the device is also
drained first (:func:`drain`): what the caller dispatched between two backwards (summing the
gradients, an optimizer's update) runs and frees its inputs before the next backward allocates
(on a TPU v5e the caller's sum of the last gradients was what a budget-0 plan peaked above).

What a computation's end is told by: one of its outputs being ready (all of a program's outputs
are ready together; the smallest is kept, as it keeps the least memory alive meanwhile). A ready
one is let go at the next backward on its device: until then at most the two latest backwards'
smallest outputs a device are kept alive.

Threads: any thread may wait and record; the records change under a lock of their own, a wait
runs outside it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from residual_store._src import _jax_internals

__all__ = ["Pace", "drain", "is_ready", "smallest_output", "wait_for", "wait_while_running"]


def is_ready(output: jax.Array) -> bool:
    """Whether the program that made ``output`` has run (without waiting)."""
    return bool(output.is_ready())  # type: ignore[attr-defined]  # (jax.Array's stubs lack it)


def wait_for(output: jax.Array) -> None:
    """Waits until the program that made ``output`` has run."""
    jax.block_until_ready(output)


def smallest_output(outputs: Any) -> jax.Array | None:
    """The smallest concrete array among ``outputs`` (``None`` inside a trace, or if none)."""
    leaves = [x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)]
    if not leaves or _jax_internals.any_tracer(leaves):
        return None
    return min(leaves, key=lambda x: int(x.nbytes))


def wait_while_running(pending: Callable[[], list[jax.Array]], running: int) -> None:
    """Waits, oldest first, until at most ``running`` of ``pending()`` (outputs of computations
    not yet run, oldest first) are left."""
    while len(outputs := pending()) > running:
        wait_for(outputs[0])


@jax.jit
def _mark(x: jax.Array) -> jax.Array:
    return x + 1


def drain(devices: Any) -> None:
    """Waits until every program dispatched on ``devices`` so far has run. A device runs its
    programs in the order they were dispatched (a TPU's, or a GPU's compute stream), so a program
    of one scalar, dispatched now and waited for, ends after all of them. (On a CPU programs may
    run side by side: there this waits for less, and the CPU has no device memory to bound.)"""
    marks = [_mark(jax.device_put(np.int8(0), device)) for device in devices]
    for mark in marks:
        wait_for(mark)


class Pace:
    """The computations of one kind in flight, per device (see the module docstring).

    Example:
      >>> pace = Pace()
      >>> pace.wait(device, running=1)       # at most one earlier one still running
      >>> pace.ran(device, backward(ctx))    # (its outputs: it is running now)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outputs: dict[Hashable, collections.deque[jax.Array]] = {}

    def _pending(self, where: Hashable) -> list[jax.Array]:
        with self._lock:
            queue = self._outputs.get(where)
            if queue is None:
                return []
            pending = [x for x in queue if not is_ready(x)]
            if pending:
                self._outputs[where] = collections.deque(pending)
            else:
                del self._outputs[where]
            return pending

    def wait(self, where: Hashable, running: int) -> None:
        """Waits until at most ``running`` computations recorded for ``where`` still run."""
        wait_while_running(lambda: self._pending(where), running)

    def ran(self, where: Hashable, outputs: Any) -> None:
        """Records a computation just dispatched for ``where`` by its ``outputs`` (ignored
        inside a trace)."""
        output = smallest_output(outputs)
        if output is not None:
            self._pending(where)  # (lets go of those that have run)
            with self._lock:
                self._outputs.setdefault(where, collections.deque()).append(output)
