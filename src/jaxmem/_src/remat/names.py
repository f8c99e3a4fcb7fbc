"""The checkpoint-name vocabulary: one name per activation of a transformer block.

Name-based remat policies (:mod:`jaxmem.policies`: ``save``, ``offload``, ``custom``,
``selective``) select values by the names given with :func:`name`, a checked
:func:`jax.ad_checkpoint.checkpoint_name`. This module is the one place where the names and their
meanings are written down (:data:`NAMES`); models tag their activations with them, and policies
check against them, so a typo is an error rather than a policy that silently saves nothing.

The names follow MaxText's ``remat_policy: custom`` map where it has one (``decoder_layer_input``,
``query_proj``, ``key_proj``, ``value_proj``, ``qkv_proj``, ``attention_out``, ``out_proj``);
MaxText's ``mlpwi`` and ``mlpwo`` are ``mlp_in`` and ``mlp_out`` here, and ``attention_scores``,
``attention_probs`` and ``mlp_act`` name the values that selective recomputation (Korthikanti
et al. 2022) and activation-heavy MLPs need to tell apart.

Shapes use ``b`` batch, ``s`` sequence, ``d`` model width, ``a`` heads, ``k`` head width
(``d = a * k``) and ``f`` MLP width.

Examples:
  >>> import jax.numpy as jnp
  >>> from jaxmem._src.remat.names import NAMES, name
  >>> NAMES["qkv_proj"]
  'fused query/key/value projection output, [b, s, 3, a, k] (or any layout holding q, k and v)'
  >>> name(jnp.ones(3), "qkv_proj").shape
  (3,)

References:
  Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022,
  https://arxiv.org/abs/2205.05198 (section 4.2: the activations of a transformer layer).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import MappingProxyType
from typing import Any

from jax.ad_checkpoint import checkpoint_name
from jax.extend import source_info_util as _siu

# A named value's equation records the line that called name(), as one that called
# jax.ad_checkpoint.checkpoint_name would, not this module's (what profiles show as its source).
_siu.register_exclusion(__file__)

NAMES = MappingProxyType(
    {
        "decoder_layer_input": (
            "input of a transformer layer (the residual stream entering it), [b, s, d]; in a "
            "scanned stack this is the carry"
        ),
        "query_proj": "query projection output, [b, s, a, k] (when q, k, v are separate)",
        "key_proj": "key projection output, [b, s, a, k] (when q, k, v are separate)",
        "value_proj": "value projection output, [b, s, a, k] (when q, k, v are separate)",
        "qkv_proj": (
            "fused query/key/value projection output, [b, s, 3, a, k] (or any layout holding "
            "q, k and v)"
        ),
        "attention_scores": (
            "attention logits q k^T / sqrt(k), masked, input of the softmax, [b, a, s, s]"
        ),
        "attention_probs": (
            "attention probabilities softmax(scores) (after attention dropout, if any), "
            "[b, a, s, s]"
        ),
        "attention_out": (
            "attention output probs @ v per head, input of the output projection, [b, s, a, k]"
        ),
        "out_proj": "attention output projection, added to the residual stream, [b, s, d]",
        "mlp_in": "first MLP matmul output (pre-activation; MaxText's mlpwi), [b, s, f]",
        "mlp_act": "MLP activation (e.g. gelu(mlp_in)), input of the second matmul, [b, s, f]",
        "mlp_out": (
            "second MLP matmul output (MaxText's mlpwo), added to the residual stream, [b, s, d]"
        ),
    }
)
"""Standard checkpoint names -> one-line meaning (read-only)."""

ATTENTION_CORE = ("attention_scores", "attention_probs")
"""The names of the ``[b, a, s, s]`` attention core, recomputed by ``selective()``."""


def _names_list() -> str:
    return ", ".join(NAMES)


def check_name(
    value: Any, *, allow_unknown: bool = False, what: str = "name", caller: str = "jaxmem.name"
) -> str:
    """Returns ``value`` if it is a str in :data:`NAMES` (any str with ``allow_unknown``).

    Args:
      value: the name to check.
      allow_unknown: accept a str outside the vocabulary (a user's own name).
      what: how the caller calls the argument, for the error message.
      caller: the public function checking, the first word of the error message.

    Returns:
      ``value``, unchanged.

    Raises:
      TypeError: ``value`` is not a str.
      ValueError: ``value`` is not in :data:`NAMES` and ``allow_unknown`` is False; the message
        lists the vocabulary and says how to use a name of one's own.

    Examples:
      >>> check_name("mlp_in")
      'mlp_in'
      >>> check_name("my_value", allow_unknown=True)
      'my_value'
      >>> check_name("mlpwi")
      Traceback (most recent call last):
        ...
      ValueError: jaxmem.name: unknown checkpoint name 'mlpwi'; the standard names are ...
    """
    if not isinstance(value, str):
        raise TypeError(
            f"{caller}: {what} must be a str (a checkpoint name), got "
            f"{type(value).__name__} ({value!r})"
        )
    if value not in NAMES and not allow_unknown:
        raise ValueError(
            f"{caller}: unknown checkpoint name {value!r}; the standard names are {_names_list()} "
            "(see jaxmem.NAMES for their meanings). To use a name of your own, pass "
            "allow_unknown=True."
        )
    return value


def check_names(
    values: Iterable[Any],
    *,
    allow_unknown: bool = False,
    what: str = "names",
    caller: str = "jaxmem.name",
) -> tuple[str, ...]:
    """Checks every name with :func:`check_name`; returns them sorted, without duplicates.

    Examples:
      >>> check_names(["mlp_in", "qkv_proj", "mlp_in"])
      ('mlp_in', 'qkv_proj')
    """
    if isinstance(values, str):
        raise TypeError(f"{caller}: {what} must be a collection of names, got the str {values!r}")
    checked = {
        check_name(v, allow_unknown=allow_unknown, what=f"{what} entry", caller=caller)
        for v in values
    }
    return tuple(sorted(checked))


def name(x: Any, name: str, *, allow_unknown: bool = False) -> Any:
    """Tags ``x`` with a checkpoint name from the vocabulary, for name-based remat policies.

    The identity on values: :func:`jax.ad_checkpoint.checkpoint_name` with a check that ``name``
    is one of :data:`NAMES` (the check runs before tracing, so a typo fails loudly instead of
    leaving a policy with nothing to select).

    Args:
      x: an array or a pytree of arrays.
      name: a name from :data:`NAMES` (``"decoder_layer_input"``, ``"qkv_proj"``, ...).
      allow_unknown: the escape hatch: accept a name outside the vocabulary. Policies that
        select it must then be built with ``allow_unknown=True`` too.

    Returns:
      ``x``, unchanged, with every leaf named ``name`` inside :func:`jax.checkpoint`.

    Raises:
      TypeError: ``name`` is not a str.
      ValueError: ``name`` is not in :data:`NAMES` (the message lists them) and
        ``allow_unknown`` is False.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmem._src.remat.names import name
      >>> def mlp(x, w):
      ...     return jnp.sum(jnp.tanh(name(x @ w, "mlp_in")))
      >>> policy = jax.checkpoint_policies.save_only_these_names("mlp_in")
      >>> x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
      >>> jax.grad(jax.checkpoint(mlp, policy=policy))(x, w).shape
      (2, 3)
      >>> name(x, "my_tensor", allow_unknown=True).shape
      (2, 3)
      >>> name(x, "mlp_input")
      Traceback (most recent call last):
        ...
      ValueError: jaxmem.name: unknown checkpoint name 'mlp_input'; the standard names are ...
    """
    return checkpoint_name(x, check_name(name, allow_unknown=allow_unknown))
