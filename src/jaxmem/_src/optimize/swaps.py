"""What :func:`jaxmem.optimize` with ``chunk_tokens=True`` swaps while it traces a function.

- ``jax.nn.dot_product_attention``'s XLA path runs as :func:`jaxmem.attention`. It (and Flax's
  ``nnx.dot_product_attention`` / ``nnx.MultiHeadAttention``, which call it without dropout)
  computes through one module function, looked up by name at each call (:data:`XLA_ATTENTION`,
  in :data:`jaxmem._src.jax_compat.nn_functions`). The lengths of the attentions swapped are
  recorded: the tokens' axis lengths of the token-wise regions
  (:mod:`jaxmem._src.chunking.tokens`).
- ``jax.grad`` and ``jax.value_and_grad`` (which ``nnx.grad``, ``nnx.value_and_grad`` and
  Equinox's filtered ones call) differentiate the function as :func:`jaxmem.optimize` runs it:
  a train step's own loss is then chunked as a loss given to ``optimize`` is, its head and
  loss included, which JAX has differentiated by the time the step's jaxpr exists.

While a trace is swapping, each name is set in its module for every thread; the replacement
acts for the thread that swapped it and calls the original for any other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax

from jaxmem._src import jax_compat as _jc
from jaxmem._src.attention import api as _attention
from jaxmem._src.optimize import patching
from jaxmem._src.scan import findings as _findings

# Called as (query, key, value, bias, mask, is_causal, scale, q_seqlen, kv_seqlen,
# local_window_size, return_residual), the last six by keyword (0.10.2 and 0.12).
XLA_ATTENTION = "_dot_product_attention_xla"
_ORIGINAL = getattr(_jc.nn_functions, XLA_ATTENTION)
_GRAD, _VALUE_AND_GRAD = jax.grad, jax.value_and_grad
_jc.register_source_exclusion(__file__)  # an attention swapped is at its caller's line


@contextlib.contextmanager
def swapping(record: list, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Within: this thread's calls of jax.nn's XLA attention run blocked, each appending
    ``(query length, key length, "file:line (function)")`` to ``record``; the functions
    ``jax.grad`` and ``jax.value_and_grad`` are given differentiate ``wrap(fun)``."""
    with (
        patching.replaced(_jc.nn_functions, XLA_ATTENTION, _blocked_xla, record),
        patching.replaced(jax, "grad", _grad, wrap),
        patching.replaced(jax, "value_and_grad", _value_and_grad, wrap),
    ):
        yield


def _grad(fun, *args, **kwargs):
    wrap = patching.top(jax, "grad")
    return _GRAD(fun if wrap is None else wrap(fun), *args, **kwargs)


def _value_and_grad(fun, *args, **kwargs):
    wrap = patching.top(jax, "value_and_grad")
    return _VALUE_AND_GRAD(fun if wrap is None else wrap(fun), *args, **kwargs)


def _blocked_xla(query, key, value, bias, mask, *args, **kwargs):
    params = _xla_params(*args, **kwargs)
    record = patching.top(_jc.nn_functions, XLA_ATTENTION)
    if record is None or params["return_residual"]:
        return _ORIGINAL(query, key, value, bias, mask, *args, **kwargs)
    b, t, n, _ = query.shape
    s = key.shape[1]
    record.append((t, s, _jc.summarize_source(_jc.current_source_info())))
    options = _attention.Options(
        float(params["scale"]),
        bool(params["is_causal"]),
        _attention.window_of(params["local_window_size"]),
        _attention.default_block(t, b * n),
        _attention.default_block(s, b * n),
    )
    return _attention.blocked(
        options, query, key, value, bias, mask, params["q_seqlen"], params["kv_seqlen"]
    )


_PARAMS = ("is_causal", "scale", "q_seqlen", "kv_seqlen", "local_window_size", "return_residual")


def _xla_params(*args, **kwargs) -> dict:
    params = dict(zip(_PARAMS, args, strict=False))
    params.update(kwargs)
    params.setdefault("return_residual", False)
    return params


NO_ATTENTION = (
    "chunk_tokens: no jax.nn.dot_product_attention call on the XLA path: no sequence length to "
    "chunk over, nothing chunked"
)
"""What ``explain`` says where no attention was swapped."""


def warn_no_attention() -> None:
    """``option_noop`` for ``chunk_tokens=True`` where the trace called no attention it runs
    blocked: no token length is known, so nothing is chunked along the tokens."""
    _findings.report(
        "option_noop",
        "chunk_tokens=True",
        "found no jax.nn.dot_product_attention call on its XLA path (nnx.MultiHeadAttention's "
        "included), so nothing is chunked along the tokens: attention written with einsums, "
        "Flax linen's or Equinox's is not recognised (docs/long_context.md)",
        _findings.user_site(),
    )
