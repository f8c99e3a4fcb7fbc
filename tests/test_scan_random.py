"""Property test of :func:`jaxmem.scan`: random step bodies against :func:`jax.lax.scan`.

A body is a small *program*: a list of shape-preserving ops applied to the carry, plus what the
step returns as ys and how the scan runs (reverse, unroll, recompute mode). The interpreter
:func:`apply_program` turns it into a step function, so a failing case prints as a short,
readable program. Values (carry and ys) and gradients with respect to the closed-over weight,
init and xs must match ``jax.lax.scan`` with the tolerance rules of ``test_scan.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

# The comparison rules are shared with the hand-written corpus (same directory, on sys.path).
from test_scan import F32_RTOL, LOW_RTOL, assert_trees_close, layernorm

import jaxmem

T, S = 3, 3  # steps; the carry is a square [S, S] matrix, so transposes keep its shape.

OPS = (
    "dot",  # h @ w (w closed over)
    "dot_wt",  # h @ w.T
    "tanh",
    "exp_tanh",  # exp of a bounded input
    "log1p_sq",  # log1p(h**2)
    "softmax",  # over the last axis
    "layernorm",
    "bf16_tanh",  # tanh computed in bf16, cast back to f32
    "transpose",
    "where",  # where(h > 0, h, 0.1 * h)
    "slice_concat",  # rotate the columns: slicing + concatenation back to the same shape
    "add_x",  # + the xs slice
    "mul_x",  # * the xs slice
    "mul_carry_in",  # * the step's carry-in
    "counter",  # + 0.1 * the int counter of the carry
)
YS_KINDS = ("none", "carry", "carry_in", "x", "intermediate", "pair")


@dataclasses.dataclass(frozen=True)
class Program:
    """A random scan: the body's ops, what it returns as ys, and the scan's options."""

    ops: tuple[str, ...]
    ys: str
    ys_at: int  # which intermediate, for ys in ("intermediate", "pair")
    counter: bool  # an int32 counter in the carry
    reverse: bool
    unroll: int | bool
    recompute: str
    jit: bool  # compiled with jax.jit, else run op by op under jax.disable_jit()
    seed: int

    @property
    def rtol(self) -> float:
        # bf16 rounding: see LOW_RTOL in test_scan.py.
        return LOW_RTOL if "bf16_tanh" in self.ops else F32_RTOL


@st.composite
def programs(draw) -> Program:
    counter = draw(st.booleans())
    pool = OPS if counter else tuple(op for op in OPS if op != "counter")
    ops = tuple(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=5)))
    return Program(
        ops=ops,
        ys=draw(st.sampled_from(YS_KINDS)),
        ys_at=draw(st.integers(0, len(ops) - 1)),
        counter=counter,
        reverse=draw(st.booleans()),
        unroll=draw(st.sampled_from((1, 2, True))),
        recompute=draw(st.sampled_from(("cheap", "none"))),
        # One example in ten is compiled: XLA:CPU needs ~0.5 s per program even at these
        # sizes, while op-by-op execution reuses its per-op executables. Op by op, lax.scan
        # (inside jaxmem's custom VJP too) runs as a Python loop, and the analysis, planning and
        # residual rebuilding of jaxmem.scan run unchanged; test_scan.py compiles every body.
        jit=draw(st.sampled_from((False,) * 9 + (True,))),
        seed=draw(st.integers(0, 2**16)),
    )


def apply_op(op: str, h, *, w, x, h_in, i):
    if op == "dot":
        return h @ w
    if op == "dot_wt":
        return h @ w.T
    if op == "tanh":
        return jnp.tanh(h)
    if op == "exp_tanh":
        return jnp.exp(jnp.tanh(h))
    if op == "log1p_sq":
        return jnp.log1p(h**2)
    if op == "softmax":
        return jax.nn.softmax(h, axis=-1)
    if op == "layernorm":
        return layernorm(h)
    if op == "bf16_tanh":
        return jnp.tanh(h.astype(jnp.bfloat16)).astype(jnp.float32)
    if op == "transpose":
        return h.T
    if op == "where":
        return jnp.where(h > 0, h, 0.1 * h)
    if op == "slice_concat":
        return jnp.concatenate([h[:, 1:], h[:, :1] * 0.5], axis=1)
    if op == "add_x":
        return h + x
    if op == "mul_x":
        return h * x
    if op == "mul_carry_in":
        return h * h_in
    if op == "counter":
        return h + 0.1 * i.astype(jnp.float32)
    raise ValueError(f"unknown op {op!r}")


def apply_program(prog: Program, w):
    """The step function ``(carry, x) -> (carry, ys)`` that ``prog`` describes."""

    def step(carry, x):
        h_in, i = carry if prog.counter else (carry, None)
        h, inter = h_in, []
        for op in prog.ops:
            h = apply_op(op, h, w=w, x=x, h_in=h_in, i=i)
            inter.append(h)
        ys = {
            "none": None,
            "carry": h,
            "carry_in": h_in,
            "x": x,
            "intermediate": inter[prog.ys_at],
            "pair": (h, inter[prog.ys_at]),
        }[prog.ys]
        return ((h, i + 1), ys) if prog.counter else (h, ys)

    return step


def make_args(prog: Program):
    rng = np.random.default_rng(prog.seed)
    w = jnp.asarray(0.5 * rng.standard_normal((S, S)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((S, S)), jnp.float32)
    if prog.counter:
        h0 = (h0, jnp.int32(rng.integers(-2, 3)))
    xs = jnp.asarray(rng.standard_normal((T, S, S)), jnp.float32)
    return w, h0, xs


def cotangents(out):
    """Random cotangents for the float outputs (float0 zeros for the int counter)."""
    leaves, tree = jax.tree.flatten(out)
    cts = []
    for i, leaf in enumerate(leaves):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            cts.append(
                jnp.asarray(np.random.default_rng(100 + i).standard_normal(leaf.shape), leaf.dtype)
            )
        else:
            cts.append(np.zeros(leaf.shape, jax.dtypes.float0))
    return jax.tree.unflatten(tree, cts)


def outputs_and_grads(prog: Program, scan):
    """``(out, vjp(out)(cotangents(out)))`` for the closed-over weight, init and xs."""

    def run(w, h0, xs):
        return scan(apply_program(prog, w), h0, xs, reverse=prog.reverse, unroll=prog.unroll)

    def f(w, h0, xs):
        out, vjp = jax.vjp(run, w, h0, xs)
        return out, vjp(cotangents(out))

    return f


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # reproducible in CI
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(prog=programs())
def test_random_bodies_match_lax_scan(prog):
    note(repr(prog))
    ours = outputs_and_grads(prog, lambda *a, **k: jaxmem.scan(*a, **k, recompute=prog.recompute))
    stock = outputs_and_grads(prog, jax.lax.scan)
    args = make_args(prog)
    both = lambda *a: (ours(*a), stock(*a))
    if prog.jit:
        results = jax.jit(both)(*args)
    else:
        with jax.disable_jit():
            results = both(*args)
    (out, grads), (ref_out, ref_grads) = results
    assert_trees_close(out, ref_out, prog.rtol, "values: out")
    assert_trees_close(grads, ref_grads, prog.rtol, "grads (w, init, xs): grads")
