"""jaxmem.plan: a remat plan for a memory budget, applied to policy="auto" stacks by use_plan."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src import auto as _auto

pytest.importorskip("flax")
from jaxmem.demo.models import GPT, GPTConfig, next_token_loss  # noqa: E402

CFG = GPTConfig(vocab_size=64, seq_len=16, num_layers=2, d_model=32, num_heads=2, d_ff=64)
NO_REMAT = jaxmem.Plan(save=frozenset(), no_remat=True)


@pytest.fixture(scope="module")
def gpt():
    model = GPT(CFG, scan_impl=functools.partial(jaxmem.scan, policy="auto"))
    tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_len), 0, CFG.vocab_size)
    with jaxmem.use_plan(NO_REMAT):
        params = model.init(jax.random.key(0), tokens)["params"]
    loss = next_token_loss(model)
    with jaxmem.use_plan(NO_REMAT):
        ref = jax.jit(jax.grad(loss))(params, tokens)
    # A budget above everything: no remat fits; the trials give the two ends.
    loose = jaxmem.plan(loss, params, tokens, budget=2**40)
    return loss, params, tokens, ref, loose


def _temps(p):
    trials = {names: temp for names, temp, _ in p.trials}
    return trials[()], max(t for n, t in trials.items() if n != ("<no remat>",))


def test_loose_budget_is_no_remat(gpt):
    *_, loose = gpt
    assert loose.no_remat and loose.recompute_flops == 0 and loose.compiles == 3
    assert "decoder_layer_input" in loose.save and "qkv_proj" in loose.save


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_plan_fits_and_keeps_gradients(gpt, fraction):
    loss, params, tokens, ref, loose = gpt
    lo, hi = _temps(loose)
    budget = int(lo + fraction * (hi - lo))
    # The ends measured for `loose` are reused: only the search's own candidates compile.
    p = jaxmem.plan(loss, params, tokens, budget=budget, max_compiles=3, known=loose.trials)
    assert p.measured_temp_bytes <= budget
    assert p.compiles <= 3 and p.recompute_flops >= 0
    assert p.recompute_flops < dict((n, f) for n, _, f in loose.trials)[()] - loose.baseline_flops
    assert p.save | p.recompute == loose.save and not p.offload
    with jaxmem.use_plan(p):
        got = jax.jit(jax.grad(loss))(params, tokens)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, ref)


def test_budget_below_full_remat(gpt):
    loss, params, tokens, _, loose = gpt
    lo, _ = _temps(loose)
    with pytest.raises(ValueError, match=f"smallest reachable temp, {lo} bytes"):
        jaxmem.plan(loss, params, tokens, budget=lo - 1, known=loose.trials)


def test_validate_lists_the_names_that_occur(gpt):
    loss, params, tokens, *_ = gpt
    ok = jaxmem.Plan(save=frozenset({"qkv_proj"}), recompute=frozenset({"mlp_act"}))
    assert ok.validate(loss, params, tokens) is ok
    with pytest.raises(ValueError, match="'mlpwi' not among .* attention_out, attention_probs"):
        jaxmem.Plan(save=frozenset({"mlpwi"})).validate(loss, params, tokens)


def test_json_round_trip(gpt):
    *_, loose = gpt
    p = jaxmem.Plan.from_json(loose.to_json())
    assert p == loose and p.policy == loose.policy
    assert "no remat" in str(p)


def test_plan_policy_is_a_name_policy():
    p = jaxmem.Plan(save=frozenset({"qkv_proj", "mlp_in"}), recompute=frozenset({"mlp_act"}))
    assert p.policy == jaxmem.policies.save("mlp_in", "qkv_proj")
    with pytest.raises(ValueError, match="both saved and recomputed"):
        jaxmem.Plan(save=frozenset({"mlp_in"}), recompute=frozenset({"mlp_in"}))


def test_auto_outside_a_plan_warns_once_and_is_no_remat(monkeypatch):
    monkeypatch.setattr(_auto, "_warned", False)

    def f(w, xs):
        step = lambda h, x: (jnp.tanh(jaxmem.name(h * w + x, "mlp_act")), None)  # noqa: E731
        return jaxmem.scan(step, jnp.zeros(3), xs, policy="auto")[0].sum()

    xs = jnp.ones((4, 3))
    with pytest.warns(UserWarning, match='policy="auto" outside any plan'):
        g = jax.grad(f)(0.5, xs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.grad(f)(0.5, xs)  # Once only.
    plain = jax.grad(
        lambda w: jax.lax.scan(lambda h, x: (jnp.tanh(h * w + x), None), jnp.zeros(3), xs)[0].sum()
    )(0.5)
    np.testing.assert_allclose(g, plain, rtol=1e-6)


def test_use_plan_needs_a_plan():
    with pytest.raises(TypeError, match="expected a jaxmem.Plan"):
        with jaxmem.use_plan(jaxmem.policies.nothing):
            pass


def test_flax_linen_stack_takes_auto():
    nn = pytest.importorskip("flax.linen")
    from jaxmem.flax import linen as jl

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            x = jaxmem.name(jax.nn.gelu(nn.Dense(8)(h)), "mlp_act")
            return h + nn.Dense(h.shape[-1])(x)

    model = jl.scan_layers(Block, 2, policy="auto")()
    h = jnp.ones((2, 4))
    with jaxmem.use_plan(NO_REMAT):
        params = model.init(jax.random.key(0), h)["params"]

    def loss(p):
        return jnp.mean(model.apply({"params": p}, h) ** 2)

    def prims(plan):
        with jaxmem.use_plan(plan):
            text = str(jax.make_jaxpr(jax.grad(loss))(params))
        return "checkpoint" in text or "remat" in text

    assert prims(jaxmem.Plan(save=frozenset({"mlp_act"})))
    assert not prims(NO_REMAT)
