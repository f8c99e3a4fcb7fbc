"""Reversible stacks with compressed anchors (``reversible_scan(..., anchor_every=k,
compress=...)``): the kept streams are stored in bf16/fp8/int8, the forward output stays exact,
the gradient is within each format's bound of ``compress=None``'s, the compiled loop stacks the
encoded bits (``u16``/``u8``/``s8``) and the temp drops; the Flax stacks pass the option
through; higher-order differentiation raises rather than return a wrong result."""

import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem
from jaxmem.flax import linen as jl
from jaxmem.flax import nnx as jn
from tests.compress_checks import check_encoded_stack

L, K, B, D = 12, 3, 8, 64  # 12 layers, an anchor every 3: 4 anchors of two [8, 64] streams
Q = L // K
FORMATS = ("bf16", "fp8", "int8")

# Relative global-norm gradient error against compress=None on this stack (measured on jax
# 0.12 and 0.10.2: bf16 1.6e-3, fp8 2.4e-2, int8 5.9e-3).
GRAD_BOUND = {"bf16": 4e-3, "fp8": 4e-2, "int8": 1.5e-2}

# Bytes of one stream's anchors, per format (fp8 and int8: one f32 scale per row).
_ANCHOR_BYTES = {None: 4 * Q * B * D, "bf16": 2 * Q * B * D, "fp8": Q * B * (D + 4)}
_ANCHOR_BYTES["int8"] = _ANCHOR_BYTES["fp8"]


def f(p, x2):
    return jnp.tanh(jnp.tanh(x2 @ p["f1"]) @ p["f2"])


def g(p, y1):
    return jnp.tanh(jnp.tanh(y1 @ p["g1"]) @ p["g2"])


def make_params(depth=L, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return {
        n: 0.5 * jax.random.normal(k, (depth, D, D)) / math.sqrt(D)
        for k, n in zip(keys, ("f1", "f2", "g1", "g2"), strict=True)
    }


PARAMS = make_params()
X = (jax.random.normal(jax.random.key(10), (B, D)), jax.random.normal(jax.random.key(20), (B, D)))


def run(params, streams, compress, anchor_every=K):
    return jaxmem.reversible_scan(
        f, g, streams, params, anchor_every=anchor_every, compress=compress
    )


def loss(params, streams, compress=None, anchor_every=K):
    y1, y2 = run(params, streams, compress, anchor_every)
    return jnp.mean((y1 + y2) ** 2) + jnp.mean(jnp.sin(y1))


def rel(a, b):
    """Relative global-norm error ``||a - b|| / ||b||`` over the leaves."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    num = sum(float(jnp.sum((jnp.float32(u) - jnp.float32(v)) ** 2)) for u, v in pairs)
    den = sum(float(jnp.sum(jnp.float32(v) ** 2)) for v in jax.tree.leaves(b))
    return math.sqrt(num / den)


_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=(2, 3))


# ----------------------------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("fmt", FORMATS)
def test_gradient_within_the_format_bound_and_forward_exact(fmt):
    value, grads = _grad(PARAMS, X, fmt, K)
    exact_value, exact = _grad(PARAMS, X, None, K)
    err = rel(grads, exact)
    assert 0 < err <= GRAD_BOUND[fmt], err
    # The forward pass is untouched: the loss and the output streams are bit-identical.
    assert value == exact_value
    out = jax.jit(run, static_argnums=(2, 3))(PARAMS, X, fmt, K)
    want = jax.jit(run, static_argnums=(2, 3))(PARAMS, X, None, K)
    for a, b in zip(out, want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_without_anchors_compress_changes_nothing(fmt):
    value, grads = _grad(PARAMS, X, fmt, None)
    exact_value, exact = _grad(PARAMS, X, None, None)
    assert value == exact_value
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(exact), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_remainder_layer_group_and_unbalanced_segments(fmt):
    """14 layers, anchor_every=4: a head of 2 layers reconstructed from the first anchor."""
    params = make_params(14, seed=1)
    grad = jax.jit(jax.grad(loss), static_argnums=(2, 3))
    err = rel(grad(params, X, fmt, 4), grad(params, X, None, 4))
    assert 0 < err <= GRAD_BOUND[fmt], err


def test_pytree_streams_three_streams_and_leaves_kept_as_they_are():
    """A three-stream coupling with pytree streams: a short-row leaf (4 values a row) is kept
    uncompressed under int8 (its scale would cost more than it saves), a bf16 leaf under bf16;
    the others are encoded, and the gradient stays within the format's bound."""
    w = 0.25 * jax.random.normal(jax.random.key(3), (L, D, D)) / math.sqrt(D)

    def f1(p, x2, x3):
        return {"a": jnp.tanh(x2 @ p), "b": 0.5 * jnp.tanh(x3["c"][:, :4])}

    def f2(p, y1, x3):
        h = y1["a"] + x3["d"].astype(jnp.float32) + jnp.mean(y1["b"], -1, keepdims=True)
        return jnp.tanh(h @ p)

    def f3(p, y1, y2):
        return {"c": jnp.tanh(y2 @ p), "d": (0.5 * jnp.tanh(y1["a"])).astype(jnp.bfloat16)}

    coupling = jaxmem.reversible(f1, f2, f3)
    x = (
        {"a": X[0], "b": X[1][:, :4]},
        X[1],
        {"c": X[0] * 0.5, "d": X[1].astype(jnp.bfloat16)},
    )

    def loss3(w, x, compress):
        out = coupling.scan(x, w, anchor_every=K, compress=compress)
        return sum(jnp.mean(jnp.float32(v) ** 2) for v in jax.tree.leaves(out))

    grad = jax.jit(jax.grad(loss3, argnums=(0, 1)), static_argnums=2)
    exact = grad(w, x, None)
    for fmt in FORMATS:
        err = rel(grad(w, x, fmt), exact)
        assert 0 < err <= GRAD_BOUND[fmt], (fmt, err)
    compiled = jax.jit(jax.grad(loss3), static_argnums=2)
    text = compiled.lower(w, x, "int8").compile().as_text()
    assert re.search(rf"s8\[{Q},{B},{D}\]", text)  # the [8, 64] leaves (bf16 included), encoded
    assert re.search(rf"f32\[{Q},{B},4\]", text)  # the short-row leaf, kept as it is
    text = compiled.lower(w, x, "bf16").compile().as_text()
    assert re.search(rf"u16\[{Q},{B},{D}\]", text)  # the f32 leaves, encoded
    assert re.search(rf"bf16\[{Q},{B},{D}\]", text)  # the bf16 leaf, kept as it is


def test_first_order_under_vmap():
    grad = jax.vmap(jax.grad(loss), in_axes=(0, None, None, None))
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), PARAMS, make_params(seed=5))
    got = jax.jit(grad, static_argnums=(2, 3))(stacked, X, "bf16", K)
    one = jax.jit(jax.grad(loss), static_argnums=(2, 3))
    for i, params in enumerate((PARAMS, make_params(seed=5))):
        want = one(params, X, "bf16", K)
        assert rel(jax.tree.map(lambda a, i=i: a[i], got), want) < 1e-5
        assert rel(want, one(params, X, None, K)) > 0


# ----------------------------------------------------------------------------------------------
# The compiled program


def _compiled(compress):
    return (
        jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=(2, 3))
        .lower(PARAMS, X, compress, K)
        .compile()
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_anchor_stack_holds_the_encoded_bits_and_temp_drops(fmt):
    saved = 2 * (_ANCHOR_BYTES[None] - _ANCHOR_BYTES[fmt])  # two streams
    check_encoded_stack(_compiled(None), _compiled(fmt), fmt, f"{Q},{B},{D}", f"{Q},{B}", saved)


# ----------------------------------------------------------------------------------------------
# Errors


def test_bad_compress_raises():
    for bad in ("fp4", "BF16", 8, True):
        with pytest.raises(
            ValueError,
            match=r"jaxmem.reversible_scan got compress=.*; expected None or one of 'bf16', "
            r"'fp8', 'int8'",
        ):
            run(PARAMS, X, bad)
    three = jaxmem.reversible(lambda p, b, c: b, lambda p, a, c: a, lambda p, a, b: a)
    with pytest.raises(ValueError, match="jaxmem.Coupling.scan got compress='fp4'"):
        three.scan((X[0], X[1], X[0]), length=2, compress="fp4")


@pytest.mark.parametrize("direction", ["jacfwd", "jacrev", "hessian"])
def test_higher_order_derivatives_raise(direction):
    """Grad of grad would differentiate through the encoded anchors (integer bits, no
    derivative): it raises rather than return a wrong Hessian. compress=None, and compress
    without anchors, still work."""
    params = make_params(6, seed=2)
    x2 = X[1][:2, :16]
    w = jnp.eye(16, D)

    def scalar(x1, compress, anchor_every=2):
        streams = (x1 @ w, x2 @ w)
        return loss(params, streams, compress, anchor_every)

    x1 = X[0][:2, :16]
    outer = {"jacfwd": jax.jacfwd, "jacrev": jax.jacrev}.get(direction)

    # Jitted: one program each, not a compile per primitive (it raises while tracing).
    @functools.partial(jax.jit, static_argnums=(0, 1))
    def second(compress, anchor_every=2):
        if outer is None:
            return jax.hessian(scalar)(x1, compress, anchor_every)
        return outer(jax.grad(scalar))(x1, compress, anchor_every)

    with pytest.raises(NotImplementedError, match="compress='bf16' under higher-order"):
        second("bf16")
    want = second(None)
    assert want.shape == (2, 16, 2, 16) and bool(jnp.all(jnp.isfinite(want)))

    # The reference: the same stack as a plain Python loop.
    def direct(x1):
        s = [x1 @ w, x2 @ w]
        for layer in range(6):
            p = jax.tree.map(lambda a, layer=layer: a[layer], params)
            s[0] = s[0] + f(p, s[1])
            s[1] = s[1] + g(p, s[0])
        return jnp.mean((s[0] + s[1]) ** 2) + jnp.mean(jnp.sin(s[0]))

    assert rel(want, jax.jit(jax.hessian(direct))(x1)) < 1e-4
    # Nothing kept: nothing encoded, the Hessian is compress=None's.
    np.testing.assert_array_equal(second("bf16", None), second(None, None))


# ----------------------------------------------------------------------------------------------
# Flax


class LinenMlp(nn.Module):
    @nn.compact
    def __call__(self, h):
        init = nn.initializers.variance_scaling(0.25, "fan_in", "normal")
        x = jnp.tanh(nn.Dense(D, kernel_init=init)(h))
        return jnp.tanh(nn.Dense(D, kernel_init=init)(x))


@pytest.mark.parametrize("fmt", FORMATS)
def test_linen_stack_takes_compress(fmt):
    stacks = {
        c: jl.reversible_layers(LinenMlp, LinenMlp, L, anchor_every=K, compress=c)
        for c in (None, fmt)
    }
    params = stacks[None]().init(jax.random.key(0), X)["params"]

    def linen_loss(params, compress):
        y1, y2 = stacks[compress]().apply({"params": params}, X)
        return jnp.mean((y1 + y2) ** 2) + jnp.mean(jnp.sin(y1))

    grad = jax.jit(jax.value_and_grad(linen_loss), static_argnums=1)
    (value, got), (exact_value, want) = grad(params, fmt), grad(params, None)
    assert value == exact_value
    err = rel(got, want)
    assert 0 < err <= GRAD_BOUND[fmt], err


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.variance_scaling(0.25, "fan_in", "normal")
        self.up = nnx.Linear(D, D, kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(D, D, kernel_init=init, rngs=rngs)

    def __call__(self, h):
        return jnp.tanh(self.down(jnp.tanh(self.up(h))))


@pytest.mark.parametrize("fmt", FORMATS)
def test_nnx_stack_takes_compress(fmt):
    def make(compress):
        return jn.ReversibleLayers(
            NnxMlp, NnxMlp, L, rngs=nnx.Rngs(0), anchor_every=K, compress=compress
        )

    def nnx_loss(stack):
        y1, y2 = stack(X)
        return jnp.mean((y1 + y2) ** 2) + jnp.mean(jnp.sin(y1))

    grad = nnx.jit(nnx.value_and_grad(nnx_loss))
    exact_value, want = grad(make(None))
    value, got = grad(make(fmt))
    assert value == exact_value
    err = rel(nnx.state(got, nnx.Param), nnx.state(want, nnx.Param))
    assert 0 < err <= GRAD_BOUND[fmt], err
    same = jn.reversible_layers(NnxMlp, NnxMlp, L, rngs=nnx.Rngs(0), anchor_every=K, compress=fmt)
    assert same.compress == fmt


def test_flax_stacks_check_compress_when_built():
    with pytest.raises(
        ValueError, match="jaxmem.flax.linen.reversible_layers got compress='fp4'; expected"
    ):
        jl.reversible_layers(LinenMlp, LinenMlp, L, anchor_every=K, compress="fp4")
    with pytest.raises(
        ValueError, match="jaxmem.flax.nnx.ReversibleLayers got compress='fp4'; expected"
    ):
        jn.ReversibleLayers(NnxMlp, NnxMlp, L, rngs=nnx.Rngs(0), compress="fp4")
    with pytest.raises(
        ValueError, match="jaxmem.flax.nnx.ReversibleLayers got compress='int4'; expected"
    ):
        jn.reversible_layers(NnxMlp, NnxMlp, L, rngs=nnx.Rngs(0), compress="int4")
