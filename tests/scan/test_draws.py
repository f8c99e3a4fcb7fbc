"""Masks drawn before the loop (:mod:`jaxmem._src.scan.draws`): a step's dropout masks keyed by its
``xs`` are drawn by a scan of their own and read back from bits; values and gradients are
``jax.lax.scan``'s, the loop's step draws nothing, and what the loop keeps shrinks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src import jax_compat as jc
from jaxmem._src.scan import draws
from tests.helpers import assert_trees_close

L, B, D = 5, 8, 16
KEEP = 0.75


def _weights():
    r = np.random.default_rng(0)
    return jnp.asarray(r.standard_normal((L, D, D)) / np.sqrt(D), jnp.float32)


def dropout_step(h, x):
    """Two dropouts keyed by the layer's key: a bool mask selected with (Flax's Dropout) and a
    float multiplier computed from a mask (Flax's attention dropout)."""
    w, key = x
    k1, k2 = jax.random.split(key)
    a = jnp.tanh(h @ w)
    keep = jax.random.bernoulli(k1, KEEP, a.shape)
    a = jax.lax.select(keep, a / KEEP, jnp.zeros_like(a))
    mult = jax.random.bernoulli(k2, KEEP, a.shape).astype(a.dtype) / KEEP
    return h + a * mult, keep


def carried_key_step(carry, w):
    """The key is carried (split every step): its draws depend on the carry, so stay in the step."""
    h, key = carry
    key, sub = jax.random.split(key)
    keep = jax.random.bernoulli(sub, KEEP, h.shape)
    h = h + jnp.where(keep, jnp.tanh(h @ w) / KEEP, 0.0)
    return (h, key), None


def _loss(scan, step=dropout_step):
    def loss(ws, h0, key):
        keys = jax.random.split(key, L)
        h, masks = scan(step, h0, (ws, keys))
        return jnp.sum(h**2) + jnp.sum(masks * h[None, :, :])

    return loss


def _args():
    return _weights(), jnp.ones((B, D), jnp.float32) * 0.3, jax.random.key(3)


def _step_jaxpr(step, *args):
    closed = jax.make_jaxpr(step)(*args)
    return jc.open_jaxpr(closed)


def test_drawn_masks_are_the_masks_leaving_the_xs_only_part():
    """The select's mask and the bool mask before the float multiplier; not the split keys."""
    h, (ws, keys) = jnp.ones((B, D)), (_weights(), jax.random.split(jax.random.key(0), L))
    jaxpr = _step_jaxpr(lambda h, w, k: dropout_step(h, (w, k)), h, ws[0], keys[0])
    masks = draws.drawn_masks(jaxpr, slice(0, 1), slice(1, 3))
    assert [str(v.aval) for v in masks] == ["bool[8,16]", "bool[8,16]"]


def test_a_draw_keyed_by_the_carry_stays_in_the_step():
    h, key, w = jnp.ones((B, D)), jax.random.key(0), _weights()[0]
    jaxpr = _step_jaxpr(lambda h, k, w: carried_key_step((h, k), w), h, key, w)
    assert draws.drawn_masks(jaxpr, slice(0, 2), slice(2, 3)) == []


@pytest.mark.parametrize("reverse", [False, True])
def test_values_and_gradients_equal_lax_scan(reverse):
    def scan(mine):
        def run(step, init, xs):
            if mine:
                return jaxmem.scan(step, init, xs, reverse=reverse)
            return jax.lax.scan(step, init, xs, reverse=reverse)

        return run

    args = _args()
    f_ours = jax.jit(jax.value_and_grad(_loss(scan(True)), argnums=(0, 1)))
    f_ref = jax.jit(jax.value_and_grad(_loss(scan(False)), argnums=(0, 1)))
    (v, g), (v_ref, g_ref) = f_ours(*args), f_ref(*args)
    np.testing.assert_allclose(v, v_ref, rtol=1e-6)
    assert_trees_close(g, g_ref)
    # The masks (a y) are the same bits.
    ws, h0, key = args
    keys = jax.random.split(key, L)
    _, m = jaxmem.scan(dropout_step, h0, (ws, keys), reverse=reverse)
    _, m_ref = jax.lax.scan(dropout_step, h0, (ws, keys), reverse=reverse)
    assert m.dtype == jnp.bool_ and bool(jnp.all(m == m_ref))


def test_forward_mode_and_vmap_equal_lax_scan():
    ws, h0, key = _args()
    ours, ref = _loss(jaxmem.scan), _loss(jax.lax.scan)
    t = jnp.ones_like(h0)
    out, tan = jax.jit(lambda h: jax.jvp(lambda h: ours(ws, h, key), (h,), (t,)))(h0)
    out_r, tan_r = jax.jvp(lambda h: ref(ws, h, key), (h0,), (t,))
    np.testing.assert_allclose(out, out_r, rtol=1e-6)
    assert_trees_close(tan, tan_r)
    keys = jax.random.split(jax.random.key(7), 3)
    batched = jax.jit(jax.vmap(jax.grad(ours, argnums=1), in_axes=(None, None, 0)))(ws, h0, keys)
    want = jax.vmap(jax.grad(ref, argnums=1), in_axes=(None, None, 0))(ws, h0, keys)
    assert_trees_close(batched, want)


def test_a_carried_key_equals_lax_scan():
    ws, h0, key = _args()

    def loss(scan):
        def f(ws, h0):
            (h, _), _ = scan(carried_key_step, (h0, key), ws)
            return jnp.sum(h**2)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    (v, g), (v_ref, g_ref) = loss(jaxmem.scan)(ws, h0), loss(jax.lax.scan)(ws, h0)
    np.testing.assert_allclose(v, v_ref, rtol=1e-6)
    assert_trees_close(g, g_ref)


def _has_draw(jaxpr) -> bool:
    return any(draws._draws(e) for e in jaxpr.eqns)


def test_the_loop_step_draws_nothing_and_keeps_no_mask():
    """The plan's step has no draw (the masks come in as xs bits and are unpacked:
    recomputed, or read back from the ys for the one the step returns, not kept), and the loop
    keeps fewer bytes than ``lax.scan``."""
    ws, h0, key = _args()
    keys = jax.random.split(key, L)
    plan = jaxmem.scan_residuals(dropout_step, h0, (ws, keys))
    assert not any(r.kind == "stacked" and r.dtype in ("bool", "uint8") for r in plan.residuals)
    masks = [r for r in plan.residuals if r.dtype == "bool"]
    assert masks and all(r.kind in ("recomputed", "ys") for r in masks), plan
    assert plan.stacked_bytes < plan.stock_stacked_bytes
    # The traced step: what the loop runs has no draw; the draw is in a lax.scan of its own.
    body, _, xs_leaves, _, _ = jaxmem._src.scan.trace._prepare(
        dropout_step, h0, (ws, keys), None, "test"
    )
    assert not _has_draw(jc.open_jaxpr(body.jaxpr))
    assert [str(jax.typeof(b)) for b in xs_leaves[2:]] == ["uint8[5,8,2]", "uint8[5,8,2]"]
