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

"""Flax's lm1b decoder layer (``examples/lm1b/models.py``), vendored for the lm1b benchmark.

Vendored from Flax 0.12.12 (``examples/lm1b/models.py`` of the ``flax`` sdist on PyPI,
https://github.com/google/flax, Apache License 2.0, Copyright 2024 The Flax Authors), trimmed to
what a stacked decoder layer needs: ``TransformerConfig`` (only the fields the layer reads),
``MlpBlock`` and ``EncoderDecoder1DBlock``, whose code is as written there (reformatted by ruff).
``PairBlock`` (the layer in ``nn.scan``'s ``(carry, y)`` form) and :func:`stack` are jaxmem's.
Used by :mod:`benchmarks.lm1b` and ``tests/flax/test_lm1b.py``; the jaxmem library never imports it.
"""

# pylint: disable=attribute-defined-outside-init
# See issue #620.

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import linen as nn
from flax import struct


@struct.dataclass
class TransformerConfig:
    """Global hyperparameters used to minimize obnoxious kwarg plumbing.

    (The fields of Flax's lm1b ``TransformerConfig`` that the decoder layer reads.)
    """

    dtype: Any = jnp.float32
    num_heads: int = 8
    qkv_dim: int = 512
    mlp_dim: int = 2048
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    deterministic: bool = False
    decode: bool = False
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-6)


class MlpBlock(nn.Module):
    """Transformer MLP / feed-forward block.

    Args:
      config: TransformerConfig dataclass containing hyperparameters.
      out_dim: optionally specify out dimension.
    """

    config: TransformerConfig
    out_dim: int | None = None

    @nn.compact
    def __call__(self, inputs):
        """Applies Transformer MlpBlock module."""
        config = self.config
        actual_out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
        x = nn.Dense(
            config.mlp_dim,
            dtype=config.dtype,
            kernel_init=nn.with_logical_partitioning(config.kernel_init, ("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(config.bias_init, ("mlp",)),
        )(inputs)
        x = nn.relu(x)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        output = nn.Dense(
            actual_out_dim,
            dtype=config.dtype,
            kernel_init=nn.with_logical_partitioning(config.kernel_init, ("mlp", "embed")),
            bias_init=nn.with_logical_partitioning(config.bias_init, ("embed",)),
        )(x)
        output = nn.Dropout(rate=config.dropout_rate)(output, deterministic=config.deterministic)
        return output


class EncoderDecoder1DBlock(nn.Module):
    """Transformer encoder-decoder layer.

    Args:
      config: TransformerConfig dataclass containing hyperparameters.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None, encoder_decoder_mask=None):
        """Applies EncoderDecoder1DBlock module.

        Args:
          inputs: input data for decoder
          decoder_mask: decoder self-attention mask.
          encoder_decoder_mask: encoder-decoder attention mask.

        Returns:
          output after transformer encoder-decoder block.
        """
        config = self.config

        # Decoder block.
        assert inputs.ndim == 3
        x = nn.LayerNorm(
            dtype=config.dtype,
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        )(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=config.num_heads,
            dtype=config.dtype,
            qkv_features=config.qkv_dim,
            kernel_init=nn.with_logical_partitioning(config.kernel_init, ("embed", "kv")),
            bias_init=nn.with_logical_partitioning(config.bias_init, ("embed",)),
            use_bias=False,
            broadcast_dropout=False,
            dropout_rate=config.attention_dropout_rate,
            deterministic=config.deterministic,
            decode=config.decode,
        )(x, mask=decoder_mask)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x + inputs

        # MLP block.
        z = nn.LayerNorm(
            dtype=config.dtype,
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        )(x)
        z = MlpBlock(config=config)(z)

        return x + z


# --- jaxmem's: the layer stacked with a scan transform -------------------------------------------


class PairBlock(EncoderDecoder1DBlock):
    """The decoder layer in ``nn.scan``'s ``(carry, y)`` form: ``(x, mask) -> (layer(x), None)``."""

    def __call__(self, inputs, decoder_mask):
        return EncoderDecoder1DBlock.__call__(self, inputs, decoder_mask), None


def stack(scan, config: TransformerConfig, layers: int, *, remat_policy=None, **scan_kwargs):
    """The decoder layer stacked ``layers`` times with ``scan`` (``nn.scan`` or jaxmem's).

    Params are stacked along axis 0 (named ``layers`` in their logical partitioning), the
    ``params`` and ``dropout`` streams split per layer, the decoder mask broadcast to every
    layer. Call as ``stack(...)(x, decoder_mask) -> (x, None)``.

    Args:
      scan: ``flax.linen.scan`` or ``jaxmem.flax.linen.scan``.
      config: the layer's hyperparameters.
      layers: how many layers.
      remat_policy: when given, the layer is wrapped in ``nn.remat(policy=..., prevent_cse=False)``
        first (the ``nn.scan`` way of rematerializing each layer).
      **scan_kwargs: passed to ``scan`` (e.g. jaxmem's ``policy=``).

    Returns:
      The stacked module (an instance, bound to ``config``).
    """
    cls = PairBlock
    if remat_policy is not None:
        cls = nn.remat(cls, policy=remat_policy, prevent_cse=False)
    stacked = scan(
        cls,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast,),
        length=layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
        **scan_kwargs,
    )
    return stacked(config=config)
