"""``jaxmem.scan`` as a JAX primitive (``jaxmem_scan``): every transformation against
:func:`jax.lax.scan`.

Forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``, also of jitted functions), forward
over reverse (``jax.hessian``), reverse over forward, ``jax.vmap`` of each (batched parameters,
carries or inputs, the batch axis anywhere), ``jax.checkpoint`` around the scan, for the lean
VJP with and without a policy, unroll and offload, and for ``checkpoints=``. Values within
1e-5 (f32); ``check_grads`` to order 2 in both modes in float64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxmem
import jaxmem.losses
from jaxmem._src import jax_compat as jc
from jaxmem._src.jax_compat import compile_to_measure

T, B, D = 6, 3, 8


def _args(seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s, scale=1.0: jnp.asarray(r.standard_normal(s) * scale, jnp.float32)
    return f(D, D, scale=0.3), f(T, B, D), f(B, D)


def _loss(scan, **options):
    def loss(w, xs, h0):
        def step(carry, x):
            h, n = carry
            h = jnp.tanh(h @ w + x)
            return (h, n + 1), (jnp.sin(h), n)

        (h, n), (ys, ns) = scan(step, (h0, jnp.int32(0)), xs, **options)
        return jnp.sum(h**2) + jnp.sum(ys * 0.7) + 0.0 * (n + jnp.sum(ns))

    return loss


OPTIONS = {
    "lean": {},
    "unroll2": {"unroll": 2},
    "reverse": {"reverse": True},
    "policy_dots": {"policy": "dots"},
    "policy_nothing": {"policy": "nothing"},
    "offload": {"offload": "residuals"},
    "cheap": {"recompute": "cheap"},
    "checkpoints2": {"checkpoints": 2},
}

W, XS, H0 = _args()

MODES = {
    "jvp": lambda f: jax.jvp(f, (W, XS, H0), (W, XS, H0)),
    "jvp_one_argument": lambda f: jax.jvp(lambda w: f(w, XS, H0), (W,), (W,)),
    "jvp_of_jit": lambda f: jax.jvp(jax.jit(f), (W, XS, H0), (W, XS, H0)),
    "jit_of_jvp": lambda f: jax.jit(lambda p, t: jax.jvp(f, p, t))((W, XS, H0), (W, XS, H0)),
    "linearize": lambda f: jax.linearize(f, W, XS, H0)[1](W, XS, H0),
    "jacfwd": lambda f: jax.jacfwd(f, argnums=(0, 2))(W, XS, H0),
    "jacfwd_of_jit": lambda f: jax.jacfwd(jax.jit(f))(W, XS, H0),
    "hessian": lambda f: jax.hessian(lambda w: f(w, XS, H0))(W),
    "jacrev_of_jacfwd": lambda f: jax.jacrev(jax.jacfwd(lambda w: f(w, XS, H0)))(W),
    "grad_of_jvp": lambda f: jax.grad(lambda w: jax.jvp(lambda v: f(v, XS, H0), (w,), (W,))[1])(W),
    "vmap_of_jvp": lambda f: jax.vmap(lambda t: jax.jvp(lambda w: f(w, XS, H0), (W,), (t,))[1])(
        jnp.stack([W, 2 * W])
    ),
    "grad_of_checkpoint": lambda f: jax.grad(jax.checkpoint(f), argnums=(0, 1, 2))(W, XS, H0),
    "grad_of_checkpoint_dots": lambda f: jax.grad(
        jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable), argnums=(0, 1, 2)
    )(W, XS, H0),
    "jvp_of_checkpoint": lambda f: jax.jvp(jax.checkpoint(f), (W, XS, H0), (W, XS, H0)),
    "jacfwd_of_checkpoint": lambda f: jax.jacfwd(jax.checkpoint(lambda w: f(w, XS, H0)))(W),
    "vmap_of_grad_of_checkpoint": lambda f: jax.vmap(
        jax.grad(jax.checkpoint(f)), in_axes=(None, 0, None)
    )(W, jnp.stack([XS, -XS]), H0),
    "grad_of_checkpoint_of_vmap": lambda f: jax.grad(
        jax.checkpoint(lambda w: jnp.sum(jax.vmap(f, (None, 0, None))(w, jnp.stack([XS, -XS]), H0)))
    )(W),
    "grad_of_grad": lambda f: jax.grad(lambda w: jnp.sum(jax.grad(f)(w, XS, H0) ** 2))(W),
}


# Forward mode through the scan: on jax 0.10.2 under jax.check_tracer_leaks, where jaxmem.scan
# is a custom VJP (jax_compat.hiprim_usable), these raise (ForwardModeError, JAX's own TypeError,
# or JAX's NotImplementedError for grad of jvp), never a wrong derivative.
FORWARD = {
    "jvp",
    "jvp_one_argument",
    "jvp_of_jit",
    "jit_of_jvp",
    "linearize",
    "jacfwd",
    "jacfwd_of_jit",
    "jacrev_of_jacfwd",
    "grad_of_jvp",
    "vmap_of_jvp",
    "jvp_of_checkpoint",
    "jacfwd_of_checkpoint",
}


def _close(actual, expected):
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree
    for a, e in zip(a_leaves, e_leaves, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(e).max()))


@functools.cache
def _reference(mode: str, reverse: bool = False, next_remat: bool = False):
    """``MODES[mode]`` (or ``"grad"``) of the lax.scan loss, jitted and computed once per module
    (per JAX config: the caller's ``next_remat`` says whether jax_remat3 and jax_custom_vjp3 are
    on). The reference does not depend on the jaxmem options, so every option shares it."""
    assert next_remat == jax.config.jax_remat3
    run = {"grad": lambda f: jax.grad(f, argnums=(0, 1, 2))(W, XS, H0), **MODES}[mode]
    return jax.jit(lambda: run(_loss(jax.lax.scan, reverse=reverse)))()


# Under a forward-mode transformation (the FORWARD modes) the primitive's rule is the JVP of its
# plain loop (``jax.lax.scan`` of the step, primitive.py ``_stock_jvp``), which reads the length,
# reverse and unroll only: policy, offload and recompute take the code path of "lean" exactly, so
# those option-mode pairs are left out (unroll2, reverse and checkpoints2 keep every mode).
SAME_FORWARD_AS_LEAN = {"policy_dots", "policy_nothing", "offload", "cheap"}
# Mode-major, so that where CI splits the cases between two set-ups (conftest.py), every mode
# runs on both with half of the options.
TRANSFORMATIONS = [
    (option, mode)
    for mode in MODES
    for option in OPTIONS
    if not (option in SAME_FORWARD_AS_LEAN and mode in FORWARD)
]


# The offload cases run on CPU, where offload is the identity: they warn offload_noop.
@pytest.mark.filterwarnings("ignore:offload_noop:jaxmem.LintWarning")
@pytest.mark.sampled
@pytest.mark.parametrize(("option", "mode"), TRANSFORMATIONS)
def test_transformation_matches_lax_scan(option, mode):
    ours = _loss(jaxmem.scan, **OPTIONS[option])
    want = _reference(mode, reverse=OPTIONS[option].get("reverse", False))
    _close(MODES[mode](ours), want)


@pytest.mark.parametrize("option", ["lean", "checkpoints2"])
def test_check_grads_both_modes_order_2(option):
    r = np.random.default_rng(1)
    with jax.enable_x64(True):
        w = jnp.asarray(r.standard_normal((4, 4)) * 0.4)
        xs = jnp.asarray(r.standard_normal((5, 2, 4)))
        h0 = jnp.asarray(r.standard_normal((2, 4)))

        def f(w, xs, h0):
            step = lambda h, x: (jnp.tanh(h @ w + x),) * 2
            h, ys = jaxmem.scan(step, h0, xs, **OPTIONS[option])
            return jnp.sum(h**2) + jnp.sum(jnp.cos(ys))

        check_grads(f, (w, xs, h0), order=2, modes=["fwd", "rev"])


# ------------------------------------------------------------------------------------------
# vmap: the batch axis anywhere, on any input; what is not batched stays unbatched.

VMAPS = {
    "xs_axis0": ((None, 0, None), lambda: (W, jnp.stack([XS, -XS]), H0)),
    "xs_axis2": ((None, 2, None), lambda: (W, jnp.stack([XS, -XS], axis=2), H0)),
    "carry": ((None, None, 1), lambda: (W, XS, jnp.stack([H0, -H0], axis=1))),
    "params": ((0, None, None), lambda: (jnp.stack([W, 0.5 * W]), XS, H0)),
    "all": (
        (0, 0, 0),
        lambda: (jnp.stack([W, 0.5 * W]), jnp.stack([XS, -XS]), jnp.stack([H0, H0])),
    ),
}


@pytest.mark.parametrize("case", list(VMAPS))
@pytest.mark.parametrize("transform", ["value", "grad", "jvp"])
def test_vmap_matches_lax_scan(case, transform):
    in_axes, make = VMAPS[case]
    args = make()

    def apply(scan):
        f = _loss(scan)
        if transform == "grad":
            f = jax.grad(f, argnums=(0, 1, 2))
        elif transform == "jvp":
            g = f
            f = lambda w, xs, h0: jax.jvp(g, (w, xs, h0), (w, xs, h0))
        return jax.vmap(f, in_axes=in_axes)(*args)

    _close(apply(jaxmem.scan), jax.jit(lambda: apply(jax.lax.scan))())  # the reference, jitted


def test_vmap_keeps_an_unbatched_carry_unbatched():
    """Only xs batched, and the carry leaf ``n`` never reads them: it comes out unbatched (as
    ``lax.scan``'s batching rule leaves it), so ``out_axes=None`` works for it."""

    def f(xs):
        step = lambda c, x: ((c[0] + x, c[1] + 1), c[1])
        return jaxmem.scan(step, (jnp.zeros(D), jnp.int32(0)), xs)

    (h, n), ns = jax.vmap(f, out_axes=((0, None), None))(jnp.stack([XS[:, 0], XS[:, 1]]))
    assert h.shape == (2, D) and int(n) == T and ns.shape == (T,)


def _temp(f, *args):
    return compile_to_measure(jax.jit(f).lower(*args)).memory_analysis().temp_size_in_bytes


def test_checkpoint_around_the_scan_keeps_the_lean_residuals():
    """jax.checkpoint around a jaxmem scan: the backward pass recomputes the scan and keeps its
    lean residuals (the temp of the plain gradient), where lax.scan keeps its own."""
    T2, B2, D2 = 64, 16, 128
    args = (jnp.eye(D2) * 0.1, jnp.ones((T2, B2, D2)), jnp.zeros((B2, D2)))

    def loss(scan):
        def f(w, xs, h0):
            _, ys = scan(lambda h, x: (jnp.tanh(h @ w + x),) * 2, h0, xs)
            return jnp.sum(ys**2)

        return f

    lean = _temp(jax.grad(loss(jaxmem.scan)), *args)
    stock = _temp(jax.grad(loss(jax.lax.scan)), *args)
    assert lean < 0.6 * stock
    assert _temp(jax.grad(jax.checkpoint(loss(jaxmem.scan))), *args) <= lean


# ------------------------------------------------------------------------------------------
# The jaxpr: one readable primitive.


def test_the_jaxpr_holds_one_jaxmem_scan_with_its_step():
    jaxpr = jax.make_jaxpr(_loss(jaxmem.scan, unroll=2))(W, XS, H0)
    eqns = [e for e in jc.open_jaxpr(jaxpr).eqns if e.primitive.name == "call_hi_primitive"]
    assert len(eqns) == 1
    prim = eqns[0].params["_prim"]
    assert type(prim).__name__ == "jaxmem_scan"
    assert (prim.params["length"], prim.params["unroll"]) == (T, 2)
    assert [e.primitive.name for e in jc.subjaxprs(eqns[0])[0].eqns][:2] == ["dot_general", "add"]
    assert "jaxmem_scan" in str(jaxpr) or jax.__version_info__ < (0, 11)


def test_an_unused_scan_is_removed():
    def f(w, xs, h0):
        jaxmem.scan(lambda h, x: (jnp.tanh(h @ w + x),) * 2, h0, xs)
        return jnp.sum(w)

    lowered = jax.jit(f).lower(W, XS, H0).as_text()
    assert "while" not in lowered


# ------------------------------------------------------------------------------------------
# Under jax.check_tracer_leaks: jax 0.10.2's lowering of a hijax primitive reports its outputs
# as leaked tracers there, so on 0.10.2 the scan and the losses bind as custom VJPs instead.


@pytest.mark.parametrize("mode", ["grad", "grad_of_checkpoint", "jvp", "hessian"])
def test_under_the_tracer_leak_check(mode):
    ours = _loss(jaxmem.scan)
    run = {"grad": lambda f: jax.grad(f, argnums=(0, 1, 2))(W, XS, H0), **MODES}[mode]
    want = _reference(mode)
    with jax.check_tracer_leaks(True):
        # The scan's outputs feed later operations (the sum): what 0.10.2 reported as a leak.
        assert jax.jit(ours).lower(W, XS, H0).compile() is not None
        if mode in FORWARD and not jc.hiprim_usable():
            with pytest.raises(jaxmem.ForwardModeError, match="check_tracer_leaks"):
                run(ours)
            return
        got = run(ours)
    _close(got, want)


def test_losses_under_the_tracer_leak_check():
    r = np.random.default_rng(3)
    h = jnp.asarray(r.standard_normal((16, 8)), jnp.float32)
    w = jnp.asarray(r.standard_normal((8, 32)) * 0.3, jnp.float32)
    labels = jnp.asarray(r.integers(0, 32, 16))

    def ours(h, w):
        return jaxmem.losses.linear_cross_entropy(h, w, labels, chunk_size=8) * 1.0

    def stock(h, w):
        logits = h @ w
        return jnp.mean(
            jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0]
        )

    with jax.check_tracer_leaks(True):
        assert jc.hiprim_usable() == (jax.__version_info__ >= (0, 11))
        got = jax.jit(jax.grad(ours, argnums=(0, 1)))(h, w)
    assert jc.hiprim_usable()
    _close(got, jax.grad(stock, argnums=(0, 1))(h, w))


# ------------------------------------------------------------------------------------------
# JAX's next implementations of jax.checkpoint and jax.custom_vjp (jax_remat3,
# jax_custom_vjp3; off by default in 0.10.2 and 0.12): the same derivatives.


@pytest.fixture
def next_remat_and_custom_vjp():
    before = {k: getattr(jax.config, k) for k in ("jax_remat3", "jax_custom_vjp3")}
    for k in before:
        jax.config.update(k, True)
    yield
    for k, v in before.items():
        jax.config.update(k, v)


@pytest.mark.parametrize(
    "mode", ["jvp", "hessian", "grad_of_checkpoint", "vmap_of_grad_of_checkpoint", "grad_of_grad"]
)
@pytest.mark.parametrize("option", ["lean", "policy_dots", "checkpoints2"])
def test_under_remat3_and_custom_vjp3(next_remat_and_custom_vjp, option, mode):
    ours = _loss(jaxmem.scan, **OPTIONS[option])
    _close(MODES[mode](ours), _reference(mode, next_remat=True))


@pytest.mark.parametrize("option", ["lean", "checkpoints2"])
def test_reverse_over_forward_of_a_jitted_loss(option):
    # Inside jit JAX linearizes the inner JVP by partial evaluation: the tangents come from
    # _LinearizedScan, which then needs reverse-mode rules of its own (it raised
    # NotImplementedError: "must implement vjp_fwd").
    def rof(scan, **kw):
        f = jax.jit(_loss(scan, **kw))
        tangents = (W, XS, H0)
        return jax.grad(lambda *a: jax.jvp(f, a, tangents)[1], argnums=(0, 1, 2))(W, XS, H0)

    _close(rof(jaxmem.scan, **OPTIONS[option]), rof(jax.lax.scan))
