"""jaxmem.plan / frontier: plans fit their budget, cost no more than the cheapest fitting preset,
and applied with use_plan (policy="auto") keep the gradients of no remat."""

import functools
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src import auto as _auto

# One xdist worker runs this module, so its module-scoped fixture is built once (the
# Makefile runs pytest with --dist loadgroup).
pytestmark = pytest.mark.xdist_group("planner")

NO_REMAT = jaxmem.Plan(no_remat=True)
PRESETS = ("nothing", "dots_no_batch", "dots", "selective", "everything")


def _close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6), a, b)


def _compiled(grad_fn, *args):
    c = jax.jit(grad_fn).lower(*args).compile()
    cost = c.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return c.memory_analysis().temp_size_in_bytes, cost["flops"]


# ---------------------------------------------------------------------------------------------
# The reference GPT (jaxmem.demo.models), two layers.


@pytest.fixture(scope="module")
def gpt():
    pytest.importorskip("flax")
    from jaxmem.demo.models import GPT, GPTConfig, next_token_loss

    cfg = GPTConfig(vocab_size=64, seq_len=16, num_layers=2, d_model=32, num_heads=2, d_ff=64)
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.seq_len), 0, cfg.vocab_size)

    def model_loss(policy):
        return next_token_loss(GPT(cfg, scan_impl=functools.partial(jaxmem.scan, policy=policy)))

    loss = model_loss("auto")
    with jaxmem.use_plan(NO_REMAT):
        params = GPT(cfg).init(jax.random.key(0), tokens)["params"]
        ref = jax.jit(jax.grad(loss))(params, tokens)
    # The presets, compiled independently of the planner (policy=<preset>, no "auto").
    presets = {
        p: _compiled(jax.grad(model_loss(jaxmem.policies.by_name(p))), params, tokens)
        for p in PRESETS
    }
    presets["no remat"] = _compiled(jax.grad(model_loss(None)), params, tokens)
    # Five budgets from the smallest preset temp to no remat's; the middle one is also chosen
    # (planned again after the sweep, from all it measured).
    lo = min(t for t, _ in presets.values())
    hi = presets["no remat"][0]
    budgets = [lo + i * (hi - lo) // 4 for i in range(5)]
    front = jaxmem.frontier(
        loss, params, tokens, budgets=budgets, budget=budgets[2], max_compiles=3
    )
    return loss, params, tokens, ref, presets, front


def test_frontier_plans_fit_and_beat_every_fitting_preset(gpt):
    *_, presets, front = gpt
    assert len(front.plans) == 5
    assert front.point("no remat").temp_bytes == presets["no remat"][0]
    budgets = [p.budget for p in front.plans]
    base = front.baseline_flops
    dots = front.point("preset dots")  # The same program as policy=dots: the same figures.
    assert (dots.temp_bytes, dots.recompute_flops + base) == pytest.approx(presets["dots"])
    assert base == presets["no remat"][1]
    for p in front.plans:
        assert p.measured_temp_bytes <= p.budget
        fitting = [f - base for k, (t, f) in presets.items() if t <= p.budget and k in PRESETS]
        if fitting:  # Never more recompute than the cheapest preset that fits.
            assert p.recompute_flops <= min(fitting) + 1e-6 * base, (str(p), presets)
        assert p.compiles <= 3
    chosen = front.chosen  # Planned last, knowing every measurement of the sweep.
    assert chosen.budget == budgets[2] and chosen.measured_temp_bytes <= chosen.budget
    assert chosen.recompute_flops <= front.plans[2].recompute_flops
    assert f"chosen for {chosen.budget / 2**20:.3f} MiB" in str(front)
    # The cheapest fitting candidate strictly below no remat recomputes something.
    assert front.plans[-1].no_remat and front.plans[-1].recompute_flops == 0
    assert front.plans[0].recompute_flops > 0


def test_plans_keep_gradients_and_are_what_use_plan_compiles(gpt):
    loss, params, tokens, ref, _, front = gpt
    grad = jax.jit(jax.grad(loss))  # Jitted once, outside any plan: the plan is in the jit key.
    for p in (front.plans[0], front.plans[2]):
        with jaxmem.use_plan(p):
            temp = grad.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
            got = grad(params, tokens)
        assert temp == p.measured_temp_bytes
        _close(got, ref)
        # The policy alone (no use_plan) gives the same program when the plan has no
        # checkpoints: plan.policy plugs into jaxmem.scan(policy=...) directly.
        assert p.checkpoints is None


def test_frontier_points_table_plot_and_json(gpt, tmp_path):
    *_, front = gpt
    measured = [p for p in front.points if p.temp_bytes is not None]
    pareto = front.pareto()
    assert front.point("no remat") in pareto and pareto
    for p in pareto:  # Nothing measured dominates a Pareto point.
        assert not any(
            q.temp_bytes <= p.temp_bytes
            and q.recompute_flops <= p.recompute_flops
            and (q.temp_bytes, q.recompute_flops) != (p.temp_bytes, p.recompute_flops)
            for q in measured
        )
    for p in set(measured) - set(pareto):
        assert any(
            q.temp_bytes <= p.temp_bytes and q.recompute_flops <= p.recompute_flops for q in pareto
        )
    kinds = {p.kind for p in front.points}
    assert {"preset", "no remat", "offload"} <= kinds
    off = [p for p in front.points if p.kind == "offload"]
    assert off and all(p.temp_bytes is None and "not measurable here" in p.note for p in off)
    picked = [p for p in front.points if p.picked_for]
    assert sorted(b for p in picked for b in p.picked_for) == [p.budget for p in front.plans]
    text = str(front)
    assert "preset dots" in text and "on the Pareto frontier" in text and "planned for" in text
    assert json.loads(front.to_json())["baseline_flops"] == front.baseline_flops
    front.plot(tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="frontier\\(time=True\\)"):
        front.plot(y="time")


def test_budget_below_reach_says_what_would_lower_it(gpt):
    loss, params, tokens, *_, front = gpt
    trials = [
        (p.key, p.temp_bytes, p.recompute_flops + front.baseline_flops)
        for p in front.points
        if p.temp_bytes is not None
    ]
    lo = min(t for _, t, _ in trials)
    with pytest.raises(ValueError, match=f"below the smallest reachable temp, {lo} bytes") as e:
        jaxmem.plan(loss, params, tokens, budget=lo - 1, known=trials, checkpoints=False)
    assert "checkpoints=" in str(e.value) and "linear_cross_entropy" in str(e.value)
    assert "offload" in str(e.value)


def test_validate_lists_the_names_that_occur(gpt):
    loss, params, tokens, *_ = gpt
    ok = jaxmem.Plan(save=frozenset({"qkv_proj"}), recompute=frozenset({"mlp_act"}))
    assert ok.validate(loss, params, tokens) is ok
    with pytest.raises(ValueError, match="'mlpwi' not among .* attention_out, attention_probs"):
        jaxmem.Plan(save=frozenset({"mlpwi"})).validate(loss, params, tokens)


def test_plan_json_round_trip_and_str(gpt):
    *_, front = gpt
    for p in front.plans:
        q = jaxmem.Plan.from_json(p.to_json())
        assert q == p and q.policy == p.policy
    assert "no remat at all" in str(front.plans[-1])
    assert "search:" in str(front.plans[0]) and "recomputed" in str(front.plans[0])


# ---------------------------------------------------------------------------------------------
# The held-out GPT (benchmarks.heldout_gpt: Flax NNX, RMSNorm, separate q/k/v, RoPE, SwiGLU),
# written apart from the planner.


def test_heldout_gpt_plans_fit_and_beat_every_fitting_preset():
    pytest.importorskip("flax")
    from benchmarks import heldout_gpt

    cfg = heldout_gpt.HeldoutConfig(
        vocab_size=64, seq_len=16, num_layers=2, d_model=32, num_heads=2, d_ff=64
    )
    loss, params, tokens = heldout_gpt.make_loss(cfg, policy="auto", batch_size=2)
    front = jaxmem.frontier(loss, params, tokens, budgets=5, max_compiles=3)
    base = front.baseline_flops
    presets = [p for p in front.points if p.kind == "preset"]
    assert {p.key for p in presets} == {"save nothing"} | {f"preset {n}" for n in PRESETS[1:]}
    assert len(front.plans) == 5 and front.plans[-1].no_remat
    for p in front.plans:
        assert p.measured_temp_bytes <= p.budget
        fitting = [q.recompute_flops for q in presets if q.temp_bytes <= p.budget]
        if fitting:
            assert p.recompute_flops <= min(fitting) + 1e-6 * base, str(p)
    middle = front.plans[2]
    assert not middle.no_remat and middle.recompute_flops > 0
    ref_loss, *_ = heldout_gpt.make_loss(cfg, policy=None, batch_size=2)
    with jaxmem.use_plan(middle):
        got = jax.jit(jax.grad(loss))(params, tokens)
    _close(got, jax.jit(jax.grad(ref_loss))(params, tokens))


# ---------------------------------------------------------------------------------------------
# A long RNN: below full remat, the plan turns on binomial checkpointing.


def _rnn_loss(w, xs):
    def step(h, x):
        a = jaxmem.name(jnp.tanh(h @ w + x), "mlp_act")
        return jnp.sin(a) * h + a, None

    return jnp.sum(jaxmem.scan(step, jnp.ones((4, 32)), xs, policy="auto")[0] ** 2)


RNN_ARGS = (
    jax.random.normal(jax.random.key(0), (32, 32)) / 8,
    jax.random.normal(jax.random.key(1), (64, 4, 32)),
)


def _rnn_stock(w, xs):
    def step(h, x):
        a = jnp.tanh(h @ w + x)
        return jnp.sin(a) * h + a, None

    return jnp.sum(jax.lax.scan(step, jnp.ones((4, 32)), xs)[0] ** 2)


def test_below_full_remat_the_plan_uses_checkpoints():
    full = jaxmem.plan(_rnn_loss, *RNN_ARGS, budget=2**40, presets=False)
    lo = dict((k, t) for k, t, _ in full.trials)["save nothing"]
    p = jaxmem.plan(_rnn_loss, *RNN_ARGS, budget=lo - 1, presets=False, known=full.trials)
    assert p.checkpoints == "sqrt" and p.measured_temp_bytes <= lo - 1
    assert p.compiles == 1 and "checkpoints='sqrt'" in str(p)
    with jaxmem.use_plan(p):
        got = jax.grad(_rnn_loss)(*RNN_ARGS)
        jaxpr = str(jax.make_jaxpr(jax.grad(_rnn_loss))(*RNN_ARGS))
    assert "while" in jaxpr  # The checkpointed VJP's advance loop.
    np.testing.assert_allclose(got, jax.grad(_rnn_stock)(*RNN_ARGS), rtol=1e-5, atol=1e-5)
    assert jaxmem.Plan.from_json(p.to_json()).checkpoints == "sqrt"


def test_time_is_measured_interleaved():
    p = jaxmem.plan(_rnn_loss, *RNN_ARGS, budget=2**40, presets=False, time=True)
    assert p.step_time_s > 0 and p.no_remat_step_time_s > 0 and "per gradient" in str(p)
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), RNN_ARGS)
    with pytest.raises(ValueError, match="give arrays, not jax.ShapeDtypeStruct"):
        jaxmem.plan(_rnn_loss, *structs, budget=2**40, presets=False, time=True)


def test_a_plan_applies_to_functions_jitted_before():
    grad = jax.jit(jax.grad(_rnn_loss))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "auto" outside any plan.
        outside = grad.lower(*RNN_ARGS).compile().memory_analysis().temp_size_in_bytes
    p = jaxmem.Plan(recompute=frozenset({"mlp_act"}), checkpoints=4)
    with jaxmem.use_plan(p):
        inside = grad.lower(*RNN_ARGS).compile().memory_analysis().temp_size_in_bytes
        want = jax.grad(_rnn_stock)(*RNN_ARGS)
        np.testing.assert_allclose(grad(*RNN_ARGS), want, rtol=1e-5, atol=1e-5)
    assert inside < outside / 4


# ---------------------------------------------------------------------------------------------
# Bad input, and policy="auto" itself.


def test_bad_input():
    with pytest.raises(TypeError, match="budget must be a number of bytes"):
        jaxmem.plan(_rnn_loss, *RNN_ARGS, budget=1.5e6)
    with pytest.raises(ValueError, match="max_compiles=2; it needs at least 3"):
        jaxmem.plan(_rnn_loss, *RNN_ARGS, budget=10**6, max_compiles=2)
    with pytest.raises(ValueError, match="uses no checkpoint name"):
        jaxmem.plan(_rnn_stock, *RNN_ARGS, budget=10**6)
    with pytest.raises(ValueError, match="both saved and recomputed|in both save and recompute"):
        jaxmem.Plan(save=frozenset({"mlp_in"}), recompute=frozenset({"mlp_in"}))
    with pytest.raises(TypeError, match="must be a set of checkpoint names"):
        jaxmem.Plan(save="mlp_in")
    with pytest.raises(ValueError, match="unknown policy 'full'"):
        jaxmem.Plan(preset="full")
    with pytest.raises(TypeError, match="expected a jaxmem.Plan"):
        with jaxmem.use_plan(jaxmem.policies.nothing):
            pass


def test_plan_policy_is_a_name_policy():
    p = jaxmem.Plan(save=frozenset({"qkv_proj", "mlp_in"}), recompute=frozenset({"mlp_act"}))
    assert p.policy == jaxmem.policies.save("mlp_in", "qkv_proj")
    assert jaxmem.Plan(preset="dots").policy == jaxmem.policies.dots
    assert NO_REMAT.policy == jaxmem.policies.everything


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
