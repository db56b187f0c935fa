"""How a store brings a context back to the device (from a memory tier, from a pending write's
host copy, or from disk, read and verified), the loads ahead of need that a schedule asks for
(on the store's loader threads), and what it hands out that no tier counts (``lent.py``).

Every read follows the key table's rules (``table.py``): it notes the key's version and takes
what it copies in one step, copies or reads without the lock, and installs what it got only if
that version is still current.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from residual_store._src.context import ResidualContext, bound_context, check_representable, describe_residual, own_nbytes
from residual_store._src.errors import ContextNotFoundError, CorruptContextError
from residual_store._src.store.copies import BudgetCopies, to_device
from residual_store._src.store.host import place
from residual_store._src.store.lent import Lent
from residual_store._src.store.owed import Found
from residual_store._src.store.pinned import HostPool
from residual_store._src.store.schedule import loads_ahead
from residual_store._src.store.table import KeyTable
from residual_store._src.store.weights import LiveWeights

if TYPE_CHECKING:
    from residual_store._src.store.disk.records import StoredContext
    from residual_store._src.store.disk.tier import DiskTier

__all__ = ["Reads"]

_AHEAD = 2  # loads a schedule keeps in flight at most
_LOOKAHEAD = 64  # keys of a schedule looked at for loading ahead


def _check_representable(key: str, spec: Any) -> None:
    """Raises if a stored dtype has no exact counterpart in this process (64-bit types without
    ``jax_enable_x64``, which JAX would silently narrow to 32 bits)."""
    check_representable(spec.avals, describe_residual(spec, f"context {key!r}"), "loading it")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Reads:
    """The read side of a store: memory first, then disk; loads ahead by schedule.

    Args:
      table: the store's key table.
      disk: the store's files (``None``: memory only; the table then never sends a read there).
      backward_for: the stored backward of a signature, for a context read from disk.
      copies: the copies the budgets owe (a read's install may push contexts out).
      weights: the weights on the device already (not read again).
      target: the device contexts are placed on (``None``: JAX's default).
      loads: the threads loads ahead run on.
      pool: the pinned host memory copies to the device go through.
    """

    table: KeyTable
    disk: DiskTier | None
    backward_for: Callable[[str], Any]
    copies: BudgetCopies
    weights: LiveWeights
    target: Any
    loads: ThreadPoolExecutor
    pool: HostPool
    # what gets and pops handed out that no tier counts (lent.py)
    _lent: Lent = dataclasses.field(default_factory=Lent, init=False)

    def get(self, key: str, *, taking: bool = False) -> ResidualContext:
        """For a ``get``: the load of ``key`` in flight if it loads the current version, the
        device tier's context, or a read now. What no tier keeps is lent (see :meth:`lend`).
        ``taking``: a ``pop``'s, whose read never enters the device tier."""
        if self.table.leaving.count:  # (read whole; wait_landed asks again under the lock)
            self.copies.wait_landed()
        found = self.table.begin_get(key, taking=taking)
        if found.on_device:
            return found.ctx  # type: ignore[return-value]
        # a load's result is kept for this get even when the budgets could not hold it
        ctx = found.load.result() if found.load is not None else self._read(key, found)
        # in no tier: lent (a pop's, once it has taken the key out of the store: see Store.pop)
        if not taking and self.table.device.budget is not None and self.table.locate(key)[0] is not ctx:
            self.lend(ctx)
        return ctx

    def lend(self, ctx: ResidualContext) -> None:
        """Under a device budget: ``ctx``, handed out and in no tier, counts against the budget
        until its device memory can be freed; and it is handed out once at most one backward on
        those lent before is still running (``lent.py``)."""
        if self.table.device.budget is not None:
            self._lent.lend(ctx)
            self._lent.pace()

    def lent(self) -> int:
        """Device bytes of the contexts lent and not yet free."""
        return self._lent.nbytes() if self._lent else 0

    def room(self) -> int | None:
        """Device bytes the budget has left beside everything the store's contexts hold on the
        device, lent ones included (negative: over; ``None``: no budget)."""
        budget = self.table.device.budget
        return None if budget is None else budget - self.table.device_held() - self.lent()

    def make_room(self, nbytes: int) -> None:
        """Before a read brings ``nbytes`` of a context to the device: waits for the backwards
        running on lent contexts until that context fits the budget beside the store's others
        (or none is left to wait for: what is lent then is in use), so the device holds at most
        the budget and the one context in use, whatever the caller dispatched ahead: never the
        next context beside a previous one still being read by its backward."""
        while (room := self.room()) is not None and room < nbytes and self._lent.wait_one():
            pass

    def load(self, key: str) -> ResidualContext:
        """``key`` from memory or disk, on the device (a load ahead's job)."""
        if self.table.leaving.count:
            self.copies.wait_landed()
        found = self.table.begin_get(key, ahead=True)
        return found.ctx if found.on_device else self._read(key, found)  # type: ignore[return-value]

    def _read(self, key: str, found: Found) -> ResidualContext:
        """Copies ``found.ctx`` to the device, or reads the disk, without the lock; then installs
        it where the table lets it (rule 3) and makes the copies that owes."""
        nbytes = None
        # it waits for room before it places anything on the device (nothing is lent without a
        # device budget; a load ahead started only where there was room)
        wait = not found.ahead and self.table.device.budget is not None and bool(self._lent)
        try:
            if found.ctx is not None:
                if wait:
                    self.make_room(own_nbytes(found.ctx))
                # a context the device budget cannot hold is served as a device copy and left
                # where it is, so a get under a small budget costs one copy, not a round trip
                ctx = to_device(found.ctx, self.target, self.pool)
            else:
                ctx, nbytes = self._from_disk(key, wait)
        except BaseException:
            self.table.finish_read(key, found, None)
            raise
        moves = self.table.finish_read(key, found, ctx, nbytes_read=nbytes)
        if moves.spills or moves.owed.demoted or moves.owed.released:
            self.copies.settle(moves)
        return ctx

    def _from_disk(self, key: str, wait: bool) -> tuple[ResidualContext, int]:
        """``key`` read from disk, verified and placed; and the bytes read. ``wait``: for room
        (:meth:`make_room`) once it is in host memory, before it is placed."""
        assert self.disk is not None, "a memory-only store's table never reads the disk"
        live = self.weights.on(self.target)  # kept alive until placed: not read again
        stored, arrays = self.disk.read(key, skip=live)  # sharded: only this process's chunks
        nbytes = sum(r.nbytes for r in stored.records if not (r.shared and not r.chunked and r.path in live))
        _check_representable(key, stored.spec)
        if wait:
            self.make_room(stored.spec.own_nbytes)
        paths = [r.path for r in stored.records]
        residuals = place(
            arrays, [r.shared for r in stored.records], stored.key_impls,
            functools.partial(self.weights.device_array, paths, arrays, live, self.target),
            self.target,
            stored.spec.on_host,
        )
        # the stored backward, read and checked now, deserialized only if rs.backward needs it
        return bound_context(stored.spec, residuals, loader=self.backward_for(stored.spec.signature)), nbytes

    # -- loads ahead -----------------------------------------------------------------------------

    def prefetch(self, key: str, holds: Callable[[str], bool]) -> None:
        """Starts loading ``key`` in the background unless it is on the device or loading, or the
        device budget has no room for it beside what the store's contexts hold, lent ones
        included (the get reads it then: a prefetch is often made before the get of another
        key, which then comes on top of it); ``holds`` asks the disk whether it has a key this
        store does not hold in memory.

        Raises:
          ContextNotFoundError: the store does not hold ``key``.
        """
        room = self.room()
        if room is not None and room < self._size(key):  # full: the get reads it, once there is room
            held = self.table.held(key)
            if held is False or (held is None and not holds(key)):
                raise ContextNotFoundError.of(key, self.table.where)
            return
        submit = self._submitter(key)
        if self.table.start_load(key, submit) is None:
            if not holds(key):
                raise ContextNotFoundError.of(key, self.table.where)
            self.table.start_load(key, submit, on_disk=True)

    def ahead(self) -> None:
        """Starts loading the contexts the schedule names next: the very next one, then as many
        as fit the room the device budget has left together with it, at most ``_AHEAD`` loads in
        flight, stopping at the first not yet put (its room is the put's); none while the
        store's contexts, lent ones included, fill the budget (the get reads it then)."""
        if not self.table.scheduled:  # (read whole; the table answers again under its lock)
            return
        room = self.room()
        if room is not None and room < 0:  # the store's contexts fill the budget: none ahead
            return
        upcoming, in_flight = self.table.ahead(_LOOKAHEAD)
        if not upcoming:
            return
        sizes = {k: (None if s == -1 else s if s is not None else self._stored_size(k)) for k, s, _ in upcoming}
        held = {k: h for k, _, h in upcoming}
        start = loads_ahead(list(sizes), sizes.__getitem__, held.__getitem__, room, _AHEAD - in_flight)
        for key in start:
            try:
                self.table.start_load(key, self._submitter(key), on_disk=True)
            except ContextNotFoundError:
                continue  # deleted meanwhile

    def _size(self, key: str) -> int:
        """The own bytes of ``key``'s context in memory (0 where only the disk has it)."""
        ctx, _, _ = self.table.locate(key)
        return 0 if ctx is None else own_nbytes(ctx)

    def _submitter(self, key: str) -> Callable[[], Future[ResidualContext]]:
        """What queues a load of ``key`` on the load threads (the table calls it, see
        :meth:`KeyTable.start_load`)."""
        return functools.partial(self.loads.submit, functools.partial(self.load, key))

    def _stored_size(self, key: str) -> int | None:
        """The own bytes of ``key`` on disk, or ``None`` if the disk does not hold it."""
        if self.disk is None:
            return None
        try:
            stored: StoredContext = self.disk.stat(key)
        except (ContextNotFoundError, CorruptContextError):
            return None
        return sum(r.nbytes for r in stored.records if not r.shared)

