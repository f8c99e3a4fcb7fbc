"""``jaxmem.scan`` takes what ``jax.lax.scan`` takes: a body returning a list, the
``_split_transpose`` keyword (Flax passes it), and ``jax.lax.scan = jaxmem.scan`` (jaxmem's own
loops never call back through the public name)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem

W = jnp.asarray(np.random.default_rng(0).standard_normal((4, 4)) * 0.3, jnp.float32)
XS = jnp.linspace(-1.0, 1.0, 5 * 2 * 4, dtype=jnp.float32).reshape(5, 2, 4)


def _loss(scan, step, **kw):
    def loss(w, xs):
        h, ys = scan(lambda h, x: step(w, h, x), jnp.zeros((2, 4)), xs, **kw)
        return jnp.sum(h**2) + jnp.sum(jnp.sin(ys))

    return loss


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * float(np.abs(y).max()))


def test_a_body_returning_a_list():
    step = lambda w, h, x: [jnp.tanh(h @ w + x), h]
    want = jax.grad(_loss(jax.lax.scan, step), (0, 1))(W, XS)
    _close(jax.grad(_loss(jaxmem.scan, step), (0, 1))(W, XS), want)
    _close(_loss(jaxmem.scan, step)(W, XS), _loss(jax.lax.scan, step)(W, XS))


@pytest.mark.parametrize("split", [False, True])
def test_split_transpose_is_accepted(split):
    step = lambda w, h, x: (jnp.tanh(h @ w + x), h)
    want = jax.grad(_loss(jax.lax.scan, step, _split_transpose=split))(W, XS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jax.grad(_loss(jaxmem.scan, step, _split_transpose=split))(W, XS)
    _close(got, want)
    said = [w for w in caught if "_split_transpose=True has no effect" in str(w.message)]
    assert len(said) == (1 if split else 0)
    with pytest.raises(TypeError, match="_split_transpose"):
        jaxmem.scan(lambda h, x: (h, x), 0.0, XS, _split_transpose="yes")


@pytest.mark.parametrize(
    "options", [{}, {"policy": "dots"}, {"checkpoints": 2}, {"unroll": 2}, {"compress": "bf16"}]
)
# Programs whose loss reads all their loops keep: compress encodes nothing there, and warns
# option_noop, as a user's loop would.
@pytest.mark.filterwarnings("ignore:option_noop. compress=:jaxmem.LintWarning")
def test_lax_scan_swapped_for_jaxmem_scan(options):
    step = lambda w, h, x: (jnp.tanh(h @ w + x), h)
    want = jax.grad(_loss(jaxmem.scan, step, **options))(W, XS)
    original = jax.lax.scan
    jax.lax.scan = jaxmem.scan
    try:
        profile = jaxmem.scan_residuals(
            lambda h, x: step(W, h, x), jnp.zeros((2, 4)), XS,
            **{k: v for k, v in options.items() if k != "unroll"},
        )  # fmt: skip
        got = jax.jit(jax.grad(_loss(jax.lax.scan, step, **options)))(W, XS)
    finally:
        jax.lax.scan = original
    _close(got, want)
    assert profile.stock_stacked_bytes > 0
