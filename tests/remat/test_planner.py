"""jaxmem.plan / frontier: plans fit their budget, cost no more than the cheapest fitting preset,
and applied with use_plan (policy="auto") keep the gradients of no remat."""

import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src import checks
from jaxmem._src.remat import auto as _auto

NO_REMAT = jaxmem.RematPlan(no_remat=True)
PRESETS = ("nothing", "dots_no_batch", "dots", "selective", "everything")


def _close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6), a, b)


# ---------------------------------------------------------------------------------------------
# The reference GPT (jaxmem.demo.models), two layers, through the benchmark's own code
# (benchmarks.planner.run_model: the presets compiled directly, then jaxmem.frontier).


def _bench():
    pytest.importorskip("flax")
    from benchmarks import planner as bench

    return bench, dataclasses.replace(bench.QUICK, budgets=5, max_compiles=3)


@pytest.fixture(scope="module")
def gpt():
    bench, config = _bench()
    make = bench.reference(config)
    result = bench.run_model("reference", make, config.budgets, config.max_compiles)
    loss, params, tokens = make("auto")
    ref_loss, *_ = make(None)
    ref = jax.jit(jax.grad(ref_loss))(params, tokens)
    return loss, params, tokens, ref, result


def _check_model(result):
    """Every plan fits and recomputes no more than the cheapest preset that fits."""
    front, presets = result.frontier, result.presets
    base = front.baseline_flops
    assert base == result.no_remat[1] and set(presets) == set(PRESETS)
    assert front.point("no remat").temp_bytes == result.no_remat[0]
    # Through "auto", a preset is the same program as with policy=<preset>: the same figures.
    for name, (temp, flops) in presets.items():
        key = "save nothing" if name == "nothing" else f"preset {name}"
        point = front.point(key)
        assert (point.temp_bytes, point.recompute_flops) == pytest.approx((temp, flops)), key
    assert len(front.plans) == 5 and front.plans[-1].no_remat
    assert front.plans[-1].recompute_flops == 0 and front.plans[0].recompute_flops > 0
    for p, row in zip(front.plans, result.rows, strict=True):
        assert p.measured_temp_bytes <= p.budget and p.compiles <= 3
        fitting = [f for t, f in presets.values() if t <= p.budget]
        if fitting:  # Never more recompute than the cheapest preset that fits.
            assert p.recompute_flops <= min(fitting) + 1e-6 * base, (str(p), presets)
        assert row["fits"] and row["not_costlier"] and row["budget_bytes"] == p.budget


def test_reference_gpt_plans_fit_and_beat_every_fitting_preset(gpt):
    *_, result = gpt
    _check_model(result)
    bench, _ = _bench()
    table = bench.format_model(result)
    assert table.count("PASS") == 5 and "FAIL" not in table


def test_plans_keep_gradients_and_are_what_use_plan_compiles(gpt):
    loss, params, tokens, ref, result = gpt
    front = result.frontier
    grad = jax.jit(jax.grad(loss))  # Jitted once, outside any plan: the plan is in the jit key.
    for p in (front.plans[0], front.plans[2]):
        with jaxmem.use_plan(p):
            got = grad(params, tokens)
            # After the call, lower().compile() is the program the call compiled (cached).
            temp = grad.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
        assert temp == p.measured_temp_bytes
        _close(got, ref)
        # The policy alone (no use_plan) gives the same program when the plan has no
        # checkpoints: plan.policy plugs into jaxmem.scan(policy=...) directly.
        assert p.checkpoints is None


def test_frontier_points_table_plot_and_json(gpt, tmp_path):
    front = gpt[-1].frontier
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
    loss, params, tokens, _, result = gpt
    front = result.frontier
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
    ok = jaxmem.RematPlan(save=frozenset({"qkv_proj"}), recompute=frozenset({"mlp_act"}))
    assert ok.validate(loss, params, tokens) is ok
    with pytest.raises(ValueError, match="'mlpwi' not among .* attention_out, attention_probs"):
        jaxmem.RematPlan(save=frozenset({"mlpwi"})).validate(loss, params, tokens)


def test_plan_json_round_trip_and_str(gpt):
    front = gpt[-1].frontier
    for p in front.plans:
        q = jaxmem.RematPlan.from_json(p.to_json())
        assert q == p and q.policy == p.policy
    assert "no remat at all" in str(front.plans[-1])
    assert "search:" in str(front.plans[0]) and "recomputed" in str(front.plans[0])


# ---------------------------------------------------------------------------------------------
# The held-out GPT (benchmarks.models.heldout_gpt: Flax NNX, RMSNorm, separate q/k/v, RoPE, SwiGLU),
# written apart from the planner.


@pytest.mark.newest  # a benchmark script's run: the newest set-up only (CI time)
def test_heldout_gpt_plans_fit_and_beat_every_fitting_preset():
    bench, config = _bench()
    make = bench.heldout(config)
    result = bench.run_model("heldout", make, config.budgets, config.max_compiles)
    _check_model(result)
    loss, params, tokens = make("auto")
    ref_loss, *_ = make(None)
    middle = result.frontier.plans[2]
    assert not middle.no_remat and middle.recompute_flops > 0
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


@pytest.fixture(scope="module")
def rnn_full():
    """The loose plan (no presets) of the RNN: its trials are the ends, measured once."""
    return jaxmem.plan(_rnn_loss, *RNN_ARGS, budget=2**40, presets=False)


def test_below_full_remat_the_plan_uses_checkpoints(rnn_full):
    full = rnn_full
    lo = dict((k, t) for k, t, _ in full.trials)["save nothing"]
    p = jaxmem.plan(_rnn_loss, *RNN_ARGS, budget=lo - 1, presets=False, known=full.trials)
    assert p.checkpoints == "sqrt" and p.measured_temp_bytes <= lo - 1
    assert p.compiles == 1 and "checkpoints='sqrt'" in str(p)
    with jaxmem.use_plan(p):
        got = jax.grad(_rnn_loss)(*RNN_ARGS)
        jaxpr = str(jax.make_jaxpr(jax.grad(_rnn_loss))(*RNN_ARGS))
    assert "checkpoint_advance" in jaxpr  # The checkpointed VJP's advance loop (a primitive).
    np.testing.assert_allclose(got, jax.grad(_rnn_stock)(*RNN_ARGS), rtol=1e-5, atol=1e-5)
    assert jaxmem.RematPlan.from_json(p.to_json()).checkpoints == "sqrt"
    # The same budget as a float and as a string with a unit (KiB: 1024 bytes).
    for same in (float(lo - 1), f"{(lo - 1) / 1024!r}KiB"):
        q = jaxmem.plan(_rnn_loss, *RNN_ARGS, budget=same, presets=False, known=full.trials)
        assert (q.budget, q.checkpoints) == (lo - 1, "sqrt"), same


def test_frontier_marks_the_chosen_plan(tmp_path):
    first = jaxmem.frontier(_rnn_loss, *RNN_ARGS, budgets=0)
    lo = min(p.temp_bytes for p in first.points if p.temp_bytes is not None)
    hi = first.point("no remat").temp_bytes
    budget = (lo + hi) // 2
    trials = [
        (p.key, p.temp_bytes, p.recompute_flops + first.baseline_flops)
        for p in first.points
        if p.temp_bytes
    ]
    front = jaxmem.frontier(_rnn_loss, *RNN_ARGS, budgets=2, budget=budget, known=trials)
    assert [p.budget for p in front.plans] == [lo, hi]
    assert front.chosen.budget == budget and front.chosen.measured_temp_bytes <= budget
    chosen_key = front.chosen.candidate.key
    assert f"chosen for {budget / 2**20:.3f} MiB: {chosen_key}" in str(front)
    front.plot(tmp_path / "f.png")
    with pytest.raises(ValueError, match="below the smallest reachable"):
        jaxmem.plan(_rnn_loss, *RNN_ARGS, budget=0, known=trials, checkpoints=False)


def test_where_offload_is_measurable_it_joins_the_search_below_full_remat(monkeypatch, rnn_full):
    # CPU cannot measure offload (it is the identity there); pretend it can, to check the
    # search's offload branch: below full remat it tries offloading every name.
    from jaxmem._src.remat import planner as planner

    full = rnn_full
    assert any("offload not measurable here" in n for n in full.notes)
    monkeypatch.setattr(planner, "_offload_measurable", lambda: True)
    measured, measure = [], planner._Search.measure

    def recording(self, cand):
        measured.append(cand.key)
        return measure(self, cand)

    monkeypatch.setattr(planner._Search, "measure", recording)
    with pytest.raises(ValueError, match="below the smallest reachable") as e:
        jaxmem.plan(_rnn_loss, *RNN_ARGS, budget=1, presets=False, known=full.trials)
    assert "save nothing; offload mlp_act" in measured
    assert "save nothing; offload mlp_act; checkpoints sqrt" in measured
    assert "not measurable" not in str(e.value)


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
    p = jaxmem.RematPlan(recompute=frozenset({"mlp_act"}), checkpoints=4)
    with jaxmem.use_plan(p):
        inside = grad.lower(*RNN_ARGS).compile().memory_analysis().temp_size_in_bytes
        want = jax.grad(_rnn_stock)(*RNN_ARGS)
        np.testing.assert_allclose(grad(*RNN_ARGS), want, rtol=1e-5, atol=1e-5)
    assert inside < outside / 4


# ---------------------------------------------------------------------------------------------
# Bad input, and policy="auto" itself.


def test_bad_input():
    for bad in (-1, -0.5, "-1GB", "48 MiBs", "1.5.2GB", "", float("inf")):
        with pytest.raises(ValueError, match=r"^jaxmem.plan: budget=.* (is negative|is not a)"):
            jaxmem.plan(_rnn_loss, *RNN_ARGS, budget=bad)
    for bad in (True, None, [10**6]):
        with pytest.raises(TypeError, match="^jaxmem.plan: budget must be a byte size"):
            jaxmem.plan(_rnn_loss, *RNN_ARGS, budget=bad)
    with pytest.raises(ValueError, match="max_compiles=2; it needs at least 3"):
        jaxmem.plan(_rnn_loss, *RNN_ARGS, budget=10**6, max_compiles=2)
    with pytest.raises(ValueError, match="runs no scan and uses no checkpoint name"):
        jaxmem.plan(lambda w, xs: jnp.sum(jnp.tanh(xs @ w)), *RNN_ARGS, budget=10**6)
    with pytest.raises(ValueError, match="both saved and recomputed|in both save and recompute"):
        jaxmem.RematPlan(save=frozenset({"mlp_in"}), recompute=frozenset({"mlp_in"}))
    with pytest.raises(TypeError, match="must be a set of checkpoint names"):
        jaxmem.RematPlan(save="mlp_in")
    with pytest.raises(ValueError, match="unknown policy 'full'"):
        jaxmem.RematPlan(preset="full")
    with pytest.raises(TypeError, match="expected a jaxmem.RematPlan"):
        with jaxmem.use_plan(jaxmem.policies.nothing):
            pass


def test_plan_policy_is_a_name_policy():
    p = jaxmem.RematPlan(save=frozenset({"qkv_proj", "mlp_in"}), recompute=frozenset({"mlp_act"}))
    assert p.policy == jaxmem.policies.save("mlp_in", "qkv_proj")
    assert jaxmem.RematPlan(preset="dots").policy == jaxmem.policies.dots
    assert NO_REMAT.policy == jaxmem.policies.everything


def test_auto_outside_a_plan_warns_once_and_is_no_remat(monkeypatch):
    monkeypatch.setattr(checks, "_WARNED", checks._WARNED - {_auto.OUTSIDE_A_PLAN})

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

    assert prims(jaxmem.RematPlan(save=frozenset({"mlp_act"})))
    assert not prims(NO_REMAT)
