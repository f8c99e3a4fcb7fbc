"""autochunk: finds the row-wise tail of a loss (and its column split, where a shared weight's
columns are reduced over), and runs it in chunks sized to a byte budget; explain() says what it
chunked and why.
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
from jaxmem._src.chunking import column_axis as _axis
from jaxmem._src.chunking import columns as _cw
from jaxmem._src.chunking import rows as _rw
from jaxmem._src.chunking.chunked import (
    _MIN_TILE_BYTES,
    _TARGET_TILES,
    DEFAULT_MAX_CHUNK_BYTES,
    _Rows,
    _sum_of_chunks,
    _Tiles,
)


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
        self.origins = _rw.origins(self.jaxpr)
        self._choose()

    def _choose(self):
        """The tails to chunk (``tails``) and the sums left as written (``skipped``), or why
        nothing is chunked (``reason``)."""
        self.reason = _not_a_sum(self.jaxpr.outvars)
        if self.reason:
            return
        candidates = _rw.reductions(self.jaxpr)
        if not candidates:
            self.reason = "no scalar sum (reduce_sum of an array) in the function"
            return
        taken: set[int] = set()
        for r in reversed(candidates):  # the last sums first: usually the loss's own
            chosen, why = self._choose_tail(r, taken)
            if chosen is None:
                self.skipped.append(f"the sum at {_where(self.jaxpr.eqns[r])}: {why}")
            else:
                self.tails.append(chosen)
                taken |= set(chosen.tail.eqns)
        if not self.tails:
            self.reason = "; ".join(self.skipped) or "no row-wise tail"
            self.skipped = []

    def _choose_tail(self, r: int, taken: set[int]) -> tuple[_Chosen | None, str]:
        """How to chunk the tail of the sum ``r`` (sharing no equation with ``taken``), or
        None and why the sum is left as written."""
        best = self._best_tail(r, taken)
        if best is None:
            return None, "no axis with more than one row"
        var, nbytes = best.largest
        if not best.eqns:
            origin = self._origin(self.jaxpr.eqns[r].invars[0])
            return None, (
                f"the summed value {_type(var.aval)} is computed by {origin}, which is not row-wise"
            )
        chosen = self._tiles(best)
        if chosen.size >= best.rows and chosen.plan is None:
            return None, (
                f"its largest row-wise intermediate {_type(var.aval)} ({_fmt_bytes(nbytes)}) "
                "fits max_chunk_bytes"
            )
        return chosen, ""

    def _best_tail(self, r: int, taken: set[int]) -> _rw.Tail | None:
        """Of the tails of the sum ``r`` along its axes of more than one row, those sharing
        no equation with ``taken``, the preferred (:func:`_preference`); or None."""
        best = None
        for axis, n in enumerate(self.jaxpr.eqns[r].invars[0].aval.shape):
            if n < 2:
                continue
            tail = _rw.find_tail(self.jaxpr, r, axis)
            if set(tail.eqns) & taken:
                continue
            if best is None or _preference(tail) > _preference(best):
                best = tail
        return best

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
            plan = _cw.plan(_axis.trace_tail(self.jaxpr, tail, tail.rows), len(tail.split))
        except _axis.Refused as r:
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
        return self.origins.get(v, "a constant")

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
                traced = _axis.trace_tail(self.jaxpr, tail, length)
                plans[length] = _cw.plan(traced, len(tail.split))
            except _axis.Refused:
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


def _not_a_sum(outs) -> str:
    """Why a function with outputs ``outs`` has no sum over rows to chunk, or ``""``."""
    if len(outs) != 1 or tuple(outs[0].aval.shape) != ():
        types = ", ".join(_type(v.aval) for v in outs)
        return f"the result is not a scalar ({types}): no sum over rows to chunk"
    if not jnp.issubdtype(outs[0].aval.dtype, jnp.inexact):
        return f"the result is not floating ({_type(outs[0].aval)})"
    return ""


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
