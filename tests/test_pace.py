"""``_src/pace.py``: backwards in flight, bounded per device (internals)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from residual_store._src import pace


@pytest.fixture
def running(monkeypatch):
    """Outputs count as not run until waited for (a device that is behind): the set of ids waited."""
    waited: set[int] = set()
    monkeypatch.setattr(pace, "is_ready", lambda out: id(out) in waited)
    monkeypatch.setattr(pace, "wait_for", lambda out: waited.add(id(out)))
    return waited


def test_internals_a_pace_waits_for_the_oldest_until_one_runs_per_device(running):
    p = pace.Pace()
    outs = {d: [jnp.full((2,), i, jnp.float32) + 0 for i in range(4)] for d in ("a", "b")}
    for i in range(4):
        for d in ("a", "b"):
            p.wait(d, running=1)
            p.ran(d, {"big": jnp.zeros((64,)), "small": outs[d][i]})  # the smallest output is kept
    # before each of the 3rd and 4th on a device, its oldest running one was waited for; the other
    # device's are its own
    assert running == {id(outs[d][i]) for d in ("a", "b") for i in (0, 1)}


def test_internals_a_pace_lets_go_of_outputs_that_have_run(running):
    p = pace.Pace()
    first = jnp.ones((3,)) + 0
    p.ran("a", first)
    running.add(id(first))  # it has run
    p.ran("a", jnp.ones((3,)) + 1)
    assert all(x is not first for q in p._outputs.values() for x in q)


def test_internals_inside_a_trace_nothing_is_recorded():
    import jax

    p = pace.Pace()
    jax.jit(lambda x: p.ran("a", x) or x)(jnp.ones(2))
    assert not p._outputs



def test_internals_drain_waits_for_a_new_scalar_program_on_each_device(monkeypatch):
    """A device runs its programs in order: ``drain`` dispatches one scalar program per device and
    waits for it, which ends after everything dispatched there before (on a TPU; a CPU may run
    programs side by side, so this checks the waits, not the order)."""
    import jax

    waited: list = []
    monkeypatch.setattr(pace, "wait_for", waited.append)
    devices = jax.devices()
    pace.drain(devices)
    pace.drain(devices)
    assert len(waited) == 2 * len(devices)
    assert [w.shape for w in waited] == [()] * len(waited)
    assert [next(iter(w.devices())) for w in waited] == [*devices, *devices]
    assert len({id(w) for w in waited}) == len(waited)  # a new program each time, not a stale ready one
