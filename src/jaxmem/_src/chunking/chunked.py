"""Chunking of loss tails that sum over independent rows, by hand and automatically.

A loss like ``sum_i loss_row(x[i], y[i]; w)`` over N tokens can run in chunks of rows. Since the
result is a scalar, each chunk's gradient can be computed as soon as the chunk is (its
contribution to ``d total / d inputs``), then scaled by the incoming cotangent in the backward
pass: nothing of a chunk's intermediates (e.g. its ``[chunk, vocab]`` logits) outlives the
chunk. This is the AutoChunker of PyTorch Inductor, and the fused linear cross-entropy of Liger.

- :func:`chunked` does it for a function the user says is such a sum (which arguments carry the
  rows, along which axis).
- :func:`jaxmem._src.chunking.autochunk.autochunk` finds such a tail inside any loss
  (:mod:`jaxmem._src.chunking.rows`: the largest row-wise part that ends in a scalar
  ``reduce_sum`` and creates an intermediate larger than a threshold), runs it chunk by chunk and
  the rest of the loss as written; where the tail's large intermediate has columns from a matmul
  by a shared weight, each chunk also runs in tiles of columns
  (:mod:`jaxmem._src.chunking.columns`). ``.explain(*args)`` says what it chunked, or why nothing.

Both compute the gradients in the forward pass when differentiated (``jax.grad``/``jax.vjp``;
never under plain evaluation, which only sums values), at the cost of a backward pass of the
tail, not more: the chunk's forward is not run twice. Forward mode (``jax.jvp``,
``jax.jacfwd``, ``jax.linearize``) differentiates the chunked sum as written; ``jax.vmap``
batches it (the chunk loop is one primitive, :mod:`jaxmem._src.vjp_primitive`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._src import jax_compat as _jc
from jaxmem._src import vjp_primitive as _vjp_primitive

_REDUCTIONS = ("sum", "mean")
DEFAULT_MAX_CHUNK_BYTES = 4 * 2**20
# Tiles of rows x columns (sizes not given): about this many, of at least
# _MIN_TILE_BYTES each (and at most max_chunk_bytes), as the default tiles of a hand-written
# tiled cross-entropy. A tile costs a loop iteration whatever its size; with fewer tiles than a
# few hundred they are larger than they need be (the temp is a few tiles).
_TARGET_TILES = 512
_MIN_TILE_BYTES = 2**20

# ------------------------------------------------------------------------------------------
# The loop: rows split along per-leaf axes, gradient in forward.


class _Rows:
    """Chunks of rows: ``fn(rows, rows_leaves_chunk, param_leaves)`` on each chunk, its gradient
    by ``jax.vjp`` (everything of the chunk at once)."""

    def __init__(self, fn, axes):
        self.fn = fn
        self.axes = axes

    def _chunk(self, leaves, start, length):
        return [
            jax.lax.dynamic_slice_in_dim(a, start, length, axis=k)
            for a, k in zip(leaves, self.axes, strict=True)
        ]

    def value(self, start, length, rows, params):
        return self.fn(length, self._chunk(rows, start, length), params)

    def grads(self, start, length, rows, params, d_rows, d_params, g_rows, g_params):
        chunk = self._chunk(rows, start, length)
        dr = [x for x, d in zip(chunk, d_rows, strict=True) if d]
        dp = [x for x, d in zip(params, d_params, strict=True) if d]

        def f(dr_, dp_):
            return self.fn(length, _merge(dr_, chunk, d_rows), _merge(dp_, params, d_params))

        v, vjp = jax.vjp(f, dr, dp)
        gr, gp = vjp(jnp.ones((), v.dtype))
        axes = [k for k, d in zip(self.axes, d_rows, strict=True) if d]
        g_rows = [
            jax.lax.dynamic_update_slice_in_dim(b, x.astype(b.dtype), start, axis=k)
            for b, x, k in zip(g_rows, gr, axes, strict=True)
        ]
        g_params = [a + x.astype(a.dtype) for a, x in zip(g_params, gp, strict=True)]
        return v, g_rows, g_params


def _merge(diff, leaves, mask):
    """``leaves`` with the entries where ``mask`` holds taken, in order, from ``diff``."""
    it = iter(diff)
    return [next(it) if m else x for x, m in zip(leaves, mask, strict=True)]


def _sum_of_chunks(run, rows_leaves, param_leaves, n: int, size: int, fname: str):
    """The sum over chunks of ``size`` rows of ``run``'s scalar, gradient in forward.

    ``run`` (:class:`_Rows`, :class:`_Tiles`) evaluates one chunk (``value``) or its value and
    gradient (``grads``: the row leaves' written into buffers like the leaves, the parameters'
    summed). Float leaves are differentiable: under ``jax.grad`` their gradients are computed
    in the forward loop and scaled by the cotangent after.
    """
    d_rows = [_jc.is_float(a) for a in rows_leaves]
    d_params = [_jc.is_float(a) for a in param_leaves]
    args = (*_by_mask(rows_leaves, d_rows), *_by_mask(param_leaves, d_params))
    loop = _ChunkLoop(run, n, size, d_rows, d_params)
    out_dtype = jax.eval_shape(lambda *a: loop.value_of(0, size, *a), *args).dtype

    def value(dr, ir, dp, ip):
        return loop.total(dr, ir, dp, ip).astype(out_dtype)

    def fwd(dr, ir, dp, ip):
        total, g_rows, g_params = loop.grads(dr, ir, dp, ip)
        return total.astype(out_dtype), (g_rows, g_params)

    def bwd(res, ct):
        return _scaled(res, ct, d_rows, d_params)

    core = _vjp_primitive.custom_vjp(value, fwd=fwd, bwd=bwd, name=fname)
    return core(*args)


def _by_mask(leaves, mask) -> tuple[list, list]:
    """The leaves where ``mask`` holds, and the others."""
    pairs = list(zip(leaves, mask, strict=True))
    return [a for a, m in pairs if m], [a for a, m in pairs if not m]


def _interleave(d, i, mask) -> list:
    """The leaves in order: where ``mask`` holds the next of ``d``, else the next of ``i``."""
    it_d, it_i = iter(d), iter(i)
    return [next(it_d) if m else next(it_i) for m in mask]


class _ChunkLoop:
    """The loops over the chunks of ``size`` of ``n`` rows, on the row and parameter leaves
    each split into the differentiable (float) ones and the others: ``dr, ir, dp, ip``."""

    def __init__(self, run, n: int, size: int, d_rows: list, d_params: list):
        self.run = run
        self.size = size
        self.full, self.rem = divmod(n, size)
        self.d_rows = d_rows
        self.d_params = d_params

    def value_of(self, start, length, dr, ir, dp, ip):
        """One chunk's value."""
        rows, params = _interleave(dr, ir, self.d_rows), _interleave(dp, ip, self.d_params)
        return self.run.value(start, length, rows, params)

    def total(self, dr, ir, dp, ip):
        """The sum of the chunks' values, in float32."""
        size, full = self.size, self.full

        def body(i, total):
            return total + self.value_of(i * size, size, dr, ir, dp, ip).astype(jnp.float32)

        total = jax.lax.fori_loop(0, full, body, jnp.zeros((), jnp.float32))
        if self.rem:
            last = self.value_of(full * size, self.rem, dr, ir, dp, ip)
            total = total + last.astype(jnp.float32)
        return total

    def grads(self, dr, ir, dp, ip):
        """The sum in float32 and the gradients of the float leaves (the parameters' in
        their dtypes), chunk by chunk."""
        size, full = self.size, self.full
        d_rows, d_params = self.d_rows, self.d_params
        rows, params = _interleave(dr, ir, d_rows), _interleave(dp, ip, d_params)

        def step(start, length, carry):
            total, g_rows, g_params = carry
            v, g_rows, g_params = self.run.grads(
                start, length, rows, params, d_rows, d_params, g_rows, g_params
            )
            return total + v.astype(jnp.float32), g_rows, g_params

        carry = (
            jnp.zeros((), jnp.float32),
            [jnp.zeros_like(a) for a in dr],
            [jnp.zeros(a.shape, jnp.float32 if a.dtype != jnp.float64 else a.dtype) for a in dp],
        )
        carry = jax.lax.fori_loop(0, full, lambda i, c: step(i * size, size, c), carry)
        if self.rem:
            carry = step(full * size, self.rem, carry)
        total, g_rows, g_params = carry
        g_params = [g.astype(p.dtype) for g, p in zip(g_params, dp, strict=True)]
        return total, g_rows, g_params


def _scaled(res, ct, d_rows: list, d_params: list) -> tuple:
    """The cotangents of ``dr, ir, dp, ip``: the gradients ``res`` scaled by the sum's
    cotangent ``ct``, None for the leaves that are not differentiated."""
    g_rows, g_params = res

    def scale(g):
        return (g * ct.astype(g.dtype)).astype(g.dtype)

    return (
        [scale(g) for g in g_rows],
        [None] * (len(d_rows) - sum(d_rows)),
        [scale(g) for g in g_params],
        [None] * (len(d_params) - sum(d_params)),
    )


class _Tiles:
    """Chunks of rows, each in tiles of columns
    (:class:`jaxmem._src.chunking.columns.ColumnTiling`).

    The tail's jaxpr takes the row leaves then the parameters; ``plans[length]`` runs a chunk
    of ``length`` rows (None: that chunk runs whole, as :class:`_Rows` does).
    """

    def __init__(self, plans: dict, rows: _Rows, axes, n_rows: int, width: int):
        self.plans = plans
        self.rows = rows
        self.axes = axes
        self.n_rows = n_rows
        self.width = width

    def _inputs(self, plan, start, length, rows, params):
        cols = dict(plan.sliced)
        n = self.n_rows
        invals = [
            None if k in cols else jax.lax.dynamic_slice_in_dim(x, start, length, self.axes[k])
            for k, x in enumerate(rows)
        ] + [None if n + k in cols else x for k, x in enumerate(params)]

        def starts(k, offset):
            out = [0] * np.ndim(rows[k])
            out[self.axes[k]], out[cols[k]] = start, offset
            return out

        def take(k, offset, width):
            if k >= n:
                return jax.lax.dynamic_slice_in_dim(params[k - n], offset, width, cols[k])
            x = rows[k]
            sizes = list(np.shape(x))
            sizes[self.axes[k]], sizes[cols[k]] = length, width
            return jax.lax.dynamic_slice(x, starts(k, offset), sizes)

        def put(k, buf, offset, g):
            if k >= n:
                a = cols[k]
                old = jax.lax.dynamic_slice_in_dim(buf, offset, g.shape[a], a)
                return jax.lax.dynamic_update_slice_in_dim(
                    buf, old + g.astype(buf.dtype), offset, a
                )
            at = starts(k, offset)
            old = jax.lax.dynamic_slice(buf, at, g.shape)
            return jax.lax.dynamic_update_slice(buf, old + g.astype(buf.dtype), at)

        return invals, take, put

    def value(self, start, length, rows, params):
        plan = self.plans[length]
        if plan is None:
            return self.rows.value(start, length, rows, params)
        invals, take, _ = self._inputs(plan, start, length, rows, params)
        return plan.value(invals, take, self.width)

    def grads(self, start, length, rows, params, d_rows, d_params, g_rows, g_params):
        plan = self.plans[length]
        if plan is None:
            return self.rows.grads(start, length, rows, params, d_rows, d_params, g_rows, g_params)
        n = self.n_rows
        invals, take, put = self._inputs(plan, start, length, rows, params)
        diff = list(d_rows) + list(d_params)
        slot = {}  # input index -> (which list, position in it)
        for k, d in enumerate(diff):
            if d:
                mask = d_rows if k < n else d_params
                j = k if k < n else k - n
                slot[k] = ("rows" if k < n else "params", sum(mask[:j]))
        bufs = {"rows": list(g_rows), "params": list(g_params)}
        cols = dict(plan.sliced)
        inbuf = {k: bufs[w][j] for k, (w, j) in slot.items() if k in cols}
        v, grads, inbuf = plan.grads(invals, diff, take, self.width, inbuf, put)
        for k, b in inbuf.items():
            w, j = slot[k]
            bufs[w][j] = b
        for k, g in enumerate(grads):
            if g is None:
                continue
            w, j = slot[k]
            if w == "rows":
                b = bufs[w][j]
                bufs[w][j] = jax.lax.dynamic_update_slice_in_dim(
                    b, g.astype(b.dtype), start, axis=self.axes[k]
                )
            else:
                bufs[w][j] = bufs[w][j] + g.astype(bufs[w][j].dtype)
        return v, bufs["rows"], bufs["params"]


# ------------------------------------------------------------------------------------------
# chunked: the user says which arguments carry the rows.


def _check(f, axis, chunk_size, num_chunks, split, reduction, caller):
    if not callable(f):
        raise TypeError(f"{caller}: f must be callable, got {type(f).__name__}")
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{caller}: axis must be an int, got {axis!r}")
    if (chunk_size is None) == (num_chunks is None):
        raise ValueError(f"{caller}: give exactly one of chunk_size and num_chunks")
    for name, v in (("chunk_size", chunk_size), ("num_chunks", num_chunks)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{caller}: {name} must be a positive int, got {v!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{caller}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if isinstance(split, int) and not isinstance(split, bool):
        split = (split,)
    if not isinstance(split, Sequence) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in split
    ):
        raise TypeError(f"{caller}: split must be an int or a tuple of ints, got {split!r}")
    return tuple(split)


def _rows(args: Sequence[Any], split: tuple[int, ...], axis: int, caller: str) -> int:
    sizes = {}
    for i in split:
        if not 0 <= i < len(args):
            raise ValueError(f"{caller}: split={split} names argument {i}; f got {len(args)}")
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            shape = np.shape(leaf)
            where = f"argument {i}{jax.tree_util.keystr(path)}"
            if not -len(shape) <= axis < len(shape):
                raise ValueError(f"{caller}: {where} has shape {shape}, no axis {axis} to split")
            sizes[where] = shape[axis]
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(f"{caller}: the split arguments differ along axis {axis} ({listed})")
    if not sizes:
        raise ValueError(f"{caller}: no argument to split along axis {axis}")
    return next(iter(sizes.values()))


def chunked(
    f: Callable[..., jax.Array],
    *,
    axis: int = 0,
    chunk_size: int | None = None,
    num_chunks: int | None = None,
    split: int | Sequence[int] = 0,
    reduction: str = "sum",
) -> Callable[..., jax.Array]:
    """Runs ``f`` chunk by chunk over the rows of its ``split`` arguments, gradient in forward.

    ``f(*args)`` must be a scalar that is the sum (``reduction="sum"``) or the mean
    (``"mean"``) over independent rows of the arguments ``split`` along ``axis``; the other
    arguments (parameters) are shared by every row. The returned function equals ``f`` in value
    and gradients (up to float rounding of the summation order), but under ``jax.grad`` /
    ``jax.vjp`` computes each chunk's gradient while the chunk is live, so only one chunk's
    intermediates exist at a time and nothing of them is kept for the backward pass. The
    gradient buffers (one like each split float leaf, one per float parameter) are the
    residuals. Integer leaves (labels) are split or shared but not differentiated.

    Nothing checks that ``f`` really is such a sum: :func:`autochunk` finds (and proves) it.

    Args:
      f: the loss ``f(*args) -> scalar``.
      axis: the row axis of the split arguments.
      chunk_size: rows per chunk (the last chunk takes the remainder); or
      num_chunks: the number of chunks (``ceil(rows / num_chunks)`` rows each).
      split: which positional arguments are split into rows (every leaf of each; the others
        are parameters).
      reduction: whether ``f`` sums or averages over the rows.

    Returns:
      ``g(*args)``, the chunked ``f``.

    Raises:
      ValueError / TypeError: bad options, or split arguments of different row counts (every
        leaf named by its path).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> def loss(x, w):
      ...     return jnp.sum(jnp.tanh(x @ w) ** 2)
      >>> x, w = jnp.ones((10, 4)), jnp.eye(4) * 0.1
      >>> g = jaxmem.chunked(loss, chunk_size=4)
      >>> bool(jnp.allclose(g(x, w), loss(x, w)))
      True
      >>> bool(jnp.allclose(jax.grad(g, argnums=1)(x, w), jax.grad(loss, argnums=1)(x, w)))
      True
    """
    caller = "jaxmem.chunked"
    split = _check(f, axis, chunk_size, num_chunks, split, reduction, caller)

    @functools.wraps(f)
    def run(*args):
        n = _rows(args, split, axis, caller)
        size = min(chunk_size if chunk_size is not None else math.ceil(n / num_chunks), n)
        row_leaves, row_tree = jax.tree.flatten([args[i] for i in split])
        params = [a for i, a in enumerate(args) if i not in split]
        param_leaves, param_tree = jax.tree.flatten(params)
        axes = [axis % np.ndim(a) for a in row_leaves]

        def fn(length, rows_, params_):
            it_r = iter(jax.tree.unflatten(row_tree, rows_))
            it_p = iter(jax.tree.unflatten(param_tree, params_))
            out = f(*[next(it_r) if i in split else next(it_p) for i in range(len(args))])
            return out * (length / n) if reduction == "mean" else out

        return _sum_of_chunks(_Rows(fn, axes), row_leaves, param_leaves, n, size, caller)

    return run


# ------------------------------------------------------------------------------------------
# autochunk: the tail found in the jaxpr.
