"""Values computed from column reductions, written as sums of terms coef * exp(expo - shift) * body,
and each column reduction as a recipe over per-tile accumulators (the online log-sum-exp among
them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._src import jax_compat as _jc
from jaxmem._src.chunking.column_axis import (
    _MAX_TERMS,
    _ONE,
    Refused,
    _Labels,
    _resize,
    _shape,
    _type,
    _where,
)


def _mul(a, b):
    if a is None or a == _ONE:
        return b
    if b is None or b == _ONE:
        return a
    return ("mul", a, b)


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return ("add", a, b)


def _stop(a):
    return None if a is None or a == _ONE or a[0] == "lit" else ("stop", a)


def _vars(expr, out: set) -> set:
    if isinstance(expr, tuple) and expr:
        if expr[0] == "var":
            out.add(expr[1])
        else:
            for x in expr[1:]:
                _vars(x, out)
    return out


def _evaluate(expr, env: dict, cache: dict):
    if expr in cache:
        return cache[expr]
    op = expr[0]
    if op == "var":
        out = env[expr[1]]
    elif op == "lit":
        out = expr[1]
    elif op == "one":
        out = 1
    elif op in ("mul", "div", "add"):
        x, y = _evaluate(expr[1], env, cache), _evaluate(expr[2], env, cache)
        out = {"mul": jnp.multiply, "div": jnp.divide, "add": jnp.add}[op](x, y)
    elif op == "neg":
        out = jnp.negative(_evaluate(expr[1], env, cache))
    elif op == "exp":
        out = jnp.exp(_evaluate(expr[1], env, cache))
    elif op == "stop":
        out = jax.lax.stop_gradient(_evaluate(expr[1], env, cache))
    elif op == "select":
        hit = _picks(_evaluate(expr[1], env, cache), expr[2])
        x = jnp.asarray(_evaluate(expr[3], env, cache))
        out = jnp.where(hit, x, jnp.zeros((), x.dtype))
    elif op == "bcast":
        out = jax.lax.broadcast_in_dim(_evaluate(expr[1], env, cache), expr[2], expr[3])
    else:  # pragma: no cover - every constructor is above
        raise AssertionError(op)
    cache[expr] = out
    return out


def _picks(pred, case: int):
    pred = jnp.asarray(pred)
    if pred.dtype == jnp.bool_:
        return pred if case == 1 else jnp.logical_not(pred)
    return pred == case


@dataclasses.dataclass(frozen=True)
class _Term:
    """``coef * exp(expo - shift) * body``: ``coef`` and ``shift`` per row (None: 1 and 0,
    computed after the column reductions), ``expo`` and ``body`` per column (computed tile by
    tile; ``expo`` None: no exponential factor)."""

    body: tuple
    coef: tuple | None = None
    expo: tuple | None = None
    shift: tuple | None = None


def _product(f: tuple, g: tuple, where: str) -> tuple:
    out = tuple(
        _Term(
            body=_mul(s.body, t.body),
            coef=_mul(s.coef, t.coef),
            expo=_add(s.expo, t.expo),
            shift=_add(s.shift, t.shift),
        )
        for s in f
        for t in g
    )
    if len(out) > _MAX_TERMS:
        raise Refused(f"{where}: the product has more than {_MAX_TERMS} terms")
    return out


def _negate(f: tuple) -> tuple:
    return tuple(dataclasses.replace(t, coef=_mul(t.coef, ("lit", -1))) for t in f)


def _pure(form: tuple):
    """The body of a form that is one reduction-free column-wise value, else None."""
    if len(form) == 1:
        (t,) = form
        if t.coef is None and t.expo is None and t.shift is None and t.body != _ONE:
            return t.body
    return None


def _exp(f: tuple, where: str) -> tuple:
    if any(t.expo is not None for t in f):
        raise Refused(f"{where}: exp of a value with an exponential factor")
    varying = [t for t in f if t.body != _ONE]
    shift = None
    for t in f:
        if t.body == _ONE:
            shift = _add(shift, ("lit", 1) if t.coef is None else t.coef)
    shift = None if shift is None else ("neg", shift)
    if not varying:
        return (_Term(_ONE, coef=("exp", ("neg", shift))),)
    if len(varying) > 1:
        raise Refused(f"{where}: exp of a sum of several column-wise values")
    (t,) = varying
    if t.coef is not None and t.coef[0] != "lit":
        raise Refused(f"{where}: exp of a column-wise value scaled by a reduction's result")
    return (_Term(_ONE, expo=_mul(t.body, t.coef), shift=shift),)


@dataclasses.dataclass
class _Acc:
    kind: str  # "sum", "max", "min", "expsum", "gather", "dot"
    body: tuple
    shape: tuple  # the reduced operand's shape (all columns)
    col: int  # its column axis
    axes: tuple  # reduced axes
    dtype: Any  # accumulation dtype
    out_shape: tuple
    expo: tuple | None = None
    eqn: Any = None  # the gather / dot_general
    other: tuple | None = None  # dot_general: the right operand's body, shape, column axis
    other_shape: tuple = ()
    other_col: int = 0
    diff: bool = False  # whether its cotangent can be non-zero


def _acc_dtype(dtype):
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype


def _finite(m):
    return jnp.where(jnp.isfinite(m), m, jnp.zeros((), m.dtype))


def _drop_col(x, col: int, rank: int):
    """A per-row coefficient (size 1 along the columns) as a value of the reduced shape."""
    x = jnp.asarray(x)
    return jnp.squeeze(x, col) if x.ndim == rank else x


_KINDS = {
    "sum": "sum",
    "max": "maximum",
    "min": "minimum",
    "expsum": "sum of exponentials (online log-sum-exp)",
    "gather": "one column per row (take_along_axis)",
    "dot": "matmul contracting the columns",
}


def _categories(j, live, labels: _Labels) -> tuple[list, set]:
    """Per equation where it runs: "pre" (before the column reductions, whole), "sweep"
    (column-wise, free of reductions: tile by tile), "reduce" (a column reduction: from the
    accumulators), "form" (column-wise, computed from reductions: rewritten, never run),
    "post" (after the reductions, whole) or "dead"; and the values computed from reductions."""
    inner: set = set()
    cat = []
    for i, e in enumerate(j.eqns):
        if not live[i]:
            cat.append("dead")
            continue
        if i in labels.reductions:
            cat.append("reduce")
            inner.update(e.outvars)
            continue
        dep = any(_jc.is_var(v) and v in inner for v in e.invars)
        if dep:
            inner.update(e.outvars)
        col = any(v in labels.axis for v in e.outvars)
        cat.append(("form" if dep else "sweep") if col else ("post" if dep else "pre"))
    return cat, inner


@dataclasses.dataclass
class _Reductions:
    """The accumulators, one recipe per column reduction, what the recipes read, and which
    reductions read each accumulator."""

    accs: list
    recipes: dict
    reads: set
    users: dict


def _reductions(j, cat: list, inner: set, labels: _Labels) -> _Reductions:
    """Rewrites the values computed from reductions as forms and each column reduction as a
    recipe over accumulators (equal per-tile reductions share one)."""
    axis = labels.axis
    forms: dict[Any, tuple] = {}

    def form(v) -> tuple:
        if not _jc.is_var(v):
            return (_Term(_ONE, coef=("lit", v.val)),)
        if v in axis:
            return forms[v] if v in inner else (_Term(("var", v)),)
        return (_Term(_ONE, coef=("var", v)),)

    def selector(v, where):
        if not _jc.is_var(v) or v in inner:
            raise Refused(f"{where}: selects by a value computed from a column reduction")
        return ("var", v)

    out = _Reductions([], {}, set(), {})
    index: dict = {}

    def acc(key, make) -> int:
        if key not in index:
            index[key] = len(out.accs)
            out.accs.append(make())
        return index[key]

    for i, e in enumerate(j.eqns):
        where = f"{e.primitive.name} at {_where(e)}"
        if cat[i] == "form":
            forms[e.outvars[0]] = _form_rule(e, [form(v) for v in e.invars], where, selector, axis)
        elif cat[i] == "reduce":
            recipe, used, reads = _reduce_rule(e, form, axis, labels.size, acc, where)
            out.recipes[i] = recipe
            out.reads |= reads
            for k in used:
                out.users.setdefault(k, []).append(i)
    return out


def _form_rule(e, ins: list, where: str, selector, axis) -> tuple:
    name = e.primitive.name
    (out,) = e.outvars
    if name in ("add", "add_any"):
        return ins[0] + ins[1]
    if name == "sub":
        return ins[0] + _negate(ins[1])
    if name == "neg":
        return _negate(ins[0])
    if name == "mul":
        return _product(ins[0], ins[1], where)
    if name in ("square",) or (name == "integer_pow" and e.params["y"] == 2):
        return _product(ins[0], ins[0], where)
    if name == "div":
        (den,) = ins[1] if len(ins[1]) == 1 else (None,)
        if den is not None and den.body == _ONE and den.expo is None:
            inv = ("div", ("lit", 1), ("lit", 1) if den.coef is None else den.coef)
            return tuple(dataclasses.replace(t, coef=_mul(t.coef, inv)) for t in ins[0])
        if den is not None and _pure(ins[1]) is not None:
            return tuple(dataclasses.replace(t, body=("div", t.body, den.body)) for t in ins[0])
        raise Refused(f"{where}: divides by a column-wise value computed from a reduction")
    if name == "exp":
        return _exp(ins[0], where)
    if name == "select_n":
        p = selector(e.invars[0], where)
        return tuple(
            dataclasses.replace(t, body=("select", p, case, t.body))
            for case, f in enumerate(ins[1:])
            for t in f
        )
    if name == "stop_gradient":
        return tuple(
            _Term(
                body=t.body if t.body == _ONE else ("stop", t.body),
                coef=_stop(t.coef),
                expo=_stop(t.expo),
                shift=_stop(t.shift),
            )
            for t in ins[0]
        )
    if name in ("copy", "copy_p") or (
        name == "convert_element_type" and e.invars[0].aval.dtype == out.aval.dtype
    ):
        return ins[0]
    if name == "broadcast_in_dim" and e.invars[0] not in axis:
        a = axis[out]
        shape = _resize(_shape(out), a, 1)
        return (
            _Term(
                _ONE, coef=("bcast", ("var", e.invars[0]), shape, e.params["broadcast_dimensions"])
            ),
        )
    raise Refused(f"{where} of a column-wise value computed from a column reduction ({_type(out)})")


def _reduce_rule(e, form, axis, size: int, acc, where: str):
    """``(recipe, accumulators used, variables the recipe reads)`` of a column reduction."""
    name = e.primitive.name
    (out,) = e.outvars
    reads: set = set()
    if name == "dot_general":
        lhs, rhs = e.invars
        bl, br = _pure(form(lhs)), _pure(form(rhs))
        if bl is None or br is None:
            raise Refused(
                f"{where}: a matmul over the columns of a value computed from a reduction"
            )
        dtype = _acc_dtype(out.aval.dtype)
        a = acc(
            ("dot", bl, br, id(e)),
            lambda: _Acc(
                "dot",
                bl,
                _shape(lhs),
                axis[lhs],
                (),
                dtype,
                _shape(out),
                eqn=e,
                other=br,
                other_shape=_shape(rhs),
                other_col=axis[rhs],
            ),
        )
        return (lambda env, st: st[a]), [a], reads
    v = e.invars[0]
    col, rank, f = axis[v], len(_shape(v)), form(v)
    if name == "gather":
        return _gather_rule(e, f, col, size, acc, where)
    axes = tuple(e.params["axes"])
    dtype = _acc_dtype(v.aval.dtype)
    reduced = tuple(s for k, s in enumerate(_shape(v)) if k not in axes)
    # A value computed from a reduction is reduced over the columns tile by tile, then over
    # its other reduced axes (``rest``, numbered without the columns) after its per-row
    # coefficients are applied.
    percol = tuple(s for k, s in enumerate(_shape(v)) if k != col)
    rest = tuple(k if k < col else k - 1 for k in axes if k != col)

    def finish(x, red):
        x = jnp.broadcast_to(x, percol)
        return red(x, rest) if rest else x

    body = _pure(f)
    if name in ("reduce_max", "reduce_min"):
        kind = "max" if name == "reduce_max" else "min"
        varying = [t for t in f if t.body != _ONE or t.expo is not None]
        const = [t.coef for t in f if t.body == _ONE and t.expo is None]
        body = _pure(tuple(varying))
        if body is None:
            raise Refused(f"{where}: the {kind}imum of a value computed from a reduction")
        over = (col,) if const else axes
        out = percol if const else reduced
        a = acc(
            (kind, body, _shape(v), over),
            lambda: _Acc(kind, body, _shape(v), col, over, dtype, out),
        )
        for c in const:
            _vars(c, reads)

        def recipe(env, st):
            cache: dict = {}
            x = st[a][0] if isinstance(st[a], tuple) else st[a]
            if not const:
                return x
            for c in const:
                x = x + _drop_col(_evaluate(c, env, cache), col, rank)
            return finish(x, jnp.max if kind == "max" else jnp.min)

        return recipe, [a], reads
    if body is not None:
        a = acc(
            ("sum", body, _shape(v), axes),
            lambda: _Acc("sum", body, _shape(v), col, axes, dtype, reduced),
        )
        return (lambda env, st: st[a]), [a], reads
    parts = []
    for t in f:
        for x in (t.coef, t.shift):
            _vars(x, reads)
        if t.expo is None and t.body == _ONE:
            parts.append(("count", t.coef, None, None))
        elif t.expo is None:
            k = acc(
                ("sum", t.body, _shape(v), (col,)),
                lambda t=t: _Acc("sum", t.body, _shape(v), col, (col,), dtype, percol),
            )
            parts.append(("sum", t.coef, None, k))
        else:
            k = acc(
                ("expsum", t.expo, t.body, _shape(v)),
                lambda t=t: _Acc(
                    "expsum",
                    t.body,
                    _shape(v),
                    col,
                    (col,),
                    np.result_type(dtype, np.float32),
                    percol,
                    expo=t.expo,
                ),
            )
            parts.append(("exp", t.coef, t.shift, k))

    def recipe(env, st):
        cache: dict = {}
        total = 0
        for kind, coef, shift, k in parts:
            c = 1 if coef is None else _drop_col(_evaluate(coef, env, cache), col, rank)
            if kind == "count":
                x = c * size
            elif kind == "sum":
                x = c * st[k]
            else:
                best, s = st[k]
                e_ = _finite(jax.lax.stop_gradient(best))
                if shift is not None:
                    e_ = e_ - _drop_col(_evaluate(shift, env, cache), col, rank)
                x = c * s * jnp.exp(e_)
            total = total + x
        return finish(total, jnp.sum)

    return recipe, [k for *_, k in parts if k is not None], reads


def _gather_rule(e, f, col, size, acc, where):
    idx, (out,) = e.invars[1], e.outvars
    operand = e.invars[0]
    reads: set = set()
    if _jc.is_var(idx):
        reads.add(idx)
    dtype = _acc_dtype(operand.aval.dtype)

    def gathered(body):
        return acc(
            ("gather", body, id(e)),
            lambda: _Acc("gather", body, _shape(operand), col, (col,), dtype, _shape(out), eqn=e),
        )

    parts = []
    for t in f:
        for x in (t.coef, t.shift):
            _vars(x, reads)
        if t.expo is None and t.body == _ONE:
            parts.append((t.coef, None, None, None))
        elif t.expo is None:
            parts.append((t.coef, None, None, gathered(t.body)))
        else:
            body = None if t.body == _ONE else gathered(t.body)
            parts.append((t.coef, t.shift, gathered(t.expo), body))
    p = e.params
    mode = p["mode"]
    fill = p.get("fill_value")
    if fill is None:
        fill = np.nan if jnp.issubdtype(out.aval.dtype, jnp.inexact) else 0

    def recipe(env, st):
        cache: dict = {}
        total = 0
        for coef, shift, expo, body in parts:
            c = 1 if coef is None else _evaluate(coef, env, cache)
            x = c if body is None else c * st[body]
            if expo is not None:
                z = st[expo] if shift is None else st[expo] - _evaluate(shift, env, cache)
                x = x * jnp.exp(z)
            total = total + x
        total = jnp.broadcast_to(total, _shape(out))
        if mode == jax.lax.GatherScatterMode.FILL_OR_DROP:
            i = jnp.asarray(env[idx] if _jc.is_var(idx) else idx.val)[..., 0]
            ok = (i >= 0) & (i < size)
            total = jnp.where(ok, total, jnp.asarray(fill, total.dtype))
        return total

    used = [k for part in parts for k in part[2:] if k is not None]
    return recipe, used, reads
