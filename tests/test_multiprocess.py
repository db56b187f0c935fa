"""A store shared by the processes of a JAX multi-controller job (``jax.process_count() > 1``).

Two processes with two CPU devices each (``jax.distributed`` on loopback) run the forwards of
two microbatches of a tiny model on a batch sharded over a four-device ``"data"`` mesh, put the
contexts (each process writes its own shards, process 0 commits) and exit; a second pair of
processes, which never defines the model, gets the contexts (each reads only its own shards) and
runs ``rs.backward``. The gradients match ``jax.grad`` here, and this one process loads a
context whole.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

import residual_store as rs

pytestmark = [pytest.mark.subprocess, pytest.mark.multiprocess]

TIMEOUT_S = 60

WORKER = textwrap.dedent(
    """
    import json, sys
    phase, pid, port, root, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
        initialization_timeout=30,
    )
    import numpy as np
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jax.experimental import multihost_utils
    import residual_store as rs
    from residual_store.store import collective
    collective.TIMEOUT_S = 30.0

    assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.device_count())
    mesh = Mesh(np.array(jax.devices()), ("data",))
    data, repl = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    def global_array(a, sharding):
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    def gather(x):
        return np.asarray(multihost_utils.process_allgather(x, tiled=True)).tolist()

    result = {}
    with rs.Store(root) as store:
        if phase == "forward":
            sys.path.insert(0, sys.argv[6])
            from test_multiprocess import batches, init_params, loss
            params = jax.tree.map(lambda a: global_array(a, repl), init_params())
            fwd = rs.split(loss)
            for i, (x, y) in enumerate(batches()):
                out, ctx = fwd(params, global_array(x, data), global_array(y, data))
                assert ctx.residuals[-1].sharding.num_devices == 4
                store.put(ctx, f"mb{i}")
                result[f"loss{i}"] = float(out.addressable_shards[0].data)
            store.flush()
            import hashlib
            digest = np.frombuffer(hashlib.sha256(ctx.spec.signature.encode()).digest()[:8], np.uint32)
            result["signatures_equal"] = bool(
                (np.asarray(multihost_utils.process_allgather(digest)) == digest).all()
            )
            result["sharded"] = sum(
                1 for r in ctx.residuals if isinstance(r.sharding, NamedSharding) and not r.is_fully_addressable
                and not r.sharding.is_fully_replicated
            )
        elif phase == "crash":  # process 1 dies while its put is being written
            sys.path.insert(0, sys.argv[6])
            from test_multiprocess import batches, init_params, loss
            collective.TIMEOUT_S = 5.0
            params = jax.tree.map(lambda a: global_array(a, repl), init_params())
            x, y = batches()[0]
            _, ctx = rs.split(loss)(params, global_array(x, data), global_array(y, data))
            jax.block_until_ready(ctx)
            if pid == 1:  # dies right after writing its shards, before the commit
                import os
                backend = store._disk.backend
                write = backend.write_arrays

                def write_then_die(*args, **kwargs):
                    write(*args, **kwargs)
                    os._exit(3)

                backend.write_arrays = write_then_die
            store.put(ctx, "crashed")
            try:
                store.flush()
                result["error"] = None
            except rs.ResidualStoreError as err:
                result["error"] = str(err)
            with open(out_path, "w") as f:
                json.dump(result, f)
            import os
            os._exit(0)  # the job has lost a process: no collective shutdown
        else:  # backward, in processes that never define the model
            grads = None
            for i in range(2):
                ctx = store.get(f"mb{i}")
                own = [r for r in ctx.residuals if not r.is_fully_addressable and not r.sharding.is_fully_replicated]
                result.setdefault("local_shards", []).append(
                    [len(r.addressable_shards) for r in own]
                )
                g = rs.backward(ctx)
                grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            result["grads"] = jax.tree.map(gather, grads)
    multihost_utils.sync_global_devices("done")
    if pid == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    jax.distributed.shutdown()
    """
)


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w1": rng.standard_normal((3, 5)).astype(np.float32) * 0.5,
        "w2": rng.standard_normal((5, 2)).astype(np.float32) * 0.5,
    }


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [
        (
            rng.standard_normal((8, 3)).astype(np.float32),
            rng.standard_normal((8, 2)).astype(np.float32),
        )
        for _ in range(2)
    ]


def loss(params, x, y):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(
    tmp_path, phase: str, root: str, expect: tuple[int, int] = (0, 0)
) -> dict:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port, out = _free_port(), tmp_path / f"{phase}.json"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))
    }
    env["JAX_PLATFORMS"] = "cpu"
    logs = [tmp_path / f"{phase}{i}.log" for i in range(2)]
    procs = []
    try:
        for i in range(2):
            with open(
                logs[i], "w"
            ) as log:  # the child keeps its own copy of the descriptor
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(script),
                            phase,
                            str(i),
                            str(port),
                            root,
                            str(out),
                            os.path.dirname(__file__),
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:  # only the processes this test started
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join(
        f"--- process {i} ---\n{log.read_text()[-3000:]}" for i, log in enumerate(logs)
    )
    assert codes == list(expect), text
    return json.loads(out.read_text())


def test_two_processes_put_then_resume_backward(tmp_path):
    root = str(tmp_path / "store")
    fwd_result = _run_pair(tmp_path, "forward", root)
    assert fwd_result["sharded"] >= 1  # some residuals span both processes' devices
    assert fwd_result["signatures_equal"]  # same signature in both processes

    params = init_params()
    expected = None
    for i, (x, y) in enumerate(batches()):
        np.testing.assert_allclose(
            fwd_result[f"loss{i}"], loss(params, x, y), rtol=1e-5
        )
        g = jax.grad(loss)(params, x, y)
        expected = g if expected is None else jax.tree.map(jnp.add, expected, g)

    with rs.Store(root) as store:
        assert sorted(store.keys()) == ["mb0", "mb1"]
    with open(os.path.join(root, "contexts", "mb0.manifest"), "rb") as f:
        manifest = msgpack.unpackb(f.read())
    chunked = [r for r in manifest["arrays"] if r.get("chunk_shape")]
    assert chunked and all(
        len(r["chunk_checksums"]) == 4 for r in chunked
    )  # both processes' shards
    for r in chunked:  # every chunk file is there, and zarr.json
        folder = os.path.join(root, r["path"])
        assert sorted(os.listdir(folder)) == sorted(
            ["zarr.json"] + [f"c.{i}.0" for i in range(4)]
        )
    assert not [
        n for n in os.listdir(os.path.join(root, "weights")) if n.endswith(".tmp")
    ]
    assert sum(s is not None for s in manifest["spec"]["shardings"]) == len(
        manifest["arrays"]
    )

    bwd_result = _run_pair(tmp_path, "backward", root)
    for counts in bwd_result["local_shards"]:
        assert counts and all(
            c == 2 for c in counts
        )  # each process holds only its 2 devices' shards
    for name in ("w1", "w2"):
        np.testing.assert_allclose(
            np.asarray(bwd_result["grads"][name]), expected[name], rtol=1e-5, atol=1e-6
        )

    # one process (fewer devices than the mesh) loads a context whole and runs its backward
    with rs.Store(root) as store:
        ctx = store.get("mb0")
        assert all(r.is_fully_addressable for r in ctx.residuals)
        g0 = rs.backward(ctx)
    x, y = batches()[0]
    g_ref = jax.grad(loss)(params, x, y)
    for name in ("w1", "w2"):
        np.testing.assert_allclose(
            np.asarray(g0[name]), g_ref[name], rtol=1e-5, atol=1e-6
        )


def test_a_process_dying_mid_put_commits_nothing(tmp_path):
    root = str(tmp_path / "store")
    result = _run_pair(tmp_path, "crash", root, expect=(0, 3))
    assert result["error"] is not None and "did not reach" in result["error"], result
    with rs.Store(root) as store:
        assert "crashed" not in store
        assert store.keys() == []
    # process 0 removed what the failed write left (the shared weights' temporary folders too)
    assert os.listdir(os.path.join(root, "data")) == []
    assert [
        n for n in os.listdir(os.path.join(root, "weights")) if n.endswith(".tmp")
    ] == []
