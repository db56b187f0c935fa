"""A data-parallel job of two processes puts its contexts in one store; a new pair resumes them.

What it shows: two processes of a JAX multi-controller job (``jax.distributed`` on loopback,
two CPU devices each, so a four-device ``"data"`` mesh) run the forwards of an MLP on a batch
sharded over the mesh, with replicated weights, and ``put`` every context in one ``rs.Store``
folder: each process writes only its own devices' shards, process 0 commits. Then both exit, as
after a preemption. A new pair of processes, which never defines the model, opens the folder,
``get``s the contexts in reverse (each process reads only its own shards), runs ``rs.backward``
through the backward the store saved with ``jax.export``, and sums the gradients. The parent
compares them with ``jax.grad`` of the whole batch in one process, and also loads one context
whole in this single process (fewer devices than the mesh) and runs its backward.

Why: the jobs that need residual offload most train across hosts; their residuals are global
arrays no single process holds, and a restarted job must resume the pending backwards.

Run: ``python examples/data_parallel_two_processes.py`` (``--small`` for the tiny sizes the
tests use, ``--store DIR`` to keep the folder and look at it with ``residual-store inspect DIR
mb0``). See docs/store.md, "Multi-process jobs".
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

RTOL = 1e-5  # max |resumed - jax.grad| / max |jax.grad|, per leaf (float32)
N_PROCESSES, DEVICES_PER_PROCESS = 2, 2


def sizes(small: bool) -> dict[str, int]:
    if small:
        return {"batch": 16, "d_in": 32, "d_hidden": 64, "microbatches": 3}
    return {"batch": 256, "d_in": 512, "d_hidden": 1024, "microbatches": 8}


def make_inputs(s: dict[str, int]):
    """Weights and microbatches as NumPy arrays, the same in every process and the parent."""
    import numpy as np

    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.standard_normal((s["d_in"], s["d_hidden"])) / np.sqrt(s["d_in"])).astype(np.float32),
        "w2": (rng.standard_normal((s["d_hidden"], 1)) / np.sqrt(s["d_hidden"])).astype(np.float32),
    }
    xs = rng.standard_normal((s["microbatches"], s["batch"], s["d_in"])).astype(np.float32)
    ys = rng.standard_normal((s["microbatches"], s["batch"], 1)).astype(np.float32)
    return params, xs, ys


def loss(params, x, y):
    import jax.numpy as jnp

    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def worker(phase: str, pid: int, port: int, store_path: str, out: str, small: bool) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=N_PROCESSES, process_id=pid)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import residual_store as rs

    mesh = Mesh(np.array(jax.devices()), ("data",))
    data, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    def global_array(a, sharding):  # each process supplies the blocks of its own devices
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    s = sizes(small)
    result: dict = {}
    with rs.Store(store_path) as store:
        if phase == "forward":
            params, xs, ys = make_inputs(s)
            params = {k: global_array(v, replicated) for k, v in params.items()}
            fwd = rs.split(loss)
            for i in range(s["microbatches"]):
                value, ctx = fwd(params, global_array(xs[i], data), global_array(ys[i], data))
                store.put(ctx, f"mb{i}")  # every process, same key, same order
                if pid == 0:
                    print(f"  forward mb{i}: loss {float(value.addressable_shards[0].data):.5f}")
            store.flush()  # every process: the contexts are committed and durable
            if pid == 0:
                print("  residuals of one context:")
                print("\n".join("    " + line for line in ctx.describe().splitlines()))
        else:  # backward: the model is not defined in this phase
            grads = None
            for i in reversed(range(s["microbatches"])):
                ctx = store.get(f"mb{i}")
                shards = [len(r.addressable_shards) for r in ctx.residuals if not r.is_fully_addressable]
                g = rs.backward(ctx)
                grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
                store.delete(f"mb{i}")  # collective too: every process, same order
                if pid == 0:
                    print(f"  backward mb{i}: this process holds {shards} shards of each global residual")
            store.flush()
            result["grads"] = {
                k: np.asarray(multihost_utils.process_allgather(v, tiled=True)).tolist() for k, v in grads.items()
            }
    if pid == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    jax.distributed.shutdown()
    # Everything is written and the store closed. XLA's CPU client with gloo collectives now and
    # then hangs in the interpreter's teardown (seen in this project's tests; cf. jax-ml/jax#19704),
    # so a worker leaves without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_pair(phase: str, store_path: str, small: bool, folder: str) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = os.path.join(folder, f"{phase}.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, __file__, "--worker", phase, "--port", str(port), "--store", store_path, "--out", out]
    procs = [
        subprocess.Popen([*cmd, "--pid", str(i)] + (["--small"] if small else []), env=env,
                         stdout=None if i == 0 else subprocess.DEVNULL)  # errors of both on stderr
        for i in range(N_PROCESSES)
    ]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if codes != [0] * N_PROCESSES:
        raise SystemExit(f"{phase} processes exited with {codes}")
    with open(out) as f:  # written by process 0
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes (the tests use them)")
    parser.add_argument("--store", default=None, help="store folder to keep (default: a temporary one)")
    parser.add_argument("--worker", choices=("forward", "backward"), help=argparse.SUPPRESS)
    parser.add_argument("--pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.pid, args.port, args.store, args.out, args.small)
        return 0

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    temporary = tempfile.TemporaryDirectory(prefix="rs-data-parallel-")  # the processes' scripts and outputs
    try:
        return _run(args, temporary.name)
    finally:
        temporary.cleanup()


def _run(args: argparse.Namespace, folder: str) -> int:
    """The parent's part, with ``folder`` for the processes' scripts, outputs and (without
    ``--store``) the store."""
    import jax
    import numpy as np

    import residual_store as rs

    store_path = args.store or os.path.join(folder, "store")
    s = sizes(args.small)
    print(f"{N_PROCESSES} processes x {DEVICES_PER_PROCESS} CPU devices, batch {s['batch']} sharded over "
          f"a 4-device 'data' mesh, {s['microbatches']} microbatches; store {store_path}")
    print("forward processes:")
    run_pair("forward", store_path, args.small, folder)

    params, xs, ys = make_inputs(s)
    with rs.Store(store_path) as store:  # this one process: fewer devices than the mesh
        keys = store.keys()
        ctx = store.get("mb0")
        whole = all(r.is_fully_addressable for r in ctx.residuals)
        g0 = rs.backward(ctx)
    ref0 = jax.grad(loss)(params, xs[0], ys[0])
    err0 = max(float(np.max(np.abs(g0[k] - ref0[k])) / np.max(np.abs(ref0[k]))) for k in ref0)
    print(f"one process: {len(keys)} contexts committed; mb0 loaded whole: {whole}; "
          f"its backward vs jax.grad: max relative difference {err0:.2e}")

    print("backward processes (the model is not defined there):")
    grads = run_pair("backward", store_path, args.small, folder)["grads"]
    expected = jax.grad(lambda p: sum(loss(p, x, y) for x, y in zip(xs, ys)))(params)
    errors = {
        k: float(np.max(np.abs(np.asarray(grads[k]) - expected[k])) / np.max(np.abs(expected[k]))) for k in expected
    }
    print("summed gradients vs jax.grad of the whole batch, max relative difference: "
          + ", ".join(f"{k} {e:.2e}" for k, e in errors.items()))
    with rs.Store(store_path) as store:
        left = store.keys()
    ok = whole and err0 <= RTOL and all(e <= RTOL for e in errors.values()) and left == []
    ok = ok and sorted(keys) == [f"mb{i}" for i in range(s["microbatches"])]
    if ok:
        print(f"OK: gradients resumed by a new pair of processes match jax.grad (rtol {RTOL}); "
              "every context was deleted after its backward")
        return 0
    print(f"FAILED: loaded whole {whole}, errors {err0:.2e} / {errors}, contexts left {left}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
