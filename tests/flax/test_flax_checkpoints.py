"""jaxmem.flax with ``checkpoints=``: linen (``scan_layers``, the ``scan`` drop-in) and NNX
(``ScanLayers``/``scan_layers``, the ``scan`` drop-in) against ``nn.scan`` / ``nnx.scan``
(values, parameter gradients, per-layer dropout), the forward steps run against the binomial
schedule, and bad values named by the entry point."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem
from jaxmem._src.scan import schedule as schedule
from jaxmem.flax import linen as jl
from jaxmem.flax import nnx as jn

L, D = 6, 4
CHECKPOINTS = [1, 2, 3, "sqrt", 6]
# Each stack with every k (k=3 under a policy); the drop-ins (the same loop underneath) with the
# extremes. Each case compiles a gradient: few cases keep the file fast.
STACK_CASES = [(1, None), (2, None), ("sqrt", None), (6, None), (3, "dots")]
DROP_IN_CASES = [(1, None), ("sqrt", "dots")]
RATE = 0.25

X = np.random.default_rng(0).normal(size=(2, D)).astype(np.float32)
XS = np.random.default_rng(1).normal(size=(L, 2, D)).astype(np.float32)


def ids(cases):
    return [f"k={k}" + (f"-{p}" if p else "") for k, p in cases]


def expected_steps(k, length=L):
    """Forward steps of one gradient: one taped evaluation per step plus Revolve's advances."""
    slots = min(math.isqrt(length - 1) + 1 if k == "sqrt" else k, length)
    return length + schedule.revolve_advances(length, slots)


def assert_trees_close(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        # Rounding of the recomputed steps: small next to the leaf's largest value.
        scale = float(np.max(np.abs(np.asarray(w, np.float64)), initial=1.0))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * scale)


def test_expected_steps_is_the_planned_schedule():
    for k in CHECKPOINTS:
        plan = jaxmem.scan_residuals(
            lambda c, _: (jnp.tanh(c), None), jnp.asarray(X), None, length=L, checkpoints=k
        )
        assert plan.schedule.forward_steps == expected_steps(k), k


# ------------------------------------------------------------------------------------------
# linen


class Layer(nn.Module):
    """Dense + tanh + dropout (split per layer), so the gradient depends on every step."""

    @nn.compact
    def __call__(self, h):
        return nn.Dropout(RATE, deterministic=False)(jnp.tanh(nn.Dense(D)(h)))


class PairLayer(Layer):
    """The same layer in nn.scan's ``(carry, y)`` form."""

    def __call__(self, h):
        return Layer.__call__(self, h), None


class Cell(nn.Module):
    """An RNN cell with dropout: broadcast params, a scanned input and a stacked output."""

    @nn.compact
    def __call__(self, h, x):
        h = nn.Dropout(RATE, deterministic=False)(jnp.tanh(nn.Dense(D)(h) + x))
        return h, h * h


LAYERS_SPLIT = {"params": True, "dropout": True}
CELL_OPTS = dict(
    variable_broadcast="params", split_rngs={"params": False, "dropout": True}, in_axes=0
)


def _linen_grad(model, params, *args):
    def loss(p):
        out = model.apply({"params": p}, *args, rngs={"dropout": jax.random.key(7)})
        return sum(jnp.sum(o**2) for o in jax.tree.leaves(out))

    return jax.jit(jax.value_and_grad(loss))(params)


@functools.cache
def linen_reference(which):
    """``nn.scan``'s parameters and ``(loss, grads)``, computed once per module."""
    if which == "layers":
        model = nn.scan(PairLayer, variable_axes={"params": 0}, split_rngs=LAYERS_SPLIT, length=L)
        args = (X,)
    else:
        model, args = nn.scan(Cell, **CELL_OPTS), (X, XS)
    params = jax.jit(model().init)(jax.random.key(0), *args)["params"]
    return params, _linen_grad(model(), params, *args)


@pytest.mark.parametrize("k,policy", STACK_CASES, ids=ids(STACK_CASES))
def test_linen_scan_layers_matches_nn_scan(k, policy):
    params, want = linen_reference("layers")
    ours = jl.scan_layers(Layer, L, checkpoints=k, policy=policy)()
    with jaxmem.step_counter() as counter:
        got = jax.block_until_ready(_linen_grad(ours, params, X))
    assert_trees_close(got, want)
    assert counter.forward_steps == expected_steps(k)


@pytest.mark.parametrize("k,policy", DROP_IN_CASES, ids=ids(DROP_IN_CASES))
def test_linen_scan_matches_nn_scan(k, policy):
    params, want = linen_reference("cell")
    ours = jl.scan(Cell, **CELL_OPTS, checkpoints=k, policy=policy)()
    with jaxmem.step_counter() as counter:
        got = jax.block_until_ready(_linen_grad(ours, params, X, XS))
    assert_trees_close(got, want)
    assert counter.forward_steps == expected_steps(k)


# ------------------------------------------------------------------------------------------
# NNX


class Block(nnx.Module):
    """Linear + tanh + dropout, its RNG stream stacked per layer (and advanced by each call)."""

    def __init__(self, *, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)
        self.drop = nnx.Dropout(RATE, rngs=rngs)

    def __call__(self, h):
        return self.drop(jnp.tanh(self.linear(h)))


def make_block(rngs):
    return Block(rngs=rngs)


def _nnx_grad(forward, model, *args):
    """``(loss, grads)`` of ``sum(forward(model, *args) ** 2)``, and the model's RNG state after."""

    @nnx.jit
    def run(model, *args):
        loss = lambda m: sum(jnp.sum(o**2) for o in jax.tree.leaves(forward(m, *args)))
        return nnx.value_and_grad(loss)(model)

    out = run(model, *args)
    return out, nnx.state(model, nnx.RngState)


def stock_layers(m, h):
    scan = nnx.scan(lambda layer, c: layer(c), in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    return scan(m.layers, h)


def cell_step(cell, h, x):
    h = cell(h) + x
    return h, h * h


CELL_AXES = dict(in_axes=(None, nnx.Carry, 0), out_axes=(nnx.Carry, 0))


@functools.cache
def nnx_reference(which):
    """``nnx.scan``'s ``((loss, grads), rng state after)``, computed once per module."""
    if which == "layers":
        stack = jn.ScanLayers(make_block, L, rngs=nnx.Rngs(0, dropout=1))
        return _nnx_grad(stock_layers, stack, X)
    return _nnx_grad(nnx.scan(cell_step, **CELL_AXES), Block(rngs=nnx.Rngs(0, dropout=1)), X, XS)


@pytest.mark.parametrize(
    "k,policy,build",
    [(k, p, jn.scan_layers if k == 6 else jn.ScanLayers) for k, p in STACK_CASES],
    ids=[
        ("scan_layers-" if k == 6 else "ScanLayers-") + i
        for (k, _), i in zip(STACK_CASES, ids(STACK_CASES), strict=True)
    ],
)
def test_nnx_scan_layers_matches_nnx_scan(k, policy, build):
    stack = build(make_block, L, rngs=nnx.Rngs(0, dropout=1), checkpoints=k, policy=policy)
    with jaxmem.step_counter() as counter:
        got = jax.block_until_ready(_nnx_grad(lambda m, h: m(h), stack, X))
    # Values, parameter gradients, and the per-layer dropout streams advanced as by nnx.scan.
    assert_trees_close(got, nnx_reference("layers"))
    assert counter.forward_steps == expected_steps(k)


@pytest.mark.parametrize("k,policy", DROP_IN_CASES, ids=ids(DROP_IN_CASES))
def test_nnx_scan_matches_nnx_scan(k, policy):
    @jn.scan(**CELL_AXES, checkpoints=k, policy=policy)  # the decorator form
    def ours(cell, h, xs):
        return cell_step(cell, h, xs)

    cell = Block(rngs=nnx.Rngs(0, dropout=1))
    with jaxmem.step_counter() as counter:
        got = jax.block_until_ready(_nnx_grad(ours, cell, X, XS))
    assert_trees_close(got, nnx_reference("cell"))
    assert counter.forward_steps == expected_steps(k)


def test_none_keeps_the_lean_vjp():
    """checkpoints=None (the default) is the stack as before: each step taped once."""
    stack = jn.ScanLayers(make_block, L, rngs=nnx.Rngs(0, dropout=1))
    with jaxmem.step_counter() as counter:
        got = jax.block_until_ready(_nnx_grad(lambda m, h: m(h), stack, X))
    assert_trees_close(got, nnx_reference("layers"))
    assert counter.forward_steps == L


# ------------------------------------------------------------------------------------------
# Bad values fail at construction, named by the entry point.


# (id, the name in the message, build with the keywords)
ENTRY_POINTS = [
    (
        "linen.scan",
        "jaxmem.flax.linen.scan",
        lambda **kw: jl.scan(Cell, variable_broadcast="params", **kw),
    ),
    (
        "linen.scan_layers",
        "jaxmem.flax.linen.scan_layers",
        lambda **kw: jl.scan_layers(Layer, L, **kw),
    ),
    ("nnx.scan", "jaxmem.flax.nnx.scan", lambda **kw: jn.scan(lambda c, x: (c, x), **kw)),
    (
        "nnx.ScanLayers",
        "jaxmem.flax.nnx.ScanLayers",
        lambda **kw: jn.ScanLayers(make_block, L, rngs=nnx.Rngs(0), **kw),
    ),
    # jn.scan_layers builds a ScanLayers, whose name its errors carry (as for length).
    (
        "nnx.scan_layers",
        "jaxmem.flax.nnx.ScanLayers",
        lambda **kw: jn.scan_layers(make_block, L, rngs=nnx.Rngs(0), **kw),
    ),
]
BAD = [
    (dict(checkpoints=0), ValueError, "checkpoints=0"),
    (dict(checkpoints=-2), ValueError, "checkpoints=-2"),
    (dict(checkpoints="log"), ValueError, "checkpoints='log'"),
    (dict(checkpoints=2.5), TypeError, "checkpoints=2.5"),
    (dict(checkpoints=True), TypeError, "checkpoints=True"),
    (dict(checkpoints=2, offload="residuals"), ValueError, "offload='residuals'"),
]


@pytest.mark.parametrize("bad,error,shown", BAD, ids=[b[2] for b in BAD])
@pytest.mark.parametrize(
    "fname,build", [e[1:] for e in ENTRY_POINTS], ids=[e[0] for e in ENTRY_POINTS]
)
def test_bad_checkpoints_name_the_entry_point(fname, build, bad, error, shown):
    with pytest.raises(error, match="^" + fname.replace(".", r"\.") + " got ") as info:
        build(**bad)
    assert shown in str(info.value)
