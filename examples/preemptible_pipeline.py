"""A pipelined training job preempted in the middle of a step's backwards, resumed from Orbax.

What it shows: a small MLP trained for a few steps, each step a pipeline schedule over
microbatches: every forward first (F1..Fn, each context ``put`` in an ``rs.Store``), then every
backward in reverse (Bn..B1, each context popped), then one SGD update. The training process
(``--phase train``) sends itself ``SIGTERM`` in the middle of one step's backwards, as a scheduler
would. Its handler only raises a flag (after ``rs.flush_on_sigterm()`` has completed the store's
writes); at the next backward boundary the loop saves one Orbax step holding the train state
(parameters, the gradients summed so far, where the step stands) and, with
``rso.ContextsSave(store)``, the contexts of the microbatches whose backward has not run, waits for
the save and exits with status 143.

A second training process restarts from the newest Orbax step: it restores the state and a
read-only ``rs.Store`` on the step's contexts, runs the missing backwards from those contexts
(no forward of that step runs again: it counts its forwards), finishes the step and the rest of
the training. The parent process also runs the same training without interruption and checks
that the final parameters of the two runs are **bitwise equal**.

Why: with pipeline schedules the contexts of a step are work done (the forwards); a preemption in
the backwards need not throw them away, and the checkpoint that holds them is an ordinary Orbax
step beside the train state, under the same ``max_to_keep`` and atomic commit.

Run: ``python examples/preemptible_pipeline.py`` (``--small`` for the tests' sizes); it needs
the Orbax extra: ``pip install -e '.[orbax]'``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile

SEED = 0
LR = 0.1


def sizes(small: bool) -> dict[str, int]:
    if small:
        return {"steps": 3, "microbatches": 4, "batch": 8, "width": 16, "depth": 2}
    return {"steps": 4, "microbatches": 8, "batch": 32, "width": 128, "depth": 4}


def init_params(cfg: dict[str, int]):
    import jax

    keys = jax.random.split(jax.random.key(SEED), cfg["depth"] + 1)
    w = cfg["width"]
    layers = [{"w": jax.random.normal(k, (w, w)) / w**0.5, "b": jax.numpy.zeros((w,))} for k in keys[:-1]]
    return {"layers": layers, "head": jax.random.normal(keys[-1], (w, 1)) / w**0.5}


def loss(params, x, y):
    import jax.numpy as jnp

    h = x
    for layer in params["layers"]:  # layers unrolled in Python, as Flax and Equinox models are
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return jnp.mean((h @ params["head"] - y) ** 2)


def microbatch(cfg: dict[str, int], step: int, i: int):
    """The data of microbatch ``i`` of ``step``: the same in every process."""
    import jax

    kx, ky = jax.random.split(jax.random.fold_in(jax.random.fold_in(jax.random.key(SEED + 1), step), i))
    return jax.random.normal(kx, (cfg["batch"], cfg["width"])), jax.random.normal(ky, (cfg["batch"], 1))


def train(ckpt_dir: str, out_path: str, small: bool, preempt_at: tuple[int, int] | None) -> int:
    """Trains from the newest Orbax step in ``ckpt_dir`` (or from scratch); with ``preempt_at``
    = (step, backwards done), sends itself SIGTERM there."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    import residual_store as rs
    from residual_store import orbax as rso

    cfg = sizes(small)
    n = cfg["microbatches"]
    preempted = []
    signal.signal(signal.SIGTERM, lambda signum, frame: preempted.append(signum))
    rs.flush_on_sigterm()  # runs first: the store's writes are done before the flag is raised

    forwards = [0]

    def forward(params, step, i):
        forwards[0] += 1
        return fwd(params, *microbatch(cfg, step, i))[1]

    fwd = rs.split(loss)
    ct = jnp.float32(1.0 / n)  # the step's loss is the mean over its microbatches
    zeros = jax.tree.map(jnp.zeros_like, init_params(cfg))
    blank = {"params": init_params(cfg), "grads": zeros, "step": jnp.int32(0), "done": jnp.int32(0)}
    mngr = ocp.CheckpointManager(os.path.abspath(ckpt_dir), options=ocp.CheckpointManagerOptions(max_to_keep=2))
    latest = mngr.latest_step()
    if latest is None:
        state, contexts = blank, None
    else:
        restored = mngr.restore(latest, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(blank), contexts=rso.ContextsRestore()))
        state, contexts = restored.state, restored.contexts
        print(f"  restored Orbax step {latest}: training step {int(state['step'])}, {int(state['done'])} of {n} "
              f"backwards done, contexts {sorted(contexts.keys())}")
    params, step = state["params"], int(state["step"])

    def save_and_stop(step: int, grads, done: int, pending: dict) -> int:
        mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": params, "grads": grads, "step": jnp.int32(step),
                                         "done": jnp.int32(done)}),
            contexts=rso.ContextsSave(pending)))
        mngr.wait_until_finished()
        mngr.close()
        print(f"  preempted in step {step} after {done} of {n} backwards: saved Orbax step {step} with the "
              f"train state and contexts {sorted(pending)}")
        return 128 + signal.SIGTERM

    with rs.Store(None) as store:
        while step < cfg["steps"]:
            forwards[0] = 0
            resuming = contexts is not None and int(state["done"]) > 0
            if resuming:  # the preempted step: its forwards ran before the restart
                done, grads, source = int(state["done"]), state["grads"], contexts
            else:
                done, grads, source = 0, zeros, store
                for i in range(n):  # F1..Fn
                    store.put(forward(params, step, i), f"mb{i}")
            for i in reversed(range(n - done)):  # Bn..B1, from where the step stands
                ctx = source.get(f"mb{i}") if resuming else store.pop(f"mb{i}")
                grads = jax.tree.map(jnp.add, grads, fwd.backward(ctx, ct))
                done += 1
                if preempt_at == (step, done):
                    os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, mid-backwards
                if preempted and i > 0:
                    return save_and_stop(step, grads, done, {f"mb{j}": source.get(f"mb{j}") for j in range(i)})
            if resuming:
                print(f"  step {step}: finished from the checkpoint's contexts, {forwards[0]} forwards run again")
            if contexts is not None:
                contexts.close()
                contexts = None
            params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
            print(f"  step {step}: loss of microbatch 0 {float(loss(params, *microbatch(cfg, step, 0))):.6f}")
            step += 1
            if preempted:  # at a step's end: the state alone
                return save_and_stop(step, zeros, 0, {})
    mngr.close()
    np.savez(out_path, *[np.asarray(x) for x in jax.tree.leaves(params)])
    return 0


def parent(small: bool) -> int:
    import numpy as np

    script = os.path.abspath(__file__)
    flags = ["--small"] if small else []
    n = sizes(small)["microbatches"]
    with tempfile.TemporaryDirectory(prefix="preemptible-") as tmp:
        def run(label: str, ckpt: str, out: str, *extra: str) -> int:
            print(f"[parent] {label}")
            sys.stdout.flush()
            cmd = [sys.executable, script, "--phase", "train", "--ckpt", ckpt, "--out", out, *flags, *extra]
            return subprocess.run(cmd).returncode

        preempted = os.path.join(tmp, "preempted")
        code = run(f"training, preempted in step 1 after {n // 2} of {n} backwards", preempted,
                   os.path.join(tmp, "unused.npz"), "--preempt-at", f"1:{n // 2}")
        if code != 128 + signal.SIGTERM:
            print(f"FAIL: the preempted run exited with status {code}, not {128 + signal.SIGTERM}")
            return 1
        if run("training restarted from the checkpoint", preempted, os.path.join(tmp, "resumed.npz")) != 0:
            print("FAIL: the restarted run failed")
            return 1
        if run("the same training, uninterrupted", os.path.join(tmp, "straight"), os.path.join(tmp, "straight.npz")) != 0:
            print("FAIL: the uninterrupted run failed")
            return 1
        resumed, straight = np.load(os.path.join(tmp, "resumed.npz")), np.load(os.path.join(tmp, "straight.npz"))
        same = resumed.files == straight.files and all(np.array_equal(resumed[k], straight[k]) for k in resumed.files)
        moved = not all(np.array_equal(straight[k], v) for k, v in zip(straight.files, _initial_leaves(small)))
    if not (same and moved):
        print("FAIL: the resumed training's parameters differ from the uninterrupted run's" if not same
              else "FAIL: training did not change the parameters")
        return 1
    print(f"OK: final parameters bitwise equal to an uninterrupted run ({len(resumed.files)} arrays)")
    return 0


def _initial_leaves(small: bool):
    import jax
    import numpy as np

    return [np.asarray(x) for x in jax.tree.leaves(init_params(sizes(small)))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=["parent", "train"], default="parent")
    parser.add_argument("--ckpt", help="train: the Orbax checkpoint folder")
    parser.add_argument("--out", help="train: where to save the final parameters (.npz)")
    parser.add_argument("--preempt-at", help="train: STEP:BACKWARDS, send SIGTERM to itself there")
    parser.add_argument("--small", action="store_true", help="tiny sizes (for the tests)")
    args = parser.parse_args(argv)
    if args.phase == "train":
        at = tuple(int(v) for v in args.preempt_at.split(":")) if args.preempt_at else None
        return train(args.ckpt, args.out, args.small, at)
    return parent(args.small)


if __name__ == "__main__":
    sys.exit(main())
