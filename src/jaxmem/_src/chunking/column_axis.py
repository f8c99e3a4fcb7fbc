"""The column axis of a row-wise tail: the matmuls by a shared weight it can come from, which values
carry the axis that comes from the weight's columns, followed through per-primitive rules, and
which uses reduce over it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._src import jax_compat as _jc
from jaxmem._src.chunking import rows as _rw

_MAX_TERMS = 16


_ONE = ("one",)


class Refused(Exception):
    """The tail cannot be split along its columns; the message says why."""


def _shape(v) -> tuple:
    return tuple(v.aval.shape)


def _where(eqn) -> str:
    return _jc.summarize_source(eqn.source_info)


def _type(v) -> str:
    return f"{np.dtype(v.aval.dtype).name}{list(_shape(v))}".replace(" ", "")


def _inline(jaxpr, consts: Sequence, args: Sequence, outer=None) -> list:
    def apply(eqn, invals):
        info = _rw.source_of(eqn, outer)
        inlined = eqn.primitive.name in _jc.CALL_PRIMITIVES or _jc.rule_is_body_derivative(eqn)
        if inlined and len(_jc.subjaxprs(eqn)) == 1:
            return _inline(*_jc.call_body(eqn), invals, info)
        return _rw.bind_at(eqn, invals, eqn.primitive.get_bind_params(eqn.params), info)

    return _jc.eval_eqns(jaxpr, consts, args, apply)


def trace_tail(jaxpr, tail: _rw.Tail, rows: int):
    """The closed, flat jaxpr of ``tail`` on ``rows`` rows: inputs ``tail.split`` (``rows``
    rows along their axes) then ``tail.params``; output the tail's scalar. Calls (``jit``)
    are inlined, source locations kept; so are the custom_jvp functions whose rule is the
    derivative of their body (:func:`jax_compat.rule_is_body_derivative`: on jax 0.12, the
    log-sum-exp of a cross-entropy), whose body the column plan then differentiates by its own
    rules; any other custom_jvp function stays one equation, which no column runs through
    (:func:`_column_in_axes`)."""
    split = [jax.ShapeDtypeStruct(_resize(_shape(v), k, rows), v.aval.dtype) for v, k in tail.split]
    params = [jax.ShapeDtypeStruct(_shape(v), v.aval.dtype) for v in tail.params]
    n = len(split)

    def run(*args):
        return _rw.run_tail(jaxpr, tail, rows, args[:n], args[n:])

    closed = jax.make_jaxpr(run)(*split, *params)
    structs = [jax.ShapeDtypeStruct(_shape(v), v.aval.dtype) for v in closed.jaxpr.invars]
    consts = _jc.jaxpr_consts(closed)
    return jax.make_jaxpr(lambda *a: _inline(_jc.open_jaxpr(closed), consts, a))(*structs)


def _column_in_axes(eqn, out_axes: list) -> list | None:
    """:func:`rows.in_axes` along the columns. An equation that runs a sub-jaxpr (a custom_jvp
    function left whole) is not column-wise: a tile rebinds each equation at its width, which
    the rule's fixed shapes could not follow."""
    if _jc.subjaxprs(eqn):
        return None
    return _rw.in_axes(eqn, out_axes)


def _resize(shape: Sequence[int], axis: int, size: int) -> tuple:
    out = list(shape)
    out[axis] = size
    return tuple(out)


def _live(jaxpr) -> list[bool]:
    live = {v for v in jaxpr.outvars if _jc.is_var(v)}
    keep = [False] * len(jaxpr.eqns)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if eqn.effects or any(v in live for v in eqn.outvars):
            keep[i] = True
            live.update(v for v in eqn.invars if _jc.is_var(v))
    return keep


@dataclasses.dataclass
class _Labels:
    axis: dict  # var -> its column axis
    size: int
    reductions: dict  # eqn index -> kind
    source: str


def _forward_axis(eqn, var, a):
    """The output axis of ``eqn`` that carries column axis ``a`` of its input ``var``."""
    if len(eqn.outvars) != 1:
        return None
    found = []
    for b in range(len(_shape(eqn.outvars[0]))):
        in_axes = _column_in_axes(eqn, [b])
        if in_axes is None:
            continue
        if all(k == a for u, k in zip(eqn.invars, in_axes, strict=True) if u is var):
            found.append(b)
    return found[0] if len(found) == 1 else None


def _take_along(eqn, a) -> bool:
    """Whether a gather takes entries of its operand's column axis ``a`` by per-row indices,
    every other axis a batch axis (``jnp.take_along_axis`` along the columns)."""
    dn = eqn.params["dimension_numbers"]
    rank = len(_shape(eqn.invars[0]))
    others = tuple(k for k in range(rank) if k != a)
    batch = tuple(getattr(dn, "operand_batching_dims", ()))
    ibatch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    idx = _shape(eqn.invars[1])
    return (
        tuple(dn.start_index_map) == (a,)
        and tuple(dn.collapsed_slice_dims) == (a,)
        and tuple(dn.offset_dims) == ()
        and tuple(sorted(batch)) == others
        and batch == ibatch
        and all(s == 1 for s in eqn.params["slice_sizes"])
        and len(idx) == rank + 1
        and idx[-1] == 1
    )


def _label(live, producer, consumers, start, a: int, size: int) -> _Labels:
    """The column axis of every value reached from ``start`` (whose axis ``a`` has ``size``
    columns): back through producers, forward through consumers, up to the column reductions."""
    axis: dict[Any, int] = {}
    reductions: dict[int, str] = {}
    queue = [(start, a)]
    while queue:
        v, k = queue.pop()
        if v in axis:
            if axis[v] != k:
                raise Refused(f"{_type(v)} would carry the columns on two axes")
            continue
        if _shape(v)[k] != size:
            raise Refused(f"{_type(v)} has {_shape(v)[k]} columns, not {size}")
        axis[v] = k
        if v in producer:
            queue += _producer_axes(producer[v][1], v, k)
        for i, eqn, _ in consumers.get(v, ()):
            if not live[i] or i in reductions:
                continue
            b = _forward_axis(eqn, v, k)
            if b is not None:
                queue.append((eqn.outvars[0], b))
                continue
            reductions[i] = _reduction_kind(eqn, v, k, queue)
    return _Labels(axis, size, reductions, "")


def _producer_axes(eqn, v, k: int) -> list:
    """``(input, column axis)`` of the inputs of ``v``'s producer ``eqn`` that carry its
    column axis ``k``, or Refused."""
    name = eqn.primitive.name
    if name == "iota" and eqn.params["dimension"] == k:
        return []  # column numbers: offset in each tile
    in_axes = _column_in_axes(eqn, [k]) if len(eqn.outvars) == 1 else None
    if in_axes is None:
        raise Refused(f"{name} at {_where(eqn)} is not column-wise ({_type(v)})")
    return [(u, j) for u, j in zip(eqn.invars, in_axes, strict=True) if j is not None]


def _reduction_kind(eqn, v, k: int, queue: list) -> str:
    """Which column reduction a consumer of ``v`` (columns along ``k``) is, or Refused; a
    matmul's other operand joins the queue with its contracted axis."""
    name = eqn.primitive.name
    where = f"{name} at {_where(eqn)}"
    if name in ("reduce_sum", "reduce_max", "reduce_min") and k in eqn.params["axes"]:
        if name != "reduce_sum" and not jnp.issubdtype(v.aval.dtype, jnp.floating):
            raise Refused(f"{where} reduces non-floating values over the columns")
        return name
    if name == "gather" and eqn.invars[0] is v and eqn.invars[1] is not v and _take_along(eqn, k):
        return name
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars
        if lhs is v and k in lc and rhs is not v:
            queue.append((rhs, rc[list(lc).index(k)]))
            return name
        if rhs is v and k in rc and lhs is not v:
            queue.append((lhs, lc[list(rc).index(k)]))
            return name
    raise Refused(f"{where} mixes the columns ({_type(v)}): not a sum, max, min, gather or matmul")


class _Graph(NamedTuple):
    """The live equations of a jaxpr as a graph: each value's producer ``(index, eqn)``, its
    consumers ``(index, eqn, input position)``, and the values that depend on the rows."""

    producer: dict
    consumers: dict
    rowdep: set

    @classmethod
    def of(cls, j, live: list, n_split: int) -> _Graph:
        """The graph of ``j``'s live equations; its first ``n_split`` inputs carry the rows."""
        producer = {v: (i, e) for i, e in enumerate(j.eqns) if live[i] for v in e.outvars}
        consumers: dict[Any, list] = {}
        rowdep = set(j.invars[:n_split])
        for i, e in enumerate(j.eqns):
            if not live[i]:
                continue
            for p, v in enumerate(e.invars):
                if _jc.is_var(v):
                    consumers.setdefault(v, []).append((i, e, p))
            if any(_jc.is_var(v) and v in rowdep for v in e.invars):
                rowdep.update(e.outvars)
        return cls(producer, consumers, rowdep)


def _column_sources(j, live: list, rowdep: set):
    """``(eqn, out, axis)`` of each candidate source of the columns: an output axis (of at
    least 2) of a live matmul that comes from one operand only, that operand independent of
    the rows."""
    for i, e in enumerate(j.eqns):
        if not live[i] or e.primitive.name != "dot_general":
            continue
        (out,) = e.outvars
        for b in range(len(_shape(out))):
            in_axes = _column_in_axes(e, [b])
            carriers = [
                (u, k) for u, k in zip(e.invars, in_axes or [], strict=True) if k is not None
            ]
            if len(carriers) == 1 and carriers[0][0] not in rowdep and _shape(out)[b] >= 2:
                yield e, out, b
