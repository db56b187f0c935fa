"""Residual names point at the user's code: the line in the model's own file (not Flax's,
Equinox's, Haiku's or JAX's), then where in the model (the library's name stack, or the nearest
weight's key path); a ``checkpoint_name`` label comes first; names are the same in every process.

The models are defined here, so every intermediate's line must be a line of this file.
"""

from __future__ import annotations

import doctest
import inspect
import json
import os
import re
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import residual_store as rs
from residual_store._src import names

IN, HIDDEN, OUT, BATCH = 3, 4, 2, 2
THIS_FILE = os.path.basename(__file__)
LINE = re.compile(r"(\S+\.py):(\d+)")


def _batch() -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(0))
    return jax.random.normal(kx, (BATCH, IN)), jax.random.normal(ky, (BATCH, OUT))


def _mse(pred: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((pred - y) ** 2)


# -- the models (two layers each) ---------------------------------------------------------------


def make_linen() -> tuple[Any, Any, list[Any]]:
    import flax.linen as nn

    class Block(nn.Module):
        features: int

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return jnp.tanh(nn.LayerNorm(name="norm")(nn.Dense(self.features, name="mlp")(x)))

    class LinenNet(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return Block(OUT, name="Block_1")(Block(HIDDEN, name="Block_0")(x))

    net = LinenNet()
    variables = jax.jit(net.init)(jax.random.key(1), jnp.zeros((1, IN)))  # (one compile, not one an op)

    def loss(v, x, y):
        return _mse(net.apply(v, x), y)

    return loss, variables, [Block, LinenNet, loss]


def make_nnx() -> tuple[Any, Any, list[Any]]:
    from flax import nnx

    class NNXBlock(nnx.Module):
        def __init__(self, din: int, dout: int, rngs: nnx.Rngs) -> None:
            self.mlp = nnx.Linear(din, dout, rngs=rngs)
            self.norm = nnx.LayerNorm(dout, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return jnp.tanh(self.norm(self.mlp(x)))

    class NNXNet(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.blocks = nnx.List([NNXBlock(IN, HIDDEN, rngs), NNXBlock(HIDDEN, OUT, rngs)])

        def __call__(self, x: jax.Array) -> jax.Array:
            for block in self.blocks:
                x = block(x)
            return x

    graphdef, state = nnx.split(NNXNet(nnx.Rngs(2)))

    def loss(s, x, y):
        return _mse(nnx.merge(graphdef, s)(x), y)

    return loss, state, [NNXBlock, NNXNet, loss]


def make_equinox() -> tuple[Any, Any, list[Any]]:
    import equinox as eqx

    class EqxNet(eqx.Module):
        layers: list

        def __init__(self, key: jax.Array) -> None:
            k1, k2 = jax.random.split(key)
            self.layers = [eqx.nn.Linear(IN, HIDDEN, key=k1), eqx.nn.Linear(HIDDEN, OUT, key=k2)]

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.layers[1](jnp.tanh(self.layers[0](x)))

    params, static = eqx.partition(EqxNet(jax.random.key(3)), eqx.is_array)

    def loss(p, x, y):
        return _mse(jax.vmap(eqx.combine(p, static))(x), y)

    return loss, params, [EqxNet, loss]


def make_haiku() -> tuple[Any, Any, list[Any]]:
    import haiku as hk

    def forward(x: jax.Array) -> jax.Array:
        h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(hk.Linear(HIDDEN, name="layer1")(x))
        return hk.Linear(OUT, name="layer2")(jnp.tanh(h))

    net = hk.without_apply_rng(hk.transform(forward))
    params = jax.jit(net.init)(jax.random.key(4), jnp.zeros((1, IN)))

    def loss(p, x, y):
        return _mse(net.apply(p, x), y)

    return loss, params, [forward, loss]


def _plain_loss(params, x, y):
    policy = jax.checkpoint_policies.save_only_these_names("hidden")

    @jax.checkpoint
    def layer(w, h):
        return checkpoint_name(jnp.tanh(h @ w), "hidden")

    with jax.named_scope("encoder"):
        h = jax.checkpoint(layer, policy=policy)(params["w1"], x)
    return _mse(h @ params["w2"], y)


def make_plain() -> tuple[Any, Any, list[Any]]:
    k1, k2 = jax.random.split(jax.random.key(5))
    params = {"w1": jax.random.normal(k1, (IN, HIDDEN)), "w2": jax.random.normal(k2, (HIDDEN, OUT))}
    return _plain_loss, params, [_plain_loss]


MAKERS = {"linen": make_linen, "nnx": make_nnx, "equinox": make_equinox, "haiku": make_haiku, "plain": make_plain}


def spec_of(kind: str) -> tuple[rs.ResidualSpec, set[int]]:
    """The residual spec of one model's forward, and the lines of this file its code spans."""
    loss, params, code = MAKERS[kind]()
    _, ctx = rs.split(loss)(params, *_batch())
    lines = set()
    for obj in code + [_mse]:
        source, start = inspect.getsourcelines(obj)
        lines.update(range(start, start + len(source)))
    return ctx.spec, lines


def intermediates(spec: rs.ResidualSpec) -> list[str]:
    return [n for n, k in zip(spec.names, spec.kinds) if k == "intermediate"]


@pytest.fixture(scope="module")
def specs() -> dict[str, tuple[rs.ResidualSpec, set[int]]]:
    return {kind: spec_of(kind) for kind in MAKERS}


# -- the tests -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MAKERS))
def test_every_intermediate_names_a_line_of_the_models_file(specs, kind):
    spec, lines = specs[kind]
    found = intermediates(spec)
    assert found, spec.names
    for name in found:
        where = LINE.findall(name)
        assert len(where) == 1, f"{kind}: {name!r} names no line, or several"
        file, line = where[0]
        assert file == THIS_FILE and int(line) in lines, f"{kind}: {name!r} is not a line of the model"


@pytest.mark.slow
def test_linen_names_carry_the_name_stack(specs):
    found = intermediates(specs["linen"][0])
    inside = [n for n in found if " in LinenNet" in n]
    assert len(inside) >= len(found) - 1, found  # all but the loss, which is outside the model
    for block in ("Block_0", "Block_1"):
        assert any(n.startswith("tanh ") and n.endswith(f" in LinenNet/{block}") for n in found), found
        assert any(n.startswith("rsqrt ") and n.endswith(f" in LinenNet/{block}/norm") for n in found), found
    assert not any(" after " in n for n in inside), found


def test_nnx_names_carry_the_nearest_weight(specs):
    found = intermediates(specs["nnx"][0])
    assert all(" after s['blocks'][" in n and " in " not in n for n in found[:-1]), found
    # The normalisation's statistics come after the linear layer, the activation after the norm's
    # scale and offset; the trailing parameter name and NNX's ``.value`` are dropped.
    for i in (0, 1):
        assert any(n.startswith("rsqrt ") and n.endswith(f" after s['blocks'][{i}]['mlp']") for n in found), found
        assert any(n.startswith("tanh ") and n.endswith(f" after s['blocks'][{i}]['norm']") for n in found), found
    assert found[-1].endswith(" after s['blocks'][1]['norm']"), found  # the loss, after the last layer


def test_equinox_names_carry_the_nearest_weight(specs):
    found = intermediates(specs["equinox"][0])
    assert any(n.startswith("tanh ") and n.endswith(" after p.layers[0]") for n in found), found
    assert found[-1].endswith(" after p.layers[1]"), found
    # Equinox's own named scopes are class names (eqx.nn.Linear), which name no layer.
    assert not any(" in " in n or "eqx." in n for n in found), found


def test_haiku_names_carry_its_module_names_or_the_nearest_weight(specs):
    found = intermediates(specs["haiku"][0])
    # Haiku names a scope after each module it calls (jax.named_call): ops inside one carry it.
    assert any(n.startswith("rsqrt ") and n.endswith(" in layer_norm") for n in found), found
    # The activation is outside every module: it comes after the nearest weight.
    assert any(n.startswith("tanh ") and n.endswith(" after p['layer_norm']") for n in found), found
    assert found[-1].endswith(" after p['layer2']"), found


def test_checkpoint_name_label_comes_first(specs):
    spec = specs["plain"][0]
    found = intermediates(spec)
    labelled = [n for n in found if n.startswith("hidden ")]
    assert len(labelled) == 1, found
    assert re.fullmatch(rf"hidden {THIS_FILE}:\d+ in encoder \(under checkpoint\)", labelled[0]), labelled
    assert "input params['w2']" in spec.names  # inputs keep their own names
    assert all(" in encoder" not in n for n in found if not n.startswith("hidden")), found


def test_nearest_weight_is_found_inside_loop_bodies():
    def loss(params, x):
        def step(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(step, x, params["layers"]["w"])
        return jnp.sum(h @ params["head"]["w"])

    params = {"layers": {"w": jnp.ones((2, IN, IN)) * 0.1}, "head": {"w": jnp.ones((IN, 1))}}
    _, ctx = rs.split(loss)(params, jnp.ones((BATCH, IN)))
    found = intermediates(ctx.spec)
    assert any(n.startswith("tanh ") and n.endswith(" after params['layers'] (under scan)") for n in found), found


def test_names_are_not_part_of_the_signature():
    def a(p, x):
        return jnp.sum(jnp.tanh(x @ p["w"]))

    def b(p, x):


        return jnp.sum(jnp.tanh(x @ p["w"]))  # the same computation, two lines further down

    args = ({"w": jnp.ones((IN, 1))}, jnp.ones((BATCH, IN)))
    sa, sb = rs.split(a)(*args)[1].spec, rs.split(b)(*args)[1].spec
    assert sa.signature == sb.signature
    assert sa.names != sb.names and intermediates(sa)[0].startswith(f"tanh {THIS_FILE}:")


def test_internals_names_module_docstring_examples():
    result = doctest.testmod(names)
    assert result.attempted > 0 and result.failed == 0


def test_internals_parameter_owner_and_module_path():
    assert names.parameter_owner("s['blocks'][0]['mlp']['kernel'].value") == "s['blocks'][0]['mlp']"
    assert names.parameter_owner("p.layers[1].weight") == "p.layers[1]"
    assert names.parameter_owner("params['mlp/~/linear_1']['w']") == "params['mlp/~/linear_1']"
    assert names.parameter_owner("params['w']") == "params['w']"
    assert names.parameter_owner("s['w'].value") == "s['w']"
    assert names.parameter_owner("ws[2]") == "ws[2]" and names.parameter_owner("p['ws'][1]") == "p['ws'][1]"
    assert names.parameter_owner("args[3]['w']") == "args[3]"
    assert names.parameter_owner("p[<odd key>]['w']") == "p[<odd key>]['w']"  # unparsed: unchanged
    assert names.module_path(("Net", "Block_1", "mlp")) == "Net/Block_1/mlp"
    assert names.module_path(("eqx.nn.MLP", "eqx.nn.Linear")) == ""
    assert names.module_path(("encoder", "eqx.nn.Linear")) == "encoder"


@pytest.mark.subprocess
def test_names_are_the_same_under_another_hash_seed(specs):
    here = {kind: list(specs[kind][0].names) for kind in ("linen", "nnx")}
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    out = subprocess.run(
        [sys.executable, __file__],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONHASHSEED": seed},
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


if __name__ == "__main__":
    print(json.dumps({kind: list(spec_of(kind)[0].names) for kind in ("linen", "nnx")}))
