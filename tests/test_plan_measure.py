"""The planner's device measurement (``residual_store._src.plan.measure``): the arithmetic
from times to a profile's fields with real numbers (a TPU v5e's), and each measurement program
run on the CPU's pinned host memory where this JAX has it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from residual_store._src.plan import cost, measure


def test_internals_measuring_this_cpu_gives_a_profile_without_a_link():
    got = measure.measure(jax.devices()[0], size=32, repeats=1)
    assert got.kind == "cpu" and got.matmul_flops > 0 and got.memory_bytes > 0 and not got.has_link
    assert not got.duplex and got.hidden_forward == got.hidden_backward == 0.0


# A TPU v5e's link programs (JAX 0.10.2, size=1024: 128 MiB each way, 12 products an iteration)
V5E_TIMES = measure.LinkTimes(nbytes=134217728, launch=0.000622209, out=0.010414216, back=0.011128207,
                              both=0.012259796, kept_forward=0.009957837, offloaded_forward=0.011087845,
                              kept_backward=0.009593697, offloaded_backward=0.011680876, products=12)


def test_internals_a_measured_links_fields_from_a_tpu_v5es_times():
    """Less the launch (0.6 ms) each: 9.8 ms to host, 10.5 back, 11.6 both ways at once; the
    forward's copy added 1.1 ms to 9.3 of products (0.93 of them hid it), the backward's 2.1 ms."""
    got = measure._link_fields(V5E_TIMES)
    assert got["d2h_bytes"] == pytest.approx(134217728 / (0.010414216 - 0.000622209))
    assert got["d2h_bytes"] == pytest.approx(13.7e9, rel=0.01)  # the built-in: 13.4e9
    assert got["h2d_bytes"] == pytest.approx(12.8e9, rel=0.01)  # 14e9
    assert got["duplex"] is True
    assert got["hidden_forward"] == pytest.approx(0.928, abs=1e-3)
    assert got["hidden_backward"] == pytest.approx(0.938, abs=1e-3)
    measured = rs.DeviceProfile(kind="TPU v5 lite", matmul_flops=167e12, memory_bytes=687e9, **got)
    assert measured.has_link and measured.program_d2h == got["d2h_bytes"]


@pytest.mark.parametrize("share", [0.5, 2 / 3, 0.9])
@pytest.mark.parametrize("ratio", [0.5, 1.0])
def test_internals_a_hidden_share_is_what_the_cost_models_law_would_hide(share, ratio):
    """Times the cost model predicts for a copy of 10 ms beside ``ratio`` times its time of
    compute give the share back: what the copy adds is ``copy_seconds``'s forward (or backward)
    part."""
    copy = 0.010
    nbytes = int(copy * 1e9)
    forward = rs.DeviceProfile(kind="x", matmul_flops=1e12, memory_bytes=1e12, d2h_bytes=1e9, h2d_bytes=1e18,
                               hidden_forward=share)
    kept = ratio * copy
    added = cost.copy_seconds(nbytes, forward, kept)
    assert measure._hidden_share(copy, kept, kept + added) == pytest.approx(share)
    backward = dataclasses.replace(forward, d2h_bytes=1e18, h2d_bytes=1e9, hidden_forward=0.0, hidden_backward=share)
    added = cost.copy_seconds(nbytes, backward, kept / 2)  # the model's backward runs beside twice the forward's
    assert measure._hidden_share(copy, kept, kept + added) == pytest.approx(share)


def test_internals_a_hidden_share_stays_a_share():
    assert measure._hidden_share(0.010, 0.010, 0.021) == 0.0  # the copy cost more than alone: none hid
    assert measure._hidden_share(0.010, 0.005, 0.005) == 1.0  # all of it behind half its time: the most
    assert measure._hidden_share(0.010, 0.020, 0.020) == pytest.approx(0.5)  # all hid at r = 2: 1 / r, a bound
    assert measure._hidden_share(0.010, 0.0, 0.010) == 0.0  # no compute: nothing to hide behind
    assert measure._hidden_share(float("nan"), 0.01, 0.01) == 0.0


def test_internals_duplex_slope_and_products_from_numbers():
    assert measure._duplex(0.074, 0.077, 0.083)  # the v5e's: 1 GiB each way
    assert not measure._duplex(0.074, 0.077, 0.150)  # one way, then the other
    # what the second 16 steps added (the launch, 0.6 ms, cancels), or the mean where noise ate it
    assert measure._slope(16, 0.0006 + 16 * 1e-4, 0.0006 + 32 * 1e-4) == pytest.approx(1e-4)
    assert measure._slope(16, 0.0040, 0.0039) == pytest.approx(0.0039 / 32)
    # 0.61 ms of copy an iteration at 167 TFLOP/s: 12 products of 8.6 GFLOP; within 1..64
    assert measure._products(0.00061, 167e12, 2.0 * 4096 * 1024 * 1024) == 12
    assert measure._products(1e-9, 167e12, 1e9) == 1 and measure._products(10.0, 167e12, 1e9) == 64


def test_internals_a_compiled_programs_aliases_are_read_off_its_text():
    text = "HloModule jit_f, input_output_alias={ {1}: (2, {}, may-alias), {0}: (0, {}, must-alias) }, entry_computation"
    assert measure._aliases(text) == [(1, 2), (0, 0)]
    assert measure._aliases("HloModule jit_f, input_output_alias={ {}: (2, {}, may-alias) }, entry") == [(0, 2)]
    assert measure._aliases("HloModule jit_f, entry_computation_layout={()->f32[]}") == []


CPU = jax.devices()[0]
HAS_PINNED = "pinned_host" in {m.kind for m in CPU.addressable_memories()}
needs_pinned = pytest.mark.skipif(not HAS_PINNED, reason="this JAX's CPU has no pinned_host memory")


@needs_pinned
def test_internals_a_program_placed_otherwise_than_asked_is_refused_before_it_runs():
    """What a measurement program is checked for (a TPU aborts a program that hands a pinned
    buffer where device memory is expected): here its output lands in device memory, not the
    pinned host memory asked for."""
    here = jax.sharding.SingleDeviceSharding(CPU, memory_kind="device")
    host = jax.sharding.SingleDeviceSharding(CPU, memory_kind="pinned_host")
    x = jax.device_put(jnp.ones(4), here)
    jitted = jax.jit(lambda x: x + 1, in_shardings=here, out_shardings=here)
    with pytest.raises(rs.ResidualStoreError, match="measurement program"):
        measure._checked(jitted, (x,), (host,))
    assert measure._checked(jitted, (x,), (here,)) is not None


_ONE_EIGHTH = 0.125  # the link programs' values: means of 1/8 (size 8), which products by w keep
_LINK_RESULTS = {  # program -> [(memory kind, last value)] of its outputs: 16 iterations
    "out": [("device", _ONE_EIGHTH + 16), ("pinned_host", _ONE_EIGHTH + 15)],  # the carry, then + 1
    "back": [("device", _ONE_EIGHTH * 17)],  # each slice added
    "both": [("pinned_host", _ONE_EIGHTH + 15), ("device", _ONE_EIGHTH * 17)],
    "kept_forward": [("device", _ONE_EIGHTH), ("device", _ONE_EIGHTH)],
    "offloaded_forward": [("device", _ONE_EIGHTH), ("pinned_host", _ONE_EIGHTH)],
    "kept_backward": [("device", _ONE_EIGHTH * 17)],
    "offloaded_backward": [("device", _ONE_EIGHTH * 17)],
}


@needs_pinned
@pytest.mark.slow  # seven programs to compile, about 5 s on a CPU
@pytest.mark.parametrize("name", measure._Link.NAMES)
def test_internals_each_link_program_runs_on_the_cpus_pinned_memory(name):
    """Each of measure()'s link programs, on JAX's CPU pinned host memory: compiled, checked and
    run twice (a donated buffer handed on), its outputs where they should be and right."""
    link = measure._Link(CPU, 8)
    run = link.program(name, k=2)
    run()
    outs = jax.tree.leaves(run())
    assert [(x.sharding.memory_kind, float(np.asarray(x, np.float32).ravel()[-1])) for x in outs] == _LINK_RESULTS[name]
    assert link.nbytes == 16 * 32 * 8 * 2 and link.product_flop == 2.0 * 32 * 8 * 8


@needs_pinned
@pytest.mark.slow  # seven programs to compile, about 5 s on a CPU
def test_internals_a_cpus_link_measured_as_an_accelerators_makes_a_valid_profile():
    times = measure._link_times(CPU, 16, 1, 1e10)
    fields = measure._link_fields(times)
    got = rs.DeviceProfile(kind="cpu", matmul_flops=1e10, memory_bytes=1e10, **fields)
    assert got.has_link and 0.0 <= got.hidden_forward <= 1.0 and 0.0 <= got.hidden_backward <= 1.0
    assert times.nbytes == 16 * 64 * 16 * 2 and 1 <= times.products <= 64
