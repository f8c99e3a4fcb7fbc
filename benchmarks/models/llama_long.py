"""A Llama-like decoder in plain JAX, written the way its users write it: the long-context model.

Issue 51 (long context) measures how the gradient's memory grows with the sequence length on
this model. It is plain JAX, no framework: the parameters are a dict, the layers' weights are
stacked on a leading axis of length ``num_layers`` and the layers run with :func:`jax.lax.scan`
over them, as in many hand-written training scripts (and MaxText's scanned layers):

* token embedding ``embed [V, D]``, an untied head ``lm_head [D, V]``, no biases anywhere;
* RMSNorm before attention, before the MLP and at the end (``attn_norm``, ``mlp_norm``,
  ``final_norm``: scales only);
* rotary position embeddings (RoPE, rotate-half) on queries and keys, the tables computed from
  the positions;
* causal attention through ``jax.nn.dot_product_attention(q, k, v, is_causal=True)``,
  ``q [B, S, N, H]`` and ``k, v [B, S, K, H]`` (grouped-query when ``K < N``);
* a SwiGLU MLP ``w_down(silu(x @ w_gate) * (x @ w_up))`` of width ``F`` (default ``4 D``);
* the loss: mean next-token cross-entropy; the model reads all ``S`` tokens and the logits at
  positions ``0 .. S-2`` predict tokens ``1 .. S-1``.

``remat=True`` wraps the layer in ``jax.checkpoint(layer,
policy=jax.checkpoint_policies.nothing_saveable)``: full remat, stock JAX's leanest policy.

:func:`make_loss` gives the loss as a plain function of ``(params, tokens)`` for a config, the
form :func:`jax.grad` and ``jaxmem.optimize`` take. The jaxmem library never imports this module.

Examples:
  >>> import jax
  >>> cfg = LlamaConfig(d_model=32, num_heads=2, vocab_size=64)
  >>> params = init(jax.random.key(0), cfg)
  >>> tokens = jax.random.randint(jax.random.key(1), (1, 16), 0, cfg.vocab_size)
  >>> f = make_loss(cfg)
  >>> f(params, tokens).shape, sorted(jax.grad(f)(params, tokens)) == sorted(params)
  ((), True)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, jax.Array]
"""The parameters: a flat dict of arrays, per-layer weights stacked on a leading axis."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of the Llama-like decoder (the defaults are issue 51's model).

    Attributes:
      num_layers: decoder layers, stacked and scanned (``L``).
      d_model: residual stream width (``D``), ``num_heads * head_dim``.
      num_heads: query heads (``N``); the head width ``H = D / N`` must be even (RoPE).
      num_kv_heads: key/value heads (``K``), dividing ``num_heads``; None: ``num_heads``.
      d_ff: SwiGLU hidden width (``F``); None: ``4 * d_model``.
      vocab_size: token ids (``V``).
      dtype: parameter and activation dtype; the cross-entropy is computed in float32.
      rope_theta: RoPE base.
      norm_eps: RMSNorm epsilon.

    Raises:
      ValueError: on sizes that do not fit together.
    """

    num_layers: int = 2
    d_model: int = 256
    num_heads: int = 4
    num_kv_heads: int | None = None
    d_ff: int | None = None
    vocab_size: int = 2048
    dtype: Any = jnp.float32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if min(self.num_layers, self.d_model, self.num_heads, self.num_kv_heads) < 1:
            raise ValueError(f"LlamaConfig: sizes must be positive, got {self}")
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ValueError(
                f"LlamaConfig: d_model={self.d_model} must be num_heads={self.num_heads} times "
                "an even head width (RoPE rotates pairs of features)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig: num_kv_heads={self.num_kv_heads} must divide "
                f"num_heads={self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        """The width of one head, ``d_model // num_heads``."""
        return self.d_model // self.num_heads


DEFAULT = LlamaConfig()
"""Issue 51's model: 2 layers, D=256, 4 heads, F=1024, V=2048, float32."""


def init(key: jax.Array, cfg: LlamaConfig = DEFAULT) -> Params:
    """Random parameters: normal weights scaled by ``1/sqrt(fan_in)``, norms' scales one.

    Args:
      key: a PRNG key.
      cfg: the model's sizes.

    Returns:
      ``{"embed": [V, D], "attn_norm": [L, D], "wq": [L, D, N*H], "wk", "wv": [L, D, K*H],
      "wo": [L, N*H, D], "mlp_norm": [L, D], "w_gate", "w_up": [L, D, F], "w_down": [L, F, D],
      "final_norm": [D], "lm_head": [D, V]}`` in ``cfg.dtype``.
    """
    L, D, F, V = cfg.num_layers, cfg.d_model, cfg.d_ff, cfg.vocab_size
    nh, kh = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "wq": (L, D, nh),
        "wk": (L, D, kh),
        "wv": (L, D, kh),
        "wo": (L, nh, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
        "lm_head": (D, V),
    }
    embed_key, *keys = jax.random.split(key, 1 + len(shapes))
    params = {
        name: (jax.random.normal(k, shape) * shape[-2] ** -0.5).astype(cfg.dtype)
        for k, (name, shape) in zip(keys, shapes.items(), strict=True)
    }
    params["embed"] = (jax.random.normal(embed_key, (V, D)) * 0.02).astype(cfg.dtype)
    ones = lambda *shape: jnp.ones(shape, cfg.dtype)
    params |= {"attn_norm": ones(L, D), "mlp_norm": ones(L, D), "final_norm": ones(D)}
    return params


def abstract_params(cfg: LlamaConfig = DEFAULT) -> Params:
    """The parameters' shapes and dtypes (``jax.ShapeDtypeStruct``), for compiling alone."""
    return jax.eval_shape(functools.partial(init, cfg=cfg), jax.random.key(0))


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of ``x [B, S, D]`` over its last axis, in float32, returned in ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32.astype(x.dtype) * scale[None, None, :]


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """RoPE's ``(sin, cos)`` tables, each ``[S, head_dim // 2]``, from the token positions."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.sin(angles), jnp.cos(angles)


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotates ``x [B, S, heads, H]`` by the tables (rotate-half: the first half of the features
    pairs with the second)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    sin, cos = sin[None, :, None, :].astype(x.dtype), cos[None, :, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def layer(x: jax.Array, w: Params, sin: jax.Array, cos: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """One decoder layer on ``x [B, S, D]`` with one layer's weights ``w`` (no ``L`` axis)."""
    B, S, _ = x.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
    q = apply_rope((h @ w["wq"]).reshape(B, S, N, H), sin, cos)
    k = apply_rope((h @ w["wk"]).reshape(B, S, K, H), sin, cos)
    v = (h @ w["wv"]).reshape(B, S, K, H)
    attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + attn.reshape(B, S, N * H) @ w["wo"]
    h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
    return x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]


LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
"""The parameters stacked on the ``L`` axis, scanned over."""


def forward(
    params: Params, tokens: jax.Array, cfg: LlamaConfig = DEFAULT, *, remat: bool = False
) -> jax.Array:
    """The logits ``[B, S, V]`` of ``tokens [B, S]`` (int32), in ``cfg.dtype``."""
    x = params["embed"][tokens]
    sin, cos = rope_tables(jnp.arange(tokens.shape[1]), cfg.head_dim, cfg.rope_theta)
    body = functools.partial(layer, sin=sin, cos=cos, cfg=cfg)
    if remat:
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    x, _ = jax.lax.scan(lambda x, w: (body(x, w), None), x, {k: params[k] for k in LAYER_KEYS})
    return rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["lm_head"]


def loss(
    params: Params, tokens: jax.Array, cfg: LlamaConfig = DEFAULT, *, remat: bool = False
) -> jax.Array:
    """Mean next-token cross-entropy: the logits at positions ``0 .. S-2`` against tokens
    ``1 .. S-1``, in float32.

    Args:
      params: as :func:`init` returns them.
      tokens: ``[B, S]`` int32 token ids, ``S >= 2``.
      cfg: the model's sizes.
      remat: full remat of each layer (``jax.checkpoint`` with ``nothing_saveable``).

    Returns:
      A float32 scalar.
    """
    return next_token_loss(forward(params, tokens, cfg, remat=remat), tokens)


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits [B, S, V]`` at positions ``0 .. S-2`` against ``tokens
    [B, S]`` at ``1 .. S-1``, in float32."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def make_loss(
    cfg: LlamaConfig = DEFAULT, *, remat: bool = False
) -> Callable[[Params, jax.Array], jax.Array]:
    """:func:`loss` for a config, as a plain function of ``(params, tokens)``: what
    ``jax.grad(jaxmem.optimize(make_loss(cfg), chunk_tokens=True))(params, tokens)`` takes."""

    def llama_loss(params: Params, tokens: jax.Array) -> jax.Array:
        return loss(params, tokens, cfg, remat=remat)

    return llama_loss
