"""The B/W split of one signature's backward: ``split.backward(ctx, cotangent, now=...)``.

A :class:`Halves` runs **B**, the gradients of the ``now`` arguments (a pipeline stage's input,
which the previous stage waits for), and hands back ``later``: a
:class:`~residual_store._src.context.ResidualContext` holding only what **W**, the remaining
gradients (the weights'), reads. ``rs.backward(later)`` runs W. The partition of the backward's
equations is :mod:`residual_store._src.partition`'s: W never runs an operation B ran, and residuals
only B read are not in ``later``.

``later`` is a context like any other: its own signature (a digest of its parent's, ``now``, and
the W computation), its own backward compiled ahead of time once per signature, a spec with a
name and kind per residual, storable in a ``Store`` and resumable in another process, with the
model's split (which rebuilds both halves from the parent's call record) or without it (from
the W backward the store saved).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from residual_store._src import jaxpr_walks, placement
from residual_store._src.backward import Backward, Executables
from residual_store._src.context import ResidualContext, ResidualSpec, bound_context
from residual_store._src.errors import InvalidArgumentError, SignatureMismatchError
from residual_store._src.keypaths import PathStructure
from residual_store._src.partition import Partition, partition
from residual_store._src.signature import later_signature

__all__ = ["GradParts", "Halves"]


@dataclasses.dataclass(frozen=True)
class GradParts:
    """What a split knows of one signature's backward beyond the :class:`Backward` itself.

    Attributes:
      residual_avals, cotangent_avals: the abstract inputs its flat function was traced on.
      templates: per differentiated argument position, in ``argnums`` order, the template of
        its gradient (``0`` per differentiated leaf, ``None`` per passed-through one).
      single: whether ``argnums`` was an int (gradients not wrapped in a tuple).
      spec: the spec of its contexts (set once the signature is known).
    """

    residual_avals: tuple[jax.ShapeDtypeStruct, ...]
    cotangent_avals: tuple[jax.ShapeDtypeStruct, ...]
    templates: tuple[tuple[int, Any], ...]
    single: bool
    spec: ResidualSpec | None = None


def _template(templates: dict[int, Any], positions: Sequence[int], single: bool) -> Any:
    return templates[positions[0]] if single else tuple(templates[p] for p in positions)


def _gradient_paths(rest: Sequence[int], templates: dict[int, Any], arg_name: Callable[[int], str]) -> list[str]:
    """The key path (``"params['w2']"``) of each gradient W computes, in its output order."""
    return [
        arg_name(p) + jax.tree_util.keystr(path)
        for p in rest
        for path, _ in jax.tree_util.tree_flatten_with_path(templates[p])[0]
    ]


class Halves:
    """B and W of one signature's backward for one choice of ``now`` (see the module docstring).

    Args:
      parent: the backward of the contexts it splits.
      spec: the spec of a context of that signature (names, kinds and call of its residuals).
      parts: the parent's :class:`GradParts`.
      now: the argument positions B differentiates (a subset of ``argnums``, not all of it), in
        the order B returns their gradients.
      now_single: ``now`` was an int: B's gradients are not wrapped in a tuple.
      arg_name: the name of an argument position (for the names of ``later``'s residuals).
      on_compile: called after each compile of either half.
    """

    def __init__(
        self,
        *,
        parent: Backward,
        spec: ResidualSpec,
        parts: GradParts,
        now: tuple[int, ...],
        now_single: bool,
        arg_name: Callable[[int], str] = lambda p: f"args[{p}]",
        on_compile: Callable[[], None] | None = None,
    ) -> None:
        if spec.call is None:
            raise InvalidArgumentError("a context without a call record cannot be split into B and W")
        templates = dict(parts.templates)
        order = [p for p, _ in parts.templates]
        rest = [p for p in order if p not in now]
        counts = {p: len(jax.tree.leaves(t)) for p, t in parts.templates}
        b_mask = [p in now for p in order for _ in range(counts[p])]
        res_avals, ct_avals = list(parts.residual_avals), list(parts.cotangent_avals)
        closed = parent.jaxpr(res_avals, ct_avals)
        self.partition: Partition = partition(closed, b_mask)
        self.parent = parent
        self.now = now
        self._now_structure = PathStructure.of_template(_template(templates, list(now), now_single))
        # B's gradients come in argnums order; they are returned in ``now``'s order
        starts, at = {}, 0
        for p in order:
            if p in now:
                starts[p] = at
                at += counts[p]
        self._now_perm = [starts[p] + i for p in now for i in range(counts[p])]
        part = self.partition

        def b_flat(residuals: Sequence[Any], cts: Sequence[Any]) -> tuple[list[Any], list[Any]]:
            return part.run_b(*residuals, *cts)

        self._b_jit = jax.jit(b_flat)
        self._b_executables = Executables(self._b_jit, on_compile)
        b_out = self._b_jit.trace(res_avals, ct_avals).jaxpr.out_avals
        n_now = sum(b_mask)
        pool = res_avals + ct_avals
        given = [pool[i] for i in part.inputs_of_w]
        later_avals = [placement.abstract(a) for a in given] + [placement.abstract(a) for a in b_out[n_now:]]
        n_given = len(given)

        def w_flat(residuals: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
            del cts  # none: later holds them
            return part.run_w(list(residuals[:n_given]), list(residuals[n_given:]))

        w_jit = jax.jit(w_flat)
        w_jaxpr = w_jit.trace(later_avals, []).jaxpr
        canonical_now = tuple(p for p in order if p in now)  # the same later, whatever the order
        signature = later_signature(parent=parent.signature, now=canonical_now, avals=later_avals, weight_half=w_jaxpr)
        grad_structure = PathStructure.of_template(_template(templates, rest, len(rest) == 1))
        self.later_spec = self._later_spec(
            signature, spec, parent, part, later_avals, canonical_now, _gradient_paths(rest, templates, arg_name)
        )
        callbacks = jaxpr_walks.host_callbacks(w_jaxpr)
        self.weight_backward = Backward(
            signature=signature,
            flat_fn=w_flat,
            out_structure=PathStructure.of(jax.tree.structure(())),
            out_avals=(),
            grad_structure=grad_structure,
            on_compile=on_compile,
            jitted=w_jit,
            unexportable=f"its W half calls back into Python ({', '.join(sorted(set(callbacks)))})"
            if callbacks
            else None,
        )

    @staticmethod
    def _later_spec(
        signature: str,
        spec: ResidualSpec,
        parent: Backward,
        part: Partition,
        avals: Sequence[Any],
        now: tuple[int, ...],
        weight_paths: Sequence[str],
    ) -> ResidualSpec:
        """Names, kinds and key paths of what ``later`` holds: the parent's residuals keep
        theirs (and stay in host memory where the parent's did); cotangents and values B
        computed are intermediates."""
        n_res = len(spec.avals)
        ct_paths = [parent.out_structure.paths[i] for i in parent.float_leaves]
        names, paths, kinds = [], [], []
        for i in part.inputs_of_w:
            if i < n_res:  # a residual of the parent, held as it is (a weight by reference)
                names.append(spec.names[i])
                paths.append(spec.input_paths[i])
                kinds.append(spec.kinds[i])
            else:
                names.append(f"cotangent of the output{ct_paths[i - n_res]}")
                paths.append(None)
                kinds.append("intermediate")
        for name, feeds in zip(part.computed_names, part.computed_feeds):
            into = ", ".join(weight_paths[j] for j in sorted(feeds)[:3]) + (", ..." if len(feeds) > 3 else "")
            names.append(f"cotangent for {into} ({name})" if into else f"cotangent ({name})")
        paths += [None] * part.n_computed
        kinds += ["intermediate"] * part.n_computed
        assert spec.call is not None
        return ResidualSpec(
            signature=signature,
            avals=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals),
            names=tuple(names),
            input_paths=tuple(paths),
            kinds=tuple(kinds),  # type: ignore[arg-type]
            call=dataclasses.replace(spec.call, now=now, parent=spec.signature),
            on_host=tuple(j for j, i in enumerate(part.inputs_of_w) if i in spec.on_host),
        )

    @property
    def compiles(self) -> int:
        """B executables compiled so far (one per placement of the residuals)."""
        return self._b_executables.compiles

    def drop_compiled(self) -> None:
        """Forgets the executables of both halves; the next call compiles again."""
        self._b_executables.clear()
        self.weight_backward.drop_compiled()

    def __call__(self, ctx: ResidualContext, cotangent: Any = None) -> tuple[Any, ResidualContext]:
        """B on ``ctx``: ``(gradients of the now arguments, later)``."""
        parent = self.parent
        if ctx.spec.signature != parent.signature:
            raise SignatureMismatchError(
                f"context has signature {ctx.spec.signature}, these halves split {parent.signature}"
            )
        cts = parent.cotangent_leaves(cotangent)
        residuals = list(ctx.residuals)
        g_now, computed = self._b_executables.run(residuals, cts, lambda: parent.check_residuals(ctx))
        pool = residuals + [c if isinstance(c, jax.Array) else jnp.asarray(c) for c in cts]
        held = [pool[i] for i in self.partition.inputs_of_w] + list(computed)
        later = bound_context(self.later_spec, held, backward=self.weight_backward)
        return self._now_structure.unflatten([g_now[i] for i in self._now_perm]), later
