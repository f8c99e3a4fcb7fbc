"""Effects in a scan body (``jax.debug.print``, ``jax.debug.callback``, ``io_callback``) run as
many times under ``jaxmem.scan`` (and a scan ``jaxmem.optimize`` rewrote) as under
``jax.lax.scan``, under every transformation: once a step in the forward loop, again in each
step a remat recomputes (as ``jax.checkpoint`` reruns them), and the loop kept where its outputs
are unused.

An ``io_callback`` whose result the step ignores is the exception: ``lax.scan``'s own gradient
drops it (partial evaluation removes the equation from its forward loop on jax 0.10.2 and 0.12),
a plain Python loop of the same step runs it once a step, and so does ``jaxmem.scan``: it is
checked against the Python loop.
"""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import jaxmem

T = 4
XS = jnp.arange(T * 3, dtype=jnp.float32).reshape(T, 3) / 10
_LOG: list = []


def _record(s):
    _LOG.append(float(s))
    return np.float32(0)


def _step(kind):
    def step(h, x):
        h = jnp.tanh(h + x)
        s = jnp.sum(h)
        if kind == "print":
            jax.debug.print("h={s}", s=s)
        elif kind == "callback":
            jax.debug.callback(_record, s)
        elif kind in ("io", "io_ordered"):
            out = jax.ShapeDtypeStruct((), jnp.float32)
            io_callback(_record, out, jax.lax.stop_gradient(s), ordered=kind == "io_ordered")
        return h, jnp.sin(h)

    return step


def _python_loop(step, init, xs, **_):
    ys = []
    for t in range(xs.shape[0]):
        init, y = step(init, xs[t])
        ys.append(y)
    return init, jnp.stack(ys)


def _checkpointed(scan):
    """``scan`` over ``jax.checkpoint(step)`` for stock, ``policy="nothing"`` for jaxmem.scan."""
    if scan is jaxmem.scan:
        return lambda step, init, xs: jaxmem.scan(step, init, xs, policy="nothing")
    return lambda step, init, xs: scan(jax.checkpoint(step), init, xs)


def _loss(scan, kind):
    def loss(xs):
        h, ys = scan(_step(kind), jnp.zeros(3), xs)
        return jnp.sum(h**2) + jnp.sum(ys)

    return loss


TRANSFORMS = {
    "call": lambda f: f(XS),
    "grad": lambda f: jax.grad(f)(XS),
    "jit_grad": lambda f: jax.jit(jax.grad(f))(XS),
    "value_and_grad": lambda f: jax.value_and_grad(f)(XS),
    "vmap_grad": lambda f: jax.vmap(jax.grad(f))(jnp.stack([XS, XS + 1])),
    "jvp": lambda f: jax.jvp(f, (XS,), (XS,)),
    "grad_checkpoint": lambda f: jax.grad(jax.checkpoint(f))(XS),
    "jit_unused": lambda f: jax.jit(lambda x: (f(x), jnp.float32(0))[1])(XS),
}


def _count(run) -> int:
    """Effects run by ``run()``: callbacks recorded plus lines printed."""
    _LOG.clear()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.block_until_ready(run())
        jax.effects_barrier()
    return len(_LOG) + sum(1 for line in out.getvalue().splitlines() if line.startswith("h="))


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("kind", ["print", "callback"])
@pytest.mark.parametrize("remat", [False, True], ids=["lean", "remat"])
def test_debug_effects_run_as_under_lax_scan(kind, transform, remat):
    wrap = _checkpointed if remat else (lambda scan: scan)
    run = TRANSFORMS[transform]
    want = _count(lambda: run(_loss(wrap(jax.lax.scan), kind)))
    assert want >= T  # the reference runs them (this test can fail)
    assert _count(lambda: run(_loss(wrap(jaxmem.scan), kind))) == want


@pytest.mark.parametrize("transform", ["grad", "jit_grad", "value_and_grad", "jit_unused"])
@pytest.mark.parametrize("kind", ["print", "callback", "io"])
def test_effects_in_a_scan_optimize_rewrote(kind, transform):
    run = TRANSFORMS[transform]
    want = _count(lambda: run(_loss(_python_loop, kind)))
    assert want == T
    assert _count(lambda: run(jaxmem.optimize(_loss(jax.lax.scan, kind)))) == want


@pytest.mark.parametrize("transform", ["call", "grad", "jit_grad", "jvp", "jit_unused"])
@pytest.mark.parametrize("kind", ["io", "io_ordered"])
def test_io_callbacks_run_once_a_step(kind, transform):
    run = TRANSFORMS[transform]
    assert _count(lambda: run(_loss(_python_loop, kind))) == T
    assert _count(lambda: run(_loss(jaxmem.scan, kind))) == T


def test_ordered_callbacks_keep_their_order():
    _LOG.clear()
    jax.grad(_loss(jaxmem.scan, "io_ordered"))(XS)
    jax.effects_barrier()
    order = list(_LOG)
    _LOG.clear()
    _loss(_python_loop, "io_ordered")(XS)
    jax.effects_barrier()
    np.testing.assert_allclose(order, _LOG, rtol=1e-6)


def test_effects_rerun_with_each_checkpointed_step():
    """With ``checkpoints=`` the steps that Revolve recomputes run their effects again, as a
    remat's recompute does: as many as the steps evaluated."""
    with jaxmem.step_counter() as steps:
        n = _count(lambda: jax.grad(_loss(_checkpoints(2), "callback"))(XS))
    assert n == steps.forward_steps > T


def _checkpoints(k):
    return lambda step, init, xs: jaxmem.scan(step, init, xs, checkpoints=k)
