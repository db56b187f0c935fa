"""The planner's cost model (``plan/cost.py``) and device profiles (``plan/profile.py``): FLOPs
read off real jaxprs, the copy time less what hides, what may be recomputed, the built-in
profiles and a measured one cached in a folder."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import residual_store as rs
from residual_store._src.plan import cost, profile


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


def test_internals_moving_costs_the_unhidden_share_of_each_copy():
    assert cost.move_seconds(10**9, profile.CPU) is None  # no link: nothing to offload to
    v5e = profile.TPU_V5E  # in-program: into donated buffers at the link's rate, 2/3 hidden; 9/10 back
    assert cost.move_seconds(int(13.4e9), v5e) == pytest.approx(1 / 3 + 13.4 / 14 * 0.1)
    assert cost.spill_seconds(int(13.4e9), v5e) == pytest.approx(1 + 13.4 / 14)  # the pool's, unhidden
    assert cost.spill_seconds(10**9, profile.CPU) is None
    slow = dataclasses.replace(v5e, program_d2h_bytes=0.8e9)  # a program's output in fresh pinned memory
    assert cost.move_seconds(int(13.4e9), slow) == pytest.approx(13.4 / 0.8 / 3 + 13.4 / 14 * 0.1)
    placed = cost.placements(8 * 2**20, v5e, offload=True)
    assert [o.choice for o in placed] == ["keep", "spill", "offload"]
    # each stores the value (written in the forward, read in the backward), then copies it
    assert placed[0].seconds == pytest.approx(2 * 8 * 2**20 / v5e.memory_bytes)
    assert placed[1].seconds == pytest.approx(placed[0].seconds + cost.spill_seconds(8 * 2**20, v5e))
    assert placed[2].seconds == pytest.approx(placed[0].seconds + cost.move_seconds(8 * 2**20, v5e))
    assert [o.choice for o in cost.placements(100, v5e, offload=False)] == ["keep", "spill"]
    assert [o.choice for o in cost.placements(100, profile.CPU, offload=True)] == ["keep"]


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

    monkeypatch.setattr(profile, "measure", fake_measure)
    monkeypatch.setattr(profile, "_MEASURED", {})
    first = rs.device_profile(remeasure=True, cache_dir=tmp_path)
    assert first.matmul_flops == 123.0 and len(measured) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["profile-cpu.json"]
    assert profile._read(tmp_path / "profile-cpu.json") == first


def test_internals_measuring_this_cpu_gives_a_profile_without_a_link():
    got = profile.measure(jax.devices()[0], size=64, repeats=1)
    assert got.kind == "cpu" and got.matmul_flops > 0 and got.memory_bytes > 0 and not got.has_link


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
