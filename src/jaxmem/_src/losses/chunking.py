"""Chunking of loss tails that sum over independent rows, by hand and automatically.

A loss like ``sum_i loss_row(x[i], y[i]; w)`` over N tokens can run in chunks of rows. Since the
result is a scalar, each chunk's gradient can be computed as soon as the chunk is (its
contribution to ``d total / d inputs``), then scaled by the incoming cotangent in the backward
pass: nothing of a chunk's intermediates (e.g. its ``[chunk, vocab]`` logits) outlives the
chunk. This is the AutoChunker of PyTorch Inductor, and the fused linear cross-entropy of Liger.

- :func:`chunked` does it for a function the user says is such a sum (which arguments carry the
  rows, along which axis).
- :func:`autochunk` finds such a tail inside any loss (:mod:`jaxmem._src.losses.rowwise`: the
  largest row-wise part that ends in a scalar ``reduce_sum`` and creates an intermediate larger than
  a threshold), runs it chunk by chunk and the rest of the loss as written; where the tail's large
  intermediate has columns from a matmul by a shared weight, each chunk also runs in tiles of
  columns (:mod:`jaxmem._src.losses.colwise`). ``.explain(*args)`` says what it chunked, or why
  nothing.

Both compute the gradients in the forward pass when differentiated (``jax.grad``/``jax.vjp``;
never under plain evaluation, which only sums values), at the cost of a backward pass of the
tail, not more: the chunk's forward is not run twice. Forward-mode differentiation
(``jax.jvp``) is not supported (``jax.custom_vjp``): :class:`jaxmem.ForwardModeError`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._src import jax_compat as _jc
from jaxmem._src.losses import colwise as _cw
from jaxmem._src.losses import rowwise as _rw
from jaxmem._src.scan.api import ForwardModeError

_REDUCTIONS = ("sum", "mean")
DEFAULT_MAX_CHUNK_BYTES = 4 * 2**20
# Tiles of rows x columns (sizes not given): about this many, of at least
# _MIN_TILE_BYTES each (and at most max_chunk_bytes), as the default tiles of a hand-written
# tiled cross-entropy. A tile costs a loop iteration whatever its size; with fewer tiles than a
# few hundred they are larger than they need be (the temp is a few tiles).
_TARGET_TILES = 512
_MIN_TILE_BYTES = 2**20

_FORWARD_MODE = (
    "{fn} computes gradients chunk by chunk under a custom VJP, and JAX cannot apply "
    "forward-mode autodiff (jax.jvp, jax.jacfwd, jax.linearize) to a custom VJP. Call the "
    "function without {fn} where you need forward mode."
)


# ------------------------------------------------------------------------------------------
# The loop: rows split along per-leaf axes, gradient in forward.


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


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
    full, rem = divmod(n, size)
    d_rows = [_is_float(a) for a in rows_leaves]
    d_params = [_is_float(a) for a in param_leaves]

    def pick(leaves, mask, want):
        return [a for a, m in zip(leaves, mask, strict=True) if m == want]

    def merge(d, i, mask):
        it_d, it_i = iter(d), iter(i)
        return [next(it_d) if m else next(it_i) for m in mask]

    def value_of(start, length, dr, ir, dp, ip):
        return run.value(start, length, merge(dr, ir, d_rows), merge(dp, ip, d_params))

    out_dtype = jax.eval_shape(
        lambda dr, ir, dp, ip: value_of(0, size, dr, ir, dp, ip),
        pick(rows_leaves, d_rows, True),
        pick(rows_leaves, d_rows, False),
        pick(param_leaves, d_params, True),
        pick(param_leaves, d_params, False),
    ).dtype

    def value(dr, ir, dp, ip):
        def body(i, total):
            return total + value_of(i * size, size, dr, ir, dp, ip).astype(jnp.float32)

        total = jax.lax.fori_loop(0, full, body, jnp.zeros((), jnp.float32))
        if rem:
            total = total + value_of(full * size, rem, dr, ir, dp, ip).astype(jnp.float32)
        return total.astype(out_dtype)

    @jax.custom_vjp
    def core(dr, ir, dp, ip):
        return value(dr, ir, dp, ip)

    def fwd(dr, ir, dp, ip):
        rows, params = merge(dr, ir, d_rows), merge(dp, ip, d_params)

        def step(start, length, carry):
            total, g_rows, g_params = carry
            v, g_rows, g_params = run.grads(
                start, length, rows, params, d_rows, d_params, g_rows, g_params
            )
            return total + v.astype(jnp.float32), g_rows, g_params

        carry = (
            jnp.zeros((), jnp.float32),
            [jnp.zeros_like(a) for a in dr],
            [jnp.zeros(a.shape, jnp.float32 if a.dtype != jnp.float64 else a.dtype) for a in dp],
        )
        carry = jax.lax.fori_loop(0, full, lambda i, c: step(i * size, size, c), carry)
        if rem:
            carry = step(full * size, rem, carry)
        total, g_rows, g_params = carry
        g_params = [g.astype(p.dtype) for g, p in zip(g_params, dp, strict=True)]
        return total.astype(out_dtype), (g_rows, g_params)

    def bwd(res, ct):
        g_rows, g_params = res

        def scale(g):
            return (g * ct.astype(g.dtype)).astype(g.dtype)

        return (
            [scale(g) for g in g_rows],
            [None] * (len(d_rows) - sum(d_rows)),
            [scale(g) for g in g_params],
            [None] * (len(d_params) - sum(d_params)),
        )

    core.defvjp(fwd, bwd)
    try:
        return core(
            pick(rows_leaves, d_rows, True),
            pick(rows_leaves, d_rows, False),
            pick(param_leaves, d_params, True),
            pick(param_leaves, d_params, False),
        )
    except TypeError as e:
        if "forward-mode" in str(e):
            raise ForwardModeError(_FORWARD_MODE.format(fn=fname)) from e
        raise


class _Tiles:
    """Chunks of rows, each in tiles of columns (:class:`jaxmem._src.losses.colwise.ColumnPlan`).

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
      ForwardModeError: under ``jax.jvp`` / ``jax.jacfwd``.

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


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _type(aval) -> str:
    return f"{np.dtype(aval.dtype).name}{list(aval.shape)}".replace(" ", "")


@dataclasses.dataclass(frozen=True)
class ChunkedTail:
    """One tail that :func:`autochunk` runs chunk by chunk.

    Attributes:
      where: source location of the tail's final ``reduce_sum``.
      axis: the row axis of the reduced value.
      rows: the number of rows.
      chunk_size: rows per chunk; ``num_chunks`` chunks (the last may be shorter).
      num_chunks: the number of chunks.
      largest: the largest intermediate of the tail (type and where it is created).
      largest_bytes: its bytes in full; ``chunk_bytes`` for one chunk.
      chunk_bytes: bytes of the largest intermediate of one chunk.
      inputs: the tail's row inputs (type and where they come from), split into chunks.
      shared: the tail's inputs shared by every row (types).
      stopped: where the walk back from the reduction stopped, and why.
      columns: when each chunk of rows also runs in tiles of columns (2-D chunking), how many
        columns; 0 when the columns stay whole.
      column_chunk_size: columns per tile; ``num_column_chunks`` tiles (the last may be
        narrower).
      num_column_chunks: the number of column tiles.
      column_source: the matmul the columns come from.
      column_inputs: the inputs split into column tiles (type, origin, column axis).
      column_reductions: the reductions over the columns, each split into per-tile parts.
      column_note: when the columns stay whole, why.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> lean = jaxmem.autochunk(lambda x, w: jnp.sum(jnp.tanh(x @ w)), chunk_size=16)
      >>> tail = lean.explain(jnp.ones((64, 4)), jnp.ones((4, 32))).tails[0]
      >>> tail.axis, tail.rows, tail.num_chunks, tail.largest_bytes, tail.chunk_bytes
      (0, 64, 4, 8192, 2048)
      >>> tail.inputs, tail.shared
      (('float32[64,4] args[0]',), ('float32[4,32] args[1]',))
    """

    where: str
    axis: int
    rows: int
    chunk_size: int
    num_chunks: int
    largest: str
    largest_bytes: int
    chunk_bytes: int
    inputs: tuple[str, ...]
    shared: tuple[str, ...]
    stopped: tuple[str, ...]
    columns: int = 0
    column_chunk_size: int = 0
    num_column_chunks: int = 0
    column_source: str = ""
    column_inputs: tuple[str, ...] = ()
    column_reductions: tuple[str, ...] = ()
    column_note: str = ""

    @property
    def expected_saving(self) -> int:
        """Bytes the largest intermediate no longer takes (full minus one chunk)."""
        return self.largest_bytes - self.chunk_bytes


@dataclasses.dataclass(frozen=True)
class ChunkReport:
    """What :func:`autochunk` does with a loss at given argument types (``.explain(*args)``).

    Attributes:
      tails: the tails run chunk by chunk (empty when nothing qualifies).
      reason: when ``tails`` is empty, why; else ``""``.
      skipped: candidate reductions left as written, each with the reason.
      max_chunk_bytes: the threshold the report was made with.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> report = jaxmem.autochunk(lambda x: x * 2).explain(jnp.ones(3))
      >>> report.chunked, report.reason
      (False, 'the result is not a scalar (float32[3]): no sum over rows to chunk')
    """

    tails: tuple[ChunkedTail, ...]
    reason: str
    skipped: tuple[str, ...]
    max_chunk_bytes: int

    @property
    def chunked(self) -> bool:
        """Whether anything runs chunk by chunk."""
        return bool(self.tails)

    @property
    def expected_saving(self) -> int:
        """Sum over the tails of :attr:`ChunkedTail.expected_saving`."""
        return sum(t.expected_saving for t in self.tails)

    def __str__(self) -> str:
        lines = [f"autochunk (max_chunk_bytes {_fmt_bytes(self.max_chunk_bytes)}):"]
        if not self.tails:
            lines.append(f"  nothing chunked, the function runs as written: {self.reason}")
        for t in self.tails:
            tiles = (
                f", each in {t.num_column_chunks} tiles of {t.column_chunk_size} of its "
                f"{t.columns} columns"
                if t.columns
                else ""
            )
            lines += [
                f"  the sum at {t.where}: {t.rows} rows along axis {t.axis} of the summed "
                f"value, {t.num_chunks} chunks of {t.chunk_size}{tiles}",
                f"    largest intermediate {t.largest}: {_fmt_bytes(t.largest_bytes)} -> "
                f"{_fmt_bytes(t.chunk_bytes)} per {'tile' if t.columns else 'chunk'} (expected "
                f"saving {_fmt_bytes(t.expected_saving)})",
                "    rows from: " + ", ".join(t.inputs),
                "    shared: " + (", ".join(t.shared) or "nothing"),
            ]
            if t.columns:
                lines.append(f"    columns from {t.column_source}")
                lines.append("    split into column tiles: " + ", ".join(t.column_inputs))
                lines += [f"    over the columns: {r}" for r in t.column_reductions]
            else:
                lines.append(f"    columns whole: {t.column_note}")
            lines += [f"    stopped at {s}" for s in t.stopped]
        lines += [f"  left as written: {s}" for s in self.skipped]
        return "\n".join(lines)


def _where(eqn) -> str:
    return _jc.summarize_source(eqn.source_info)


class _Analysis:
    """The jaxpr of a loss at given argument types and the tails chosen in it."""

    def __init__(self, fn, args, options: _Options):
        args, kwargs = args
        max_chunk_bytes, chunk_size = options.max_chunk_bytes, options.chunk_size
        self.options = options
        self.flat_args, self.in_tree = jax.tree.flatten((args, kwargs))
        closed = jax.make_jaxpr(lambda a, k: fn(*a, **k))(args, kwargs)
        self.closed = closed
        self.jaxpr = _jc.open_jaxpr(closed)
        self.out_tree = jax.tree.structure(jax.eval_shape(lambda a, k: fn(*a, **k), args, kwargs))
        self.max_chunk_bytes = max_chunk_bytes
        self.chunk_size = chunk_size
        self.tails: list[_Chosen] = []
        self.skipped: list[str] = []
        self.reason = ""
        paths = [
            ("args" if p[0].idx == 0 else "kwargs") + jax.tree_util.keystr(p[1:])
            for p, _ in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
        ]
        self.names = dict(zip(self.jaxpr.invars, paths, strict=True))
        self.producer = {v: e for e in self.jaxpr.eqns for v in e.outvars}
        self._choose()

    def _choose(self):
        outs = self.jaxpr.outvars
        if len(outs) != 1 or tuple(outs[0].aval.shape) != ():
            types = ", ".join(_type(v.aval) for v in outs)
            self.reason = f"the result is not a scalar ({types}): no sum over rows to chunk"
            return
        if not jnp.issubdtype(outs[0].aval.dtype, jnp.inexact):
            self.reason = f"the result is not floating ({_type(outs[0].aval)})"
            return
        candidates = _rw.reductions(self.jaxpr)
        if not candidates:
            self.reason = "no scalar sum (reduce_sum of an array) in the function"
            return
        taken: set[int] = set()
        for r in reversed(candidates):  # the last sums first: usually the loss's own
            eqn = self.jaxpr.eqns[r]
            where = _where(eqn)
            best = None
            for axis, n in enumerate(eqn.invars[0].aval.shape):
                if n < 2:
                    continue
                tail = _rw.find_tail(self.jaxpr, r, axis)
                if set(tail.eqns) & taken:
                    continue
                if best is None or _preference(tail) > _preference(best):
                    best = tail
            if best is None:
                self.skipped.append(f"the sum at {where}: no axis with more than one row")
                continue
            var, nbytes = best.largest
            if not best.eqns:
                why = (
                    f"the summed value {_type(var.aval)} is computed by "
                    f"{self._origin(eqn.invars[0])}, which is not row-wise"
                )
                self.skipped.append(f"the sum at {where}: {why}")
                continue
            chosen = self._tiles(best)
            if chosen.size >= best.rows and chosen.plan is None:
                self.skipped.append(
                    f"the sum at {where}: its largest row-wise intermediate {_type(var.aval)} "
                    f"({_fmt_bytes(nbytes)}) fits max_chunk_bytes"
                )
            else:
                self.tails.append(chosen)
                taken |= set(best.eqns)
        if not self.tails:
            self.reason = "; ".join(self.skipped) or "no row-wise tail"
            self.skipped = []

    def _size(self, tail: _rw.Tail) -> int:
        if self.chunk_size is not None:
            return min(self.chunk_size, tail.rows)
        return max(1, min(tail.rows, self.max_chunk_bytes // max(1, tail.row_bytes)))

    def _tiles(self, tail: _rw.Tail) -> _Chosen:
        """Rows per chunk, and the column tiles when the tail splits along columns too."""
        plan, note = self._columns(tail)
        if plan is None:
            return _Chosen(tail, self._size(tail), None, 0, note)
        opts, budget = self.options, self._tile_bytes(plan)
        cell = max(1, math.ceil(plan.col_bytes / tail.rows))  # one row, one column
        if opts.chunk_size is not None:
            rows = min(opts.chunk_size, tail.rows)
        else:  # square tiles: the fewest re-reads of the weight and of the rows
            side = max(1, math.isqrt(max(1, budget // cell)))
            rows = min(tail.rows, 1 << (side.bit_length() - 1))
        if opts.column_chunk_size is not None:
            width = min(opts.column_chunk_size, plan.size)
        else:
            width = max(1, min(plan.size, budget // (cell * rows)))
        if rows >= tail.rows and width >= plan.size:
            return _Chosen(tail, self._size(tail), None, 0, "one tile holds every row and column")
        note = (
            ""
            if opts.column_chunk_size is not None
            else self._whole_columns(tail, plan, rows, width)
        )
        if note:
            return _Chosen(tail, self._size(tail), None, 0, note)
        return _Chosen(tail, rows, plan, width, "")

    def _tile_bytes(self, plan) -> int:
        """The bytes of one tile's largest intermediate: ``max_chunk_bytes``, or less when the
        whole intermediate makes fewer than ``_TARGET_TILES`` tiles of it (never below
        ``_MIN_TILE_BYTES``)."""
        whole = plan.col_bytes * plan.size
        return min(self.max_chunk_bytes, max(_MIN_TILE_BYTES, -(-whole // _TARGET_TILES)))

    def _columns(self, tail: _rw.Tail):
        """The column plan of a tail, or None and why the columns stay whole."""
        if not self.options.columns:
            return None, "columns=False"
        try:
            plan = _cw.plan(_cw.trace_tail(self.jaxpr, tail, tail.rows), len(tail.split))
        except _cw.Refused as r:
            return None, f"they do not split into tiles: {r}"
        return plan, ""

    def _whole_columns(self, tail: _rw.Tail, plan, rows: int, width: int) -> str:
        """Why tiles of ``rows`` x ``width`` would not help (then the columns stay whole): the
        gradient of the shared inputs split along the columns, which each chunk of rows
        creates whole, is small next to the budget or to what a tile holds per row."""
        n = len(tail.split)
        shared = sum(
            math.prod(tail.params[k - n].aval.shape) * 4
            for k, _ in plan.sliced
            if n <= k < n + len(tail.params)
        )
        row = math.ceil(plan.col_bytes / tail.rows) * plan.size
        if row > self.max_chunk_bytes:
            return ""  # one row of the columns alone is over the budget
        if shared <= self.max_chunk_bytes:
            return (
                f"the gradient of the inputs split along them ({_fmt_bytes(shared)}) fits "
                "max_chunk_bytes"
            )
        held = math.ceil(plan.row_bytes / tail.rows) * rows + shared * width // plan.size
        if held >= shared:
            return (
                f"a tile of {rows} rows and {width} columns would hold {_fmt_bytes(held)} "
                f"besides its block, no less than the gradient of the inputs split along them "
                f"that a chunk of rows creates ({_fmt_bytes(shared)})"
            )
        return ""

    def _origin(self, v) -> str:
        if v in self.names:
            return self.names[v]
        eqn = self.producer.get(v)
        return "a constant" if eqn is None else f"{eqn.primitive.name} at {_where(eqn)}"

    def report(self) -> ChunkReport:
        tails = []
        for chosen in self.tails:
            tail, size, plan, width = chosen.tail, chosen.size, chosen.plan, chosen.width
            var, nbytes = tail.largest
            red = self.jaxpr.eqns[tail.reduction]
            chunk_bytes = tail.row_bytes * size
            columns: dict[str, Any] = {"column_note": chosen.note}
            if plan is not None:
                chunk_bytes = math.ceil(plan.col_bytes / tail.rows) * size * width
                sources = [v for v, _ in tail.split] + list(tail.params)
                columns = {
                    "columns": plan.size,
                    "column_chunk_size": width,
                    "num_column_chunks": -(-plan.size // width),
                    "column_source": plan.source,
                    "column_inputs": tuple(
                        f"{_type(sources[k].aval)} {self._origin(sources[k])} (axis {a})"
                        for k, a in plan.sliced
                        if k < len(sources)
                    ),
                    "column_reductions": plan.reductions,
                }
            tails.append(
                ChunkedTail(
                    where=_where(red),
                    axis=_axis_of(tail, red),
                    rows=tail.rows,
                    chunk_size=size,
                    num_chunks=-(-tail.rows // size),
                    largest=f"{_type(var.aval)} from {self._origin(var)}",
                    largest_bytes=nbytes,
                    chunk_bytes=chunk_bytes,
                    inputs=tuple(f"{_type(v.aval)} {self._origin(v)}" for v, _ in tail.split),
                    shared=tuple(f"{_type(v.aval)} {self._origin(v)}" for v in tail.params),
                    stopped=tuple(
                        f"{_type(v.aval)}: {prim} is not row-wise"
                        if prim != "used outside the tail"
                        else f"{_type(v.aval)}: also used outside the tail"
                        for prim, v in tail.stopped
                    ),
                    **columns,
                )
            )
        return ChunkReport(tuple(tails), self.reason, tuple(self.skipped), self.max_chunk_bytes)

    def run(self, fname: str):
        """Evaluates the loss: segments of the jaxpr as written, each tail chunk by chunk."""
        jaxpr = self.jaxpr
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, _jc.jaxpr_consts(self.closed), strict=True))
        env.update(zip(jaxpr.invars, self.flat_args, strict=True))
        members = {i for c in self.tails for i in c.tail.eqns} | _rw.dead(jaxpr)
        at = {c.tail.reduction: c for c in self.tails}
        later_uses = _later_uses(jaxpr, [c.tail for c in self.tails])

        def read(v):
            return env[v] if _jc.is_var(v) else v.val

        segment: list[int] = []

        def flush(end: int):
            if not segment:
                return
            eqns = [jaxpr.eqns[i] for i in segment]
            defined = {v for e in eqns for v in e.outvars}
            invars = list(
                dict.fromkeys(
                    v for e in eqns for v in e.invars if _jc.is_var(v) and v not in defined
                )
            )
            outvars = [v for v in defined if _jc.is_var(v) and later_uses(v, end)]
            sub = _jc.make_jaxpr(jaxpr, constvars=[], invars=invars, outvars=outvars, eqns=eqns)
            vals = _jc.jaxpr_as_fun(_jc.closed_jaxpr(sub, []))(*[read(v) for v in invars])
            env.update(zip(outvars, vals, strict=True))
            segment.clear()

        for i in range(len(jaxpr.eqns)):
            if i in members:
                continue
            if i not in at:
                segment.append(i)
                continue
            flush(i)
            chosen = at[i]
            tail, size = chosen.tail, chosen.size
            split_vals = [read(v) for v, _ in tail.split]
            param_vals = [read(v) for v in tail.params]

            def fn(length, rows_, params_, tail=tail):
                return _rw.run_tail(jaxpr, tail, length, rows_, params_)

            axes = [k for _, k in tail.split]
            run = _Rows(fn, axes)
            if chosen.plan is not None:
                run = _Tiles(self._plans(chosen), run, axes, len(axes), chosen.width)
            (out,) = jaxpr.eqns[i].outvars
            env[out] = _sum_of_chunks(run, split_vals, param_vals, tail.rows, size, fname)
        flush(len(jaxpr.eqns))
        return jax.tree.unflatten(self.out_tree, [read(v) for v in jaxpr.outvars])

    def _plans(self, chosen: _Chosen) -> dict:
        """The column plan of each chunk length (None where a length does not split)."""
        tail, size = chosen.tail, chosen.size
        plans = {}
        for length in {size, tail.rows % size} - {0}:
            if length == tail.rows:
                plans[length] = chosen.plan
                continue
            try:
                traced = _cw.trace_tail(self.jaxpr, tail, length)
                plans[length] = _cw.plan(traced, len(tail.split))
            except _cw.Refused:
                plans[length] = None  # that chunk runs with its columns whole
        return plans


@dataclasses.dataclass(frozen=True)
class _Chosen:
    """A tail to chunk: rows per chunk, and its column plan and tile width (or why none)."""

    tail: _rw.Tail
    size: int
    plan: Any
    width: int
    note: str


@dataclasses.dataclass(frozen=True)
class _Options:
    max_chunk_bytes: int
    chunk_size: int | None
    column_chunk_size: int | None
    columns: bool


def _preference(tail: _rw.Tail) -> tuple:
    """Which axis of a sum to chunk along: the one whose tail has the largest intermediate,
    then the most intermediates of that size (the axis along which more of the loss is
    row-wise: not the columns a softmax reduces), then the most rows."""
    largest = tail.largest[1]
    return (largest, tail.total_bytes // max(1, largest), tail.rows)


def _axis_of(tail: _rw.Tail, red) -> int:
    return tail.axes[id(red)][0][0]


def _later_uses(jaxpr, tails: Sequence[_rw.Tail]):
    """``uses(v, i)``: whether ``v`` is read at index ``>= i`` (a tail's inputs are read at its
    reduction) or is an output."""
    last: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if _jc.is_var(v):
                last[v] = i
    for tail in tails:
        for v in [v for v, _ in tail.split] + list(tail.params):
            last[v] = max(last.get(v, -1), tail.reduction)
    for v in jaxpr.outvars:
        if _jc.is_var(v):
            last[v] = len(jaxpr.eqns)

    def uses(v, i: int) -> bool:
        return last.get(v, -1) >= i

    return uses


class AutoChunked:
    """The function :func:`autochunk` returns: call it like the loss; ``.explain(*args)``.

    Each call traces the loss for the arguments' types, finds the tails to chunk (as
    ``explain`` reports them) and runs it; under :func:`jax.jit` that happens once per
    compilation.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> lean = jaxmem.autochunk(lambda x: jnp.sum(jnp.exp(x)), chunk_size=2)
      >>> float(lean(jnp.zeros((5, 3))))
      15.0
      >>> lean.max_chunk_bytes == jaxmem.autochunk(len).max_chunk_bytes
      True
    """

    def __init__(self, fn, options: _Options, warn: bool):
        self._fn = fn
        self._options = options
        self._max = options.max_chunk_bytes
        self._warn = warn
        self._warned: set = set()
        functools.update_wrapper(self, fn)

    @property
    def max_chunk_bytes(self) -> int:
        """The bytes one chunk's largest intermediate may take."""
        return self._max

    def _analysis(self, args, kwargs) -> _Analysis:
        return _Analysis(self._fn, (args, kwargs), self._options)

    def __call__(self, *args, **kwargs):
        analysis = self._analysis(args, kwargs)
        if not analysis.tails:
            key = (
                jax.tree.structure((args, kwargs)),
                tuple((np.shape(a), jnp.result_type(a)) for a in analysis.flat_args),
            )
            if self._warn and key not in self._warned:
                self._warned.add(key)
                warnings.warn(
                    f"jaxmem.autochunk({getattr(self._fn, '__name__', 'fn')}): nothing "
                    f"chunked, the function runs as written: {analysis.reason}",
                    stacklevel=2,
                )
            return self._fn(*args, **kwargs)
        return analysis.run("jaxmem.autochunk")

    def explain(self, *args, **kwargs) -> ChunkReport:
        """What calling with ``args`` (arrays or ``jax.ShapeDtypeStruct``) chunks, and why."""
        return self._analysis(args, kwargs).report()


def autochunk(
    fn: Callable[..., jax.Array],
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    chunk_size: int | None = None,
    column_chunk_size: int | None = None,
    columns: bool = True,
    warn: bool = True,
) -> AutoChunked:
    """Runs the memory-heavy row-wise tail of a scalar loss chunk by chunk, found automatically.

    ``fn`` is traced (at each call, for the arguments' types). Walking back from each scalar
    ``reduce_sum`` (``jnp.sum``, ``jnp.mean``, ``optax`` means...), autochunk finds the largest
    part of the computation that is *row-wise* along one axis of the summed value: every row of
    every intermediate depends only on the same row of some inputs (the hidden states, the
    labels) and on values shared by every row (the weights). Each primitive's rule proves it
    (elementwise ops, dot products, broadcasts, reshapes, reductions along other axes, gathers
    such as ``take_along_axis``, ``jit`` calls, ...); random numbers, custom derivative rules
    (``jax.nn.relu``), collectives and anything unknown end the tail, and so does an
    intermediate that is also used outside it. When the tail creates an intermediate larger
    than ``max_chunk_bytes`` (the ``[tokens, vocab]`` logits of an LM head, the ``[tokens, 4d]``
    hidden of an MLP head), it runs as :func:`chunked` does: in chunks of rows, gradient in
    forward, nothing of a chunk kept for the backward pass. The rest of ``fn`` runs as written.

    *2-D chunking.* A chunk of rows still creates the whole gradient of the weights it shares
    (``[D, V]`` for an LM head), and one row's ``[V]`` logits may alone be large. When the
    columns of the large intermediate come from a matmul by a shared weight and every use of
    them splits into per-tile parts (sums, maxima and minima over the columns, the logit at the
    label taken with ``take_along_axis``, a matmul contracting them; values computed from such
    reductions and used again per column, as in a log-softmax, are rewritten exactly: the sum of
    ``exp(z - max)`` runs as an online log-sum-exp), each chunk of rows also runs in tiles of
    columns: a forward sweep accumulates the reductions, a backward sweep recomputes each tile
    and adds its share of the weight's gradient in place. Tiles are about square, one tile's
    largest intermediate within ``max_chunk_bytes`` and, where that still makes fewer than
    about 512 tiles, smaller: about 512 tiles of at least 1 MiB (the temp is a few tiles, and a
    tile costs one loop iteration whatever its size). The columns stay whole (``.explain`` says
    why) when a use does not split (a sort or cumulative sum along them, a ``log`` of a
    probability, ...), when ``columns=False``, or when the gradient of the weights split along
    them is small: within ``max_chunk_bytes``, or no more than what a tile holds per row.

    Where nothing qualifies (no row-wise tail, a non-scalar result, intermediates below the
    threshold) the function runs unchanged and a warning says why once per argument types
    (``warn=False`` silences it); ``.explain(*args)`` returns a :class:`ChunkReport` that says
    what is chunked, along which axes, the chunk and tile sizes and the bytes expected to be
    saved, or why nothing is.

    Values and gradients equal ``fn``'s up to float rounding (sums run chunk by chunk and tile
    by tile).

    Args:
      fn: the loss, returning a scalar.
      max_chunk_bytes: the bytes one chunk's (or tile's) largest intermediate may take (default
        4 MiB; tiles of rows and columns may take less, see above); tails whose largest
        intermediate is smaller are left as written.
      chunk_size: rows per chunk, instead of the size derived from ``max_chunk_bytes``.
      column_chunk_size: columns per tile, instead of the size derived from
        ``max_chunk_bytes``; given, the columns are split whenever they can be.
      columns: whether chunks of rows may also run in tiles of columns.
      warn: warn when nothing is chunked.

    Returns:
      An :class:`AutoChunked` callable, ``fn``'s drop-in, with ``.explain(*args)``.

    Raises:
      ForwardModeError: when a chunked tail meets ``jax.jvp`` / ``jax.jacfwd``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import jaxmem
      >>> def loss(x, w, labels):
      ...     logits = x @ w
      ...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      >>> x, w = jnp.ones((64, 8)), jnp.ones((8, 512)) * 0.01
      >>> labels = jnp.zeros((64,), jnp.int32)
      >>> lean = jaxmem.autochunk(loss, max_chunk_bytes=16 * 1024)
      >>> report = lean.explain(x, w, labels)
      >>> report.tails[0].num_chunks, report.tails[0].chunk_size, report.tails[0].columns
      (8, 8, 0)
      >>> bool(jnp.allclose(lean(x, w, labels), loss(x, w, labels)))
      True
      >>> g = jax.grad(lean, argnums=(0, 1))(x, w, labels)
      >>> bool(jnp.allclose(g[1], jax.grad(loss, argnums=1)(x, w, labels)))
      True

      Tiles of rows and columns (here at most 4 KiB of logits each):

      >>> tiled = jaxmem.autochunk(loss, max_chunk_bytes=4 * 1024)
      >>> tail = tiled.explain(x, w, labels).tails[0]
      >>> tail.chunk_size, tail.column_chunk_size, tail.num_column_chunks
      (32, 32, 16)
      >>> tail.column_inputs
      ('float32[8,512] args[1] (axis 1)',)
      >>> g = jax.grad(tiled, argnums=(0, 1))(x, w, labels)
      >>> bool(jnp.allclose(g[1], jax.grad(loss, argnums=1)(x, w, labels), atol=1e-7))
      True
    """
    fname = "jaxmem.autochunk"
    if not callable(fn):
        raise TypeError(f"{fname}: fn must be callable, got {type(fn).__name__}")
    if isinstance(max_chunk_bytes, bool) or not isinstance(max_chunk_bytes, int):
        raise TypeError(f"{fname}: max_chunk_bytes must be an int, got {max_chunk_bytes!r}")
    if max_chunk_bytes < 1:
        raise ValueError(f"{fname}: max_chunk_bytes must be positive, got {max_chunk_bytes}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"{fname}: chunk_size must be a positive int or None, got {chunk_size!r}")
    if column_chunk_size is not None and (
        isinstance(column_chunk_size, bool)
        or not isinstance(column_chunk_size, int)
        or column_chunk_size < 1
    ):
        raise ValueError(
            f"{fname}: column_chunk_size must be a positive int or None, got {column_chunk_size!r}"
        )
    options = _Options(max_chunk_bytes, chunk_size, column_chunk_size, bool(columns))
    return AutoChunked(fn, options, bool(warn))
