"""How fast ``rs.Store`` moves residual contexts, against raw file I/O, ``np.save`` and Orbax.

Run: ``python benchmarks/store_throughput.py [--sizes 2,4,64] [--repeats N] [--quick]
[--no-orbax] [--dir DIR] [--part all|io|schedule|budget|stacks|put|split|s3]``. ``--quick`` measures the same
sizes and the same schedule with fewer repeats (a minute or two on 2 cores); the full run takes a
few minutes. One process; every number is the median of its timed runs, taken round-robin across
the candidates of one table, each round starting one candidate later (drift and neighbours on a
shared machine hit them alike), after one untimed warm-up run each. Ratios are measured in this
one run: absolute times on shared machines are noise, ratios are not.

Part 1, I/O. For each size (MiB; default 2, 4 and 64, 512 on request), a real
``rs.ResidualContext``: ``rs.split`` of a function of 12 float32 arrays of mixed sizes (40%,
20%, 10%, ... of the total), each through ``sin``, so its context holds 12 intermediates
(``cos``) of exactly those sizes. Every writer writes the same bytes; every reader reads them:

- writes: ``store.put(ctx, key)`` + ``store.flush()`` with ``durable=True`` and
  ``durable=False``, against raw ``write`` of each array into its own file (the durable baseline
  adds ``os.fsync`` of each file, of the folder and of its parent), ``np.save`` (the same system
  calls as raw ``write``: its row shows the noise of the write rows) and Orbax
  ``StandardCheckpointer`` (``save`` + ``wait_until_finished``). Each writer starts after
  ``os.sync()``, so none pays for another's dirty pages. The store rows write a new key and
  delete it after each run, so the store recycles the deleted context's data folder, as it does
  in a training loop.
- reads: ``store.get(key)`` until the context is a ready ``jax.Array`` pytree, in a ``Store``
  in use (``device_budget=0, host_budget=0``: every get reads the files, into the buffers of the
  contexts got before, as in a training loop; the goals' row) and in a fresh ``Store`` on the
  same path (opened untimed: it reads and parses the manifest, and its buffers are new pages),
  against the raw baseline: ``readinto`` into
  preallocated 64-byte aligned buffers plus ``jax.device_put`` of each buffer (a get returns
  ``jax.Array``s, so the baseline does too), the same into freshly allocated aligned buffers
  (what any reader that returns new arrays pays: page faults), ``np.load`` (numpy arrays, no
  ``device_put``) and Orbax ``restore``. Reads run cold (``sync`` + ``echo 1 >
  /proc/sys/vm/drop_caches`` before every timed read of every reader, where this process may do
  that) and warm (the files in the page cache, each read once untimed first).
- round trip, at 4 MiB: ``put`` + ``flush`` into a durable store, then ``get`` in a fresh
  ``Store`` (opened in the timed run), against Orbax ``save`` + ``restore``, and the raw
  baselines' own round trip (``write`` + ``fsync``, then ``readinto`` fresh buffers +
  ``device_put``): the most any durable writer of these files could gain on Orbax here.
- host tier: ``Store(None, device_budget=0)`` ``put`` + ``get`` round trip, against
  ``jax.device_put`` of every array to host memory (``pinned_host`` where the backend has it)
  and back. Checksums: ``serializers.checksum`` over the 12 arrays, against the warm get.

Part 2, schedule. 16 microbatches of the demo transformer of ``residual_store.demo`` (3.9 MiB of
intermediates per context), all forwards then all backwards (F1..F16, B16..B1) with
``rs.split``: contexts kept in a Python list, against every context ``put`` into a disk
``Store(path, device_budget=0, host_budget=0)`` (write-through; the contexts leave memory) with
``store.prefetch`` one backward ahead, then ``store.get`` and the backward; the step ends with
``store.flush()``, so the writer's work is counted. Durable and non-durable stores, each with
``save="all"`` and ``save="auto"`` (fewer bytes to move; the backward recomputes the rest). Besides the
wall time, the process's user and system CPU seconds per step (``getrusage``, all threads: XLA's,
and the store's writer and loaders), so the I/O threads' cost shows.

Part 2c, budget (issue 26). The same transformer's 16 microbatches, F1..F16 then B16..B1
declared with ``store.schedule``, through ``Store(path, device_budget=2 contexts, host_budget=0)``
with no ``flush`` in the step (writes in flight): at its peak, the device memory the live
contexts hold as their own (every ``rs.ResidualContext`` alive, found through ``gc``: the
store's tiers, loads ahead, the context the step got; each array once), after every put and get
once the backward in flight is done, against the budget plus one context (the one being put or
got); with the pending host copies (``stats()["pending"]``) at that moment. And the step time
against the step in memory; gradients bit-identical.

Part 2b, stacks (issue 25; ``benchmarks/stacks.py``). Contexts of a stack of blocks unrolled in
Python (hundreds of small residuals): put+flush and get of one context against one file written
and read, files per put, and a pipeline step of the 24-block stack through a store with budgets 0
against the step in memory.

Part 3, put latency (no goal). The demo transformer's context ``put`` into a store that has not
seen its signature (a fresh ``Store`` each run: the put that also saves the backward with
``jax.export``, on the writer thread), against a later ``put``, and against the export itself.

Part 4, split. ``rs.split`` forward + backward against one jitted ``jax.value_and_grad``:
``measure_model`` of ``benchmarks/split_overhead.py`` on its MLP (8 tanh layers of 1024, batch
256: about 35 ms a step; its ``--quick`` MLP is too small, a step of dispatches, to judge by).

Part 5, object store (no goal; issue 16). ``put`` + ``flush`` and ``get`` (a fresh ``Store``)
at 4 and 64 MiB on an S3-compatible server on loopback (moto, started here as the tests start
it, from the ``test`` extra) through tensorstore's ``s3`` driver, against a local folder
(``durable=True``), as the ratio local time / s3 time.

Goals (issue 12), printed at the end as one table (goal | measured | target | verdict), each
ratio from the medians of one table; "x raw" is raw time / store time (higher is better):

- 64 MiB (and 512 MiB when measured): put+flush (durable) >= 0.9x raw write+fsync; cold get and
  warm get >= 0.9x raw readinto+device_put;
- 2 MiB: the same three at >= 0.7x raw;
- 4 MiB durable round trip >= 10x faster than Orbax save + restore;
- schedule through the spilled store <= 1.15x in memory without fsync, <= 1.25x with fsync;
  its gradients bit-identical (``np.array_equal``) to the in-memory ones; with ``save="auto"``
  (issue 15) <= 1.1x the in-memory ``save="all"`` without fsync;
- budget (issue 26): the store's peak live device bytes over the spilled schedule <= budget +
  one context; that step <= 1.1x in memory (durable=False); gradients bit-identical;
- split forward + backward <= 1.10x fused ``value_and_grad``;
- stacks (issue 25): 16- and 64-block contexts put+flush <= 5x one file+fsync, get <= 10x one
  file read+device_put, <= 4 files a put; the 24-block pipeline step through a store <= 1.25x
  the step in memory (``save="all"``), <= 1.15x with ``save="auto"``.

A goal that this run could not measure (a size not in ``--sizes``, no page-cache drop, no Orbax)
reads ``n/a``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import stacks
from split_overhead import measure_model, mlp_case
from timing import Case, interleaved_medians

import residual_store as rs
import residual_store_serializers as serializers
from residual_store.demo import DemoConfig, init_transformer, transformer_loss

# Relative sizes of the 12 residual arrays (percent of the total): a few big ones, small ones.
_WEIGHTS = (40, 20, 10, 10, 6, 4, 3, 2, 2, 1, 1, 1)
_ROW = 256  # arrays are (n // 256, 256) float32
_DEFAULT_SIZES = "2,4,64"
_DEFAULT_REPEATS = {2: 21, 4: 21, 64: 9, 512: 7}
_QUICK_REPEATS = {2: 9, 4: 9, 64: 5, 512: 3}
_ROUND_TRIP_MIB = 4
# size (MiB) -> the least put+flush and get throughput, as a fraction of raw
_IO_TARGETS = {2: 0.7, 64: 0.9, 512: 0.9}
_DROP_CACHES = "/proc/sys/vm/drop_caches"

# The schedule: 16 microbatches, about 3.9 MiB of intermediates per context (plus 3 MiB of
# weights held by reference)
SCHEDULE = DemoConfig(
    vocab=256,
    d_model=128,
    n_heads=4,
    d_ff=512,
    n_layers=4,
    seq_len=64,
    microbatch=4,
    n_microbatches=16,
)


# ----------------------------------------------------------------------------------------------
# Timing


def _try_drop_caches() -> bool:
    """Whether this process may drop the page cache (root, writable /proc); tries it once."""
    try:
        _drop_caches()
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
    """One ``write`` of each array into its own file (+ ``fsync`` of each, and of the folders)."""
    folder.mkdir(parents=True)
    for i, a in enumerate(arrays):
        with open(folder / f"{i}.bin", "wb", buffering=0) as f:
            f.write(memoryview(a.reshape(-1).view(np.uint8)))
            if fsync:
                os.fsync(f.fileno())
    if fsync:
        _fsync_dir(folder)
        _fsync_dir(folder.parent)


def raw_read_put(
    folder: Path, buffers: list[np.ndarray], shardings: list[Any]
) -> list[jax.Array]:
    """The raw read baseline: ``readinto`` each file into its buffer, then ``jax.device_put``."""
    for i, buf in enumerate(buffers):
        with open(folder / f"{i}.bin", "rb", buffering=0) as f:
            f.readinto(memoryview(buf.reshape(-1).view(np.uint8)))
    return [jax.device_put(buf, s) for buf, s in zip(buffers, shardings)]


def aligned_like(arrays: list[np.ndarray]) -> list[np.ndarray]:
    return [serializers.aligned_empty(a.shape, a.dtype) for a in arrays]


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

RAW_WRITE = "raw write"
RAW_WRITE_FSYNC = "raw write+fsync"
RAW_READ = "raw readinto+device_put"
RAW_READ_FRESH = "raw readinto+device_put, fresh buffers"
STORE_GET = "store get (fresh Store)"
STORE_GET_OPEN = "store get (open Store, budgets 0)"
STORE_PUT = "store put+flush, durable={}"
STORE_ROUND_TRIP = "store put+flush durable + get (fresh Store)"
ORBAX_ROUND_TRIP = "orbax save + restore"
RAW_ROUND_TRIP = "raw write+fsync + readinto+device_put"


@dataclasses.dataclass
class Row:
    size_mib: int
    op: str
    seconds: float
    baseline: str
    baseline_seconds: float
    nbytes: int

    @property
    def speed(self) -> float:
        """Baseline time / this time: above 1 is faster than the baseline."""
        return self.baseline_seconds / self.seconds


class _Fresh:
    """A new name for each run of a case, under ``root``, from one counter."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.counter = iter(range(1 << 30))

    def name(self, prefix: str) -> str:
        return f"{prefix}{next(self.counter)}"

    def dir_case(self, prefix: str, fn: Callable[[Path], Any]) -> Case:
        """``fn(folder)`` on a new folder after ``os.sync()``; the folder removed afterwards."""
        paths: list[Path] = []

        def setup() -> None:
            os.sync()
            paths[:] = [self.root / self.name(prefix)]

        return Case(
            lambda: fn(paths[0]), setup, lambda: shutil.rmtree(paths[0], ignore_errors=True)
        )

    def key_case(self, store: rs.Store, fn: Callable[[str], Any]) -> Case:
        """``fn(key)`` on a new key of ``store`` after ``os.sync()``; the key deleted afterwards."""
        keys: list[str] = []

        def setup() -> None:
            os.sync()
            keys[:] = [self.name("k")]

        return Case(lambda: fn(keys[0]), setup, lambda: store.delete(keys[0]))


def _put_flush(store: rs.Store, ctx: rs.ResidualContext, key: str) -> None:
    store.put(ctx, key)
    store.flush()


def measure_io(
    mib: int, base: Path, repeats: int, orbax: _Orbax | None, cold: bool
) -> tuple[list[Row], dict[str, float]]:
    """Returns the table rows and every median (seconds) by candidate name, for one size."""
    root = base / f"{mib}MiB"
    root.mkdir(parents=True)
    fresh = _Fresh(root)
    ctx = make_context(mib << 20)
    residuals = ctx.residuals
    shardings = [x.sharding for x in residuals]
    arrays = [np.asarray(x) for x in residuals]  # zero-copy views on CPU; same bytes for all
    nbytes = sum(a.nbytes for a in arrays)
    t: dict[str, float] = {}

    # -- writes -----------------------------------------------------------------------------
    store_paths = {durable: root / f"store-w-{int(durable)}" for durable in (False, True)}
    stores = {durable: rs.Store(p, durable=durable) for durable, p in store_paths.items()}
    writes = {
        RAW_WRITE: fresh.dir_case("raw", lambda p: raw_write(p, arrays, False)),
        RAW_WRITE_FSYNC: fresh.dir_case("raws", lambda p: raw_write(p, arrays, True)),
        "np.save": fresh.dir_case("npy", lambda p: np_save(p, arrays)),
        **{
            STORE_PUT.format(durable): fresh.key_case(
                store, lambda k, store=store: _put_flush(store, ctx, k)
            )
            for durable, store in stores.items()
        },
    }
    if orbax is not None:
        writes["orbax save"] = fresh.dir_case("orbax", lambda p: orbax.save(p, list(residuals)))
    t.update(interleaved_medians(writes, repeats))

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
    buffers = aligned_like(arrays)
    reader: list[rs.Store] = []
    # a store in use: nothing kept in memory, so every get reads the files, into the buffers of
    # the contexts got before (the raw baseline reuses its buffers too)
    opened = rs.Store(store_dir, device_budget=0, host_budget=0, read_only=True)

    def open_reader() -> None:
        reader[:] = [rs.Store(store_dir)]

    def close_reader() -> None:
        reader.pop().close()

    def get_and_check() -> rs.ResidualContext:
        got = reader[0].get("r")
        assert got.spec == ctx.spec
        return got

    for mode in ("cold", "warm") if cold else ("warm",):
        drop = _drop_caches if mode == "cold" else None

        def before(
            fn: Callable[[], None] | None = None, drop: Callable[[], None] | None = drop
        ) -> Callable[[], None]:
            def setup() -> None:
                if fn is not None:
                    fn()
                if drop is not None:
                    drop()

            return setup

        reads = {
            RAW_READ: Case(lambda: raw_read_put(raw_dir, buffers, shardings), before()),
            RAW_READ_FRESH: Case(
                lambda: raw_read_put(raw_dir, aligned_like(arrays), shardings), before()
            ),
            "np.load": Case(lambda: np_load(npy_dir, len(arrays)), before()),
            STORE_GET: Case(get_and_check, before(open_reader), close_reader),
            STORE_GET_OPEN: Case(lambda: opened.get("r"), before()),
        }
        if orbax is not None:
            reads["orbax restore"] = Case(lambda: orbax.restore(orbax_dir, abstract), before())
        t.update(
            {f"{name} [{mode}]": v for name, v in interleaved_medians(reads, repeats).items()}
        )

    # the bytes read back are the bytes written
    with rs.Store(store_dir) as s:
        got = s.get("r")
        assert all(np.array_equal(np.asarray(g), a) for g, a in zip(got.residuals, arrays))
    got = opened.get("r")
    assert all(np.array_equal(np.asarray(g), a) for g, a in zip(got.residuals, arrays))
    assert opened._persistence.disk.buffers is not None and opened._persistence.disk.buffers.reused > 0
    opened.close()

    # -- round trip: durable put+flush, then get in a fresh Store -------------------------------
    if mib == _ROUND_TRIP_MIB:

        def store_round_trip(key: str) -> rs.ResidualContext:
            _put_flush(stores[True], ctx, key)
            with rs.Store(store_paths[True]) as s:
                return jax.block_until_ready(s.get(key))

        trips = {
            STORE_ROUND_TRIP: fresh.key_case(stores[True], store_round_trip),
            # the floor of any durable round trip of these bytes: what Orbax's could be sped up to
            RAW_ROUND_TRIP: fresh.dir_case(
                "raw-rt", lambda p: (raw_write(p, arrays, True), raw_read_put(p, aligned_like(arrays), shardings))
            ),
        }
        if orbax is not None:
            trips[ORBAX_ROUND_TRIP] = fresh.dir_case(
                "orbax-rt", lambda p: (orbax.save(p, list(residuals)), orbax.restore(p, abstract))
            )
        t.update(interleaved_medians(trips, repeats))
    for s in stores.values():
        s.close()

    # -- host tier and checksums --------------------------------------------------------------
    host_store = rs.Store(None, device_budget=0)

    def host_round_trip() -> rs.ResidualContext:
        host_store.put(ctx, "h")
        return host_store.get("h")

    t.update(
        interleaved_medians(
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
        row(RAW_WRITE_FSYNC, RAW_WRITE),
        row("np.save", RAW_WRITE),
        row(STORE_PUT.format(False), RAW_WRITE),
        row(STORE_PUT.format(True), RAW_WRITE_FSYNC),
    ]
    if orbax is not None:
        rows.append(row("orbax save", RAW_WRITE_FSYNC))
    for mode in ("cold", "warm") if cold else ("warm",):
        base_read = f"{RAW_READ} [{mode}]"
        rows += [row(f"{op} [{mode}]", base_read) for op in (RAW_READ_FRESH, "np.load", STORE_GET, STORE_GET_OPEN)]
        if orbax is not None:
            rows.append(row(f"orbax restore [{mode}]", base_read))
    if ORBAX_ROUND_TRIP in t:
        rows.append(row(STORE_ROUND_TRIP, ORBAX_ROUND_TRIP))
        rows.append(row(RAW_ROUND_TRIP, ORBAX_ROUND_TRIP))
    rows.append(row("host tier put+get", "device_put to host and back"))
    shutil.rmtree(root, ignore_errors=True)
    return rows, t


def _print_io_table(rows: list[Row]) -> None:
    header = (
        f"{'size':>7} | {'operation':<46} | {'ms':>8} | {'baseline':<46} | {'base ms':>8} | "
        f"{'base/ms':>7} | {'GB/s':>6}"
    )
    print(header)
    print("-" * len(header))
    last = None
    for r in rows:
        if last is not None and r.size_mib != last:
            print("-" * len(header))
        last = r.size_mib
        print(
            f"{r.size_mib:>4}MiB | {r.op:<46} | {r.seconds * 1e3:>8.2f} | {r.baseline:<46} | "
            f"{r.baseline_seconds * 1e3:>8.2f} | {r.speed:>7.2f} | {r.nbytes / r.seconds / 1e9:>6.2f}"
        )


def _print_checksums(t_by_size: dict[int, dict[str, float]]) -> None:
    print("\nchecksums (serializers.checksum of the 12 arrays), against the store's get:")
    for mib, t in t_by_size.items():
        shares = ", ".join(
            f"{100 * t['checksum 12 arrays'] / t[f'{STORE_GET} [{mode}]']:.1f}% of a {mode} get"
            for mode in ("cold", "warm")
            if f"{STORE_GET} [{mode}]" in t
        )
        print(f"  {mib:>4} MiB: {t['checksum 12 arrays'] * 1e3:.2f} ms, {shares}")


# ----------------------------------------------------------------------------------------------
# Part 2: the schedule

IN_MEMORY = "in memory (list)"
SPILLED = "store, durable={}"
SPILLED_AUTO = "store, durable={}, save='auto'"


def measure_schedule(base: Path, repeats: int) -> dict[str, Any]:
    cfg = SCHEDULE
    n = cfg.n_microbatches
    key = jax.random.key(cfg.seed)
    params = init_transformer(key, cfg)
    loss = lambda p, tokens, k: transformer_loss(p, tokens, k, cfg)  # noqa: E731
    splits = {save: rs.split(loss, argnums=0, has_aux=True, save=save) for save in ("all", "auto")}
    data_key, drop_key = jax.random.split(jax.random.key(1))
    tokens = jax.random.randint(data_key, (n, cfg.microbatch, cfg.seq_len + 1), 0, cfg.vocab)
    batches = [tokens[i] for i in range(n)]
    drop_keys = list(jax.random.split(drop_key, n))
    ct = jnp.float32(1.0 / n)

    calls = [(params, batches[i], drop_keys[i]) for i in range(n)]

    def in_memory(fwd: rs.Split = splits["all"]) -> Any:
        return stacks.in_memory_step(fwd, calls, ct)

    def via_store(store: rs.Store, fwd: rs.Split) -> Any:
        return stacks.spilled_step(store, fwd, calls, ct)

    def own(save: str) -> int:
        ctx = splits[save](params, batches[0], drop_keys[0])[1]
        return sum(x.nbytes for x, k in zip(ctx.residuals, ctx.spec.kinds) if k in ("intermediate", "input"))

    ctx0 = splits["all"](params, batches[0], drop_keys[0])[1]
    labels = {(d, save): (SPILLED if save == "all" else SPILLED_AUTO).format(d) for d in (True, False) for save in splits}
    stores = {
        (d, save): rs.Store(base / f"schedule-{int(d)}-{save}", device_budget=0, host_budget=0, durable=d)
        for d, save in labels
    }
    try:
        reference = jax.tree.leaves(in_memory())
        want = jax.tree.leaves(in_memory(splits["auto"]))
        identical, auto_close = {}, {}
        for (d, save), store in stores.items():
            got = jax.tree.leaves(via_store(store, splits[save]))
            if save == "all":
                identical[d] = len(got) == len(reference) and all(
                    np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, reference)
                )
            else:  # the same values as "auto" in memory, and jax.grad's up to rounding
                identical[f"{d}, auto"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want))
                auto_close[d] = max(
                    float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) / max(float(np.max(np.abs(np.asarray(b)))), 1e-30)
                    for a, b in zip(got, reference)
                )
        cases = {
            IN_MEMORY: Case(in_memory),
            **{label: Case(lambda k=k: via_store(stores[k], splits[k[1]])) for k, label in labels.items()},
        }
        t = interleaved_medians(cases, repeats)
    finally:
        for s in stores.values():
            s.close()
    return {
        "cfg": cfg,
        "own_bytes": own("all"),
        "own_bytes_auto": own("auto"),
        "context_bytes": ctx0.nbytes,
        "t": t,
        "cpu": {name: case.median_cpu() for name, case in cases.items()},
        "identical": identical,
        "auto_rel_diff": auto_close,
    }


def _print_schedule(s: dict[str, Any], reps: int) -> None:
    cfg, t, cpu = s["cfg"], s["t"], s["cpu"]
    print(
        f"\nschedule: {cfg.n_microbatches} microbatches of the demo transformer "
        f"({cfg.n_layers} layers, d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.microbatch}x{cfg.seq_len} "
        f"tokens), F1..F{cfg.n_microbatches} then B{cfg.n_microbatches}..B1; a context holds "
        f"{s['own_bytes'] / 2**20:.2f} MiB of intermediates with save='all', "
        f"{s['own_bytes_auto'] / 2**20:.2f} MiB with save='auto' ({s['context_bytes'] / 2**20:.2f} MiB "
        f"with weights); medians of {reps} steps, round-robin; CPU: process user and system "
        f"seconds per step, all threads (getrusage); grads: bit-identical to the same save in memory"
    )
    rows = [(IN_MEMORY, IN_MEMORY + ", save='all'", "-")] + [
        ((SPILLED if save == "all" else SPILLED_AUTO).format(d),
         f"Store(path, budgets 0), prefetch+get, durable={d}, save={save!r}",
         str(s["identical"][d if save == "all" else f"{d}, auto"]))
        for save in ("all", "auto") for d in (True, False)
    ]
    header = (
        f"{'contexts':<68} | {'ms/step':>8} | {'ratio':>6} | {'user s':>7} | {'sys s':>7} | "
        f"{'CPU/wall':>8} | {'grads identical':>15}"
    )
    print(header)
    print("-" * len(header))
    for name, label, same in rows:
        user, system = cpu[name]
        print(
            f"{label:<68} | {t[name] * 1e3:>8.1f} | {t[name] / t[IN_MEMORY]:>6.2f} | {user:>7.3f} | "
            f"{system:>7.3f} | {(user + system) / t[name]:>8.2f} | {same:>15}"
        )
    print("save='auto' against jax.grad's values (the in-memory 'all'), largest relative difference: "
          + ", ".join(f"durable={d}: {e:.1e}" for d, e in s["auto_rel_diff"].items()))


# ----------------------------------------------------------------------------------------------
# Part 2c: a budget bounds the device memory of the store's contexts (issue 26)

BUDGET_CONTEXTS = 2
IN_MEMORY_BUDGET = "in memory, all"
BUDGETED = "store, budget {} contexts, durable={}"


def _context_device_bytes() -> int:
    """Bytes of the device-memory arrays that live contexts hold as their own (intermediates and
    inputs, each array once), found by walking every live ``rs.ResidualContext``: the store's,
    the one the step holds, loads ahead. Not the step's gradients or temporaries, and not a
    pending write's host copy (a NumPy view on a CPU, pinned host memory on a GPU)."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, rs.ResidualContext):
            for x, kind in zip(obj.residuals, obj.spec.kinds):
                if kind in ("intermediate", "input") and isinstance(x, jax.Array) and not jax.dtypes.issubdtype(
                    x.dtype, jax.dtypes.prng_key
                ) and (
                    x.sharding.memory_kind in (None, next(iter(x.sharding.device_set)).default_memory().kind)
                ):
                    seen[id(x)] = x.nbytes
    return sum(seen.values())


def budgeted_step(store: rs.Store, fwd: rs.Split, calls: list[tuple], ct: Any, sample: Callable[[Any], None] | None = None) -> Any:
    """F1..Fn then Bn..B1 with the order declared (``store.schedule``) and no ``flush``, each
    context popped for its backward: the store loads ahead and spills what is needed last on its
    own. ``sample(grads)`` runs after
    every put and get (the memory pass; ``None`` when timed)."""
    keys = [f"mb{i}" for i in range(len(calls))]
    store.schedule(keys[::-1])
    grads = None
    for key, call in zip(keys, calls):
        store.put(fwd(*call)[1], key)
        if sample is not None:
            sample(grads)
    for key in keys[::-1]:
        ctx = store.pop(key)  # used once: the store keeps nothing of it
        if sample is not None:
            sample(grads)
        grads = stacks.add_trees(grads, fwd.backward(ctx, ct))
        del ctx
    return jax.block_until_ready(grads)


def measure_budget(base: Path, repeats: int) -> dict[str, Any]:
    """The peak of the store's live device bytes over a spilled schedule (``jax.live_arrays()``
    after every put and get, writes in flight: no ``flush``), against the budget; and the step
    time against the step in memory."""
    cfg = SCHEDULE
    n = cfg.n_microbatches
    params = init_transformer(jax.random.key(cfg.seed), cfg)
    fwd = rs.split(lambda p, tokens, k: transformer_loss(p, tokens, k, cfg), argnums=0, has_aux=True)
    data_key, drop_key = jax.random.split(jax.random.key(3))
    tokens = jax.random.randint(data_key, (n, cfg.microbatch, cfg.seq_len + 1), 0, cfg.vocab)
    calls = [(params, tokens[i], k) for i, k in enumerate(jax.random.split(drop_key, n))]
    ct = jnp.float32(1.0 / n)
    one = fwd(*calls[0])[1].spec.own_nbytes
    budget = BUDGET_CONTEXTS * one
    labels = {d: BUDGETED.format(BUDGET_CONTEXTS, d) for d in (False, True)}
    stores = {d: rs.Store(base / f"budget-{int(d)}", device_budget=budget, host_budget=0, durable=d) for d in labels}
    try:
        reference = jax.tree.leaves(stacks.in_memory_step(fwd, calls, ct))
        peaks: dict[bool, dict[str, int]] = {}
        identical: dict[bool, bool] = {}
        for d, store in stores.items():
            store.flush()
            peak = {"held": 0, "pending": 0}

            def sample(grads: Any, store: rs.Store = store, peak: dict[str, int] = peak) -> None:
                jax.block_until_ready(grads)  # the backward in flight still holds the context it got
                held = _context_device_bytes()
                if held >= peak["held"]:
                    peak.update(held=held, pending=store.stats()["pending"]["bytes"])

            got = jax.tree.leaves(budgeted_step(store, fwd, calls, ct, sample))
            identical[d] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, reference))
            store.flush()
            peaks[d] = peak
        cases = {
            IN_MEMORY_BUDGET: Case(lambda: stacks.in_memory_step(fwd, calls, ct)),
            **{label: Case(lambda d=d: budgeted_step(stores[d], fwd, calls, ct), teardown=stores[d].flush) for d, label in labels.items()},
        }
        t = interleaved_medians(cases, repeats)
    finally:
        for s in stores.values():
            s.close()
    return {"one": one, "budget": budget, "peaks": peaks, "identical": identical, "t": t, "n": n}


def _print_budget(b: dict[str, Any], reps: int) -> None:
    mib = 2**20
    print(
        f"\nbudget: {b['n']} microbatches of the schedule's transformer, F1..F{b['n']} then B{b['n']}..B1 declared "
        f"with store.schedule, no flush in the step; Store(path, device_budget={BUDGET_CONTEXTS} contexts = "
        f"{b['budget'] / mib:.2f} MiB, host_budget=0); one context {b['one'] / mib:.2f} MiB; peak: the device "
        f"arrays every live context holds as its own (the store's, loads ahead, the one the step got), after "
        f"every put and get once the backward in flight is done; pending: stats()['pending']['bytes'] then "
        f"(host copies); medians of {reps} steps, round-robin"
    )
    header = (f"{'durable':>7} | {'peak MiB':>8} | {'peak / (budget + one)':>21} | {'pending MiB then':>16} | "
              f"{'ms/step':>8} | {'/ in memory':>11} | grads identical")
    print(header)
    print("-" * len(header))
    t, bound = b["t"], b["budget"] + b["one"]
    for d, peak in b["peaks"].items():
        label = BUDGETED.format(BUDGET_CONTEXTS, d)
        print(
            f"{d!s:>7} | {peak['held'] / mib:>8.2f} | {peak['held'] / bound:>21.2f} | {peak['pending'] / mib:>16.2f} | "
            f"{t[label] * 1e3:>8.1f} | {t[label] / t[IN_MEMORY_BUDGET]:>11.2f} | {b['identical'][d]}"
        )


def _budget_goals(goals: Goals, b: dict[str, Any]) -> None:
    bound = b["budget"] + b["one"]
    for d, peak in b["peaks"].items():
        goals.check(
            f"contexts' peak live device bytes, spilled schedule (durable={d}) <= budget + one context",
            peak["held"] <= bound, f"{peak['held'] / 2**20:.2f} MiB", f"<= {bound / 2**20:.2f} MiB",
        )
    goals.ratio(
        f"budgeted schedule ({BUDGET_CONTEXTS} contexts on device, durable=False) / in memory",
        b["t"][BUDGETED.format(BUDGET_CONTEXTS, False)] / b["t"][IN_MEMORY_BUDGET], "<=", 1.10,
    )
    goals.check(
        "budgeted schedule gradients bit-identical to in memory", all(b["identical"].values()),
        ", ".join(f"durable={d}: {'identical' if ok else 'DIFFER'}" for d, ok in b["identical"].items()),
        "np.array_equal",
    )


# ----------------------------------------------------------------------------------------------
# Part 5: an S3-compatible object store on loopback


def measure_object_store(base: Path, sizes: list[int], repeats: int) -> list[dict[str, Any]] | str:
    """put+flush and get (a fresh ``Store`` per get) on moto's S3 server on loopback against a
    local folder (``durable=True``: an object store's PUT returns once the object is stored),
    per size; or why it cannot run."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import s3_server  # noqa: PLC0415 - the tests' loopback server, for this part only

    if not s3_server.available():
        return "moto[s3] and flask are not installed (pip install -e '.[test]')"
    os.environ.update(s3_server.CREDENTIALS)
    server = s3_server.S3Server().start()
    rows = []
    try:
        server.make_bucket("bench")
        for mib in sizes:
            ctx = make_context(mib << 20)
            where = {"local folder": str(base / f"s3-local-{mib}"), "s3 on loopback": server.spec("bench", f"b{mib}/")}
            stores = {name: rs.Store(path, durable=True) for name, path in where.items()}
            fresh = _Fresh(base)
            try:
                for store in stores.values():
                    _put_flush(store, ctx, "read")
                cases = {}
                for name, store in stores.items():
                    cases[f"{name} put+flush"] = fresh.key_case(store, lambda k, s=store: _put_flush(s, ctx, k))

                    def get(path: Any = where[name]) -> Any:
                        with rs.Store(path, read_only=True) as reader:
                            return reader.get("read").residuals

                    cases[f"{name} get"] = Case(get)
                t = interleaved_medians(cases, repeats)
            finally:
                for store in stores.values():
                    store.close()
            for op in ("put+flush", "get"):
                local, remote = t[f"local folder {op}"], t[f"s3 on loopback {op}"]
                rows.append({"MiB": mib, "op": op, "local ms": local * 1e3, "s3 ms": remote * 1e3,
                             "s3 GB/s": ctx.nbytes / remote / 1e9, "local / s3": local / remote})
    finally:
        server.stop()
    return rows


def _print_object_store(rows: list[dict[str, Any]] | str, repeats: int) -> None:
    print(
        f"\nobject store: moto's S3 server on loopback (python -m moto.server, objects in its memory) "
        f"through tensorstore's s3 driver, against a local folder (durable=True); medians of "
        f"{repeats}, round-robin; get opens a fresh Store; local / s3 = local time / s3 time"
    )
    if isinstance(rows, str):
        print(f"  not measured: {rows}")
        return
    header = f"{'size':>6} | {'op':<10} | {'local ms':>9} | {'s3 ms':>9} | {'s3 GB/s':>8} | {'local / s3':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['MiB']:>4}MiB | {r['op']:<10} | {r['local ms']:>9.2f} | {r['s3 ms']:>9.2f} | "
              f"{r['s3 GB/s']:>8.2f} | {r['local / s3']:>9.2f}x")


# ----------------------------------------------------------------------------------------------
# Part 3: put latency


def measure_first_put(base: Path, repeats: int) -> dict[str, float]:
    """Median seconds of a put that saves the signature's backward, of a later put, and of the
    export itself (see Part 3 of the module docstring)."""
    from residual_store._src.store import backwards

    cfg = SCHEDULE
    params = init_transformer(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (cfg.microbatch, cfg.seq_len + 1), 0, cfg.vocab)
    fwd = rs.split(lambda p, t, k: transformer_loss(p, t, k, cfg), has_aux=True)
    _, ctx = fwd(params, tokens, jax.random.key(2))
    jax.block_until_ready(ctx)
    timed: dict[str, list[float]] = {"first": [], "later": [], "export": []}

    def clock(name: str, fn: Callable[[], Any], keep: bool) -> None:
        start = time.perf_counter()
        fn()
        if keep:
            timed[name].append(time.perf_counter() - start)

    for i in range(repeats + 1):  # the first round warms up
        with rs.Store(base / f"put{i}") as store:
            clock("first", lambda: store.put(ctx, "a"), i > 0)
            store.flush()
            clock("later", lambda: store.put(ctx, "b"), i > 0)
        clock("export", lambda: backwards.serialize(ctx._backward, ctx.spec.avals, None), i > 0)
        shutil.rmtree(base / f"put{i}", ignore_errors=True)
    return {name: statistics.median(ts) for name, ts in timed.items()}


def _print_first_put(p: dict[str, float]) -> None:
    print("\nput latency, demo transformer context (caller's thread; medians):")
    _print_table(
        ["put", "ms", "/ later put"],
        [
            ["first put of a signature (saves its backward)", f"{1e3 * p['first']:.3f}", f"{p['first'] / p['later']:.2f}"],
            ["later put of that signature", f"{1e3 * p['later']:.3f}", "1.00"],
            ["jax.export of the backward (writer thread)", f"{1e3 * p['export']:.3f}", f"{p['export'] / p['later']:.0f}"],
        ],
    )


# ----------------------------------------------------------------------------------------------
# Goals


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    """Columns separated by `` | ``; the first left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(header))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


class Goals:
    """The goals table: goal | measured | target | verdict."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = []

    def ratio(self, goal: str, value: float | None, op: str, target: float, note: str = "") -> None:
        """``value`` (a ratio, or ``None``: not measured, then ``note`` says why) ``op`` ``target``."""
        want = f"{op} {target:.2f}x"
        if value is None:
            self.rows.append([goal, f"n/a ({note})", want, "n/a"])
            return
        ok = value >= target if op == ">=" else value <= target
        self.rows.append([goal, f"{value:.2f}x" + (f" ({note})" if note else ""), want, "PASS" if ok else "MISS"])

    def check(self, goal: str, ok: bool, measured: str, target: str) -> None:
        self.rows.append([goal, measured, target, "PASS" if ok else "MISS"])

    def show(self) -> None:
        if not self.rows:
            print("\n(no goals in this part)")
            return
        print(
            "\ngoals (issue 12): I/O: x raw = raw time / store time (higher is better); round trip: "
            "Orbax time / store time; schedule, split: time / baseline time (lower is better)"
        )
        _print_table(["goal", "measured", "target", "verdict"], self.rows)


def _io_goals(goals: Goals, t_by_size: dict[int, dict[str, float]], have_orbax: bool) -> None:
    for mib, target in _IO_TARGETS.items():
        t = t_by_size.get(mib)
        if t is None and mib not in (2, 64):
            continue  # 512 MiB: goals only when measured

        def speed(raw: str, ours: str, t: dict[str, float] | None = t, mib: int = mib) -> tuple[float | None, str]:
            if t is None:
                return None, f"{mib} MiB not in --sizes"
            if ours not in t:
                return None, "cannot drop the page cache here"
            return t[raw] / t[ours], ""

        put = speed(RAW_WRITE_FSYNC, STORE_PUT.format(True))
        goals.ratio(f"{mib} MiB put+flush durable vs raw write+fsync", put[0], ">=", target, put[1])
        for mode in ("cold", "warm"):
            get = speed(f"{RAW_READ} [{mode}]", f"{STORE_GET_OPEN} [{mode}]")
            fresh = speed(f"{RAW_READ} [{mode}]", f"{STORE_GET} [{mode}]")
            note = get[1] or (f"a fresh Store: {fresh[0]:.2f}x" if fresh[0] is not None else "")
            goals.ratio(f"{mib} MiB get {mode} (open Store) vs raw readinto+device_put", get[0], ">=", target, note)
    t = t_by_size.get(_ROUND_TRIP_MIB)
    goal = f"{_ROUND_TRIP_MIB} MiB durable round trip, Orbax time / store time"
    if t is None or not have_orbax:
        goals.ratio(goal, None, ">=", 10.0, f"{_ROUND_TRIP_MIB} not in --sizes" if t is None else "no Orbax")
    else:
        ours, theirs, floor = t[STORE_ROUND_TRIP], t[ORBAX_ROUND_TRIP], t[RAW_ROUND_TRIP]
        goals.ratio(
            goal, theirs / ours, ">=", 10.0,
            f"{ours * 1e3:.1f} vs {theirs * 1e3:.1f} ms; raw write+fsync and read: {theirs / floor:.2f}x",
        )


def _schedule_goals(goals: Goals, s: dict[str, Any]) -> None:
    t = s["t"]
    for durable, target in ((False, 1.15), (True, 1.25)):
        goals.ratio(
            f"spilled schedule (durable={durable}) / in memory",
            t[SPILLED.format(durable)] / t[IN_MEMORY], "<=", target,
        )  # fmt: skip
    goals.ratio(
        "spilled schedule, save='auto' (durable=False) / in memory 'all'",
        t[SPILLED_AUTO.format(False)] / t[IN_MEMORY], "<=", 1.10,
    )  # fmt: skip
    same = s["identical"]
    goals.check(
        "spilled schedule gradients bit-identical to in memory",
        all(same.values()),
        ", ".join(f"durable={d}: {'identical' if ok else 'DIFFER'}" for d, ok in same.items()),
        "np.array_equal",
    )


def _split_goal(goals: Goals, runs: int) -> None:
    name = "MLP 8x1024 tanh, batch 256"
    m = measure_model(name, *mlp_case(quick=False), runs)
    print(
        f"\nsplit: {name}: fused value_and_grad {m['fused ms']:.2f} ms, split fwd {m['split fwd ms']:.2f} ms "
        f"+ bwd {m['split bwd ms']:.2f} ms; medians of {runs} runs (benchmarks/split_overhead.py)"
    )
    goals.ratio(f"split fwd+bwd / fused value_and_grad ({name})", m["split total / fused"], "<=", 1.10)


# ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default=_DEFAULT_SIZES, help=f"context sizes in MiB (default {_DEFAULT_SIZES}; 512 optional)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs per number (default: 21 at 2 and 4 MiB, 9 at 64, 7 at 512; 5 for the "
        "schedule; about a third of that with --quick)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="the same, with fewer repeats: a minute or two"
    )
    parser.add_argument("--no-orbax", action="store_true", help="skip the Orbax baseline")
    parser.add_argument("--dir", default=None, help="folder to write in (default: a temp dir)")
    parser.add_argument("--part", choices=("all", "io", "schedule", "budget", "stacks", "put", "split", "s3"), default="all")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]

    def repeats_for(mib: int) -> int:
        if args.repeats is not None:
            return args.repeats
        table = _QUICK_REPEATS if args.quick else _DEFAULT_REPEATS
        return table.get(mib, max(3, min(15, 512 // max(mib, 1))))

    def repeats_or(quick: int, full: int) -> int:
        return args.repeats if args.repeats is not None else (quick if args.quick else full)

    base = Path(args.dir or tempfile.mkdtemp(prefix="store_throughput_"))
    base.mkdir(parents=True, exist_ok=True)
    goals = Goals()
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
                "base/ms = baseline time / time (higher is faster); GB/s = context bytes / time\n"
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
            _print_checksums(t_by_size)
            _io_goals(goals, t_by_size, orbax is not None)
        if args.part in ("all", "schedule"):
            reps = repeats_or(3, 5)
            s = measure_schedule(base, reps)
            _print_schedule(s, reps)
            _schedule_goals(goals, s)
        if args.part in ("all", "budget"):  # a budget bounds device memory, writes in flight (issue 26)
            reps = repeats_or(3, 7)
            b = measure_budget(base, reps)
            _print_budget(b, reps)
            _budget_goals(goals, b)
        if args.part in ("all", "stacks"):  # contexts of hundreds of small residuals (issue 25)
            for goal, value, target, op in stacks.report(base, repeats_or(5, 9)):
                if "files" in goal:
                    goals.check(goal, value <= target, f"{value}", f"<= {target}")
                else:
                    goals.ratio(goal, value, op, target)
        if args.part in ("all", "put"):
            _print_first_put(measure_first_put(base, repeats_or(3, 9)))
        if args.part in ("all", "split"):
            _split_goal(goals, repeats_or(15, 30))
        if args.part in ("all", "s3"):
            reps = repeats_or(3, 7)
            _print_object_store(measure_object_store(base, [4, 64], reps), reps)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    goals.show()


if __name__ == "__main__":
    main()
