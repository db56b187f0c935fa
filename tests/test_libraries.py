"""The test matrix of issue 10: splits of Flax NNX, Flax linen, Equinox, Haiku models, custom
pytree nodes and int-keyed dicts (models in ``library_models.py``).

For each case:
  * in this process, ``fwd.backward(ctx)`` equals ``jax.value_and_grad`` leaf by leaf on fresh
    random inputs, the primal output and the aux state equal ``fun``'s, and two microbatches of
    one shape cost one forward and one backward compile;
  * the contexts put in a store are run by processes that never import the model code: one
    without the libraries either (gradients in their original structure only where it is made
    of JAX containers, else a mapping from key path to array in the model's leaf order), one with flax.nnx and equinox
    imported (NNX ``State`` and built-in ``eqx.nn`` modules come back as such, ``like=``
    rebuilds on a template);
  * a ``jax.jit`` step that calls the split and its backward gives the same gradients;
  * ``like=`` a tree with one path different raises ``rs.SignatureMismatchError`` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import textwrap
from typing import Any

import jax
import numpy as np
import pytest

import library_models as lm
import residual_store as rs

# every test here shares module fixtures that build and run the real models (seconds each)
pytestmark = pytest.mark.slow

TOL = {"rtol": 1e-5, "atol": 1e-6}
N_MICROBATCHES = 2
SUBPROCESS_TIMEOUT = 300
JIT_CASES = ("nnx_functional", "nnx_whole", "eqx_transformer", "eqx_gru")


# ----------------------------------------------------------------------------------------------
# Helpers


def _keystr(path: Any) -> str:
    return jax.tree_util.keystr(path)


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def max_rel_err(got: dict[str, Any], want: dict[str, Any]) -> float:
    """The largest ``|got - want|`` over every leaf, relative to that leaf's largest ``|want|``."""
    worst = 0.0
    for path, w in want.items():
        w = np.asarray(w, np.float64)
        scale = max(float(np.max(np.abs(w))), 1e-30) if w.size else 1.0
        worst = max(worst, float(np.max(np.abs(np.asarray(got[path], np.float64) - w), initial=0.0)) / scale)
    return worst


class _Flat(dict):
    """A ``{key path: leaf}`` dict, compared as it is (not flattened again)."""


def assert_close_by_path(got: Any, want: Any, what: str) -> float:
    """``got`` and ``want`` (trees, or :class:`_Flat` dicts) equal leaf by leaf, keyed by
    ``jax.tree_util.keystr`` and in the same leaf order (float leaves within ``TOL``, others
    exactly, typed PRNG keys by their key data); returns the largest relative error of the float
    leaves. The order matters: gradients ``jax.tree.unflatten``-ed on the parameters' treedef
    land on the parameter at the same position, whatever their key paths say."""
    got_flat = got if isinstance(got, _Flat) else lm.flat(got)
    want_flat = want if isinstance(want, _Flat) else lm.flat(want)
    assert list(got_flat) == list(want_flat), f"{what}: key paths differ, or come in another order"
    assert want_flat, f"{what}: nothing to compare"
    for path, w in want_flat.items():
        g, w = _as_numpy(got_flat[path]), _as_numpy(w)
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what} {path}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
        if np.issubdtype(w.dtype, np.inexact):
            np.testing.assert_allclose(g, w, err_msg=f"{what} {path}", **TOL)
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{what} {path}")
    return max_rel_err(
        {p: v for p, v in got_flat.items() if np.issubdtype(_as_numpy(v).dtype, np.inexact)},
        {p: v for p, v in want_flat.items() if np.issubdtype(_as_numpy(v).dtype, np.inexact)},
    )


def with_one_path_changed(tree: Any) -> tuple[Any, str]:
    """``tree`` with its first leaf wrapped in a list (so its key path ``p`` becomes ``p[0]``,
    every other path unchanged), and ``p``."""
    leaves, treedef = jax.tree.flatten(tree)
    path = next(iter(lm.flat(tree)))
    leaves[0] = [leaves[0]]
    return jax.tree.unflatten(treedef, leaves), path


def _running_stat(path: str) -> bool:
    """A BatchNorm running statistic, differentiated by a filter but not used in training mode
    (its gradient is zero)."""
    return path.startswith("['bn']['mean']") or path.startswith("['bn']['var']")


def _report(case: str, what: str, value: Any) -> None:
    print(f"REPORT {case} {what} {value}")  # gathered for issue 10's table (pytest -s)


# ----------------------------------------------------------------------------------------------
# Running every case once (module scope: compiled things are shared by the tests)


@dataclasses.dataclass
class Run:
    case: lm.Case
    fwd: rs.Split
    reference: Any
    args: list[tuple[Any, ...]]
    results: list[Any]  # (out, aux) or out, per microbatch
    contexts: list[rs.ResidualContext]
    grads: list[Any]
    expected: list[tuple[Any, Any, Any]]  # reference (out, aux, grads) per microbatch
    info: rs.CacheInfo


@pytest.fixture(scope="module")
def seed() -> int:
    """A fresh seed per run (printed, so a failure can be replayed with LIBRARY_TEST_SEED)."""
    value = int(os.environ.get("LIBRARY_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"library test seed {value}")
    return value


@pytest.fixture(scope="module")
def runs(seed) -> dict[str, Run]:
    out: dict[str, Run] = {}
    for index, (name, make) in enumerate(lm.MAKERS.items()):
        case = make()
        fwd, ref = case.split(), lm.reference(case)
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), index), N_MICROBATCHES)
        args = [case.args(k) for k in keys]
        results, contexts, grads = [], [], []
        for a in args:
            result, ctx = fwd(*a)
            results.append(result)
            contexts.append(ctx)
            grads.append(fwd.backward(ctx))
        info = fwd.cache_info()
        out[name] = Run(case, fwd, ref, args, results, contexts, grads, [ref(*a) for a in args], info)
    return out


CASES = list(lm.MAKERS)


# ----------------------------------------------------------------------------------------------
# In this process


@pytest.mark.parametrize("name", CASES)
def test_gradients_output_and_aux_equal_jax_grad(runs, name):
    run = runs[name]
    worst = 0.0
    for i in range(N_MICROBATCHES):
        want_out, want_aux, want_grads = run.expected[i]
        got = run.results[i]
        got_out, got_aux = got if run.case.has_aux else (got, None)
        np.testing.assert_allclose(got_out, want_out, **TOL)
        if run.case.has_aux:
            assert jax.tree.structure(got_aux) == jax.tree.structure(want_aux)
            assert_close_by_path(got_aux, want_aux, f"{name} aux {i}")
        # the original structure, None where a leaf was passed through (a filter)
        assert jax.tree.structure(run.grads[i]) == jax.tree.structure(want_grads)
        assert all(float(np.max(np.abs(v))) > 0 for k, v in lm.flat(want_grads).items() if not _running_stat(k))
        worst = max(worst, assert_close_by_path(run.grads[i], want_grads, f"{name} grads {i}"))
    _report(name, "in_process_rel_err", worst)


@pytest.mark.parametrize("name", CASES)
def test_a_context_read_back_from_disk_holds_the_models_own_weight_arrays(runs, name, tmp_path):
    """Budgets 0, so every get reads the disk: the weights of what comes back are the model's
    live parameter arrays the put held (not read, not copied), and the gradients are bit for
    bit the in-memory ones."""
    run = runs[name]
    with rs.Store(tmp_path / "s", device_budget=0, host_budget=0) as store:
        for i, ctx in enumerate(run.contexts):
            store.put(ctx, f"{name}-{i}")
        store.flush()
        for i, ctx in enumerate(run.contexts):
            got = store.get(f"{name}-{i}")
            weights = [(x, y) for x, y, k in zip(got.residuals, ctx.residuals, ctx.spec.kinds) if k == "weight"]
            assert weights and all(x is y for x, y in weights), name
            for a, b in zip(jax.tree.leaves(run.fwd.backward(got)), jax.tree.leaves(run.grads[i])):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_microbatches_differ(runs):
    """Fresh random inputs per microbatch: the gradients of the two are not the same."""
    for name, run in runs.items():
        a, b = lm.flat(run.expected[0][2]), lm.flat(run.expected[1][2])
        assert any(not np.allclose(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("name", CASES)
def test_two_microbatches_cost_one_forward_and_one_backward_compile(runs, name, compiles):
    run = runs[name]
    info = run.info
    _report(name, "compiles", f"fwd={info.forward_compiles},bwd={info.backward_compiles}")
    assert (info.forward_compiles, info.backward_compiles) == (1, 1), info
    assert info.misses == 1 and info.hits == N_MICROBATCHES - 1, info
    # a third microbatch of that shape compiles nothing at all (counted by jax.monitoring)
    args = run.case.args(jax.random.key(12345))
    with compiles.counting() as counted:
        result, ctx = run.fwd(*args)
        jax.block_until_ready(run.fwd.backward(ctx))
    assert counted.count == 0


@pytest.mark.parametrize("name", CASES)
def test_like_rebuilds_on_the_parameters(runs, name):
    """``like=`` the parameters (for a split with a filter that passes leaves through, the
    reference gradients, which are ``None`` there) gives their structure and the same values."""
    run = runs[name]
    like = run.expected[0][2] if name == "nnx_whole" else run.case.params
    got = rs.backward(run.contexts[0], like=like)
    assert jax.tree.structure(got) == jax.tree.structure(like)
    assert type(got) is type(run.case.params)
    assert_close_by_path(got, run.grads[0], f"{name} like=")


def test_like_the_whole_nnx_state_for_a_filtered_split(runs):
    """``like=`` the parameters themselves: the leaves the filter passed through (the RNG key
    and counter) come back ``None``, as ``nnx.grad`` leaves them out."""
    run = runs["nnx_whole"]
    got = rs.backward(run.contexts[0], like=run.case.params)
    assert type(got) is type(run.case.params)
    assert_close_by_path(got, run.expected[0][2], "like= the whole state")
    assert jax.tree.structure(got) == jax.tree.structure(run.expected[0][2])


@pytest.mark.parametrize("name", CASES)
def test_like_with_one_path_different_is_refused_naming_it(runs, name):
    run = runs[name]
    bad, path = with_one_path_changed(run.expected[0][2])
    for backward in (rs.backward, run.fwd.backward):
        with pytest.raises(rs.SignatureMismatchError) as err:
            backward(run.contexts[0], like=bad)
        assert path in str(err.value), str(err.value)
        assert path + "[0]" in str(err.value)


def test_a_whole_equinox_transformer_block_with_a_filter():
    """Its Python leaves (``eqx.nn.Dropout``'s ``inference`` flag and rate) are static under the
    filter, as under ``eqx.filter_jit``, and get ``None`` gradients."""
    case = lm.make_eqx_transformer_whole()
    args = case.args(jax.random.key(0))
    _, ctx = case.split()(*args)
    assert_close_by_path(rs.backward(ctx), lm.reference(case)(*args)[2], "whole block")


# ----------------------------------------------------------------------------------------------
# Inside jax.jit


@pytest.mark.parametrize("name", JIT_CASES)
def test_a_jitted_step_calling_the_split_and_its_backward(runs, name):
    run = runs[name]
    fwd = run.fwd

    @jax.jit
    def step(*args):
        result, ctx = fwd(*args)
        return result, fwd.backward(ctx), ctx

    args = run.args[0]
    result, grads, ctx = step(*args)
    want_out, want_aux, want_grads = run.expected[0]
    out = result[0] if run.case.has_aux else result
    np.testing.assert_allclose(out, want_out, **TOL)
    assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
    assert_close_by_path(grads, want_grads, f"{name} jit")
    if run.case.has_aux:
        assert_close_by_path(result[1], want_aux, f"{name} jit aux")
    # the context returned from the jitted step runs outside it too
    assert isinstance(ctx, rs.ResidualContext)
    assert_close_by_path(rs.backward(ctx), want_grads, f"{name} jit ctx")


# ----------------------------------------------------------------------------------------------
# In other processes, without the model code

RUNNER = textwrap.dedent(
    """
    import json, sys
    mode, root, out, spec = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    if mode == "libs":
        import equinox as eqx
        from flax import nnx
    import jax, numpy as np
    import residual_store as rs

    assert "library_models" not in sys.modules
    report, names, arrays = {"results": {}, "checks": {}}, [], []

    def describe(g):
        t = type(g)
        return {"type": f"{t.__module__}.{t.__qualname__}", "treedef": str(jax.tree.structure(g))}

    def record(key, g):
        report["results"][key] = describe(g)
        for path, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
            names.append(key + jax.tree_util.keystr(path))
            arrays.append(np.asarray(leaf))

    def refused(ctx, like):
        try:
            rs.backward(ctx, like=like)
        except rs.SignatureMismatchError as err:
            return str(err)
        return "accepted"

    def one_path_changed(tree):
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = [leaf for _, leaf in flat]
        leaves[0] = [leaves[0]]
        return jax.tree.unflatten(treedef, leaves), jax.tree_util.keystr(flat[0][0])

    with rs.Store(root, read_only=True) as store:
        for key in spec["keys"]:
            record(key, rs.backward(store.get(key)))
        # like= with one path different, on a stored backward
        plain = rs.backward(store.get("linen_scan-0"))
        bad, path = one_path_changed(plain)
        report["checks"]["bad_like_plain"] = {"path": path, "message": refused(store.get("linen_scan-0"), bad)}
        if mode == "libs":
            n_in, hidden, n_out = spec["sizes"]
            # templates built from the libraries alone, with the model's sizes
            cell = eqx.nn.GRUCell(n_in, hidden, key=jax.random.key(0))
            record("like:eqx_gru-0", rs.backward(store.get("eqx_gru-0"), like=cell))
            rngs = nnx.Rngs(0)
            net = nnx.Dict(
                l1=nnx.Linear(n_in, hidden, rngs=rngs),
                bn=nnx.BatchNorm(hidden, rngs=rngs),
                drop=nnx.Dropout(0.25, rngs=rngs),
                l2=nnx.Linear(hidden, n_out, rngs=rngs),
            )
            record("like:nnx_functional-0", rs.backward(store.get("nnx_functional-0"), like=nnx.state(net, nnx.Param)))
            bad, path = one_path_changed(cell)
            report["checks"]["bad_like_gru"] = {"path": path, "message": refused(store.get("eqx_gru-0"), bad)}
    report["imported"] = sorted(m for m in ("library_models", "flax", "equinox", "haiku") if m in sys.modules)
    np.savez(out, *arrays)
    report["names"] = names
    print(json.dumps(report))
    """
)


def _start(mode: str, root: str, out: str, keys: list[str], seed: int) -> subprocess.Popen[str]:
    spec = {"keys": keys, "sizes": [lm.IN, lm.HIDDEN, lm.OUT]}
    # no PYTHONPATH, and a cwd away from tests/: library_models is not importable there
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.Popen(
        [sys.executable, "-c", RUNNER, mode, root, out, json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONHASHSEED": str(seed)},
        cwd=os.path.dirname(root),
    )


def _finish(proc: subprocess.Popen[str], out: str) -> dict[str, Any]:
    try:
        stdout, stderr = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the runner took over {SUBPROCESS_TIMEOUT} s: {stderr[-4000:]}") from None
    assert proc.returncode == 0, stderr[-4000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    with np.load(out) as data:
        report["arrays"] = dict(zip(report.pop("names"), (data[f"arr_{i}"] for i in range(len(data.files)))))
    return report


@pytest.fixture(scope="module")
def stored(runs, tmp_path_factory):
    """Every case's contexts in one store, run by one process per variant (the two at once),
    under other hash seeds than this one's."""
    base = tmp_path_factory.mktemp("libraries")
    root = str(base / "store")
    keys = []
    with rs.Store(root) as store:
        for name, run in runs.items():
            for i, ctx in enumerate(run.contexts):
                keys.append(store.put(ctx, f"{name}-{i}"))
        store.flush()
    outs = {mode: str(base / f"{mode}.npz") for mode in ("bare", "libs")}
    procs = {mode: _start(mode, root, outs[mode], keys, seed=n) for n, mode in enumerate(outs, 1)}
    try:
        return {mode: _finish(proc, outs[mode]) for mode, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _expected(case: lm.Case, grads: Any, mode: str) -> tuple[str | None, Any]:
    """What a process of ``mode`` gets back: ``(type name or None for a mapping of key paths,
    {name under which the runner records it: leaf})``, in the model's leaf order."""
    typed = case.plain or (mode == "libs" and case.library_type is not None)
    if typed:
        return case.library_type or "builtins.dict", _Flat(lm.flat(grads))
    # a mapping from key path to array: the runner's key path of each entry is that of a dict key
    return None, _Flat({_keystr((jax.tree_util.DictKey(p),)): v for p, v in lm.flat(grads).items()})


def test_the_processes_imported_neither_the_model_nor_more_than_asked(stored):
    assert stored["bare"]["imported"] == []
    assert stored["libs"]["imported"] == ["equinox", "flax"]


@pytest.mark.parametrize("mode", ["bare", "libs"])
@pytest.mark.parametrize("name", CASES)
def test_a_process_without_the_model_gets_jax_grads_gradients(runs, stored, name, mode):
    report, run = stored[mode], runs[name]
    worst = 0.0
    for i in range(N_MICROBATCHES):
        key = f"{name}-{i}"
        want = run.expected[i][2]
        type_name, want_flat = _expected(run.case, want, mode)
        got = report["results"][key]
        if type_name is None:  # the leaves keep the model's order (assert_close_by_path checks it)
            assert got["type"] == "collections.OrderedDict", got
            _report(name, f"{mode}_structure", "dict-of-keypaths")
        else:
            assert got["type"] == type_name, got
            assert got["treedef"] == str(jax.tree.structure(want)), got  # int keys stay ints, ...
            _report(name, f"{mode}_structure", ("original-" if run.case.plain else "") + type_name.rsplit(".", 1)[-1])
        got_flat = _Flat({k[len(key):]: v for k, v in report["arrays"].items() if k.startswith(key + "[") or k.startswith(key + ".")})
        worst = max(worst, assert_close_by_path(got_flat, want_flat, f"{mode} {key}"))
    _report(name, f"{mode}_rel_err", worst)


def test_like_rebuilds_on_templates_made_by_the_libraries(runs, stored):
    report = stored["libs"]
    for name, type_name in (("eqx_gru", "equinox.nn._rnn.GRUCell"), ("nnx_functional", "flax.nnx.statelib.State")):
        got = report["results"][f"like:{name}-0"]
        assert got["type"] == type_name, got
        want = runs[name].expected[0][2]
        assert got["treedef"] == str(jax.tree.structure(want))
        key = f"like:{name}-0"
        got_flat = _Flat({k[len(key):]: v for k, v in report["arrays"].items() if k.startswith(key)})
        assert_close_by_path(got_flat, _Flat(lm.flat(want)), key)


@pytest.mark.parametrize("check", ["bad_like_plain", "bad_like_gru"])
def test_a_stored_backward_refuses_like_with_one_path_different(stored, check):
    mode = "libs" if check == "bad_like_gru" else "bare"
    found = stored[mode]["checks"][check]
    assert found["message"] != "accepted"
    assert found["path"] in found["message"] and found["path"] + "[0]" in found["message"], found
