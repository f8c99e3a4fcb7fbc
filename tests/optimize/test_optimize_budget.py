"""``jaxmem.optimize(train_step, budget=...)``: the compiled peak within the budget, the fewest
FLOPs among the framework's own policies that fit, outputs equal to the step as written.

The model is benchmarks.budget's plain-JAX GPT train step (``lax.scan`` over stacked layers,
``jax.checkpoint(nothing_saveable)`` on the body, ``value_and_grad`` and an SGD-momentum
update), at small shapes. The framework's own policies are the same step written with each
``jax.checkpoint_policies`` policy (or no remat), compiled by the test, not by jaxmem.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from benchmarks import budget as gpt
from jaxmem._src.optimize import budget as budget_mod

SIZES = gpt.Sizes(layers=3, d=64, seq=32, batch=4, heads=2, vocab=128)


def peak_and_flops(fn, args):
    peak, flops, _ = gpt.compiled_figures(fn, args)
    return peak, flops


def close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol * max(1.0, np.abs(y).max()))


@pytest.fixture(scope="module")
def model():
    args = gpt.make_args(SIZES)
    step = gpt.make_step(SIZES)
    policies = {}
    for label, policy in gpt.POLICIES.items():
        fn = gpt.make_step(SIZES, policy, remat=policy is not None)
        policies[label] = peak_and_flops(fn, args)
    want = jax.jit(step)(*args)
    return step, args, policies, want


@pytest.fixture(scope="module")
def trials(model):
    """Every setting's (peak, FLOPs), planned once at a budget every setting fits."""
    step, args, _, _ = model
    plan = jaxmem.optimize(step, budget=2**50).budget_plan(*args)
    return {t.key: (t.peak_bytes, t.flops) for t in plan.trials}


def budgets(policies, trials):
    lo = min(p for p, _ in policies.values())
    hi = policies["no remat"][0]
    lean = trials["lean, no remat"][0]
    return sorted({int(lo + (hi - lo) * f) for f in (0.0, 1 / 3, 2 / 3, 1.0)} | {int(lean * 1.01)})


def test_the_budget_bounds_the_compiled_peak_at_the_fewest_flops(model, trials):
    step, args, policies, want = model
    lean_peak, lean_flops = trials["lean, no remat"]
    no_remat_flops = policies["no remat"][1]
    assert lean_peak < policies["no remat"][0]  # jaxmem's lean step fits below stock's no remat
    assert lean_flops <= 1.01 * no_remat_flops
    programs = {}  # the chosen setting -> jax.jit(optimized)'s figures, compiled in full
    for b in budgets(policies, trials):
        opt = jaxmem.optimize(step, budget=b)
        key = opt.budget_plan(*args).chosen.key
        if key not in programs:
            programs[key] = (peak_and_flops(opt, args), jax.jit(opt)(*args))
        (peak, flops), out = programs[key]
        assert peak <= b, (b, opt.budget_plan(*args))
        fit = [f for p, f in policies.values() if p <= b]
        assert fit, b
        assert flops <= 1.01 * min(fit), (b, flops, fit)
        if lean_peak <= b:
            assert flops <= 1.01 * no_remat_flops, (b, flops)
        plan = opt.budget_plan(*args)
        assert plan.chosen.peak_bytes <= b and plan.budget_bytes == b
        close(out, want)


def test_planned_figures_are_those_of_the_full_compile(model, trials):
    """The plan compiles at XLA's fast backend level on CPU: the same peak and FLOPs."""
    step, args, policies, _ = model
    assert trials["as written"] == pytest.approx(policies["full remat (default)"], rel=1e-6)
    assert trials["lax.scan, no remat"] == pytest.approx(policies["no remat"], rel=1e-6)
    # lax.scan under a preset: the step re-evaluated, checkpointed with prevent_cse=False (as
    # inside a scan); no more memory or FLOPs than the framework's own jax.checkpoint.
    for key, own in (
        ("dots", "dots_saveable"),
        ("dots_no_batch", "dots_with_no_batch_dims_saveable"),
    ):
        (peak, flops), (own_peak, own_flops) = trials[f"lax.scan, {key}"], policies[own]
        assert peak <= own_peak and flops <= own_flops * (1 + 1e-6), (key, peak, own_peak)


def test_a_budget_only_the_function_as_written_fits_runs_it_unchanged(model, trials):
    step, args, _, want = model
    b = trials["as written"][0]
    tighter = [k for k, (p, _) in trials.items() if p < b]
    opt = jaxmem.optimize(step, budget=b)
    plan = opt.budget_plan(*args)
    assert plan.chosen.peak_bytes <= b
    if not tighter:
        assert plan.chosen.key in ("as written", "lean, own remat", "lax.scan, full remat")
    close(opt(*args), want)


def test_unreachable_budget_names_the_smallest_peak(model, trials):
    step, args, _, _ = model
    smallest = min(p for p, _ in trials.values())
    with pytest.raises(ValueError, match=r"below the smallest reachable peak, (\d+) bytes") as e:
        jaxmem.optimize(step, budget=smallest // 4)(*args)
    reached = int(str(e.value).split("reachable peak, ")[1].split(" ")[0])
    assert reached <= smallest  # checkpoints='sqrt' tried as the fallback
    assert "chunked loss" in str(e.value)


@pytest.mark.parametrize(
    "budget, want",
    [("48MiB", 48 * 2**20), ("1.5GB", 1_500_000_000), ("8GiB", 8 * 2**30), (5.2e7, 52_000_000)],
)
def test_budget_strings_and_floats(budget, want):
    opt = jaxmem.optimize(jnp.sin, budget=budget)
    assert opt._budget == want


@pytest.mark.parametrize("bad", [-1, "-1GB", "48 apples", float("nan")])
def test_bad_budget_raises_value_error(bad):
    with pytest.raises(ValueError, match=r"^jaxmem.optimize: budget=.* (is negative|is not a)"):
        jaxmem.optimize(jnp.sin, budget=bad)


def test_budget_option_errors():
    with pytest.raises(TypeError, match="budget="):
        jaxmem.optimize(jnp.sin, budget="1GiB", policy="dots")
    with pytest.raises(TypeError, match="budget="):
        jaxmem.optimize(jnp.sin, budget="1GiB", checkpoints="sqrt")
    with pytest.raises(TypeError, match="budget="):
        jaxmem.optimize(jnp.sin, objective="time")
    with pytest.raises(ValueError, match="objective"):
        jaxmem.optimize(jnp.sin, budget="1GiB", objective="memory")
    with pytest.raises(ValueError, match="budget_plan needs"):
        jaxmem.optimize(jnp.sin).budget_plan(jnp.ones(3))
    with pytest.raises(TypeError, match="^jaxmem.optimize: budget must be a byte size"):
        jaxmem.optimize(jnp.sin, budget=[1])
    deco = jaxmem.optimize(budget="1GiB")(jnp.sin)  # the decorator form
    assert deco._budget == 2**30


def test_plans_once_per_input_signature(monkeypatch):
    calls = []
    real = budget_mod.measure
    monkeypatch.setattr(budget_mod, "measure", lambda *a: calls.append(1) or real(*a))
    traces = []  # the trace that finds the steps' value names, once per signature too
    discover = budget_mod._flops_mod.discover
    monkeypatch.setattr(
        budget_mod._flops_mod, "discover", lambda *a: traces.append(1) or discover(*a)
    )

    def loss(w, xs):
        body = jax.checkpoint(lambda h, x: (jnp.tanh(h @ w + x), None))
        return jnp.sum(jax.lax.scan(body, jnp.zeros(8), xs)[0])

    grad = jax.grad(loss)
    step = jaxmem.optimize(grad, budget="1GiB")
    w = jnp.eye(8)
    g = step(w, jnp.ones((6, 8)))
    step(w, jnp.ones((6, 8)) * 2)  # same signature: planned once
    jax.jit(step)(w, jnp.ones((6, 8)))  # under jit, on tracers: the same plan
    assert len(calls) == 1
    step(w, jnp.ones((9, 8)))  # a new length
    assert len(calls) == 2
    step(w.astype(jnp.bfloat16), jnp.ones((9, 8), jnp.bfloat16))  # a new dtype
    assert len(calls) == 3
    again = jaxmem.optimize(grad, budget="2GiB")  # the same function and options
    again(w, jnp.ones((6, 8)))
    assert len(calls) == len(traces) == 3
    close(g, jax.grad(loss)(w, jnp.ones((6, 8))))


def test_settings_that_lower_to_one_program_compile_once(monkeypatch):
    compiled = []
    real = jax.stages.Lowered.compile
    monkeypatch.setattr(
        jax.stages.Lowered, "compile", lambda self, *a: compiled.append(1) or real(self, *a)
    )
    # Two settings run one program under two names (the module's name is the function's).
    run = {"a": jnp.sin, "b": lambda x: jnp.sin(x), "c": jnp.cos}.get
    spec = [jax.ShapeDtypeStruct((3,), jnp.float32)]
    a, b, c = budget_mod.compile_many(run, ["a", "b", "c"], spec, fast=False)
    assert len(compiled) == 2 and a is b and a is not c
    assert a.as_text() != c.as_text()


def test_planning_under_an_outer_jit(model):
    step, args, _, want = model
    b = model[2]["no remat"][0]
    opt = jaxmem.optimize(step, budget=b)
    close(jax.jit(opt)(*args), want)  # planned at the first trace, on tracers
    assert peak_and_flops(opt, args)[0] <= b


def rnn_step():
    def loss(w, xs):
        body = jax.checkpoint(lambda h, x: (jnp.tanh(h @ w + x), None))
        return jnp.sum(jax.lax.scan(body, jnp.zeros((4, 32)), xs)[0] ** 2)

    def step(w, xs):
        value, g = jax.value_and_grad(loss)(w, xs)
        return value, w - 0.1 * g

    return step, (jnp.eye(32) * 0.5, jnp.linspace(-1, 1, 16 * 4 * 32).reshape(16, 4, 32))


def test_objective_time_times_the_fitting_settings():
    step, args = rnn_step()
    b = 2 * jaxmem.optimize(step, budget=2**50).budget_plan(*args).as_written.peak_bytes
    opt = jaxmem.optimize(step, budget=b, objective="time")
    plan = opt.budget_plan(*args)
    fitting = [t for t in plan.trials if t.peak_bytes <= b]
    assert len(fitting) >= 2
    timed = [t for t in fitting if t.seconds is not None]
    assert len(timed) >= 2 and all(t.peak_bytes <= b for t in timed)
    assert plan.chosen.seconds is not None
    assert plan.chosen.seconds <= min(t.seconds for t in timed) * (1 + budget_mod._TIME_TIE)
    assert all(t.seconds is None for t in plan.trials if t.peak_bytes > b)
    close(opt(*args), step(*args))


def test_explain_shows_the_plan(model):
    step, args, policies, _ = model
    b = policies["no remat"][0]
    text = str(jaxmem.optimize(step, budget=b).explain(*args))
    assert f"budget {b / 2**20:.1f} MiB" in text
    assert "as written: peak" in text and "tried:" in text


def test_dropped_remat_keeps_the_values():
    """The step's own remat dropped (and a preset's applied) gives the same values: a remat
    inside a nested function of the step, its checkpoint names, a scan inside a scan."""

    def loss(w, xs):
        def inner(h, x):
            h = jax.checkpoint(lambda h: jnp.sin(h @ w) + x)(h)
            return h, jnp.sum(h)

        def outer(h, x):
            h, s = jax.lax.scan(inner, h, x)
            return h, s

        body = jax.checkpoint(outer, policy=jax.checkpoint_policies.nothing_saveable)
        h, ys = jax.lax.scan(body, jnp.zeros(4), xs)
        return jnp.sum(h) + jnp.sum(ys**2)

    w, xs = jnp.eye(4) * 0.7, jnp.linspace(-1, 1, 5 * 3 * 4).reshape(5, 3, 4)
    want = jax.value_and_grad(loss)(w, xs)
    opt = jaxmem.optimize(jax.value_and_grad(loss))
    for setting in budget_mod.settings() + budget_mod.fallbacks():
        got = jax.jit(lambda w, xs, s=setting: opt._run(s, (w, xs), {})[0])(w, xs)
        close(got, jax.tree.leaves(want))


def test_plan_on_unmodified_code_names_values_by_op_kind():
    """``jaxmem.plan`` on a loss that names nothing and runs ``lax.scan`` without remat: its
    measured temp fits a budget between full remat's and jaxmem's lean gradient temps, and
    ``optimize(loss, plan=p)`` compiles to that temp with the loss's own gradient."""
    from benchmarks import optimize as gpt_loss

    sizes = gpt_loss.Sizes(layers=2, batch=2, seq=16, d=32, heads=2)
    loss, args = gpt_loss.make_loss(sizes, jax.lax.scan), gpt_loss.make_args(sizes)

    def temp(f):
        compiled = jax.jit(jax.grad(f)).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full, lean = temp(jaxmem.optimize(loss, policy="nothing")), temp(jaxmem.optimize(loss))
    assert full < lean < temp(loss)
    b = (full + lean) // 2
    p = jaxmem.plan(loss, *args, budget=b, max_compiles=8)
    assert p.op_names and p.measured_temp_bytes <= b
    assert any("matmul_" in key for key, _, _ in p.trials), p.trials  # op-kind names tried
    assert not p.no_remat, p  # below jaxmem's lean temp, something is recomputed
    opt = jaxmem.optimize(loss, plan=p)
    assert temp(opt) == p.measured_temp_bytes
    close(jax.grad(opt)(*args), jax.grad(loss)(*args))
    assert jaxmem.RematPlan.from_json(p.to_json()) == p
    with pytest.raises(TypeError, match="plan="):
        jaxmem.optimize(loss, plan=p, budget="1GiB")
    with pytest.raises(TypeError, match="plan must be a jaxmem.RematPlan"):
        jaxmem.optimize(loss, plan="dots")


def test_op_kind_names_reach_inside_softmax():
    """The values of ``jax.nn.softmax`` (a custom_jvp call from jax 0.12.1, written out before)
    are named by op kind on every version, and the named loss keeps the loss's gradient."""
    from jaxmem._src.optimize.api import by_op_kind
    from jaxmem._src.remat.flops import discover

    def loss(w, xs):
        def step(h, x):
            return jnp.tanh(jax.nn.softmax(h @ w + x, axis=-1)), None

        return jnp.sum(jax.lax.scan(step, jnp.zeros((2, 8)), xs)[0] ** 2)

    w, xs = jnp.eye(8) * 0.5, jnp.linspace(-1, 1, 4 * 2 * 8).reshape(4, 2, 8)
    names = {n.name for n in discover(by_op_kind(loss), (w, xs))}
    assert {"matmul_0", "exponential_0", "activation_0"} <= names, names
    with jaxmem.use_plan(jaxmem.RematPlan(no_remat=True)):
        close(jax.grad(by_op_kind(loss))(w, xs), jax.grad(loss)(w, xs))


def test_equinox_train_step_fits_a_budget_at_fewer_flops():
    """An Equinox stack as its users write it (``eqx.filter_vmap`` init, ``lax.scan`` over
    ``eqx.filter_checkpoint``, ``eqx.filter_value_and_grad`` and an update): under a budget
    between the step's own peak and no remat's, the compiled peak fits at fewer FLOPs, the
    outputs the step's."""
    eqx = pytest.importorskip("equinox")
    layers, d = 4, 64
    keys = jax.random.split(jax.random.key(0), layers)
    make = lambda k: eqx.nn.MLP(d, d, 4 * d, 1, activation=jax.nn.gelu, key=k)
    stack = eqx.filter_vmap(make)(keys)
    params, static = eqx.partition(stack, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (16, 32, d))

    def make_step(remat):
        def loss(params, x):
            def body(h, p):
                mlp = eqx.combine(p, static)
                return h + jax.vmap(jax.vmap(mlp))(h), None

            body = eqx.filter_checkpoint(body) if remat else body
            h, _ = jax.lax.scan(body, x, params)
            return jnp.mean(h**2)

        def step(params, x):
            value, grads = eqx.filter_value_and_grad(loss)(params, x)
            return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

        return step

    step = make_step(remat=True)
    (own_peak, own_flops), (none_peak, none_flops) = (
        peak_and_flops(step, (params, x)),
        peak_and_flops(make_step(False), (params, x)),
    )
    assert own_peak < none_peak and none_flops < own_flops
    budget = (own_peak + none_peak) // 2
    opt = jaxmem.optimize(step, budget=budget)
    peak, flops = peak_and_flops(opt, (params, x))
    assert peak <= budget and flops < own_flops, (peak, budget, flops, own_flops)
    close(jax.jit(opt)(params, x), jax.jit(step)(params, x))


def test_offload_settings_where_the_backend_measures_offload(monkeypatch):
    """Where host offload changes the device peak (not on CPU), the fallbacks offload the lean
    scans' residuals or carries; their values are the step's (on CPU offload is the identity)."""
    from jaxmem._src.remat import planner

    assert not any(s.offload for s in budget_mod.fallbacks()) or planner.offload_measurable()
    monkeypatch.setattr(planner, "offload_measurable", lambda: True)
    offloaded = [s for s in budget_mod.fallbacks() if s.offload]
    assert {s.offload for s in offloaded} == {"residuals", "carries"}
    assert [s.key for s in offloaded] == [
        "lean, no remat, offload=residuals",
        "lean, no remat, checkpoints=sqrt, offload=carries",
    ]
    step, args = rnn_step()
    opt = jaxmem.optimize(step)
    want = jax.tree.leaves(step(*args))
    for setting in offloaded:
        close(jax.jit(lambda *a, s=setting: opt._run(s, a, {})[0])(*args), want)


def test_named_values_match_a_frameworks_name_based_policies():
    """A step whose layers name values (``checkpoint_name``, as MaxText's do) under full remat:
    at each name-based policy's peak (``save_only_these_names`` / ``save_any_names_but_these``)
    the plan's FLOPs are within 1.01x the fewest among those that fit."""
    from jax.ad_checkpoint import checkpoint_name as cn

    d, h = SIZES.d, SIZES.heads

    def make(policy):
        def block(x, p):
            b, t, _ = x.shape
            q, k, v = jnp.split(cn(gpt._norm(x, p["g1"]) @ p["qkv"], "qkv"), 3, -1)
            split = lambda a: a.reshape(b, t, h, d // h)
            s = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / (d // h) ** 0.5
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None, None], s, -1e9)
            a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), split(v)).reshape(b, t, d)
            x = x + cn(a @ p["o"], "out_proj")
            u = cn(gpt._norm(x, p["g2"]) @ p["up"], "mlpwi")
            return x + cn(jax.nn.gelu(u) @ p["down"], "mlpwo")

        body = jax.checkpoint(lambda x, p: (block(x, p), None), policy=policy)

        def loss(params, tokens):
            x, _ = jax.lax.scan(body, params["emb"][tokens], params["blocks"])
            logp = jax.nn.log_softmax(x @ params["emb"].T)
            return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1))

        def step(params, m, tokens):
            value, g = jax.value_and_grad(loss)(params, tokens)
            m = jax.tree.map(lambda m, g: 0.9 * m + g, m, g)
            return value, jax.tree.map(lambda p, m: p - 1e-2 * m, params, m), m

        return step

    cp = jax.checkpoint_policies
    own = [
        cp.nothing_saveable,
        cp.save_only_these_names("out_proj"),
        cp.save_only_these_names("qkv", "out_proj"),
        cp.save_any_names_but_these("mlpwi", "mlpwo"),
        cp.save_only_these_names("qkv", "out_proj", "mlpwi", "mlpwo"),
    ]
    args = gpt.make_args(SIZES)
    figures = [peak_and_flops(make(p), args) for p in own]
    step = make(cp.nothing_saveable)
    for b, _ in figures:
        plan = jaxmem.optimize(step, budget=b).budget_plan(*args)
        least = min(f for p, f in figures if p <= b)
        assert plan.chosen.peak_bytes <= b and plan.chosen.flops <= 1.01 * least, (b, plan)
    keys = [t.key for t in plan.trials]
    assert {f"lax.scan, save {n}" for n in ("qkv", "out_proj", "mlpwi", "mlpwo")} <= set(keys)
    assert any(k.startswith("lax.scan, save ") and "," in k for k in keys), keys  # prefixes
    close(jax.jit(jaxmem.optimize(step, budget=figures[2][0]))(*args), jax.jit(step)(*args))


def two_stacks():
    """A step over two scanned stacks under full remat, one wide in the batch (its residuals
    large, its recompute cheap), one wide in the features (the other way round)."""

    def loss(wa, wb, xa, xb):
        fa = jax.checkpoint(lambda h, x: (jnp.tanh(jnp.tanh(h @ wa + x) @ wa), None))
        fb = jax.checkpoint(lambda h, x: (jnp.tanh(jnp.tanh(h @ wb + x) @ wb), None))
        ha, _ = jax.lax.scan(fa, jnp.zeros((256, 64)), xa)
        hb, _ = jax.lax.scan(fb, jnp.zeros((4, 512)), xb)
        return jnp.sum(ha**2) + jnp.sum(hb**2)

    def step(wa, wb, xa, xb):
        value, (ga, gb) = jax.value_and_grad(loss, (0, 1))(wa, wb, xa, xb)
        return value, wa - 0.1 * ga, wb - 0.1 * gb

    xa = jnp.linspace(-0.1, 0.1, 64 * 256 * 64).reshape(64, 256, 64)
    xb = jnp.linspace(-0.1, 0.1, 64 * 4 * 512).reshape(64, 4, 512)
    return step, (jnp.eye(64) * 0.5, jnp.eye(512) * 0.5, xa, xb)


def test_scans_at_two_call_sites_get_a_setting_each():
    """Where one setting for both stacks fits only with both recomputed, the plan keeps the
    cheap stack's values and recomputes the other's: fewer FLOPs than every uniform setting
    that fits, within the budget, the outputs the step's."""
    step, args = two_stacks()
    own_peak, own_flops = peak_and_flops(step, args)
    budget = own_peak + 2 * 2**20
    opt = jaxmem.optimize(step, budget=budget)
    plan = opt.budget_plan(*args)
    assert "; other scans: " in plan.chosen.key, plan.chosen.key  # a setting per call site
    uniform = [t for t in plan.trials if ";" not in t.key and t.peak_bytes <= budget]
    peak, flops = peak_and_flops(opt, args)
    assert peak <= budget and flops < min(t.flops for t in uniform) < 1.01 * own_flops
    close(jax.jit(opt)(*args), jax.jit(step)(*args))
    # explain names each scan's own setting.
    why = {r.source.split()[0].rsplit("/", 1)[-1]: r.why for r in opt.explain(*args).scans}
    assert len(why) == 2 and len(set(why.values())) == 2, why


def test_one_call_site_adds_no_settings():
    step, args = rnn_step()
    plan = jaxmem.optimize(step, budget=2**40).budget_plan(*args)
    assert not any(";" in t.key for t in plan.trials)


@pytest.mark.parametrize("wrap", [jax.jit, jax.checkpoint], ids=["jit", "checkpoint"])
def test_the_budget_reaches_scans_in_a_jit_or_checkpoint_the_step_differentiates(wrap):
    """The loss's scan inside a ``jax.jit`` or a ``jax.checkpoint``: its remat is dropped where a
    setting says (fewer FLOPs than as written), and the copy of the loop JAX binds again under
    the checkpoint is no call site of its own."""

    def loss(w, xs):
        @wrap
        def inner(w, xs):
            body = jax.checkpoint(lambda h, x: (jnp.tanh(jnp.tanh(h @ w + x) @ w), None))
            return jnp.sum(jax.lax.scan(body, jnp.zeros((8, 32)), xs)[0] ** 2)

        return inner(w, xs)

    def step(w, xs):
        value, g = jax.value_and_grad(loss)(w, xs)
        return value, w - 0.1 * g

    args = (jnp.eye(32) * 0.5, jnp.linspace(-0.1, 0.1, 16 * 8 * 32).reshape(16, 8, 32))
    opt = jaxmem.optimize(step, budget=2**40)
    plan = opt.budget_plan(*args)
    assert plan.chosen.flops < plan.as_written.flops
    assert not any(";" in t.key for t in plan.trials)
    close(jax.jit(opt)(*args), jax.jit(step)(*args))
