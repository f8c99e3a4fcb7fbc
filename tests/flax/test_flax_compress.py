"""``compress=`` on the Flax stacks (``jaxmem.flax.linen`` / ``jaxmem.flax.nnx``): checked with the
entry point's name, forward values bit-identical to ``compress=None``'s, gradients within the
format's bound (tests/scan/test_compress.py has the rest)."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.flax import linen as jl
from jaxmem.flax import nnx as jn

L, B, D = 3, 8, 64
X = np.random.default_rng(0).normal(size=(B, D)).astype(np.float32)


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(D)(jax.nn.gelu(nn.Dense(2 * D)(x)))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


def _rel(got, ref) -> float:
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True)
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in pairs)
    return math.sqrt(num / sum(float(jnp.sum(b**2)) for b in jax.tree.leaves(ref)))


BUILDERS = [
    ("jaxmem.flax.linen.scan_layers", lambda **kw: jl.scan_layers(Layer, L, **kw)),
    (
        "jaxmem.flax.linen.scan",
        lambda **kw: jl.scan(Layer, variable_axes={"params": 0}, length=L, **kw),
    ),
    ("jaxmem.flax.nnx.scan", lambda **kw: jn.scan(lambda c, x: (c, x), **kw)),
    (
        "jaxmem.flax.nnx.ScanLayers",
        lambda **kw: jn.ScanLayers(Block, L, rngs=nnx.Rngs(0), **kw),
    ),
    (
        "jaxmem.flax.nnx.ScanLayers",
        lambda **kw: jn.scan_layers(Block, L, rngs=nnx.Rngs(0), **kw),
    ),
]


@pytest.mark.parametrize(
    "fname,build", BUILDERS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BUILDERS)]
)
def test_bad_compress_names_the_entry_point(fname, build):
    with pytest.raises(ValueError, match="^" + fname.replace(".", r"\.") + " got compress='fp4'"):
        build(compress="fp4")


@pytest.mark.parametrize("fmt,bound", [("bf16", 5e-3), ("int8", 4e-2)])
def test_linen_scan_layers_compress(fmt, bound):
    exact, small = jl.scan_layers(Layer, L)(), jl.scan_layers(Layer, L, compress=fmt)()
    params = exact.init(jax.random.key(0), X)["params"]

    def loss(model):
        return lambda p: jnp.sum(model.apply({"params": p}, X) ** 2)

    v0, g0 = jax.jit(jax.value_and_grad(loss(exact)))(params)
    v, g = jax.jit(jax.value_and_grad(loss(small)))(params)
    np.testing.assert_array_equal(v, v0)
    assert 0 < _rel(g, g0) <= bound


@pytest.mark.parametrize("fmt,bound", [("bf16", 5e-3), ("int8", 4e-2)])
def test_nnx_scan_layers_compress(fmt, bound):
    def grads(compress):
        stack = jn.scan_layers(Block, L, rngs=nnx.Rngs(0), compress=compress)
        return nnx.value_and_grad(lambda m: jnp.sum(m(jnp.asarray(X)) ** 2))(stack)

    (v0, g0), (v, g) = grads(None), grads(fmt)
    np.testing.assert_array_equal(v, v0)
    assert 0 < _rel(nnx.state(g), nnx.state(g0)) <= bound
