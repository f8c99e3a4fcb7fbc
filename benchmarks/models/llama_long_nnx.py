"""The long-context Llama-like decoder in Flax NNX, written the way NNX users write it.

The same model as :mod:`benchmarks.models.llama_long` (same :class:`LlamaConfig`, RoPE tables
and next-token loss), as ``nnx.Module`` classes: ``nnx.Embed``, ``nnx.Linear(use_bias=False)``
for every projection and the untied head, ``nnx.RMSNorm``, causal attention through
``jax.nn.dot_product_attention(q, k, v, is_causal=True)`` and a SwiGLU MLP. The layers are
created with ``nnx.vmap`` over a split of the rngs and run with ``nnx.scan`` (Flax's "scan over
layers" pattern); ``remat=True`` runs each layer through ``nnx.remat(...,
policy=jax.checkpoint_policies.nothing_saveable)``.

:func:`loss` takes the module; :func:`pure_loss` gives a function of ``(state, tokens)`` (the
module split with ``nnx.split``, merged back inside) for :func:`jax.grad` and
``jaxmem.optimize``. The jaxmem library never imports this module.

Examples:
  >>> import jax
  >>> from flax import nnx
  >>> cfg = LlamaConfig(d_model=32, num_heads=2, vocab_size=64)
  >>> model = Llama(cfg, rngs=nnx.Rngs(0))
  >>> tokens = jax.random.randint(jax.random.key(1), (1, 16), 0, cfg.vocab_size)
  >>> loss(model, tokens).shape
  ()
  >>> f, state = pure_loss(model)
  >>> grads = jax.grad(f)(state, tokens)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.models.llama_long import (
    DEFAULT,
    LlamaConfig,
    apply_rope,
    next_token_loss,
    rope_tables,
)


def _linear(cfg: LlamaConfig, n_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        n_in, n_out, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs
    )


def _norm(cfg: LlamaConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(
        cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs
    )


class Attention(nnx.Module):
    """Causal self-attention with RoPE; grouped-query when ``num_kv_heads < num_heads``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, H = cfg.d_model, cfg.head_dim
        self.wq = _linear(cfg, D, cfg.num_heads * H, rngs)
        self.wk = _linear(cfg, D, cfg.num_kv_heads * H, rngs)
        self.wv = _linear(cfg, D, cfg.num_kv_heads * H, rngs)
        self.wo = _linear(cfg, cfg.num_heads * H, D, rngs)

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
        B, S, _ = x.shape
        N, K, H = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        q = apply_rope(self.wq(x).reshape(B, S, N, H), sin, cos)
        k = apply_rope(self.wk(x).reshape(B, S, K, H), sin, cos)
        v = self.wv(x).reshape(B, S, K, H)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.reshape(B, S, N * H))


class Mlp(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.gate = _linear(cfg, cfg.d_model, cfg.d_ff, rngs)
        self.up = _linear(cfg, cfg.d_model, cfg.d_ff, rngs)
        self.down = _linear(cfg, cfg.d_ff, cfg.d_model, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """A pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.attn_norm = _norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = _norm(cfg, rngs)
        self.mlp = Mlp(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), sin, cos)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    """Embedding, ``num_layers`` blocks stacked with ``nnx.vmap`` and scanned with ``nnx.scan``,
    a final RMSNorm and an untied head."""

    def __init__(self, cfg: LlamaConfig = DEFAULT, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs
        )

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = create_block(rngs)
        self.final_norm = _norm(cfg, rngs)
        self.lm_head = _linear(cfg, cfg.d_model, cfg.vocab_size, rngs)

    def __call__(self, tokens: jax.Array, *, remat: bool = False) -> jax.Array:
        """The logits ``[B, S, V]`` of ``tokens [B, S]``; ``remat``: full remat of each layer."""
        x = self.embed(tokens)
        positions = jnp.arange(tokens.shape[1])
        sin, cos = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)

        def apply(block: Block, x: jax.Array) -> jax.Array:
            return block(x, sin, cos)

        if remat:
            apply = nnx.remat(apply, policy=jax.checkpoint_policies.nothing_saveable)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x: jax.Array, block: Block) -> jax.Array:
            return apply(block, x)

        x = forward(x, self.blocks)
        return self.lm_head(self.final_norm(x))


def loss(model: Llama, tokens: jax.Array, *, remat: bool = False) -> jax.Array:
    """Mean next-token cross-entropy of ``tokens [B, S]`` (int32), in float32."""
    return next_token_loss(model(tokens, remat=remat), tokens)


def pure_loss(
    model: Llama, *, remat: bool = False
) -> tuple[Callable[[nnx.State, jax.Array], jax.Array], nnx.State]:
    """:func:`loss` as a pure function of ``(state, tokens)``, and the model's state.

    ``jax.grad(f)(state, tokens)`` differentiates with respect to every parameter (the model is
    split with ``nnx.split`` here and merged back in ``f``), and so does
    ``jax.grad(jaxmem.optimize(f, chunk_tokens=True))``.
    """
    graphdef, state = nnx.split(model)

    def llama_nnx_loss(state: nnx.State, tokens: jax.Array) -> jax.Array:
        return loss(nnx.merge(graphdef, state), tokens, remat=remat)

    return llama_nnx_loss, state


def abstract_state(
    cfg: LlamaConfig = DEFAULT, *, remat: bool = False
) -> tuple[Callable[[nnx.State, jax.Array], jax.Array], nnx.State]:
    """:func:`pure_loss` of a model built abstractly (``nnx.eval_shape``): the state holds
    ``jax.ShapeDtypeStruct`` leaves, for compiling without allocating the parameters."""
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    return pure_loss(model, remat=remat)
