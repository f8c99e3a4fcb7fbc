"""optimize(fn, chunk_tokens=True) on unmodified long-context models: the Llama-like decoder of
benchmarks.models in plain JAX and in Flax NNX, a train step that differentiates inside, and
Flax's nnx.MultiHeadAttention. Gradients equal stock's (f32, 1e-5 of the largest); what was
swapped and chunked is listed by explain and present in the program; the gradient's temp grows
linearly in the sequence length where stock's grows quadratically. The chunk threshold is
lowered so that these small models chunk (the library's default, 4 MiB, is for real sizes)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from benchmarks.models import llama_long
from jaxmem._src.chunking import tokens as _tokens
from tests.helpers import assert_trees_close

RTOL = 1e-5
CFG = llama_long.LlamaConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, vocab_size=64)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(_tokens, "DEFAULT_CHUNK_BYTES", 4096)


def _tokens_of(s, b=1, cfg=CFG):
    return jax.random.randint(jax.random.key(1), (b, s), 0, cfg.vocab_size)


def _params(cfg=CFG):
    return llama_long.init(jax.random.key(0), cfg)


@pytest.mark.parametrize("remat", [False, True])
def test_plain_llama_gradients_equal_stock(remat):
    loss = llama_long.make_loss(CFG, remat=remat)
    params, tokens = _params(), _tokens_of(64)
    opt = jaxmem.optimize(loss, chunk_tokens=True)
    got = jax.jit(jax.value_and_grad(opt))(params, tokens)
    assert_trees_close(got, jax.jit(jax.value_and_grad(loss))(params, tokens), rtol=RTOL)
    text = str(opt.explain(params, tokens))
    assert "attention at" in text and "blocked (64 x 64)" in text, text
    assert text.count("chunked: ") >= 2, text  # in the layer, and the head's loss


def test_the_gradient_holds_no_logits():
    """At S = 2048 (blocks of 512) the gradient's temp is under one [N, S, S] float32 array,
    stock's over several."""
    params = llama_long.abstract_params(CFG)
    loss = llama_long.make_loss(CFG)
    logits = CFG.num_heads * 2048 * 2048 * 4
    ours = _temp(jaxmem.optimize(loss, chunk_tokens=True), params, 2048)
    assert ours < logits < _temp(loss, params, 2048)


def test_nnx_llama_gradients_equal_stock():
    from flax import nnx

    from benchmarks.models import llama_long_nnx

    model = llama_long_nnx.Llama(CFG, rngs=nnx.Rngs(0))
    loss, state = llama_long_nnx.pure_loss(model)
    tokens = _tokens_of(64)
    opt = jaxmem.optimize(loss, chunk_tokens=True)
    got = jax.jit(jax.grad(opt))(state, tokens)
    assert_trees_close(got, jax.jit(jax.grad(loss))(state, tokens), rtol=RTOL)
    text = str(opt.explain(state, tokens))
    assert "blocked (64 x 64)" in text and "chunked: " in text, text


def _step(loss):
    def step(params, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


def test_train_step_that_differentiates_inside():
    """The step's own value_and_grad differentiates its loss as optimize runs it: a program no
    larger than a step written around optimize(loss), its loss head chunked."""
    loss = llama_long.make_loss(CFG)
    params, tokens = _params(), _tokens_of(128)
    step = _step(loss)
    opt = jaxmem.optimize(step, chunk_tokens=True)
    assert_trees_close(jax.jit(opt)(params, tokens), jax.jit(step)(params, tokens), rtol=RTOL)
    text = str(opt.explain(params, tokens))
    assert "blocked (128 x 128)" in text and text.count("chunked: ") >= 2, text
    around = _step(jaxmem.optimize(loss, chunk_tokens=True))
    temp = lambda f: jax.jit(f).lower(params, tokens).compile().memory_analysis()
    assert temp(opt).temp_size_in_bytes <= temp(around).temp_size_in_bytes
    assert temp(opt).temp_size_in_bytes < temp(step).temp_size_in_bytes


def test_forward_mode_and_vmap():
    loss = llama_long.make_loss(CFG)
    params, tokens = _params(), _tokens_of(32)
    opt = jaxmem.optimize(loss, chunk_tokens=True)
    tangent = jax.tree.map(lambda p: 0.1 * jnp.ones_like(p), params)
    jvp = lambda f: jax.jit(lambda p, t: jax.jvp(lambda p: f(p, tokens), (p,), (t,)))
    assert_trees_close(jvp(opt)(params, tangent), jvp(loss)(params, tangent), rtol=RTOL)
    batch = _tokens_of(32, b=3)[:, None]
    batched = lambda f: jax.jit(jax.vmap(jax.grad(f), (None, 0)))
    assert_trees_close(batched(opt)(params, batch), batched(loss)(params, batch), rtol=RTOL)


def test_flax_multi_head_attention():
    from flax import nnx

    mha = nnx.MultiHeadAttention(4, 32, qkv_features=32, decode=False, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(mha)
    x = jax.random.normal(jax.random.key(2), (2, 40, 32))

    def loss(state, x):
        m = nnx.merge(graphdef, state)
        return jnp.mean(m(x, mask=nnx.make_causal_mask(x[..., 0])) ** 2)

    opt = jaxmem.optimize(loss, chunk_tokens=True)
    got, want = jax.grad(opt)(state, x), jax.grad(loss)(state, x)
    # The key bias's true gradient is zero (softmax is shift-invariant): both are rounding
    # noise near 1e-9, so every leaf is compared at 1e-5 of the largest gradient of all.
    largest = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= RTOL * largest
    assert "blocked (40 x 40)" in str(opt.explain(state, x))


def test_nothing_to_chunk_without_attention():
    f = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
    w, x = jnp.ones((8, 8)), jnp.ones((64, 8))
    opt = jaxmem.optimize(f, chunk_tokens=True)
    with pytest.warns(jaxmem.LintWarning, match="option_noop: chunk_tokens=True found no") as got:
        grads = jax.grad(opt)(w, x)
    assert got[0].filename == __file__  # the user's line
    assert_trees_close(grads, jax.grad(f)(w, x), rtol=RTOL)
    assert "no jax.nn.dot_product_attention call" in str(opt.explain(w, x))


def test_attention_written_by_hand_is_warned_not_chunked():
    """The known gap (docs/long_context.md): einsum-softmax-einsum attention is not recognised;
    the user is told, and the values are stock's."""

    def f(q, k, v):
        logits = jnp.einsum("btnh,bsnh->bnts", q, k) / 4.0
        return jnp.sum(jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v) ** 2)

    q = k = v = jax.random.normal(jax.random.key(0), (1, 32, 2, 16))
    with pytest.warns(jaxmem.LintWarning, match="option_noop: chunk_tokens=True"):
        grads = jax.grad(jaxmem.optimize(f, chunk_tokens=True), (0, 1, 2))(q, k, v)
    assert_trees_close(grads, jax.grad(f, (0, 1, 2))(q, k, v), rtol=RTOL)


def test_attention_through_jax_nn_is_not_warned():
    def f(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)

    q = k = v = jax.random.normal(jax.random.key(0), (1, 32, 2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmem.LintWarning)
        jax.grad(jaxmem.optimize(f, chunk_tokens=True))(q, k, v)


def test_chunk_tokens_must_be_a_bool():
    with pytest.raises(TypeError, match="jaxmem.optimize: chunk_tokens must be True or False"):
        jaxmem.optimize(lambda x: x, chunk_tokens="yes")


def _temp(loss, params, s):
    tokens = jax.ShapeDtypeStruct((1, s), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_temp_grows_linearly_with_the_sequence():
    """4x the tokens: at most 4.5x the gradient's temp (stock: quadratic, over 8x), and below
    stock's with full remat (benchmarks.long_context measures the issue's sizes)."""
    cfg = llama_long.LlamaConfig(num_layers=2, d_model=64, num_heads=4, vocab_size=256)
    params = llama_long.abstract_params(cfg)
    ours = jaxmem.optimize(llama_long.make_loss(cfg), chunk_tokens=True)
    stock = llama_long.make_loss(cfg)
    remat = llama_long.make_loss(cfg, remat=True)
    temps = {n: [_temp(f, params, s) for s in (512, 2048)] for n, f in
             (("ours", ours), ("stock", stock), ("remat", remat))}  # fmt: skip
    growth = {n: b / a for n, (a, b) in temps.items()}
    assert growth["ours"] <= 4.5 < 8 < growth["stock"], (growth, temps)
    assert temps["ours"][1] < 0.25 * temps["remat"][1], temps
