"""Splitting a row-wise tail along a second axis: the columns of a large shared weight.

A row-wise tail (:mod:`jaxmem._src.chunking.rows`) often multiplies its rows by a large weight
shared by every row (``logits = x @ w``, ``w`` of shape ``[D, V]``) and then reduces each row over
the weight's columns: a softmax's maximum and sum, the logit at the label. Split into chunks of rows
only, each chunk still creates ``[rows, V]`` blocks and a whole ``[D, V]`` gradient of the weight.
This module finds when such a tail can also run in tiles of columns, and runs one chunk of rows that
way:

1. :func:`plan` labels the *column axis* of every value of the tail (the axis that comes from
   the weight's columns, followed through the same per-primitive rules as the rows), and checks
   that every use of a value with that axis is either column-wise itself or a *column
   reduction* that splits exactly into per-tile parts: a ``reduce_sum``, ``reduce_max`` or
   ``reduce_min`` over the columns, the ``take_along_axis`` gather of one column per row (the
   label's logit), or a ``dot_general`` that contracts the columns with another column-wise
   value (a second matmul).
2. Values computed *from* column reductions but used again along the columns (``z - max(z)``
   in a log-softmax, ``exp`` of it) are written as sums of terms ``coef * exp(expo - shift) *
   body``: ``coef`` and ``shift`` per row (computed after the reductions), ``expo`` and
   ``body`` per column and free of any reduction (computed tile by tile). A reduction of such a
   value becomes per-tile reductions of the bodies: ``sum(z - c) = sum(z) - V * c``, and
   ``sum(exp(z - c))`` is carried as a running maximum ``m`` and ``sum(exp(z - m))``, rescaled
   when ``m`` grows (the online log-sum-exp of Milakov and Gimelshein), then multiplied by
   ``exp(m - c)``. Anything else (a reduction-dependent value under a ``log``, a ``sort``,
   a cumulative sum along the columns, ...) refuses the split, with the reason.
3. :class:`ColumnTiling` runs a chunk of rows as: the part before the column reductions (``pre``),
   a forward sweep over column tiles that accumulates the reductions, the part after them
   (``post``), and, for the gradient, a backward sweep that recomputes each tile and pulls the
   cotangents of the reductions back into it: each tile's share of the weight's gradient is
   added in place into the caller's buffer. Nothing of size ``[rows, V]`` exists, and no
   ``[D, V]`` array besides that buffer.

Values and gradients equal the tail's as written up to float rounding (sums run tile by tile).

References:
  Milakov and Gimelshein, "Online normalizer calculation for softmax", 2018
  (arXiv:1805.02867). Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models",
  2024 (arXiv:2411.09009): the cross-entropy of an LM head in tiles of tokens and vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._src import jax_compat as _jc
from jaxmem._src.chunking import rows as _rw
from jaxmem._src.chunking.column_axis import (
    Refused,
    _column_sources,
    _Graph,
    _label,
    _Labels,
    _live,
    _resize,
    _shape,
    _type,
    _where,
)
from jaxmem._src.chunking.column_reductions import (
    _KINDS,
    _Acc,
    _acc_dtype,
    _categories,
    _evaluate,
    _finite,
    _picks,
    _reductions,
    _vars,
)

# ------------------------------------------------------------------------------------------
# The plan.


@dataclasses.dataclass
class ColumnTiling:
    """How one chunk of rows of a tail runs in tiles of columns (see the module docstring).

    Attributes:
      size: the number of columns.
      sliced: ``(input index, column axis)`` of each input of the tail's jaxpr that is split
        into column tiles (the weight, a bias, per-row targets with a column axis); an index
        past the inputs is a constant of the jaxpr.
      reductions: one line per column reduction (what it is and where).
      source: the matmul the columns come from.
      col_bytes: bytes of one column of the largest column-wise value (all the chunk's rows).
      row_bytes: bytes, for all the chunk's rows, of what a tile holds besides its column-wise
        values: the rows' inputs and their gradients, the values computed before the column
        reductions, the accumulators and their cotangents.
    """

    size: int
    sliced: tuple[tuple[int, int], ...]
    reductions: tuple[str, ...]
    source: str
    col_bytes: int
    row_bytes: int
    jaxpr: Any = dataclasses.field(repr=False)
    consts: list = dataclasses.field(repr=False)
    axis: dict = dataclasses.field(repr=False)
    cat: list = dataclasses.field(repr=False)
    accs: list = dataclasses.field(repr=False)
    recipes: dict = dataclasses.field(repr=False)
    pre_out: list = dataclasses.field(repr=False)
    sweep_free: list = dataclasses.field(repr=False)

    # --- pieces --------------------------------------------------------------------------

    def _base(self) -> dict:
        return dict(zip(self.jaxpr.constvars, self.consts, strict=True))

    def _pre(self, invals: Sequence) -> dict:
        j = self.jaxpr
        env = self._base()
        env.update((v, x) for v, x in zip(j.invars, invals, strict=True) if x is not None)
        for eqn, cat in zip(j.eqns, self.cat, strict=True):
            if cat == "pre":
                _bind(eqn, env)
        return env

    def _take_const(self, k: int, offset, width: int):
        a = dict(self.sliced)[k]
        return jax.lax.dynamic_slice_in_dim(
            self.consts[k - len(self.jaxpr.invars)], offset, width, a
        )

    def _tile(self, free: dict, take: Callable, offset, width: int) -> dict:
        j = self.jaxpr
        env = {**self._base(), **free}
        n = len(j.invars)
        for k, _ in self.sliced:
            var = j.invars[k] if k < n else j.constvars[k - n]
            env[var] = take(k, offset, width) if k < n else self._take_const(k, offset, width)
        for eqn, cat in zip(j.eqns, self.cat, strict=True):
            if cat != "sweep":
                continue
            (out,) = eqn.outvars
            a = self.axis[out]
            params = _rw.rewrite(eqn, [a], width)
            invals = [env[v] if _jc.is_var(v) else v.val for v in eqn.invars]
            x = eqn.primitive.bind(*invals, **params)
            if eqn.primitive.name == "iota" and eqn.params["dimension"] == a:
                x = x + jnp.asarray(offset, x.dtype)
            env[out] = x
        return env

    def _operand(self, body, shape, col, env, cache, tile: _Tile, fill=None):
        """A body over the tile, broadcast to the reduced operand's shape; with ``fill``, the
        columns an earlier tile already covered (the overlap of the last tile) hold ``fill``."""
        x = jnp.broadcast_to(
            jnp.asarray(_evaluate(body, env, cache)), _resize(shape, col, tile.width)
        )
        if fill is None or tile.fresh is None:
            return x
        return jnp.where(tile.new(x.shape, col), x, jnp.asarray(fill, x.dtype))

    def _index(self, eqn, env):
        v = eqn.invars[1]
        idx = jnp.asarray(env[v] if _jc.is_var(v) else v.val)
        if eqn.params["mode"] != jax.lax.GatherScatterMode.FILL_OR_DROP:
            idx = jnp.clip(idx, 0, self.size - 1)
        return idx

    def _gathered(self, acc: _Acc, body, env, cache, tile: _Tile):
        x = self._operand(body, acc.shape, acc.col, env, cache, tile)
        p = acc.eqn.params
        idx = self._index(acc.eqn, env)
        local = idx - jnp.asarray(tile.offset, idx.dtype)
        if tile.fresh is not None:  # columns an earlier tile covered are not taken again
            local = jnp.where(idx >= tile.fresh, local, -1)
        if idx.shape[acc.col] == 1:
            # One column per row: a masked sum over the tile, whose gradient is a select that
            # XLA fuses with the other per-column cotangents (a gather's is a scatter into a
            # block of its own).
            hit = jax.lax.broadcasted_iota(local.dtype, x.shape, acc.col) == local[..., 0]
            zero = jnp.zeros((), x.dtype)
            return jnp.sum(jnp.where(hit, x, zero), acc.col, keepdims=True)
        inside = (local >= 0) & (local < tile.width)
        out = jax.lax.gather(
            x,
            jnp.clip(local, 0, tile.width - 1),
            p["dimension_numbers"],
            p["slice_sizes"],
            indices_are_sorted=p["indices_are_sorted"],
            unique_indices=p["unique_indices"],
            mode=jax.lax.GatherScatterMode.CLIP,
        )
        return jnp.where(inside[..., 0], out, jnp.zeros((), out.dtype))

    def _dot(self, acc: _Acc, env, cache, tile: _Tile):
        x = self._operand(acc.body, acc.shape, acc.col, env, cache, tile, fill=0)
        y = self._operand(acc.other, acc.other_shape, acc.other_col, env, cache, tile)
        p = acc.eqn.params
        out = jax.lax.dot_general(
            x,
            y,
            p["dimension_numbers"],
            precision=p.get("precision"),
            preferred_element_type=p.get("preferred_element_type"),
        )
        return out.astype(acc.dtype)

    def _exp_parts(self, acc: _Acc, env, cache, tile: _Tile):
        e = self._operand(acc.expo, acc.shape, acc.col, env, cache, tile).astype(acc.dtype)
        b = self._operand(acc.body, acc.shape, acc.col, env, cache, tile)
        mask = None
        if acc.body[0] == "select":  # zero where not selected: the maximum runs over the rest
            hit = _picks(_evaluate(acc.body[1], env, cache), acc.body[2])
            mask = jnp.broadcast_to(hit, e.shape)
        if tile.fresh is not None:
            new = tile.new(e.shape, acc.col)
            mask = new if mask is None else mask & new
        return e, b, mask

    def _exp_terms(self, acc: _Acc, e, b, mask, ref):
        terms = b * jnp.exp(e - jnp.expand_dims(ref, acc.col))
        if mask is not None:
            terms = jnp.where(mask, terms, jnp.zeros((), terms.dtype))
        return jnp.sum(terms, acc.col, dtype=acc.dtype)

    def _step(self, env: dict, state: list, tile: _Tile) -> list:
        """The accumulators after one more tile."""
        cache: dict = {}
        new = []
        for acc, st in zip(self.accs, state, strict=True):
            if acc.kind == "sum":
                x = self._operand(acc.body, acc.shape, acc.col, env, cache, tile, fill=0)
                new.append(st + jnp.sum(x, acc.axes, dtype=acc.dtype))
            elif acc.kind in ("max", "min"):
                fill = -jnp.inf if acc.kind == "max" else jnp.inf
                x = self._operand(acc.body, acc.shape, acc.col, env, cache, tile, fill=fill)
                x = x.astype(acc.dtype)
                if acc.kind == "min":
                    new.append(jnp.minimum(st, jnp.min(x, acc.axes)))
                elif not acc.diff:
                    new.append(jnp.maximum(st, jnp.max(x, acc.axes)))
                else:  # the maximum and how many entries reach it (its gradient splits)
                    best, count = st
                    top = jnp.maximum(best, jnp.max(x, acc.axes))
                    ties = jnp.sum(x == jnp.expand_dims(top, acc.axes), acc.axes, dtype=acc.dtype)
                    new.append((top, jnp.where(best == top, count, 0) + ties))
            elif acc.kind == "expsum":
                best, total = st
                e, b, mask = self._exp_parts(acc, env, cache, tile)
                low = jnp.asarray(-jnp.inf, acc.dtype)
                top = jnp.maximum(
                    best, jnp.max(e if mask is None else jnp.where(mask, e, low), acc.col)
                )
                ref = _finite(top)
                kept = jnp.where(best == low, 0, total * jnp.exp(_finite(best) - ref))
                new.append((top, kept + self._exp_terms(acc, e, b, mask, ref)))
            elif acc.kind == "gather":
                x = self._gathered(acc, acc.body, env, cache, tile)
                new.append(st + x.astype(acc.dtype))
            else:
                new.append(st + self._dot(acc, env, cache, tile))
        return new

    def _initial(self) -> list:
        out = []
        for acc in self.accs:
            shape = acc.out_shape
            if acc.kind == "max" and acc.diff:
                out.append((jnp.full(shape, -jnp.inf, acc.dtype), jnp.zeros(shape, acc.dtype)))
            elif acc.kind in ("max", "min"):
                out.append(jnp.full(shape, -jnp.inf if acc.kind == "max" else jnp.inf, acc.dtype))
            elif acc.kind == "expsum":
                out.append((jnp.full(shape, -jnp.inf, acc.dtype), jnp.zeros(shape, acc.dtype)))
            else:
                out.append(jnp.zeros(shape, acc.dtype))
        return out

    def _sweep(self, step: Callable, state, width: int):
        """``step(tile, state)`` over the column tiles, in one loop: when ``width`` does not
        divide the columns, the last tile ends at the last column and overlaps the one before
        (its repeated columns are masked out), so that no tile runs outside the loop (a tile
        after the loop made XLA copy the weight's gradient buffer)."""
        count = -(-self.size // width)
        if count == 1:
            return step(_Tile(0, self.size, None), state)
        ragged = self.size % width != 0

        def body(j, s):
            start = j * width
            offset = jnp.minimum(start, self.size - width) if ragged else start
            return step(_Tile(offset, width, start if ragged else None), s)

        return jax.lax.fori_loop(0, count, body, state)

    def _forward(self, free: dict, take: Callable, width: int) -> list:
        def step(tile, state):
            return self._step(self._tile(free, take, tile.offset, tile.width), state, tile)

        return self._sweep(step, self._initial(), width)

    def _post(self, env: dict, state: list):
        j = self.jaxpr
        for i, (eqn, cat) in enumerate(zip(j.eqns, self.cat, strict=True)):
            if cat == "post":
                _bind(eqn, env)
            elif cat == "reduce":
                (out,) = eqn.outvars
                env[out] = jnp.asarray(self.recipes[i](env, state)).astype(out.aval.dtype)
        (out,) = j.outvars
        return env[out] if _jc.is_var(out) else out.val

    def _partials(self, env: dict, state: list, dstate: list, tile: _Tile):
        """The sum over the accumulators of <cotangent, this tile's part of it>: its gradient
        is the tile's share of the gradient."""
        cache: dict = {}
        total = jnp.zeros((), jnp.float32)
        for acc, st, d in zip(self.accs, state, dstate, strict=True):
            if not acc.diff:
                continue
            if acc.kind == "sum":
                x = self._operand(acc.body, acc.shape, acc.col, env, cache, tile, fill=0)
                part = jnp.sum(x, acc.axes, dtype=acc.dtype)
            elif acc.kind == "max":
                best, count = st
                x = self._operand(acc.body, acc.shape, acc.col, env, cache, tile, fill=-jnp.inf)
                hit = x == jnp.expand_dims(best, acc.axes)
                share = hit.astype(acc.dtype) / jnp.expand_dims(count, acc.axes)
                x = jnp.where(hit, x, jnp.zeros((), x.dtype))
                part = jnp.sum(x * jax.lax.stop_gradient(share), acc.axes, dtype=acc.dtype)
            elif acc.kind == "expsum":
                e, b, mask = self._exp_parts(acc, env, cache, tile)
                part = self._exp_terms(acc, e, b, mask, _finite(st[0]))
            elif acc.kind == "gather":
                part = self._gathered(acc, acc.body, env, cache, tile)
            else:
                part = self._dot(acc, env, cache, tile)
            total = total + jnp.sum(part.astype(jnp.float32) * d.astype(jnp.float32))
        return total

    # --- entry points ----------------------------------------------------------------------

    def value(self, invals: Sequence, take: Callable, width: int):
        """The tail's value on one chunk of rows.

        Args:
          invals: the values of the jaxpr's inputs (None for the column-split ones).
          take: ``take(k, offset, width)``: columns ``[offset, offset + width)`` of the
            column-split input ``k`` (the chunk's rows of it).
          width: columns per tile (the last tile takes the remainder).
        """
        env = self._pre(invals)
        state = self._forward({v: env[v] for v in self.sweep_free}, take, width)
        return self._post(env, state)

    def grads(self, invals, diff, take, width: int, bufs: dict, put: Callable):
        """The value and gradient of the tail on one chunk of rows.

        Args:
          invals, take, width: as for :meth:`value`.
          diff: per input, whether to differentiate it.
          bufs: per differentiable column-split input (by index), the buffer its gradient is
            added into, tile by tile.
          put: ``put(k, buf, offset, g)``: ``buf`` with ``g``, the gradient of input ``k``'s
            tile at ``offset``, added.

        Returns:
          ``(value, grads, bufs)``: the gradients of the other differentiable inputs (None
          where not differentiated) and the updated buffers.
        """
        split = {k for k, _ in self.sliced}
        wrt = [k for k, d in enumerate(diff) if d and k not in split]
        pre = self._pre_vjp(invals, wrt)
        free = {v: pre.env[v] for v in self.sweep_free}
        state = self._forward(free, take, width)
        value, dstate, dvals = self._post_vjp(pre, state)
        back = _Backward(
            free=free,
            fvars=[v for v in self.sweep_free if _jc.is_float(v)],
            state=state,
            dstate=dstate,
            cols=[k for k, _ in self.sliced if k < len(diff) and diff[k]],
            take=take,
            put=put,
        )
        dfree, bufs = self._backward(back, width, bufs)
        douts = [
            d + dfree[back.fvars.index(v)].astype(d.dtype) if v in back.fvars else d
            for v, d in zip(pre.outs_f, dvals, strict=True)
        ]
        (gin,) = pre.vjp(douts)
        grads: list = [None] * len(invals)
        for k, g in zip(wrt, gin, strict=True):
            grads[k] = g
        return value, grads, bufs

    def _pre_vjp(self, invals: Sequence, wrt: list) -> _PreVJP:
        """The part before the column reductions as a function of the inputs ``wrt``,
        linearized."""
        outs_f = [v for v in self.pre_out if _jc.is_float(v)]
        outs_i = [v for v in self.pre_out if not _jc.is_float(v)]

        def pre(xs):
            vals = list(invals)
            for k, x in zip(wrt, xs, strict=True):
                vals[k] = x
            env = self._pre(vals)
            return [env[v] for v in outs_f], [env[v] for v in outs_i]

        fvals, pre_vjp, ivals = jax.vjp(pre, [invals[k] for k in wrt], has_aux=True)
        env = {
            **self._base(),
            **dict(zip(outs_f, fvals, strict=True)),
            **dict(zip(outs_i, ivals, strict=True)),
        }
        return _PreVJP(outs_f, fvals, pre_vjp, env)

    def _post_vjp(self, pre: _PreVJP, state: list):
        """The tail's value from the accumulators after the forward sweep, and its cotangents:
        per accumulator (None where not differentiable) and per float value before the
        reductions."""
        live = [i for i, a in enumerate(self.accs) if a.diff]

        def post(parts, vals):
            st = list(state)
            for i, p in zip(live, parts, strict=True):
                st[i] = _inject(self.accs[i], st[i], p)
            env = {**pre.env, **dict(zip(pre.outs_f, vals, strict=True))}
            return self._post(env, st)

        parts = [_part(self.accs[i], state[i]) for i in live]
        value, post_vjp = jax.vjp(post, parts, pre.fvals)
        dparts, dvals = post_vjp(jnp.ones((), value.dtype))
        dstate: list = [None] * len(self.accs)
        for i, d in zip(live, dparts, strict=True):
            dstate[i] = d
        return value, dstate, dvals

    def _backward(self, back: _Backward, width: int, bufs: dict):
        """The backward sweep: per tile, the gradient of its share (:meth:`_partials`), added
        into the buffers of the column-split inputs and summed for the float values the sweep
        reads (returned in the order of ``back.fvars``)."""

        def tile_grads(tile, carry):
            dfree, bufs = carry
            tiles = [back.take(k, tile.offset, tile.width) for k in back.cols]
            share = self._share(back, tile)
            gt, gf = jax.grad(share, argnums=(0, 1))(tiles, [back.free[v] for v in back.fvars])
            bufs = dict(bufs)
            for k, g in zip(back.cols, gt, strict=True):
                bufs[k] = back.put(k, bufs[k], tile.offset, g)
            dfree = [a + g.astype(a.dtype) for a, g in zip(dfree, gf, strict=True)]
            return dfree, bufs

        dfree0 = [jnp.zeros(_shape(v), _acc_dtype(v.aval.dtype)) for v in back.fvars]
        return self._sweep(tile_grads, (dfree0, dict(bufs)), width)

    def _share(self, back: _Backward, tile: _Tile) -> Callable:
        """``share(tiles, fv)``: a tile's share (:meth:`_partials`) as a function of the
        differentiated column-split inputs' tiles and the float values the sweep reads."""

        def share(tiles, fv):
            env = {**back.free, **dict(zip(back.fvars, fv, strict=True))}

            def take_d(k, o, width):
                return tiles[back.cols.index(k)] if k in back.cols else back.take(k, o, width)

            tenv = self._tile(env, take_d, tile.offset, tile.width)
            return self._partials(tenv, back.state, back.dstate, tile)

        return share


class _PreVJP(NamedTuple):
    """The part before the column reductions, linearized: its float outputs, their values
    and pullback, and the values the sweeps and the part after them start from."""

    outs_f: list
    fvals: list
    vjp: Callable
    env: dict


class _Backward(NamedTuple):
    """What the backward sweep reads: the values before the reductions that the sweep reads
    (``free``; ``fvars`` the differentiated ones), the accumulators after the forward sweep
    and their cotangents, the differentiated column-split inputs (``cols``), and ``take`` and
    ``put`` of their tiles."""

    free: dict
    fvars: list
    state: list
    dstate: list
    cols: list
    take: Callable
    put: Callable


@dataclasses.dataclass(frozen=True)
class _Tile:
    """Columns ``[offset, offset + width)``; ``fresh`` (or None: all) the first column that no
    earlier tile covered."""

    offset: Any
    width: int
    fresh: Any

    def new(self, shape, col: int):
        """Where the columns of a value of ``shape`` (columns along ``col``) are new."""
        cols = jax.lax.broadcasted_iota(jnp.int32, shape, col) + jnp.asarray(self.offset, jnp.int32)
        return cols >= self.fresh


def _part(acc: _Acc, st):
    """The differentiable part of an accumulator's state."""
    if acc.kind == "expsum" or (acc.kind == "max" and isinstance(st, tuple)):
        return st[1] if acc.kind == "expsum" else st[0]
    return st


def _inject(acc: _Acc, st, p):
    if acc.kind == "expsum":
        return (jax.lax.stop_gradient(st[0]), p)
    if acc.kind == "max" and isinstance(st, tuple):
        return (p, jax.lax.stop_gradient(st[1]))
    return p


def _bind(eqn, env: dict):
    outs = _jc.bind_eqn(eqn, [env[v] if _jc.is_var(v) else v.val for v in eqn.invars])
    for v, x in zip(eqn.outvars, outs, strict=True):
        if not _jc.is_drop_var(v):
            env[v] = x


# ------------------------------------------------------------------------------------------
# Building the plan.


def plan(closed, n_split: int) -> ColumnTiling:
    """The column plan of a tail's flat jaxpr (:func:`trace_tail`), or :class:`Refused`.

    The columns come from a ``dot_general`` whose output axis is a free axis of an operand
    that does not depend on the rows (the shared weight); of several candidates, the one whose
    column-wise values are largest wins.

    Args:
      closed: the closed flat jaxpr of the tail on a chunk of rows.
      n_split: how many of its first inputs carry the rows (the others are shared).

    Raises:
      Refused: no candidate, or every candidate meets a use of the columns that does not
        split into tiles (the message gives the reasons).
    """
    j = _jc.open_jaxpr(closed)
    live = _live(j)
    graph = _Graph.of(j, live, n_split)
    best, best_bytes, reasons, seen = None, -1, [], set()
    for e, out, b in _column_sources(j, live, graph.rowdep):
        if (out, b) in seen:
            continue
        source = f"dot_general at {_where(e)} ({_type(out)}, axis {b})"
        try:
            labels = _label(live, graph.producer, graph.consumers, out, b, _shape(out)[b])
        except Refused as r:
            reasons.append(f"the columns of {source}: {r}")
            continue
        seen.update(labels.axis.items())
        labels.source = source
        size = max((_jc.nbytes(v.aval) for v in labels.axis if v in graph.producer), default=0)
        if size > best_bytes:
            best, best_bytes = labels, size
    if best is None:
        raise Refused("; ".join(reasons) or "no matmul by a weight shared by every row")
    return _build(closed, live, best, graph.producer, n_split)


def _diff_live(j, live) -> set:
    """The values whose cotangent can be non-zero: those the output depends on, other than
    through a ``stop_gradient``, and float."""
    out = {v for v in j.outvars if _jc.is_var(v)}
    for i in range(len(j.eqns) - 1, -1, -1):
        e = j.eqns[i]
        if not live[i] or e.primitive.name == "stop_gradient":
            continue
        if any(v in out for v in e.outvars):
            out.update(v for v in e.invars if _jc.is_var(v) and _jc.is_float(v))
    return out


def _build(closed, live, labels: _Labels, producer, n_split: int) -> ColumnTiling:
    """The plan of the columns ``labels`` found by :func:`plan`."""
    j = _jc.open_jaxpr(closed)
    axis, size = labels.axis, labels.size
    cat, inner = _categories(j, live, labels)
    red = _reductions(j, cat, inner, labels)
    _mark_diff(j, live, red)
    sweep_free, pre_out = _pre_outputs(j, cat, axis, red)
    col_bytes = max(
        (math.ceil(_jc.nbytes(v.aval) / size) for v in axis if v in producer), default=0
    )
    held = dict.fromkeys(sweep_free + [v for v in j.invars[:n_split] if v not in axis])
    row_bytes = sum(_jc.nbytes(v.aval) * (2 if _jc.is_float(v) else 1) for v in held)
    row_bytes += sum(2 * math.prod(a.out_shape) * np.dtype(a.dtype).itemsize for a in red.accs)
    sources = list(j.invars) + list(j.constvars)
    return ColumnTiling(
        size=size,
        sliced=tuple((k, axis[v]) for k, v in enumerate(sources) if v in axis),
        reductions=_describe(j, red),
        source=labels.source,
        col_bytes=col_bytes,
        row_bytes=row_bytes,
        jaxpr=j,
        consts=_jc.jaxpr_consts(closed),
        axis=axis,
        cat=cat,
        accs=red.accs,
        recipes=red.recipes,
        pre_out=pre_out,
        sweep_free=sweep_free,
    )


def _mark_diff(j, live, red) -> None:
    """Marks the accumulators whose cotangent can be non-zero: inexact, and read by a
    reduction whose result the output depends on differentiably."""
    dl = _diff_live(j, live)
    for k, eqns in red.users.items():
        a = red.accs[k]
        a.diff = jnp.issubdtype(a.dtype, jnp.inexact) and any(
            j.eqns[i].outvars[0] in dl for i in eqns
        )


def _pre_outputs(j, cat: list, axis: dict, red) -> tuple[list, list]:
    """The values computed before the reductions that the sweeps read (``sweep_free``) and
    that the sweeps or the part after the reductions read (``pre_out``), in order."""
    sweep_refs: set = set()
    post_refs = set(red.reads)
    for i, e in enumerate(j.eqns):
        refs = (
            sweep_refs if cat[i] == "sweep" else post_refs if cat[i] in ("post", "reduce") else None
        )
        if refs is not None:
            refs.update(v for v in e.invars if _jc.is_var(v))
    for a in red.accs:
        for expr in (a.body, a.expo, a.other):
            _vars(expr, sweep_refs)
        if a.kind == "gather" and _jc.is_var(a.eqn.invars[1]):
            sweep_refs.add(a.eqn.invars[1])
    late = {v for i, e in enumerate(j.eqns) if cat[i] != "pre" for v in e.outvars}
    outer = [
        v
        for v in dict.fromkeys([*j.invars, *(v for e in j.eqns for v in e.outvars)])
        if v not in axis and v not in late
    ]
    sweep_free = [v for v in outer if v in sweep_refs]
    pre_out = [v for v in outer if v in sweep_refs or v in post_refs]
    return sweep_free, pre_out


def _describe(j, red) -> tuple[str, ...]:
    """One line per column reduction: the primitive, where, and the kinds of its
    accumulators."""
    return tuple(
        f"{j.eqns[i].primitive.name} at {_where(j.eqns[i])}: "
        + ", ".join(
            dict.fromkeys(_KINDS[red.accs[k].kind] for k, es in red.users.items() if i in es)
        )
        for i in sorted(red.recipes)
    )
