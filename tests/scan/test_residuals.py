"""Tests of the step plan (:mod:`jaxmem._src.scan.residuals`): what the backward step may
recompute."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src import jax_compat as jc
from jaxmem._src.listing import saved_residuals
from jaxmem._src.scan import jaxprs as J
from jaxmem._src.scan import pins as P
from jaxmem._src.scan import residuals as R
from tests import helpers

K = np.float32(11.3137)


def _step(a, b, c, d):
    """Two carries and a y; the y locates its row maxima with an exact comparison."""
    g = 2.0 * ((c @ d) / K)
    q = (((g + g) * b) @ a) / K
    s = jnp.maximum(g, 0.1 * g)  # on jax 0.10.2 its JVP compares g and 0.1 * g with s
    top = jnp.where(s == jnp.max(s, axis=-1, keepdims=True), s, 0.5 * s)
    return jnp.tanh(s + b), jnp.tanh(q + c), top


def _args(seed=0, n=16):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
    return f(n, n), f(4, n), f(4, n), f(n, n)


def _plan(recompute="cheap"):
    body = jax.make_jaxpr(_step)(*_args())
    return R.plan_step(body, 1, 2, [v.aval for v in body.jaxpr.invars], recompute)


def _float_equalities(closed):
    return [
        e
        for e in J.iter_eqns(jc.open_jaxpr(closed))
        if e.primitive.name in ("eq", "ne") and any(jc.is_float(v) for v in e.invars)
    ]


def test_exact_float_comparisons_are_kept_not_recomputed():
    """The backward step never re-evaluates ``eq``/``ne`` of floats: its operands would be
    recomputed there by another XLA computation than the forward's, equal only up to rounding,
    and the mask would flip (a quarter of the gradient was lost this way on jax 0.10.2). The
    forward step computes those masks; the plan keeps them, packed as bits."""
    plan = _plan()
    assert _float_equalities(jc.closed_jaxpr(plan.traced.jaxpr, plan.traced.consts))
    assert not _float_equalities(plan.rebuild)
    masks = [v for v in plan.stacked_vars if v.aval.dtype == np.dtype(bool)]
    assert masks and all(J.packs_bits(v.aval) for v in masks)


def test_integer_comparisons_stay_cheap():
    i = jax.make_jaxpr(lambda x: x == 3)(jnp.arange(4)).jaxpr.eqns[0]
    f = jax.make_jaxpr(lambda x: x == 3.0)(jnp.ones(4)).jaxpr.eqns[0]
    lt = jax.make_jaxpr(lambda x: x < 3.0)(jnp.ones(4)).jaxpr.eqns[0]
    assert J._is_cheap(i) and not J._is_cheap(f) and J._is_cheap(lt)


@pytest.mark.parametrize("recompute", ["cheap", "none"])
def test_gradients_with_exact_comparisons_equal_lax_scan(recompute):
    a, b0, c0, _ = _args(1, 32)
    ds = jnp.asarray(np.random.default_rng(2).standard_normal((9, 32, 32)), jnp.float32)

    def loss(scan, **kw):
        def f(a, b0, c0, ds):
            def step(carry, d):
                b, c = carry
                u, w, top = _step(a, b, c, d)
                return (u, w), top

            (u, w), ys = scan(step, (b0, c0), ds, **kw)
            return jnp.sum(u**2) + jnp.sum(w**2) + jnp.sum(ys * jnp.cos(ys))

        return f

    want = jax.grad(loss(jax.lax.scan), argnums=(0, 1, 2, 3))(a, b0, c0, ds)
    got = jax.grad(loss(jaxmem.scan, recompute=recompute), argnums=(0, 1, 2, 3))(a, b0, c0, ds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def _chooser_step(carry, x):
    h, c = carry
    v = jnp.tanh(c)
    s = jnp.maximum(v, jnp.tanh(v))  # XLA rewrites this as tanh(max(c, tanh(c)))
    top = s - jnp.max(s, axis=-1, keepdims=True)
    return (jnp.tanh(s + h), jnp.tanh(v + c + x)), top


def test_chooser_operands_are_pinned_where_a_mask_compares_with_the_result():
    """Where the forward step compares a chooser's result (max, reduce_max) with one of its
    operands for equality (jax 0.10's max JVP; reduce_max's on both versions), those operands
    are an optimization barrier's outputs and the comparison reads them: no operand can be
    evaluated twice (in two fusions, differing in the last bit) against the result."""
    h = jnp.ones((2, 8))
    body = jax.make_jaxpr(_chooser_step)((h, h), h)
    plan = R.plan_step(body, 0, 2, [v.aval for v in body.jaxpr.invars], "auto")
    eqns = jc.open_jaxpr(plan.forward).eqns
    pinned = {v for e in eqns if e.primitive.name == "optimization_barrier" for v in e.outvars}
    result_of = {}  # a chooser's result and its reshapes -> the chooser's float operands
    for e in eqns:
        if e.primitive.name in ("max", "reduce_max"):
            result_of[e.outvars[0]] = [v for v in e.invars if jc.is_var(v)]
        elif e.primitive.name == "reshape" and e.invars[0] in result_of:
            result_of[e.outvars[0]] = result_of[e.invars[0]]
    checked = 0
    for e in eqns:
        if e.primitive.name == "eq" and all(jc.is_var(v) for v in e.invars):
            for result, other in (e.invars, e.invars[::-1]):
                if other in result_of.get(result, ()):
                    assert all(v in pinned for v in result_of[result]), e
                    checked += 1
    assert checked >= 1 if jax.__version__.startswith("0.12") else checked >= 3


def test_jaxprs_without_a_float_mask_are_not_rewritten():
    """relu (a custom_jvp, no comparison with its result) and integer maxima keep their forward
    step as planned: nothing is pinned where no mask compares floats for equality."""

    def step(c, x):
        return jnp.tanh(jax.nn.relu(c) + x), jnp.maximum(x.astype(jnp.int32), 1)

    c = jnp.ones((2, 8))
    body = jax.make_jaxpr(step)(c, c)
    forward = R.plan_step(body, 0, 1, [v.aval for v in body.jaxpr.invars], "auto").forward
    assert P.pin_chooser_operands(forward) is forward
    names = {e.primitive.name for e in J.iter_eqns(jc.open_jaxpr(forward))}
    assert "optimization_barrier" not in names


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("recompute", ["auto", "cheap", "none"])
def test_chooser_of_a_transcendental_gradient_equals_lax_scan_at_o0(recompute, reverse):
    """``maximum(tanh(c), tanh(tanh(c)))`` compiled without LLVM optimization: on jax 0.10.2
    its masks came out all false for some lanes (the maximum computed as ``tanh(max(..))`` in
    one fusion, its operands in another), 0.385 of the gradient off, before the operands were
    pinned."""
    r = np.random.default_rng(15005)
    n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
    h0, c0, xs, wy = n(2, 8), n(2, 8), n(21, 2, 8), n(21, 2, 8)

    def grads(scan, **kw):
        def loss(h0, c0, xs):
            (u, w), ys = scan(_chooser_step, (h0, c0), xs, reverse=reverse, **kw)
            return jnp.sum(u**2) + jnp.sum(w**2) + jnp.sum(ys * wy)

        options = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)), compiler_options=options)(h0, c0, xs)

    want = grads(jax.lax.scan)
    got = grads(jaxmem.scan, recompute=recompute)
    scale = max(float(jnp.max(jnp.abs(w))) for w in want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale)


def test_a_pass_through_y_is_read_from_its_input():
    """nnx.scan returns the layers' state as ys: the backward step reads those values from the
    xs slices, and the ys stacks are not kept alive for it."""

    def step(c, w):
        return (jnp.tanh(c @ w),), w

    c, w = jnp.ones((2, 4)), jnp.ones((4, 4))
    body = jax.make_jaxpr(lambda c, w: (*step(c, w)[0], step(c, w)[1]))(c, w)
    plan = R.plan_step(body, 0, 1, [v.aval for v in body.jaxpr.invars], "auto")
    assert plan.need_y == (False,)
    assert "xs" in plan.res_classes


def test_no_final_carry_is_kept_where_no_carry_out_is_read():
    """Under a remat policy that saves nothing the backward step reads each step's inputs only:
    the carry sequence is kept, the final carry is not kept beside it."""
    h0 = jnp.ones((2, 8))
    ws = jnp.ones((3, 8, 8))
    step = lambda h, w: (jnp.tanh(h @ w), None)

    def residual_shapes(scan, **kw):
        loss = lambda h0, ws: jnp.sum(scan(step, h0, ws, **kw)[0])
        return sorted(r.aval.shape for r in saved_residuals(loss, h0, ws))

    ours = residual_shapes(jaxmem.scan, policy="nothing")
    stock = residual_shapes(
        lambda f, *a: jax.lax.scan(
            jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable), *a
        )
    )
    assert ours == [(3, 2, 8), (3, 8, 8)]  # the carry sequence and the weights
    assert all(shape in stock for shape in ours)


def _masked_softmax_step(mask):
    def step(h, w):
        s = (h @ w) @ h.T
        s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)  # jnp.where is a jit call
        return jnp.tanh(jax.nn.softmax(s)[0] @ h), None

    return step


def test_calls_are_planned_equation_by_equation():
    """A call (``jnp.where``'s ``jit``) is no unit of the cut: with a float mask, ``where``
    computes ``mask != 0`` (an exact comparison, never recomputed) beside its select and the
    zero tangent its derivative broadcasts. Whole, the call was unrecomputable and the plan
    stacked its outputs (the masked scores, the zeros, the mask); inlined, the mask is a loop
    invariant and the plan keeps what it keeps for a boolean mask."""
    h, ws = jnp.ones((64, 32)), jnp.ones((4, 32, 32))
    tril = jnp.tril(jnp.ones((1, 64, 64), jnp.float32))
    by_float = jaxmem.scan_residuals(_masked_softmax_step(tril), h, ws)
    by_bool = jaxmem.scan_residuals(_masked_softmax_step(tril != 0), h, ws)
    assert by_float.stacked_bytes == by_bool.stacked_bytes
    # Kept per step: q = h @ w, the carry, and what softmax's derivative reads: its input and
    # row statistics up to jax 0.12.0, its output alone from jax 0.12.1.
    kept = sorted(r.shape for r in by_float.stacked)
    if helpers.JAX_VERSION >= (0, 12, 1):
        assert kept == [(1, 64, 64), (64, 32), (64, 32)], kept
    else:
        assert kept == [(1, 64), (1, 64, 64), (64, 32), (64, 32)], kept
    assert not [r for r in by_float.stacked if r.dtype == "bool"]


@pytest.mark.parametrize("recompute", ["auto", "cheap", "none"])
def test_gradients_through_inlined_calls_equal_lax_scan(recompute):
    h = jax.random.normal(jax.random.key(0), (64, 32))
    ws = jax.random.normal(jax.random.key(1), (4, 32, 32)) / 6
    step = _masked_softmax_step(jnp.tril(jnp.ones((1, 64, 64), jnp.float32)))

    def loss(scan, h, ws):
        return jnp.sum(scan(step, h, ws)[0] ** 2)

    want = jax.grad(lambda h, ws: loss(jax.lax.scan, h, ws), argnums=(0, 1))(h, ws)
    scan = lambda f, c, x: jaxmem.scan(f, c, x, recompute=recompute)
    got = jax.grad(lambda h, ws: loss(scan, h, ws), argnums=(0, 1))(h, ws)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_the_plan_is_the_same_at_every_trace():
    # The kept values come out of the cut as a set, whose order follows the variables' ids: the
    # stacks (and the compiled program) must follow the step's program order instead.
    from jaxmem.demo import models

    config = models.GPTConfig(
        vocab_size=64, seq_len=16, num_layers=2, d_model=64, num_heads=2, d_ff=128
    )
    params = models.abstract_params(config, 2)
    tokens = jax.ShapeDtypeStruct((2, config.seq_len), jnp.int32)

    def text():
        loss = models.next_token_loss(models.GPT(config, jaxmem.scan))
        return str(jax.make_jaxpr(jax.grad(loss))(params, tokens))

    assert len({text() for _ in range(4)}) == 1
