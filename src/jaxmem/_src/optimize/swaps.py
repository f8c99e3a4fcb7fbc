"""What :func:`jaxmem.optimize` with ``chunk_tokens=True`` swaps while it traces a function.

- ``jax.nn.dot_product_attention``'s XLA path runs as :func:`jaxmem.attention`. It (and Flax's
  ``nnx.dot_product_attention`` / ``nnx.MultiHeadAttention``, which call it without dropout)
  computes through one module function, looked up by name at each call (:data:`XLA_ATTENTION`,
  in :data:`jaxmem._src.jax_compat.nn_functions`). The lengths of the attentions swapped are
  recorded: the tokens' axis lengths of the token-wise regions
  (:mod:`jaxmem._src.chunking.tokens`).
- Equinox's ``eqx.nn.MultiheadAttention`` computes each head through
  ``equinox.nn._attention.dot_product_attention`` (looked up by name at each call): where
  Equinox is imported, it runs as :func:`jaxmem.attention` too, but with dropout on (its
  original then runs).
- ``jax.grad`` and ``jax.value_and_grad`` (which ``nnx.grad``, ``nnx.value_and_grad`` and
  Equinox's filtered ones call) differentiate the function as :func:`jaxmem.optimize` runs it:
  a train step's own loss is then chunked as a loss given to ``optimize`` is, its head and
  loss included, which JAX has differentiated by the time the step's jaxpr exists.

While a trace is swapping, each name is set in its module for every thread; the replacement
acts for the thread that swapped it and calls the original for any other.
"""

from __future__ import annotations

import contextlib
import math
import sys
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
# Equinox's per-head attention, (query, key_, value, mask=None, dropout=None, *, key=None,
# inference=None) on [T, H], [S, H], [S, H] and a [T, S] mask.
EQUINOX_ATTENTION = ("equinox.nn._attention", "dot_product_attention")


@contextlib.contextmanager
def swapping(record: list, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Within: this thread's calls of jax.nn's XLA attention run blocked, each appending
    ``(query length, key length, "file:line (function)")`` to ``record``; the functions
    ``jax.grad`` and ``jax.value_and_grad`` are given differentiate ``wrap(fun)``."""
    with (
        patching.replaced(_jc.nn_functions, XLA_ATTENTION, _blocked_xla, record),
        _swapping_equinox(record),
        patching.replaced(jax, "grad", _grad, wrap),
        patching.replaced(jax, "value_and_grad", _value_and_grad, wrap),
    ):
        yield


def _swapping_equinox(record: list):
    """Equinox's attention swapped where Equinox is imported (jaxmem does not import it)."""
    module = sys.modules.get(EQUINOX_ATTENTION[0])
    if not callable(getattr(module, EQUINOX_ATTENTION[1], None)):
        return contextlib.nullcontext()
    return patching.replaced(module, EQUINOX_ATTENTION[1], _blocked_equinox, record)


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
    return _run_blocked(
        record,
        (query, key, value, bias, mask, params["q_seqlen"], params["kv_seqlen"]),
        float(params["scale"]),
        bool(params["is_causal"]),
        _attention.window_of(params["local_window_size"]),
    )


def _run_blocked(record: list, arrays: tuple, scale: float, is_causal: bool, window):
    """:func:`jaxmem._src.attention.api.blocked` of ``arrays`` (query, key, value, bias, mask,
    q_seqlen, kv_seqlen; [B, T, N, H] inputs) with the default blocks, its lengths and the
    caller's line appended to ``record``."""
    b, t, n, _ = arrays[0].shape
    s = arrays[1].shape[1]
    record.append((t, s, _jc.summarize_source(_jc.current_source_info())))
    options = _attention.Options(
        scale,
        is_causal,
        window,
        _attention.default_block(t, b * n),
        _attention.default_block(s, b * n),
    )
    return _attention.blocked(options, *arrays)


def _blocked_equinox(query, key_, value, mask=None, dropout=None, *, key=None, inference=None):
    module = sys.modules[EQUINOX_ATTENTION[0]]
    record = patching.top(module, EQUINOX_ATTENTION[1])
    t, h = query.shape
    s = key_.shape[0]
    plain = (
        record is not None
        and not _dropout_on(dropout, inference)
        and key_.shape == (s, h)
        and value.shape == (s, h)  # jaxmem.attention's value has the query's head size
        and (mask is None or mask.shape == (t, s))  # else Equinox's own error
    )
    if not plain:
        original = patching.original(module, EQUINOX_ATTENTION[1])
        return original(query, key_, value, mask, dropout, key=key, inference=inference)
    q, k, v = (a[None, :, None, :] for a in (query, key_, value))
    mask = None if mask is None else mask[None, None]
    arrays = (q, k, v, None, mask, None, None)
    return _run_blocked(record, arrays, 1.0 / math.sqrt(h), False, None)[0, :, 0, :]


def _dropout_on(dropout, inference) -> bool:
    """Whether Equinox's ``dropout(weights, key=..., inference=inference)`` drops anything
    (its own rule: off in inference mode or at p == 0)."""
    if dropout is None:
        return False
    off = getattr(dropout, "inference", False) if inference is None else inference
    p = getattr(dropout, "p", None)
    return not (off is True or (isinstance(p, (int, float)) and p == 0))


_PARAMS = ("is_causal", "scale", "q_seqlen", "kv_seqlen", "local_window_size", "return_residual")


def _xla_params(*args, **kwargs) -> dict:
    params = dict(zip(_PARAMS, args, strict=False))
    params.update(kwargs)
    params.setdefault("return_residual", False)
    return params


NO_ATTENTION = (
    "chunk_tokens: no jax.nn.dot_product_attention call on the XLA path and no Equinox "
    "attention: no sequence length to chunk over, nothing chunked"
)
"""What ``explain`` says where no attention was swapped."""


def warn_no_attention() -> None:
    """``option_noop`` for ``chunk_tokens=True`` where the trace called no attention it runs
    blocked: no token length is known, so nothing is chunked along the tokens."""
    _findings.report(
        "option_noop",
        "chunk_tokens=True",
        "found no jax.nn.dot_product_attention call on its XLA path (nnx.MultiHeadAttention's "
        "included) and no eqx.nn.MultiheadAttention, so nothing is chunked along the tokens: "
        "attention written with einsums or Flax linen's is not recognised "
        "(docs/long_context.md)",
        _findings.user_site(),
    )
