"""The planner's cost model (``plan/cost.py``) and device profiles (``plan/profile.py``): FLOPs
read off real jaxprs, the copy time less what hides, what may be recomputed, the built-in
profiles and a measured one cached in a folder."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import residual_store as rs
from residual_store._src.plan import cost, measure, profile


def _eqn(fn, *args, name):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return next(e for e in jaxpr.eqns if e.primitive.name == name)


def test_internals_a_matrix_products_flops_are_2mnk_and_its_time_the_roofline():
    a, b = jnp.ones((2, 12, 40)), jnp.ones((2, 40, 24))
    eqn = _eqn(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), a, b, name="dot_general")
    assert cost.flops(eqn) == 2 * 2 * 12 * 24 * 40
    fast_memory = rs.DeviceProfile(kind="x", matmul_flops=1e9, memory_bytes=1e15)
    assert cost.seconds(eqn, fast_memory) == pytest.approx(2 * 2 * 12 * 24 * 40 / 1e9)
    slow_memory = rs.DeviceProfile(kind="x", matmul_flops=1e15, memory_bytes=1e6)
    traffic = 4 * (2 * 12 * 40 + 2 * 40 * 24 + 2 * 12 * 24)
    assert cost.seconds(eqn, slow_memory) == pytest.approx(traffic / 1e6)
    tanh = _eqn(jnp.tanh, a, name="tanh")  # a cheap operation: what it writes (fused chains read once)
    assert cost.seconds(tanh, slow_memory) == pytest.approx(4 * 2 * 12 * 40 / 1e6)


def test_internals_a_convolutions_flops_count_its_window_and_input_features():
    x, k = jnp.ones((1, 3, 10, 10)), jnp.ones((8, 3, 5, 5))
    eqn = _eqn(lambda x, k: jax.lax.conv(x, k, (1, 1), "VALID"), x, k, name="conv_general_dilated")
    assert cost.flops(eqn) == 2 * (1 * 8 * 6 * 6) * (3 * 5 * 5)


def test_internals_products_and_cheap_operations_may_be_recomputed_rng_never():
    x = jnp.ones((4, 4))
    assert cost.recomputable(_eqn(lambda x: x @ x, x, name="dot_general"))
    assert cost.recomputable(_eqn(jnp.tanh, x, name="tanh"))
    assert not cost.recomputable(_eqn(lambda k: jax.random.bits(k, (3,)), jax.random.key(0), name="random_bits"))
    assert not cost.recomputable(_eqn(lambda x: jax.lax.sort(x), x, name="sort"))  # not a product: kept


def test_internals_moving_costs_what_the_compute_beside_it_does_not_hide():
    n = int(13.4e9)  # on the v5e's profile: 1 s to host in the program, 13.4 / 14 s back
    v5e = profile.TPU_V5E  # 2/3 s of copy hidden a second of compute in the forward, 0.9 in the backward
    assert cost.copy_seconds(n, profile.CPU, 1.0) is None  # no link: nothing to offload to
    assert cost.copy_seconds(n, v5e, 0.0) == pytest.approx(1 + 13.4 / 14)  # nothing beside: all of it
    # beside compute of the copy's own time, 2/3 hides; the backward's twice the compute hides all
    assert cost.copy_seconds(n, v5e, 1.0) == pytest.approx(1 / 3)
    assert cost.copy_seconds(n, v5e, 0.25) == pytest.approx((1 - 0.25 * 2 / 3) + (13.4 / 14 - 0.5 * 0.9))
    assert cost.copy_seconds(n, v5e, 10.0) == 0.0  # never below nothing
    # the hidden share grows with the compute's time over the copy's, to all of it
    shares = [1 - cost.copy_seconds(n, dataclasses.replace(v5e, h2d_bytes=1e18), r) for r in (0.5, 1.0, 1.5, 2.0)]
    assert shares == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0], abs=1e-9)
    slow = dataclasses.replace(v5e, program_d2h_bytes=0.8e9)  # a program's output in fresh pinned memory
    assert cost.copy_seconds(n, slow, 1.0) == pytest.approx(13.4 / 0.8 - 2 / 3)
    assert cost.move_seconds(n, v5e) == pytest.approx(1 / 3 + 13.4 / 14 * 0.1)  # each copy beside its own time
    assert cost.spill_seconds(n, v5e) == pytest.approx(1 + 13.4 / 14)  # the pool's, unhidden
    assert cost.spill_seconds(10**9, profile.CPU) is None
    placed = cost.placements(8 * 2**20, v5e, offload=True)
    assert [o.choice for o in placed] == ["keep", "spill", "offload"]
    # each stores the value (written in the forward, read in the backward), then copies it: a
    # store's copies unhidden; an offload's bytes moved, which its group's compute hides
    assert placed[0].seconds == pytest.approx(2 * 8 * 2**20 / v5e.memory_bytes)
    assert placed[1].seconds == pytest.approx(placed[0].seconds + cost.spill_seconds(8 * 2**20, v5e))
    assert placed[2].seconds == placed[0].seconds and placed[2].moved == 8 * 2**20
    assert placed[0].moved == placed[1].moved == 0
    assert [o.choice for o in cost.placements(100, v5e, offload=False)] == ["keep", "spill"]
    assert [o.choice for o in cost.placements(100, profile.CPU, offload=True)] == ["keep"]


def test_internals_a_scans_values_are_one_group_beside_its_products():
    """Stacked values of one scan share the compute of its body's products times its length (a
    value outside the scans is costed apart)."""
    v5e = profile.TPU_V5E

    def f(w, x):
        def body(h, w):
            a = jnp.tanh(h @ w)
            return a @ w, None
        h, _ = jax.lax.scan(body, x, w)
        return jnp.sum(jnp.tanh(h @ w[0]))

    w, x = jnp.ones((5, 64, 64), jnp.bfloat16), jnp.ones((32, 64), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(f)(w, x).jaxpr
    scan = next(k for k, e in enumerate(jaxpr.eqns) if e.primitive.name == "scan")
    dot = next(e for e in jaxpr.eqns if e.primitive.name == "dot_general")
    assert cost._beside(jaxpr, v5e) == pytest.approx({scan: 5 * 2 * cost.seconds(dot, v5e)})
    assert cost.product_seconds(jaxpr, v5e) == pytest.approx(11 * cost.seconds(dot, v5e))


def test_internals_built_in_profiles_and_the_default_devices():
    assert rs.device_profile() is profile.CPU  # tests never measure
    assert profile.builtin_profile("TPU v5 lite") is profile.builtin_profile("tpu v5e") is profile.TPU_V5E
    assert profile.builtin_profile("TPU v4") is None
    assert profile.TPU_V5E.has_link and not profile.CPU.has_link
    assert profile.TPU_V5E.digest != profile.CPU.digest


def test_internals_a_measured_profile_is_cached_in_the_folder_named(tmp_path, monkeypatch):
    measured = []

    def fake_measure(device):
        measured.append(device)
        return rs.DeviceProfile(kind=device.device_kind, matmul_flops=123.0, memory_bytes=456.0)

    monkeypatch.setattr(measure, "measure", fake_measure)
    monkeypatch.setattr(profile, "_MEASURED", {})
    first = rs.device_profile(remeasure=True, cache_dir=tmp_path)
    assert first.matmul_flops == 123.0 and len(measured) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["profile-cpu.json"]
    assert profile._read(tmp_path / "profile-cpu.json") == first


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"matmul_flops": 0.0}, "matmul_flops"),
        ({"memory_bytes": float("inf")}, "memory_bytes"),
        ({"d2h_bytes": 1e9}, "both link rates"),
        ({"d2h_bytes": 1e9, "h2d_bytes": -1.0}, "h2d_bytes"),
        ({"hidden_forward": 1.5}, "hidden_forward"),
    ],
)
def test_bad_profiles_raise_the_librarys_error(kwargs, match):
    with pytest.raises(rs.InvalidArgumentError, match=match):
        rs.DeviceProfile(**{"kind": "x", "matmul_flops": 1e9, "memory_bytes": 1e9, **kwargs})


def _two_in_one_body(recompute_seconds):
    """Two values of one scan body (1 s of products beside them), each 0.6 s to copy each way on
    a link whose copies hide a second a second of compute: alone each hides, together 0.2 s
    does not."""
    linked = rs.DeviceProfile(kind="x", matmul_flops=1e9, memory_bytes=1e18, d2h_bytes=1e9, h2d_bytes=1e9,
                              hidden_forward=1.0, hidden_backward=1.0)
    size = int(0.6e9)
    options = (*cost.placements(size, linked, offload=True), cost.Option("recompute", 0, recompute_seconds))
    return linked, [cost.Candidate(k, f"v{k}", size, options, group=0, beside=1.0) for k in range(2)]


@pytest.mark.parametrize("recompute", [0.1, 0.3])
def test_internals_values_of_one_body_share_what_its_compute_hides(recompute):
    """Offloading both costs their copies' excess over the compute (0.2 s), split between them;
    where recomputing one costs less, the plan offloads the other only."""
    from residual_store._src.plan import choose

    linked, candidates = _two_in_one_body(recompute)
    exact, placed = choose._solved([], candidates, 0, linked)
    assert exact
    if recompute < 0.2:
        assert sorted(o.choice for o in placed) == ["offload", "recompute"]
        assert sum(o.seconds for o in placed) == pytest.approx(recompute)  # the one offloaded hides
    else:
        assert [o.choice for o in placed] == ["offload", "offload"]
        assert [o.seconds for o in placed] == pytest.approx([0.1, 0.1])  # the excess, by bytes


def test_internals_a_group_with_too_many_combinations_is_costed_apart(monkeypatch):
    """Past the combining's states, each value is costed beside its share of the compute, through
    the greedy pass: a plan that fits, not proven the fastest."""
    from residual_store._src.plan import choose, solve

    monkeypatch.setattr(solve, "combined", lambda *a, **k: None)
    linked, candidates = _two_in_one_body(0.05)
    exact, placed = choose._solved([], candidates, 0, linked)
    assert not exact and all(o.nbytes == 0 for o in placed)
    assert [o.choice for o in placed] == ["recompute", "recompute"]  # 0.6 s beside 0.5 s each: 0.1 s over, against 0.05


def test_internals_values_outside_the_scans_are_costed_apart():
    """A value outside the scans is copied whole, wherever the program puts the copy: an item of
    its own, its copies beside compute of their own time (the profile's shares: half of each
    hides here), whatever else is offloaded."""
    from residual_store._src.plan import choose

    linked, candidates = _two_in_one_body(0.7)
    halves = dataclasses.replace(linked, hidden_forward=0.5, hidden_backward=0.5)
    candidates = [dataclasses.replace(c, group=None, beside=0.0) for c in candidates]
    exact, placed = choose._solved([], candidates, 0, halves)
    assert exact and [o.choice for o in placed] == ["offload", "offload"]
    assert [o.seconds for o in placed] == pytest.approx([0.3 + 0.3] * 2)  # each 0.6 s a way, half hidden
    exact, placed = choose._solved([], [dataclasses.replace(c, options=(*c.options[:3], cost.Option("recompute", 0, 0.5)))
                                        for c in candidates], 0, halves)
    assert [o.choice for o in placed] == ["recompute", "recompute"]
