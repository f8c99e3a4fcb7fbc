"""Memory-lean losses: :func:`linear_cross_entropy` never materializes the [N, V] logits.

With the output projection sharded over the vocabulary on a mesh axis
(``linear_cross_entropy(..., vocab_axis="model")``, inferred under an Explicit mesh), it is
vocabulary-parallel: no device holds all of ``w`` or all logits of a token.

Examples:
  >>> import jax.numpy as jnp
  >>> from jaxmem import losses
  >>> x, w = jnp.ones((4, 8)), jnp.zeros((8, 10))
  >>> float(losses.linear_cross_entropy(x, w, jnp.arange(4), chunk_size=4))  # log(10)
  2.302585...
"""

from jaxmem._src.losses.linear_ce import linear_cross_entropy as linear_cross_entropy
from jaxmem._src.losses.linear_ce_config import default_tiles as default_tiles

__all__ = [
    "default_tiles",
    "linear_cross_entropy",
]
