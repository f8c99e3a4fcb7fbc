"""The long-context models (plain JAX, Flax NNX) and ``benchmarks.long_context``, tiny shapes."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem
from benchmarks import long_context
from benchmarks.models import llama_long, llama_long_nnx

# A script's test: it runs on the newest set-up only (CI time; conftest.py).
pytestmark = pytest.mark.newest

CFG = llama_long.LlamaConfig(d_model=32, num_heads=2, vocab_size=64)
GQA = llama_long.LlamaConfig(d_model=32, num_heads=4, num_kv_heads=2, vocab_size=64)
S = 64

# Two lengths, every criterion's length among them; one timed round.
TINY = dataclasses.replace(long_context.QUICK, lengths=(64, 128), growth=(64, 128), repeats=1)
TINY = dataclasses.replace(TINY, fit_budget_length=64, fit_min_length=128, fit_max_length=256)
TINY = dataclasses.replace(TINY, time_length=64, grad_length=64)
# One length: every figure once, the fewest compiles.
ONE = dataclasses.replace(TINY, lengths=(64,), growth=(64, 64), fit_max_length=64)

TINY_ATTENTION = long_context.AttentionConfig(
    length=128, equal_length=128, head_dim=8, block=32, repeats=1, quick=True
)


def tokens(cfg=CFG, length=S):
    return jax.random.randint(jax.random.key(1), (1, length), 0, cfg.vocab_size, jnp.int32)


def rel(got, want):
    return long_context.grad_error(got, want)


def finite(tree):
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


def run(f, *args):
    """``jax.value_and_grad(f)(*args)``, compiled without LLVM optimization (seconds less)."""
    grad = jax.jit(jax.value_and_grad(f))
    return grad.lower(*args).compile(long_context.FAST_COMPILE)(*args)


def plain_grads(cfg, remat, params=None):
    params = llama_long.init(jax.random.key(0), cfg) if params is None else params
    return run(llama_long.make_loss(cfg, remat=remat), params, tokens(cfg))


def test_models_give_one_function_with_and_without_remat():
    # Grouped-query (K=2 of N=4); the benchmark's tests below run the models without it.
    f, state = llama_long_nnx.pure_loss(llama_long_nnx.Llama(GQA, rngs=nnx.Rngs(0)), remat=True)
    params = _plain_from_nnx(state)
    value, g = plain_grads(GQA, False, params)
    value_remat, g_remat = plain_grads(GQA, True, params)
    value_nnx, g_nnx = run(f, state, tokens(GQA))
    assert value.shape == () and value.dtype == jnp.float32
    # Near log(V) at initialization: a next-token loss over the whole vocabulary.
    assert abs(float(value) - np.log(GQA.vocab_size)) < 1.0
    assert finite(g) and max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g)) > 0
    assert abs(float(value_remat) - float(value)) <= 1e-6 * abs(float(value))
    assert rel(g_remat, g) <= 1e-6
    # The NNX model (under nnx.remat) is the plain one, weight for weight.
    assert abs(float(value_nnx) - float(value)) <= 1e-5 * abs(float(value))
    assert rel(_plain_from_nnx(g_nnx), g) <= 1e-5


def test_plain_parameters_have_the_issue_shapes():
    p = llama_long.abstract_params(GQA)
    L, D, F, V, NH, KH = 2, 32, 128, 64, 32, 16  # 4 heads and 2 kv heads of width 8
    want = {
        "embed": (V, D),
        "attn_norm": (L, D),
        "wq": (L, D, NH),
        "wk": (L, D, KH),
        "wv": (L, D, KH),
        "wo": (L, NH, D),
        "mlp_norm": (L, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
        "final_norm": (D,),
        "lm_head": (D, V),
    }
    assert {k: v.shape for k, v in p.items()} == want
    assert llama_long.DEFAULT == llama_long.LlamaConfig(
        num_layers=2, d_model=256, num_heads=4, num_kv_heads=4, d_ff=1024, vocab_size=2048
    )


def _plain_from_nnx(state):
    """The NNX model's parameters as the plain model's dict."""
    s = nnx.to_pure_dict(state)
    b = s["blocks"]
    return {
        "embed": s["embed"]["embedding"],
        "attn_norm": b["attn_norm"]["scale"],
        "wq": b["attn"]["wq"]["kernel"],
        "wk": b["attn"]["wk"]["kernel"],
        "wv": b["attn"]["wv"]["kernel"],
        "wo": b["attn"]["wo"]["kernel"],
        "mlp_norm": b["mlp_norm"]["scale"],
        "w_gate": b["mlp"]["gate"]["kernel"],
        "w_up": b["mlp"]["up"]["kernel"],
        "w_down": b["mlp"]["down"]["kernel"],
        "final_norm": s["final_norm"]["scale"],
        "lm_head": s["lm_head"]["kernel"],
    }


def test_bf16_option():
    cfg = llama_long.LlamaConfig(d_model=32, num_heads=2, vocab_size=64, dtype=jnp.bfloat16)
    value, g = plain_grads(cfg, remat=False)
    assert value.dtype == jnp.float32 and finite(g)
    assert {x.dtype for x in jax.tree.leaves(g)} == {jnp.dtype(jnp.bfloat16)}
    f, state = llama_long_nnx.abstract_state(cfg)  # the spread compiles it so; no run here
    value, g = jax.eval_shape(jax.value_and_grad(f), state, tokens(cfg))
    assert value.dtype == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(g)} == {jnp.dtype(jnp.bfloat16)}


def test_config_rejects_sizes_that_do_not_fit():
    with pytest.raises(ValueError, match="even head width"):
        llama_long.LlamaConfig(d_model=30, num_heads=2)
    with pytest.raises(ValueError, match="must divide"):
        llama_long.LlamaConfig(num_heads=4, num_kv_heads=3)


def test_a_failing_jaxmem_column_is_reported_and_fails_every_check(monkeypatch):
    # An optimize without chunk_tokens: the stock columns stand (their temps stubbed: no
    # compile), the jaxmem column reads n/a with the error's type, time and gradients are
    # skipped, every criterion FAILs.
    def refuse(loss):
        raise TypeError("optimize() got an unexpected keyword argument 'chunk_tokens'")

    measure_temp = long_context.measure_temp

    def stub(model, config, label, length):
        if label == long_context.JAXMEM:
            return measure_temp(model, config, label, length)
        return length * (2 if label == long_context.STOCK else 1)

    monkeypatch.setattr(long_context, "jaxmem_loss", refuse)
    monkeypatch.setattr(long_context, "measure_temp", stub)
    result = long_context.measure(long_context.MODELS["plain"], TINY)
    assert result.errors[long_context.JAXMEM].startswith("TypeError")
    assert result.temps[long_context.JAXMEM] == {64: None, 128: None}
    assert result.temp(long_context.STOCK, 128) == 256 and result.fit_budget == 128
    assert result.time is None and result.skipped.startswith("jaxmem n/a (TypeError")
    checks = long_context.check(result, TINY)
    assert [c.verdict for c in checks] == [long_context.FAIL] * 5
    assert all("jaxmem n/a (TypeError)" in c.detail for c in checks)
    assert "n/a (TypeError)" in long_context.format_result(result, TINY)


def test_attention_inputs_of_every_variant():
    shapes = {}
    for variant in long_context.VARIANTS:
        inputs = long_context.attention_inputs(variant, TINY_ATTENTION, 128)
        shapes[variant.name] = {k: None if x is None else x.shape for k, x in inputs.items()}
    assert shapes["GQA, causal"]["k"] == (1, 128, 2, 8) and shapes["causal"]["k"] == (1, 128, 4, 8)
    assert shapes["bool mask [B,N,T,S]"]["mask"] == (1, 4, 128, 128)
    assert shapes["bias [1,N,T,S]"]["bias"] == (1, 4, 128, 128)
    both = shapes["causal + mask + bias [B,1,T,S]"]
    assert both["bias"] == both["mask"] == (1, 1, 128, 128)
    assert shapes["causal"]["bias"] is None and shapes["causal"]["mask"] is None
    assert {x.dtype for x in inputs.values() if x is not None} == {
        jnp.dtype(jnp.float32),
        jnp.dtype(jnp.bool_),
    }


def test_attention_section_reports_an_error_as_a_failure(monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("broken")

    monkeypatch.setattr(jaxmem, "attention", broken)
    config = dataclasses.replace(TINY_ATTENTION, length=64, equal_length=64)
    result = long_context.measure_attention(config, long_context.VARIANTS[:1])
    (row,) = result.rows
    assert row.max_err is None and row.temps[long_context.JAXMEM] is None
    assert result.time is None and result.time_error == "ValueError: broken"
    checks = long_context.check_attention(result, config)
    assert [c.verdict for c in checks] == [long_context.FAIL] * 2
    assert "n/a (ValueError)" in checks[0].detail


def test_main_quick_models_and_attention(tmp_path, monkeypatch, capsys):
    # The plain model at one length (every figure once: the temps, the gradients, the timed
    # step) and the attention section (the variant with a mask, a bias and is_causal: the
    # gradients of the bias too), into the tables, the JSON, the plot and the exit status.
    monkeypatch.setattr(long_context, "QUICK", ONE)
    monkeypatch.setattr(long_context, "QUICK_ATTENTION", TINY_ATTENTION)
    monkeypatch.setattr(long_context, "VARIANTS", long_context.VARIANTS[4:])
    out, png = tmp_path / "lc.json", tmp_path / "lc.png"
    argv = ["--quick", "--model", "plain", "--json", str(out), "--plot", str(png)]
    status = long_context.main(argv)
    data = json.loads(out.read_text())
    assert data["jax_version"] == jax.__version__
    printed = capsys.readouterr().out
    assert f"jax {jax.__version__}" in printed and "step time at S=64" in printed
    (model,) = data["models"].values()
    temps = model["temps"]
    assert temps["stock"]["64"] > temps["stock full remat"]["64"] > 0 and temps["jaxmem"]["64"]
    assert model["fit_budget"] == temps["stock"]["64"] and not model["errors"]
    assert model["grad_err"] <= long_context.MAX_GRAD_ERR and model["value_err"] <= 1e-6
    assert model["time"]["ratio"] > 0 and model["time"]["grad_err"] <= long_context.MAX_GRAD_ERR
    assert len(model["time"]["samples_s"]["jaxmem"]) == ONE.repeats
    verdicts = {c["name"]: c["verdict"] for c in model["checks"]}
    assert len(verdicts) == 5
    assert verdicts["gradients at S=64: max|diff| / max|g| <= 1e-05"] == long_context.PASS
    assert verdicts["jaxmem temp(64) / temp(64) <= 4.5"] == long_context.PASS  # growth 1
    attention = data["attention"]
    (row,) = attention["rows"]
    assert row["variant"] == "causal + mask + bias [B,1,T,S]" and not row["errors"]
    assert set(row["grad_errs"]) == {"q", "k", "v", "bias"}
    assert max(row["value_err"], *row["grad_errs"].values()) <= long_context.ATTN_MAX_ERR
    assert 0 < row["temps"]["jaxmem"] < row["temps"]["stock"]
    assert attention["time"]["variant"] == row["variant"] and attention["time"]["ratio"] > 0
    assert attention["config"]["length"] == 128 and len(attention["checks"]) == 2
    assert attention["checks"][0]["verdict"] == long_context.PASS
    assert "jaxmem.attention against jax.nn.dot_product_attention" in printed
    every = [c["verdict"] for c in model["checks"] + attention["checks"]]
    assert data["passed"] == (long_context.FAIL not in every)
    assert status == (0 if data["passed"] else 1) and "spread" not in data
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 0


def test_main_spread_on_one_tiny_shape(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(long_context, "QUICK", TINY)
    shapes = long_context.spread_shapes(TINY, quick=True)
    assert [(s.model, s.timed) for s in shapes] == [("plain", True), ("nnx", False)]
    # The NNX model's shape, timed (the other tests time the plain one); no S past the table.
    config = dataclasses.replace(shapes[1].config, fit_max_length=128)
    shape = dataclasses.replace(shapes[1], config=config, timed=True)
    monkeypatch.setattr(long_context, "spread_shapes", lambda base, quick: (shape,))
    out = tmp_path / "spread.json"
    status = long_context.main(["--quick", "--spread", "--json", str(out)])
    data = json.loads(out.read_text())
    assert status == (0 if data["passed"] else 1)
    assert not data["models"] and "attention" not in data
    (row,) = data["spread"]
    assert row["shape"] == "B=2" and row["config"]["batch"] == 2 and row["timed"]
    # Only what the criteria read: stock at the budget, remat at the long length, jaxmem on
    # from the short one while it fits.
    temps = row["temps"]
    assert set(temps["stock"]) == {"64"} and set(temps["stock full remat"]) == {"128"}
    assert set(temps["jaxmem"]) == {"64", "128"}
    assert temps["stock"]["64"] > 0 and row["time"]["ratio"] > 0
    assert row["grad_err"] <= long_context.MAX_GRAD_ERR
    verdicts = [c["verdict"] for c in row["checks"]]
    assert len(verdicts) == 5  # timed: the memory criteria, the time and the gradients
    growth = temps["jaxmem"]["128"] / temps["jaxmem"]["64"]
    assert verdicts[0] == (long_context.PASS if growth <= 4.5 else long_context.FAIL)
    assert data["passed"] == (long_context.FAIL not in verdicts)
    printed = capsys.readouterr().out
    assert "shape spread" in printed and "nnx" in printed and "B=2" in printed


def test_spread_shapes_cover_the_issue_spread():
    shapes = long_context.spread_shapes(long_context.FULL)
    plain = {s.label: s for s in shapes if s.model == "plain"}
    assert {s.config.batch for s in plain.values()} == {1, 4}
    assert plain["D=512, 8 heads"].config.model.d_ff == 2048
    assert plain["GQA N=4, K=2"].config.model.num_kv_heads == 2
    assert plain["4 layers"].config.model.num_layers == 4
    assert plain["V=32000"].config.model.vocab_size == 32000
    assert plain["bf16"].config.model.dtype == jnp.bfloat16
    assert {label for label, s in plain.items() if s.timed} == {"B=4", "D=512, 8 heads"}
    assert sum(s.model == "nnx" for s in shapes) >= 2
    for s in shapes:
        assert s.config.lengths == (2048, 4096, 8192) and s.config.fit_max_length == 65536
        assert s.config.repeats >= 11
    plan = long_context.memory_plan(shapes[0].config)
    assert plan == {"stock": (2048,), "stock full remat": (8192,), "jaxmem": (2048, 4096, 8192)}
