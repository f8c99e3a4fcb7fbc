"""A held-out GPT-style decoder in Flax NNX, for evaluating the memory planner on unseen code.

:mod:`jaxmem.demo.models` holds the reference GPT the planner (:func:`jaxmem.plan`) was developed
against: Flax linen, LayerNorm with biases, a fused query/key/value projection, learned position
embeddings and a GELU MLP. A planner that only works on that one model proves little, so this
module is a second, independently written model in the style of a typical Flax NNX user, and it
differs from the reference the way real (LLaMA-like) models do:

* Flax NNX modules (``nnx.Module``, ``nnx.Param``), not linen;
* RMSNorm without bias, and no biases anywhere;
* separate query, key and value projections (``query_proj``, ``key_proj``, ``value_proj``);
* rotary position embeddings (RoPE) on queries and keys, no position embedding table;
* a SwiGLU MLP (gate and up projections, both tagged ``mlp_in``; ``silu(gate) * up`` tagged
  ``mlp_act``; the down projection ``mlp_out``);
* an untied output head.

The layers are stacked with :class:`jaxmem.flax.nnx.ScanLayers`, whose ``policy`` comes from the
constructor, so ``policy="auto"`` lets :func:`jaxmem.use_plan` pick what is saved at trace time.
Every activation a planner may select is tagged with :func:`jaxmem.name` under its standard name
(:data:`jaxmem.NAMES`). The jaxmem library never imports this module.

Examples:
  >>> import jax
  >>> cfg = HeldoutConfig(vocab_size=64, seq_len=8, num_layers=2, d_model=16, num_heads=2,
  ...                     d_ff=32)
  >>> loss_fn, params, tokens = make_loss(cfg, policy=None, batch_size=2)
  >>> loss_fn(params, tokens).shape
  ()
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxmem
from jaxmem.flax import nnx as jnnx


@dataclasses.dataclass(frozen=True)
class HeldoutConfig:
    """Hyperparameters of the held-out GPT.

    Attributes:
      vocab_size: number of token ids, >= 2.
      seq_len: tokens per sequence (the model's context), >= 2 (next-token loss needs a pair).
      num_layers: decoder layers in the scanned stack, >= 1.
      d_model: residual stream width, divisible by ``num_heads`` with an even head width (RoPE
        rotates pairs of features).
      num_heads: attention heads, >= 1.
      d_ff: hidden width of the SwiGLU MLP, >= 1.
      dtype: parameter and activation dtype (a floating dtype).

    Raises:
      TypeError: a size that is not an int, or a dtype that is not a floating dtype.
      ValueError: a size out of range, or ``d_model`` not splitting into heads of even width.
    """

    vocab_size: int
    seq_len: int
    num_layers: int
    d_model: int
    num_heads: int
    d_ff: int
    dtype: Any = jnp.float32

    def __post_init__(self):
        minimum = {
            "vocab_size": 2,
            "seq_len": 2,
            "num_layers": 1,
            "d_model": 1,
            "num_heads": 1,
            "d_ff": 1,
        }
        for field, least in minimum.items():
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"HeldoutConfig: {field} must be an int, got {type(value).__name__} "
                    f"({value!r})."
                )
            if value < least:
                raise ValueError(f"HeldoutConfig: {field} must be >= {least}, got {value}.")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"HeldoutConfig: d_model={self.d_model} is not divisible by "
                f"num_heads={self.num_heads}; each head gets d_model // num_heads features."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"HeldoutConfig: the head width d_model // num_heads = {self.head_dim} is odd; "
                "rotary embeddings rotate pairs of features, so it must be even."
            )
        try:
            dtype = jnp.dtype(self.dtype)
        except TypeError as e:
            raise TypeError(f"HeldoutConfig: dtype {self.dtype!r} is not a dtype.") from e
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"HeldoutConfig: dtype must be a floating dtype (float32, bfloat16, ...), got "
                f"{dtype}."
            )

    @property
    def head_dim(self) -> int:
        """Features per attention head, ``d_model // num_heads``."""
        return self.d_model // self.num_heads


class RMSNorm(nnx.Module):
    """Root-mean-square normalization with a learned scale and no bias (Zhang & Sennrich 2019).

    Args:
      dim: the normalized (last) axis size.
      eps: added to the mean square.
      dtype: the scale's dtype.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype: Any = jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        ms = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        y = x.astype(jnp.float32) * jax.lax.rsqrt(ms + self.eps)
        scale = jnp.reshape(self.scale[...], (1,) * (x.ndim - 1) + (-1,))
        return (y * scale).astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, *, base: float = 10000.0) -> jax.Array:
    """Applies rotary position embeddings (Su et al. 2021), the half-split (GPT-NeoX) layout.

    Args:
      x: ``[b, s, a, k]`` queries or keys, ``k`` even.
      positions: ``[s]`` integer positions.
      base: the frequency base.

    Returns:
      ``x`` with feature pairs ``(i, i + k/2)`` rotated by ``position * base**(-2i/k)``.
    """
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [s, k/2]
    cos = jnp.cos(angles)[None, :, None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention with separate q/k/v projections and RoPE, no biases.

    Args:
      config: the model's hyperparameters.
      rngs: parameter initialization streams.
    """

    def __init__(self, config: HeldoutConfig, *, rngs: nnx.Rngs):
        d, a, k = config.d_model, config.num_heads, config.head_dim
        init = nnx.initializers.normal(stddev=d**-0.5)

        def proj():
            return nnx.LinearGeneral(
                d, (a, k), use_bias=False, kernel_init=init, dtype=config.dtype,
                param_dtype=config.dtype, rngs=rngs,
            )  # fmt: skip

        self.wq, self.wk, self.wv = proj(), proj(), proj()
        self.wo = nnx.LinearGeneral(
            (a, k), d, axis=(-2, -1), use_bias=False,
            kernel_init=nnx.initializers.normal(stddev=(a * k) ** -0.5),
            dtype=config.dtype, param_dtype=config.dtype, rngs=rngs,
        )  # fmt: skip
        self.head_dim = k

    def __call__(self, x: jax.Array) -> jax.Array:
        seq = x.shape[1]
        positions = jnp.arange(seq)
        q = jaxmem.name(self.wq(x), "query_proj")  # [b, s, a, k]
        key = jaxmem.name(self.wk(x), "key_proj")
        v = jaxmem.name(self.wv(x), "value_proj")
        q, key = rotary(q, positions), rotary(key, positions)
        scores = jnp.einsum("bqak,bsak->baqs", q, key) / math.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((1, 1, seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        scores = jaxmem.name(scores, "attention_scores")
        probs = jaxmem.name(jax.nn.softmax(scores, axis=-1), "attention_probs")
        out = jaxmem.name(jnp.einsum("baqs,bsak->bqak", probs, v), "attention_out")
        return jaxmem.name(self.wo(out), "out_proj")


class SwiGLU(nnx.Module):
    """The gated MLP ``down(silu(gate(x)) * up(x))`` (Shazeer 2020), no biases.

    Args:
      config: the model's hyperparameters.
      rngs: parameter initialization streams.
    """

    def __init__(self, config: HeldoutConfig, *, rngs: nnx.Rngs):
        d, f = config.d_model, config.d_ff
        kw = dict(use_bias=False, dtype=config.dtype, param_dtype=config.dtype, rngs=rngs)
        self.gate = nnx.Linear(d, f, kernel_init=nnx.initializers.normal(d**-0.5), **kw)
        self.up = nnx.Linear(d, f, kernel_init=nnx.initializers.normal(d**-0.5), **kw)
        self.down = nnx.Linear(f, d, kernel_init=nnx.initializers.normal(f**-0.5), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        # Both first-layer matmuls are the MLP's pre-activation inputs: one name for the pair.
        gate = jaxmem.name(self.gate(x), "mlp_in")
        up = jaxmem.name(self.up(x), "mlp_in")
        act = jaxmem.name(jax.nn.silu(gate) * up, "mlp_act")
        return jaxmem.name(self.down(act), "mlp_out")


class DecoderLayer(nnx.Module):
    """A pre-norm decoder layer: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``.

    Args:
      config: the model's hyperparameters.
      rngs: parameter initialization streams.
    """

    def __init__(self, config: HeldoutConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.d_model, dtype=config.dtype)
        self.attn = CausalSelfAttention(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config.d_model, dtype=config.dtype)
        self.mlp = SwiGLU(config, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        h = jaxmem.name(h, "decoder_layer_input")
        h = h + self.attn(self.attn_norm(h))
        return h + self.mlp(self.mlp_norm(h))


class HeldoutGPT(nnx.Module):
    """Token embedding, a scanned stack of decoder layers, a final RMSNorm and an untied head.

    Args:
      config: the model's hyperparameters.
      rngs: parameter initialization streams.
      policy: remat policy of the layer stack, passed to :class:`jaxmem.flax.nnx.ScanLayers`:
        ``"auto"`` (chosen by :func:`jaxmem.use_plan` at trace time), a policy or preset name,
        or None (no remat).

    Call it on ``[b, s]`` int tokens; it returns ``[b, s, vocab_size]`` logits (float32).
    """

    def __init__(
        self, config: HeldoutConfig, *, rngs: nnx.Rngs, policy: Callable | str | None = "auto"
    ):
        if not isinstance(config, HeldoutConfig):
            raise TypeError(
                f"HeldoutGPT: config must be a HeldoutConfig, got {type(config).__name__}."
            )
        self.config = config
        self.embed = nnx.Embed(
            config.vocab_size, config.d_model, embedding_init=nnx.initializers.normal(1.0),
            dtype=config.dtype, param_dtype=config.dtype, rngs=rngs,
        )  # fmt: skip
        self.layers = jnnx.ScanLayers(
            lambda r: DecoderLayer(config, rngs=r), config.num_layers, rngs=rngs, policy=policy
        )
        self.final_norm = RMSNorm(config.d_model, dtype=config.dtype)
        self.lm_head = nnx.Linear(
            config.d_model, config.vocab_size, use_bias=False,
            kernel_init=nnx.initializers.normal(config.d_model**-0.5 * 0.1),
            dtype=config.dtype, param_dtype=config.dtype, rngs=rngs,
        )  # fmt: skip

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if tokens.ndim != 2 or tokens.shape[1] > self.config.seq_len:
            raise ValueError(
                f"HeldoutGPT: tokens must be [batch, seq] with seq <= seq_len="
                f"{self.config.seq_len}, got shape {tuple(tokens.shape)}."
            )
        h = self.layers(self.embed(tokens))
        return self.lm_head(self.final_norm(h)).astype(jnp.float32)


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``logits[:, :-1]``."""
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    target = tokens[:, 1:]
    return -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))


def make_loss(
    config: HeldoutConfig,
    policy: Callable | str | None = "auto",
    *,
    batch_size: int,
    seed: int = 0,
    abstract: bool = False,
) -> tuple[Callable[[nnx.State, jax.Array], jax.Array], Any, Any]:
    """Builds the model and a pure next-token loss over its parameter state.

    Args:
      config: the model's hyperparameters.
      policy: the layer stack's remat policy (``"auto"``: chosen by :func:`jaxmem.use_plan`).
      batch_size: sequences per batch, >= 1.
      seed: seeds the parameters and the random tokens.
      abstract: return ``jax.ShapeDtypeStruct`` parameters and tokens (from ``nnx.eval_shape``,
        nothing allocated), for configurations that should be compiled but not run.

    Returns:
      ``(loss_fn, params, tokens)``: ``loss_fn(params, tokens)`` is the scalar loss (pure:
      ``jax.grad(loss_fn)`` differentiates w.r.t. the ``nnx.Param`` state); ``params`` is that
      state; ``tokens`` are ``[batch_size, seq_len]`` int32 ids.

    Raises:
      TypeError: ``config`` is not a :class:`HeldoutConfig`, or ``batch_size`` not an int.
      ValueError: ``batch_size < 1``.
    """
    if not isinstance(config, HeldoutConfig):
        raise TypeError(f"make_loss: config must be a HeldoutConfig, got {type(config).__name__}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"make_loss: batch_size must be an int, got {batch_size!r}.")
    if batch_size < 1:
        raise ValueError(f"make_loss: batch_size must be >= 1, got {batch_size}.")

    def build():
        return HeldoutGPT(config, rngs=nnx.Rngs(seed), policy=policy)

    model = nnx.eval_shape(build) if abstract else build()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if abstract:
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        tokens = jax.ShapeDtypeStruct((batch_size, config.seq_len), jnp.int32)
    else:
        key = jax.random.fold_in(jax.random.key(seed), 1)
        tokens = jax.random.randint(key, (batch_size, config.seq_len), 0, config.vocab_size)

    def loss_fn(params: nnx.State, tokens: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, params, rest)
        return next_token_loss(model(tokens), tokens)

    return loss_fn, params, tokens
