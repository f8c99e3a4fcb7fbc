"""``jax.nn.dot_product_attention``'s XLA path run as :func:`jaxmem.attention` while
:func:`jaxmem.optimize` (``chunk_tokens=True``) traces a function.

``jax.nn.dot_product_attention`` (and Flax's ``nnx.dot_product_attention`` /
``nnx.MultiHeadAttention``, which call it without dropout) computes on XLA through one module
function, looked up by name at each call (:data:`XLA_ATTENTION`, in
:data:`jaxmem._src.jax_compat.nn_functions`). While a
trace is catching (:func:`swapping`), that name is :func:`_blocked_xla` in every thread, which
runs the blocked attention for the catching thread and the original for any other; the lengths
of the attentions swapped are recorded, the tokens' axis lengths of the token-wise regions
(:mod:`jaxmem._src.chunking.tokens`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from jaxmem._src import jax_compat as _jc
from jaxmem._src.attention import api as _attention

_STATE = threading.local()  # .records: this thread's active records, innermost last
_LOCK = threading.Lock()
_ACTIVE = [0]
# Called as (query, key, value, bias, mask, is_causal, scale, q_seqlen, kv_seqlen,
# local_window_size, return_residual), the last six by keyword (0.10.2 and 0.12).
XLA_ATTENTION = "_dot_product_attention_xla"
_ORIGINAL = getattr(_jc.nn_functions, XLA_ATTENTION)
_jc.register_source_exclusion(__file__)  # an attention swapped is at its caller's line


@contextlib.contextmanager
def swapping(record: list) -> Iterator[None]:
    """Within: this thread's calls of jax.nn's XLA attention run blocked, each appending
    ``(query length, key length, "file:line (function)")`` to ``record``."""
    stack = _records()
    stack.append(record)
    with _LOCK:
        if _ACTIVE[0] == 0:
            setattr(_jc.nn_functions, XLA_ATTENTION, _blocked_xla)
        _ACTIVE[0] += 1
    try:
        yield
    finally:
        stack.pop()
        with _LOCK:
            _ACTIVE[0] -= 1
            if _ACTIVE[0] == 0:
                setattr(_jc.nn_functions, XLA_ATTENTION, _ORIGINAL)


def _records() -> list:
    if not hasattr(_STATE, "records"):
        _STATE.records = []
    return _STATE.records


def _blocked_xla(query, key, value, bias, mask, *args, **kwargs):
    params = _xla_params(*args, **kwargs)
    stack = _records()
    if not stack or params["return_residual"]:
        return _ORIGINAL(query, key, value, bias, mask, *args, **kwargs)
    b, t, n, _ = query.shape
    s = key.shape[1]
    stack[-1].append((t, s, _jc.summarize_source(_jc.current_source_info())))
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
