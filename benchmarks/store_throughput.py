"""How fast ``rs.Store`` moves residual contexts, against raw file I/O, ``np.save`` and Orbax.

Run: ``python benchmarks/store_throughput.py [--sizes 4,64,512] [--repeats N] [--quick]
[--no-orbax] [--dir DIR] [--part all|io|schedule]``. One process; every number is the median of
its timed runs, taken round-robin across the candidates of one table, each round starting one
candidate later (drift and neighbours on a shared machine hit them alike), after one untimed
warm-up run each. Tables report ratios measured in this one
run: absolute times on shared machines are noise, ratios are not.

Part 1, I/O. For each size (MiB), a real ``rs.ResidualContext``: ``rs.split`` of a function of
12 float32 arrays of mixed sizes (40%, 20%, 10%, ... of the total), each through ``sin``, so its
context holds 12 intermediates (``cos``) of exactly those sizes. Every writer writes the same
bytes; every reader reads them back:

- writes: ``store.put(ctx, key)`` + ``store.flush()`` with ``durable=True`` (fsync) and
  ``durable=False``, against raw ``ndarray.tofile`` one file per array (+ ``os.fsync`` of each
  file and the folder for the durable row), ``np.save``, and Orbax ``StandardCheckpointer``
  (``save`` + ``wait_until_finished``). Each writer starts after ``os.sync()``, so none pays for
  another's dirty pages. ``np.save`` makes the same system calls as raw ``tofile`` (plus a
  128-byte header), so its ratio shows the noise of the write rows: large at 512 MiB, where
  page-cache allocation by the kernel dominates unsynced writes.
- reads: ``store.get(key)`` in a fresh ``Store`` on the same path until the context is a ready
  ``jax.Array`` pytree, against raw ``readinto`` into preallocated buffers (the baseline of the
  goals), ``readinto`` into freshly allocated buffers (what any reader that returns new arrays
  also pays: page faults; noisy at hundreds of MiB, where the kernel may compact memory for
  transparent huge pages on first touch), ``np.load`` and Orbax ``restore``. Reads run twice:
  cold (``sync`` + ``echo 1 > /proc/sys/vm/drop_caches`` before every timed read of every
  reader, where this process may do that) and warm (the files are in the page cache for every
  reader, each having read them once untimed).
- host tier: ``Store(None, device_budget=0)`` ``put`` + ``get`` round trip, against
  ``jax.device_put`` of every array to host memory (``pinned_host`` where the backend has it)
  and back.
- checksums: ``serializers.checksum`` over the 12 arrays, as a fraction of the get time.

Part 2, schedule. 16 microbatches of the small transformer of ``residual_store.demo``, all
forwards then all backwards (F1..F16, B16..B1) with ``rs.split``: contexts kept in a Python
list, against every context ``put`` into a disk ``Store(path, device_budget=0, host_budget=0)``
(write-through; the contexts really leave memory) with ``store.prefetch`` one backward ahead,
then ``store.get`` and the backward; the step ends with ``store.flush()``, so the writer's work
is counted. Durable and non-durable stores; the gradients must equal the in-memory ones.

Part 3, put latency. The demo transformer's context ``put`` into a store that has not seen its
signature (a fresh ``Store`` each run: the put that also saves the backward with ``jax.export``),
against a ``put`` of the same signature again, and against the export itself. The export runs
on the writer thread, so the first ``put`` returns as fast as a later one.

Goals (from the issue): disk put >= 0.8x raw write throughput and get >= 0.8x raw read for
64 MiB and up (fsync and no-fsync separately); a 4 MiB round trip within 2x raw; at least 10x
faster than Orbax at 4 MiB; checksums under 10% of the get time; the store schedule within
1.15x of the in-memory one. Each goal prints PASS or MISS. A round trip is the sum of the
medians of put+flush and of a warm get (what it wrote is in the page cache), against raw
tofile (+fsync) + readinto, and Orbax save + warm restore.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import residual_store as rs
import serializers
from residual_store.demo import DemoConfig, init_transformer, transformer_loss

# Relative sizes of the 12 residual arrays (percent of the total): a few big ones, small ones.
_WEIGHTS = (40, 20, 10, 10, 6, 4, 3, 2, 2, 1, 1, 1)
_ROW = 256  # arrays are (n // 256, 256) float32
_DEFAULT_REPEATS = {4: 21, 64: 9, 512: 7}  # a full run takes 2-3 minutes on 2 cores
_DROP_CACHES = "/proc/sys/vm/drop_caches"


# ----------------------------------------------------------------------------------------------
# Timing


@dataclasses.dataclass
class Case:
    """One candidate: ``fn`` is timed (until its result is ready); setup/teardown are not."""

    fn: Callable[[], Any]
    setup: Callable[[], Any] | None = None
    teardown: Callable[[], Any] | None = None

    def run(self) -> float:
        if self.setup is not None:
            self.setup()
        start = time.perf_counter()
        jax.block_until_ready(self.fn())
        elapsed = time.perf_counter() - start
        if self.teardown is not None:
            self.teardown()
        return elapsed


def _interleaved_medians(cases: dict[str, Case], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per candidate, timing them round-robin so that drift on a shared machine
    affects every candidate alike; each round starts one candidate later, so that none always
    runs right after the same neighbour (whose freed memory or deleted files it might pay for)."""
    for case in cases.values():
        for _ in range(warmup):
            case.run()
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(cases[name].run())
    return {name: statistics.median(ts) for name, ts in times.items()}


def _try_drop_caches() -> bool:
    """Whether this process may drop the page cache (root, writable /proc); tries it once."""
    try:
        os.sync()
        with open(_DROP_CACHES, "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def _drop_caches() -> None:
    os.sync()
    with open(_DROP_CACHES, "w") as f:
        f.write("1")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# The context and the baselines


def make_context(total_bytes: int) -> rs.ResidualContext:
    """A real context: 12 float32 intermediates (``cos`` of 12 inputs) summing to ``total_bytes``."""
    inputs = []
    for i, w in enumerate(_WEIGHTS):
        rows = max(1, total_bytes * w // sum(_WEIGHTS) // 4 // _ROW)
        inputs.append(
            jnp.arange(rows * _ROW, dtype=jnp.float32).reshape(rows, _ROW) * (1e-3 * (i + 1))
        )
    fwd = rs.split(lambda xs: sum(jnp.sum(jnp.sin(x)) for x in xs))
    _, ctx = fwd(inputs)
    del inputs
    assert len(ctx.residuals) == 12 and set(ctx.spec.kinds) == {"intermediate"}, ctx.describe()
    return jax.block_until_ready(ctx)


def raw_write(folder: Path, arrays: list[np.ndarray], fsync: bool) -> None:
    folder.mkdir(parents=True)
    for i, a in enumerate(arrays):
        with open(folder / f"{i}.bin", "wb") as f:
            a.tofile(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    if fsync:
        _fsync_dir(folder)
        _fsync_dir(folder.parent)


def raw_read_into(folder: Path, buffers: list[np.ndarray]) -> list[np.ndarray]:
    for i, buf in enumerate(buffers):
        with open(folder / f"{i}.bin", "rb", buffering=0) as f:
            f.readinto(memoryview(buf.reshape(-1).view(np.uint8)))
    return buffers


def raw_read_fresh(folder: Path, arrays: list[np.ndarray]) -> list[np.ndarray]:
    return raw_read_into(folder, [np.empty(a.shape, a.dtype) for a in arrays])


def np_save(folder: Path, arrays: list[np.ndarray]) -> None:
    folder.mkdir(parents=True)
    for i, a in enumerate(arrays):
        np.save(folder / f"{i}.npy", a)


def np_load(folder: Path, n: int) -> list[np.ndarray]:
    return [np.load(folder / f"{i}.npy") for i in range(n)]


def _host_sharding(x: jax.Array) -> Any:
    """``x``'s sharding in host memory (``pinned_host``), or ``None`` if the backend has none."""
    device = next(iter(x.sharding.device_set))
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 - backends without memory spaces
        return None
    return x.sharding.with_memory_kind("pinned_host") if "pinned_host" in kinds else None


def device_host_round_trip(residuals: tuple[jax.Array, ...]) -> list[jax.Array]:
    """The least a host tier must do: copy every array to host memory and back."""
    out = []
    for x in residuals:
        host = _host_sharding(x)
        if host is None:
            out.append(jax.device_put(np.array(x), x.sharding))
        else:
            h = jax.device_put(x, host)
            out.append(jax.device_put(h, x.sharding))
    return out


class _Orbax:
    """Orbax ``StandardCheckpointer`` save/restore of the residual list, or ``None`` if absent."""

    def __init__(self) -> None:
        import orbax.checkpoint as ocp

        logging.getLogger("absl").setLevel(logging.ERROR)
        self.ocp = ocp
        self.ckpt = ocp.StandardCheckpointer()

    def save(self, path: Path, tree: list[jax.Array]) -> None:
        self.ckpt.save(path, tree)
        self.ckpt.wait_until_finished()

    def restore(self, path: Path, abstract: list[jax.ShapeDtypeStruct]) -> Any:
        return self.ckpt.restore(path, abstract)

    def close(self) -> None:
        self.ckpt.close()


def _make_orbax(enabled: bool) -> tuple[_Orbax | None, str]:
    if not enabled:
        return None, "skipped (--no-orbax)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            orbax = _Orbax()
        import orbax.checkpoint as ocp

        return orbax, f"orbax-checkpoint {getattr(ocp, '__version__', '?')}"
    except Exception as err:  # noqa: BLE001 - optional baseline
        return None, (
            f"skipped (orbax-checkpoint not importable: {type(err).__name__}: {err}; "
            "`pip install orbax-checkpoint` to add it)"
        )


# ----------------------------------------------------------------------------------------------
# Part 1: I/O


@dataclasses.dataclass
class Row:
    size_mib: int
    op: str
    seconds: float
    baseline: str
    baseline_seconds: float
    nbytes: int

    @property
    def ratio(self) -> float:
        return self.seconds / self.baseline_seconds


def measure_io(
    mib: int, base: Path, repeats: int, orbax: _Orbax | None, cold: bool
) -> tuple[list[Row], dict[str, float]]:
    """Returns the table rows and every median (seconds) by candidate name, for one size."""
    root = base / f"{mib}MiB"
    root.mkdir(parents=True)
    ctx = make_context(mib << 20)
    residuals = ctx.residuals
    arrays = [np.asarray(x) for x in residuals]  # zero-copy views on CPU; same bytes for all
    nbytes = sum(a.nbytes for a in arrays)
    counter = iter(range(1 << 30))
    t: dict[str, float] = {}

    # -- writes -----------------------------------------------------------------------------
    stores = {
        durable: rs.Store(root / f"store-w-{int(durable)}", durable=durable)
        for durable in (False, True)
    }
    write_keys: dict[bool, str] = {}

    def store_put(durable: bool) -> Case:
        store = stores[durable]

        def setup() -> None:
            os.sync()
            write_keys[durable] = f"w{next(counter)}"

        def fn() -> None:
            store.put(ctx, write_keys[durable])
            store.flush()

        return Case(fn, setup, lambda: store.delete(write_keys[durable]))

    def dir_writer(name: str, write: Callable[[Path], Any]) -> Case:
        paths: list[Path] = []

        def setup() -> None:
            os.sync()
            paths[:] = [root / f"{name}-{next(counter)}"]

        return Case(
            lambda: write(paths[0]), setup, lambda: shutil.rmtree(paths[0], ignore_errors=True)
        )

    writes = {
        "raw tofile": dir_writer("raw", lambda p: raw_write(p, arrays, False)),
        "raw tofile+fsync": dir_writer("raws", lambda p: raw_write(p, arrays, True)),
        "np.save": dir_writer("npy", lambda p: np_save(p, arrays)),
        "store put+flush, durable=False": store_put(False),
        "store put+flush, durable=True": store_put(True),
    }
    if orbax is not None:
        writes["orbax save"] = dir_writer("orbax", lambda p: orbax.save(p, list(residuals)))
    t.update(_interleaved_medians(writes, repeats))
    for s in stores.values():
        s.close()

    # -- reads: write each format once, then read it back -------------------------------------
    raw_dir, npy_dir, orbax_dir, store_dir = (
        root / n for n in ("raw-r", "npy-r", "orbax-r", "store-r")
    )
    raw_write(raw_dir, arrays, False)
    np_save(npy_dir, arrays)
    with rs.Store(store_dir) as s:
        s.put(ctx, "r")
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in residuals]
    if orbax is not None:
        orbax.save(orbax_dir, list(residuals))
    buffers = [np.empty_like(a) for a in arrays]
    reader: list[rs.Store] = []

    def open_reader() -> None:
        reader[:] = [rs.Store(store_dir)]

    def close_reader() -> None:
        reader.pop().close()

    def get_and_check() -> rs.ResidualContext:
        got = reader[0].get("r")
        assert got.spec == ctx.spec
        return got

    for mode in ("cold", "warm") if cold else ("warm",):
        before = _drop_caches if mode == "cold" else None

        def with_before(
            fn: Callable[[], Any] | None = None, before: Callable[[], None] | None = before
        ) -> Callable[[], None]:
            def setup() -> None:
                if fn is not None:
                    fn()
                if before is not None:
                    before()

            return setup

        reads = {
            "raw readinto": Case(lambda: raw_read_into(raw_dir, buffers), with_before()),
            "raw readinto, fresh buffers": Case(
                lambda: raw_read_fresh(raw_dir, arrays), with_before()
            ),
            "np.load": Case(lambda: np_load(npy_dir, len(arrays)), with_before()),
            "store get (fresh Store)": Case(get_and_check, with_before(open_reader), close_reader),
        }
        if orbax is not None:
            reads["orbax restore"] = Case(lambda: orbax.restore(orbax_dir, abstract), with_before())
        t.update(
            {f"{name} [{mode}]": v for name, v in _interleaved_medians(reads, repeats).items()}
        )

    # the bytes read back are the bytes written
    with rs.Store(store_dir) as s:
        got = s.get("r")
        assert all(np.array_equal(np.asarray(g), a) for g, a in zip(got.residuals, arrays))

    # -- host tier and checksums --------------------------------------------------------------
    host_store = rs.Store(None, device_budget=0)

    def host_round_trip() -> rs.ResidualContext:
        host_store.put(ctx, "h")
        return host_store.get("h")

    t.update(
        _interleaved_medians(
            {
                "host tier put+get": Case(host_round_trip, teardown=lambda: host_store.delete("h")),
                "device_put to host and back": Case(lambda: device_host_round_trip(residuals)),
                "checksum 12 arrays": Case(lambda: [serializers.checksum(a) for a in arrays]),
            },
            repeats,
        )
    )
    host_store.close()

    def row(op: str, baseline: str) -> Row:
        return Row(mib, op, t[op], baseline, t[baseline], nbytes)

    rows = [
        row("raw tofile+fsync", "raw tofile"),
        row("np.save", "raw tofile"),
        row("store put+flush, durable=False", "raw tofile"),
        row("store put+flush, durable=True", "raw tofile+fsync"),
    ]
    if orbax is not None:
        rows.append(row("orbax save", "raw tofile+fsync"))
    for mode in ("cold", "warm") if cold else ("warm",):
        base_read = f"raw readinto [{mode}]"
        rows += [
            row(f"raw readinto, fresh buffers [{mode}]", base_read),
            row(f"np.load [{mode}]", base_read),
            row(f"store get (fresh Store) [{mode}]", base_read),
        ]
        if orbax is not None:
            rows.append(row(f"orbax restore [{mode}]", base_read))
    rows += [
        row("host tier put+get", "device_put to host and back"),
        row("checksum 12 arrays", "store get (fresh Store) [warm]"),
    ]
    if cold:
        rows.append(row("checksum 12 arrays", "store get (fresh Store) [cold]"))
    shutil.rmtree(root, ignore_errors=True)
    return rows, t


def _print_io_table(rows: list[Row]) -> None:
    header = (
        f"{'size':>7} | {'operation':<36} | {'ms':>9} | {'baseline':<32} | {'base ms':>9} | "
        f"{'ratio':>6} | {'GB/s':>6}"
    )
    print(header)
    print("-" * len(header))
    last = None
    for r in rows:
        if last is not None and r.size_mib != last:
            print("-" * len(header))
        last = r.size_mib
        print(
            f"{r.size_mib:>4}MiB | {r.op:<36} | {r.seconds * 1e3:>9.2f} | {r.baseline:<32} | "
            f"{r.baseline_seconds * 1e3:>9.2f} | {r.ratio:>6.2f} | {r.nbytes / r.seconds / 1e9:>6.2f}"
        )


# ----------------------------------------------------------------------------------------------
# Part 2: the schedule


def schedule_config(quick: bool) -> DemoConfig:
    if quick:
        return DemoConfig(
            vocab=128,
            d_model=64,
            n_heads=4,
            d_ff=256,
            n_layers=2,
            seq_len=64,
            microbatch=4,
            n_microbatches=8,
        )
    # about 3.9 MiB of intermediates per context (plus 3 MiB of weights held by reference)
    return DemoConfig(
        vocab=256,
        d_model=128,
        n_heads=4,
        d_ff=512,
        n_layers=4,
        seq_len=64,
        microbatch=4,
        n_microbatches=16,
    )


def measure_schedule(base: Path, repeats: int, quick: bool) -> dict[str, Any]:
    cfg = schedule_config(quick)
    n = cfg.n_microbatches
    key = jax.random.key(cfg.seed)
    params = init_transformer(key, cfg)
    fwd = rs.split(
        lambda p, tokens, k: transformer_loss(p, tokens, k, cfg), argnums=0, has_aux=True
    )
    data_key, drop_key = jax.random.split(jax.random.key(1))
    tokens = jax.random.randint(data_key, (n, cfg.microbatch, cfg.seq_len + 1), 0, cfg.vocab)
    batches = [tokens[i] for i in range(n)]
    drop_keys = list(jax.random.split(drop_key, n))
    ct = jnp.float32(1.0 / n)

    def add(a: Any, b: Any) -> Any:
        return b if a is None else jax.tree.map(jnp.add, a, b)

    def in_memory() -> Any:
        contexts = [fwd(params, batches[i], drop_keys[i])[1] for i in range(n)]
        grads = None
        for ctx in reversed(contexts):
            grads = add(grads, fwd.backward(ctx, ct))
        return jax.block_until_ready(grads)

    def via_store(store: rs.Store) -> Any:
        keys = [f"mb{i}" for i in range(n)]
        for i in range(n):
            store.put(fwd(params, batches[i], drop_keys[i])[1], keys[i])
        store.prefetch(keys[-1])
        grads = None
        for i in reversed(range(n)):
            if i > 0:
                store.prefetch(keys[i - 1])
            grads = add(grads, fwd.backward(store.get(keys[i]), ct))
        grads = jax.block_until_ready(grads)
        store.flush()
        return grads

    ctx0 = fwd(params, batches[0], drop_keys[0])[1]
    inter = sum(x.nbytes for x, k in zip(ctx0.residuals, ctx0.spec.kinds) if k == "intermediate")
    stores = {
        durable: rs.Store(
            base / f"schedule-{int(durable)}", device_budget=0, host_budget=0, durable=durable
        )
        for durable in (True, False)
    }
    try:
        reference = in_memory()
        diffs = {}
        for durable, store in stores.items():
            got = via_store(store)
            diffs[durable] = max(
                float(jnp.max(jnp.abs(a - b)))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference))
            )
        t = _interleaved_medians(
            {
                "in memory (list)": Case(in_memory),
                "store, durable=True": Case(lambda: via_store(stores[True])),
                "store, durable=False": Case(lambda: via_store(stores[False])),
            },
            repeats,
        )
        stats = stores[True].stats()
    finally:
        for s in stores.values():
            s.close()
    return {
        "cfg": cfg,
        "own_bytes": inter,
        "context_bytes": ctx0.nbytes,
        "t": t,
        "diffs": diffs,
        "stats": stats,
    }


# ----------------------------------------------------------------------------------------------


def measure_first_put(base: Path, repeats: int, quick: bool) -> dict[str, float]:
    """Median seconds of a put that saves the signature's backward, of a later put, and of the
    export itself (see Part 3 of the module docstring)."""
    from residual_store.store import backwards

    cfg = schedule_config(quick)
    params = init_transformer(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (cfg.microbatch, cfg.seq_len + 1), 0, cfg.vocab)
    fwd = rs.split(lambda p, t, k: transformer_loss(p, t, k, cfg), has_aux=True)
    _, ctx = fwd(params, tokens, jax.random.key(2))
    jax.block_until_ready(ctx)
    first, later, export = [], [], []
    for i in range(repeats + 1):  # the first round warms up
        with rs.Store(base / f"put{i}") as store:
            start = time.perf_counter()
            store.put(ctx, "a")
            t_first = time.perf_counter() - start
            store.flush()
            start = time.perf_counter()
            store.put(ctx, "b")
            t_later = time.perf_counter() - start
        start = time.perf_counter()
        backwards.serialize(ctx._backward, ctx.spec.avals, None)
        t_export = time.perf_counter() - start
        if i:
            first.append(t_first)
            later.append(t_later)
            export.append(t_export)
        shutil.rmtree(base / f"put{i}", ignore_errors=True)
    return {"first": statistics.median(first), "later": statistics.median(later), "export": statistics.median(export)}


def _goal(results: list[tuple[str, bool, str]], name: str, ok: bool, detail: str) -> None:
    results.append((name, ok, detail))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="4,64,512", help="context sizes in MiB (default 4,64,512)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs per number (default: 21 at 4 MiB, 9 at 64, 7 at 512; 5 for the schedule)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 4 MiB, 3 repeats, tiny schedule"
    )
    parser.add_argument("--no-orbax", action="store_true", help="skip the Orbax baseline")
    parser.add_argument("--dir", default=None, help="folder to write in (default: a temp dir)")
    parser.add_argument("--part", choices=("all", "io", "schedule", "put"), default="all")
    args = parser.parse_args()
    sizes = [4] if args.quick else [int(s) for s in args.sizes.split(",") if s.strip()]

    def repeats_for(mib: int) -> int:
        if args.repeats is not None:
            return args.repeats
        if args.quick:
            return 3
        return _DEFAULT_REPEATS.get(mib, max(3, min(15, 512 // max(mib, 1))))

    base = Path(args.dir or tempfile.mkdtemp(prefix="store_throughput_"))
    base.mkdir(parents=True, exist_ok=True)
    goals: list[tuple[str, bool, str]] = []
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs; files in {base}"
    )
    try:
        if args.part in ("all", "io"):
            cold = _try_drop_caches()
            orbax, orbax_note = _make_orbax(not args.no_orbax)
            print(f"orbax baseline: {orbax_note}")
            print(
                "cold reads: page cache dropped (sync; echo 1 > drop_caches) before every timed read of "
                "every reader"
                if cold
                else "page cache cannot be dropped here (no permission): every read is a WARM page-cache "
                "read, for every reader alike (each is read once untimed first)"
            )
            print(
                "12 float32 intermediates of a real rs.split context per size; medians of N runs "
                "(N: " + ", ".join(f"{m} MiB: {repeats_for(m)}" for m in sizes) + "), round-robin; "
                "ratio = ms / baseline ms (lower is better); GB/s = context bytes / time\n"
            )
            rows: list[Row] = []
            t_by_size: dict[int, dict[str, float]] = {}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # orbax's chatter
                    for mib in sizes:
                        r, t = measure_io(mib, base, repeats_for(mib), orbax, cold)
                        rows += r
                        t_by_size[mib] = t
            finally:
                if orbax is not None:
                    orbax.close()
            _print_io_table(rows)
            _io_goals(goals, t_by_size, cold, orbax is not None)
        if args.part in ("all", "schedule"):
            reps = args.repeats if args.repeats is not None else (3 if args.quick else 5)
            s = measure_schedule(base, reps, args.quick)
            _print_schedule(s, reps)
            t = s["t"]
            for durable in (True, False):
                ratio = t[f"store, durable={durable}"] / t["in memory (list)"]
                _goal(
                    goals,
                    f"schedule via store (durable={durable}) <= 1.15x in-memory",
                    ratio <= 1.15,
                    f"{ratio:.2f}x",
                )
                _goal(
                    goals,
                    f"schedule gradients equal (durable={durable})",
                    s["diffs"][durable] == 0.0,
                    f"max abs diff {s['diffs'][durable]:.3g}",
                )
        if args.part in ("all", "put"):
            p = measure_first_put(base, args.repeats or (3 if args.quick else 9), args.quick)
            print("\nput latency, demo transformer context (caller's thread; medians):")
            rows = [
                ["put", "ms", "/ later put"],
                ["first put of a signature (saves its backward)", f"{1e3 * p['first']:.3f}", f"{p['first'] / p['later']:.2f}"],
                ["later put of that signature", f"{1e3 * p['later']:.3f}", "1.00"],
                ["jax.export of the backward (writer thread)", f"{1e3 * p['export']:.3f}", f"{p['export'] / p['later']:.0f}"],
            ]
            widths = [max(len(r[i]) for r in rows) for i in range(3)]
            for r in rows:
                print("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
            _goal(goals, "first put of a new signature <= 2x a later put", p["first"] <= 2 * p["later"],
                  f"{p['first'] / p['later']:.2f}x")
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print("\ngoals:")
    for name, ok, detail in goals:
        print(f"  {'PASS' if ok else 'MISS'}  {name}: {detail}")


def _io_goals(
    goals: list[tuple[str, bool, str]],
    t_by_size: dict[int, dict[str, float]],
    cold: bool,
    have_orbax: bool,
) -> None:
    modes = ("cold", "warm") if cold else ("warm",)
    for mib, t in t_by_size.items():
        if mib >= 64:
            for durable, base in ((True, "raw tofile+fsync"), (False, "raw tofile")):
                thr = t[base] / t[f"store put+flush, durable={durable}"]
                _goal(
                    goals,
                    f"{mib} MiB put (durable={durable}) >= 0.8x raw write throughput",
                    thr >= 0.8,
                    f"{thr:.2f}x",
                )
            for mode in modes:
                get = t[f"store get (fresh Store) [{mode}]"]
                thr = t[f"raw readinto [{mode}]"] / get
                fresh = t[f"raw readinto, fresh buffers [{mode}]"] / get
                _goal(
                    goals,
                    f"{mib} MiB get [{mode}] >= 0.8x raw read throughput",
                    thr >= 0.8,
                    f"{thr:.2f}x (vs readinto into fresh buffers: {fresh:.2f}x)",
                )
        for mode in modes:
            frac = t["checksum 12 arrays"] / t[f"store get (fresh Store) [{mode}]"]
            _goal(
                goals,
                f"{mib} MiB checksums < 10% of get [{mode}]",
                frac < 0.10,
                f"{100 * frac:.1f}%",
            )
    if 4 in t_by_size:
        t = t_by_size[4]
        mode = "warm"  # a round trip reads back what it just wrote: from the page cache
        for durable, base in ((False, "raw tofile"), (True, "raw tofile+fsync")):
            ours = t[f"store put+flush, durable={durable}"] + t[f"store get (fresh Store) [{mode}]"]
            raw = t[base] + t[f"raw readinto [{mode}]"]
            _goal(
                goals,
                f"4 MiB round trip (durable={durable}, {mode} read) within 2x raw",
                ours <= 2 * raw,
                f"{ours / raw:.2f}x ({ours * 1e3:.1f} ms vs {raw * 1e3:.1f} ms; put+flush + get)",
            )
        if have_orbax:
            orbax = t["orbax save"] + t[f"orbax restore [{mode}]"]
            for durable in (True, False):
                ours = (
                    t[f"store put+flush, durable={durable}"]
                    + t[f"store get (fresh Store) [{mode}]"]
                )
                _goal(
                    goals,
                    f"4 MiB round trip (durable={durable}) >= 10x faster than Orbax",
                    orbax >= 10 * ours,
                    f"{orbax / ours:.1f}x ({ours * 1e3:.1f} ms vs Orbax {orbax * 1e3:.1f} ms)",
                )
        else:
            print("(Orbax goal skipped: no Orbax baseline)")


def _print_schedule(s: dict[str, Any], reps: int) -> None:
    cfg, t = s["cfg"], s["t"]
    base = t["in memory (list)"]
    print(
        f"\nschedule: {cfg.n_microbatches} microbatches of the demo transformer "
        f"({cfg.n_layers} layers, d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.microbatch}x{cfg.seq_len} "
        f"tokens), F1..F{cfg.n_microbatches} then B{cfg.n_microbatches}..B1; a context holds "
        f"{s['own_bytes'] / 2**20:.2f} MiB of intermediates ({s['context_bytes'] / 2**20:.2f} MiB "
        f"with weights); medians of {reps} steps, round-robin"
    )
    header = f"{'contexts':<52} | {'ms/step':>9} | {'ratio':>6} | {'max |grad diff|':>15}"
    print(header)
    print("-" * len(header))
    print(f"{'in memory (list)':<52} | {base * 1e3:>9.1f} | {1.0:>6.2f} | {'-':>15}")
    for durable in (True, False):
        name = f"store, durable={durable}"
        label = f"Store(path, budgets 0), prefetch+get, durable={durable}"
        print(
            f"{label:<52} | {t[name] * 1e3:>9.1f} | {t[name] / base:>6.2f} | {s['diffs'][durable]:>15.3g}"
        )


if __name__ == "__main__":
    main()
