"""The linear cross-entropy's kernels: the forward pass over vocabulary chunks (an online
log-sum-exp, optionally in tiles of tokens) and the backward pass that recomputes each chunk's
logits, on one device or one shard's slice of the vocabulary.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxmem._src.losses.linear_ce_config import (
    _Config,
)
from jaxmem._src.losses.vocab_split import (
    _combine_shards,
    _explicit_sharding,
    _manual_axes,
    _psum_to,
    _vary,
    _vocab_offset,
)


def _chunk(i, cfg: _Config, v: int):
    """Start column and validity mask of chunk ``i`` (the last chunk may overlap the previous).

    The mask is None when the chunks tile V exactly (nothing to mask).
    """
    c = cfg.chunk_size
    if v % c == 0:
        start = i * c
        return start, start + jnp.arange(c), None
    start = jnp.minimum(i * c, v - c)
    cols = start + jnp.arange(c)
    return start, cols, (cols >= i * c)[None, :]


def _valid(colvalid, a, fill):
    """``a`` where the chunk's columns are valid, else ``fill`` (``a`` itself if all are)."""
    return a if colvalid is None else jnp.where(colvalid, a, fill)


def _chunk_logits(x, w, b, start, cfg: _Config):
    """Raw f32 logits ``x @ w[:, start:start+C] (+ b)``, and after the optional softcap."""
    wc = lax.dynamic_slice_in_dim(w, start, cfg.chunk_size, axis=1)
    r = jnp.dot(x, wc, preferred_element_type=jnp.float32)
    if b is not None:
        bc = lax.dynamic_slice_in_dim(b, start, cfg.chunk_size).astype(jnp.float32)
        r = r + bc[None, :]
    z = r if cfg.logit_softcap is None else cfg.logit_softcap * jnp.tanh(r / cfg.logit_softcap)
    return wc, z


def _tile(i, t: int, n: int):
    """Start row and validity of token tile ``i`` (the last tile may overlap the previous)."""
    start = jnp.minimum(i * t, n - t)
    return start, start + jnp.arange(t) >= i * t


def _tiles(cfg: _Config, n: int) -> int | None:
    t = cfg.token_chunk
    return None if t is None or t >= n else t


def _forward(cfg: _Config, x, w, b, labels, mask):
    n = x.shape[0]
    t = _tiles(cfg, n)
    if t is None:
        return _forward_rows(cfg, x, w, b, labels, mask)

    def body(i, carry):
        loss, lse = carry
        start, _ = _tile(i, t, n)
        rows = [lax.dynamic_slice_in_dim(a, start, t) for a in (x, labels, mask)]
        loss_t, lse_t = _forward_rows(cfg, rows[0], w, b, rows[1], rows[2])
        # Rows of an overlapping last tile get the same values again.
        return (
            lax.dynamic_update_slice_in_dim(loss, loss_t, start, axis=0),
            lax.dynamic_update_slice_in_dim(lse, lse_t, start, axis=0),
        )

    zeros = jnp.zeros((n,), jnp.float32)
    return lax.fori_loop(0, -(-n // t), body, (zeros, zeros))


def _forward_rows(cfg: _Config, x, w, b, labels, mask):
    v = w.shape[1]
    offset, v_total = _vocab_offset(cfg, v)
    num_chunks = -(-v // cfg.chunk_size)

    def body(i, carry):
        m, s, zy, zsum = carry
        start, cols, colvalid = _chunk(i, cfg, v)
        _, z = _chunk_logits(x, w, b, start, cfg)
        zm = _valid(colvalid, z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(zm, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(zm - m_new[:, None]), axis=1)
        hit = _valid(colvalid, cols[None, :] + offset == labels[:, None], False)
        zy = zy + jnp.sum(jnp.where(hit, z, 0.0), axis=1)
        if cfg.label_smoothing:
            zsum = zsum + jnp.sum(_valid(colvalid, z, 0.0), axis=1)
        return m_new, s, zy, zsum

    # Carries typed like a column of x (its sharding on Explicit meshes), varying over every
    # manual axis an input varies over.
    zeros = _vary(jnp.zeros_like(x[:, 0], jnp.float32), _manual_axes(x, w, b, labels, mask))
    init = (jnp.full_like(zeros, -jnp.inf), zeros, zeros, zeros)
    m, s, zy, zsum = lax.fori_loop(0, num_chunks, body, init)
    if cfg.axis_name is not None:
        m, s, zy, zsum = _combine_shards(cfg, m, s, zy, zsum)
    lse = m + jnp.log(s)
    alpha = cfg.label_smoothing
    loss = lse - (1.0 - alpha) * zy
    if alpha:
        loss = loss - (alpha / v_total) * zsum
    if cfg.z_loss:
        loss = loss + cfg.z_loss * lse * lse
    return jnp.where(mask, loss, 0.0), lse


def _backward(cfg: _Config, x, w, labels, mask, lse, g_loss, g_lse, b):
    """(dx, dw, db): the cotangents of the core's inputs."""
    n = x.shape[0]
    t = _tiles(cfg, n)
    if t is None:
        dx, dw, db = _bwd_rows(cfg, x, w, b, labels, mask, lse, g_loss, g_lse, None, None)
        return _sum_dx(cfg, _psum_to(dx, x)).astype(x.dtype), dw, db

    def body(i, carry):
        dx, dw, db = carry
        start, new = _tile(i, t, n)
        rows = [lax.dynamic_slice_in_dim(a, start, t) for a in (x, labels, mask, lse)]
        g = [lax.dynamic_slice_in_dim(a, start, t) for a in (g_loss, g_lse)]
        # Rows an overlapping last tile repeats add nothing to dw (zero cotangents) and keep
        # the dx they have.
        if overlap:
            g = [jnp.where(new, a, 0.0) for a in g]
        if in_place:
            dx_rows = (dx, start)
            return _bwd_rows(cfg, rows[0], w, b, rows[1], rows[2], rows[3], *g, dw, db, dx_rows)
        dx_t, dw, db = _bwd_rows(cfg, rows[0], w, b, rows[1], rows[2], rows[3], *g, dw, db)
        dx_t = _sum_dx(cfg, dx_t).astype(dx.dtype)
        if overlap:
            dx_t = jnp.where(new[:, None], dx_t, lax.dynamic_slice_in_dim(dx, start, t))
        return lax.dynamic_update_slice_in_dim(dx, dx_t, start, axis=0), dw, db

    overlap = n % t != 0  # the last tile overlaps the one before it
    # On XLA:CPU an f32 dx that is not summed over shards takes each chunk's rows in place (a
    # scatter-add: no [tokens, D] accumulator beside it); the rows an overlapping tile repeats
    # get zeros. Other backends keep the accumulator (the form measured there).
    in_place = cfg.cpu_tiles and not cfg.sum_dx and x.dtype == jnp.float32

    init = (jnp.zeros_like(x), jnp.zeros_like(w), None if b is None else jnp.zeros_like(b))
    return lax.fori_loop(0, -(-n // t), body, init)


def _sum_dx(cfg: _Config, dx):
    """dx summed over the vocabulary shards, in a shard of the partitioned core."""
    return lax.psum(dx, cfg.axis_name) if cfg.sum_dx else dx


def _bwd_rows(cfg, x, w, b, labels, mask, lse, g_loss, g_lse, dw, db, dx_rows=None):
    """dx (f32, not yet summed over vocabulary shards), and dw, db added to the given ones.

    With ``dx_rows = (dx, start)`` (an f32 dx of all tokens, and this tile's first row), each
    chunk's dx is added into rows ``start:start + len(x)`` of that dx, which is returned instead;
    then dw's matmul reads the tile transposed, made once here (on XLA:CPU, 512 x 1024 tiles:
    0.84x the time of dots contracting x's rows in place; the [D, tokens] copy takes the place of
    the [tokens, D] accumulator of dx the scatter-add saves).
    """
    v = w.shape[1]
    offset, v_total = _vocab_offset(cfg, v)
    alpha = cfg.label_smoothing
    gl = jnp.where(mask, g_loss, 0.0).astype(jnp.float32)
    coef = gl * (1.0 + 2.0 * cfg.z_loss * lse) + g_lse.astype(jnp.float32)
    compute_dtype = jnp.result_type(x.dtype, w.dtype)
    num_chunks = -(-v // cfg.chunk_size)
    xt = None if dx_rows is None else x.T

    def body(i, carry):
        dx, dw, db = carry
        start, cols, colvalid = _chunk(i, cfg, v)
        wc, z = _chunk_logits(x, w, b, start, cfg)
        p = _valid(colvalid, jnp.exp(z - lse[:, None]), 0.0)
        hit = _valid(colvalid, cols[None, :] + offset == labels[:, None], False)
        target = (1.0 - alpha) * hit.astype(jnp.float32)
        if alpha:
            target = target + _valid(colvalid, jnp.float32(alpha / v_total), 0.0)
        dz = coef[:, None] * p - gl[:, None] * target
        if cfg.logit_softcap is not None:
            t = z / cfg.logit_softcap
            dz = dz * (1.0 - t * t)
        dzc = dz.astype(compute_dtype)
        dxc = lax.dot_general(dzc, wc, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if dx_rows is None:
            dx = dx + dxc
        else:
            rows = dx_rows[1] + jnp.arange(x.shape[0])
            dx = dx.at[rows].add(dxc, indices_are_sorted=True, unique_indices=True)
        dwc = lax.dot_general(
            x if xt is None else xt,
            dzc,
            (((0 if xt is None else 1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
            out_sharding=_explicit_sharding(dw),
        )
        dwc = _psum_to(dwc, w)  # over token axes, chunk by chunk: no unreduced [D, V] buffer
        old = lax.dynamic_slice_in_dim(dw, start, cfg.chunk_size, axis=1)
        dw = lax.dynamic_update_slice_in_dim(dw, old + dwc.astype(dw.dtype), start, axis=1)
        if db is not None:
            old_b = lax.dynamic_slice_in_dim(db, start, cfg.chunk_size)
            db_new = old_b + _psum_to(jnp.sum(dz, axis=0), b).astype(db.dtype)
            db = lax.dynamic_update_slice_in_dim(db, db_new, start, axis=0)
        return dx, dw, db

    if dx_rows is None:
        dx = _vary(jnp.zeros_like(x, jnp.float32), _manual_axes(x, w, b, labels, mask))
    else:
        dx = dx_rows[0]
    init = (
        dx,
        jnp.zeros_like(w) if dw is None else dw,
        None if b is None else jnp.zeros_like(b) if db is None else db,
    )
    return lax.fori_loop(0, num_chunks, body, init)
