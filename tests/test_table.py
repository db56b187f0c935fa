"""The key table (``residual_store/_src/store/table.py``), one transition at a time, as Optax tests
its pure functions: small real contexts (one compiled split, a few floats each), no threads, no
disk. Each rule of the module docstring, and each of the five races it closes, is stated here as
the sequence of transitions the racing threads make; the race, signal and kill suites prove the
same end to end.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest

import residual_store as rs
from residual_store._src.context import ResidualContext
from residual_store._src.store.owed import Found, Keeping, Moves, Write
from residual_store._src.store.table import KeyTable
from store_helpers import tiny_context

WRITES_PUTS = Keeping(below_host=True, writes_puts=True)  # a store with a path (write-through)
OFFLOAD = Keeping(below_host=True, writes_spills=True)  # write_through=False
MEMORY = Keeping(below_host=False)  # no path


_ctx = tiny_context


SIZE = _ctx().spec.own_nbytes


def _table(device: int | None = None, host: int | None = None, keeping: Keeping = WRITES_PUTS) -> KeyTable:
    return KeyTable(device, host, keeping, where="test")


def _where(table: KeyTable) -> tuple[list[str], list[str]]:
    return table.device.keys(), table.host.keys()


def _settled(table: KeyTable, moves: Moves) -> Moves:
    """Makes the copies ``moves`` owes (stand-ins: new context objects of the same arrays), as a
    caller does outside the lock."""
    copy = lambda c: ResidualContext.tree_unflatten(c.spec, list(c.residuals))
    table.settle([(k, c, copy(c)) for k, c in moves.owed.demoted], [(k, c, copy(c)) for k, c in moves.owed.released])
    return moves


def _claim(table: KeyTable, writes) -> list[tuple[Write, Future]]:  # noqa: ANN001
    return table.claim_writes(writes, Future)


# -- where a put goes, and what the budgets move ------------------------------------------------


def test_internals_a_put_goes_to_the_highest_tier_its_size_fits_and_is_owed_a_host_copy_there():
    table = _table(device=SIZE, host=2 * SIZE)
    small, big = _ctx(1), _ctx(2)
    moves = table.put("small", small)
    assert _where(table) == (["small"], []) and not moves.owed.due
    assert moves.own == Write("small", small, moves.own.version)  # write-through: every put is written
    moves = table.put("big", big)
    assert _where(table) == (["small"], ["big"])
    assert moves.owed.demoted == (("big", big),)  # entered host memory on the device: a copy is owed
    assert table.host.size_of("big") == big.spec.own_nbytes


def test_internals_a_put_that_fits_no_tier_is_only_pending_and_its_device_memory_released():
    table = _table(device=0, host=0)
    ctx = _ctx()
    moves = table.put("k", ctx)
    assert _where(table) == ([], []) and moves.own is not None
    assert moves.owed.released == (("k", ctx),)  # its write's copy: the device memory goes now
    assert table.locate("k")[0] is ctx and table.held("k") is True


def test_internals_the_least_recently_used_leaves_the_device_first_and_the_put_stays():
    table = _table(device=2 * SIZE)
    ctxs = {k: _ctx(seed=i) for i, k in enumerate("abc")}
    table.put("a", ctxs["a"])
    table.put("b", ctxs["b"])
    assert table.begin_get("a").on_device  # a is now the most recently used
    moves = table.put("c", ctxs["c"])
    assert _where(table) == (["a", "c"], ["b"])
    assert moves.owed.demoted == (("b", ctxs["b"]),)
    assert table.device.bytes_out == table.host.bytes_in == SIZE


def test_internals_with_a_schedule_the_context_needed_last_leaves_and_an_unnamed_put_stays():
    table = _table(device=2 * SIZE)
    table.declare(["a", "c", "b"])
    for k in "abc":
        table.put(k, _ctx())
    assert _where(table) == (["a", "c"], ["b"])  # b is needed last
    table.put("d", _ctx())  # not named: needed after all the others, yet the put keeps it
    assert _where(table)[1] == ["b", "c"] and "d" in table.device


def test_internals_what_leaves_host_memory_is_written_where_the_store_writes_spills():
    table = _table(device=SIZE, host=SIZE, keeping=OFFLOAD)
    ctxs = [_ctx(seed=i) for i in range(3)]
    assert table.put("a", ctxs[0]).own is None  # offload: a put held in memory is not written
    table.put("b", ctxs[1])
    moves = table.put("c", ctxs[2])  # a leaves host memory for the disk
    assert [(w.key, w.ctx) for w in moves.spills] == [("a", ctxs[0])]
    assert table.locate("a") == (ctxs[0], True, False)  # pending: in no tier, still got from memory
    assert [w for w, _ in _claim(table, moves.spills)] == list(moves.spills)


def test_internals_what_leaves_host_memory_in_a_write_through_store_is_dropped_once_written():
    table = _table(device=0, host=SIZE)
    a = _ctx()
    first = table.put("a", a)
    table.write_done("a", first.own.version, SIZE)
    assert table.locate("a") == (a, False, False)  # in host memory, and on disk
    moves = table.put("b", _ctx())
    assert moves.spills == () and table.locate("a") == (None, False, False)  # the disk has it


def test_internals_the_device_tier_keeps_within_the_device_limit():
    table = KeyTable(None, None, WRITES_PUTS, device_limit=lambda held: SIZE, where="test")
    for k in "abcd":
        table.put(k, _ctx())
    assert _where(table) == (["d"], ["a", "b", "c"])


def test_internals_a_memory_only_store_refuses_a_put_that_would_push_a_context_out_unchanged():
    table = _table(device=SIZE, host=SIZE, keeping=MEMORY)
    table.put("a", _ctx())
    table.put("b", _ctx())
    with pytest.raises(rs.StoreFullError, match="'c'"):
        table.put("c", _ctx())
    assert _where(table) == (["b"], ["a"])
    table.put("a", _ctx())  # replacing a held context of the same size fits
    with pytest.raises(rs.ContextNotFoundError, match="no context 'z' in store test"):
        table.begin_get("z")


def test_internals_a_memory_only_promotion_that_would_push_a_context_out_is_served_as_a_copy():
    table = _table(device=2 * SIZE, host=SIZE, keeping=MEMORY)
    a, b = _ctx(1, seed=1), _ctx(2, seed=2)  # b is twice a's size
    table.put("a", a)
    table.put("b", b)  # a moves to host memory
    found = table.begin_get("a")
    assert found.ctx is a and found.stays  # promoting it would push b out: host memory holds one a
    assert table.finish_read("a", found, _ctx(1, seed=1)) == Moves()
    assert _where(table) == (["b"], ["a"])
    swap = _table(device=SIZE, host=SIZE, keeping=MEMORY)
    swap.put("a", a)
    swap.put("c", _ctx(1, seed=3))
    found = swap.begin_get("a")
    assert not found.stays  # a and c trade places
    swap.finish_read("a", found, _ctx(1, seed=1))
    assert _where(swap) == (["a"], ["c"])


# -- rule 2 and 3: versions, and reads that install only what is current ------------------------


def test_internals_every_put_and_delete_gives_a_new_version_never_reused():
    table = _table()
    versions = [table.put("k", _ctx()).own.version for _ in range(3)]
    versions.append(table.delete("k"))
    table.delete_done("k", versions[-1])
    versions.append(table.put("k", _ctx()).own.version)
    assert versions == sorted(versions) and len(set(versions)) == 5


def test_internals_a_read_from_disk_installs_only_if_its_version_is_still_current():
    table = _table()
    found = table.begin_get("k")  # nothing in memory: the disk
    assert found == Found(0)
    v1 = _ctx(seed=1)
    table.put("k", v1)  # overlaps the read
    assert table.finish_read("k", found, _ctx(seed=0), nbytes_read=SIZE) == Moves()
    assert table.begin_get("k").ctx is v1  # the put's, not the old version read meanwhile
    assert table.stats()["io"]["reads"] == 1


def test_internals_a_read_installs_what_it_read_and_notes_the_disk_holds_it():
    table = _table()
    found = table.begin_get("k")
    ctx = _ctx()
    table.finish_read("k", found, ctx, nbytes_read=SIZE)
    assert table.begin_get("k") == Found(found.version, ctx, on_device=True)
    assert table.locate("k") == (ctx, False, False)


def test_internals_a_copy_from_host_memory_installs_only_where_its_source_still_is():
    table = _table(device=SIZE, host=None)
    a = _ctx(seed=1)
    table.put("a", a)
    table.put("b", _ctx(seed=2))  # a moves to host memory
    found = table.begin_get("a")
    assert found.ctx is a and not found.stays
    table.put("a", _ctx(seed=3))  # replaced while copied
    assert table.finish_read("a", found, _ctx(seed=1)) == Moves()
    found = table.begin_get("a")
    assert found.on_device and found.ctx is not a


def test_internals_a_load_ahead_is_taken_by_a_get_only_if_it_loads_the_current_version():
    table = _table()
    load: Future[ResidualContext] = Future()
    assert table.start_load("k", lambda: load) is None  # only the disk can tell
    assert table.start_load("k", lambda: load, on_disk=True)
    assert table.begin_get("k").load is load
    stale: Future[ResidualContext] = Future()
    table.start_load("k", lambda: stale, on_disk=True)
    table.put("k", _ctx())
    found = table.begin_get("k")
    assert found.load is None and found.on_device


# -- rule 4: writes land only if current --------------------------------------------------------


def test_internals_a_write_of_a_superseded_version_finds_nothing_to_write():
    table = _table()
    first = table.put("k", _ctx(seed=1)).own
    second = table.put("k", _ctx(seed=2)).own
    assert table.write_starting("k", first.version) is None
    assert table.write_starting("k", second.version) is second.ctx
    table.write_done("k", second.version, SIZE)
    assert table.write_starting("k", second.version) is None  # written: nothing pending
    assert table.locate("k")[1] is False  # the disk holds the current version


def test_internals_a_failed_write_takes_its_put_out_of_memory():
    table = _table()
    own = table.put("k", _ctx()).own
    table.write_done("k", own.version, None, failed=True)
    assert table.locate("k") == (None, False, False) and table.held("k") is None  # the disk decides


# -- rule 5, race 1: a delete hides the key at once and its removal always lands ----------------


def test_internals_a_delete_hides_the_key_until_its_removal_is_done():
    table = _table()
    table.put("k", _ctx())
    version = table.delete("k")
    assert version is not None and table.held("k") is False
    with pytest.raises(rs.ContextNotFoundError, match="deleted"):
        table.begin_get("k")
    with pytest.raises(rs.ContextNotFoundError, match="already deleted"):
        table.delete("k")
    assert table.keys() == (set(), {"k"})
    table.delete_done("k", version)
    assert table.held("k") is None and table.keys() == (set(), set())  # the disk decides again


def test_internals_a_delete_of_a_key_only_the_disk_holds_asks_the_disk_first():
    table = _table()
    assert table.delete("k") is None
    version = table.delete("k", stored=True)
    assert table.held("k") is False
    table.delete_done("k", version)
    assert table.held("k") is None


def test_internals_race_1_a_put_after_a_delete_keeps_the_removal_owed_and_a_failed_write_leaves_it_deleted():
    """delete(k), then put(k) before the writer reached the removal, then that put's write fails:
    the removal still runs (it is queued before the write and the table still owes it), so
    nothing brings the deleted version back."""
    table = _table()
    removal = table.delete("k", stored=True)
    own = table.put("k", _ctx()).own
    assert table.held("k") is True  # the put is visible at once
    assert table.write_starting("k", own.version) is own.ctx
    table.write_done("k", own.version, None, failed=True)
    table.delete_done("k", removal)
    assert table.held("k") is None and table.locate("k") == (None, False, False)


def test_internals_a_disk_read_after_a_delete_and_put_never_installs_while_the_removal_is_owed():
    table = _table(device=0, host=0)
    removal = table.delete("k", stored=True)
    own = table.put("k", _ctx(seed=1)).own
    table.write_done("k", own.version, SIZE)  # (written before the removal: impossible in order, refused anyway)
    found = table.begin_get("k")
    assert found.ctx is None
    assert table.finish_read("k", found, _ctx(seed=0), nbytes_read=SIZE) == Moves()
    table.delete_done("k", removal)


# -- rule 6, race 2: a pending write is queued exactly once -------------------------------------


def test_internals_race_2_a_write_no_put_has_queued_yet_is_claimed_by_the_drain():
    """A signal lands between a put's transition and its queueing: the drain finds the pending
    write nobody queued and claims it; the put, back from the handler, finds it claimed and
    queues nothing."""
    table = _table()
    older = _claim(table, [table.put("k", _ctx(seed=0)).own])  # an earlier put's, queued
    moves = table.put("k", _ctx(seed=2))  # ... the signal lands here
    drained = table.claim_writes(None, Future)  # every write nobody queued yet
    assert [(w.key, w.version) for w, _ in drained] == [("k", moves.own.version)]
    assert table.newest_writes(["k"]) == [drained[0][1]]  # what flush("k") waits for
    assert _claim(table, [moves.own]) == []  # the put's own queueing: already claimed
    assert table.claim_writes(None, Future) == []
    assert table.write_starting("k", older[0][0].version) is None  # superseded: skipped


def test_internals_a_write_is_claimed_once_and_only_while_it_is_current():
    table = _table()
    own = table.put("k", _ctx()).own
    assert [w for w, _ in _claim(table, [own])] == [own]
    assert _claim(table, [own]) == []
    table.put("k", _ctx(seed=1))
    assert _claim(table, [own]) == []  # a stale version


# -- race 3: a read returns the version current when it began -----------------------------------


def test_internals_race_3_a_get_takes_what_it_copies_when_it_notes_the_version():
    """A get of a pending write's context, then a delete that drops that pending write: the get
    still holds the context of the version it noted, never falls to an older one on disk."""
    table = _table(device=0, host=0)
    ctx = _ctx(seed=5)
    table.put("k", ctx)
    found = table.begin_get("k")
    assert found.ctx is ctx and found.version > 0
    table.delete("k")
    assert table.finish_read("k", found, _ctx(seed=5)) == Moves()  # returned to the caller, not cached


# -- the copies owed ------------------------------------------------------------------------------


def test_internals_settled_copies_take_the_place_of_what_they_copy_only_where_it_still_is():
    table = _table(device=0, host=None)
    a = _ctx()
    moves = table.put("a", a)
    assert moves.owed.demoted == (("a", a),)
    _settled(table, moves)
    held = table.locate("a")[0]
    assert held is not a and held.residuals[1] is a.residuals[1]  # the copy, in host memory
    assert table.write_starting("a", moves.own.version) is held  # the pending write waits as the copy
    stale = table.put("a", _ctx(seed=1))  # a later put: a copy of the older context is dropped
    table.settle([("a", a, _ctx(seed=9))], [])
    assert table.locate("a")[0] is stale.owed.demoted[0][1]


def test_internals_stats_count_tiers_pending_copies_and_the_disk_io():
    table = _table(device=SIZE, host=0)
    table.put("a", _ctx())
    table.put("b", _ctx())  # a leaves memory, pending
    stats = table.stats()
    assert stats["device"]["contexts"] == 1 and stats["host"]["contexts"] == 0
    assert stats["pending"] == {"bytes": SIZE, "contexts": 1, "reads": 0}
    found = table.begin_get("a")
    assert found.ctx is not None and table.stats()["pending"]["reads"] == 1


def test_internals_a_load_ahead_enters_the_device_tier_only_where_it_has_room():
    """A prefetch brings ``a`` back while the device tier is full with ``b``: ``a`` is held for its
    get alone and ``b`` stays (it may be needed first); once there is room, a load enters."""
    table = _table(device=SIZE, host=None)
    a, b = _ctx(seed=1), _ctx(seed=2)
    table.put("a", a)
    table.put("b", b)  # a moves to host memory
    found = table.begin_get("a", ahead=True)
    assert found.ahead and found.ctx is a
    assert table.finish_read("a", found, _ctx(seed=1)) == Moves()
    assert _where(table) == (["b"], ["a"])
    table.delete("b")
    found = table.begin_get("a", ahead=True)
    copy = _ctx(seed=1)
    table.finish_read("a", found, copy)
    assert _where(table) == (["a"], []) and table.begin_get("a").ctx is copy
