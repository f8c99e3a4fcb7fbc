"""The decisions of ``recompute="auto"`` (:mod:`jaxmem._src.scan.recompute_cost`), structurally.

Each test reads the plan (what is stacked, what the backward step recomputes), never a clock:
the step times these decisions protect are measured by ``python -m benchmarks.peers``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src import jax_compat as jc
from jaxmem._src.scan import jaxprs as J
from jaxmem._src.scan import recompute_cost as rc
from jaxmem._src.scan import residuals as R

N, D, W = 16, 8, 32


def _plan(step, args, n_consts, n_carry, recompute):
    body = jax.make_jaxpr(step)(*args)
    return R.plan_step(body, n_consts, n_carry, [v.aval for v in body.jaxpr.invars], recompute)


def _rebuilt(plan) -> list[str]:
    return [e.primitive.name for e in jc.open_jaxpr(plan.rebuild).eqns]


def _stacked_shapes(plan):
    return sorted(tuple(v.aval.shape) for v in plan.stacked_vars)


def _mlp_step(h, w1, w2):
    """A residual MLP written per token, as Equinox's ``jax.vmap(mlp)(h)``: each Linear is a dot
    of the weight with the batch followed by a transpose back to tokens-first."""
    z = jax.vmap(lambda v: w1 @ v)(h)
    return (h + jax.vmap(lambda v: w2 @ v)(jax.nn.relu(z)),)


def _mlp_args():
    r = np.random.default_rng(0)
    return (
        jnp.asarray(r.standard_normal((N, D)), jnp.float32),
        jnp.asarray(r.standard_normal((W, D)), jnp.float32),
        jnp.asarray(r.standard_normal((D, W)), jnp.float32),
    )


def test_a_transpose_of_a_computed_value_is_kept_on_cpu():
    """``"cheap"`` stores the dot's output and transposes it again in the backward step (1.25x
    lax.scan's step time on the Equinox stack); ``"auto"`` stores the transposed value: the same
    bytes, and no transpose of a computed value in the backward step."""
    h, w1, w2 = _mlp_args()
    step = lambda h, w1, w2: _mlp_step(h, w1, w2)
    # w1, w2 as xs slices: consts 0, carry h, x = (w1, w2).
    cheap = _plan(step, (h, w1, w2), 0, 1, "cheap")
    auto = _plan(step, (h, w1, w2), 0, 1, "auto")
    assert "transpose" in _rebuilt(cheap)
    computed = {v for e in jc.open_jaxpr(auto.rebuild).eqns for v in e.outvars}
    for e in jc.open_jaxpr(auto.rebuild).eqns:
        if e.primitive.name == "transpose":
            assert e.invars[0] not in computed
    assert _stacked_shapes(auto) == [(N, W)]  # relu's input, tokens-first
    assert _stacked_shapes(cheap) == [(W, N)]  # the dot's output, before its transpose
    assert R.kept_bytes(auto.stacked_vars[0].aval) == R.kept_bytes(cheap.stacked_vars[0].aval)


def test_a_transpose_of_an_input_is_still_recomputed():
    """The transposed weight of ``tanh(h @ w.T)`` (w an xs slice) folds into the backward dot:
    ``"auto"`` stacks nothing for it, as ``"cheap"`` (stock lax.scan stacks it per step)."""
    r = np.random.default_rng(1)
    h = jnp.asarray(r.standard_normal((4, D)), jnp.float32)
    w = jnp.asarray(r.standard_normal((D, D)), jnp.float32)
    step = lambda h, w: (jnp.tanh(h @ w.T),)
    auto = _plan(step, (h, w), 0, 1, "auto")
    assert auto.stacked_vars == ()
    assert "transpose" in _rebuilt(auto)
    assert auto.res_classes == _plan(step, (h, w), 0, 1, "cheap").res_classes


def _chain_step(c, x):
    """Transcendental work on the carry and no dot: the step is its elementwise work."""
    u = jnp.sin(c * x)
    return (jnp.tanh(jnp.exp(u) + jnp.cos(u)),)


def _chain_args():
    return jnp.linspace(-1.0, 1.0, 4096, dtype=jnp.float32), jnp.ones(4096, jnp.float32)


def _cuts(*models):
    """The priced cut under each model and the cheap cut, of one trace of the chain step."""
    body = jax.make_jaxpr(_chain_step)(*_chain_args())
    traced = R.trace_step_vjp(body, 0, 1, [v.aval for v in body.jaxpr.invars])
    free = R.loop_invariants(traced) | set(traced.x_in)
    cands = R.carry_candidates(traced, [-1])
    priced = [R._priced_cut(traced, body, free, cands, m)[1] for m in models]
    cheap = R.choose_stores(traced, free, cands, J._is_cheap)
    return [R._stored_bytes(traced, s) for s in (*priced, cheap)]


def test_the_budget_keeps_what_costs_more_than_it_saves():
    """Priced with no budget and no credit for saved traffic, recomputing a transcendental
    costs more than it saves: the cut stores more. With a generous budget it is the cheap cut."""
    strict = dataclasses.replace(rc.CPU, budget=0.0, bytes_per_s=float("inf"))
    generous = dataclasses.replace(rc.CPU, budget=10.0)
    strict_bytes, generous_bytes, cheap_bytes = _cuts(strict, generous)
    assert generous_bytes == cheap_bytes
    assert strict_bytes > cheap_bytes


def test_prices():
    jaxpr = jax.make_jaxpr(lambda a, b: jnp.tanh(a @ b).T + 1.0)(jnp.ones((8, 4)), jnp.ones((4, 2)))
    dot, tanh, transpose, add = jaxpr.jaxpr.eqns
    cpu = rc.CPU
    assert rc.eqn_seconds(dot, cpu) == 2 * 8 * 2 * 4 / cpu.dot_flops_per_s
    assert rc.eqn_seconds(tanh, cpu) == 16 / cpu.transcendental_per_s
    assert rc.eqn_seconds(transpose, cpu) == 2 * 64 / cpu.bytes_per_s
    assert rc.eqn_seconds(add, cpu) == 16 / cpu.elementwise_per_s
    assert rc.eqn_seconds(transpose, rc.GPU) == 16 / rc.GPU.elementwise_per_s
    assert rc.step_seconds(jaxpr.jaxpr.eqns, cpu) == pytest.approx(
        3 * sum(rc.eqn_seconds(e, cpu) for e in jaxpr.jaxpr.eqns)
    )
    assert rc.for_backend("cpu") is rc.CPU and rc.for_backend("cuda") is rc.GPU


def test_auto_is_the_default_and_is_checked():
    h, w1, w2 = _mlp_args()
    ws = (jnp.stack([w1] * 3), jnp.stack([w2] * 3))
    step = lambda h, w: (_mlp_step(h, *w)[0], None)
    default = jaxmem.scan_residuals(step, h, ws)
    auto = jaxmem.scan_residuals(step, h, ws, recompute="auto")
    assert default.stacked == auto.stacked
    with pytest.raises(ValueError, match="recompute='fast'; expected one of 'auto', 'cheap'"):
        jaxmem.scan(step, h, ws, recompute="fast")
