"""What splitting forward from backward costs, against a fused ``jax.value_and_grad``.

Run: ``python benchmarks/split_overhead.py [--runs 20] [--quick]``. One process; every number is
the median of ``--runs`` timed runs after warm-up, and the table reports ratios measured in this
one run (absolute times on shared machines are noise, ratios are not):

- ``split total / fused``: split forward + split backward against one jitted
  ``jax.value_and_grad`` (goal: at most 1.10), with ``save="all"`` and ``save="auto"`` (goals,
  issue 15: the transformer block at most 0.4x the residual bytes of ``"all"`` and 1.0x fused,
  the MLP at most 0.6x and 1.05x);
- ``backward / fused``: what a recompute-free backward costs compared with re-running
  ``value_and_grad`` (the alternative when the backward must happen later);
- residual bytes, and how many of them are weights the context holds without copying;
- the dispatch overhead ``rs.backward`` adds on a cache hit over calling the compiled executable
  directly, on a tiny function (goal: at most 30 microseconds);
- what a new signature costs once, on the demo transformer (``residual_store.demo``): the
  signature itself (the canonical text of the forward and backward jaxprs, hashed), the whole
  trace (``fun``, the forward under ``jax.vjp``, the backward, the signature), against the
  forward compile that a new signature pays anyway and the compile of a fused
  ``jax.value_and_grad``. Paid once per signature, never per call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import residual_store as rs


def interleaved_medians(fns: dict[str, Callable[[], Any]], runs: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per candidate, timing them round-robin so that drift on a shared machine
    affects every candidate alike."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def mlp_stage_case(quick: bool) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A pipeline stage ``(params, x) -> activations``: 8 tanh layers of 1024, batch 256."""
    batch, width, depth = (64, 256, 4) if quick else (256, 1024, 8)
    keys = jax.random.split(jax.random.key(0), depth + 1)
    params = [jax.random.normal(k, (width, width)) / jnp.sqrt(width) for k in keys[:-1]]
    x = jax.random.normal(keys[-1], (batch, width))

    def stage(params, x):
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return h

    return stage, (params, x)


def transformer_stage_case(quick: bool) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A pipeline stage ``(params, x) -> activations``: one pre-layernorm causal transformer
    block, sequence 256, d_model 512, 8 heads, batch 4."""
    batch, seq, d, heads = (2, 64, 128, 4) if quick else (4, 256, 512, 8)
    k = jax.random.split(jax.random.key(1), 6)
    scale = lambda n: 1 / jnp.sqrt(n)
    params = {
        "wqkv": jax.random.normal(k[0], (d, 3 * d)) * scale(d),
        "wo": jax.random.normal(k[1], (d, d)) * scale(d),
        "w1": jax.random.normal(k[2], (d, 4 * d)) * scale(d),
        "w2": jax.random.normal(k[3], (4 * d, d)) * scale(4 * d),
        "ln1": jnp.ones(d),
        "ln2": jnp.ones(d),
    }
    x = jax.random.normal(k[4], (batch, seq, d))

    def layernorm(x, s):
        m = x.mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5) * s

    def stage(p, x):
        b, t, _ = x.shape
        q, kk, v = jnp.split(layernorm(x, p["ln1"]) @ p["wqkv"], 3, -1)
        split_heads = lambda z: z.reshape(b, t, heads, d // heads)
        logits = jnp.einsum("bqhd,bkhd->bhqk", split_heads(q), split_heads(kk)) * scale(d // heads)
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), split_heads(v))
        x = x + attn.reshape(b, t, d) @ p["wo"]
        return x + jax.nn.gelu(layernorm(x, p["ln2"]) @ p["w1"]) @ p["w2"]

    return stage, (params, x)


def _as_loss(stage_case: tuple[Callable[..., Any], tuple[Any, ...]]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    stage, args = stage_case
    return (lambda *a: jnp.mean(stage(*a) ** 2)), args


def mlp_case(quick: bool) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The MLP stage under a mean-square loss."""
    return _as_loss(mlp_stage_case(quick))


def transformer_block_case(quick: bool) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The transformer block under a mean-square loss."""
    return _as_loss(transformer_stage_case(quick))


def scan_transformer_case(quick: bool) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The demo transformer's loss (``residual_store.demo``) with its layers under a plain
    ``lax.scan`` (no ``jax.checkpoint``): 4 layers, d_model 256, d_ff 1024, 4x128 tokens."""
    from residual_store.demo import DemoConfig, init_transformer, transformer_loss

    cfg = DemoConfig(vocab=256, d_model=256, n_heads=4, d_ff=1024, n_layers=4, seq_len=128, microbatch=4, remat=False)
    if quick:
        cfg = DemoConfig(vocab=64, d_model=64, n_heads=4, d_ff=256, n_layers=2, seq_len=32, microbatch=2, remat=False)
    params = init_transformer(jax.random.key(2), cfg)
    tokens = jax.random.randint(jax.random.key(3), (cfg.microbatch, cfg.seq_len + 1), 0, cfg.vocab)
    return (lambda p, t, k: transformer_loss(p, t, k, cfg)[0]), (params, tokens, jax.random.key(4))


def measure_model(
    name: str, loss: Callable[..., Any], args: tuple[Any, ...], runs: int, save: str = "all"
) -> dict[str, Any]:
    fused = jax.jit(jax.value_and_grad(loss))
    fwd = rs.split(loss, save=save)
    _, ctx = fwd(*args)
    fwd.backward(ctx)
    t = interleaved_medians(
        {
            "fused": lambda: fused(*args),
            "fwd": lambda: fwd(*args),
            "bwd": lambda: fwd.backward(ctx),
            "total": lambda: fwd.backward(fwd(*args)[1]),
        },
        runs,
    )
    t_fused, t_fwd, t_bwd, t_total = t["fused"], t["fwd"], t["bwd"], t["total"]
    held = {k: 0 for k in ("weight", "input", "constant", "intermediate")}
    for r, kind in zip(ctx.residuals, ctx.spec.kinds):
        held[kind] += r.nbytes
    return {
        "model": name,
        "save": save,
        "fused ms": 1e3 * t_fused,
        "split fwd ms": 1e3 * t_fwd,
        "split bwd ms": 1e3 * t_bwd,
        "split total / fused": t_total / t_fused,
        "bwd / fused": t_bwd / t_fused,
        "residual MiB": ctx.nbytes / 2**20,
        "own MiB": (held["intermediate"] + held["input"]) / 2**20,
        "weights MiB (not copied)": (held["weight"] + held["constant"]) / 2**20,
    }


def dispatch_overhead(calls: int = 2000, repeats: int = 21) -> dict[str, float]:
    """Per-call time of ``Split.backward`` and ``Split.__call__`` against their executables."""
    fwd = rs.split(lambda x: jnp.sum(jnp.sin(x)))
    x = jnp.arange(8.0)
    out, ctx = fwd(x)
    fwd.backward(ctx)
    entry = fwd._cache.values()[0]  # the benchmark compares against the raw executables
    residuals, ct = list(ctx.residuals), [jnp.float32(1.0)]
    bwd_exe = entry.backward._executables.find(residuals, [np.ones((), np.float32)])  # as backward(ctx) passed it
    fwd_exe, consts = entry.executable, list(entry.consts)

    def per_call(fn: Callable[[], Any]) -> float:
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                result = fn()
            jax.block_until_ready(result)
            samples.append((time.perf_counter() - start) / calls)
        return statistics.median(samples)

    ct_scalar = ct[0]
    return {
        "backward via rs (us)": 1e6 * per_call(lambda: fwd.backward(ctx, ct_scalar)),
        "backward executable (us)": 1e6 * per_call(lambda: bwd_exe(residuals, ct)),
        "forward via rs (us)": 1e6 * per_call(lambda: fwd(x)),
        "forward executable (us)": 1e6 * per_call(lambda: fwd_exe(consts, [x])),
    }


def new_signature_cost(repeats: int) -> dict[str, float]:
    """Median seconds, over ``repeats`` fresh splits of the demo transformer, of: the signature
    (``compute_signature``), the trace that includes it, the forward compile, the whole first
    call; and the compile of the fused ``value_and_grad`` of the same loss."""
    import importlib

    from residual_store.demo import DemoConfig, init_transformer, transformer_loss

    split_module = importlib.import_module("residual_store._src.split")  # (rs.split is the function)
    cfg = DemoConfig()
    params = init_transformer(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (cfg.microbatch, cfg.seq_len + 1), 0, cfg.vocab)
    key = jax.random.key(2)
    timed: dict[str, list[float]] = {"signature": [], "trace": [], "first call": [], "fused compile": []}
    real_signature, real_trace = split_module.compute_signature, split_module.Split._trace_call

    def clock(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timed[name].append(time.perf_counter() - start)

        return wrapped

    split_module.compute_signature = clock("signature", real_signature)
    split_module.Split._trace_call = clock("trace", real_trace)
    try:
        for _ in range(repeats):
            loss = lambda p, t, k: transformer_loss(p, t, k, cfg)  # a new function: nothing cached
            start = time.perf_counter()
            jax.block_until_ready(rs.split(loss, has_aux=True)(params, tokens, key))
            timed["first call"].append(time.perf_counter() - start)
            start = time.perf_counter()
            jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params, tokens, key).compile()
            timed["fused compile"].append(time.perf_counter() - start)
    finally:
        split_module.compute_signature, split_module.Split._trace_call = real_signature, real_trace
    return {name: statistics.median(ts) for name, ts in timed.items()}


def export_cost(repeats: int) -> dict[str, float]:
    """Median seconds to export the demo transformer's backward for the current platform alone
    and for every platform (what a store saves per signature, on its writer thread), against
    compiling that backward."""
    from residual_store._src.export import PLATFORMS, export_backward
    from residual_store.demo import DemoConfig, init_transformer, transformer_loss

    cfg = DemoConfig()
    params = init_transformer(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (cfg.microbatch, cfg.seq_len + 1), 0, cfg.vocab)
    (_, _), ctx = rs.split(lambda p, t, k: transformer_loss(p, t, k, cfg), has_aux=True)(params, tokens, jax.random.key(2))
    bwd = ctx._backward
    start = time.perf_counter()  # once: JAX caches the executable of an identical computation
    jax.jit(bwd.flat_fn).lower(list(ctx.residuals), [jnp.float32(1.0)]).compile()
    timed: dict[str, list[float]] = {"one platform": [], "all platforms": [], "backward compile": [time.perf_counter() - start]}
    for _ in range(repeats):
        for name, platforms in (("one platform", ()), ("all platforms", PLATFORMS)):
            start = time.perf_counter()
            export_backward(bwd, ctx.spec.avals, platforms=platforms)
            timed[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in timed.items()}


def _ms_and_ratio(title: str, seconds: dict[str, float], base: str) -> list[dict[str, Any]]:
    """Two table rows: ``seconds`` in milliseconds, and each over ``seconds[base]``."""
    return [
        {title: "ms", **{k: 1e3 * v for k, v in seconds.items()}},
        {title: f"/ {base}", **{k: v / seconds[base] for k, v in seconds.items()}},
    ]


def table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
    cells = [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    line = lambda vals: " | ".join(v.rjust(w) for v, w in zip(vals, widths))
    return "\n".join([line(cols), "-+-".join("-" * w for w in widths), *map(line, cells)])


def parse_args(doc: str) -> argparse.Namespace:
    """``--runs`` and ``--quick``, and a header line naming JAX, the platform and the runs."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="timed runs per number (default 20)")
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; medians of {args.runs} runs\n")
    return args


def main() -> None:
    args = parse_args(__doc__)
    rows = [
        measure_model(name, *case(args.quick), args.runs, save=save)
        for name, case in (
            ("MLP 8x1024 tanh, batch 256" if not args.quick else "MLP (quick)", mlp_case),
            ("transformer block s256 d512 h8" if not args.quick else "block (quick)", transformer_block_case),
            ("demo transformer, plain scan, 4 layers d256" if not args.quick else "scan (quick)", scan_transformer_case),
        )
        for save in ("all", "auto")
    ]
    for auto in rows[1::2]:  # save="auto" against "all" of the same model
        auto["own MiB"] = f"{auto['own MiB']:.3f} ({auto['own MiB'] / rows[rows.index(auto) - 1]['own MiB']:.2f}x)"
    print(table(rows))
    d = dispatch_overhead(calls=200 if args.quick else 2000)
    print()
    print(table([
        {
            "tiny function": "backward",
            "via rs (us)": d["backward via rs (us)"],
            "executable (us)": d["backward executable (us)"],
            "added (us)": d["backward via rs (us)"] - d["backward executable (us)"],
            "ratio": d["backward via rs (us)"] / d["backward executable (us)"],
        },
        {
            "tiny function": "forward",
            "via rs (us)": d["forward via rs (us)"],
            "executable (us)": d["forward executable (us)"],
            "added (us)": d["forward via rs (us)"] - d["forward executable (us)"],
            "ratio": d["forward via rs (us)"] / d["forward executable (us)"],
        },
    ]))
    c = new_signature_cost(repeats=3 if args.quick else 7)
    print()
    print(table(_ms_and_ratio("new signature, demo transformer", {
        "signature": c["signature"],
        "trace (incl. signature)": c["trace"],
        "forward compile": c["first call"] - c["trace"],
        "first call": c["first call"],
        "fused v&g compile": c["fused compile"],
    }, base="first call")))
    e = export_cost(repeats=3 if args.quick else 7)
    print()
    print(table(_ms_and_ratio("stored backward, demo transformer", {
        "export, this platform": e["one platform"],
        "export, all platforms": e["all platforms"],
        "backward compile": e["backward compile"],
    }, base="backward compile")))
    print("\ngoals: split total / fused <= 1.10; backward dispatch added <= 30 us; a new signature's")
    print("cost is paid once (its first call), never per call")


if __name__ == "__main__":
    main()
