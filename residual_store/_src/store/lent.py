"""The contexts a store has handed out on the device, counted until their device memory can go.

Why: JAX dispatches asynchronously. A ``get`` or ``pop`` returns device arrays whose copy to
the device is only enqueued (their memory is allocated at once), and a backward called on them
returns before it has run; so a loop ``for k in keys: g = add(g, rs.backward(store.pop(k)))``
would bring every context back before the first backward ran, whatever the budget. A context
the store hands out that no tier counts (a pop's, or a get's that the device tier could not
keep) is therefore *lent*: its device bytes count against the device budget until they can be
freed, and a read under a full budget first waits for room (``reads.py``).

The backwards themselves need device memory too (their outputs and working memory, allocated
when each is dispatched), which no budget counts: a loop of pops and backwards would otherwise
have every backward of a step allocated at once, even for contexts that hold nothing on the
device (a planned context whose values the forward put in host memory). So every context handed
out under a device budget is watched, and each ``get`` or ``pop`` that hands one out first waits
until at most one backward on those handed out is still running (:meth:`Lent.pace`): the one
running and the one its caller dispatches next, so the chip never idles for it.

A lease is over when nothing refers to the context any more (a weak reference tells: the
caller dropped it; arrays of it the caller holds otherwise, its inputs, are the caller's) and,
where a backward of the library's read it (:func:`~residual_store._src.context.on_consumed`
tells the lease its outputs), that backward has finished: its outputs are ready, so the
computation that held the arrays' memory is done. A
lease whose context the caller still holds is the *context in use*: nothing to wait for. One
dropped without a backward of the library's is over at once (the store cannot see the
computation that read it).

Threads: any thread may lend, count and wait; the leases are changed under a lock of their own
(bookkeeping only), a wait runs outside it.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax

from residual_store._src import pace
from residual_store._src.context import ResidualContext, on_consumed, own_nbytes
from residual_store._src.pace import smallest_output, wait_while_running
from residual_store._src.store.copies import holds_device_memory
from residual_store._src.store.critical import StoreLock

__all__ = ["Lent"]


class _Lease:
    """One context handed out: a weak reference to it, the bytes of its own arrays (each once),
    and one output of the backward that read them (once one ran): all of one program's outputs
    are ready together, and the smallest keeps the least memory alive meanwhile."""

    __slots__ = ("nbytes", "_ctx", "output")

    def __init__(self, ctx: ResidualContext) -> None:
        self._ctx = weakref.ref(ctx)
        self.nbytes = own_nbytes(ctx) if holds_device_memory(ctx) else 0
        self.output: jax.Array | None = None

    def used(self, outputs: Any) -> None:
        """The backward's outputs (concrete arrays; ignored inside a trace)."""
        output = smallest_output(outputs)
        if output is not None:
            self.output = output

    def dropped(self) -> bool:
        """Whether nothing refers to the context any more."""
        return self._ctx() is None

    def over(self) -> bool:
        """Whether its device memory can be freed now (see the module docstring)."""
        output = self.output
        return self.dropped() and (output is None or pace.is_ready(output))

    def pending(self) -> jax.Array | None:
        """The output to wait on for this lease to be over, if a backward of it is running."""
        output = self.output
        return output if output is not None and not pace.is_ready(output) else None


class Lent:
    """The leases of one store (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = StoreLock()
        self._leases: list[_Lease] = []

    def __bool__(self) -> bool:
        return bool(self._leases)  # (read whole: a hint, :meth:`nbytes` answers)

    def lend(self, ctx: ResidualContext) -> None:
        """Counts ``ctx``'s own device arrays (each distinct one once) until they can be freed,
        and watches the backward that reads it (one that holds nothing on the device too); a
        context lent already (by this store or another) is not counted again."""
        lease = _Lease(ctx)
        if not on_consumed(ctx, lease.used):
            return
        with self._lock:
            self._leases = [x for x in self._leases if not x.over()]
            self._leases.append(lease)

    def nbytes(self) -> int:
        """Device bytes of the leases not over yet (those over are forgotten)."""
        with self._lock:
            self._leases = [x for x in self._leases if not x.over()]
            return sum(x.nbytes for x in self._leases)

    def pace(self, running: int = 1) -> None:
        """Waits, oldest first, until at most ``running`` backwards on lent contexts are still
        running (see the module docstring)."""
        wait_while_running(self._pending, running)

    def _pending(self) -> list[jax.Array]:
        with self._lock:
            return [o for o in map(_Lease.pending, self._leases) if o is not None]

    def wait_one(self) -> bool:
        """Waits for the oldest backward still running on a lent context; ``False`` if none runs
        (what is lent then is in use, or over)."""
        pending = self._pending()
        if not pending:
            return False
        pace.wait_for(pending[0])
        return True

