"""The corpus of scan bodies that ``test_scan.py`` (against ``lax.scan`` and a Python loop) and
``test_checkpoints.py`` (checkpoint schedules) run: each case builds ``run(scan, params, init,
xs)`` and its arguments, seeded from its name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from tests.helpers import F32_RTOL, LOW_RTOL, Rand

f32, f16, bf16 = jnp.float32, jnp.float16, jnp.bfloat16

T, B, D = 3, 2, 4


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
