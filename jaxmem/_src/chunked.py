"""Gradient-in-forward chunking of a loss that sums (or averages) over independent rows.

A loss like ``sum_i loss_row(x[i], y[i]; w)`` over N tokens can run in chunks of rows. Since the
result is a scalar, each chunk's gradient can be computed as soon as the chunk is (its
contribution to ``d total / d inputs``), then scaled by the incoming cotangent in the backward
pass: nothing of a chunk's intermediates (e.g. its ``[chunk, vocab]`` logits) outlives the
chunk. :func:`chunked` does this for any such ``f``: the arguments split along ``axis`` (the
rows) get their gradient chunk by chunk, the others (parameters) get the sum over the chunks.

The price: the gradients are computed in the forward pass even when only the value is asked for
under ``jax.grad``/``jax.vjp`` (never under plain evaluation, where only values are computed), and
forward-mode differentiation (``jax.jvp``) is not supported (``jax.custom_vjp``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_REDUCTIONS = ("sum", "mean")


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
    if split is not None:
        if isinstance(split, int):
            split = (split,)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in split):
            raise TypeError(f"{caller}: split must be an int or a tuple of ints, got {split!r}")
    return split


def _rows(args: Sequence[Any], split: tuple[int, ...], axis: int, caller: str) -> int:
    sizes = {}
    for i in split:
        if not 0 <= i < len(args):
            raise ValueError(f"{caller}: split={split} names argument {i}; f got {len(args)}")
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            shape = np.shape(leaf)
            where = f"argument {i}{jax.tree_util.keystr(path)}"
            if len(shape) <= axis:
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
    arguments (parameters) are shared by every row. The result of the returned function equals
    ``f(*args)``, and so do its gradients (up to float rounding of the summation order).

    Args:
      f: the loss ``f(*args) -> scalar``.
      axis: the row axis of the split arguments.
      chunk_size: rows per chunk (the last chunk takes the remainder); or
      num_chunks: the number of chunks (rows divided as evenly as possible).
      split: which positional arguments are split into rows (every leaf of each; the others
        are parameters).
      reduction: whether ``f`` sums or averages over the rows.

    Returns:
      ``g(*args)``, the chunked ``f``.

    Raises:
      ValueError / TypeError: bad options or split arguments of different row counts.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> def loss(x, w):
      ...     return jnp.sum(jnp.tanh(x @ w) ** 2)
      >>> x, w = jnp.ones((10, 4)), jnp.eye(4) * 0.1
      >>> g = chunked(loss, chunk_size=4)
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
        full, rem = divmod(n, size)
        row_leaves, row_tree = jax.tree.flatten([args[i] for i in split])
        diff = [jnp.issubdtype(jnp.result_type(a), jnp.inexact) for a in row_leaves]
        params = [a for i, a in enumerate(args) if i not in split]
        for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
            if not jnp.issubdtype(jnp.result_type(p), jnp.inexact):
                raise TypeError(
                    f"{caller}: a parameter (an argument not in split={split}) has the integer "
                    f"leaf {jax.tree_util.keystr(path)}; split it or close over it."
                )

        def call(d_leaves, i_leaves, params_):
            it_d, it_i = iter(d_leaves), iter(i_leaves)
            leaves = [next(it_d) if is_d else next(it_i) for is_d in diff]
            it_r, it_p = iter(jax.tree.unflatten(row_tree, leaves)), iter(params_)
            return f(*[next(it_r) if i in split else next(it_p) for i in range(len(args))])

        def take(leaves, start, length):
            return [jax.lax.slice_in_dim(a, start, start + length, axis=axis) for a in leaves]

        def blocks(leaves):  # the first full * size rows as [full, ..., size, ...]
            out = []
            for a in leaves:
                a = jax.lax.slice_in_dim(a, 0, full * size, axis=axis)
                shape = a.shape[:axis] + (full, size) + a.shape[axis + 1 :]
                out.append(jnp.moveaxis(a.reshape(shape), axis, 0))
            return out

        def weight(length):
            return length / n if reduction == "mean" else 1.0

        def value_only(d_leaves, i_leaves, params_):
            total = jnp.zeros((), jnp.float32)
            if full:

                def body(acc, chunk):
                    v = call(*chunk, params_).astype(jnp.float32)
                    return acc + weight(size) * v, None

                total, _ = jax.lax.scan(body, total, (blocks(d_leaves), blocks(i_leaves)))
            if rem:
                last = (take(d_leaves, full * size, rem), take(i_leaves, full * size, rem))
                total = total + weight(rem) * call(*last, params_).astype(jnp.float32)
            return total

        def grads_of(d_chunk, i_chunk, params_, w):
            val, vjp = jax.vjp(lambda d, p: call(d, i_chunk, p), d_chunk, params_)
            g_rows, g_params = vjp(jnp.asarray(w, val.dtype))
            return w * val.astype(jnp.float32), g_rows, g_params

        @jax.custom_vjp
        def core(d_leaves, i_leaves, params_):
            return value_only(d_leaves, i_leaves, params_)

        def fwd(d_leaves, i_leaves, params_):
            total = jnp.zeros((), jnp.float32)
            acc = jax.tree.map(jnp.zeros_like, params_)
            g_blocks = g_rem = None
            if full:

                def body(carry, chunk):
                    t, gp = carry
                    v, gr, gp_c = grads_of(*chunk, params_, weight(size))
                    return (t + v, jax.tree.map(jnp.add, gp, gp_c)), gr

                chunks = (blocks(d_leaves), blocks(i_leaves))
                (total, acc), g_blocks = jax.lax.scan(body, (total, acc), chunks)
            if rem:
                last = (take(d_leaves, full * size, rem), take(i_leaves, full * size, rem))
                v, g_rem, gp_c = grads_of(*last, params_, weight(rem))
                total, acc = total + v, jax.tree.map(jnp.add, acc, gp_c)
            return total, (_assemble(g_blocks, g_rem, axis, full, size), acc)

        def bwd(res, ct):
            g_rows, g_params = res
            scale = lambda g: (g * ct).astype(g.dtype)  # noqa: E731
            i_zero = [None] * (len(diff) - sum(diff))
            return [scale(g) for g in g_rows], i_zero, jax.tree.map(scale, g_params)

        core.defvjp(fwd, bwd)
        d_leaves = [a for a, is_d in zip(row_leaves, diff, strict=True) if is_d]
        i_leaves = [a for a, is_d in zip(row_leaves, diff, strict=True) if not is_d]
        return core(d_leaves, i_leaves, params)

    return run


def _assemble(g_blocks, g_rem, axis, full, size):
    """Row gradients back in the rows' layout: the full chunks', then the remainder's."""
    n_leaves = len(g_blocks if g_blocks is not None else g_rem)
    out = []
    for k in range(n_leaves):
        parts = []
        if g_blocks is not None:
            gb = jnp.moveaxis(g_blocks[k], 0, axis)
            parts.append(gb.reshape(gb.shape[:axis] + (full * size,) + gb.shape[axis + 2 :]))
        if g_rem is not None:
            parts.append(g_rem[k])
        out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis))
    return out
