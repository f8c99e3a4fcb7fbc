# Copyright 2024 The Flax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""Flax's Gemma decoder ``Block`` (``examples/gemma``, NNX), vendored for the peers benchmark.

Vendored from Flax 0.12.12 (``examples/gemma/`` of the ``flax`` sdist on PyPI,
https://github.com/google/flax, Apache License 2.0, Copyright 2024 and 2026 The Flax Authors),
trimmed to what one decoder block needs, in one module:

- from ``transformer_cfg.py``: the RoPE defaults, ``QueryPreAttentionNormalisation``,
  ``AttentionType``, ``ShardingConfig``, ``TransformerConfig`` (its fields,
  ``query_pre_attn_scalar``, the ``gemma_2b`` preset and ``__post_init__``; not the loaders
  from checkpoints nor the other presets);
- from ``sow_lib.py``: ``SowConfig``;
- from ``layers.py``: ``RMSNorm``;
- from ``positional_embeddings.py``: ``apply_rope``;
- from ``modules.py``: ``Attention``, ``FeedForward`` and ``Block`` (without their
  ``init_cache``, which only sampling uses).

The code is as written there, reformatted by ruff (four-space indents), with these changes only:
the names the example imports from its sibling modules (``layers.RMSNorm``,
``positional_embeddings.apply_rope``, ``sow_lib.SowConfig``) are this module's own, and
``jaxtyping.Array`` is ``jax.Array`` (no jaxtyping dependency). Used by :mod:`benchmarks.peers`
and ``tests/benchmarks/test_peers_benchmark.py``; the jaxmem library never imports it.
"""

# ruff: noqa: B008  (flax's own argument defaults, kept as written)

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.sharding import auto_axes

Array = jax.Array

_NUM_LAYERS_GEMMA_2B = 18

DEFAULT_ROPE_BASE_FREQUENCY = 10_000
DEFAULT_ROPE_SCALE_FACTOR = 1.0


class QueryPreAttentionNormalisation(enum.Enum):
    """Initialization strategy."""

    # Whether to scale the query by 1/sqrt(head_dim)
    BY_ONE_OVER_SQRT_HEAD_DIM = enum.auto()

    # Whether to scale the query by `embed_dim // num_heads`
    BY_EMBED_DIM_DIV_NUM_HEADS = enum.auto()

    # Whether to scale the query by `1/sqrt(embed_dim // num_heads)`
    BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS = enum.auto()


class AttentionType(enum.Enum):
    GLOBAL = 1
    LOCAL_SLIDING = 2


@dataclasses.dataclass(slots=True, frozen=True)
class ShardingConfig:
    """Sharding configuration for gemma transformer."""

    emb_vd: P | None = None
    q_weight_ndh: P | None = None
    kv_weight_cndh: P | None = None
    qkv_weight_cndh: P | None = None
    o_weight_nhd: P | None = None
    ffw_weight_df: P | None = None
    ffw_weight_fd: P | None = None
    rms_norm_weight: P | None = None
    act_btd: P | None = None
    act_btf: P | None = None
    act_btnh: P | None = None
    act_sbtnh: P | None = None

    fsdp_axis_name: str = "fsdp"
    tensor_parallel_axis_name: str = "tensor"

    @staticmethod
    def no_sharding():
        return ShardingConfig()

    @staticmethod
    def fsdp_tp_sharding(
        is_sampling: bool = False,
        fsdp_axis_name: str = "fsdp",
        tensor_parallel_axis_name: str = "tp",
    ):
        fsdp = fsdp_axis_name if not is_sampling else None
        tp = tensor_parallel_axis_name

        return ShardingConfig(
            emb_vd=P(tp, fsdp),
            q_weight_ndh=P(tp, fsdp, None),
            kv_weight_cndh=P(None, tp, fsdp, None),
            qkv_weight_cndh=P(None, tp, fsdp, None),
            o_weight_nhd=P(tp, None, fsdp),
            ffw_weight_df=P(fsdp, tp),
            ffw_weight_fd=P(tp, fsdp),
            rms_norm_weight=P(
                tp,
            ),
            act_btd=P(fsdp, None, None if is_sampling else tp),
            act_btf=P(fsdp, None, tp),
            act_btnh=P(fsdp, None, tp, None),
            act_sbtnh=P(None, fsdp, None, tp, None),
            tensor_parallel_axis_name=tensor_parallel_axis_name,
            fsdp_axis_name=fsdp_axis_name,
        )


@dataclasses.dataclass(slots=True, frozen=True)
class TransformerConfig:
    """Configuration for the text-only gemma transformer."""

    num_layers: int
    num_embed: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    final_logit_softcap: float | None
    use_post_attn_norm: bool
    use_post_ffw_norm: bool
    attention_types: Iterable[AttentionType]
    query_pre_attn_norm: QueryPreAttentionNormalisation = (
        QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM
    )
    attn_logits_soft_cap: float | None = None
    transpose_gating_einsum: bool = False
    local_base_frequency: int = DEFAULT_ROPE_BASE_FREQUENCY
    global_base_frequency: int = DEFAULT_ROPE_BASE_FREQUENCY
    local_scale_factor: float = DEFAULT_ROPE_SCALE_FACTOR
    global_scale_factor: float = DEFAULT_ROPE_SCALE_FACTOR
    use_qk_norm: bool = False
    sliding_window_size: int | None = None
    dtype: Any = jnp.float32
    weight_dtype: Any = jnp.float32
    dropout_rate: float = 0.0

    shd_config: ShardingConfig = ShardingConfig.no_sharding()

    def query_pre_attn_scalar(self) -> float:
        """Returns the scalar to multiply the query by before attention."""
        match self.query_pre_attn_norm:
            case QueryPreAttentionNormalisation.BY_EMBED_DIM_DIV_NUM_HEADS:
                return self.embed_dim // self.num_heads
            case QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS:  # pylint: disable=line-too-long
                return (self.embed_dim // self.num_heads) ** -0.5
            case QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM | _:
                return self.head_dim**-0.5

    @classmethod
    def gemma_2b(cls, **override) -> "TransformerConfig":
        num_layers = _NUM_LAYERS_GEMMA_2B
        config = {
            "num_layers": num_layers,
            "num_embed": 256128,
            "embed_dim": 2048,
            "hidden_dim": 16384,
            "num_heads": 8,
            "head_dim": 256,
            "num_kv_heads": 1,
            "final_logit_softcap": None,
            "attention_types": (AttentionType.GLOBAL,) * num_layers,
            "use_post_attn_norm": False,
            "use_post_ffw_norm": False,
        }
        for key, value in override.items():
            config[key] = value
        return cls(**config)

    def __post_init__(self):
        if self.num_heads != self.num_kv_heads:
            if self.num_heads % self.num_kv_heads != 0:
                raise ValueError(
                    f"Number of query heads ({self.num_heads}) must be divisible by "
                    f"number of key/value heads ({self.num_kv_heads})."
                )


@dataclasses.dataclass(frozen=True)
class SowConfig:
    """Module for sowing intermediate activations."""

    # Whether to sow embeddings.
    embeddings: bool = False

    # Whether to sow activations after each attention block (in residual stream).
    rs_after_attention: bool = False

    # Whether to sow activations after each FFW block (in residual stream).
    # This is the same as the residual stream activations after a whole layer.
    rs_after_ffw: bool = False

    # If non-zero, top-k activations in a ffw hidden layer are sowed.
    # We use a sparse representation here to save memory.
    mlp_hidden_topk: int = 0

    # If non-zero, top-k attention logits are sowed.
    # We use a sparse representation here to save memory.
    attn_logits_topk: int = 0

    def is_enabled(self):
        return any(
            [
                self.embeddings,
                self.rs_after_attention,
                self.rs_after_ffw,
                self.mlp_hidden_topk,
                self.attn_logits_topk,
            ]
        )

    def maybe_sow_embeddings(
        self,
        embeddings: jax.Array,
        module: nnx.Module,
    ):
        """Sows embeddings if configured."""
        if self.embeddings:
            module.sow(nnx.Intermediate, "embeddings", embeddings)

    def maybe_sow_rs_after_attention(
        self,
        activations: jax.Array,
        module: nnx.Module,
    ):
        """Sows activations after attention if configured."""
        if self.rs_after_attention:
            module.sow(nnx.Intermediate, "rs_after_attention", activations)

    def maybe_sow_rs_after_ffw(
        self,
        activations: jax.Array,
        module: nnx.Module,
    ):
        """Sows activations after FFW if configured."""
        if self.rs_after_ffw:
            module.sow(nnx.Intermediate, "rs_after_ffw", activations)

    def maybe_sow_mlp_hidden_topk(
        self,
        activations: jax.Array,
        module: nnx.Module,
    ):
        """Sows top-absolute-k activations in a mlp hidden layer if configured."""
        if self.mlp_hidden_topk:
            shd = jax.typeof(activations).sharding
            top_k = lambda x: jax.lax.top_k(x, self.mlp_hidden_topk)
            _, indices = auto_axes(out_sharding=shd)(top_k)(jnp.abs(activations))
            take_aa = lambda x, i, axis: jnp.take_along_axis(x, i, axis)
            values = auto_axes(out_sharding=shd)(take_aa)(activations, indices, axis=-1)
            module.sow(nnx.Intermediate, "hidden_topk_values", values)
            module.sow(nnx.Intermediate, "hidden_topk_indices", indices)

    def maybe_sow_attn_logits_topk(
        self,
        logits: jax.Array,
        module: nnx.Module,
    ):
        """Sows top-k attention logits if configured."""
        if self.attn_logits_topk:
            shd = jax.typeof(logits).sharding
            top_k = lambda x: jax.lax.top_k(x, self.attn_logits_topk)
            values, indices = auto_axes(out_sharding=shd)(top_k)(logits)
            module.sow(nnx.Intermediate, "logits_topk_values", values)
            module.sow(nnx.Intermediate, "logits_topk_indices", indices)


class RMSNorm(nnx.Module):
    """RMSNorm layer."""

    def __init__(
        self,
        dim: int,
        *,
        scale_init: nnx.Initializer = nnx.initializers.zeros_init(),
        scale_metadata: dict[str, Any] | None = None,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        weight_dtype: Any = jnp.float32,
    ):
        self.dtype = dtype
        self.weight_dtype = weight_dtype
        scale_metadata = scale_metadata if scale_metadata else {}
        self.scale = nnx.Param(
            scale_init(rngs.params(), dim, weight_dtype),
            **scale_metadata,  # pyrefly: ignore[bad-argument-type]
        )

    def __call__(self, x: Array) -> Array:
        x = jnp.asarray(x, jnp.float32)
        mean2 = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        normed_inputs = jnp.asarray(x * jax.lax.rsqrt(mean2 + 1e-06), dtype=self.dtype)
        scale = jnp.asarray(self.scale, self.dtype)
        normed_inputs = normed_inputs * (1.0 + scale)
        return normed_inputs


_MAX_WAVELENGTH = 10_000


def apply_rope(
    inputs: jax.Array,  # [B, L]
    positions: jax.Array,  # [B, L]
    head_dim: int,
    max_wavelength: int = _MAX_WAVELENGTH,
    scale_factor: float = 1.0,
) -> jax.Array:
    """Applies RoPE."""
    fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
    timescale = max_wavelength**fraction

    sinusoid_inp = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sinusoid_inp = sinusoid_inp[..., jnp.newaxis, :]
    if scale_factor < 1.0:
        raise ValueError(f"scale_factor must be >= 1.0, got {scale_factor}")
    sinusoid_inp /= scale_factor

    sin = jnp.sin(sinusoid_inp)
    cos = jnp.cos(sinusoid_inp)

    first_half, second_half = jnp.split(inputs, 2, axis=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    out = jnp.concatenate([first_part, second_part], axis=-1)
    return out.astype(inputs.dtype)


LayerCache = dict[str, Array]

K_MASK = -2.3819763e38  # Set to a large negative number.


class Attention(nnx.Module):
    """Attention module."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        features: int,
        head_dim: int,
        query_pre_attn_scalar: float,
        attn_type: AttentionType,
        *,
        rngs: nnx.Rngs,
        rope_base_frequency: int = DEFAULT_ROPE_BASE_FREQUENCY,
        rope_scale_factor: float = DEFAULT_ROPE_SCALE_FACTOR,
        attn_logits_soft_cap: float | None = None,
        sliding_window_size: int | None = None,
        use_qk_norm: bool = False,
        sow_config: SowConfig = SowConfig(),
        shd_config: ShardingConfig,
        dtype: jnp.dtype = jnp.float32,  # pyrefly: ignore[bad-function-definition]
        weight_dtype: jnp.dtype = jnp.float32,  # pyrefly: ignore[bad-function-definition]
        dropout_rate: float = 0.0,
    ):
        if attn_type == AttentionType.LOCAL_SLIDING and sliding_window_size is None:
            raise ValueError("`sliding_window_size` must be set if `attn_type` is Local Sliding.")

        self.shd_config = shd_config
        self.query_pre_attn_scalar = query_pre_attn_scalar
        self.attn_type = attn_type
        self.sliding_window_size = sliding_window_size
        self.attn_logits_soft_cap = attn_logits_soft_cap
        self.attn_vec_einsum = nnx.Einsum(
            einsum_str="BTNH,NHD->BTD",
            kernel_shape=(num_heads, head_dim, features),
            kernel_metadata={
                "out_sharding": shd_config.o_weight_nhd,
            },
            dtype=dtype,
            param_dtype=weight_dtype,
            rngs=rngs,
        )
        self.rope_base_frequency = rope_base_frequency
        self.rope_scale_factor = rope_scale_factor
        self.use_qk_norm = use_qk_norm
        self.sow_config = sow_config
        self.shd_config = shd_config

        self.act_cbtkh_shd = None
        if num_heads == num_kv_heads:
            self.qkv_einsum = nnx.Einsum(
                einsum_str="BTD,SNDH->SBTNH",
                kernel_shape=(3, num_heads, features, head_dim),
                kernel_metadata={
                    "out_sharding": shd_config.qkv_weight_cndh,
                },
                dtype=dtype,
                param_dtype=weight_dtype,
                rngs=rngs,
            )
        else:
            if num_heads % num_kv_heads != 0:
                raise ValueError(
                    f"Number of query heads ({num_heads}) must be divisible by "
                    f"number of key/value heads ({num_kv_heads})."
                )
            self.q_einsum = nnx.Einsum(
                einsum_str="BTD,NDH->BTNH",
                kernel_shape=(num_heads, features, head_dim),
                kernel_metadata={"out_sharding": shd_config.q_weight_ndh},
                dtype=dtype,
                param_dtype=weight_dtype,
                rngs=rngs,
            )
            kv_kernel_sharding = None
            if shd_config.kv_weight_cndh:
                self.act_cbtkh_shd = (
                    self.shd_config.act_sbtnh
                    if num_kv_heads > 1
                    else jax.P(None, shd_config.fsdp_axis_name, None, None, None)
                )
                kv_kernel_sharding = (
                    shd_config.kv_weight_cndh
                    if num_kv_heads > 1
                    else jax.P(None, None, shd_config.fsdp_axis_name, None)
                )
            self.kv_einsum = nnx.Einsum(
                einsum_str="BTD,CKDH->CBTKH",
                kernel_shape=(2, num_kv_heads, features, head_dim),
                kernel_metadata={"out_sharding": kv_kernel_sharding},
                dtype=dtype,
                param_dtype=weight_dtype,
                rngs=rngs,
            )

        if self.use_qk_norm:
            self._query_norm = RMSNorm(
                head_dim,
                dtype=dtype,
                weight_dtype=weight_dtype,
                rngs=rngs,
            )
            self._key_norm = RMSNorm(
                head_dim,
                dtype=dtype,
                weight_dtype=weight_dtype,
                rngs=rngs,
            )

        self.dropout = nnx.Dropout(dropout_rate)

    def __call__(
        self,
        x: Array,
        segment_pos: Array,
        cache: LayerCache | None,
        attn_mask: Array,
        rngs: nnx.Rngs | None = None,
    ) -> tuple[LayerCache | None, Array]:
        seq_len = x.shape[1]

        if self.use_qkv_einsum:
            query_proj, key_proj, value_proj = self.qkv_einsum(
                x, out_sharding=self.shd_config.act_sbtnh
            )
        else:
            query_proj = self.q_einsum(x, out_sharding=self.shd_config.act_btnh)
            key_proj, value_proj = self.kv_einsum(x, out_sharding=self.act_cbtkh_shd)

        if self.use_qk_norm:
            query_proj = self._query_norm(query_proj)
            key_proj = self._key_norm(key_proj)

        query_proj = apply_rope(
            query_proj,
            segment_pos,
            head_dim=self.head_dim,
            max_wavelength=self.rope_base_frequency,
            scale_factor=self.rope_scale_factor,
        )
        query_scaled = query_proj * self.query_pre_attn_scalar
        key_proj = apply_rope(
            key_proj,
            segment_pos,
            head_dim=self.head_dim,
            max_wavelength=self.rope_base_frequency,
            scale_factor=self.rope_scale_factor,
        )

        # Cache is left aligned.
        if cache is not None:
            end_index = cache["end_index"][0]
            slice_indices = (0, end_index % cache["v"].shape[1], 0, 0)
            value_proj = jax.lax.dynamic_update_slice(
                cache["v"],
                value_proj,
                slice_indices,
            )
            key_proj = jax.lax.dynamic_update_slice(cache["k"], key_proj, slice_indices)

        use_gqa = self.num_heads > self.num_kv_heads and self.num_kv_heads > 1
        if use_gqa:
            # Reshape matrices to enable einsums over groups.
            num_groups = self.num_heads // self.num_kv_heads
            batch_size, seq_size, _, head_dim = query_scaled.shape
            query_scaled = query_scaled.reshape(
                (batch_size, seq_size, self.num_kv_heads, num_groups, head_dim)
            )
            logits = jnp.einsum("BTKGH,BSKH->BTKGS", query_scaled, key_proj)
            logits = logits.reshape((batch_size, seq_size, self.num_heads, -1))
        else:
            logits = jnp.einsum("BTNH,BSNH->BTNS", query_scaled, key_proj)

        if self.attn_logits_soft_cap is not None:
            logits = jnp.tanh(logits / self.attn_logits_soft_cap)
            logits = logits * self.attn_logits_soft_cap
        if self.attn_type == AttentionType.LOCAL_SLIDING:
            if self.sliding_window_size is None:
                raise ValueError("sliding_window_size must be set if attn_type is Local Sliding.")

            # workaround for a bug with triu/tril if all_ones is explicitly sharded
            # all_ones = jnp.ones_like(attn_mask)
            all_ones = jnp.ones(attn_mask.shape, dtype=attn_mask.dtype)
            sliding_mask = jnp.triu(all_ones, -1 * self.sliding_window_size + 1) * jnp.tril(
                all_ones, self.sliding_window_size - 1
            )
            attn_mask = sliding_mask * attn_mask

        padded_logits = jnp.where((jnp.expand_dims(attn_mask, -2)), logits, K_MASK)
        self.sow_config.maybe_sow_attn_logits_topk(padded_logits, self)
        probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)

        probs = self.dropout(probs, rngs=rngs)

        if use_gqa:
            # Reshape matrices to enable einsums over groups.
            num_groups = self.num_heads // self.num_kv_heads
            batch_size, seq_size1, _, _ = probs.shape
            probs = probs.reshape((batch_size, seq_size1, self.num_kv_heads, num_groups, -1))
            encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value_proj)
            encoded = encoded.reshape(
                (batch_size, seq_size, self.num_heads, head_dim)  # pyrefly: ignore[unbound-name]
            )
        else:
            encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, value_proj)
        attn_output = self.attn_vec_einsum(encoded, out_sharding=self.shd_config.act_btd)

        if cache is not None:
            new_cache = {
                "v": value_proj,
                "k": key_proj,
                "end_index": cache["end_index"] + seq_len,
            }
        else:
            new_cache = None

        return new_cache, attn_output

    @property
    def head_dim(self):
        return self.attn_vec_einsum.kernel.shape[1]

    @property
    def num_heads(self):
        return (
            self.qkv_einsum.kernel.shape[1]
            if self.use_qkv_einsum
            else self.q_einsum.kernel.shape[0]
        )

    @property
    def num_kv_heads(self):
        return (
            self.qkv_einsum.kernel.shape[1]
            if self.use_qkv_einsum
            else self.kv_einsum.kernel.shape[1]
        )

    @property
    def use_qkv_einsum(self):
        return hasattr(self, "qkv_einsum") and self.qkv_einsum is not None


class FeedForward(nnx.Module):
    """Feed forward module."""

    def __init__(
        self,
        features: int,
        hidden_dim: int,
        *,
        kernel_init: nnx.Initializer = nnx.initializers.normal(),
        rngs: nnx.Rngs,
        sow_config: SowConfig = SowConfig(),
        shd_config: ShardingConfig,
        dtype: jnp.dtype = jnp.float32,  # pyrefly: ignore[bad-function-definition]
        weight_dtype: jnp.dtype = jnp.float32,  # pyrefly: ignore[bad-function-definition]
        dropout_rate: float = 0.0,
    ):
        self.gate_proj = nnx.Linear(
            in_features=features,
            out_features=hidden_dim,
            use_bias=False,
            rngs=rngs,
            kernel_init=kernel_init,
            kernel_metadata={"out_sharding": shd_config.ffw_weight_df},
            dtype=dtype,
            param_dtype=weight_dtype,
        )
        self.up_proj = nnx.Linear(
            in_features=features,
            out_features=hidden_dim,
            use_bias=False,
            rngs=rngs,
            kernel_init=kernel_init,
            kernel_metadata={"out_sharding": shd_config.ffw_weight_df},
            dtype=dtype,
            param_dtype=weight_dtype,
        )
        self.down_proj = nnx.Linear(
            in_features=hidden_dim,
            out_features=features,
            use_bias=False,
            rngs=rngs,
            kernel_init=kernel_init,
            kernel_metadata={"out_sharding": shd_config.ffw_weight_fd},
            dtype=dtype,
            param_dtype=weight_dtype,
        )
        self.dropout = nnx.Dropout(dropout_rate)
        self.sow_config = sow_config
        self.shd_config = shd_config

    def __call__(self, x: Array, rngs: nnx.Rngs | None = None) -> Array:
        ff_gate = self.gate_proj(x, out_sharding=self.shd_config.act_btf)
        gate_value = nnx.gelu(ff_gate)

        ff1 = self.up_proj(x, out_sharding=self.shd_config.act_btf)
        activations = gate_value * ff1
        self.sow_config.maybe_sow_mlp_hidden_topk(activations, self)

        activations = self.dropout(activations, rngs=rngs)
        outputs = self.down_proj(activations, out_sharding=self.shd_config.act_btd)
        return outputs


class Block(nnx.Module):
    """Transformer block."""

    def __init__(
        self,
        config: TransformerConfig,
        attn_type: AttentionType,
        *,
        rngs: nnx.Rngs,
        sow_config: SowConfig = SowConfig(),
    ):
        num_heads = config.num_heads
        num_kv_heads = config.num_kv_heads
        embed_dim = config.embed_dim
        head_dim = config.head_dim
        hidden_dim = config.hidden_dim
        sliding_window_size = config.sliding_window_size
        use_post_attn_norm = config.use_post_attn_norm
        use_post_ffw_norm = config.use_post_ffw_norm
        query_pre_attn_scalar = config.query_pre_attn_scalar()
        if attn_type == AttentionType.LOCAL_SLIDING:
            rope_base_frequency = config.local_base_frequency
            rope_scale_factor = config.local_scale_factor
        else:
            rope_base_frequency = config.global_base_frequency
            rope_scale_factor = config.global_scale_factor

        attn_logits_soft_cap = config.attn_logits_soft_cap
        use_qk_norm = config.use_qk_norm
        dtype = config.dtype
        weight_dtype = config.weight_dtype

        self.pre_attention_norm = RMSNorm(
            embed_dim,
            scale_metadata={"out_sharding": config.shd_config.rms_norm_weight},
            rngs=rngs,
            dtype=dtype,
            weight_dtype=weight_dtype,
        )
        self.attn = Attention(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            features=embed_dim,
            head_dim=head_dim,
            query_pre_attn_scalar=query_pre_attn_scalar,
            attn_type=attn_type,
            rope_base_frequency=rope_base_frequency,
            rope_scale_factor=rope_scale_factor,
            attn_logits_soft_cap=attn_logits_soft_cap,
            sliding_window_size=sliding_window_size,
            rngs=rngs,
            use_qk_norm=use_qk_norm,
            sow_config=sow_config,
            shd_config=config.shd_config,
            dtype=dtype,
            weight_dtype=weight_dtype,
            dropout_rate=config.dropout_rate,
        )
        if use_post_attn_norm:
            self.post_attention_norm = RMSNorm(
                embed_dim,
                scale_metadata={"out_sharding": config.shd_config.rms_norm_weight},
                rngs=rngs,
                dtype=dtype,
                weight_dtype=weight_dtype,
            )
        else:
            self.post_attention_norm = None

        self.pre_ffw_norm = RMSNorm(
            embed_dim,
            scale_metadata={"out_sharding": config.shd_config.rms_norm_weight},
            rngs=rngs,
            dtype=dtype,
            weight_dtype=weight_dtype,
        )
        self.mlp = FeedForward(
            features=embed_dim,
            hidden_dim=hidden_dim,
            rngs=rngs,
            sow_config=sow_config,
            shd_config=config.shd_config,
            dtype=dtype,
            weight_dtype=weight_dtype,
            dropout_rate=config.dropout_rate,
        )
        if use_post_ffw_norm:
            self.post_ffw_norm = RMSNorm(
                embed_dim,
                scale_metadata={"out_sharding": config.shd_config.rms_norm_weight},
                rngs=rngs,
                dtype=dtype,
                weight_dtype=weight_dtype,
            )
        else:
            self.post_ffw_norm = None

        self.dropout = nnx.Dropout(config.dropout_rate)
        self.sow_config = sow_config

    def __call__(
        self,
        x: jax.Array,
        segment_pos: jax.Array,
        cache: LayerCache | None,
        attn_mask: jax.Array,
        rngs: nnx.Rngs | None = None,
    ) -> tuple[LayerCache | None, jax.Array]:

        # Attention.
        attn_inputs = self.pre_attention_norm(x)
        cache, attn_output = self.attn(
            attn_inputs,
            segment_pos,
            cache,
            attn_mask,
            rngs=rngs,
        )
        if self.post_attention_norm is not None:
            attn_output = self.post_attention_norm(attn_output)
        x += attn_output
        self.sow_config.maybe_sow_rs_after_attention(x, self)

        # Feed forward.
        ffw_inputs = self.pre_ffw_norm(x)
        ffw_outputs = self.mlp(ffw_inputs, rngs=rngs)
        if self.post_ffw_norm is not None:
            ffw_outputs = self.post_ffw_norm(ffw_outputs)
        x += ffw_outputs
        x = self.dropout(x, rngs=rngs)
        self.sow_config.maybe_sow_rs_after_ffw(x, self)

        return cache, x
