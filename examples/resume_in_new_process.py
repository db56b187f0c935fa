"""Forward in one process, backward in another that never sees the model's code.

What it shows: a first process (``--phase forward``) builds the demo transformer
(``residual_store.demo``: layers under ``lax.scan`` and ``jax.checkpoint``, dropout from typed
PRNG keys, integer tokens), runs the forward of eight microbatches with ``rs.split`` and puts
every residual context in an ``rs.Store`` folder, then exits. A second process
(``--phase backward``) opens the folder and runs ``rs.backward`` on every context, summing and
saving the gradients. That process does not import the model: the model's module is blocked
(``import residual_store.demo`` raises ``ImportError`` there) and no model function is defined;
it runs the backward that the store serialized with ``jax.export`` on the first ``put``. A third
process (``--phase resume``) has the model's code and resumes the natural way: a fresh
``rs.split`` runs ``fwd.backward(store.get(key))``, rebuilding the backward from what each
context records without running or compiling the forward. The parent process runs the phases
with ``subprocess``, computes ``jax.grad`` of the full batch itself, prints the three and exits
non-zero if they differ by more than the stated tolerance.

Why: a backward can then run where and when the forward is gone: after a restart, on another
worker of a pipeline, or from a job that only holds the stored contexts.

Run: ``python examples/resume_in_new_process.py`` (``--small`` for the tiny sizes the tests
use, ``--store DIR`` to keep the store folder and look at it with ``residual-store ls DIR``).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import types

MODEL_MODULE = "residual_store.demo"
RTOL = 1e-5  # max |backward process - jax.grad| / max |jax.grad|, per leaf (float32)
SEED = 0


def config(small: bool):
    """The demo transformer's sizes (imports the model: forward phase and parent only)."""
    from residual_store.demo import DemoConfig

    if small:
        return DemoConfig(d_model=32, d_ff=64, n_layers=2, seq_len=16, microbatch=2, n_microbatches=8)
    return DemoConfig()


def make_inputs(cfg):
    """Parameters, tokens and dropout keys, the same in the forward process and the parent."""
    import jax

    from residual_store.demo import init_transformer

    kp, kt, kd = jax.random.split(jax.random.key(SEED), 3)
    params = init_transformer(kp, cfg)
    tokens = jax.random.randint(kt, (cfg.n_microbatches, cfg.microbatch, cfg.seq_len + 1), 0, cfg.vocab)
    keys = jax.random.split(kd, cfg.n_microbatches)
    return params, tokens, keys


def forward_phase(store_path: str, small: bool) -> int:
    import jax

    import residual_store as rs
    from residual_store.demo import transformer_loss

    print(f"  [forward process, pid {os.getpid()}]")
    cfg = config(small)
    params, tokens, keys = make_inputs(cfg)
    fwd = rs.split(transformer_loss, has_aux=True, static_argnums=3)  # cfg: static, hashable
    with rs.Store(store_path) as store:
        for i in range(cfg.n_microbatches):
            (loss, aux), ctx = fwd(params, tokens[i], keys[i], cfg)
            store.put(ctx, f"mb{i:03d}")
            print(f"  forward mb{i:03d}: loss {float(loss):.4f}, accuracy {float(aux['accuracy']):.3f}, "
                  f"{ctx.nbytes:,} bytes of residuals")
        store.flush()
        stats = store.stats()
    print(f"  stored {stats['disk']['contexts']} contexts, {stats['disk']['bytes']:,} bytes on disk "
          f"(weights once); signature {ctx.spec.signature[:16]}...")
    print("  residuals of one context:\n" + "\n".join("    " + line for line in ctx.describe().splitlines()))
    jax.block_until_ready(loss)
    return 0


def backward_phase(store_path: str, out_path: str) -> int:
    # The model is not importable here, and nothing in this process defines it.
    sys.modules[MODEL_MODULE] = None  # makes `import residual_store.demo` raise ImportError
    import importlib

    try:
        importlib.import_module(MODEL_MODULE)
    except ImportError:
        print(f"  [backward process, pid {os.getpid()}] {MODEL_MODULE} is not importable here, "
              "and no model function is defined")
    else:
        raise AssertionError(f"{MODEL_MODULE} should not be importable in the backward phase")
    assert "transformer_loss" not in globals() and "init_transformer" not in globals()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import residual_store as rs

    with rs.Store(store_path) as store:
        keys = sorted(store.keys())
        cotangent = jnp.float32(1.0 / len(keys))  # full-batch loss = mean of microbatch losses
        total = None
        for key in reversed(keys):
            ctx = store.get(key)
            g = rs.backward(ctx, cotangent)
            total = g if total is None else jax.tree.map(jnp.add, total, g)
            print(f"  backward {key}: {len(ctx.residuals)} residuals, signature {ctx.spec.signature[:16]}...")
    # Nothing in this process ever defined a model function:
    model_names = {"transformer_loss", "init_transformer"}
    assert not any(
        isinstance(o, types.FunctionType) and o.__name__ in model_names for o in gc.get_objects()
    ), "a model function exists in the backward process"
    flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(total)}
    np.savez(out_path, **flat)
    assert MODEL_MODULE not in sys.modules or sys.modules[MODEL_MODULE] is None
    print(f"  saved {len(flat)} gradient arrays to {os.path.basename(out_path)}")
    return 0


def resume_phase(store_path: str, out_path: str) -> int:
    """The natural way to resume, in a process that has the model's code: a fresh split, which
    never runs the forward, rebuilds the backward from what each context records."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import residual_store as rs
    from residual_store.demo import transformer_loss

    print(f"  [resume process, pid {os.getpid()}] has the model's code; runs no forward")
    fwd = rs.split(transformer_loss, has_aux=True, static_argnums=3)
    with rs.Store(store_path, read_only=True) as store:  # a mistyped path fails here
        keys = sorted(store.keys())
        cotangent = jnp.float32(1.0 / len(keys))
        total = None
        for key in reversed(keys):
            g = fwd.backward(store.get(key), cotangent)
            total = g if total is None else jax.tree.map(jnp.add, total, g)
    info = fwd.cache_info()
    print(f"  {len(keys)} backwards by a fresh split: {info.forward_compiles} forward compiles, "
          f"{info.backward_compiles} backward compile")
    assert info.forward_compiles == 0 and info.backward_compiles == 1, info
    flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(total)}
    np.savez(out_path, **flat)
    return 0


def parent(store_path: str | None, small: bool) -> int:
    folder = tempfile.TemporaryDirectory(prefix="resume-example-")
    store_path = store_path or os.path.join(folder.name, "store")
    out_path = os.path.join(folder.name, "grads.npz")
    resumed_path = os.path.join(folder.name, "grads_resumed.npz")
    script = os.path.abspath(__file__)
    small_flag = ["--small"] if small else []
    phases = (("forward", small_flag), ("backward", ["--out", out_path]), ("resume", ["--out", resumed_path]))
    for phase, extra in phases:
        print(f"[parent pid {os.getpid()}] starting: python {os.path.basename(script)} --phase {phase} ...")
        sys.stdout.flush()
        done = subprocess.run([sys.executable, script, "--phase", phase, "--store", store_path, *extra])
        if done.returncode != 0:
            print(f"FAIL: the {phase} process exited with status {done.returncode}")
            return 1

    import jax
    import jax.numpy as jnp
    import numpy as np

    from residual_store.demo import transformer_loss

    cfg = config(small)
    params, tokens, keys = make_inputs(cfg)

    def full_batch_loss(p):
        losses = jax.vmap(lambda t, k: transformer_loss(p, t, k, cfg)[0])(tokens, keys)
        return jnp.mean(losses)

    reference = jax.jit(jax.grad(full_batch_loss))(params)
    ok = True
    for label, path in (("backward process (no model)", out_path), ("resume process (fresh split)", resumed_path)):
        stored = np.load(path)
        print(f"gradients: {label} vs jax.grad in the parent")
        print(f"  {'parameter':<22} {'|g| new process':>15} {'|g| jax.grad':>13} {'max rel diff':>12}")
        worst = 0.0
        for leaf_path, ref in jax.tree_util.tree_leaves_with_path(reference):
            name = jax.tree_util.keystr(leaf_path)
            got, ref = stored[name], np.asarray(ref)
            diff = float(np.max(np.abs(got - ref)) / (np.max(np.abs(ref)) + 1e-30))
            worst = max(worst, diff)
            print(f"  {name:<22} {np.linalg.norm(got):15.6f} {np.linalg.norm(ref):13.6f} {diff:12.2e}")
        this_ok = worst <= RTOL and len(stored.files) == len(jax.tree.leaves(reference))
        ok = ok and this_ok
        print(f"{'OK' if this_ok else 'FAIL'}: gradients from the {label} match jax.grad "
              f"(max rel diff {worst:.2e}, tolerance {RTOL:.0e})")
    folder.cleanup()
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=["parent", "forward", "backward", "resume"], default="parent")
    parser.add_argument("--store", help="store folder (default: a temporary one)")
    parser.add_argument("--out", help="backward and resume phases: where to save the gradients (.npz)")
    parser.add_argument("--small", action="store_true", help="tiny sizes (for the tests)")
    args = parser.parse_args(argv)
    if args.phase == "forward":
        return forward_phase(args.store, args.small)
    if args.phase == "backward":
        return backward_phase(args.store, args.out)
    if args.phase == "resume":
        return resume_phase(args.store, args.out)
    return parent(args.store, args.small)


if __name__ == "__main__":
    sys.exit(main())
