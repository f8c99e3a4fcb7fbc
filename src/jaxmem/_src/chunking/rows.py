"""Which parts of a jaxpr are row-wise, and how to run them on a chunk of the rows.

A value is *row-wise along axis a* when, for every row ``i`` along ``a``, its slice ``i`` depends
only on slice ``i`` of some inputs (the *split* inputs, each along its own axis) and on values
that do not vary with the rows (the *parameters*). The tail of a loss that ends in
``reduce_sum(t)`` over the rows of a row-wise ``t`` can then run chunk by chunk
(:mod:`jaxmem._src.chunking.chunked`). This module answers the two questions that needs:

1. :func:`find_tail`: walking back from a scalar ``reduce_sum``, the largest set of equations
   whose outputs are row-wise, given per-primitive rules (``_RULES``: from the row axis of an
   equation's output, the row axis of each input, or None for an input shared by every row; an
   equation without a rule, or whose rule does not apply, ends the tail there). The set is
   closed: none of its intermediates is used outside it, so none has to exist in full.
2. :func:`run_tail`: evaluates those equations on ``rows`` rows instead of the traced count,
   rewriting the few parameters that spell a shape (``broadcast_in_dim``'s ``shape``,
   ``reshape``'s ``new_sizes``, ``iota``'s ``shape``, ``slice``'s limits, ``gather``'s
   ``slice_sizes``); ``jit`` calls inside the tail are entered and rewritten the same way.

Conservative by construction: an equation is row-wise only when its rule proves it from the
shapes and parameters, so an unknown primitive (random bits, collectives, custom derivative
rules, effects) keeps the tail from passing through it, never the other way round.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax.extend import source_info_util as _siu

from jaxmem._src import jax_compat as _jc

# Each rule: (eqn, out_axes) -> in_axes (an int per input carrying the rows, None for an input
# shared by every row) or None when the equation is not row-wise for these output axes.
Rule = Callable[[Any, list], "list | None"]

_UNARY = """neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan
asin acos atan sinh cosh asinh acosh atanh abs sqrt rsqrt cbrt erf erfc erf_inv lgamma digamma
not imag real conj integer_pow convert_element_type reduce_precision stop_gradient copy copy_p
square population_count clz name""".split()
_BINARY = """add sub mul div rem pow max min atan2 nextafter and or xor eq ne lt le gt ge
shift_left shift_right_logical shift_right_arithmetic add_any complex select_n clamp""".split()
_REDUCTIONS = """reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor
argmax argmin""".split()
_CUMULATIVE = "cumsum cumprod cummax cummin cumlogsumexp".split()


def _shape(v) -> tuple:
    return tuple(v.aval.shape)


def _elementwise(eqn, out_axes):
    (a,) = out_axes
    out = _shape(eqn.outvars[0])
    in_axes = []
    for v in eqn.invars:
        s = _shape(v)
        if not s:
            in_axes.append(None)  # a scalar, shared by every row
        elif len(s) != len(out):
            return None
        elif s[a] == out[a]:
            in_axes.append(a)
        elif s[a] == 1:
            in_axes.append(None)  # broadcast along the rows
        else:
            return None
    return in_axes


def _broadcast_in_dim(eqn, out_axes):
    (a,) = out_axes
    operand = eqn.invars[0]
    dims = tuple(eqn.params["broadcast_dimensions"])
    if len(eqn.invars) != 1:
        return None  # dynamic shapes
    if a not in dims:
        return [None]
    k = dims.index(a)
    if _shape(operand)[k] == _shape(eqn.outvars[0])[a]:
        return [k]
    return [None]  # a size-1 dimension broadcast along the rows


def _reshape(eqn, out_axes):
    (a,) = out_axes
    if eqn.params.get("dimensions") is not None or len(eqn.invars) != 1:
        return None
    src, out = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    before = math.prod(out[:a])
    for k in range(len(src)):
        if math.prod(src[:k]) == before and src[k] == out[a]:
            return [k]  # same leading product and size: row i maps to row i
    return None


def _squeeze(eqn, out_axes):
    (a,) = out_axes
    dims = set(eqn.params["dimensions"])
    kept = [k for k in range(len(_shape(eqn.invars[0]))) if k not in dims]
    return [kept[a]]


def _transpose(eqn, out_axes):
    (a,) = out_axes
    return [eqn.params["permutation"][a]]


def _reduction(eqn, out_axes):
    (a,) = out_axes[:1]
    axes = set(eqn.params["axes"])
    kept = [k for k in range(len(_shape(eqn.invars[0]))) if k not in axes]
    return [kept[a]]


def _cumulative(eqn, out_axes):
    (a,) = out_axes
    return None if eqn.params["axis"] == a else [a]


def _dot_general(eqn, out_axes):
    (a,) = out_axes
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs_free = [k for k in range(len(_shape(eqn.invars[0]))) if k not in lc and k not in lb]
    rhs_free = [k for k in range(len(_shape(eqn.invars[1]))) if k not in rc and k not in rb]
    if a < len(lb):
        return [lb[a], rb[a]]
    if a < len(lb) + len(lhs_free):
        return [lhs_free[a - len(lb)], None]
    return [None, rhs_free[a - len(lb) - len(lhs_free)]]


def _iota(eqn, out_axes):
    (a,) = out_axes
    # Along the rows its values are the row numbers: different in every chunk.
    return None if eqn.params["dimension"] == a or eqn.invars else []


def _concatenate(eqn, out_axes):
    (a,) = out_axes
    return None if eqn.params["dimension"] == a else [a] * len(eqn.invars)


def _pad(eqn, out_axes):
    (a,) = out_axes
    lo, hi, interior = eqn.params["padding_config"][a]
    return [a, None] if (lo, hi, interior) == (0, 0, 0) else None


def _slice(eqn, out_axes):
    # The first rows (``logits[:, :-1]``): row i is row i of the operand, whose later rows the
    # tail does not read (the chunks cover the output's rows).
    (a,) = out_axes
    p = eqn.params
    stride = 1 if p["strides"] is None else p["strides"][a]
    return [a] if p["start_indices"][a] == 0 and stride == 1 else None


def _split(eqn, out_axes):
    axes = {x for x in out_axes if x is not None}
    if len(axes) != 1:
        return None
    (a,) = axes
    return None if eqn.params["axis"] == a else [a]


def _gather(eqn, out_axes):
    (a,) = out_axes
    dn = eqn.params["dimension_numbers"]
    operand, indices = eqn.invars
    op_rank = len(_shape(operand))
    offset_dims = tuple(dn.offset_dims)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    if a in offset_dims:
        # A dimension of the operand taken whole: the row axis of the operand, unindexed.
        slice_dims = [
            k for k in range(op_rank) if k not in dn.collapsed_slice_dims and k not in op_batch
        ]
        k = slice_dims[offset_dims.index(a)]
        whole = eqn.params["slice_sizes"][k] == _shape(operand)[k]
        return [k, None] if whole and k not in dn.start_index_map else None
    # A batch dimension of the indices (the last dimension of indices is the index vector).
    j = [d for d in range(len(_shape(eqn.outvars[0]))) if d not in offset_dims].index(a)
    if j in idx_batch:
        return [op_batch[idx_batch.index(j)], j]  # row i of the operand, by row i's index
    return [None, j]  # a lookup into a shared table (an embedding)


_CALLS = ("jit", "pjit", "closed_call", "core_call")
_LAYOUT = ("transpose", "reshape", "squeeze", "broadcast_in_dim", "expand_dims")


def _call_axes(eqn, out_axes) -> dict:
    """The axes of the equations inside a row-wise call (nested calls included)."""
    (sub,) = _jc.subjaxprs(eqn)
    return _inner_axes(sub, out_axes)[1]


def _call(eqn, out_axes):
    (sub,) = _jc.subjaxprs(eqn)
    found = _inner_axes(sub, out_axes)
    return None if found is None else found[0]


_RULES: dict[str, Rule] = {
    **{name: _elementwise for name in _UNARY + _BINARY},
    **{name: _reduction for name in _REDUCTIONS},
    **{name: _cumulative for name in _CUMULATIVE},
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "transpose": _transpose,
    "dot_general": _dot_general,
    "iota": _iota,
    "concatenate": _concatenate,
    "pad": _pad,
    "slice": _slice,
    "split": _split,
    "gather": _gather,
    **{name: _call for name in _CALLS},
}


def in_axes(eqn, out_axes: list) -> list | None:
    """The rows' axis of each input of ``eqn``, or None when it is not row-wise."""
    rule = _RULES.get(eqn.primitive.name)
    if rule is None or eqn.effects or any(a is None for a in out_axes):
        return None
    if len(out_axes) != 1 and eqn.primitive.name != "split":
        return None
    try:
        axes = rule(eqn, out_axes)
    except (KeyError, IndexError, ValueError, TypeError, AttributeError):
        return None  # parameters this rule does not know (another JAX version): not row-wise
    if axes is None or len(axes) != len(eqn.invars):
        return None
    for v, k in zip(eqn.invars, axes, strict=True):
        if k is not None and (not _jc.is_var(v) or k >= len(_shape(v))):
            return None
    return axes


# Per equation (by id) of a tail: (input axes, output axes), for run_tail.
Axes = dict


def _inner_axes(jaxpr, out_axes: list) -> tuple[list, Axes] | None:
    """Input axes of a called jaxpr whose every equation must be row-wise, or None."""
    required = _output_axes(jaxpr.outvars, out_axes)
    if required is None:
        return None
    axes: Axes = {}
    for eqn in reversed(jaxpr.eqns):
        outs = [required.get(v, "unused") for v in eqn.outvars if not _jc.is_drop_var(v)]
        if all(o == "unused" for o in outs):
            continue  # not needed: run_tail skips it
        ins = _needed_in_axes(eqn, outs, axes)
        if ins is None:
            return None
        for v, k in zip(eqn.invars, ins, strict=True):
            if _jc.is_var(v) and required.setdefault(v, k) != k:
                return None
        axes[id(eqn)] = (ins, outs)
    return [required.get(v) for v in jaxpr.invars], axes


def _output_axes(outvars, out_axes: list) -> dict[Any, int | None] | None:
    """The rows' axis of each output variable of a called jaxpr, or None where they disagree
    (or a literal output would carry rows)."""
    required: dict[Any, int | None] = {}
    for v, a in zip(outvars, out_axes, strict=True):
        if not _jc.is_var(v):
            if a is not None:
                return None
            continue
        if required.setdefault(v, a) != a:
            return None
    return required


def _needed_in_axes(eqn, outs: list, axes: Axes) -> list | None:
    """The input axes of an equation of a called jaxpr whose outputs are needed with axes
    ``outs``, or None when it is not row-wise; a call's inner axes join ``axes``."""
    if any(o == "unused" for o in outs):
        return None
    if all(o is None for o in outs):
        # Shared by every row: runs unchanged.
        return None if eqn.effects else [None] * len(eqn.invars)
    ins = in_axes(eqn, outs)
    if ins is not None and eqn.primitive.name in _CALLS:
        axes.update(_call_axes(eqn, outs))
    return ins


@dataclasses.dataclass
class Tail:
    """A row-wise tail ending in a scalar ``reduce_sum`` (see :func:`find_tail`).

    Attributes:
      reduction: the index of the ``reduce_sum`` equation in the top-level jaxpr.
      eqns: the indices of the tail's other equations, in order.
      split: ``(var, axis)`` of each input carrying the rows (computed before the tail); it
        may have more rows than ``rows`` (after a slice of the first rows), never fewer.
      params: the inputs shared by every row.
      rows: the number of rows.
      axes: per equation (by id, nested calls included): (input axes, output axes).
      largest: ``(var, bytes)`` of the tail's largest intermediate.
      row_bytes: the bytes of one of its rows.
      stopped: ``(primitive, var)`` pairs where the walk back had to stop: the split inputs that
        are produced by an equation that is not row-wise.
      total_bytes: the bytes of all the tail's intermediates.
    """

    reduction: int
    eqns: tuple[int, ...]
    split: tuple[tuple[Any, int], ...]
    params: tuple[Any, ...]
    rows: int
    axes: Axes
    largest: tuple[Any, int]
    row_bytes: int
    stopped: tuple[tuple[str, Any], ...]
    total_bytes: int = 0


def dead(jaxpr) -> set[int]:
    """Indices of the equations none of whose outputs is used (and without effects)."""
    live = {v for v in jaxpr.outvars if _jc.is_var(v)}
    dead = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if eqn.effects or any(v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if _jc.is_var(v))
        else:
            dead.add(i)
    return dead


def reductions(jaxpr) -> list[int]:
    """Indices of the scalar floating ``reduce_sum`` equations of a top-level jaxpr."""
    out = []
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "reduce_sum" or not _jc.is_var(eqn.invars[0]):
            continue
        v = eqn.outvars[0]
        if _shape(v) == () and jnp.issubdtype(v.aval.dtype, jnp.inexact) and _shape(eqn.invars[0]):
            out.append(i)
    return out


def find_tail(jaxpr, reduction: int, axis: int) -> Tail:
    """The largest closed row-wise tail ending in equation ``reduction``, rows along ``axis``.

    Walks back from the reduced value ``t`` (rows along ``axis`` of ``t``): an equation joins
    the tail when its outputs are used with a row axis by the tail and its rule gives the row
    axis of each input consistently; then equations whose outputs are also used outside the
    tail (or are outputs of the jaxpr) leave it, until none is.
    """
    eqns = jaxpr.eqns
    red = eqns[reduction]
    t = red.invars[0]
    walk = _Walk(required={t: axis}, axes={id(red): ([axis], [None])})
    for i in range(reduction - 1, -1, -1):
        walk.visit(i, eqns[i])
    _close(jaxpr, reduction, walk)
    split, params, produced = _inputs(eqns, walk.members, reduction, axis)
    sizes = [
        (v, _jc.nbytes(v.aval))
        for v in produced
        if not _jc.is_drop_var(v) and walk.required.get(v) is not None
    ]
    largest = max(sizes, key=lambda p: p[1], default=(t, _jc.nbytes(t.aval)))
    rows_of_largest = _shape(largest[0])[walk.required.get(largest[0], axis)]
    stopped = tuple((walk.stops[v], v) for v in split if v in walk.stops)
    assert not set(split) & set(params), "a tail input both split and shared"
    return Tail(
        reduction,
        tuple(sorted(walk.members)),
        tuple(split.items()),
        tuple(params),
        _shape(t)[axis],
        walk.axes,
        largest,
        math.ceil(largest[1] / max(1, rows_of_largest)),
        stopped,
        sum(b for _, b in sizes),
    )


@dataclasses.dataclass
class _Walk:
    """The walk back from a tail's reduction: the row axis the tail needs of each value, the
    axes of the equations joined so far (``members`` by index, ``axes`` by id, nested calls
    included), and what produced each value where the walk had to stop."""

    required: dict[Any, int | None]
    axes: Axes
    members: dict[int, tuple] = dataclasses.field(default_factory=dict)
    stops: dict[Any, str] = dataclasses.field(default_factory=dict)

    def visit(self, i: int, eqn) -> None:
        """Joins equation ``i`` when the tail uses its outputs with row axes and its inputs'
        axes agree with the tail's; notes a stop when its outputs cannot be row-wise."""
        outs = [self.required.get(v, "unused") for v in eqn.outvars if not _jc.is_drop_var(v)]
        if all(o == "unused" for o in outs):
            return  # not used by the tail
        if all(o is None for o in outs) and eqn.primitive.name in _LAYOUT and not eqn.effects:
            # A shared value's transpose or reshape (``embedding.T``, a LayerNorm scale as
            # [1, 1, D]) joins the tail: its gradient is then the original's, and XLA folds the
            # layout change into its use instead of a copy that lives through the loop.
            ins = [None] * len(eqn.invars)
        elif any(o is None for o in outs):
            return  # used as a parameter: computed before the tail
        else:
            ins = None if "unused" in outs else in_axes(eqn, outs)
        if ins is None or self._conflicts(eqn, ins):
            for v in eqn.outvars:
                self.stops.setdefault(v, eqn.primitive.name)
            return
        self._join(i, eqn, ins, outs)

    def _conflicts(self, eqn, ins: list) -> bool:
        """Whether an input of ``eqn`` would need another row axis than the tail needs."""
        return any(
            _jc.is_var(v) and self.required.get(v, k) != k
            for v, k in zip(eqn.invars, ins, strict=True)
        )

    def _join(self, i: int, eqn, ins: list, outs: list) -> None:
        """Adds equation ``i`` to the tail, its inputs needed with axes ``ins``."""
        for v, k in zip(eqn.invars, ins, strict=True):
            if _jc.is_var(v):
                self.required[v] = k
        self.members[i] = (ins, outs)
        if eqn.primitive.name in _CALLS:
            self.axes.update(_call_axes(eqn, outs))
        self.axes[id(eqn)] = (ins, outs)


def _close(jaxpr, reduction: int, walk: _Walk) -> None:
    """Closes the tail: an intermediate used outside it (or an output of the jaxpr) must exist
    in full, so its producer (and whatever in the tail only feeds it) leaves, until none is."""
    eqns = jaxpr.eqns
    users = _users(jaxpr)
    outvars = {v for v in jaxpr.outvars if _jc.is_var(v)}
    changed = True
    while changed:
        changed = False
        inside = set(walk.members) | {reduction}
        for i in sorted(walk.members):
            escapes = any(
                v in outvars or users.get(v, set()) - inside
                for v in eqns[i].outvars
                if not _jc.is_drop_var(v)
            )
            if escapes:
                for v in eqns[i].outvars:
                    walk.stops.setdefault(v, "used outside the tail")
                del walk.members[i]
                changed = True


def _users(jaxpr) -> dict[Any, set[int]]:
    """The equations that read each variable. Dead equations (``_ = sign z`` in jnp.log of a
    sum) read nothing."""
    dead_set = dead(jaxpr)
    users: dict[Any, set[int]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if i in dead_set:
            continue
        for v in eqn.invars:
            if _jc.is_var(v):
                users.setdefault(v, set()).add(i)
    return users


def _inputs(eqns, members: dict, reduction: int, axis: int) -> tuple[dict, dict, set]:
    """The tail's inputs: those split along the rows (with their axes), those shared by every
    row (keys, in order), and the set of values the tail produces."""
    inside = set(members) | {reduction}
    produced = {v for i in members for v in eqns[i].outvars}
    split: dict[Any, int] = {}
    params: dict[Any, None] = {}
    for i in sorted(inside):
        ins = members[i][0] if i in members else [axis]
        for v, k in zip(eqns[i].invars, ins, strict=True):
            if not _jc.is_var(v) or v in produced:
                continue
            if k is None:
                params[v] = None
            else:
                split[v] = k
    return split, params, produced


def _resize(shape: Sequence[int], axis: int, rows: int) -> tuple:
    shape = list(shape)
    shape[axis] = rows
    return tuple(shape)


def rewrite(eqn, out_axes: list, rows: int) -> dict:
    """``eqn``'s parameters with the rows' dimension of every spelled shape set to ``rows``."""
    p = dict(eqn.params)
    name = eqn.primitive.name
    a = next((x for x in out_axes if x is not None), None)
    if a is None:
        return p
    if name in ("broadcast_in_dim", "iota"):
        p["shape"] = _resize(p["shape"], a, rows)
    elif name == "reshape":
        p["new_sizes"] = _resize(p["new_sizes"], a, rows)
    elif name == "slice":
        p["limit_indices"] = _resize(p["limit_indices"], a, rows)
    elif name == "gather" and a in p["dimension_numbers"].offset_dims:
        k = _gather(eqn, out_axes)[0]
        p["slice_sizes"] = _resize(p["slice_sizes"], k, rows)
    return p


def source_of(eqn, outer):
    """Where a re-bound equation says it comes from: its own source, or, inside a library's jit
    (no user frame), ``outer``, the library's call; so that a trace of a tail points at the loss."""
    if outer is None or _jc.summarize_source(eqn.source_info):
        return eqn.source_info
    return outer


def bind_at(eqn, invals: Sequence, params: dict, info) -> list:
    """``eqn``'s primitive bound to ``invals`` with ``params``, traced at source ``info``; its
    outputs as a list."""
    with _siu.user_context(info.traceback, name_stack=info.name_stack):
        return _jc.bind_eqn(eqn, invals, params)


def _eval(jaxpr, consts: Sequence, args: Sequence, axes: Axes, rows: int, outer=None) -> list:
    def apply(eqn, invals):
        if id(eqn) not in axes:
            return None  # not needed by the tail
        _, out_axes = axes[id(eqn)]
        info = source_of(eqn, outer)
        if eqn.primitive.name in _CALLS:
            body, consts_b = _jc.call_body(eqn)
            if all(a is None for a in out_axes):  # shared by every row: runs as written
                return _jc.jaxpr_as_fun(_jc.closed_jaxpr(body, consts_b))(*invals)
            return _eval(body, consts_b, invals, axes, rows, info)
        return bind_at(eqn, invals, rewrite(eqn, out_axes, rows), info)

    return _jc.eval_eqns(jaxpr, consts, args, apply)


def run_tail(jaxpr, tail: Tail, rows: int, split_vals: Sequence, param_vals: Sequence):
    """The value of the tail's ``reduce_sum`` over ``rows`` rows (a chunk of the split inputs).

    ``jaxpr`` is the open top-level jaxpr the tail was found in; ``split_vals`` hold ``rows``
    rows along their axes, in the order of ``tail.split``; ``param_vals`` follow
    ``tail.params``.
    """
    eqns = [jaxpr.eqns[i] for i in (*tail.eqns, tail.reduction)]
    red = jaxpr.eqns[tail.reduction]
    sub = _jc.make_jaxpr(
        jaxpr,
        constvars=[],
        invars=[v for v, _ in tail.split] + list(tail.params),
        outvars=list(red.outvars),
        eqns=eqns,
    )
    (out,) = _eval(sub, [], [*split_vals, *param_vals], tail.axes, rows)
    return out
