"""A small GPT-style Flax linen language model whose layer stack runs through a pluggable scan.

Demo and reference code (see :mod:`jaxmem.demo`), not library API.

The transformer blocks' parameters are stacked over a leading layer axis (initialised with
:func:`jax.vmap` over ``Block.init`` with split keys) and applied by
``scan_impl(step, h, stacked_params)``, where ``step`` calls ``Block().apply({"params": p}, h)``.
Swapping ``scan_impl`` (``jax.lax.scan``, ``jaxmem.scan``, ...) and the remat ``policy`` on the
step changes how the stack is differentiated, never the parameters or the values computed, so
memory profiles of the configurations compare like with like.

Examples:
  Shapes only (``jax.eval_shape``: nothing is compiled or run):

  >>> import jax
  >>> cfg = GPTConfig(vocab_size=64, seq_len=8, num_layers=2, d_model=16, num_heads=2, d_ff=32)
  >>> params = abstract_params(cfg)
  >>> params["blocks"]["mlp_in"]["kernel"].shape  # stacked over the 2 layers
  (2, 16, 32)
  >>> tokens = jax.ShapeDtypeStruct((1, 8), "int32")
  >>> jax.eval_shape(GPT(cfg).apply, {"params": params}, tokens).shape
  (1, 8, 64)
  >>> lean = GPT(cfg, policy=jax.checkpoint_policies.dots_saveable)
  >>> jax.eval_shape(next_token_loss(lean), params, tokens).shape
  ()
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxmem
from jaxmem import name

try:
    import flax.linen as nn
except ImportError as e:
    raise ImportError(
        f"jaxmem.demo needs Flax, an optional dependency: pip install 'jaxmem[flax]' ({e})"
    ) from e

ScanImpl = Callable[..., Any]
Policy = Callable[..., bool]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of :class:`GPT`.

    Attributes:
      vocab_size: Number of tokens.
      seq_len: Maximum sequence length (size of the positional embedding table).
      num_layers: Number of transformer blocks.
      d_model: Width of the residual stream.
      num_heads: Attention heads; must divide ``d_model``.
      d_ff: Hidden width of the MLP.
      tie_embeddings: Whether the output projection reuses the token embedding.
    """

    vocab_size: int = 4096
    seq_len: int = 128
    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 4
    d_ff: int = 1024
    tie_embeddings: bool = True

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"GPTConfig.{field.name} must be a positive int, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"GPTConfig: num_heads={self.num_heads} must divide d_model={self.d_model}; "
                "pick a d_model that is a multiple of num_heads."
            )


class Block(nn.Module):
    """Pre-LN transformer block: ``h + attn(LN(h))``, then ``h + mlp(LN(h))``.

    Causal multi-head softmax attention with a fused qkv projection, and a GELU MLP. Its
    activations carry the standard checkpoint names (:data:`jaxmem.NAMES`:
    ``decoder_layer_input``, ``qkv_proj``, ``attention_scores``, ``attention_probs``,
    ``attention_out``, ``out_proj``, ``mlp_in``, ``mlp_act``, ``mlp_out``) so name-based remat
    policies (:mod:`jaxmem.policies`) can select them.

    Attributes:
      num_heads: Attention heads.
      d_ff: Hidden width of the MLP.
    """

    num_heads: int
    d_ff: int

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        """Applies the block to ``h`` of shape ``[batch, seq, d_model]``."""
        b, s, d = h.shape
        dh = d // self.num_heads
        h = name(h, "decoder_layer_input")
        x = nn.LayerNorm(name="ln1")(h)
        qkv = nn.DenseGeneral((3, self.num_heads, dh), name="qkv")(x)  # [B, S, 3, H, Dh]
        qkv = name(qkv, "qkv_proj")
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
        causal = jnp.tril(jnp.ones((s, s), jnp.bool_))[None, None]
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        probs = name(jax.nn.softmax(name(scores, "attention_scores"), axis=-1), "attention_probs")
        attn = name(jnp.einsum("bhqk,bkhd->bqhd", probs, v), "attention_out")
        out = nn.DenseGeneral(d, axis=(-2, -1), name="out")(attn)
        h = h + name(out, "out_proj")
        x = nn.LayerNorm(name="ln2")(h)
        x = name(nn.Dense(self.d_ff, name="mlp_in")(x), "mlp_in")
        x = name(jax.nn.gelu(x), "mlp_act")
        x = name(nn.Dense(d, name="mlp_out")(x), "mlp_out")
        return h + x


class GPT(nn.Module):
    """GPT-style decoder: token + positional embedding, scanned pre-LN blocks, final LN, logits.

    Attributes:
      config: Model sizes.
      scan_impl: Runs the layer stack; signature of :func:`jax.lax.scan` (e.g. ``jaxmem.scan``).
      policy: Remat policy for ``jax.checkpoint`` around each block step (e.g.
        ``jax.checkpoint_policies.dots_saveable``); None applies no remat.
      return_hidden: Return the final hidden states ``[batch, seq, d_model]`` instead of the
        logits (for losses that apply the output projection themselves).
    """

    config: GPTConfig
    scan_impl: ScanImpl = jax.lax.scan
    policy: Policy | None = None
    return_hidden: bool = False

    def block(self) -> Block:
        """Returns the (unbound) block module whose parameters are stacked over the layers."""
        return Block(num_heads=self.config.num_heads, d_ff=self.config.d_ff, parent=None)

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Returns logits ``[batch, seq, vocab]`` for int tokens ``[batch, seq]``."""
        cfg = self.config
        _, s = tokens.shape
        if s > cfg.seq_len:
            raise ValueError(f"GPT: got {s} tokens per sequence, more than seq_len={cfg.seq_len}")
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, name="embed")
        pos = self.param("pos_embed", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model))
        h = embed(tokens) + pos[None, :s]

        block = self.block()

        def init_blocks(rng: jax.Array) -> Any:
            keys = jax.random.split(rng, cfg.num_layers)
            dummy = jnp.zeros((1, 1, cfg.d_model), jnp.float32)
            return jax.vmap(lambda k: block.init(k, dummy)["params"])(keys)

        blocks = self.param("blocks", init_blocks)

        def step(h, p):
            return block.apply({"params": p}, h), None

        if self.policy is not None:
            step = jax.checkpoint(step, policy=self.policy)
        h, _ = self.scan_impl(step, h, blocks)

        h = nn.LayerNorm(name="ln_f")(h)
        if self.return_hidden:
            if not cfg.tie_embeddings:  # Create the head's parameters all the same.
                nn.Dense(cfg.vocab_size, use_bias=False, name="head")(h[:1, :1])
            return h
        if cfg.tie_embeddings:
            return embed.attend(h)
        return nn.Dense(cfg.vocab_size, use_bias=False, name="head")(h)


def next_token_loss(model: GPT) -> Callable[[Any, jax.Array], jax.Array]:
    """Returns ``loss(params, tokens)``: mean next-token cross-entropy (optax) of ``model``.

    Position ``t`` predicts token ``t + 1``; the last position has no target.
    """

    def loss(params: Any, tokens: jax.Array) -> jax.Array:
        logits = model.apply({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    return loss


def linear_ce_next_token_loss(model: GPT) -> Callable[[Any, jax.Array], jax.Array]:
    """Like :func:`next_token_loss`, with :func:`jaxmem.losses.linear_cross_entropy`.

    The output projection and the cross-entropy run chunk by chunk over the vocabulary, so the
    ``[batch, seq, vocab]`` logits never exist.
    """
    hidden_model = model.clone(return_hidden=True)

    def loss(params: Any, tokens: jax.Array) -> jax.Array:
        h = hidden_model.apply({"params": params}, tokens)
        if model.config.tie_embeddings:
            w = params["embed"]["embedding"].T
        else:
            w = params["head"]["kernel"]
        return jaxmem.losses.linear_cross_entropy(h[:, :-1], w, tokens[:, 1:])

    return loss


def abstract_params(config: GPTConfig, batch_size: int = 1) -> Any:
    """Returns the parameters' shapes and dtypes as ``jax.ShapeDtypeStruct``, computing nothing."""
    tokens = jax.ShapeDtypeStruct((batch_size, config.seq_len), jnp.int32)
    return jax.eval_shape(GPT(config).init, jax.random.key(0), tokens)["params"]
