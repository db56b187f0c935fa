"""The part the library examples share: run the backwards in a new process that never imports the
model, compare with ``jax.grad``, print PASS or exit 1.

``flax_nnx.py``, ``flax_linen.py``, ``equinox_model.py`` and ``haiku_model.py`` follow one recipe:
four microbatches in pipeline order, every forward first (F1..F4, each context ``put`` in an
``rs.Store``), then the backwards in reverse (B4..B1, from ``store.get``), then one
``optax.adamw`` update. Then a NEW process (``python -c``, which never sees the example script)
opens the store read-only and runs ``rs.backward(store.get(key))`` on every context through the
backward the store serialized with ``jax.export``. The example compares both sets of gradients
with ``jax.grad`` of the same four microbatches (relative tolerance :data:`RTOL`) and prints a
PASS line, or exits 1. ``--store DIR`` keeps the store for ``residual-store ls DIR``; ``--small``
is accepted and changes nothing (the sizes are tiny already).

Each example keeps what belongs to its library (the model, the loss, the ``rs.split`` options,
the optax update, and what the new process should get back); this module holds only the
plumbing around it.

In the example (the parent process): :func:`parse_args`, :func:`store_path`,
:func:`microbatches`, :func:`sum_backwards`, :func:`mean_loss`, :func:`flat`, :func:`max_rel_diff`,
:func:`compare_in_new_process` and :func:`report`.

In the new process, whose program (``python -c``) each example writes: :func:`backwards_from_store`
and :func:`save`. :func:`compare_in_new_process` puts this folder on that process's ``sys.path``
so that its program can ``import _resume``; nothing there imports the example script or its model.

At import this module loads only the standard library (``--help`` stays fast, and the new process
gets no model library from it).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax
    import numpy as np

RTOL = 1e-5  # max |g - jax.grad| / max |jax.grad| per leaf (float32)
HERE = os.path.dirname(os.path.abspath(__file__))


# --- in the example script ------------------------------------------------------------------


def parse_args(doc: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags every library example takes: ``--store DIR`` and ``--small`` (a no-op)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--store", help="store folder (default: a temporary one)")
    parser.add_argument("--small", action="store_true", help="accepted for the tests; sizes are tiny already")
    return parser.parse_args(argv)


def store_path(folder: str | None, prefix: str) -> str:
    """``folder`` (from ``--store``) if given, else a store path in a temporary folder removed at exit."""
    if folder:
        return folder
    temporary = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, temporary, ignore_errors=True)
    return os.path.join(temporary, "store")


def microbatches(n: int, batch: int, d_in: int, d_out: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``n`` microbatches of random inputs ``(n, batch, d_in)`` and targets ``(n, batch, d_out)``,
    and ``n`` typed PRNG keys for dropout: the same data in every example."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    data = np.random.default_rng(1)
    xs = jnp.asarray(data.normal(size=(n, batch, d_in)), jnp.float32)
    ys = jnp.asarray(data.normal(size=(n, batch, d_out)), jnp.float32)
    return xs, ys, jax.random.split(jax.random.key(2), n)


def sum_backwards(store: Any, keys: Sequence[str], backward: Callable[..., Any]) -> Any:
    """``backward(store.get(key), 1 / len(keys))`` for every key in reverse (B4..B1), summed.

    ``backward`` is ``fwd.backward`` in the example and ``rs.backward`` in the new process; the
    cotangent ``1 / len(keys)`` makes the sum the gradient of the mean loss.
    """
    import jax
    import jax.numpy as jnp

    total = None
    for key in reversed(keys):
        g = backward(store.get(key), jnp.float32(1 / len(keys)))
        total = g if total is None else jax.tree.map(jnp.add, total, g)  # None leaves stay None
    return total


def mean_loss(loss_of: Callable[[Any, int], jax.Array], n: int) -> Callable[[Any], jax.Array]:
    """``params -> mean of loss_of(params, i) over the n microbatches``, jitted: the loss printed
    before and after the optax step, and what ``jax.grad`` differentiates for the reference."""
    import jax

    return jax.jit(lambda params: sum(loss_of(params, i) for i in range(n)) / n)


def flat(tree: Any) -> dict[str, np.ndarray]:
    """The leaves of ``tree`` as numpy arrays, keyed by ``jax.tree_util.keystr`` path (no ``None``)."""
    import jax
    import numpy as np

    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def max_rel_diff(got: Mapping[str, Any], ref: Mapping[str, Any]) -> float:
    """max over leaves of max |got - ref| / max |ref|; infinite if the two have different leaves."""
    import numpy as np

    if sorted(got) != sorted(ref):
        print(f"gradient leaves differ: {sorted(got)} vs jax.grad's {sorted(ref)}")
        return float("inf")
    return max(float(np.max(np.abs(np.asarray(got[k]) - np.asarray(ref[k]))) / (np.max(np.abs(ref[k])) + 1e-30))
               for k in ref)


def compare_in_new_process(child: str, store: str, keys: Sequence[str], script: str,
                           ref: Mapping[str, Any]) -> float:
    """Run ``child`` with ``python -c`` on the store and compare the gradients it saves with ``ref``.

    The new process gets ``store``, a path for its gradients, ``script`` (the example's own path,
    which it checks it never imported) and ``keys`` as its arguments; see
    :func:`backwards_from_store` and :func:`save`. Returns :func:`max_rel_diff`, or infinity (after
    printing why) if the process failed.
    """
    import numpy as np

    program = f"import sys; sys.path.insert(0, {HERE!r})\n{child}"
    with tempfile.TemporaryDirectory(prefix="resume-grads-") as folder:
        out_path = os.path.join(folder, "grads.npz")
        sys.stdout.flush()  # the parent's lines before the child's
        argv = [sys.executable, "-c", program, store, out_path, os.path.abspath(script), *keys]
        done = subprocess.run(argv, check=False)
        if done.returncode != 0:
            print(f"FAIL: the new process exited with status {done.returncode}")
            return float("inf")
        return max_rel_diff(dict(np.load(out_path)), ref)


def report(library: str, here: float, there: float, *, grads_ok: bool, start: float) -> int:
    """Print the PASS (or FAIL) line; return the exit status: 0 if both differences are within
    :data:`RTOL` and ``grads_ok`` (the gradients have the structure the example expects)."""
    ok = grads_ok and max(here, there) <= RTOL
    print(f"{'PASS' if ok else 'FAIL'}: {library} gradients match jax.grad: this process {here:.1e}, "
          f"new process without the model {there:.1e} (tolerance {RTOL:.0e}); "
          f"{time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


# --- in the new process ---------------------------------------------------------------------


def backwards_from_store() -> tuple[Any, list[str]]:
    """``rs.backward`` on every context named on the command line (:func:`sum_backwards`); returns
    the summed gradients and the keys.

    Only the store is used: no model, no loss function. Fails if the example script was imported.
    """
    import residual_store as rs

    store, script, keys = sys.argv[1], sys.argv[3], sys.argv[4:]
    with rs.Store(store, read_only=True) as opened:
        total = sum_backwards(opened, keys, rs.backward)
    assert not any(getattr(m, "__file__", None) == script for m in list(sys.modules.values()))
    return total, keys


def save(grads: Mapping[str, Any]) -> None:
    """Save ``grads`` (path -> array) where :func:`compare_in_new_process` reads them."""
    import numpy as np

    np.savez(sys.argv[2], **{path: np.asarray(x) for path, x in grads.items()})
