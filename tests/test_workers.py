"""The store's background workers (``residual_store/_src/store/workers.py``): the writer (in
submit order, on one thread, under a byte bound; flush and drain wait for a mark of the queue,
never for an empty one) and the pool that loads ahead. Threads are synchronised with events and
bounded by timeouts: a failing test fails, it never hangs."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

import residual_store as rs
from residual_store._src.store.workers import Writer

TIMEOUT = 10.0  # seconds any wait on another thread may take before the test fails
BLOCKED = 0.05  # how long a thread that must be blocked is watched to stay so


def _wait(event: threading.Event) -> None:
    assert event.wait(TIMEOUT), "timed out waiting on another thread"


def _gate_job(gate: threading.Event, log: list[str], name: str) -> Callable[[], str]:
    def job() -> str:
        _wait(gate)
        log.append(name)
        return name
    return job


def _blocked_until_gate_opens(gate: threading.Event, fn: Callable[[], Any], what: str) -> list[Any]:
    """Runs ``fn`` on a thread and checks that it has not returned while ``gate`` is shut; then
    opens the gate and waits for it. Its result (or its error) comes back in a list."""
    _, returned, out = _in_thread(fn)
    try:
        assert not returned.wait(BLOCKED), f"{what} returned before the gate opened"
    finally:
        gate.set()
    _wait(returned)
    return out


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, threading.Event, list[Any]]:
    """Runs ``fn`` on a daemon thread; the event is set (and the list holds its result or its
    error) when it returns."""
    done, out = threading.Event(), []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out.append(err)
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done, out


MakeWriter = Callable[..., Writer]


@pytest.fixture
def writer() -> Iterator[MakeWriter]:
    """Makes writers (``max_pending_bytes``, ``on_idle``); each is closed after the test."""
    writers: list[Writer] = []

    def make(max_pending_bytes: int = 1 << 20, on_idle: Callable[[], None] | None = None) -> Writer:
        writers.append(Writer(max_pending_bytes, on_idle))
        return writers[-1]

    yield make
    for w in writers:
        w.close(wait=False)


def test_internals_the_writer_runs_jobs_in_submit_order_on_one_thread(writer: MakeWriter):
    w, ran = writer(), []
    futures = [w.submit(lambda i=i: ran.append((i, threading.get_ident())) or i, 1) for i in range(20)]
    w.flush()
    assert [i for i, _ in ran] == list(range(20))
    assert len({t for _, t in ran}) == 1 and ran[0][1] != threading.get_ident()
    assert [f.result(timeout=0) for f in futures] == list(range(20))


def test_internals_submit_blocks_while_more_than_its_byte_bound_is_pending(writer: MakeWriter):
    w, gate, log = writer(max_pending_bytes=100), threading.Event(), []
    try:
        first = w.submit(_gate_job(gate, log, "first"), 60)  # an empty queue takes any job
        _, fits, _ = _in_thread(lambda: w.submit(_gate_job(gate, log, "fits"), 40))
        assert fits.wait(TIMEOUT), "submit blocked at the byte bound"  # 100 pending: not past it
        _, submitted, out = _in_thread(lambda: (w.submit(_gate_job(gate, log, "third"), 1), log.append("submitted")))
        assert not submitted.wait(BLOCKED), "submit returned past the byte bound"
        assert not first.done()
    finally:
        gate.set()
    _wait(submitted)
    assert not isinstance(out[0], BaseException)
    w.flush()
    # the third job was queued only once the first had run and its bytes were freed
    assert log.index("first") < log.index("submitted")
    assert [x for x in log if x != "submitted"] == ["first", "fits", "third"]


def test_internals_a_job_bigger_than_the_bound_is_taken_when_nothing_is_pending(writer: MakeWriter):
    w = writer(max_pending_bytes=10)
    assert w.submit(lambda: "big", 1000).result(timeout=TIMEOUT) == "big"
    w.flush()
    assert w.submit(lambda: "again", 1000).result(timeout=TIMEOUT) == "again"


def test_internals_flush_waits_for_every_queued_job(writer: MakeWriter):
    w, gate, log = writer(), threading.Event(), []
    futures = [w.submit(_gate_job(gate, log, str(i)), 1) for i in range(3)]
    out = _blocked_until_gate_opens(gate, w.flush, "flush (its jobs wait at the gate)")
    assert out == [None] and log == ["0", "1", "2"] and all(f.done() for f in futures)


def test_internals_a_failed_job_is_reported_by_its_future_and_by_drain(writer: MakeWriter):
    w = writer()

    def fail() -> None:
        raise ValueError("disk on fire")

    failed = w.submit(fail, 1)
    after = w.submit(lambda: "still runs", 1)
    assert after.result(timeout=TIMEOUT) == "still runs"
    err = failed.exception(timeout=TIMEOUT)
    assert isinstance(err, ValueError) and "disk on fire" in str(err)
    assert err.__traceback__ is None  # a kept error holds no frames (nor its store)
    assert any("disk on fire" in n and "background writer" in n for n in getattr(err, "__notes__", []))
    assert w.drain()[0] == [err]
    assert w.drain()[0] == []  # reported once
    w.flush()  # nothing left to raise


def test_internals_flush_raises_the_first_error_since_the_last_flush(writer: MakeWriter):
    w = writer()
    for msg in ("first", "second"):
        w.submit(functools.partial(_raise, msg), 1)
    with pytest.raises(KeyError, match="first"):
        w.flush()
    w.flush()  # cleared by the flush that raised it
    w.submit(functools.partial(_raise, "third"), 1)
    with pytest.raises(KeyError, match="third"):
        w.flush()


def _raise(msg: str) -> None:
    raise KeyError(msg)


def test_internals_on_idle_runs_once_after_the_last_queued_job_before_flush_returns(writer: MakeWriter):
    log: list[str] = []
    w, gate = writer(on_idle=lambda: log.append("idle")), threading.Event()
    w.submit(_gate_job(gate, log, "a"), 1)
    w.submit(_gate_job(gate, log, "b"), 1)
    w.submit(_gate_job(gate, log, "c"), 1)
    gate.set()
    w.flush()
    assert log == ["a", "b", "c", "idle"]


def test_internals_close_runs_what_is_queued_then_stops_the_worker(writer: MakeWriter):
    w, gate, log = writer(), threading.Event(), []
    threads: list[threading.Thread] = []
    w.submit(lambda: threads.append(threading.current_thread()), 1)
    for i in range(3):
        w.submit(_gate_job(gate, log, str(i)), 1)
    out = _blocked_until_gate_opens(gate, w.close, "close (its queue waits at the gate)")
    assert out == [None] and log == ["0", "1", "2"]
    assert not threads[0].is_alive()
    with pytest.raises(rs.InvalidArgumentError, match="closed"):
        w.submit(lambda: None, 1)
    assert w.drain()[0] == []


def test_internals_a_writer_never_used_starts_no_thread_and_closes(writer: MakeWriter):
    before = set(threading.enumerate())
    w = writer()
    assert set(threading.enumerate()) - before == set()  # (others' threads may end meanwhile)
    w.close()
    assert w.drain()[0] == []


def test_internals_the_load_pool_runs_jobs_side_by_side_and_shutdown_waits_for_them():
    loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="residual-store-load")
    a_started, b_release, names = threading.Event(), threading.Event(), []
    try:
        def a() -> str:
            a_started.set()
            _wait(b_release)  # only a second worker can release it
            names.append(threading.current_thread().name)
            return "a"

        def b() -> str:
            _wait(a_started)
            b_release.set()
            names.append(threading.current_thread().name)
            return "b"

        fa, fb = loader.submit(a), loader.submit(b)
        assert isinstance(fa, Future)
        assert (fa.result(timeout=TIMEOUT), fb.result(timeout=TIMEOUT)) == ("a", "b")
        assert all(n.startswith("residual-store-load") for n in names) and len(set(names)) == 2
        gate = threading.Event()
        slow = loader.submit(lambda: _wait(gate) or "done")
    finally:
        b_release.set()
    _blocked_until_gate_opens(gate, loader.shutdown, "close (its running job waits at the gate)")
    assert slow.result(timeout=0) == "done"
    with pytest.raises(RuntimeError):
        loader.submit(lambda: None)
