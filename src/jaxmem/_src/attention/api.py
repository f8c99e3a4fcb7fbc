""":func:`attention`: :func:`jax.nn.dot_product_attention`'s values and gradients without its
``[B, N, T, S]`` logits (:mod:`.blocks` computes it block by block)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxmem._src import jax_compat as _jc
from jaxmem._src import vjp_primitive as _vjp_primitive
from jaxmem._src.attention import blocks as _blocks

_jc.register_source_exclusion(__file__)  # its equations are at the caller's line
NAME = "attention"  # the primitive's name in a jaxpr (jax >= 0.11)
_CALLER = "jaxmem.attention"
# A block's logits [B, N, bq, bk] in float32 stay under this many bytes (a few live at once);
# blocks are powers of two from _MIN_BLOCK to _MAX_BLOCK rows.
_BLOCK_BYTES = 8 * 2**20
_MIN_BLOCK = 64
_MAX_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class Options:
    """What :func:`attention` computes, checked once: the static half of a call."""

    scale: float
    is_causal: bool
    window: tuple[int, int] | None
    block_q: int
    block_k: int

    def geometry(self, t: int, s: int, masked_rows: bool) -> _blocks.Geometry:
        # Leaving out blocks no query sees is exact only where every row keeps a key: a row
        # masked whole is jax.nn's average over every key, the left-out ones included.
        limited = self.is_causal or self.window is not None
        skip = limited and not masked_rows and (self.window is None or self.is_causal or t <= s)
        return _blocks.Geometry(
            t, s, self.block_q, self.block_k, self.is_causal, self.window, skip, self.scale
        )


def default_block(length: int, batch_heads: int) -> int:
    """The block size along a sequence of ``length`` for ``batch_heads`` = B * N logit rows
    per query: the largest power of two up to 512, and below the length, whose square block of
    logits fits 8 MiB in float32, at least 64. Below the length: one block spanning the
    sequence is dense attention with the online softmax's extra buffers (1.0x-1.7x jax.nn's
    gradient temp, measured), two already keep less.

    Examples:
      >>> default_block(4096, 4), default_block(100, 4), default_block(512, 4)
      (512, 64, 256)
      >>> default_block(4096, 256)
      64
    """
    block = _MAX_BLOCK
    while block > _MIN_BLOCK and block >= length:
        block //= 2
    while block > _MIN_BLOCK and batch_heads * block * block * 4 > _BLOCK_BYTES:
        block //= 2
    return block


def _check_arrays(q, k, v, bias, mask, q_len, kv_len) -> None:
    b, s, kh, h = k.shape
    if v.shape[:3] != (b, s, kh):
        raise ValueError(
            f"{_CALLER}: value's shape {v.shape} must be [B, S, K, H] = key's {k.shape}"
        )
    if q.shape[0] != b or q.shape[-1] != h:
        raise ValueError(
            f"{_CALLER}: query's shape {q.shape} must be [B, T, N, H] with key's B={b} and H={h}"
        )
    if q.shape[2] % kh:
        raise ValueError(
            f"{_CALLER}: the number of query heads ({q.shape[2]}) must be a multiple of key/value "
            f"heads ({kh})"
        )
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(
            f"{_CALLER}: query, key and value must share a dtype, got {q.dtype}, {k.dtype}, "
            f"{v.dtype}"
        )
    _check_logit_arrays(bias, mask, (b, q.shape[2], q.shape[1], s))
    for name, x in (("query_seq_lengths", q_len), ("key_value_seq_lengths", kv_len)):
        if x is not None and (x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer)):
            raise ValueError(f"{_CALLER}: {name} must be an integer array of shape ({b},)")


def _check_logit_arrays(bias, mask, full: tuple) -> None:
    for name, x in (("bias", bias), ("mask", mask)):
        if x is None:
            continue
        if x.ndim != 4 or any(d not in (1, f) for d, f in zip(x.shape, full, strict=True)):
            raise ValueError(
                f"{_CALLER}: {name}'s shape {x.shape} must broadcast to [B, N, T, S] = {full}"
            )
    if mask is not None and mask.dtype != np.bool_:
        raise ValueError(f"{_CALLER}: mask must be boolean, got {mask.dtype}")


def window_of(local_window_size) -> tuple[int, int] | None:
    if local_window_size is None:
        return None
    if isinstance(local_window_size, int):
        return (local_window_size, local_window_size)
    if (
        isinstance(local_window_size, tuple)
        and len(local_window_size) == 2
        and all(isinstance(w, int) and w >= 0 for w in local_window_size)
    ):
        return local_window_size
    raise ValueError(
        f"{_CALLER}: local_window_size must be an int or a (left, right) pair of non-negative "
        f"ints, got {local_window_size!r}"
    )


def _block_option(value, name: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{_CALLER}: {name} must be a positive int, got {value!r}")
    return value


def _ensure_4d(x):
    return None if x is None else jnp.expand_dims(x, tuple(range(4 - x.ndim)))


def attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: int | tuple[int, int] | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
):
    """Scaled dot-product attention in blocks: :func:`jax.nn.dot_product_attention`'s values and
    gradients, with no ``[T, S]`` array per head.

    The arguments are :func:`jax.nn.dot_product_attention`'s: ``query [B, T, N, H]``, ``key`` and
    ``value [B, S, K, H]`` (``[T, N, H]`` without the batch), grouped-query attention where
    ``K < N`` (``N`` a multiple of ``K``), a boolean ``mask`` and a ``bias`` broadcastable to
    ``[B, N, T, S]``, ``is_causal``, the sequence lengths and a local window. The logits are
    computed in blocks of ``block_q`` queries by ``block_k`` keys with an online softmax in
    float32 (FlashAttention-2's schedule); the gradient recomputes each block from the softmax's
    maximum and normalizer it keeps (two floats per query and head), so what the backward keeps is
    the inputs, the output and those. Blocks no query sees (above the causal diagonal, outside the
    window) are not computed. Forward mode, ``jax.vmap`` and sharded inputs work as for any JAX
    function; on jax < 0.11 it is a ``jax.custom_vjp`` (reverse mode only).


    Where a fused kernel exists (``implementation="cudnn"`` on NVIDIA GPUs, Pallas' flash
    attention on TPU) it is faster; this is for the XLA path (CPU, and GPU/TPU without such a
    kernel), and what :func:`jaxmem.optimize` puts in place of it with ``chunk_tokens=True``.

    Args:
      query, key, value: ``[B, T, N, H]``, ``[B, S, K, H]``, ``[B, S, K, H]``.
      bias, mask: broadcastable to ``[B, N, T, S]``; the mask boolean.
      scale, is_causal: as :func:`jax.nn.dot_product_attention` (scale: ``1 / sqrt(H)``).
      query_seq_lengths, key_value_seq_lengths: ``[B]`` integers, as jax.nn's.
      local_window_size: an int or ``(left, right)``, as jax.nn's.
      block_q, block_k: the block sizes (default: a power of two up to 512 from each length,
        smaller where many heads would make a block's logits over 8 MiB).

    Returns:
      ``[B, T, N, H]`` (``[T, N, H]`` for three-dimensional inputs), in ``value``'s dtype.

    Raises:
      ValueError: shapes or dtypes :func:`jax.nn.dot_product_attention` refuses, a bad window
        or block size.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 256, 2, 16))
      >>> out = jaxmem.attention(q, k, v, is_causal=True, block_q=64, block_k=64)
      >>> ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
      >>> bool(jnp.allclose(out, ref, atol=1e-5))
      True
    """
    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    three_d = q.ndim == 3
    if q.ndim not in (3, 4) or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(
            f"{_CALLER}: query, key and value must be [B, T, N, H] (or [T, N, H]), got shapes "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    q, k, v = (_ensure_4d(x) for x in (q, k, v))
    bias = _ensure_4d(None if bias is None else jnp.asarray(bias))
    mask = _ensure_4d(None if mask is None else jnp.asarray(mask))
    q_len = None if query_seq_lengths is None else jnp.asarray(query_seq_lengths)
    kv_len = None if key_value_seq_lengths is None else jnp.asarray(key_value_seq_lengths)
    _check_arrays(q, k, v, bias, mask, q_len, kv_len)
    b, t, n, _ = q.shape
    s = k.shape[1]
    options = Options(
        1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale),
        bool(is_causal),
        window_of(local_window_size),
        _block_option(block_q, "block_q", default_block(t, b * n)),
        _block_option(block_k, "block_k", default_block(s, b * n)),
    )
    out = blocked(options, q, k, v, bias, mask, q_len, kv_len)
    return out[0] if three_d else out


def blocked(options: Options, q, k, v, bias, mask, q_len, kv_len):
    """:func:`attention` on checked four-dimensional arrays (what :mod:`jaxmem.optimize` binds
    in place of jax.nn's XLA path)."""
    b, t, n, _ = q.shape
    masked_rows = mask is not None or kv_len is not None
    g = options.geometry(t, k.shape[1], masked_rows)
    out = _core(g)(q, k, v, bias, mask, q_len, kv_len)
    if q_len is not None:  # as jax.nn: the queries past a sequence's length give zeros
        out = out * (jnp.arange(t)[None, :] < q_len[:, None])[:, :, None, None].astype(out.dtype)
    return out


def _pad(x, axis: int, length: int):
    """``x`` padded with zeros to ``length`` along ``axis`` (itself where it is that long)."""
    if x.shape[axis] in (1, length):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths)


def _padded(x, tp: int, sp: int):
    """A ``[B|1, N|1, T|1, S|1]`` bias or mask padded to ``[B|1, N|1, Tp|1, Sp|1]``."""
    return _pad(_pad(x, 2, tp), 3, sp)


def _core(g: _blocks.Geometry):
    """The blocked attention with its recomputing backward. It takes the caller's arrays and
    pads and groups them inside, so that what its gradient keeps is those arrays, not copies."""
    tp, sp = g.nq * g.bq, g.nk * g.bk

    def inputs(q, k, v, bias, mask, q_len, kv_len):
        b, _, n, _ = q.shape
        kh = k.shape[2]
        padded = lambda x: None if x is None else _padded(x, tp, sp)
        qg = _pad(q, 1, tp).reshape(b, tp, kh, n // kh, -1)
        kp, vp = _pad(k, 1, sp), _pad(v, 1, sp)
        return _blocks.Inputs(qg, kp, vp, padded(bias), padded(mask), q_len, kv_len)

    def output(out, q):
        b, t, n, _ = q.shape
        return out[:, :t].reshape(b, t, n, -1)

    def fun(*args):
        out, _, _ = _blocks.forward(g, inputs(*args))
        return output(out.astype(args[2].dtype), args[0])

    def fwd(*args, nonzeros):
        out, m, norm = _blocks.forward(g, inputs(*args))
        out = out.astype(args[2].dtype)
        # Whether the bias has a tangent, as the residuals' structure (no array).
        wants_dbias = (None,) if args[3] is not None and nonzeros[3] else ()
        return output(out, args[0]), (args, out, (m, norm), wants_dbias)

    def bwd(res, d_out):
        args, out, stats, wants_dbias = res
        q, k, v, bias = args[:4]
        a = inputs(*args)
        d_out = _pad(d_out, 1, tp).reshape(out.shape)
        dq, dk, dv, dbias = _blocks.backward(g, a, out, stats, d_out, bool(wants_dbias))
        return (
            dq[:, : q.shape[1]].reshape(q.shape).astype(q.dtype),
            dk[:, : k.shape[1]].astype(k.dtype),
            dv[:, : v.shape[1]].astype(v.dtype),
            None
            if dbias is None
            else dbias[:, :, : bias.shape[2], : bias.shape[3]].astype(bias.dtype),
            None,
            None,
            None,
        )

    return _vjp_primitive.custom_vjp(fun, fwd=fwd, bwd=bwd, name=NAME, nonzeros=True)
