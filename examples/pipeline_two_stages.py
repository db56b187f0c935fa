"""A two-stage pipeline with a 1F1B schedule, the stage boundary carried as a cotangent.

What it shows: a model cut into two stages, each its own function split with ``rs.split``:

- stage 1 maps the input features to activations (``stage1(params1, x) -> h``);
- stage 2 maps the activations to the loss (``stage2(params2, h, labels) -> loss``).

The microbatches run in the 1F1B ("one forward, one backward") order that pipeline-parallel
trainers use: each stage runs a few warm-up forwards, then alternates one forward with one
backward, then drains with cool-down backwards. A backward runs long after its forward, from the
saved residual context alone (the forward is never re-run), and each stage holds at most
``num_stages - stage_index`` contexts at a time, instead of all eight.

The boundary between the stages: stage 2's split differentiates both its parameters and its
input activations (``argnums=(0, 1)``); the activation gradient it returns is the cotangent that
stage 1's backward takes. The summed per-microbatch gradients are checked against ``jax.grad`` of
the composed model on the full batch; the script exits non-zero if they differ by more than the
stated tolerance.

Why: this is the job ``jax.grad`` in one jitted step cannot do, since the two halves of each
microbatch's gradient run at different times, interleaved with other microbatches' forwards.

Run: ``python examples/pipeline_two_stages.py`` (``--small`` for the quick sizes the tests use).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

import residual_store as rs

NUM_STAGES = 2
RTOL = 1e-5  # max |pipeline - jax.grad| / max |jax.grad|, per leaf (float32 sums in another order)


# -- the model, in two stages ------------------------------------------------------------------


def init_params(key, d_in, d_hidden, n_classes):
    k = jax.random.split(key, 4)

    def dense(key, m, n):
        return {"w": jax.random.normal(key, (m, n)) / jnp.sqrt(m), "b": jnp.zeros((n,))}

    params1 = {"l1": dense(k[0], d_in, d_hidden), "l2": dense(k[1], d_hidden, d_hidden)}
    params2 = {
        "l3": dense(k[2], d_hidden, d_hidden),
        "ln": jnp.ones((d_hidden,)),
        "head": dense(k[3], d_hidden, n_classes),
    }
    return params1, params2


def stage1(params, x):
    """Input features -> activations (the tensor sent to the next stage)."""
    h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
    return h + jnp.tanh(h @ params["l2"]["w"] + params["l2"]["b"])


def stage2(params, h, labels):
    """Activations -> mean cross-entropy loss; ``labels`` are int class ids (no gradient)."""
    h = h + jax.nn.gelu(h @ params["l3"]["w"] + params["l3"]["b"])
    h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5) * params["ln"]
    logits = h @ params["head"]["w"] + params["head"]["b"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def full_loss(params1, params2, x, labels):
    return stage2(params2, stage1(params1, x), labels)


# -- the 1F1B schedule --------------------------------------------------------------------------


def one_f_one_b(stage, num_stages, num_micro):
    """The op list of one stage: warm-up forwards, alternating F/B, cool-down backwards."""
    warmup = min(num_stages - stage - 1, num_micro)
    ops = [("F", i) for i in range(warmup)]
    for i in range(num_micro - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", i) for i in range(num_micro - warmup, num_micro)]
    return ops


def timeline(num_stages, num_micro):
    """Ticks of a simulated pipeline: each stage runs its next op once its input is ready.

    A stage's F(i) needs F(i) of the stage before (the activations); its B(i) needs B(i) of the
    stage after (the activation cotangent). Ops of one tick are independent of each other.
    """
    queues = [one_f_one_b(s, num_stages, num_micro) for s in range(num_stages)]
    done, ticks = set(), []
    while any(queues):
        tick = []
        for s, queue in enumerate(queues):
            if not queue:
                tick.append(None)
                continue
            kind, i = queue[0]
            ready = (
                (s == 0 or ("F", s - 1, i) in done)
                if kind == "F"
                else (s == num_stages - 1 or ("B", s + 1, i) in done)
            )
            tick.append((kind, s, i) if ready else None)
        if not any(tick):
            raise RuntimeError("schedule deadlocked")
        for op in tick:
            if op is not None:
                queues[op[1]].pop(0)
                done.add(op)
        ticks.append(tick)
    return ticks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=32)
    parser.add_argument("--d-in", type=int, default=64)
    parser.add_argument("--d-hidden", type=int, default=256)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="tiny sizes (for the tests)")
    args = parser.parse_args(argv)
    if args.small:
        args.microbatch_size, args.d_in, args.d_hidden = 8, 16, 32
    m, b = args.microbatches, args.microbatch_size

    kp, kx, ky = jax.random.split(jax.random.key(0), 3)
    params1, params2 = init_params(kp, args.d_in, args.d_hidden, args.classes)
    xs = jax.random.normal(kx, (m, b, args.d_in))
    ys = jax.random.randint(ky, (m, b), 0, args.classes)

    fwd1 = rs.split(stage1)  # differentiate params1; x is the data
    fwd2 = rs.split(stage2, argnums=(0, 1))  # params2 AND the incoming activations
    cotangent = jnp.float32(1.0 / m)  # full-batch loss = mean of the microbatch means

    ticks = timeline(NUM_STAGES, m)
    print(f"1F1B over {m} microbatches of {b} rows, {NUM_STAGES} stages, {len(ticks)} ticks")
    print("  tick  stage 1  stage 2   live contexts (stage 1, stage 2)")

    ctx1, ctx2, acts, act_grads = {}, {}, {}, {}
    grads1 = grads2 = None
    peak_live = [0, 0]
    losses = []
    for t, tick in enumerate(ticks):
        for op in tick:
            if op is None:
                continue
            kind, stage, i = op
            if (kind, stage) == ("F", 0):
                acts[i], ctx1[i] = fwd1(params1, xs[i])  # send acts[i] to stage 2
            elif (kind, stage) == ("F", 1):
                loss, ctx2[i] = fwd2(params2, acts.pop(i), ys[i])
                losses.append(float(loss))
            elif (kind, stage) == ("B", 1):
                g2, act_grads[i] = fwd2.backward(ctx2.pop(i), cotangent)  # send dL/dh to stage 1
                grads2 = g2 if grads2 is None else jax.tree.map(jnp.add, grads2, g2)
            else:
                g1 = fwd1.backward(ctx1.pop(i), act_grads.pop(i))  # the boundary cotangent
                grads1 = g1 if grads1 is None else jax.tree.map(jnp.add, grads1, g1)
        peak_live = [max(peak_live[0], len(ctx1)), max(peak_live[1], len(ctx2))]
        cells = [f"{op[0]}{op[2] + 1}" if op else "." for op in tick]
        print(f"  {t + 1:4d}  {cells[0]:>7}  {cells[1]:>7}   ({len(ctx1)}, {len(ctx2)})")

    ref1, ref2 = jax.jit(jax.grad(full_loss, argnums=(0, 1)))(
        params1, params2, xs.reshape(m * b, -1), ys.reshape(m * b)
    )
    full_value = float(full_loss(params1, params2, xs.reshape(m * b, -1), ys.reshape(m * b)))

    def rel_diffs(got, ref):
        return {
            jax.tree_util.keystr(path): float(jnp.max(jnp.abs(g - r)) / (jnp.max(jnp.abs(r)) + 1e-30))
            for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref))
        }

    diffs = {**{f"stage1{k}": v for k, v in rel_diffs(grads1, ref1).items()},
             **{f"stage2{k}": v for k, v in rel_diffs(grads2, ref2).items()}}
    print(f"mean microbatch loss {sum(losses) / m:.6f}, full-batch loss {full_value:.6f}")
    print("max relative gradient difference vs jax.grad of the composed model, per parameter:")
    for name, d in diffs.items():
        print(f"  {name:<22} {d:.2e}")
    for name, fwd in (("stage 1", fwd1), ("stage 2", fwd2)):
        info = fwd.cache_info()
        print(f"{name}: {info.forward_compiles} forward compile, {info.backward_compiles} backward compile")
    print(f"peak live contexts: stage 1 {peak_live[0]}, stage 2 {peak_live[1]} (of {m} microbatches)")

    worst = max(diffs.values())
    ok = worst <= RTOL and peak_live[0] <= NUM_STAGES and peak_live[1] <= 1
    ok = ok and not ctx1 and not ctx2 and not act_grads
    print(f"{'OK' if ok else 'FAIL'}: pipeline gradients match jax.grad (max rel diff {worst:.2e}, tolerance {RTOL:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
