"""The README's main job: a small transformer trained with a pipeline-style schedule.

Each step splits the batch into microbatches, runs every forward first (F1..Fn), offloading each
residual context to a store whose memory budgets hold only a few (the rest spill to disk), then
every backward in reverse (Bn..B1), prefetching the next context while the current backward
runs, and checks the summed gradients against ``jax.grad`` of the full batch. All microbatches
share one signature, so the whole run costs one forward and one backward compile.

The model here (:func:`init_transformer`, :func:`transformer_loss`) is also what the tests and
benchmarks use: a pre-layernorm causal transformer with its layers under ``lax.scan`` and
``jax.checkpoint`` (saving only the named attention and MLP outputs), dropout from a typed PRNG
key, integer tokens, and an accuracy ``aux`` output.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

__all__ = ["DemoConfig", "init_transformer", "transformer_loss", "run_demo"]

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes and schedule of the demo; the defaults run in about 30 s on two idle CPU cores (32 s
    measured 2026-12-06, most of it compiling), and up to about 90 s where other work shares
    them (61 to 86 s measured)."""

    vocab: int = 64
    d_model: int = 64
    n_heads: int = 4
    d_ff: int = 128
    n_layers: int = 2
    seq_len: int = 32
    microbatch: int = 4
    n_microbatches: int = 8
    steps: int = 3
    learning_rate: float = 0.05
    dropout: float = 0.1
    remat: bool = True  # the layers under jax.checkpoint saving only named outputs; False: a plain scan
    compare_save: bool = True  # one more step per save choice and layer variant (save="all" vs "auto")
    seed: int = 0

    def __post_init__(self) -> None:
        from residual_store._src.errors import InvalidArgumentError

        for name in ("steps", "n_microbatches", "n_layers", "microbatch", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"DemoConfig.{name} must be a whole number of at least 1, got {value!r}")


def init_transformer(key: jax.Array, cfg: DemoConfig, dtype: Any = jnp.float32) -> Params:
    """Random parameters; per-layer weights are stacked on a leading ``n_layers`` axis."""
    k = jax.random.split(key, 6)
    d, f, n = cfg.d_model, cfg.d_ff, cfg.n_layers

    def normal(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return (jax.random.normal(key, shape) / jnp.sqrt(fan_in)).astype(dtype)

    return {
        "embed": normal(k[0], (cfg.vocab, d), d),
        "pos": normal(k[1], (cfg.seq_len, d), 1) * 0.1,
        "layers": {
            "ln1": jnp.ones((n, d), dtype),
            "wqkv": normal(k[2], (n, d, 3 * d), d),
            "wo": normal(k[3], (n, d, d), d),
            "ln2": jnp.ones((n, d), dtype),
            "w1": normal(k[4], (n, d, f), d),
            "w2": normal(k[5], (n, f, d), f),
        },
        "ln_f": jnp.ones((d,), dtype),
    }


def _layernorm(x: jax.Array, scale: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def _block(cfg: DemoConfig, train: bool) -> Callable[..., Any]:
    def block(x: jax.Array, layer: tuple[Params, jax.Array]) -> tuple[jax.Array, None]:
        p, key = layer
        b, t, d = x.shape
        h = _layernorm(x, p["ln1"])
        q, k, v = jnp.split(h @ p["wqkv"], 3, axis=-1)
        heads = lambda z: z.reshape(b, t, cfg.n_heads, d // cfg.n_heads)
        logits = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / jnp.sqrt(d // cfg.n_heads)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        attn = jnp.einsum("bhqk,bkhd->bqhd", weights, heads(v)).reshape(b, t, d)
        attn = checkpoint_name(attn @ p["wo"], "attn_out")
        if train and cfg.dropout > 0:
            keep = jax.random.bernoulli(key, 1.0 - cfg.dropout, attn.shape)
            attn = jnp.where(keep, attn / (1.0 - cfg.dropout), 0.0)
        x = x + attn
        hidden = checkpoint_name(jax.nn.gelu(_layernorm(x, p["ln2"]) @ p["w1"]), "mlp_hidden")
        return x + hidden @ p["w2"], None

    return block


def _embed(params: Params, inputs: jax.Array) -> jax.Array:
    return params["embed"][inputs] + params["pos"][: inputs.shape[1]]


def _layers(layers: Params, x: jax.Array, keys: jax.Array, cfg: DemoConfig) -> jax.Array:
    """The blocks, one per leading index of ``layers``, under ``lax.scan``; with ``cfg.remat``
    each under ``jax.checkpoint`` saving only the attention and MLP outputs (a hand-written
    policy), else plain (``jax.vjp`` keeps every intermediate of every layer)."""
    body = _block(cfg, train=True)
    if cfg.remat:
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.save_only_these_names("attn_out", "mlp_hidden"))
    return jax.lax.scan(body, x, (layers, keys))[0]


def _head(params: Params, x: jax.Array, targets: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    logits = (_layernorm(x, params["ln_f"]) @ params["embed"].T).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    accuracy = jnp.mean((jnp.argmax(logits, -1) == targets).astype(jnp.float32))
    return jnp.mean(nll), {"accuracy": accuracy}


def transformer_loss(
    params: Params, tokens: jax.Array, key: jax.Array, cfg: DemoConfig = DemoConfig()
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy of ``tokens`` (int ``[batch, seq_len + 1]``) and its accuracy."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    keys = jax.random.split(key, cfg.n_layers)
    x = _layers(params["layers"], _embed(params, inputs), keys, cfg)
    return _head(params, x, targets)


def _tree_max_rel_diff(a: Any, b: Any) -> float:
    diffs = jax.tree.map(
        lambda x, y: jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-12), a, b
    )
    return float(max(jax.tree.leaves(diffs)))


@dataclasses.dataclass
class _Timeline:
    """The contexts' own bytes per tier after every step of a schedule, for the table and the
    plot (the same quantity on every tier: what the budgets count)."""

    labels: list[str] = dataclasses.field(default_factory=list)
    device: list[int] = dataclasses.field(default_factory=list)
    host: list[int] = dataclasses.field(default_factory=list)
    disk: list[int] = dataclasses.field(default_factory=list)
    pending: list[int] = dataclasses.field(default_factory=list)  # host copies waiting for their write

    def record(self, label: str, stats: dict[str, dict[str, int]]) -> None:
        self.labels.append(label)
        self.device.append(stats["device"]["bytes"])
        self.host.append(stats["host"]["bytes"])
        self.disk.append(stats["disk"]["own_bytes"])
        self.pending.append(stats["pending"]["bytes"])


def _split_params(params: Params, k: int) -> tuple[Params, Params, Params]:
    """The embedding's, the first ``k`` layers' and the rest's (the head shares the embedding)."""
    layers = params["layers"]
    return (
        {"embed": params["embed"], "pos": params["pos"]},
        jax.tree.map(lambda x: x[:k], layers),
        {"layers": jax.tree.map(lambda x: x[k:], layers), "ln_f": params["ln_f"], "embed": params["embed"]},
    )


def _zero_bubble_step(
    cfg: DemoConfig, params: Params, tokens: jax.Array, drop_keys: jax.Array, store: Any, timeline: _Timeline
) -> tuple[Params, dict[str, Any]]:
    """One step of the model as a two-stage pipeline in the ZB-H1-style order: stage 1 runs the
    first half of the layers on the embedded tokens, stage 2 the rest, the head and the loss; each
    backward is split into B (``now=1``: the input gradient, sent to the stage before at once)
    and W (``rs.backward(later)``, deferred), and every context and ``later`` goes through
    ``store`` under its declared order of gets. Returns the summed gradients (the full model's
    structure) and what ran."""
    import residual_store as rs
    from residual_store.pipeline import timeline as pipeline_timeline

    n, k = cfg.n_microbatches, max(1, cfg.n_layers // 2)
    emb_params, first_params, last_params = _split_params(params, k)
    first = rs.split(lambda layers, x, keys: _layers(layers, x, keys, cfg), argnums=(0, 1))
    last = rs.split(lambda p, x, tokens, keys: _head(p, _layers(p["layers"], x, keys, cfg), tokens[:, 1:])[0],
                    argnums=(0, 1))
    steps = pipeline_timeline(2, n, split_backward=True)
    key_of = lambda st: f"zb-s{st.stage + 1}-{'w' if st.op == 'W' else 'f'}{st.microbatch}"  # noqa: E731
    store.schedule([key_of(st) for st in steps if st.op != "F"])
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
    g_emb, g_first, g_last = zeros(emb_params), zeros(first_params), zeros(last_params)
    acts: dict[int, jax.Array] = {}
    cts: dict[int, jax.Array] = {}
    embed_vjps: dict[int, Any] = {}
    for st in steps:
        i = st.microbatch
        layer_keys = jax.random.split(drop_keys[i], cfg.n_layers)
        if (st.op, st.stage) == ("F", 0):
            x, embed_vjps[i] = jax.vjp(lambda e: _embed(e, tokens[i][:, :-1]), emb_params)
            acts[i], ctx = first(first_params, x, layer_keys[:k])
            store.put(ctx, key_of(st))
        elif (st.op, st.stage) == ("F", 1):
            store.put(last(last_params, acts.pop(i), tokens[i], layer_keys[k:])[1], key_of(st))
        elif (st.op, st.stage) == ("B", 1):
            cts[i], later = last.backward(store.pop(key_of(st)), jnp.float32(1.0 / n), now=1)
            store.put(later, key_of(dataclasses.replace(st, op="W")))
        elif (st.op, st.stage) == ("B", 0):
            g_x, later = first.backward(store.pop(key_of(st)), cts.pop(i), now=1)
            store.put(later, key_of(dataclasses.replace(st, op="W")))
            g_emb = jax.tree.map(jnp.add, g_emb, embed_vjps.pop(i)(g_x)[0])
        elif st.stage == 0:  # W
            g_first = jax.tree.map(jnp.add, g_first, rs.backward(store.pop(key_of(st))))
        else:
            g_last = jax.tree.map(jnp.add, g_last, rs.backward(store.pop(key_of(st))))
        timeline.record(f"{st.label} s{st.stage + 1}", store.stats())
    store.schedule([])
    grads = {
        "embed": g_emb["embed"] + g_last["embed"],
        "pos": g_emb["pos"],
        "layers": jax.tree.map(lambda a, b: jnp.concatenate([a, b]), g_first, g_last["layers"]),
        "ln_f": g_last["ln_f"],
    }
    compiles = {name: (f.cache_info().forward_compiles, f.cache_info().backward_compiles)
                for name, f in (("stage 1", first), ("stage 2", last))}
    return grads, {"steps": steps, "compiles": compiles}


def _one_step(fwd: Any, params: Params, tokens: jax.Array, drop_keys: jax.Array, store: Any = None) -> Any:
    """One step, F1..Fn then Bn..B1, with the contexts in a list, or through ``store`` (each
    put, then read back one backward ahead); the summed gradients."""
    n = len(drop_keys)
    if store is None:
        contexts: Any = reversed([fwd(params, tokens[i], drop_keys[i])[1] for i in range(n)])
    else:
        keys = [store.put(fwd(params, tokens[i], drop_keys[i])[1], f"mb{i}") for i in range(n)]

        def gets() -> Any:
            for i in reversed(range(n)):
                if i > 0:
                    store.prefetch(keys[i - 1])
                yield store.pop(keys[i])

        contexts = gets()
    grads = None
    for ctx in contexts:
        g = fwd.backward(ctx, jnp.float32(1.0 / n))
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    return grads


def _save_comparison(
    cfg: DemoConfig, params: Params, tokens: jax.Array, drop_keys: jax.Array, folder: str,
    reference: Callable[..., Any], repeats: int = 5, progress: Callable[[str], None] = lambda line: None,
) -> list[dict[str, Any]]:
    """``save="all"`` against ``save="auto"``, for the layers under the demo's hand-written
    checkpoint policy and as a plain scan: one step (:func:`_one_step`) with the contexts in a
    list, and through a store with zero budgets (each context spilled to disk, read back ahead of
    its backward). Per row: the contexts' own bytes, the medians of ``repeats`` steps (after one
    to compile) and the gradients' largest relative difference from ``jax.grad``."""
    import residual_store as rs

    want = reference(params, tokens, drop_keys)

    def median_seconds(step: Callable[[], Any]) -> tuple[float, Any]:
        grads = step()  # compiles
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step())
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2], grads

    rows: list[dict[str, Any]] = []
    for remat in (True, False):
        variant = dataclasses.replace(cfg, remat=remat)
        for save in ("all", "auto"):
            fwd = rs.split(lambda p, t, k, c=variant: transformer_loss(p, t, k, c), argnums=0, has_aux=True, save=save)
            step = functools.partial(_one_step, fwd, params, tokens, drop_keys)
            name = f"{'checkpoint' if remat else 'plain'}-{save}"
            progress(f"{name}: {len(rows) + 1} of 4")
            with rs.Store(os.path.join(folder, name), device_budget=0, host_budget=0, durable=False) as store:
                t_memory, grads = median_seconds(step)
                t_spilled, spilled_grads = median_seconds(functools.partial(step, store=store))
            rows.append({
                "layers": "jax.checkpoint, named outputs saved" if remat else "plain lax.scan",
                "save": save,
                "own_bytes": fwd(params, tokens[0], drop_keys[0])[1].spec.own_nbytes,
                "ms_in_memory": t_memory * 1e3,
                "ms_spilled": t_spilled * 1e3,
                "max_rel_grad_diff": max(_tree_max_rel_diff(grads, want), _tree_max_rel_diff(spilled_grads, want)),
            })
    return rows


def _print_save_comparison(print_fn: Callable[[str], None], rows: list[dict[str, Any]], cfg: DemoConfig) -> None:
    n = cfg.n_microbatches
    table = [("layers", "save", "MiB/context", "ms/step in memory", "ms/step spilled", "max rel. grad diff")]
    base = {r["layers"]: r for r in rows if r["save"] == "all"}
    for r in rows:
        ratio = r["own_bytes"] / base[r["layers"]]["own_bytes"]
        table.append((r["layers"], repr(r["save"]), f"{r['own_bytes'] / 2**20:.2f} ({ratio:.2f}x)",
                      f"{r['ms_in_memory']:.1f}", f"{r['ms_spilled']:.1f}", f"{r['max_rel_grad_diff']:.1e}"))
    widths = [max(len(t[c]) for t in table) for c in range(len(table[0]))]
    print_fn(
        f"save='all' vs save='auto': one step, F1..F{n} then B{n}..B1, contexts in a list (in memory) or "
        f"through a store with budgets 0 (spilled: every context to disk and back)"
    )
    print_fn("\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table))


def run_demo(
    cfg: DemoConfig = DemoConfig(),
    *,
    store_path: str | None = None,
    plot_path: str | None = "residual_store_demo.png",
    print_fn: Callable[[str], None] = print,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Trains ``cfg.steps`` steps with a pipeline-style schedule, offloading every context.

    Per step: forwards F1..Fn, each context ``put`` into a :class:`~residual_store.Store`
    whose device and host budgets hold only a few contexts (the rest spill to disk); then
    backwards Bn..B1, each prefetching the next context before popping its own. Gradients are
    checked against ``jax.grad`` of the full batch. Then one more batch runs through the same
    model cut into two pipeline stages, in a zero-bubble (ZB-H1-style) order: each backward
    split into B (``now=1``) and a deferred W, the contexts and ``later`` contexts through the
    same store under a declared ``store.schedule``, the gradients checked likewise.

    Returns a dict with ``losses``, ``max_rel_grad_diff`` (per step), ``cache_info``,
    ``timings`` (seconds: forward, backward, io), ``peak_bytes`` per tier, ``budgets``,
    ``plot`` (the PNG's path, or ``None`` without matplotlib) and ``zero_bubble`` (its
    ``steps``, ``compiles`` per stage and ``max_rel_grad_diff``) and ``save``: ``save="all"``
    against ``save="auto"`` on one more step, for the layers under the demo's checkpoint policy
    and as a plain scan (rows with ``own_bytes``, ``ms_in_memory``, ``ms_spilled``,
    ``max_rel_grad_diff``). ``timeout``: seconds each request to an object store may take (a
    ``store_path`` such as ``s3://bucket/run``; ``None``: the store's default).
    """
    import tempfile

    import residual_store as rs
    from residual_store._src.store.disk.backends import resolve_path

    if store_path is not None:
        resolve_path(store_path)  # a path the store refuses is refused now, not after a compile

    key = jax.random.key(cfg.seed)
    params = init_transformer(key, cfg)
    loss_fn = lambda p, tokens, k: transformer_loss(p, tokens, k, cfg)
    fwd = rs.split(loss_fn, argnums=0, has_aux=True)
    reference = jax.jit(jax.grad(lambda p, t, ks: _mean_loss(loss_fn, p, t, ks), argnums=0))
    n = cfg.n_microbatches
    losses, diffs = [], []
    timings = {"forward": 0.0, "backward": 0.0, "io": 0.0}
    timeline = _Timeline()
    zb_timeline = _Timeline()
    scratch = tempfile.TemporaryDirectory(prefix="residual-store-demo-")  # removed at the end
    path = store_path or os.path.join(scratch.name, "store")
    kept = store_path is not None

    store: rs.Store | None = None  # (closed, and the scratch folder removed, however the run ends: a Ctrl-C too)
    try:
        where = path if kept else "a temporary store (removed at the end; --store DIR keeps one)"
        print_fn(
            f"residual-store demo: {cfg.n_layers}-layer transformer, {n} microbatches of "
            f"{cfg.microbatch}x{cfg.seq_len} tokens, {cfg.steps} steps; schedule F1..F{n}, B{n}..B1 "
            f"with every context offloaded to {where}"
        )
        # Size the budgets from one context: the device holds 2, host memory 3, the rest go to disk.
        probe_tokens = jnp.zeros((cfg.microbatch, cfg.seq_len + 1), jnp.int32)
        context_bytes = fwd(params, probe_tokens, key)[1].spec.own_nbytes  # what the budgets count
        budgets = {"device": 2 * context_bytes, "host": 3 * context_bytes}
        store = rs.Store(path, device_budget=budgets["device"], host_budget=budgets["host"], durable=False, timeout=timeout)
        phases = 3 if cfg.compare_save else 2
        progress = _progress_line(print_fn)
        print_fn(f"[1/{phases}] training: {cfg.steps} steps (the first one compiles the forward and the backward)")
        for step in range(cfg.steps):
            key, data_key, drop_key = jax.random.split(key, 3)
            tokens = jax.random.randint(data_key, (n, cfg.microbatch, cfg.seq_len + 1), 0, cfg.vocab)
            drop_keys = jax.random.split(drop_key, n)
            step_loss, keys = 0.0, []
            for i in range(n):
                start = time.perf_counter()
                (loss, _aux), ctx = fwd(params, tokens[i], drop_keys[i])
                step_loss += float(loss) / n
                middle = time.perf_counter()
                keys.append(store.put(ctx, f"step{step}-mb{i}"))
                timings["forward"] += middle - start
                timings["io"] += time.perf_counter() - middle
                timeline.record(f"F{i + 1}", store.stats())
                progress(f"step {step + 1}/{cfg.steps}: F{i + 1} of F1..F{n}")
            grads = None
            for i in reversed(range(n)):
                start = time.perf_counter()
                if i > 0:
                    store.prefetch(keys[i - 1])
                last_kept = kept and step == cfg.steps - 1  # a kept store keeps the last step's contexts
                ctx = store.get(keys[i]) if last_kept else store.pop(keys[i])
                middle = time.perf_counter()
                g = fwd.backward(ctx, jnp.float32(1.0 / n))
                grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
                jax.block_until_ready(grads)
                timings["io"] += middle - start
                timings["backward"] += time.perf_counter() - middle
                timeline.record(f"B{i + 1}", store.stats())
                progress(f"step {step + 1}/{cfg.steps}: B{i + 1} of B{n}..B1")
            diff = _tree_max_rel_diff(grads, reference(params, tokens, drop_keys))
            params = jax.tree.map(lambda p, g: p - cfg.learning_rate * g, params, grads)
            losses.append(step_loss)
            diffs.append(diff)
            progress("")
            print_fn(f"  step {step + 1}/{cfg.steps}: loss {step_loss:.4f}, max rel. grad diff {diff:.2e}")
        store.flush()
        if kept:
            store.gc(older_than=0)  # the popped contexts' recycled folders: nothing unreferenced is left
        peaks = {tier: max(getattr(timeline, tier)) for tier in ("device", "host", "pending", "disk")}
        _print_report(print_fn, timings, peaks, budgets, fwd.cache_info(), cfg)
        print_fn(f"[2/{phases}] zero-bubble: one more batch through the model as 2 pipeline stages")
        key, data_key, drop_key = jax.random.split(key, 3)
        tokens = jax.random.randint(data_key, (n, cfg.microbatch, cfg.seq_len + 1), 0, cfg.vocab)
        drop_keys = jax.random.split(drop_key, n)
        with rs.Store(os.path.join(scratch.name, "zero-bubble"), device_budget=budgets["device"],
                      host_budget=budgets["host"], durable=False) as zb_store:
            zb_grads, zb = _zero_bubble_step(cfg, params, tokens, drop_keys, zb_store, zb_timeline)
        zb["max_rel_grad_diff"] = _tree_max_rel_diff(zb_grads, reference(params, tokens, drop_keys))
        compiles = ", ".join(f"{name} {f} forward and {b} backward (B, W)" for name, (f, b) in zb["compiles"].items())
        print_fn(
            f"  zero-bubble step: the model as 2 stages, ZB-H1 order ({len(zb['steps'])} steps, B and W "
            f"split, W deferred), max rel. grad diff {zb['max_rel_grad_diff']:.2e}; compiles: {compiles}"
        )
        save_rows = []
        if cfg.compare_save:
            print_fn(f"[3/{phases}] save='all' vs save='auto': 4 variants, each compiled then timed over 5 steps")
            save_rows = _save_comparison(
                cfg, params, tokens, drop_keys, os.path.join(scratch.name, "save"), reference, progress=progress
            )
            progress("")
            _print_save_comparison(print_fn, save_rows, cfg)
    finally:
        if store is not None:
            store.close()
        scratch.cleanup()

    info = fwd.cache_info()
    if kept:
        print_fn(
            f"the store keeps step {cfg.steps}'s {n} contexts (step{cfg.steps - 1}-mb0..mb{n - 1}); look inside:\n"
            f"  residual-store ls {path}\n  residual-store inspect {path} step{cfg.steps - 1}-mb0\n"
            f"  residual-store du {path}"
        )
    first_step = _Timeline(*(getattr(timeline, f.name)[: 2 * n] for f in dataclasses.fields(_Timeline)))
    panels = [
        (f"one training step: F1..F{n}, then B{n}..B1 (every context through the store)", first_step),
        ("the same model as 2 pipeline stages, ZB-H1 order: B now, W (weight gradients) deferred, "
         "later contexts through the store", zb_timeline),
    ]
    plot = _plot(panels, budgets, plot_path, print_fn) if plot_path else None
    return {
        "losses": losses,
        "max_rel_grad_diff": diffs,
        "cache_info": info,
        "timings": timings,
        "peak_bytes": peaks,
        "budgets": budgets,
        "plot": plot,
        "zero_bubble": zb,
        "save": save_rows,
    }


def _progress_line(print_fn: Callable[[str], None]) -> Callable[[str], None]:
    """Where the demo prints to a terminal: a function that rewrites one status line on stderr
    (``""`` clears it); elsewhere (a pipe, a log, a ``print_fn`` of the caller's) one that does
    nothing, so logs hold only the phases and tables."""
    import sys

    from residual_store._src.cli_text import status_line

    if print_fn is not print or not sys.stderr.isatty():
        return lambda line: None
    return status_line


def _print_report(
    print_fn: Callable[[str], None],
    timings: dict[str, float],
    peaks: dict[str, int],
    budgets: dict[str, int],
    info: Any,
    cfg: DemoConfig,
) -> None:
    """One table (the steps' losses and gradient checks are printed as they run): peak bytes of
    the contexts' own residuals per tier against the budgets, time, compiles."""
    rows = [("tier (contexts' own bytes)", "peak bytes", "budget")]
    rows += [(t, f"{peaks[t]:,}", f"{budgets[t]:,}" if t in budgets else "-") for t in ("device", "host", "pending", "disk")]
    rows += [("", "", ""), ("time", "seconds", "")]
    rows += [(k, f"{v:.2f}", "") for k, v in timings.items()]
    rows += [("", "", ""), ("compiles", "forward", "backward")]
    rows += [(f"{cfg.steps * cfg.n_microbatches} microbatches", str(info.forward_compiles), str(info.backward_compiles))]
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    print_fn("\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows))


_OP_COLORS = {"F": "black", "B": "tab:purple", "W": "tab:green"}


def _plot(
    panels: list[tuple[str, _Timeline]], budgets: dict[str, int], path: str, print_fn: Callable[[str], None]
) -> str | None:
    """One panel per schedule: the contexts' own MiB per tier after each step, the budgets
    dashed, each step labelled on the x axis (F forward, B backward or input gradient, W weight
    gradient, coloured alike), the legend outside the data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print_fn("(no plot: pip install 'residual-store[plot]' to draw memory per tier over the schedule)")
        return None
    mib = 1 / 2**20
    widest = max(len(t.labels) for _, t in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(10, 0.28 * widest + 3), 4.2 * len(panels)), squeeze=False)
    for ax, (title, timeline) in zip(axes[:, 0], panels):
        x = list(range(len(timeline.labels)))
        tiers = (("device", "tab:red"), ("host", "tab:blue"), ("pending", "tab:orange"), ("disk", "tab:gray"))
        for tier, color in tiers:
            name = {"disk": "disk (committed)", "pending": "pending writes (host copies)"}.get(tier, tier)
            ax.step(x, [b * mib for b in getattr(timeline, tier)], where="post", label=name, color=color, linewidth=1.6)
            if tier in budgets:
                ax.axhline(budgets[tier] * mib, color=color, linestyle="--", linewidth=0.9, label=f"{tier} budget")
        ax.set_xticks(x, timeline.labels, rotation=90, fontsize=8)
        for tick, label in zip(ax.get_xticklabels(), timeline.labels):
            tick.set_color(_OP_COLORS.get(label[:1], "black"))
        ax.set_xlim(-0.5, len(x) - 0.5)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("schedule step, after each (F forward, B backward or input gradient, W weight gradient)", fontsize=9)
        ax.set_ylabel("MiB of contexts' own residuals", fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", linewidth=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as err:  # the run's results stand without it
        print_fn(f"(no plot: cannot write {path}: {err.strerror or err})")
        return None
    finally:
        plt.close(fig)
    print_fn(f"plot of memory per tier: {path}")
    return path


def _mean_loss(loss_fn: Callable[..., Any], params: Params, tokens: jax.Array, keys: jax.Array) -> jax.Array:
    losses = jax.vmap(lambda t, k: loss_fn(params, t, k)[0])(tokens, keys)
    return jnp.mean(losses)
