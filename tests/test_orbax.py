"""Contexts as an item of an Orbax checkpoint step (``residual_store.orbax``): saved with the train
state by one ``CheckpointManager.save``, asynchronously, from host copies taken before ``save``
returns; restored as a read-only store that a process without the model runs backwards from;
removed with their step by ``max_to_keep``; damage found as in any store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import residual_store as rs
from libraries import BATCH, IN, OUT, flat, make_nnx, make_plain
from residual_store import orbax as rso
from store_helpers import ended_at_exit, mixed_inputs, mixed_loss, read_manifest, run_python, write_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PLAIN_LOSS, PLAIN_PARAMS = make_plain()
NNX_LOSS, NNX_PARAMS = make_nnx()
MODELS = {"plain": (rs.split(PLAIN_LOSS), PLAIN_LOSS, PLAIN_PARAMS), "nnx": (rs.split(NNX_LOSS), NNX_LOSS, NNX_PARAMS)}
FWD, LOSS, PARAMS = MODELS["plain"]
MIXED = rs.split(mixed_loss)  # residuals of many dtypes, typed PRNG keys among them


def _batches(rng: jax.Array, n: int) -> list[tuple[jax.Array, jax.Array]]:
    """``n`` fresh microbatches ``(x, y)``."""
    keys = jax.random.split(rng, 2 * n)
    return [(jax.random.normal(keys[2 * i], (BATCH, IN)), jax.random.normal(keys[2 * i + 1], (BATCH, OUT))) for i in range(n)]


def _contexts(rng: jax.Array, n: int = 2, fwd=FWD, params=PARAMS) -> dict[str, rs.ResidualContext]:
    return {f"mb{i}": fwd(params, x, y)[1] for i, (x, y) in enumerate(_batches(rng, n))}


def _manager(directory, **options) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(**options))


def _save(mngr: ocp.CheckpointManager, step: int, contexts, state=None) -> None:
    state = PARAMS if state is None else state
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), contexts=rso.ContextsSave(contexts)))


def _restore(mngr: ocp.CheckpointManager, step: int) -> rs.Store:
    return mngr.restore(step, args=ocp.args.Composite(contexts=rso.ContextsRestore())).contexts


def _bitwise(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _pythonpath() -> str:
    """A ``PYTHONPATH`` under which subprocesses import this checkout's package."""
    return os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


def _weight_bytes(contexts: dict[str, rs.ResidualContext]) -> int:
    """Bytes of the distinct weights the contexts hold."""
    weights = {id(x): x for ctx in contexts.values() for x, k in zip(ctx.residuals, ctx.spec.kinds) if k == "weight"}
    return sum(x.nbytes for x in weights.values())


def _python(folder, source: str, *args: str, seed: str = "0") -> subprocess.CompletedProcess[str]:
    """Runs ``source`` in a new process that imports this checkout's package, under the hash
    seed ``seed``; fails the test on error."""
    script = write_script(folder, "script.py", source)
    return run_python(script, *args, env={"PYTHONPATH": _pythonpath(), "PYTHONHASHSEED": seed})


# -- a new process without the model ----------------------------------------------------------

READER = """
    import collections, json, sys
    import jax, numpy as np, orbax.checkpoint as ocp
    import residual_store as rs
    from residual_store import orbax as rso

    directory, step, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(directory, options=options) as mngr:
        store = mngr.restore(step, args=ocp.args.Composite(contexts=rso.ContextsRestore())).contexts
    grads = {}
    with store:
        keys = store.keys()
        for key in keys:
            g = rs.backward(store.get(key))
            if isinstance(g, collections.OrderedDict):  # a type not registered here: key paths
                pairs = g.items()
            else:
                pairs = ((jax.tree_util.keystr(p), v) for p, v in jax.tree_util.tree_flatten_with_path(g)[0])
            grads.update({key + path: np.asarray(v) for path, v in pairs})
    np.savez(out, **{str(i): v for i, v in enumerate(grads.values())})
    modules = sorted(m for m in ("flax", "libraries", "test_orbax") if m in sys.modules)
    print(json.dumps({"keys": keys, "paths": list(grads), "modules": modules}))
"""


def _backwards_in_a_new_process(tmp_path, step: int, seed: str) -> tuple[list[str], dict[str, np.ndarray]]:
    """The keys of the contexts item of ``step`` of the checkpoint ``tmp_path/ckpt`` and their
    gradients (``key + key path`` -> array), as a new process without the model gets them."""
    out = tmp_path / "grads.npz"
    proc = _python(tmp_path, READER, str(tmp_path / "ckpt"), str(step), str(out), seed=seed)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["modules"] == [], report  # neither the model's library nor these tests
    arrays = np.load(out)
    return report["keys"], {path: arrays[str(i)] for i, path in enumerate(report["paths"])}


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("model", list(MODELS))
def test_contexts_saved_with_the_state_run_backward_in_a_process_without_the_model(model, tmp_path, rng):
    fwd, loss, params = MODELS[model]
    batches = _batches(rng, 2)
    contexts = {f"mb{i}": fwd(params, x, y)[1] for i, (x, y) in enumerate(batches)}
    with _manager(tmp_path / "ckpt") as mngr:
        _save(mngr, 3, contexts, state=params)
        mngr.wait_until_finished()
        restored = mngr.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(params)))
    _bitwise(restored.state, params)

    keys, got = _backwards_in_a_new_process(tmp_path, 3, seed="23")
    assert keys == sorted(contexts)
    for key, (x, y) in zip(contexts, batches):
        live = flat(fwd.backward(contexts[key]))  # the same program: bitwise
        want = flat(jax.grad(loss)(params, x, y))
        assert [p[len(key):] for p in got if p.startswith(key)] == list(want)
        for path, g in want.items():
            np.testing.assert_array_equal(got[key + path], np.asarray(live[path]))
            np.testing.assert_allclose(got[key + path], g, rtol=1e-5, atol=1e-5)


# -- steps ------------------------------------------------------------------------------------


def test_max_to_keep_removes_old_steps_with_their_contexts(tmp_path, rng):
    contexts = _contexts(rng, 1)
    with _manager(tmp_path, max_to_keep=2) as mngr:
        for step in range(3):
            _save(mngr, step, contexts)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
        with _restore(mngr, 2) as store:
            assert store.keys() == ["mb0"]
            _bitwise(rs.backward(store.get("mb0")), FWD.backward(contexts["mb0"]))
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]


def _flip_a_byte(item: str, key: str) -> None:
    """Flips one byte of ``key``'s first own residual, inside its bundle file."""
    manifest = read_manifest(item, key)
    offset = next(r["offset"] for r in manifest["arrays"] if "offset" in r)
    with open(os.path.join(item, manifest["bundle"]["path"]), "r+b") as f:
        f.seek(offset + 1)
        byte = f.read(1)
        f.seek(offset + 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_damaged_context_in_a_checkpoint_is_refused_and_the_others_load(tmp_path, rng, capsys):
    from residual_store import cli

    contexts = _contexts(rng, 2)
    with _manager(tmp_path) as mngr:
        _save(mngr, 0, contexts)
        mngr.wait_until_finished()
    item = str(tmp_path / "0" / "contexts")
    assert cli.main(["verify", item]) == 0
    _flip_a_byte(item, "mb0")
    assert cli.main(["verify", item]) == 1
    assert "mb0" in capsys.readouterr().out
    with _manager(tmp_path, read_only=True) as mngr, _restore(mngr, 0) as store:
        with pytest.raises(rs.CorruptContextError, match="mb0"):
            store.get("mb0")
        _bitwise(rs.backward(store.get("mb1")), FWD.backward(contexts["mb1"]))
        with pytest.raises(rs.ReadOnlyStoreError):
            store.delete("mb1")


# -- the asynchronous save --------------------------------------------------------------------


@pytest.mark.parametrize("dtypes", ["float32", pytest.param("mixed", marks=pytest.mark.slow)])
def test_the_save_returns_before_the_write_and_deleted_arrays_do_not_break_it(tmp_path, rng, monkeypatch, dtypes):
    params = jax.tree.map(lambda p: p + 0, PARAMS)  # arrays of this test's own, deleted below
    contexts = _contexts(rng, 2, params=params)
    if dtypes == "mixed":  # bfloat16, float16, int32, bool, typed keys (copied where they are)
        contexts["mixed"] = MIXED(*mixed_inputs(rng))[1]
    want = {key: rs.backward(ctx) for key, ctx in contexts.items()}
    gate, written = threading.Event(), threading.Event()
    write = rso._write

    def gated_write(path, snapshot):
        assert gate.wait(60), "the test never opened the gate"
        write(path, snapshot)
        written.set()

    monkeypatch.setattr(rso, "_write", gated_write)
    with _manager(tmp_path) as mngr:
        try:
            _save(mngr, 0, contexts, state=params)
            assert not written.is_set()  # save returned; the contexts' write waits for the gate
            for array in {id(x): x for ctx in contexts.values() for x in ctx.residuals}.values():
                array.delete()  # the contexts' own arrays and the weights they hold
            for p in jax.tree.leaves(params):
                p.delete()
            assert "0" not in os.listdir(tmp_path)  # not committed while an item is being written
        finally:
            gate.set()
        mngr.wait_until_finished()
        assert written.is_set() and mngr.all_steps() == [0]
        with _restore(mngr, 0) as store:
            for key, grads in want.items():
                _bitwise(rs.backward(store.get(key)), grads)


def test_a_failed_write_commits_no_step(tmp_path, rng, monkeypatch):
    contexts = _contexts(rng, 1)
    with _manager(tmp_path) as mngr:
        _save(mngr, 0, contexts)
        mngr.wait_until_finished()

        def full(path, snapshot):
            raise rs.StoreFullError("no space left on the device")

        monkeypatch.setattr(rso, "_write", full)
        _save(mngr, 1, contexts)
        with pytest.raises(rs.StoreFullError):
            mngr.wait_until_finished()
        assert mngr.all_steps() == [0] and "1" not in os.listdir(tmp_path)


def test_a_context_whose_arrays_were_deleted_is_refused(tmp_path, rng):
    contexts = _contexts(rng, 2)
    contexts["mb1"].residuals[-1].delete()
    with pytest.raises(rs.InvalidArgumentError, match="was deleted"):
        rso.ContextsSave(contexts)
    args = rso.ContextsSave({"mb0": contexts["mb0"]})
    contexts["mb0"].residuals[-1].delete()  # after the check, before the save: the step fails
    with _manager(tmp_path) as mngr:
        mngr.save(0, args=ocp.args.Composite(contexts=args))
        with pytest.raises(rs.InvalidArgumentError, match="was deleted"):
            mngr.wait_until_finished()
        assert mngr.all_steps() == []
        _save(mngr, 1, _contexts(rng, 1))  # the manager saves on
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1]


def test_a_synchronous_checkpointer_writes_the_item_as_a_store(tmp_path, rng):
    contexts = _contexts(rng, 1)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(tmp_path / "step", args=ocp.args.Composite(contexts=rso.ContextsSave(contexts)))
        restored = checkpointer.restore(tmp_path / "step", args=ocp.args.Composite(contexts=rso.ContextsRestore()))
    with restored.contexts as store:
        _bitwise(rs.backward(store.get("mb0")), FWD.backward(contexts["mb0"]))
    with rs.Store(tmp_path / "step" / "contexts", read_only=True) as store:
        assert store.keys() == ["mb0"]


def test_a_checkpointer_of_the_item_alone_is_refused(tmp_path, rng):
    """Orbax writes its step metadata into a lone item's folder, which a store does not share."""
    with ocp.Checkpointer(rso.ContextsHandler()) as checkpointer:
        with pytest.raises(rs.InvalidArgumentError, match="holds files but no residual store"):
            checkpointer.save(tmp_path / "item", args=rso.ContextsSave(_contexts(rng, 1)))
    assert not (tmp_path / "item").exists()


# -- what is saved ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", [None, "source"])
def test_a_store_is_saved_with_every_key_as_it_was_at_save(tmp_path, rng, path):
    contexts = _contexts(rng, 3)
    want = {key: FWD.backward(ctx) for key, ctx in contexts.items()}
    source = rs.Store(path and tmp_path / path, device_budget=0 if path else None)
    with source:
        for key, ctx in contexts.items():
            source.put(ctx, key)
        with _manager(tmp_path / "ckpt") as mngr:
            _save(mngr, 0, source)
            source.delete("mb0")  # after save returned: the step keeps it
            source.put(contexts["mb1"], "mb9")
            mngr.wait_until_finished()
            with _restore(mngr, 0) as store:
                assert store.keys() == sorted(contexts)
                for key, grads in want.items():
                    _bitwise(rs.backward(store.get(key)), grads)
                disk = store.stats()["disk"]
    assert disk["bytes"] - disk["own_bytes"] == _weight_bytes(contexts)  # once in the item


CHECKPOINTER = """
    import sys
    import orbax.checkpoint as ocp, residual_store as rs
    from residual_store import orbax as rso
    with rs.Store(sys.argv[1], read_only=True) as store, ocp.CheckpointManager(sys.argv[2]) as mngr:
        mngr.save(0, args=ocp.args.Composite(contexts=rso.ContextsSave(store)))
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_process_without_the_model_checkpoints_a_store_that_another_runs_backward_from(tmp_path, rng):
    """The item's backward is exported again from the one the source store keeps."""
    contexts = _contexts(rng, 2)
    with rs.Store(tmp_path / "source") as source:
        for key, ctx in contexts.items():
            source.put(ctx, key)
    _python(tmp_path, CHECKPOINTER, str(tmp_path / "source"), str(tmp_path / "ckpt"), seed="5")
    keys, got = _backwards_in_a_new_process(tmp_path, 0, seed="7")
    assert keys == sorted(contexts)
    for key, ctx in contexts.items():
        for path, g in flat(FWD.backward(ctx)).items():
            np.testing.assert_array_equal(got[key + path], np.asarray(g))


def test_weights_the_contexts_share_are_stored_once_in_the_item(tmp_path, rng):
    contexts = _contexts(rng, 4)
    with _manager(tmp_path) as mngr:
        _save(mngr, 0, contexts)
        mngr.wait_until_finished()
        with _restore(mngr, 0) as store:
            disk = store.stats()["disk"]
    assert disk["contexts"] == 4
    assert disk["bytes"] - disk["own_bytes"] == _weight_bytes(contexts) > 0  # once, not once per context


BAD = {
    "not a mapping": ([1, 2], rs.InvalidArgumentError),
    "not a context": ({"mb0": "ctx"}, rs.InvalidArgumentError),
    "a bad key": ({"../mb0": None}, rs.InvalidKeyError),
    "a key not a str": ({0: None}, rs.InvalidKeyError),
}


@pytest.mark.parametrize("case", list(BAD))
def test_what_cannot_be_saved_is_refused_before_anything_is_written(tmp_path, rng, case):
    contexts, error = BAD[case]
    ctx = FWD(PARAMS, *_batches(rng, 1)[0])[1]
    contexts = contexts if not isinstance(contexts, dict) else {k: ctx if v is None else v for k, v in contexts.items()}
    with _manager(tmp_path / "ckpt") as mngr:
        with pytest.raises(error):
            _save(mngr, 0, contexts)
        mngr.wait_until_finished()
        assert mngr.all_steps() == []
    assert os.listdir(tmp_path / "ckpt") == []


# -- importing --------------------------------------------------------------------------------


@pytest.mark.subprocess
def test_residual_store_never_imports_orbax_and_without_orbax_names_the_extra(tmp_path):
    source = """
        import sys
        import residual_store
        assert "orbax" not in sys.modules, "import residual_store imported orbax"

        class NoOrbax:  # a process where orbax-checkpoint is not installed
            def find_spec(self, name, path=None, target=None):
                if name == "orbax" or name.startswith("orbax."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NoOrbax())
        try:
            import residual_store.orbax
        except ImportError as err:
            print(err)
        else:
            raise AssertionError("residual_store.orbax imported without orbax")
    """
    assert "pip install 'residual-store[orbax]'" in _python(tmp_path, source).stdout


# -- a job of several processes ---------------------------------------------------------------

JOB_WORKER = """
    import faulthandler, sys
    faulthandler.dump_traceback_later(80)  # still running then: every thread's stack in the log
    pid, port, directory, tests = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=30,
    )
    import numpy as np, orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import residual_store as rs
    from residual_store import orbax as rso
    sys.path.insert(0, tests)
    from test_multiprocess import batches, init_params, loss

    mesh = Mesh(np.array(jax.devices()), ("data",))
    data = NamedSharding(mesh, P("data"))

    def global_array(a, sharding):
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    # w2 sharded over both processes' devices, w1 replicated; the batch split over all four
    p = init_params()
    params = {"w1": global_array(p["w1"], NamedSharding(mesh, P())),
              "w2": global_array(p["w2"], NamedSharding(mesh, P("data", None)))}
    fwd = rs.split(loss)
    contexts = {f"mb{i}": fwd(params, global_array(x, data), global_array(y, data))[1]
                for i, (x, y) in enumerate(batches())}
    with ocp.CheckpointManager(directory) as mngr:
        mngr.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(params),
                                             contexts=rso.ContextsSave(contexts)))
        mngr.wait_until_finished()
    print("saved", flush=True)
"""


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.multiprocess
def test_two_processes_save_sharded_contexts_in_one_step(tmp_path):
    """Every process of a ``jax.distributed`` job saves the same contexts (its shards); the step's
    item is one store that a single process reads whole and runs backward from."""
    from test_multiprocess import TIMEOUT_S, _free_port, _worker_env, batches, init_params, loss

    script, port = write_script(tmp_path, "worker.py", JOB_WORKER), _free_port()
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    procs = []
    with ended_at_exit(procs):
        for i, log in enumerate(logs):
            with open(log, "w") as out:  # the child keeps its own copy of the descriptor
                args = [sys.executable, script, str(i), str(port), str(tmp_path / "ckpt"), os.path.dirname(__file__)]
                procs.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=_worker_env(PYTHONPATH=_pythonpath())))
        codes = [p.wait(timeout=2 * TIMEOUT_S) for p in procs]
    assert codes == [0, 0], "\n".join(f"--- process {i} ---\n{log.read_text()[-6000:]}" for i, log in enumerate(logs))

    chunked = [r for r in read_manifest(tmp_path / "ckpt" / "5" / "contexts", "mb0")["arrays"] if r.get("chunk_shape")]
    assert chunked and all(len(r["chunk_checksums"]) == 4 for r in chunked)  # both processes' shards
    params = init_params()
    with _manager(tmp_path / "ckpt", read_only=True) as mngr, _restore(mngr, 5) as store:
        assert store.keys() == ["mb0", "mb1"]
        for key, (x, y) in zip(store.keys(), batches()):
            grads, want = rs.backward(store.get(key)), jax.grad(loss)(params, x, y)
            for name in ("w1", "w2"):
                np.testing.assert_allclose(np.asarray(grads[name]), want[name], rtol=1e-5, atol=1e-6)


def test_item_folders_on_object_stores_open_as_kvstore_specs():
    from etils import epath

    assert rso._store_path(epath.Path("s3://bucket/run/3/contexts")) == {
        "driver": "s3", "bucket": "bucket", "path": "run/3/contexts/",
    }
    assert rso._store_path(epath.Path("/ckpt/3/contexts")) == "/ckpt/3/contexts"
    with pytest.raises(rs.InvalidArgumentError, match="hdfs://"):
        rso._store_path("hdfs://cluster/ckpt/3/contexts")


def test_a_process_that_imported_the_module_restores_the_item_without_arguments(tmp_path, rng):
    contexts = _contexts(rng, 1)
    with _manager(tmp_path) as mngr:
        _save(mngr, 0, contexts)
    with _manager(tmp_path, read_only=True) as mngr, mngr.restore(0).contexts as store:
        _bitwise(rs.backward(store.get("mb0")), FWD.backward(contexts["mb0"]))
