"""Acceptance tests of :func:`jaxmem.scan` and :func:`jaxmem.scanned`.

Every body of the corpus is checked, for values (carry and ys) and for gradients with respect to
every float argument (closed-over parameters, init, xs), against :func:`jax.lax.scan` and against
a plain Python loop, for ``recompute="cheap"`` and ``recompute="none"``. Then: composition with
jit, vmap and higher-order reverse mode (forward mode: ``test_primitive.py``);
the decorator; input checks; weak types; and the memory savings, measured structurally (bytes of
the saved-residual listing derived by hand, compiled temp bytes), never by wall time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxmem
from jaxmem._src.listing import saved_residuals

f32, f16, bf16 = jnp.float32, jnp.float16, jnp.bfloat16

# f32 bodies: max relative difference 1e-6 (with atol = 1e-6 * max|reference|).
F32_RTOL = 1e-6
# Bodies that round to bf16/f16: XLA may keep 16-bit intermediates in excess (f32) precision
# inside a fusion, and fuses differently in a scan body, an unrolled Python loop and the custom
# VJP's recomputation, so one rounding step of a 16-bit float (2**-8 for bf16) can differ
# between equally correct programs. 2e-2 relative is a few bf16 ulps, still far below the size
# of any wrong gradient.
LOW_RTOL = 2e-2

T, B, D = 3, 2, 4
RECOMPUTE_MODES = ("auto", "cheap", "none")


# ------------------------------------------------------------------------------------------
# Comparison helpers and references.


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def assert_trees_close(actual, expected, rtol: float = F32_RTOL, what: str = ""):
    """Same tree, dtypes and shapes; float leaves within rtol (atol = rtol * max|expected|).

    Integer and boolean leaves must be equal; float0 leaves (cotangents of integer inputs) are
    compared by dtype and shape only.
    """
    a_paths, a_tree = jax.tree_util.tree_flatten_with_path(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, f"{what}: tree structure {a_tree} != {e_tree}"
    for (path, a), e in zip(a_paths, e_leaves, strict=True):
        where = f"{what}{jax.tree_util.keystr(path)}"
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != {e.dtype}"
        assert a.shape == e.shape, f"{where}: shape {a.shape} != {e.shape}"
        if e.dtype == jax.dtypes.float0:
            continue
        if not jnp.issubdtype(e.dtype, jnp.inexact):
            np.testing.assert_array_equal(a, e, err_msg=where)
            continue
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        assert np.all(np.isfinite(e64)), f"{where}: the reference is not finite"
        if e64.size == 0:
            continue
        atol = rtol * float(np.max(np.abs(e64)))
        err = np.abs(a64 - e64)
        bad = ~(err <= atol + rtol * np.abs(e64))
        if np.any(bad):
            scale = max(float(np.max(np.abs(e64))), np.finfo(np.float64).tiny)
            raise AssertionError(
                f"{where}: {int(bad.sum())} of {e64.size} elements differ; max |diff| = "
                f"{float(err.max()):.3g}, max |diff| / max|ref| = {float(err.max()) / scale:.3g} "
                f"(rtol {rtol})\nactual:\n{a}\nexpected:\n{e}"
            )


def loop_scan(f, init, xs=None, length=None, reverse=False, unroll=1):
    """A plain Python loop with the semantics of :func:`jax.lax.scan` (the second reference)."""
    del unroll
    x_leaves, x_tree = jax.tree.flatten(xs)
    n = length if length is not None else x_leaves[0].shape[0]
    carry = init
    ys = [None] * n
    for t in reversed(range(n)) if reverse else range(n):
        carry, ys[t] = f(carry, jax.tree.unflatten(x_tree, [leaf[t] for leaf in x_leaves]))
    if n == 0:
        x_struct = jax.tree.unflatten(
            x_tree, [jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype) for leaf in x_leaves]
        )
        _, y_struct = jax.eval_shape(f, init, x_struct)
        return carry, jax.tree.map(lambda s: jnp.zeros((0, *s.shape), s.dtype), y_struct)
    return carry, jax.tree.map(lambda *leaves: jnp.stack(leaves), *ys)


def jaxmem_scan(recompute: str) -> Callable:
    return functools.partial(jaxmem.scan, recompute=recompute)


SCANS: dict[str, Callable] = {"lax": jax.lax.scan, "loop": loop_scan}


def scalarize(out):
    """A scalar loss of every float leaf of ``out``: random linear term plus half a square.

    Its gradient sends a different, value-dependent cotangent into every output element.
    """
    leaves = [leaf for leaf in jax.tree.leaves(out) if _is_float(leaf)]
    # f32, or f64 for the float64 runs of a case (below).
    dtype = functools.reduce(jnp.promote_types, [leaf.dtype for leaf in leaves], f32)
    total = jnp.zeros((), dtype)
    for i, leaf in enumerate(leaves):
        w = jnp.asarray(np.random.default_rng(100 + i).standard_normal(leaf.shape), dtype)
        x = leaf.astype(dtype)
        total = total + jnp.sum(w * x) + 0.5 * jnp.sum(x * x)
    return total


def values_and_grads_fn(run: Callable, scan: Callable, nargs: int = 3) -> Callable:
    """``args -> (run(scan, *args), grad of scalarize(run(scan, *args)) w.r.t. every arg)``."""

    def loss(*a):
        out = run(scan, *a)
        return scalarize(out), out

    f = jax.value_and_grad(loss, argnums=tuple(range(nargs)), has_aux=True, allow_int=True)

    def values_and_grads(*args):
        (_, out), grads = f(*args)
        return out, grads

    return values_and_grads


# ------------------------------------------------------------------------------------------
# The corpus: each case builds ``run(scan, params, init, xs)`` and its arguments.


class Rand:
    """Deterministic random arrays, seeded from the case name."""

    def __init__(self, name: str):
        self.rng = np.random.default_rng(zlib.crc32(name.encode()))

    def normal(self, shape, scale=1.0, dtype=f32):
        return jnp.asarray(scale * self.rng.standard_normal(shape), dtype)

    def ints(self, shape, low, high, dtype=jnp.int32):
        return jnp.asarray(self.rng.integers(low, high, shape), dtype)

    def bools(self, shape):
        return jnp.asarray(self.rng.random(shape) < 0.5)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable
    rtol: float = F32_RTOL

    def build(self):
        return self.make(Rand(self.name))


CASES: dict[str, Case] = {}


def case(name: str, rtol: float = F32_RTOL):
    def register(make):
        assert name not in CASES, name
        CASES[name] = Case(name, make, rtol)
        return make

    return register


def last(g, x):
    """``g`` (shape ``[x.shape[-1]]``) broadcast explicitly against ``x``."""
    return jnp.broadcast_to(g, x.shape)


def layernorm(x, eps=1e-5):
    m = jnp.mean(x, axis=-1, keepdims=True)
    v = jnp.mean(jnp.square(x - m), axis=-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + eps)


def rnn_args(r, t=T):
    return {"w": r.normal((D, D), 0.5)}, r.normal((B, D)), r.normal((t, B, D))


def rnn_step(p):
    def step(h, x):
        h = jnp.tanh(h @ p["w"] + x)
        return h, h

    return step


# --- docs/design.md §4 bodies, at tiny shapes ---------------------------------------------------


@case("rnn_ys")
def _(r):
    def run(scan, p, h0, xs):
        return scan(rnn_step(p), h0, xs)

    return run, rnn_args(r)


@case("rnn")
def _(r):
    def run(scan, p, h0, xs):
        return scan(lambda h, x: (jnp.tanh(h @ p["w"] + x), None), h0, xs)

    return run, rnn_args(r)


@case("cast_weights", rtol=LOW_RTOL)
def _(r):
    def run(scan, p, h0, ws):
        def step(h, w):
            h = jnp.tanh((h.astype(bf16) @ w.astype(bf16)).astype(f32))
            return h, None

        return scan(step, h0, ws)

    return run, ({}, r.normal((B, D)), r.normal((T, D, D), 0.5))


@case("transposed_weights")
def _(r):
    def run(scan, p, h0, ws):
        return scan(lambda h, w: (jnp.tanh(h @ w.T), None), h0, ws)

    return run, ({}, r.normal((B, D)), r.normal((T, D, D), 0.5))


PL, PB, PS, PD, PH, PF = 2, 2, 3, 4, 2, 8


def prelm_params(r):
    return {
        "ln1": 1.0 + r.normal((PL, PD), 0.1),
        "ln2": 1.0 + r.normal((PL, PD), 0.1),
        "qkv": r.normal((PL, PD, 3 * PD), 0.5),
        "o": r.normal((PL, PD, PD), 0.5),
        "w1": r.normal((PL, PD, PF), 0.5),
        "w2": r.normal((PL, PF, PD), 0.5),
    }


def prelm_block(x, p):
    """Pre-LN transformer block: LN -> qkv -> softmax attention -> o-proj -> residual -> LN ->
    gelu MLP -> residual."""
    b, s, d = x.shape
    dh = d // PH
    h = layernorm(x) * last(p["ln1"], x)
    qkv = jnp.einsum("bsd,de->bse", h, p["qkv"])
    q, k, v = (a.reshape(b, s, PH, dh) for a in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, d)
    x = x + jnp.einsum("bsd,de->bse", attn, p["o"])
    h = layernorm(x) * last(p["ln2"], x)
    mlp = jnp.einsum("bsf,fd->bsd", jax.nn.gelu(jnp.einsum("bsd,df->bsf", h, p["w1"])), p["w2"])
    return x + mlp, None


@case("prelm_block")
def _(r):
    def run(scan, p, x0, ps):
        return scan(prelm_block, x0, ps)

    return run, ({}, r.normal((PB, PS, PD)), prelm_params(r))


@case("prelm_block_dots")
def _(r):
    body = jax.checkpoint(prelm_block, policy=jax.checkpoint_policies.dots_saveable)

    def run(scan, p, x0, ps):
        return scan(body, x0, ps)

    return run, ({}, r.normal((PB, PS, PD)), prelm_params(r))


# --- pytrees: carries and ys ---------------------------------------------------------------


@case("lstm_dict_carry")
def _(r):
    def run(scan, p, init, xs):
        def step(c, x):
            z = c["h"] @ p["wh"] + x @ p["wx"]
            z = z + last(p["b"], z)
            i, f, o, g = jnp.split(z, 4, axis=-1)
            cell = jax.nn.sigmoid(f) * c["c"] + jax.nn.sigmoid(i) * jnp.tanh(g)
            h = jax.nn.sigmoid(o) * jnp.tanh(cell)
            return {"h": h, "c": cell}, h

        return scan(step, init, xs)

    p = {"wh": r.normal((D, 4 * D), 0.5), "wx": r.normal((D, 4 * D), 0.5), "b": r.normal((4 * D,))}
    return run, (p, {"h": r.normal((B, D)), "c": r.normal((B, D))}, r.normal((T, B, D)))


@case("nested_tuple_carry")
def _(r):
    def run(scan, p, init, xs):
        def step(carry, x):
            h, (c, acc) = carry
            h2 = jnp.tanh(h @ p["w"] + c * x)
            c2 = c * jax.nn.sigmoid(h2)
            return (h2, (c2, {"n": acc["n"] + jnp.sum(h2 * h2)})), None

        return scan(step, init, xs)

    init = (r.normal((B, D)), (r.normal((B, D)), {"n": r.normal(())}))
    return run, ({"w": r.normal((D, D), 0.5)}, init, r.normal((T, B, D)))


@case("ys_tuple")
def _(r):
    def run(scan, p, h0, xs):
        def step(h, x):
            pre = h @ p["w"] + x
            h = jnp.tanh(pre)
            return h, (h, jnp.sum(pre, axis=-1), jnp.exp(-h))

        return scan(step, h0, xs)

    return run, rnn_args(r)


@case("ys_dict")
def _(r):
    def run(scan, p, h0, xs):
        def step(h, x):
            pre = h @ p["w"] + x
            h = jnp.tanh(pre)
            return h, {"pre": pre, "post": h, "sq": {"nested": jnp.square(pre)}}

        return scan(step, h0, xs)

    return run, rnn_args(r)


@case("ys_none_tuple_carry")
def _(r):
    def run(scan, p, init, xs):
        def step(c, x):
            a, b = c
            return (jnp.tanh(a @ p["w"] + x), b + jnp.sin(a)), None

        return scan(step, init, xs)

    return run, (
        {"w": r.normal((D, D), 0.5)},
        (r.normal((B, D)), r.normal((B, D))),
        r.normal((T, B, D)),
    )


@case("many_carry_leaves")
def _(r):
    """Eight carry leaves: more than the analysis tries every subset of (it tries a few)."""

    def run(scan, p, init, xs):
        def step(c, x):
            new = [jnp.tanh(c[(i + 1) % 8] @ p["w"] + x * c[i]) for i in range(8)]
            return new, new[3]

        return scan(step, init, xs)

    return run, (
        {"w": r.normal((D, D), 0.5)},
        [r.normal((B, D)) for _ in range(8)],
        r.normal((T, B, D)),
    )


# --- scan options --------------------------------------------------------------------------


@case("reverse")
def _(r):
    def run(scan, p, h0, xs):
        return scan(rnn_step(p), h0, xs, reverse=True)

    return run, rnn_args(r)


@case("reverse_carry_in_ys")
def _(r):
    def run(scan, p, init, xs):
        def step(c, x):
            h = jnp.tanh(c @ p["w"] + x)
            return h, (c, jnp.square(h))

        return scan(step, init, xs, reverse=True)

    return run, rnn_args(r, t=4)


@case("unroll_2")
def _(r):
    def run(scan, p, h0, xs):
        return scan(rnn_step(p), h0, xs, unroll=2)

    return run, rnn_args(r, t=5)


@case("unroll_true")
def _(r):
    def run(scan, p, h0, xs):
        return scan(rnn_step(p), h0, xs, unroll=True)

    return run, rnn_args(r)


@case("reverse_unroll_2")
def _(r):
    def run(scan, p, h0, xs):
        return scan(rnn_step(p), h0, xs, reverse=True, unroll=2)

    return run, rnn_args(r, t=5)


@case("xs_none_length")
def _(r):
    def run(scan, p, h0, xs):
        del xs
        return scan(lambda h, _: rnn_step(p)(h, last(p["b"], h)), h0, None, length=4)

    return run, ({"w": r.normal((D, D), 0.5), "b": r.normal((D,))}, r.normal((B, D)), None)


@case("zero_length")
def _(r):
    def run(scan, p, h0, xs):
        return scan(rnn_step(p), h0, xs)

    return run, rnn_args(r, t=0)


@case("zero_length_xs_none")
def _(r):
    def run(scan, p, h0, xs):
        del xs
        return scan(lambda h, _: (jnp.tanh(h @ p["w"]), jnp.exp(h)), h0, None, length=0)

    return run, ({"w": r.normal((D, D), 0.5)}, r.normal((B, D)), None)


# --- integer and boolean values --------------------------------------------------------------


@case("int_counter_carry")
def _(r):
    def run(scan, p, init, xs):
        def step(c, x):
            h, i = c
            h = jnp.tanh(h @ p["w"] + x * i.astype(f32))
            return (h, i + 1), (h, i)

        return scan(step, init, xs)

    return run, (
        {"w": r.normal((D, D), 0.5)},
        (r.normal((B, D)), jnp.int32(1)),
        r.normal((T, B, D)),
    )


@case("int_xs")
def _(r):
    def run(scan, p, h0, xs):
        def step(h, x):
            xf, k = x
            h = jnp.tanh(h @ p["w"] + xf * k.astype(f32))
            return h, (h * k.astype(f32), k * 2)

        return scan(step, h0, xs)

    xs = (r.normal((T, B, D)), r.ints((T, B, D), -2, 3))
    return run, ({"w": r.normal((D, D), 0.5)}, r.normal((B, D)), xs)


@case("int_counter_indexes_weights")
def _(r):
    def run(scan, p, init, xs):
        def step(c, x):
            h, i = c
            w = jax.lax.dynamic_index_in_dim(p["ws"], i, keepdims=False)
            return (jnp.tanh(h @ w + x), i + 1), None

        return scan(step, init, xs)

    p = {"ws": r.normal((T, D, D), 0.5)}
    return run, (p, (r.normal((B, D)), jnp.int32(0)), r.normal((T, B, D)))


@case("bool_xs_where")
def _(r):
    def run(scan, p, h0, xs):
        def step(h, x):
            xf, m = x
            h = jnp.where(m, jnp.tanh(h @ p["w"] + xf), h * 0.5)
            return h, m

        return scan(step, h0, xs)

    return run, (
        {"w": r.normal((D, D), 0.5)},
        r.normal((B, D)),
        (r.normal((T, B, D)), r.bools((T, B, D))),
    )


@case("bool_carry_flip")
def _(r):
    def run(scan, p, init, xs):
        def step(c, x):
            h, flag = c
            h = jnp.where(flag, jnp.tanh(h @ p["w"] + x), jnp.sin(h) + x)
            return (h, jnp.logical_not(flag)), h

        return scan(step, init, xs)

    return run, (
        {"w": r.normal((D, D), 0.5)},
        (r.normal((B, D)), jnp.bool_(True)),
        r.normal((T, B, D)),
    )


@case("prng_keys_xs")
def _(r):
    """Dropout-style: a typed PRNG key per step, scanned over as xs."""

    def run(scan, p, h0, xs):
        def step(h, x):
            x, key = x
            keep = jax.random.bernoulli(key, 0.7, h.shape)
            h = jnp.tanh(h @ p["w"] + x)
            return jnp.where(keep, h / 0.7, 0.0), h

        return scan(step, h0, (xs, jax.random.split(jax.random.key(0), xs.shape[0])))

    return run, rnn_args(r)


@case("prng_key_carry")
def _(r):
    def run(scan, p, init, xs):
        def step(c, x):
            h, key = c
            key, sub = jax.random.split(key)
            h = jnp.tanh(h @ p["w"] + x * jax.random.normal(sub, h.shape))
            return (h, key), h

        (h, key), ys = scan(step, (init, jax.random.key(1)), xs)
        return (h, jax.random.key_data(key)), ys

    return run, rnn_args(r)


# --- closures, nesting, remat ---------------------------------------------------------------


@case("closure_many_arrays")
def _(r):
    def run(scan, p, h0, xs):
        def step(h, x):
            z = (h @ p["w"]) * last(p["scale"], h) + p["bias"] + x
            return jnp.tanh(z) + jnp.sin(p["bias"]) * h, z

        return scan(step, h0, xs)

    p = {"w": r.normal((D, D), 0.5), "scale": r.normal((D,)), "bias": r.normal((B, D))}
    return run, (p, r.normal((B, D)), r.normal((T, B, D)))


@case("nested_scan")
def _(r):
    def run(scan, p, h0, xs):
        def outer(h, x):  # x: [S, B, D]
            def inner(g, xi):
                g = jnp.tanh(g @ p["v"] + xi * h)
                return g, g

            g, gs = scan(inner, h, x)
            return jnp.tanh(g @ p["w"]) + h, jnp.sum(gs, axis=0)

        return scan(outer, h0, xs)

    p = {"w": r.normal((D, D), 0.5), "v": r.normal((D, D), 0.5)}
    return run, (p, r.normal((B, D)), r.normal((T, 2, B, D)))


@case("checkpoint_body")
def _(r):
    def run(scan, p, h0, xs):
        @jax.checkpoint
        def step(h, x):
            h = jnp.tanh(jnp.sin(h @ p["w"]) + x)
            return h, jnp.exp(-h)

        return scan(step, h0, xs)

    return run, rnn_args(r)


@case("checkpoint_whole_loss")
def _(r):
    def run(scan, p, h0, xs):
        @jax.checkpoint
        def inner(p, h0, xs):
            return scan(rnn_step(p), h0, xs)

        return inner(p, h0, xs)

    return run, rnn_args(r)


@case("jit_inside_body")
def _(r):
    @jax.jit
    def cheap(z, x):
        return jnp.tanh(z) * jax.nn.sigmoid(x)

    def run(scan, p, h0, xs):
        def step(h, x):
            h = cheap(h @ p["w"], x) + x
            return h, h

        return scan(step, h0, xs)

    return run, rnn_args(r)


# --- aliasing between carry, ys, xs and constants ------------------------------------------


@case("carry_passthrough")
def _(r):
    def run(scan, p, init, xs):
        def step(c, x):
            h, k = c
            return (jnp.tanh(h @ p["w"] + k * x), k), None

        return scan(step, init, xs)

    return run, (
        {"w": r.normal((D, D), 0.5)},
        (r.normal((B, D)), r.normal((B, D))),
        r.normal((T, B, D)),
    )


@case("carry_swap")
def _(r):
    def run(scan, p, init, xs):
        def step(c, x):
            a, b = c
            return (b, jnp.tanh(a @ p["w"] + x) * b), a

        return scan(step, init, xs)

    return run, (
        {"w": r.normal((D, D), 0.5)},
        (r.normal((B, D)), r.normal((B, D))),
        r.normal((T, B, D)),
    )


@case("ys_is_carry_in")
def _(r):
    def run(scan, p, h0, xs):
        def step(h, x):
            return jnp.tanh(h @ p["w"] + x), h

        return scan(step, h0, xs)

    return run, rnn_args(r)


@case("ys_is_carry_twice")
def _(r):
    def run(scan, p, init, xs):
        def step(c, x):
            h = jnp.tanh(c[0] @ p["w"] + x)
            return (h, h), (h, c[1], h)

        return scan(step, init, xs)

    return run, (
        {"w": r.normal((D, D), 0.5)},
        (r.normal((B, D)), r.normal((B, D))),
        r.normal((T, B, D)),
    )


@case("ys_is_x")
def _(r):
    def run(scan, p, h0, xs):
        def step(h, x):
            return jnp.tanh(h @ p["w"] + jnp.square(x)), x

        return scan(step, h0, xs)

    return run, rnn_args(r)


@case("carry_is_x")
def _(r):
    def run(scan, p, init, xs):
        def step(c, x):
            h, prev = c
            return (jnp.tanh(h @ p["w"] + prev * x), x), jnp.cos(prev)

        return scan(step, init, xs)

    return run, (
        {"w": r.normal((D, D), 0.5)},
        (r.normal((B, D)), r.normal((B, D))),
        r.normal((T, B, D)),
    )


@case("constants_only_residuals")
def _(r):
    def run(scan, p, h0, xs):
        def step(h, x):
            w = jnp.tanh(p["w"])
            s = jnp.sin(last(p["b"], h))
            return h @ w + x * s, jnp.exp(p["b"])

        return scan(step, h0, xs)

    p = {"w": r.normal((D, D), 0.5), "b": r.normal((D,))}
    return run, (p, r.normal((B, D)), r.normal((T, B, D)))


@case("carry_constant_output")
def _(r):
    def run(scan, p, init, xs):
        def step(c, x):
            h, s = c
            return (jnp.tanh(h @ p["w"] * s + x), jnp.float32(2.0)), s * h

        return scan(step, init, xs)

    return run, (
        {"w": r.normal((D, D), 0.5)},
        (r.normal((B, D)), r.normal(())),
        r.normal((T, B, D)),
    )


# --- operations ------------------------------------------------------------------------------


def elementwise_case(name, fn, rtol=F32_RTOL):
    @case(name, rtol=rtol)
    def _(r):
        def run(scan, p, h0, xs):
            def step(h, x):
                h = fn(h @ p["w"] + x, h, p)
                return h, h

            return scan(step, h0, xs)

        p = {"w": r.normal((D, D), 0.5), "g": 1.0 + r.normal((D,), 0.1), "b": r.normal((D,), 0.1)}
        return run, (p, r.normal((B, D)), r.normal((T, B, D)))


elementwise_case("softmax", lambda z, h, p: jax.nn.softmax(z, axis=-1))
elementwise_case("log_softmax", lambda z, h, p: jax.nn.log_softmax(z, axis=-1) * 0.3)
elementwise_case("layernorm", lambda z, h, p: layernorm(z) * last(p["g"], z) + last(p["b"], z))
elementwise_case("log1p_exp", lambda z, h, p: jnp.log1p(jnp.square(z)) * jnp.exp(-jnp.tanh(h)))
elementwise_case("logistic", lambda z, h, p: jax.nn.sigmoid(z) - 0.5)
elementwise_case("where_leaky", lambda z, h, p: jnp.where(z > 0, z, 0.1 * z) * 0.5)
# The cubic of the tanh form cancels: in f32 lax.scan's own gradient is 1.4e-6 of the largest off
# float64's on an AMD EPYC CPU (jaxmem.scan's 1.1e-6), so the two can differ by 2.5e-6; in float64
# they agree (test_float64_gradients_equal_lax_scan).
elementwise_case("gelu_tanh", lambda z, h, p: jax.nn.gelu(z) * 0.5, rtol=4e-6)
elementwise_case("gelu_erf", lambda z, h, p: jax.nn.gelu(z, approximate=False) * 0.5)
elementwise_case(
    "rsqrt_pow", lambda z, h, p: z * jax.lax.rsqrt(1.0 + z**2) + jnp.sqrt(h**4 + 1.0) * 0.1
)
elementwise_case(
    "clip_max_min", lambda z, h, p: jnp.maximum(jnp.minimum(z, 1.5), -1.5) * jnp.abs(h) * 0.5
)
elementwise_case(
    "slice_concat",
    lambda z, h, p: jnp.concatenate([jnp.tanh(z[:, D // 2 :]), z[:, : D // 2] * 0.5], axis=1),
)
elementwise_case("rev", lambda z, h, p: jnp.tanh(jnp.flip(z, axis=-1)) * h)
elementwise_case(
    "reductions",
    lambda z, h, p: (
        jnp.tanh(z - jnp.mean(z, axis=-1, keepdims=True)) + jnp.max(z, axis=-1, keepdims=True) * 0.1
    ),
)
elementwise_case(
    "cast_f16", lambda z, h, p: jnp.tanh(z.astype(f16) * f16(0.5)).astype(f32), rtol=LOW_RTOL
)
elementwise_case(
    "cast_bf16", lambda z, h, p: jnp.tanh(z.astype(bf16)).astype(f32) * h, rtol=LOW_RTOL
)


@case("transpose_square")
def _(r):
    def run(scan, p, h0, xs):
        def step(h, x):
            h = jnp.tanh(h.T @ p["w"] + x.T)
            return h, h.T

        return scan(step, h0, xs)

    return run, ({"w": r.normal((D, D), 0.5)}, r.normal((D, D)), r.normal((T, D, D)))


@case("attention_step")
def _(r):
    def run(scan, p, h0, xs):
        def step(h, x):  # h: [B, D] query, x: [S, D] keys.
            scores = jnp.einsum("bd,sd->bs", h @ p["w"], x)
            h = jnp.tanh(jax.nn.softmax(scores, axis=-1) @ x + h)
            return h, scores

        return scan(step, h0, xs)

    return run, ({"w": r.normal((D, D), 0.5)}, r.normal((B, D)), r.normal((T, 3, D)))


@case("gelu_mlp_residual")
def _(r):
    def run(scan, p, h0, xs):
        def step(h, x):
            u = jax.nn.gelu(layernorm(h) @ p["w1"])
            return h + u @ p["w2"] + x, u

        return scan(step, h0, xs)

    p = {"w1": r.normal((D, 2 * D), 0.5), "w2": r.normal((2 * D, D), 0.5)}
    return run, (p, r.normal((B, D)), r.normal((T, B, D)))


@case("bf16_carry", rtol=LOW_RTOL)
def _(r):
    def run(scan, p, h0, xs):
        def step(h, x):
            h = jnp.tanh(h.astype(f32) @ p["w"] + x).astype(bf16)
            return h, h.astype(f32)

        return scan(step, h0, xs)

    return run, ({"w": r.normal((D, D), 0.5)}, r.normal((B, D), dtype=bf16), r.normal((T, B, D)))


@case("mixed_dtypes", rtol=LOW_RTOL)
def _(r):
    def run(scan, p, init, xs):
        def step(c, x):
            h, m = c
            xf, s = x
            h = jnp.tanh(h @ p["w"] + xf + m.astype(f32))
            m = (m * f16(0.5) + jnp.sin(s).astype(f16)).astype(f16)
            return (h, m), (h.astype(bf16), s)

        return scan(step, init, xs)

    init = (r.normal((B, D)), r.normal((B, D), dtype=f16))
    xs = (r.normal((T, B, D)), r.normal((T, B, D), dtype=bf16))
    return run, ({"w": r.normal((D, D), 0.5)}, init, xs)


# ------------------------------------------------------------------------------------------
# The corpus tests.


KINDS = ("lax", "loop", *RECOMPUTE_MODES)  # references, then jaxmem.scan's modes


def scan_of(kind: str) -> Callable:
    return SCANS[kind] if kind in SCANS else jaxmem_scan(kind)


@functools.cache
def all_results(name: str) -> dict | None:
    """Values and gradients of case ``name`` for every kind, compiled as one program.

    One program compiles faster than four. None when some kind fails to trace or compile: then
    each test computes its own kind, so the error shows in the test it belongs to.
    """
    run, args = CASES[name].build()
    try:
        return results_at_once(run, args, KINDS)
    except Exception:  # Raised again by result(), in the test of the kind that fails.
        return None


def results_at_once(run, args, kinds) -> dict:
    """``{kind: (values, grads)}`` of ``run`` on ``args``, every kind in one jitted program."""
    fns = {kind: values_and_grads_fn(run, scan_of(kind)) for kind in kinds}
    return jax.jit(lambda *a: {kind: f(*a) for kind, f in fns.items()})(*args)


def result(name: str, kind: str):
    """``(values, grads)`` of case ``name`` with scan implementation ``kind``."""
    results = all_results(name)
    if results is not None:
        return results[kind]
    run, args = CASES[name].build()
    return jax.jit(values_and_grads_fn(run, scan_of(kind)))(*args)


def test_corpus_is_large_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_corpus_matches_lax_scan_and_python_loop(name, recompute):
    rtol = CASES[name].rtol
    out, grads = result(name, recompute)
    for kind in SCANS:
        ref_out, ref_grads = result(name, kind)
        assert_trees_close(out, ref_out, rtol, f"{name} values vs {kind}: out")
        assert_trees_close(grads, ref_grads, rtol, f"{name} grads vs {kind}: grads")


@pytest.mark.parametrize("name", ["gelu_tanh", "layernorm"])
def test_float64_gradients_equal_lax_scan(name):
    """The f32 tolerances above are rounding: in float64 every mode's gradients are lax.scan's."""
    run, args = CASES[name].build()
    with jax.enable_x64(True):
        args = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), args)
        results = results_at_once(run, args, ("lax", *RECOMPUTE_MODES))
    assert jax.tree.leaves(results["lax"][1])[0].dtype == jnp.float64
    for kind in RECOMPUTE_MODES:
        assert_trees_close(results[kind], results["lax"], 1e-12, f"{name} float64 {kind}")


@pytest.mark.parametrize("name", ["constants_only_residuals", "int_xs"])
def test_eager_matches_jit(name):
    """Outside jit the custom VJP's forward runs on concrete arrays (hoisting included)."""
    c = CASES[name]
    run, args = c.build()
    out, grads = values_and_grads_fn(run, jaxmem.scan)(*args)
    ref_out, ref_grads = result(name, "lax")
    assert_trees_close(out, ref_out, c.rtol, f"{name} eager values: out")
    assert_trees_close(grads, ref_grads, c.rtol, f"{name} eager grads: grads")


# ------------------------------------------------------------------------------------------
# Composition with transformations.


def rnn_loss(scan):
    def loss(w, xs, h0):
        _, ys = scan(rnn_step({"w": w}), h0, xs)
        return jnp.sum(ys**2)

    return loss


def small_rnn_args(seed=0):
    r = Rand(f"small{seed}")
    return r.normal((D, D), 0.5), r.normal((T, B, D)), r.normal((B, D))


def test_closure_gradient_under_jit():
    args = small_rnn_args()
    got = jax.jit(jax.value_and_grad(rnn_loss(jaxmem.scan), argnums=(0, 1, 2)))(*args)
    want = jax.jit(jax.value_and_grad(rnn_loss(jax.lax.scan), argnums=(0, 1, 2)))(*args)
    assert_trees_close(got, want)


@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
def test_vmap_batched_xs_and_closed_over_params(recompute):
    r = Rand("vmap")
    nb = 3
    ws, xs, h0 = r.normal((nb, D, D), 0.5), r.normal((nb, T, B, D)), r.normal((B, D))

    def forward(scan):
        def f(w, xs, h0):
            return scan(rnn_step({"w": w}), h0, xs)

        return jax.vmap(f, in_axes=(0, 0, None))

    got = forward(jaxmem_scan(recompute))(ws, xs, h0)
    assert_trees_close(got, forward(jax.lax.scan)(ws, xs, h0), what="vmap values")

    def grad_of_vmap(scan):
        return jax.grad(lambda *a: jnp.sum(jax.vmap(rnn_loss(scan), (0, 0, None))(*a)), (0, 1, 2))

    got = jax.jit(grad_of_vmap(jaxmem_scan(recompute)))(ws, xs, h0)
    assert_trees_close(got, jax.jit(grad_of_vmap(jax.lax.scan))(ws, xs, h0), what="grad(vmap)")

    def vmap_of_grad(scan):
        return jax.vmap(jax.grad(rnn_loss(scan), (0, 1, 2)), in_axes=(0, 0, None))

    got = vmap_of_grad(jaxmem_scan(recompute))(ws, xs, h0)
    assert_trees_close(got, vmap_of_grad(jax.lax.scan)(ws, xs, h0), what="vmap(grad)")


@pytest.mark.parametrize("in_axes", [(0, None, None), (None, 0, None), (None, None, 0)])
def test_vmap_of_grad_one_batched_argument(in_axes):
    """Batched closed-over weight only, batched xs only, batched init only."""
    r = Rand(f"vmap{in_axes}")
    args = [r.normal((D, D), 0.5), r.normal((T, B, D)), r.normal((B, D))]
    args = [
        a if ax is None else jnp.stack([a, 0.5 * a, -a])
        for a, ax in zip(args, in_axes, strict=True)
    ]

    def g(scan):
        return jax.jit(jax.vmap(jax.grad(rnn_loss(scan), (0, 1, 2)), in_axes=in_axes))

    assert_trees_close(g(jaxmem.scan)(*args), g(jax.lax.scan)(*args))


def test_numpy_inputs():
    r = Rand("numpy")
    w, xs, h0 = (
        np.asarray(a) for a in (r.normal((D, D), 0.5), r.normal((T, B, D)), r.normal((B, D)))
    )
    assert isinstance(xs, np.ndarray)
    assert_trees_close(
        jaxmem.scan(rnn_step({"w": w}), h0, xs), jax.lax.scan(rnn_step({"w": w}), h0, xs)
    )


@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
def test_jacrev_of_grad_matches_lax(recompute):
    args = small_rnn_args(1)
    got = jax.jacrev(jax.grad(rnn_loss(jaxmem_scan(recompute))))(*args)
    want = jax.jacrev(jax.grad(rnn_loss(jax.lax.scan)))(*args)
    assert_trees_close(got, want)


def test_grad_of_grad_all_arguments():
    args = small_rnn_args(2)

    def second(scan):
        g = jax.grad(rnn_loss(scan), argnums=(0, 1, 2))
        return jax.grad(lambda *a: sum(jnp.sum(jnp.sin(t)) for t in g(*a)), argnums=(0, 1, 2))

    assert_trees_close(jax.jit(second(jaxmem.scan))(*args), jax.jit(second(jax.lax.scan))(*args))


def test_hessian_matches_lax_scan():
    """jax.hessian is jacfwd(jacrev(f)): forward mode over jaxmem.scan's reverse pass."""
    w, xs, h0 = small_rnn_args(3)
    got = jax.hessian(rnn_loss(jaxmem.scan))(w, xs, h0)
    assert_trees_close(got, jax.hessian(rnn_loss(jax.lax.scan))(w, xs, h0))


def test_forward_mode_error_is_a_type_error():
    assert issubclass(jaxmem.ForwardModeError, TypeError)


def test_check_grads_rev_order_2():
    r = Rand("check_grads")
    with jax.enable_x64(True):
        w = jnp.asarray(r.normal((D, D), 0.5), jnp.float64)
        xs = jnp.asarray(r.normal((T, B, D)), jnp.float64)
        h0 = jnp.asarray(r.normal((B, D)), jnp.float64)

        def loss(w, xs, h0):
            def step(h, x):
                h = jnp.tanh(layernorm(h @ w) + x)
                return h, jax.nn.softmax(h, axis=-1)

            hT, ys = jaxmem.scan(step, h0, xs)
            return jnp.sum(hT**2) + jnp.sum(jnp.log(ys))

        check_grads(jax.jit(loss), (w, xs, h0), order=2, modes=["rev"])


def test_check_grads_rev_order_1_f32():
    args = small_rnn_args(4)
    check_grads(rnn_loss(jaxmem.scan), args, order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


# ------------------------------------------------------------------------------------------
# jaxmem.scanned.


def cell(c, x):
    h = jnp.tanh(c * 0.5 + x)
    return h, jnp.square(h)


def test_scanned_bare():
    scanned = jaxmem.scanned(cell)
    assert scanned.__name__ == "cell"
    init, xs = Rand("scanned").normal((B, D)), Rand("scanned_xs").normal((T, B, D))

    def loss(scan_fn):
        return lambda i, x: scalarize(scan_fn(i, x))

    assert_trees_close(scanned(init, xs), jax.lax.scan(cell, init, xs))
    got = jax.grad(loss(scanned), (0, 1))(init, xs)
    want = jax.grad(loss(lambda i, x: jax.lax.scan(cell, i, x)), (0, 1))(init, xs)
    assert_trees_close(got, want)


def test_scanned_with_options():
    @jaxmem.scanned(recompute="none", reverse=True)
    def step(c, x):
        return cell(c, x)

    init, xs = Rand("scanned2").normal((B, D)), Rand("scanned2_xs").normal((T, B, D))
    want = jax.lax.scan(cell, init, xs, reverse=True)
    assert_trees_close(step(init, xs), want)
    got = jax.grad(lambda i, x: scalarize(step(i, x)), (0, 1))(init, xs)
    ref = jax.grad(lambda i, x: scalarize(jax.lax.scan(cell, i, x, reverse=True)), (0, 1))
    assert_trees_close(got, ref(init, xs))
    # Call-time keywords override the decorator's.
    assert_trees_close(step(init, xs, reverse=False), jax.lax.scan(cell, init, xs))


def test_scanned_length_without_xs():
    @jaxmem.scanned(length=4)
    def count(c, _):
        return c * 2.0, c

    assert_trees_close(
        count(jnp.float32(1.0)),
        jax.lax.scan(lambda c, _: (c * 2.0, c), jnp.float32(1.0), None, length=4),
    )


def test_scanned_bad_keyword():
    with pytest.raises(TypeError, match="bogus_option"):
        jaxmem.scanned(bogus_option=1)
    with pytest.raises(ValueError, match="recompute='bogus'"):
        jaxmem.scanned(cell, recompute="bogus")


# ------------------------------------------------------------------------------------------
# Input checks.


def ident(c, x):
    return c, x


def test_error_mismatched_leading_axes():
    xs = {"w": jnp.zeros((12, 2)), "b": jnp.zeros((10, 2))}
    with pytest.raises(ValueError, match=r"inconsistent leading-axis sizes") as info:
        jaxmem.scan(ident, 0.0, xs)
    assert "xs['w'] has 12" in str(info.value)
    assert "xs['b'] has 10" in str(info.value)


def test_error_mismatched_leading_axes_under_jit():
    xs = {"w": jnp.zeros((12, 2)), "b": jnp.zeros((10, 2))}
    with pytest.raises(ValueError, match=r"xs\['b'\] has 10"):
        jax.jit(lambda xs: jaxmem.scan(ident, 0.0, xs))(xs)


def test_error_carry_dtype_change():
    with pytest.raises(TypeError, match=r"init\['h'\] is float32\[2\].*float16\[2\]"):
        jaxmem.scan(
            lambda c, x: ({"h": c["h"].astype(f16)}, None), {"h": jnp.zeros(2)}, jnp.zeros((3,))
        )


def test_error_carry_shape_change():
    with pytest.raises(TypeError, match=r"init\[1\] is float32\[2\].*float32\[3\]"):
        jaxmem.scan(
            lambda c, x: ((c[0], jnp.zeros(3)), None), (jnp.zeros(1), jnp.zeros(2)), jnp.zeros((3,))
        )


def test_error_carry_tree_change():
    with pytest.raises(TypeError, match=r"tree structure"):
        jaxmem.scan(lambda c, x: ((c, c), None), jnp.zeros(2), jnp.zeros((3,)))


def test_error_non_array_leaf_in_init():
    with pytest.raises(TypeError, match=r"init\['name'\] is a str"):
        jaxmem.scan(ident, {"h": jnp.zeros(2), "name": "abc"}, jnp.zeros((3,)))


def test_error_non_array_leaf_in_xs():
    with pytest.raises(TypeError, match=r"xs\[1\]\['s'\] is a str"):
        jaxmem.scan(ident, 0.0, (jnp.zeros(3), {"s": "abc"}))


def test_error_length_conflicts_with_xs():
    with pytest.raises(ValueError, match=r"length=5.*xs\['a'\] has 3"):
        jaxmem.scan(ident, 0.0, {"a": jnp.zeros((3,))}, length=5)


def test_error_no_xs_no_length():
    with pytest.raises(ValueError, match=r"no xs.*length"):
        jaxmem.scan(ident, 0.0)


def test_error_scalar_xs_leaf():
    with pytest.raises(ValueError, match=r"scalar xs leaf xs\['a'\]"):
        jaxmem.scan(ident, 0.0, {"a": jnp.zeros(()), "b": jnp.zeros((3,))})


def test_error_f_not_callable():
    with pytest.raises(TypeError, match=r"callable"):
        jaxmem.scan(3, 0.0, jnp.zeros((3,)))


def test_error_bad_recompute():
    with pytest.raises(ValueError, match=r"recompute='bogus'"):
        jaxmem.scan(ident, 0.0, jnp.zeros((3,)), recompute="bogus")


def test_error_bad_unroll():
    with pytest.raises(TypeError, match=r"unroll='x'"):
        jaxmem.scan(ident, 0.0, jnp.zeros((3,)), unroll="x")


def test_error_body_not_a_pair():
    with pytest.raises(TypeError, match=r"must return a pair"):
        jaxmem.scan(lambda c, x: c + x, 0.0, jnp.zeros((3,)))


# ------------------------------------------------------------------------------------------
# Weak types.


def test_weak_typed_python_float_init():
    w, xs = jnp.float32(0.7), Rand("weak").normal((T,))

    def run(scan, w, xs):
        return scan(lambda h, x: (jnp.tanh(h * w + x), h), 0.0, xs)

    got, want = run(jaxmem.scan, w, xs), run(jax.lax.scan, w, xs)
    assert_trees_close(got, want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert jax.typeof(a) == jax.typeof(b), (jax.typeof(a), jax.typeof(b))
    g = jax.grad(lambda *a: scalarize(run(jaxmem.scan, *a)), (0, 1))(w, xs)
    assert_trees_close(g, jax.grad(lambda *a: scalarize(run(jax.lax.scan, *a)), (0, 1))(w, xs))


def test_weak_typed_init_promoted_to_f16_body():
    xs = Rand("weak16").normal((T,), dtype=f16)

    def run(scan, xs):
        return scan(lambda c, x: (c * f16(0.5) + x, c), 0.0, xs)

    got, want = run(jaxmem.scan, xs), run(jax.lax.scan, xs)
    assert_trees_close(got, want)
    assert jax.typeof(got[0]) == jax.typeof(want[0])


# ------------------------------------------------------------------------------------------
# Memory, structurally: saved-residual bytes derived by hand, compiled temp bytes.


def residual_bytes(f, *args) -> int:
    """Total bytes of the residuals ``jax.vjp(f, *args)`` saves that are not ``f``'s arguments."""
    return sum(r.bytes for r in saved_residuals(f, *args) if r.origin != "argument")


MT, MB, MD = 8, 4, 16  # rnn shapes
ML, MLB, MLD = 4, 4, 32  # layer-stack shapes


def mem_rnn(scan, with_ys):
    def loss(w, xs, h0):
        if with_ys:
            _, ys = scan(rnn_step({"w": w}), h0, xs)
            return jnp.sum(ys**2)
        h_t, _ = scan(lambda h, x: (jnp.tanh(h @ w + x), None), h0, xs)
        return jnp.sum(h_t**2)

    r = Rand("mem_rnn")
    return loss, (r.normal((MD, MD), 0.2), r.normal((MT, MB, MD)), r.normal((MB, MD)))


def mem_layers(scan, body):
    def loss(ws, h0):
        h_l, _ = scan(lambda h, w: (body(h, w), None), h0, ws)
        return jnp.sum(h_l**2)

    r = Rand("mem_layers")
    return loss, (r.normal((ML, MLD, MLD), 0.2), r.normal((MLB, MLD)))


def cast_body(h, w):
    return jnp.tanh((h.astype(bf16) @ w.astype(bf16)).astype(f32))


def transposed_body(h, w):
    return jnp.tanh(h @ w.T)


def test_residual_bytes_rnn_ys():
    loss, args = mem_rnn(jaxmem.scan, with_ys=True)
    # tanh' needs h_t = y_t: the ys output serves as the carry sequence (h_0 is the argument h0),
    # so the scan saves nothing but ys [T, B, D]; the loss sum(ys**2) saves 2*ys [T, B, D].
    expected = MT * MB * MD * 4 + MT * MB * MD * 4
    assert residual_bytes(loss, *args) == expected
    stock_loss, _ = mem_rnn(jax.lax.scan, with_ys=True)
    assert residual_bytes(stock_loss, *args) > expected


def test_residual_bytes_rnn():
    loss, args = mem_rnn(jaxmem.scan, with_ys=False)
    # The carry sequence h_0..h_{T-1} [T, B, D] and the final carry h_T [B, D] (tanh' needs the
    # carry-out, W's cotangent the carry-in), plus the loss sum(h_T**2) saving 2*h_T [B, D].
    expected = MT * MB * MD * 4 + MB * MD * 4 + MB * MD * 4
    assert residual_bytes(loss, *args) == expected
    stock_loss, _ = mem_rnn(jax.lax.scan, with_ys=False)
    assert residual_bytes(stock_loss, *args) > expected


@pytest.mark.parametrize(
    "body", [cast_body, transposed_body], ids=["cast_weights", "transposed_weights"]
)
def test_residual_bytes_weight_stacks(body):
    loss, args = mem_layers(jaxmem.scan, body)
    # The carry sequence [L, B, D] f32 plus the final carry [B, D] (casts and transposes of the
    # carry and of the xs weights are recomputed, tanh' reads the carry-out), plus 2*h_L [B, D]
    # saved by the loss. No weight-sized [L, D, D] stack.
    expected = ML * MLB * MLD * 4 + MLB * MLD * 4 + MLB * MLD * 4
    assert residual_bytes(loss, *args) == expected
    stock_loss, _ = mem_layers(jax.lax.scan, body)
    stock = residual_bytes(stock_loss, *args)
    # lax.scan stacks a bf16 copy / transpose of the weights: at least L*D*D*2 bytes more.
    assert stock > expected + ML * MLD * MLD * 2


def test_recompute_none_stacks_more_than_cheap():
    cheap, args = mem_layers(jaxmem_scan("cheap"), cast_body)
    none, _ = mem_layers(jaxmem_scan("none"), cast_body)
    assert residual_bytes(none, *args) > residual_bytes(cheap, *args)


def test_compiled_temp_bytes_rnn_ys():
    def temp(scan):
        loss, args = mem_rnn(scan, with_ys=True)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
        analysis = compiled.memory_analysis()
        if analysis is None:
            pytest.skip("this backend gives no memory_analysis()")
        return analysis.temp_size_in_bytes

    assert temp(jaxmem.scan) < temp(jax.lax.scan)


def test_scan_does_not_leak_the_enclosing_trace():
    """The custom VJP's rules must not keep the body's traced constants (tracers of the
    enclosing trace) alive: jax.check_tracer_leaks finds none, under jit and eagerly."""

    def loss(w, x):
        return jnp.sum(jaxmem.scan(lambda h, _: (jnp.tanh(h * w), None), x, None, length=3)[0])

    with jax.check_tracer_leaks(True):
        jax.eval_shape(lambda w: jaxmem.scan(lambda c, x: (c * w, x), w, jnp.ones(2))[0], 1.0)
        g = jax.jit(jax.grad(loss))(jnp.float32(0.5), jnp.ones(4))
        g_eager = jax.grad(loss)(jnp.float32(0.5), jnp.ones(4))
    ref = jax.grad(
        lambda w, x: jnp.sum(
            jax.lax.scan(lambda h, _: (jnp.tanh(h * w), None), x, None, length=3)[0]
        )
    )(jnp.float32(0.5), jnp.ones(4))
    np.testing.assert_allclose(g, ref, rtol=1e-6)
    np.testing.assert_allclose(g_eager, ref, rtol=1e-6)


def test_a_pass_through_carry_is_a_constant_and_an_xs_returned_as_ys_is_not_copied():
    """As in ``jax.lax.scan``: a carry leaf the step returns unchanged is not carried (its uses
    read it as a constant: nothing of it is kept per step) and an xs leaf the step returns as a
    ys comes back as the xs array itself (no stacked copy)."""
    r = np.random.default_rng(0)
    w = jnp.asarray(r.standard_normal((D, D)), f32)
    h0, k0, xs = (jnp.asarray(r.standard_normal(s), f32) for s in ((B, D), (B, D), (T, B, D)))

    def step(c, x):
        h, k = c
        return (jnp.tanh(h @ w + k * x), k), (x, h * k)

    jaxpr = jax.make_jaxpr(lambda h0, k0, xs: jaxmem.scan(step, (h0, k0), xs))(h0, k0, xs)
    j = jaxpr.jaxpr
    final_k, ys_x = j.outvars[1], j.outvars[2]
    assert final_k is j.invars[1] and ys_x is j.invars[2]
    plan = jaxmem.scan_residuals(step, (h0, k0), xs)
    assert [(res.kind, res.shape) for res in plan.stacked] == [("carry", (B, D))]
    assert ("const", (B, D)) in [(res.kind, res.shape) for res in plan.residuals]
    for scan in (jax.lax.scan, loop_scan):
        expected = values_and_grads_fn(lambda s, *a: s(step, (a[0], a[1]), a[2]), scan)
        got = values_and_grads_fn(lambda s, *a: s(step, (a[0], a[1]), a[2]), jaxmem.scan)
        assert_trees_close(jax.jit(got)(h0, k0, xs), jax.jit(expected)(h0, k0, xs))
