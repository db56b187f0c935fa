"""``rs.split(f, save=rs.plan(...))``: per residual keep, offload or recompute under a device
budget. The gradients are ``jax.grad``'s at every budget, the plan trades bytes for recompute as
the budget tightens (and offloads where the profile has a link: a CPU's pinned host memory
stands in for it), the report matches the context, and a planned context keeps every promise
of a context: a signature of its own, a store round trip, a resume in a process with the model
and without it.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import residual_store as rs
import transformer_model as tm
from store_helpers import TESTS_DIR, jitted_grad, jitted_value_and_grad, run_cli, run_python, write_script

LAYERS, D, F, B = 3, 16, 32, 8
TOL = {"rtol": 1e-6, "atol": 1e-7}
LINKED = rs.DeviceProfile(kind="cpu-linked", matmul_flops=1e9, memory_bytes=1e10, d2h_bytes=1e9, h2d_bytes=1e9,
                          hidden_forward=0.5)
"""A profile with a link, where moving inside the programs (half hidden) beats a store's copies and
recomputing: on a CPU, JAX's pinned host memory kind stands in for the host side."""


def stage(p, x):
    """Layers under ``lax.scan``: three matrix products a layer whose outputs the backward reads
    (one named for a policy: a plan looks through the label)."""

    def layer(h, w):
        a = jnp.tanh(h @ w["a"])
        s = jax.nn.softmax(a @ a.T / 4.0)
        return h + checkpoint_name(s @ a, "mixed") @ w["b"], None

    return jax.lax.scan(layer, x, p)[0]


def loss(p, x):
    return jnp.mean(stage(p, x) ** 2)


def _grad(p, x):
    """``jax.grad(loss, argnums=(0, 1))``, jitted once for every test that compares with it (those
    of test_plan_offload.py too): run eagerly, its scan compiles anew on every call."""
    return jitted_grad(loss, (0, 1))(p, x)


def inputs(seed):
    k = jax.random.split(jax.random.key(seed), 3)
    p = {"a": jax.random.normal(k[0], (LAYERS, D, F)) / 4, "b": jax.random.normal(k[1], (LAYERS, F, D)) / 6}
    return p, jax.random.normal(k[2], (B, D))


def _device_bytes(ctx):
    """The bytes a context holds in device memory, weights aside."""
    return sum(r.nbytes for r, kind in zip(ctx.residuals, ctx.spec.kinds)
               if kind != "weight" and r.sharding.memory_kind != "pinned_host")


def _host_bytes(ctx):
    return sum(r.nbytes for r in ctx.residuals if r.sharding.memory_kind == "pinned_host")


def _assert_grads(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert float(jnp.max(jnp.abs(w))) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


BUDGETS = (None, 6000, 3000, 0)


def _planned_split(linked, budget):
    """A planned split (with the link or without), run on fresh inputs: it, its context and plan."""
    fwd = rs.split(loss, argnums=(0, 1), save=rs.plan(device_budget=budget, profile=LINKED if linked else None))
    p, x = inputs(1)
    _, ctx = fwd(p, x)
    return fwd, ctx, ctx.spec.signature


@pytest.fixture(scope="module")
def planned():
    """Per (profile, budget): :func:`_planned_split`."""
    return {(linked, budget): _planned_split(linked, budget) for linked in (False, True) for budget in BUDGETS}


@pytest.mark.parametrize("linked", [False, True], ids=["cpu", "linked"])
def test_gradients_equal_jax_grad_at_every_budget(planned, linked):
    for budget in BUDGETS:
        fwd, ctx, _ = planned[linked, budget]
        _assert_grads(fwd.backward(ctx), _grad(*inputs(1)))
        p, x = inputs(2)  # fresh inputs, the same compiled forward and backward
        _assert_grads(fwd.backward(fwd(p, x)[1]), _grad(p, x))
        assert fwd.cache_info().forward_compiles == 1 and fwd.cache_info().backward_compiles == 1


ROOMY = 1 << 20
"""A budget with room beside the contexts for the gradients of a backward dispatched ahead."""


@pytest.mark.parametrize("budget", [None, ROOMY, 0], ids=["unbounded", "room", "budget-0"])
def test_internals_backwards_of_a_plan_under_a_budget_are_paced(planned, monkeypatch, budget):
    """A loop that dispatches backwards ahead (as on an accelerator: here no output counts as
    ready until waited for): under a plan's device budget with room beside its contexts for
    another backward's gradients (allocated at dispatch), at most one earlier backward still runs
    when the next is dispatched; without that room, none; an unbounded plan leaves JAX's dispatch
    alone. Gradients are ``jax.grad``'s."""
    from residual_store._src import backward, pace

    monkeypatch.setattr(backward, "_PLANNED", pace.Pace())  # (none of other tests' backwards)
    waited: set[int] = set()
    monkeypatch.setattr(pace, "is_ready", lambda out: id(out) in waited)
    monkeypatch.setattr(pace, "wait_for", lambda out: waited.add(id(out)))
    drained: list[frozenset] = []
    monkeypatch.setattr(backward, "drain", lambda devices: drained.append(frozenset(devices)))
    fwd = planned[False, budget][0] if budget != ROOMY else rs.split(
        loss, argnums=(0, 1), save=rs.plan(device_budget=ROOMY, microbatches=5))
    calls = [inputs(10 + i) for i in range(5)]
    contexts = [fwd(*call)[1] for call in calls]
    grads, running = [], []
    for ctx in reversed(contexts):
        grads.append(fwd.backward(ctx))
        running.append(len(grads) - len(waited))  # dispatched and not waited for, this one included
    room = ROOMY - 5 * contexts[0].spec.own_nbytes
    if budget == ROOMY:
        assert room >= sum(g.nbytes for g in jax.tree.leaves(grads[0]))
    want = {None: [1, 2, 3, 4, 5], ROOMY: [1, 2, 2, 2, 2], 0: [1, 1, 1, 1, 1]}[budget]
    assert running == want, running
    # without room for another's gradients (budget 0; their bytes are the executable's outputs',
    # known from the first call) the device is drained before the backward is dispatched
    assert drained == [frozenset(jax.devices()[:1])] * {None: 0, ROOMY: 0, 0: 5}[budget]
    for g, call in zip(grads, reversed(calls)):
        _assert_grads(g, _grad(*call))


def test_internals_a_records_budget_read_back_for_pacing():
    from residual_store._src.context import plan_budget

    record = rs.plan(device_budget=5000, microbatches=3).record
    assert plan_budget(record) == (5000, 3)
    assert plan_budget(rs.plan().record) is None and plan_budget("all") is None and plan_budget("policy:x") is None
    for damaged in ("plan:budget=x;microbatches=3;", "plan:microbatches=3;", "plan:budget=-4;microbatches=0;"):
        assert plan_budget(damaged) == (0, 1)  # (paced as tightly as it goes)


def test_recomputing_on_a_cpu_is_bit_identical(planned):
    """The backward recomputes a product with the forward's own operations on the same inputs:
    on a CPU its gradients are, to the bit, those of the plan that keeps every product, at every
    budget (and within ``TOL`` of ``jax.grad``'s, above). Not ``save="all"``'s bits: a plan, as
    ``"auto"``, saves no elementwise value, and XLA's CPU code for the ones a backward computes
    again rounds by the machine's vector width."""
    keep_all, ctx, _ = planned[False, None]
    assert rs.plan_of(ctx).count("recompute") == 0
    want = keep_all.backward(ctx)
    for budget in BUDGETS[1:]:
        planned_fwd, ctx, _ = planned[False, budget]
        assert rs.plan_of(ctx).count("recompute") > 0
        for g, w in zip(jax.tree.leaves(planned_fwd.backward(ctx)), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_tighter_budget_recomputes_more_on_a_cpu(planned):
    plans = [rs.explain(planned[False, b][1]) for b in BUDGETS]
    reports = [rs.plan_of(planned[False, b][1]) for b in BUDGETS]
    recomputed = [r.count("recompute") for r in reports]
    assert recomputed == sorted(recomputed) and recomputed[0] == 0 and recomputed[-1] == 3, plans
    assert all(r.count("offload") == 0 for r in reports)  # a CPU has no link
    for budget, r in zip(BUDGETS, reports):
        ctx = planned[False, budget][1]
        assert r.device_bytes == _device_bytes(ctx) and r.host_bytes == r.spill_bytes == 0  # the report is the context
        assert r.fits == (budget is None or r.device_bytes <= budget)
    assert reports[1].fits and reports[2].fits and not reports[3].fits  # 0: the carry stack stays
    assert reports[0].seconds < reports[1].seconds < reports[2].seconds < reports[3].seconds


def test_with_a_link_the_plan_offloads_into_pinned_host_memory(planned):
    for budget in BUDGETS:
        ctx = planned[True, budget][1]
        r = rs.plan_of(ctx)
        assert (r.device_bytes + r.spill_bytes, r.host_bytes) == (_device_bytes(ctx), _host_bytes(ctx))
        assert r.count("recompute") == 0  # moving costs less than these products on this profile
        assert r.fits and r.count("spill") == 0  # the in-program copies, half hidden, cost less
    assert rs.plan_of(planned[True, None][1]).host_bytes == 0
    assert rs.plan_of(planned[True, 0][1]).device_bytes == 0 < rs.plan_of(planned[True, 0][1]).host_bytes


def test_where_a_stores_copies_cost_less_the_plan_spills_what_it_keeps():
    """A TPU v5e today: fresh pinned program outputs are slow, the store's pool is not. A spilled
    value stays in the context, on the device, for a store at the budget to move."""
    slow_program = rs.DeviceProfile(kind="cpu-pool", matmul_flops=1e8, memory_bytes=1e10, d2h_bytes=1e10,
                                    h2d_bytes=1e10, program_d2h_bytes=1e8)
    fwd = rs.split(loss, argnums=(0, 1), save=rs.plan(device_budget=0, profile=slow_program))
    p, x = inputs(3)
    _, ctx = fwd(p, x)
    r = rs.plan_of(ctx)
    assert r.fits and r.device_bytes == r.host_bytes == 0 and r.count("offload") == 0
    assert r.spill_bytes == _device_bytes(ctx) > 0 and r.count("spill") > 0, rs.explain(ctx)
    with rs.Store(None, device_budget=0) as store:
        store.put(ctx, "k")
        _assert_grads(fwd.backward(store.pop("k")), _grad(p, x))


@pytest.mark.parametrize("linked", [False, True], ids=["cpu", "linked"])
def test_the_bw_split_of_a_planned_context(planned, linked):
    """B then W equal the plain backward; an offloaded residual only W reads stays in host
    memory in ``later``."""
    fwd, ctx, _ = planned[linked, 0]
    full = jax.tree.leaves(fwd.backward(ctx))
    dx, later = fwd.backward(ctx, now=1)
    for g, w in zip(jax.tree.leaves((rs.backward(later), dx)), full, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)
    assert (_host_bytes(later) > 0) == linked


def test_every_plan_is_a_signature_of_its_own(planned):
    signatures = {sig for _, _, sig in planned.values()}
    p, x = inputs(1)
    signatures |= {rs.split(loss, argnums=(0, 1), save=s)(p, x)[1].spec.signature for s in ("all", "auto")}
    # unbounded, both profiles keep every value alike: one computation, one signature (the
    # profile decides a plan; the plan, not the profile, is what a signature digests)
    assert planned[False, None][2] == planned[True, None][2]
    assert len(signatures) == len(planned) - 1 + 2
    _, ctx, _ = planned[False, 0]
    with pytest.raises(rs.SignatureMismatchError, match="save='plan:budget=0") as budget:
        rs.split(loss, argnums=(0, 1), save=rs.plan(device_budget=6000)).backward(ctx)
    with pytest.raises(rs.SignatureMismatchError, match="save='plan:budget=0") as auto:
        rs.split(loss, argnums=(0, 1), save="auto").backward(ctx)
    assert "device profiles" not in str(budget.value) + str(auto.value)


def test_a_plan_read_off_another_profile_rebuilds_the_backward_where_it_plans_alike(planned):
    """A profile measured in each process differs by its noise: the profile is not in the
    signature (the plan is, in the forward and backward), so a split whose profile plans alike
    runs the context's backward; one that plans otherwise says so, and what to do."""
    fwd, ctx, signature = planned[False, 0]
    remeasured = dataclasses.replace(rs.device_profile(), matmul_flops=rs.device_profile().matmul_flops * 1.02,
                                     memory_bytes=rs.device_profile().memory_bytes * 0.97)
    assert remeasured.digest != rs.device_profile().digest
    alike = rs.split(loss, argnums=(0, 1), save=rs.plan(device_budget=0, profile=remeasured))
    _assert_grads(alike.backward(ctx), _grad(*inputs(1)))
    p, x = inputs(4)
    assert alike(p, x)[1].spec.signature == signature  # its own contexts: the same signature
    assert alike.cache_info().backward_compiles == 1
    otherwise = rs.split(loss, argnums=(0, 1), save=rs.plan(device_budget=0, profile=LINKED))  # offloads
    with pytest.raises(rs.SignatureMismatchError, match="this split plans otherwise .the device profiles the two "
                       "plans read differ: the context's 'cpu.*this split's 'cpu-linked.*rs.DeviceProfile"):
        otherwise.backward(ctx)
    with pytest.raises(rs.SignatureMismatchError, match="save='plan:budget=0") as other_budget:
        rs.split(loss, argnums=(0, 1), save=rs.plan(device_budget=6000, profile=remeasured)).backward(ctx)
    assert "device profiles" not in str(other_budget.value)


@pytest.mark.slow  # seconds of compiling (as test_transformer.py's): the fast tier aims at 90 s
def test_the_transformer_with_its_names_policy_keys_and_aux():
    """``jax.checkpoint`` bodies, RNG (dropout) and ``checkpoint_name``'d values are kept whole."""
    params = tm.init(jax.random.key(3))
    tokens = jax.random.randint(jax.random.key(4), (2, tm.SEQ + 1), 0, tm.VOCAB)
    key = jax.random.key(5)
    fwd = rs.split(tm.loss, has_aux=True, save=rs.plan(device_budget=0))
    (value, aux), ctx = fwd(params, tokens, key)
    (want_value, want_aux), want = jitted_value_and_grad(tm.loss, has_aux=True)(params, tokens, key)
    np.testing.assert_allclose(value, want_value, **TOL)
    _assert_grads(fwd.backward(ctx), want)
    assert rs.plan_of(ctx).count("recompute") > 0


def _dropout_mlp(w, x, key):
    mask = jax.random.bernoulli(key, 0.7, (x.shape[0], w.shape[1]))
    return jnp.sum(jnp.where(mask, jnp.sin(x @ w), 0.0) @ w.T)


def test_rng_is_never_recomputed():
    w, x = jax.random.normal(jax.random.key(6), (8, 8)), jax.random.normal(jax.random.key(7), (4, 8))
    fwd = rs.split(_dropout_mlp, save=rs.plan(device_budget=0))
    _, ctx = fwd(w, x, jax.random.key(8))
    _assert_grads(fwd.backward(ctx), jax.grad(_dropout_mlp)(w, x, jax.random.key(8)))
    report = rs.plan_of(ctx)
    assert report.count("recompute") == 1  # x @ w, from x; the mask is kept, never drawn again
    assert any(d.choice == "keep" and d.dtype == "bool" for d in report.decisions), rs.explain(ctx)


_RESUME = """
import dataclasses, sys, jax, numpy as np, residual_store as rs
assert "test_plan" not in sys.modules
with rs.Store(sys.argv[1], read_only=True) as store:
    for key in ("cpu", "linked"):  # no model here: the stored backward recomputes
        grads = rs.backward(store.get(key))
        np.savez(f"{sys.argv[2]}/{key}-free.npz", *[np.asarray(g) for g in jax.tree.leaves(grads)])
    sys.path.insert(0, sys.argv[3])
    import test_plan  # the model: a fresh split made with the same plan rebuilds the backward
    # the profile measured again here, by its noise 3% off: it plans alike, so it rebuilds the backward
    remeasured = dataclasses.replace(test_plan.LINKED, matmul_flops=test_plan.LINKED.matmul_flops * 1.03)
    fwd = rs.split(test_plan.loss, argnums=(0, 1), save=rs.plan(device_budget=3000, profile=remeasured))
    ctx = store.get("linked")  # its offloaded values read back into host memory, where the backward wants them
    assert ctx.spec.on_host and all(ctx.residuals[i].sharding.memory_kind == "pinned_host" for i in ctx.spec.on_host)
    np.savez(f"{sys.argv[2]}/linked-model.npz", *[np.asarray(g) for g in jax.tree.leaves(fwd.backward(ctx))])
    print(rs.explain(ctx).splitlines()[0])
"""


@pytest.mark.subprocess  # (slow: a new process imports JAX and compiles)
def test_a_planned_context_resumes_in_another_process_with_and_without_the_model(tmp_path):
    want = jax.tree.leaves(_grad(*inputs(1)))
    cpu, linked = _planned_split(False, 3000), _planned_split(True, 3000)  # (the two the fixture has)
    with rs.Store(tmp_path / "store") as store:
        store.put(cpu[1], "cpu")
        store.put(linked[1], "linked")
        again = store.get("linked")  # and back in this process, from its device tier
        _assert_grads(linked[0].backward(again), want)
    script = write_script(tmp_path, "resume.py", _RESUME)
    proc = run_python(script, str(tmp_path / "store"), str(tmp_path), str(TESTS_DIR), env={"PYTHONHASHSEED": "7"})
    assert "2 offloaded" in proc.stdout, proc.stdout
    for name in ("cpu-free", "linked-free", "linked-model"):
        got = np.load(tmp_path / f"{name}.npz")
        for i, w in enumerate(want):
            np.testing.assert_allclose(got[f"arr_{i}"], np.asarray(w), **TOL)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"microbatches": 0}, "microbatches"),
        ({"microbatches": 2.0}, "microbatches"),
        ({"device_budget": -1}, "device_budget"),
        ({"device_budget": "12 parsecs"}, "device_budget"),
        ({"device_budget": "50%"}, "memory"),  # a CPU reports no memory limit
        ({"profile": "tpu"}, "profile"),
        ({"offload": "yes"}, "offload"),
    ],
)
def test_bad_plan_options_raise_the_librarys_error(kwargs, match):
    with pytest.raises(rs.InvalidArgumentError, match=match):
        rs.plan(**kwargs)


def test_explain_refuses_what_has_no_plan():
    _, ctx = rs.split(loss, argnums=(0, 1))(*inputs(1))
    with pytest.raises(rs.InvalidArgumentError, match="no plan for signature"):
        rs.explain(ctx)
    with pytest.raises(rs.InvalidArgumentError, match="takes a rs.ResidualContext or a rs.Plan"):
        rs.explain(3)


def test_the_budget_is_shared_by_the_microbatches():
    one = rs.plan(device_budget="6KiB", microbatches=1)
    four = rs.plan(device_budget="24KiB", microbatches=4)
    assert one.context_budget == four.context_budget == 6144
    assert one != four and one.record != four.record  # the same choice, another record


def test_a_stores_info_and_the_command_lines_inspect_name_the_plan(planned, tmp_path):
    """What a context's split kept is in its record: ``Store.info(key).save`` (in memory and
    from disk) and ``residual-store inspect`` (text and ``--json``), for a plan and for
    ``save="all"``, read by a store that never made the plan."""
    fwd, ctx, _ = planned[False, 3000]
    record = fwd.save.record  # (rs.PlanOptions: what rs.plan returned)
    assert record.startswith("plan:")
    plain = rs.split(loss, argnums=(0, 1))(*inputs(2))[1]
    with rs.Store(tmp_path / "s") as store:
        store.put(ctx, "planned")
        store.put(plain, "plain")
        assert store.info("planned").save == record and store.info("plain").save == "all"
    with rs.Store(tmp_path / "s", read_only=True) as reader:
        assert reader.info("planned").save == record
    assert json.loads(run_cli("inspect", str(tmp_path / "s"), "planned", "--json").stdout)["save"] == record
    assert f"saved for the backward: {record}" in run_cli("inspect", str(tmp_path / "s"), "planned").stdout


def test_a_model_of_layers_in_a_python_loop_is_planned_exactly_with_a_link():
    """Layers in a Python loop leave every value outside a scan, each an item of its own (its
    copies costed apart): scores of them stay within the exact solver."""
    def unrolled(p, x):
        h = x
        for i in range(40):
            h = h + jnp.tanh(jnp.tanh(h @ p["a"][i]) @ p["b"][i])
        return jnp.mean(h**2)

    k = jax.random.split(jax.random.key(5), 2)
    p = {"a": jax.random.normal(k[0], (40, D, F)), "b": jax.random.normal(k[1], (40, F, D))}
    x = jnp.ones((B, D))
    for budget in (0, 6_000):
        fwd = rs.split(unrolled, save=rs.plan(device_budget=budget, profile=LINKED))
        report = rs.plan_of(jax.eval_shape(lambda p, x: fwd(p, x)[1], p, x))  # noqa: B023 - called at once
        assert report.exact and report.fits, rs.explain(report)
        assert len(report.decisions) > 60
