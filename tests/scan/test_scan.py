"""Acceptance tests of :func:`jaxmem.scan` and :func:`jaxmem.scanned`.

Every body of the corpus is checked, for values (carry and ys) and for gradients with respect to
every float argument (closed-over parameters, init, xs), against :func:`jax.lax.scan` and against
a plain Python loop, for ``recompute="cheap"`` and ``recompute="none"``. Then: composition with
jit, vmap and higher-order reverse mode (forward mode: ``test_primitive.py``);
the decorator; input checks; weak types; and the memory savings, measured structurally (bytes of
the saved-residual listing derived by hand, compiled temp bytes), never by wall time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxmem
from jaxmem._src.listing import saved_residuals
from tests.helpers import (
    Rand,
    assert_trees_close,
    loop_scan,
    scalarize,
    values_and_grads_fn,
)
from tests.scan.corpus import CASES, B, D, T, bf16, f16, f32, layernorm, rnn_step

RECOMPUTE_MODES = ("auto", "cheap", "none")


def jaxmem_scan(recompute: str) -> Callable:
    return functools.partial(jaxmem.scan, recompute=recompute)


SCANS: dict[str, Callable] = {"lax": jax.lax.scan, "loop": loop_scan}


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
