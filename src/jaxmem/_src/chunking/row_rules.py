"""The per-primitive rules of :mod:`jaxmem._src.chunking.rows`: from the rows' axis of an
equation's output, the rows' axis of each input (None for an input shared by every row), or
None where the equation is not row-wise for that axis. They read shapes and parameters only;
calls and custom_jvp functions, which run a sub-jaxpr, are :mod:`rows`' own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

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
}
