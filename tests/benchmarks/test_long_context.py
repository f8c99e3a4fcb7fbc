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

CFG = llama_long.LlamaConfig(d_model=32, num_heads=2, vocab_size=64)
GQA = llama_long.LlamaConfig(d_model=32, num_heads=4, num_kv_heads=2, vocab_size=64)
S = 64

# Two lengths, every criterion's length among them; one timed round.
TINY = dataclasses.replace(long_context.QUICK, lengths=(64, 128), growth=(64, 128), repeats=1)
TINY = dataclasses.replace(TINY, fit_budget_length=64, fit_min_length=128, fit_max_length=256)
TINY = dataclasses.replace(TINY, time_length=64, grad_length=64)


def tokens(cfg=CFG, length=S):
    return jax.random.randint(jax.random.key(1), (1, length), 0, cfg.vocab_size, jnp.int32)


def rel(got, want):
    return long_context.grad_error(got, want)


def finite(tree):
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


def plain_grads(cfg, remat):
    params = llama_long.init(jax.random.key(0), cfg)
    return jax.jit(jax.value_and_grad(llama_long.make_loss(cfg, remat=remat)))(params, tokens(cfg))


def nnx_grads(cfg, remat):
    f, state = llama_long_nnx.pure_loss(llama_long_nnx.Llama(cfg, rngs=nnx.Rngs(0)), remat=remat)
    return jax.jit(jax.value_and_grad(f))(state, tokens(cfg))


@pytest.mark.parametrize("cfg", [CFG, GQA], ids=["mha", "gqa"])
@pytest.mark.parametrize("grads", [plain_grads, nnx_grads], ids=["plain", "nnx"])
def test_loss_and_gradients_are_finite_and_remat_changes_nothing(grads, cfg):
    value, g = grads(cfg, remat=False)
    value_remat, g_remat = grads(cfg, remat=True)
    assert value.shape == () and value.dtype == jnp.float32
    # Near log(V) at initialization: a next-token loss over the whole vocabulary.
    assert abs(float(value) - np.log(cfg.vocab_size)) < 1.0
    assert finite(g) and max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g)) > 0
    assert abs(float(value_remat) - float(value)) <= 1e-6 * abs(float(value))
    assert rel(g_remat, g) <= 1e-6


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


def test_nnx_and_plain_models_are_the_same_function():
    f, state = llama_long_nnx.pure_loss(llama_long_nnx.Llama(GQA, rngs=nnx.Rngs(0)))
    params = _plain_from_nnx(state)
    value, g = jax.jit(jax.value_and_grad(f))(state, tokens(GQA))
    want, g_plain = jax.jit(jax.value_and_grad(llama_long.make_loss(GQA)))(params, tokens(GQA))
    assert abs(float(value) - float(want)) <= 1e-5 * abs(float(want))
    assert rel(_plain_from_nnx(g), g_plain) <= 1e-5


def test_bf16_option():
    cfg = llama_long.LlamaConfig(d_model=32, num_heads=2, vocab_size=64, dtype=jnp.bfloat16)
    value, g = plain_grads(cfg, remat=False)
    assert value.dtype == jnp.float32 and finite(g)
    assert {x.dtype for x in jax.tree.leaves(g)} == {jnp.dtype(jnp.bfloat16)}
    value, g = nnx_grads(cfg, remat=False)
    assert value.dtype == jnp.float32 and finite(g)
    assert {x.dtype for x in jax.tree.leaves(g)} == {jnp.dtype(jnp.bfloat16)}


def test_config_rejects_sizes_that_do_not_fit():
    with pytest.raises(ValueError, match="even head width"):
        llama_long.LlamaConfig(d_model=30, num_heads=2)
    with pytest.raises(ValueError, match="must divide"):
        llama_long.LlamaConfig(num_heads=4, num_kv_heads=3)


@pytest.mark.parametrize("key", ["plain", "nnx"])
def test_measure_runs_on_tiny_shapes(key):
    result = long_context.measure(long_context.MODELS[key], TINY)
    for label in (long_context.STOCK, long_context.REMAT):
        assert label not in result.errors
        assert all(result.temp(label, n) > 0 for n in TINY.lengths)
    assert result.temp(long_context.REMAT, 128) < result.temp(long_context.STOCK, 128)
    assert result.fit_budget == result.temp(long_context.STOCK, 64)
    assert result.longest_fit(long_context.STOCK, 64) == 64
    checks = long_context.check(result, TINY)
    assert len(checks) == 5
    if long_context.chunk_tokens_available():
        assert long_context.JAXMEM not in result.errors
        assert result.grad_err <= long_context.MAX_GRAD_ERR
        assert result.time is not None and result.time["ratio"] > 0
    else:  # the API is absent: the column says so, the stock columns stand, the checks fail
        assert result.errors[long_context.JAXMEM].startswith("TypeError")
        assert result.temp(long_context.JAXMEM, 64) is None and result.time is None
        assert all(c.verdict == long_context.FAIL for c in checks)
    text = long_context.format_result(result, TINY)
    assert "stock full remat" in text and "growth temp(128) / temp(64)" in text


@pytest.mark.parametrize("key", ["plain", "nnx"])
def test_time_and_gradients_against_stock(key, monkeypatch):
    # Every figure of the jaxmem column, measured with optimize as it is today (without
    # chunk_tokens), so that the timing, gradient and fit paths run whatever the API's state.
    monkeypatch.setattr(long_context, "jaxmem_loss", jaxmem.optimize)
    result = long_context.measure(long_context.MODELS[key], TINY)
    assert not result.errors
    assert result.grad_err <= 1e-5 and result.value_err <= 1e-6
    assert result.time["ratio"] > 0 and result.time["grad_err"] <= 1e-5
    assert len(result.time["samples_s"][long_context.JAXMEM]) == TINY.repeats
    assert 0 < result.growth(long_context.JAXMEM, 64, 128)
    verdicts = {c.name: c.verdict for c in long_context.check(result, TINY)}
    assert verdicts["gradients at S=64: max|diff| / max|g| <= 1e-05"] == long_context.PASS


def test_main_quick_writes_json_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(long_context, "QUICK", TINY)
    out, png = tmp_path / "lc.json", tmp_path / "lc.png"
    argv = ["--quick", "--model", "plain", "--json", str(out), "--plot", str(png)]
    status = long_context.main(argv)
    data = json.loads(out.read_text())
    assert status == (0 if data["passed"] else 1)
    assert data["jax_version"] == jax.__version__
    printed = capsys.readouterr().out
    assert f"jax {jax.__version__}" in printed and ("PASS" in printed or "FAIL" in printed)
    (model,) = data["models"].values()
    assert model["temps"]["stock"]["64"] > 0
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 0
