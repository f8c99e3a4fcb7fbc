"""Attention in blocks of queries and keys: an online softmax forward and a backward that
recomputes each block (FlashAttention-2's schedule, written in ``lax`` loops).

Arrays are grouped by key head: queries ``[B, T, K, G, H]`` (``N = K * G`` query heads, ``G`` per
key head), keys ``[B, S, K, H]``, values ``[B, S, K, Hv]``; a block's logits are
``[B, K, G, bq, bk]``. ``T`` and ``S`` are padded to whole blocks (padded keys get ``-inf``
logits, padded queries are dropped), so no length needs to divide.

The forward keeps, per query, the running maximum and sum of the softmax and the weighted sum of
values, and returns the output with each row's maximum and normalizer; the backward loops over key
blocks, each over the query blocks that see it, recomputing the block's probabilities from them.
Blocks that no query of the block sees (above the causal diagonal, outside a local window) are never
visited. Masked logits take the value :func:`jax.nn.dot_product_attention` gives them (``-0.7 *
float32 max``), so a row with every key masked averages the values as it does.

"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmem._src import jax_compat as _jc
from jaxmem._src import vjp_primitive as _vjp_primitive

_jc.register_source_exclusion(__file__)  # its equations are at the caller's line
# jax.nn's masked logit: finite, so that a fully masked row is a uniform average, not NaN.
MASKED = float(-0.7 * np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The static shape of one attention: lengths, block sizes, and which blocks are visited.

    Attributes:
      t, s: the query and key lengths.
      bq, bk: the block sizes along them.
      causal: query ``i`` sees keys ``j <= i``.
      window: ``(left, right)``: query ``i`` sees keys ``i - left <= j <= i + right``; or None.
      skip: whether blocks that no query sees are left out (only where no row can be masked
        whole, so that leaving them out changes nothing: see :func:`visits_all`).
      scale: the logits' scale.
    """

    t: int
    s: int
    bq: int
    bk: int
    causal: bool
    window: tuple[int, int] | None
    skip: bool
    scale: float

    @property
    def nq(self) -> int:
        return -(-self.t // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.s // self.bk)

    def keys_of(self, i):
        """The key blocks ``[lo, hi)`` query block ``i`` (traced) visits."""
        lo, hi = 0, self.nk
        if not self.skip:
            return jnp.int32(lo), jnp.int32(hi)
        last = (i + 1) * self.bq - 1  # the block's last query
        hi_key = None
        if self.causal:
            hi_key = last
        if self.window is not None:
            left, right = self.window
            lo = jnp.maximum(0, (i * self.bq - left) // self.bk)
            hi_key = last + right if hi_key is None else jnp.minimum(hi_key, last + right)
        if hi_key is not None:
            hi = jnp.minimum(self.nk, hi_key // self.bk + 1)
        return jnp.int32(lo), jnp.int32(hi)

    def queries_of(self, j):
        """The query blocks ``[lo, hi)`` that visit key block ``j`` (traced)."""
        lo, hi = 0, self.nq
        if not self.skip:
            return jnp.int32(lo), jnp.int32(hi)
        first = j * self.bk  # the block's first key
        lo_query = None
        if self.causal:
            lo_query = first
        if self.window is not None:
            left, right = self.window
            hi = jnp.minimum(self.nq, ((j + 1) * self.bk - 1 + left) // self.bq + 1)
            lo_query = first - right if lo_query is None else jnp.maximum(lo_query, first - right)
        if lo_query is not None:
            lo = jnp.maximum(0, lo_query // self.bq)
        return jnp.int32(lo), jnp.int32(hi)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """One attention's arrays, padded to whole blocks and grouped by key head."""

    q: jax.Array  # [B, Tp, K, G, H]
    k: jax.Array  # [B, Sp, K, H]
    v: jax.Array  # [B, Sp, K, Hv]
    bias: jax.Array | None  # [B|1, N|1, Tp|1, Sp|1]: grouped block by block (not whole: a
    mask: jax.Array | None  # the same, bool        reshape can be a copy on jax 0.10.2's XLA)
    q_len: jax.Array | None  # [B] int
    kv_len: jax.Array | None  # [B] int


def _block(x, axis: int, start, size: int):
    """``size`` entries of ``x`` along ``axis`` from ``start``; all of an axis of length 1."""
    if x.shape[axis] == 1:
        return x
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def logits(g: Geometry, a: Inputs, i, j, qi, kj):
    """Block ``(i, j)``'s logits ``[B, K, G, bq, bk]`` in float32, masked as jax.nn masks them
    (padded keys: ``-inf``), and where they are not masked (None: nowhere masked)."""
    s = jnp.einsum("bqkgh,bskh->bkgqs", qi, kj, preferred_element_type=jnp.float32)
    s = s * jnp.float32(g.scale)
    if a.bias is not None:
        s = s + _logit_block(a, a.bias, i, j, g).astype(jnp.float32)
    block = (1, 1, 1, g.bq, g.bk)
    qpos = i * g.bq + lax.broadcasted_iota(jnp.int32, block, 3)
    kpos = j * g.bk + lax.broadcasted_iota(jnp.int32, block, 4)
    keep = None
    if a.mask is not None:
        keep = _logit_block(a, a.mask, i, j, g)
    if g.causal:
        keep = _and(keep, kpos <= qpos)
    if g.window is not None:
        left, right = g.window
        keep = _and(keep, (qpos <= kpos + left) & (qpos >= kpos - right))
    if a.q_len is not None or a.kv_len is not None:
        keep = _and(keep, _padding(a, qpos, kpos))
    if keep is not None:
        s = jnp.where(keep, s, jnp.float32(MASKED))
    if g.s % g.bk:  # keys past the end: padding of the last block
        s = jnp.where(kpos < g.s, s, -jnp.inf)
    return s, keep


def _logit_block(a: Inputs, x, i, j, g: Geometry):
    """Block ``(i, j)`` of a ``[B|1, N|1, Tp|1, Sp|1]`` bias or mask, as ``[B|1, K|1, G|1, bq|1,
    bk|1]``."""
    x = _block(_block(x, 2, i * g.bq, g.bq), 3, j * g.bk, g.bk)
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], a.k.shape[2], -1, *x.shape[2:])


def _and(a, b):
    return b if a is None else a & b


def _padding(a: Inputs, qpos, kpos):
    """``[B, 1, 1, bq, bk]``: jax.nn's padding mask from the sequence lengths."""
    keep = jnp.ones((1, 1, 1, 1, 1), bool)
    if a.q_len is not None:
        keep = keep & (qpos < a.q_len[:, None, None, None, None])
    if a.kv_len is not None:
        keep = keep & (kpos < a.kv_len[:, None, None, None, None])
    return keep


def forward(g: Geometry, a: Inputs):
    """``(out [B, Tp, K, G, Hv], m [B, K, G, Tp], norm [B, K, G, Tp])`` in float32: the
    softmax of a row is ``exp(logits - m) * norm``. (Not one log-sum-exp ``m - log(norm)``: for
    a row masked whole ``m`` is jax.nn's masked logit, -2.4e38, where ``log(norm)`` is lost.)"""
    b, tp, k_heads, groups, _ = a.q.shape
    hv = a.v.shape[-1]

    def query_block(i, bufs):
        out, lse, norm = bufs
        qi = lax.dynamic_slice_in_dim(a.q, i * g.bq, g.bq, axis=1)

        def key_block(j, carry):
            m, total, acc = carry
            kj = lax.dynamic_slice_in_dim(a.k, j * g.bk, g.bk, axis=1)
            vj = lax.dynamic_slice_in_dim(a.v, j * g.bk, g.bk, axis=1)
            s, _ = logits(g, a, i, j, qi, kj)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            pv = jnp.einsum(
                "bkgqs,bskh->bqkgh", p.astype(a.v.dtype), vj, preferred_element_type=jnp.float32
            )
            corr_q = jnp.moveaxis(corr, 3, 1)[..., None]  # [B, bq, K, G, 1]
            return m_new, total * corr + p.sum(-1), acc * corr_q + pv

        shape = (b, k_heads, groups, g.bq)
        stats = _vjp_primitive.zeros_sharded_like(shape, jnp.float32, a.q, (0, 2, 3, 1))
        init = (
            stats - jnp.inf,
            stats,
            _vjp_primitive.zeros_sharded_like(
                (b, g.bq, k_heads, groups, hv), jnp.float32, a.q, range(5)
            ),
        )
        lo, hi = g.keys_of(i)
        m, total, acc = lax.fori_loop(lo, hi, key_block, init)
        oi = acc / jnp.moveaxis(total, 3, 1)[..., None]
        out = lax.dynamic_update_slice_in_dim(out, oi, i * g.bq, axis=1)
        lse = lax.dynamic_update_slice_in_dim(lse, m, i * g.bq, axis=3)
        norm = lax.dynamic_update_slice_in_dim(norm, 1.0 / total, i * g.bq, axis=3)
        return out, lse, norm

    stats = _vjp_primitive.zeros_sharded_like(
        (b, k_heads, groups, tp), jnp.float32, a.q, (0, 2, 3, 1)
    )
    bufs = (
        _vjp_primitive.zeros_sharded_like((b, tp, k_heads, groups, hv), jnp.float32, a.q, range(5)),
        stats,
        stats,
    )
    return lax.fori_loop(0, g.nq, query_block, bufs)


def backward(g: Geometry, a: Inputs, out, stats, d_out, wants_dbias: bool = True):
    """``(dq, dk, dv, dbias)`` (dbias None without a bias) from the output's cotangent.

    ``out`` and ``d_out`` are ``[B, Tp, K, G, Hv]``, ``stats`` the forward's ``(m, norm)``;
    padded queries must have zero ``d_out``.
    """
    m, norm = stats
    delta = jnp.einsum("bqkgh,bqkgh->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    dq0 = _vjp_primitive.zeros_sharded_like(a.q.shape, jnp.float32, a.q, range(5))
    dbias0 = None
    if a.bias is not None and wants_dbias:
        dbias0 = _vjp_primitive.zeros_sharded_like(a.bias.shape, jnp.float32, a.bias, range(4))

    def key_block(j, carry):
        dq, dk_all, dv_all, dbias = carry
        kj = lax.dynamic_slice_in_dim(a.k, j * g.bk, g.bk, axis=1)
        vj = lax.dynamic_slice_in_dim(a.v, j * g.bk, g.bk, axis=1)

        def query_block(i, inner):
            dk, dv, dq, dbias = inner
            qi = lax.dynamic_slice_in_dim(a.q, i * g.bq, g.bq, axis=1)
            doi = lax.dynamic_slice_in_dim(d_out, i * g.bq, g.bq, axis=1)
            s, keep = logits(g, a, i, j, qi, kj)
            m_i = lax.dynamic_slice_in_dim(m, i * g.bq, g.bq, axis=3)
            norm_i = lax.dynamic_slice_in_dim(norm, i * g.bq, g.bq, axis=3)
            p = jnp.exp(s - m_i[..., None]) * norm_i[..., None]
            dv = dv + jnp.einsum(
                "bkgqs,bqkgh->bskh", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32
            )
            dp = jnp.einsum("bqkgh,bskh->bkgqs", doi, vj, preferred_element_type=jnp.float32)
            delta_i = lax.dynamic_slice_in_dim(delta, i * g.bq, g.bq, axis=3)
            ds = p * (dp - delta_i[..., None])
            if keep is not None:  # a masked logit is a constant: no gradient (as jnp.where)
                ds = jnp.where(keep, ds, 0.0)
            if dbias is not None:
                dbias = _add_block(dbias, ds, i * g.bq, j * g.bk, g)
            ds = ds * jnp.float32(g.scale)
            dqi = jnp.einsum("bkgqs,bskh->bqkgh", ds.astype(kj.dtype), kj,
                             preferred_element_type=jnp.float32)  # fmt: skip
            old = lax.dynamic_slice_in_dim(dq, i * g.bq, g.bq, axis=1)
            dq = lax.dynamic_update_slice_in_dim(dq, old + dqi, i * g.bq, axis=1)
            dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds.astype(qi.dtype), qi,
                                 preferred_element_type=jnp.float32)  # fmt: skip
            return dk, dv, dq, dbias

        dk = _vjp_primitive.zeros_sharded_like(kj.shape, jnp.float32, a.k, range(4))
        dv = _vjp_primitive.zeros_sharded_like(vj.shape, jnp.float32, a.v, range(4))
        lo, hi = g.queries_of(j)
        dk, dv, dq, dbias = lax.fori_loop(lo, hi, query_block, (dk, dv, dq, dbias))
        dk_all = lax.dynamic_update_slice_in_dim(dk_all, dk, j * g.bk, axis=1)
        dv_all = lax.dynamic_update_slice_in_dim(dv_all, dv, j * g.bk, axis=1)
        return dq, dk_all, dv_all, dbias

    dk0 = _vjp_primitive.zeros_sharded_like(a.k.shape, jnp.float32, a.k, range(4))
    dv0 = _vjp_primitive.zeros_sharded_like(a.v.shape, jnp.float32, a.v, range(4))
    return lax.fori_loop(0, g.nk, key_block, (dq0, dk0, dv0, dbias0))


def _add_block(dbias, ds, q0, k0, g: Geometry):
    """``dbias`` ``[B|1, N|1, Tp|1, Sp|1]`` with block ``ds`` ``[B, K, G, bq, bk]`` added at
    ``(q0, k0)``, summed over the axes the bias broadcasts."""
    b, kh, groups, bq, bk = ds.shape
    heads = (1, 2) if dbias.shape[1] == 1 else ()
    sums = heads + tuple(ax for ax, d in ((0, 0), (3, 2), (4, 3)) if dbias.shape[d] == 1)
    ds = ds.sum(axis=sums, keepdims=True) if sums else ds
    ds = ds.reshape(ds.shape[0], ds.shape[1] * ds.shape[2], *ds.shape[3:])
    start = [0, 0, q0 if dbias.shape[2] != 1 else 0, k0 if dbias.shape[3] != 1 else 0]
    old = lax.dynamic_slice(dbias, start, ds.shape)
    return lax.dynamic_update_slice(dbias, old + ds, start)
