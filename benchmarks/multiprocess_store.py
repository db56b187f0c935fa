"""Collective ``rs.Store`` writes and reads: 2 processes x 2 CPU devices against 1 process x 4.

Run: ``python benchmarks/multiprocess_store.py [--mib 256] [--arrays 2] [--repeats 4] [--alternations 3]
[--dir DIR] [--kvstore]``; ``--kvstore`` opens the folder as ``{"driver": "file", "path": ...,
"file_io_sync": true}``, through tensorstore's kvstore API, the code path of ``gcs`` and ``s3``.

The context is a real ``rs.ResidualContext``: ``rs.split`` of ``sum(sin(x_k))`` over ``--arrays``
float32 arrays of ``--mib`` MiB in all, each sharded over four devices on a ``"data"`` mesh axis,
so it holds that many sharded intermediates (``cos(x_k)``) of exactly those bytes.

- 2 processes: ``jax.distributed`` on loopback, two CPU devices each; every process puts and gets
  the same keys (each writes and reads only its own devices' shards, process 0 commits).
- 1 process: ``jax_num_cpu_devices=4``, the same mesh shape, the same bytes.

Each configuration runs in fresh subprocesses, ``--alternations`` times, alternating with the
other (the machine's drift hits both alike). Each launch: one untimed warm-up round, then
``--repeats`` timed rounds of: ``os.sync()``, ``put`` + ``flush`` in a ``Store(durable=True)``;
``os.sync()``, ``put`` + ``flush`` in a ``Store(durable=False)``; ``get`` in a fresh ``Store`` on the
folder until the context is a ready pytree (warm: the bytes were just written, so they are in
the page cache; dropping caches needs root); then every process deletes the round's contexts. In
the 2-process runs every timed step starts and ends at a barrier of the coordination service (no
devices), and the time is process 0's (the one that commits). Numbers are medians; ratios are 2-process / 1-process throughput (> 1: the two
processes are faster), of the medians and, as a check on this machine's bimodal times (page
allocation), of the fastest rounds. Note the machine's CPU count: 2 processes x 2 devices on 2 cores share them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

STEPS = ("put durable", "put no-fsync", "get (warm)")


def _worker(
    mode: str, pid: int, port: int, folder: str, out: str, mib: int, n_arrays: int, repeats: int, kvstore: bool
) -> None:
    import jax

    # --kvstore: the same folder through tensorstore's kvstore API, the code path of gcs and s3
    root = {"driver": "file", "path": folder, "file_io_sync": True} if kvstore else folder

    multi = mode == "multi"
    jax.config.update("jax_num_cpu_devices", 2 if multi else 4)
    if multi:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60
        )
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import residual_store as rs
    from residual_store._src import _jax_internals

    assert jax.device_count() == 4, jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    data = NamedSharding(mesh, P("data"))
    cols = 1024
    rows = mib * (1 << 20) // 4 // cols // n_arrays
    rows -= rows % 4

    def shard(k: int):
        def make(idx):
            start = idx[0].start or 0
            rng = np.random.default_rng(1000 * k + start)
            return rng.random((rows // 4, cols), dtype=np.float32)

        return make

    xs = [jax.make_array_from_callback((rows, cols), data, shard(k)) for k in range(n_arrays)]
    fwd = rs.split(lambda xs: sum(jnp.sum(jnp.sin(x)) for x in xs))  # differentiates its 1st argument
    _, ctx = fwd(xs)
    jax.block_until_ready(ctx)
    nbytes = sum(int(r.nbytes) for r in ctx.residuals)
    assert list(ctx.spec.kinds) == ["intermediate"] * n_arrays, ctx.spec.kinds
    assert all(len(r.sharding.device_set) == 4 for r in ctx.residuals)

    client = _jax_internals.distributed_client() if multi else None
    barriers = iter(range(1 << 30))

    def barrier() -> None:
        if client is not None:
            client.wait_at_barrier(f"bench/{next(barriers)}", 120_000)

    def timed(fn) -> float:
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        return time.perf_counter() - t0

    def put(key: str, durable: bool) -> None:
        with rs.Store(root, durable=durable) as store:
            store.put(ctx, key)
            store.flush()

    def get(key: str) -> None:
        with rs.Store(root) as store:
            jax.block_until_ready(store.get(key).residuals)

    times: dict[str, list[float]] = {s: [] for s in STEPS}
    for r in range(repeats + 1):  # round 0: warm-up
        os.sync()
        t_d = timed(lambda k=f"d{r}": put(k, True))
        os.sync()
        t_n = timed(lambda k=f"n{r}": put(k, False))
        t_g = timed(lambda k=f"n{r}": get(k))
        if r < repeats:  # keep the footprint small (the last round stays, for the check below);
            # every process deletes: a delete is collective, like a put
            with rs.Store(root) as store:
                store.delete(f"d{r}")
                store.delete(f"n{r}")
        barrier()
        if r:
            for s, t in zip(STEPS, (t_d, t_n, t_g)):
                times[s].append(t)
    if multi:
        barrier()
    if pid == 0:  # the last round's two contexts were written, whole
        on_disk = sum(
            os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(os.path.join(folder, "data")) for n in names
        )
        with rs.Store(root) as store:
            assert sorted(store.keys()) == [f"d{repeats}", f"n{repeats}"], store.keys()
        assert on_disk >= 2 * nbytes, (on_disk, nbytes)
        with open(out, "w") as f:
            json.dump({"nbytes": nbytes, "times": times, "shape": [rows, cols], "arrays": n_arrays}, f)
    if multi:
        barrier()
        jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, folder: str, args: argparse.Namespace) -> dict:
    root = os.path.join(folder, f"store-{mode}")
    out = os.path.join(folder, f"{mode}.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAX_"))}
    env["JAX_PLATFORMS"] = "cpu"
    port = _free_port()
    n = 2 if mode == "multi" else 1
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", mode, str(i), str(port), root, out,
             str(args.mib), str(args.arrays), str(args.repeats), str(int(args.kvstore))],
            env=env,
        )
        for i in range(n)
    ]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0] * n:
        raise SystemExit(f"{mode} workers exited with {codes}")
    with open(out) as f:
        result = json.load(f)
    shutil.rmtree(root, ignore_errors=True)
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, pid, port, root, out, mib, n_arrays, repeats, kvstore = sys.argv[2:11]
        _worker(mode, int(pid), int(port), root, out, int(mib), int(n_arrays), int(repeats), kvstore == "1")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--arrays", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4, help="timed rounds per launch")
    parser.add_argument("--alternations", type=int, default=3, help="launches of each configuration")
    parser.add_argument("--dir", default=None, help="folder for the stores (default: a temporary one)")
    parser.add_argument(
        "--kvstore", action="store_true", help="open the folder as a tensorstore file kvstore spec (the gcs/s3 path)"
    )
    args = parser.parse_args()
    start = time.perf_counter()
    folder = tempfile.mkdtemp(prefix="mp-store-bench-", dir=args.dir)
    try:  # the configurations alternate, so drift of the machine hits both alike
        runs: dict[str, list[dict]] = {"single": [], "multi": []}
        for _ in range(args.alternations):
            for mode, launches in runs.items():
                launches.append(_launch(mode, folder, args))
        single, multi = (
            {**rs[0], "times": {s: [t for r in rs for t in r["times"][s]] for s in STEPS}}
            for rs in runs.values()
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    nbytes = single["nbytes"]
    assert multi["nbytes"] == nbytes
    print(
        f"context: {single['arrays']} sharded float32 intermediates {tuple(single['shape'])}, "
        f"{nbytes / (1 << 20):.0f} MiB; {args.alternations} x {args.repeats} timed rounds, medians; "
        f"{os.cpu_count()} CPUs; store: {'tensorstore file kvstore spec' if args.kvstore else 'local folder'}"
    )
    header = f"{'step':<14}{'1 proc x 4 dev':>22}{'2 proc x 2 dev':>22}{'2p/1p GB/s':>12}{'(of min)':>10}"
    print(header)
    print("-" * len(header))
    verdicts = {}
    for step in STEPS:
        t1 = statistics.median(single["times"][step])
        t2 = statistics.median(multi["times"][step])
        g1, g2 = nbytes / t1 / 1e9, nbytes / t2 / 1e9
        verdicts[step] = g2 / g1
        print(
            f"{step:<14}{t1 * 1e3:>10.0f} ms {g1:>6.2f} GB/s{t2 * 1e3:>10.0f} ms {g2:>6.2f} GB/s"
            f"{g2 / g1:>11.2f}x{min(single['times'][step]) / min(multi['times'][step]):>9.2f}x"
        )
    print("spread (ms, min..max of the timed rounds):")
    for step in STEPS:
        spread = [f"{min(r['times'][step]) * 1e3:.0f}..{max(r['times'][step]) * 1e3:.0f}" for r in (single, multi)]
        print(f"  {step:<14} 1 proc {spread[0]:>12}   2 proc {spread[1]:>12}")
    for step in STEPS:
        r = verdicts[step]
        word = "scales (faster with two processes)" if r >= 1.1 else (
            "on par" if r >= 0.9 else "slower with two processes")
        print(f"{step}: {word} ({r:.2f}x)")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
