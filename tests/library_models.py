"""The test matrix of issue 10: one small model per library feature that a split must carry.

Each ``make_<case>()`` returns a :class:`Case`: the function a user splits, its first argument
(the one differentiated), ``batch(key)`` for the other positional arguments of one microbatch
(fresh random inputs from ``key``), the ``rs.split`` options, and what a process that imported
the libraries (but not this module) should get the gradients back as.

Cases:
  ``nnx_functional``  Flax NNX ``nnx.split``/``nnx.merge`` with ``nnx.BatchNorm`` (its batch
                      statistics returned through ``has_aux``) and ``nnx.Dropout`` (its key passed
                      as a non-differentiated argument, next to the Dropout's own RNG stream state).
  ``nnx_whole``       The whole NNX state (parameters, batch statistics, RNG key and counter) as the
                      differentiated argument with ``filter=rs.is_inexact``; the new state is aux.
  ``linen_scan``      Flax linen ``nn.scan(nn.remat(Block))`` over a few layers.
  ``eqx_transformer`` An Equinox transformer block (``eqx.nn.MultiheadAttention``, an MLP,
                      ``eqx.nn.LayerNorm``), partitioned with ``eqx.partition``.
  ``eqx_gru``         A whole ``eqx.nn.GRUCell`` under ``lax.scan``, with ``filter=rs.is_inexact``.
  ``haiku_state``     Haiku ``hk.transform_with_state`` (``hk.BatchNorm`` state through
                      ``has_aux``) with ``hk.remat``.
  ``custom_nodes``    Custom pytree node classes defined here: one registered with
                      ``register_pytree_with_keys_class``, one a dataclass with ``register_dataclass``.
  ``int_keys``        A dict with int keys, what ``nnx.to_pure_dict`` makes of an ``nnx.List``.

Shapes are tiny (hidden sizes <= 16, sequences <= 4, batch <= 4) and seeds are fixed, so every
process builds the same parameters. Imported by the tests only: the processes that run stored
backwards never import it (nor the libraries, in one of them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
from flax import nnx

import residual_store as rs
from libraries import flat  # noqa: F401 - {keystr: leaf}, shared with the resume tests

IN, HIDDEN, OUT, BATCH, SEQ, LAYERS, HEADS = 4, 8, 2, 4, 4, 3, 2


@dataclasses.dataclass
class Case:
    """One model of the matrix.

    Attributes:
      name: the case's name (store keys start with it).
      fun: the function to split; its first argument is differentiated.
      params: that first argument.
      batch: ``batch(key)``: the other positional arguments of one microbatch.
      options: keyword options for ``rs.split`` (``has_aux``, ``filter``).
      library_type: ``module.qualname`` of the gradients' type in a process that imported the
        libraries (flax.nnx, equinox) but not this module; ``None`` where a type defined here is
        in the structure (the gradients then come back as a ``dict`` from key path to array,
        unless every node is a JAX container: see ``plain``).
      plain: the structure is made of JAX containers only (dicts, lists, tuples), so every
        process gets it back as it was.
    """

    name: str
    fun: Callable[..., Any]
    params: Any
    batch: Callable[[jax.Array], tuple[Any, ...]]
    options: dict[str, Any]
    library_type: str | None = None
    plain: bool = False

    @property
    def has_aux(self) -> bool:
        return bool(self.options.get("has_aux", False))

    def args(self, key: jax.Array) -> tuple[Any, ...]:
        return (self.params, *self.batch(key))

    def split(self) -> rs.Split:
        return rs.split(self.fun, **self.options)


def reference(case: Case) -> Callable[..., tuple[Any, Any, Any]]:
    """A jitted ``jax.value_and_grad`` of ``case.fun`` in its first argument, differentiating
    the leaves ``case.options["filter"]`` accepts (all, without a filter): ``(*args) -> (out,
    aux, grads)``, ``grads`` shaped like ``args[0]`` with ``None`` at the leaves passed through."""
    keep = case.options.get("filter")

    def run(*args: Any) -> tuple[Any, Any, Any]:
        leaves, treedef = jax.tree.flatten(args[0])
        rest, rest_tree = jax.tree.flatten(args[1:])
        mask = [keep is None or bool(keep(x)) for x in leaves]

        def f(diff: list[Any]) -> Any:
            it = iter(diff)
            merged = [next(it) if m else x for x, m in zip(leaves, mask)]
            # every argument rebuilt at this trace level (NNX mutates Variables only there)
            return case.fun(jax.tree.unflatten(treedef, merged), *jax.tree.unflatten(rest_tree, rest))

        value, g = jax.value_and_grad(f, has_aux=case.has_aux)([x for x, m in zip(leaves, mask) if m])
        it = iter(g)
        grads = jax.tree.unflatten(treedef, [next(it) if m else None for m in mask])
        out, aux = value if case.has_aux else (value, None)
        return out, aux, grads

    jitted = jax.jit(run)

    def call(*args: Any) -> tuple[Any, Any, Any]:
        # a whole Equinox module holds Python leaves (flags, functions): run it unjitted, as
        # eqx.filter_jit would keep them static
        return jitted(*args) if all(eqx.is_array(x) for x in jax.tree.leaves(args)) else run(*args)

    return call


def _mse(pred: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((pred - y) ** 2)


def _xy(key: jax.Array, x_shape: tuple[int, ...], y_shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, x_shape), jax.random.normal(ky, y_shape)


# ----------------------------------------------------------------------------------------------
# 1. Flax NNX: BatchNorm statistics through has_aux, Dropout keys


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.bn = nnx.BatchNorm(HIDDEN, use_running_average=False, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)  # keeps its own stream: a key and a uint32 count
        self.l2 = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x: jax.Array, rngs: jax.Array | None = None) -> jax.Array:
        h = jnp.tanh(self.bn(self.l1(x)))
        return self.l2(self.drop(h, rngs=rngs))


def make_nnx_functional() -> Case:
    """``loss(params, batch_stats, rng_state, x, y, dropout_key) -> (loss, new batch_stats)``."""
    graphdef, params, batch_stats, rng_state = nnx.split(NnxNet(nnx.Rngs(0, dropout=1)), nnx.Param, nnx.BatchStat, ...)

    def loss(params, batch_stats, rng_state, x, y, dropout_key):
        model = nnx.merge(graphdef, params, batch_stats, rng_state)
        pred = model(x, rngs=dropout_key)
        return _mse(pred, y), nnx.state(model, nnx.BatchStat)

    def batch(key: jax.Array) -> tuple[Any, ...]:
        kxy, kd = jax.random.split(key)
        return (batch_stats, rng_state, *_xy(kxy, (BATCH, IN), (BATCH, OUT)), kd)

    return Case("nnx_functional", loss, params, batch, {"has_aux": True}, library_type="flax.nnx.statelib.State")


def make_nnx_whole() -> Case:
    """``loss(state, x, y) -> (loss, new state)``: the whole state, RNG counter and key included,
    differentiated with ``filter=rs.is_inexact`` (as ``nnx.grad`` users pass the module)."""
    graphdef, state = nnx.split(NnxNet(nnx.Rngs(2, dropout=3)))

    def loss(state, x, y):
        model = nnx.merge(graphdef, state)
        return _mse(model(x), y), nnx.state(model)  # Dropout draws from (and advances) its stream

    def batch(key: jax.Array) -> tuple[Any, ...]:
        return _xy(key, (BATCH, IN), (BATCH, OUT))

    return Case(
        "nnx_whole", loss, state, batch, {"has_aux": True, "filter": rs.is_inexact},
        library_type="flax.nnx.statelib.State",
    )


# ----------------------------------------------------------------------------------------------
# 2. Flax linen: nn.scan(nn.remat(Block))


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h: jax.Array, _: Any) -> tuple[jax.Array, None]:
        return h + nn.LayerNorm()(jnp.tanh(nn.Dense(HIDDEN)(h))), None


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(HIDDEN)(x)
        stack = nn.scan(
            nn.remat(LinenBlock),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=LAYERS,
        )
        h, _ = stack(name="layers")(h, None)
        return nn.Dense(OUT)(h)


def make_linen_scan() -> Case:
    net = LinenNet()
    variables = net.init(jax.random.key(4), jnp.zeros((1, IN)))

    def loss(variables, x, y):
        return _mse(net.apply(variables, x), y)

    def batch(key: jax.Array) -> tuple[Any, ...]:
        return _xy(key, (BATCH, IN), (BATCH, OUT))

    return Case("linen_scan", loss, variables, batch, {}, plain=True)


# ----------------------------------------------------------------------------------------------
# 3. Equinox: a transformer block; a GRUCell under lax.scan


class EqxBlock(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    ln1: eqx.nn.LayerNorm
    ln2: eqx.nn.LayerNorm

    def __init__(self, key: jax.Array) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn = eqx.nn.MultiheadAttention(HEADS, HIDDEN, key=k1)
        self.fc1 = eqx.nn.Linear(HIDDEN, 2 * HIDDEN, key=k2)
        self.fc2 = eqx.nn.Linear(2 * HIDDEN, HIDDEN, key=k3)
        self.ln1 = eqx.nn.LayerNorm(HIDDEN)
        self.ln2 = eqx.nn.LayerNorm(HIDDEN)

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (SEQ, HIDDEN)
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(h)))


def _eqx_block() -> EqxBlock:
    return EqxBlock(jax.random.key(5))


def _seq_batch(key: jax.Array) -> tuple[Any, ...]:
    return _xy(key, (BATCH, SEQ, HIDDEN), (BATCH, SEQ, HIDDEN))


def make_eqx_transformer() -> Case:
    """The block partitioned into its inexact arrays and the rest (``eqx.partition``)."""
    params, static = eqx.partition(_eqx_block(), eqx.is_inexact_array)

    def loss(params, x, y):
        return _mse(jax.vmap(eqx.combine(params, static))(x), y)

    return Case("eqx_transformer", loss, params, _seq_batch, {})


def make_eqx_transformer_whole() -> Case:
    """The same block passed whole with ``filter=rs.is_inexact``, as ``eqx.filter_grad`` users
    do. Its ``eqx.nn.Dropout`` (inside ``MultiheadAttention``) holds Python leaves
    (``p=0.0``, ``inference=False``) that ``eqx.filter_grad`` leaves untouched."""

    def loss(model, x, y):
        return _mse(jax.vmap(model)(x), y)

    return Case("eqx_transformer_whole", loss, _eqx_block(), _seq_batch, {"filter": rs.is_inexact})


def make_eqx_gru() -> Case:
    """A whole ``eqx.nn.GRUCell`` (a built-in Equinox module) with ``filter=rs.is_inexact``."""
    cell = eqx.nn.GRUCell(IN, HIDDEN, key=jax.random.key(6))

    def loss(cell, xs, y):  # xs: (SEQ, BATCH, IN)
        def step(h, x):
            return jax.vmap(cell)(x, h), None

        h, _ = jax.lax.scan(step, jnp.zeros((BATCH, HIDDEN)), xs)
        return _mse(h, y)

    def batch(key: jax.Array) -> tuple[Any, ...]:
        return _xy(key, (SEQ, BATCH, IN), (BATCH, HIDDEN))

    return Case("eqx_gru", loss, cell, batch, {"filter": rs.is_inexact}, library_type="equinox.nn._rnn.GRUCell")


# ----------------------------------------------------------------------------------------------
# 4. Haiku: transform_with_state, hk.remat


def _haiku_forward(x: jax.Array, is_training: bool) -> jax.Array:
    h = hk.Linear(HIDDEN)(x)
    h = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(h, is_training)
    h = hk.remat(lambda h: jnp.tanh(hk.Linear(HIDDEN, name="inner")(h)))(h)
    return hk.Linear(OUT)(h)


def make_haiku_state() -> Case:
    """``loss(params, state, x, y) -> (loss, new state)``; the state holds int32 counters."""
    net = hk.without_apply_rng(hk.transform_with_state(_haiku_forward))
    params, state = net.init(jax.random.key(7), jnp.zeros((BATCH, IN)), True)

    def loss(params, state, x, y):
        pred, new_state = net.apply(params, state, x, True)
        return _mse(pred, y), new_state

    def batch(key: jax.Array) -> tuple[Any, ...]:
        return (state, *_xy(key, (BATCH, IN), (BATCH, OUT)))

    return Case("haiku_state", loss, params, batch, {"has_aux": True}, plain=True)


# ----------------------------------------------------------------------------------------------
# 5. Custom pytree node classes


@jax.tree_util.register_pytree_with_keys_class
class Affine:
    """``activation(x @ w + b)``; the activation's name is static (the node's aux data)."""

    def __init__(self, w: Any, b: Any, activation: str = "tanh") -> None:
        self.w, self.b, self.activation = w, b, activation

    def tree_flatten_with_keys(self) -> tuple[Any, str]:
        keys = jax.tree_util.GetAttrKey
        return ((keys("w"), self.w), (keys("b"), self.b)), self.activation

    @classmethod
    def tree_unflatten(cls, activation: str, children: Any) -> Affine:
        return cls(*children, activation=activation)

    def __call__(self, x: jax.Array) -> jax.Array:
        return getattr(jnp, self.activation)(x @ self.w + self.b)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["layers", "scale"], meta_fields=["name"])
@dataclasses.dataclass
class Stack:
    layers: list[Affine]
    scale: Any
    name: str = "stack"


def make_custom_nodes() -> Case:
    k1, k2, k3 = jax.random.split(jax.random.key(8), 3)
    params = Stack(
        layers=[
            Affine(jax.random.normal(k1, (IN, HIDDEN)) * 0.5, jnp.full((HIDDEN,), 0.1)),
            Affine(jax.random.normal(k2, (HIDDEN, OUT)) * 0.5, jnp.zeros((OUT,)), activation="sin"),
        ],
        scale=jax.random.uniform(k3, (OUT,), minval=0.5, maxval=1.5),
    )

    def loss(p, x, y):
        h = x
        for layer in p.layers:
            h = layer(h)
        return _mse(h * p.scale, y)

    def batch(key: jax.Array) -> tuple[Any, ...]:
        return _xy(key, (BATCH, IN), (BATCH, OUT))

    return Case("custom_nodes", loss, params, batch, {})


# ----------------------------------------------------------------------------------------------
# 6. A dict with int keys (nnx.to_pure_dict of an nnx.List)


class NnxListNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(IN if i == 0 else HIDDEN, HIDDEN, rngs=rngs) for i in range(LAYERS)])
        self.head = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.head(x)


def make_int_keys() -> Case:
    """``params`` is ``nnx.to_pure_dict(state)``: ``{"head": ..., "layers": {0: ..., 1: ..., 2: ...}}``."""
    graphdef, state = nnx.split(NnxListNet(nnx.Rngs(9)))
    pure = nnx.to_pure_dict(state)

    def loss(pure, x, y):
        template = jax.tree.map(lambda v: v, state)  # fresh Variables: the template stays as it was
        nnx.replace_by_pure_dict(template, pure)
        return _mse(nnx.merge(graphdef, template)(x), y)

    def batch(key: jax.Array) -> tuple[Any, ...]:
        return _xy(key, (BATCH, IN), (BATCH, OUT))

    return Case("int_keys", loss, pure, batch, {}, plain=True)


MAKERS: dict[str, Callable[[], Case]] = {
    "nnx_functional": make_nnx_functional,
    "nnx_whole": make_nnx_whole,
    "linen_scan": make_linen_scan,
    "eqx_transformer": make_eqx_transformer,
    "eqx_gru": make_eqx_gru,
    "haiku_state": make_haiku_state,
    "custom_nodes": make_custom_nodes,
    "int_keys": make_int_keys,
}

