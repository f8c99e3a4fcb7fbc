"""Values computed from column reductions, written as sums of terms coef * exp(expo - shift) * body,
and each column reduction as a recipe over per-tile accumulators (the online log-sum-exp among
them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

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

# Expressions: bodies (per column tile, free of column reductions) and per-row coefficients.
# Tuples, so that equal bodies share one accumulator: ("var", v), ("lit", k), ("one",),
# ("mul"|"div"|"add", a, b), ("neg"|"exp"|"stop", a), ("select", p, case, a) (``a`` where the
# selector ``p`` picks ``case``, else 0) and ("bcast", a, shape, dims).


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


_BINARY = {"mul": jnp.multiply, "div": jnp.divide, "add": jnp.add}
_UNARY = {"neg": jnp.negative, "exp": jnp.exp, "stop": jax.lax.stop_gradient}


def _evaluate(expr, env: dict, cache: dict):
    """The value of an expression, its variables read from ``env``; equal subexpressions are
    computed once (``cache``)."""
    if expr in cache:
        return cache[expr]
    out = _compute(expr, env, cache)
    cache[expr] = out
    return out


def _compute(expr, env: dict, cache: dict):
    """The value of one expression node, its operands by :func:`_evaluate`."""
    op = expr[0]
    if op == "var":
        return env[expr[1]]
    if op == "lit":
        return expr[1]
    if op == "one":
        return 1
    if op in _BINARY:
        x, y = _evaluate(expr[1], env, cache), _evaluate(expr[2], env, cache)
        return _BINARY[op](x, y)
    if op in _UNARY:
        return _UNARY[op](_evaluate(expr[1], env, cache))
    if op == "select":
        hit = _picks(_evaluate(expr[1], env, cache), expr[2])
        x = jnp.asarray(_evaluate(expr[3], env, cache))
        return jnp.where(hit, x, jnp.zeros((), x.dtype))
    if op == "bcast":
        return jax.lax.broadcast_in_dim(_evaluate(expr[1], env, cache), expr[2], expr[3])
    raise AssertionError(op)  # pragma: no cover - every constructor is above


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


# Accumulators: one per distinct per-tile reduction.


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
    index: dict = dataclasses.field(default_factory=dict, repr=False)  # key -> accumulator

    def acc(self, key, make) -> int:
        """The index of the accumulator ``key``, made by ``make()`` the first time (equal
        per-tile reductions share one)."""
        if key not in self.index:
            self.index[key] = len(self.accs)
            self.accs.append(make())
        return self.index[key]


@dataclasses.dataclass
class _Forms:
    """The forms of the values computed from reductions, as the rewrite meets them."""

    axis: dict  # var -> its column axis
    inner: set  # the values computed from reductions
    known: dict = dataclasses.field(default_factory=dict)  # var -> its form

    def of(self, v) -> tuple:
        """The form of an input: a literal or a per-row value is a coefficient, a column-wise
        value its own body or, when computed from reductions, its rewritten form."""
        if not _jc.is_var(v):
            return (_Term(_ONE, coef=("lit", v.val)),)
        if v in self.axis:
            return self.known[v] if v in self.inner else (_Term(("var", v)),)
        return (_Term(_ONE, coef=("var", v)),)

    def selector(self, v, where: str) -> tuple:
        """A ``select_n`` predicate as an expression; one computed from a reduction refuses."""
        if not _jc.is_var(v) or v in self.inner:
            raise Refused(f"{where}: selects by a value computed from a column reduction")
        return ("var", v)


def _reductions(j, cat: list, inner: set, labels: _Labels) -> _Reductions:
    """Rewrites the values computed from reductions as forms and each column reduction as a
    recipe over accumulators (equal per-tile reductions share one)."""
    forms = _Forms(labels.axis, inner)
    out = _Reductions([], {}, set(), {})
    for i, e in enumerate(j.eqns):
        where = f"{e.primitive.name} at {_where(e)}"
        if cat[i] == "form":
            forms.known[e.outvars[0]] = _form_rule(e, [forms.of(v) for v in e.invars], where, forms)
        elif cat[i] == "reduce":
            recipe, used, reads = _reduce_rule(
                e, forms.of, labels.axis, labels.size, out.acc, where
            )
            out.recipes[i] = recipe
            out.reads |= reads
            for k in used:
                out.users.setdefault(k, []).append(i)
    return out


# ------------------------------------------------------------------------------------------
# Forms: the rule of each column-wise primitive over values computed from reductions.


def _form_div(e, ins: list, where: str, forms: _Forms) -> tuple:
    """A quotient by a per-row value (a coefficient) or by a reduction-free column-wise value
    (a body); by anything else computed from a reduction, Refused."""
    (den,) = ins[1] if len(ins[1]) == 1 else (None,)
    if den is not None and den.body == _ONE and den.expo is None:
        inv = ("div", ("lit", 1), ("lit", 1) if den.coef is None else den.coef)
        return tuple(dataclasses.replace(t, coef=_mul(t.coef, inv)) for t in ins[0])
    if den is not None and _pure(ins[1]) is not None:
        return tuple(dataclasses.replace(t, body=("div", t.body, den.body)) for t in ins[0])
    raise Refused(f"{where}: divides by a column-wise value computed from a reduction")


def _form_select(e, ins: list, where: str, forms: _Forms) -> tuple:
    """``select_n``: the terms of every case, each zero where the predicate picks another."""
    p = forms.selector(e.invars[0], where)
    return tuple(
        dataclasses.replace(t, body=("select", p, case, t.body))
        for case, f in enumerate(ins[1:])
        for t in f
    )


def _form_stop(e, ins: list, where: str, forms: _Forms) -> tuple:
    """``stop_gradient``: every factor of every term stopped."""
    return tuple(
        _Term(
            body=t.body if t.body == _ONE else ("stop", t.body),
            coef=_stop(t.coef),
            expo=_stop(t.expo),
            shift=_stop(t.shift),
        )
        for t in ins[0]
    )


def _form_convert(e, ins: list, where: str, forms: _Forms) -> tuple | None:
    """A conversion to the same dtype is the input; another does not apply."""
    return ins[0] if e.invars[0].aval.dtype == e.outvars[0].aval.dtype else None


def _form_broadcast(e, ins: list, where: str, forms: _Forms) -> tuple | None:
    """A per-row value broadcast along the columns: a coefficient of the reduced shape (size
    1 along the columns); a column-wise operand does not apply."""
    if e.invars[0] in forms.axis:
        return None
    (out,) = e.outvars
    shape = _resize(_shape(out), forms.axis[out], 1)
    dims = e.params["broadcast_dimensions"]
    return (_Term(_ONE, coef=("bcast", ("var", e.invars[0]), shape, dims)),)


# Each rule: (eqn, its inputs' forms, where, forms) -> its output's form, or None where the rule
# does not apply (the split is then refused, as for a primitive without a rule).
_FORM_RULES: dict[str, Callable] = {
    "add": lambda e, ins, where, forms: ins[0] + ins[1],
    "add_any": lambda e, ins, where, forms: ins[0] + ins[1],
    "sub": lambda e, ins, where, forms: ins[0] + _negate(ins[1]),
    "neg": lambda e, ins, where, forms: _negate(ins[0]),
    "mul": lambda e, ins, where, forms: _product(ins[0], ins[1], where),
    "square": lambda e, ins, where, forms: _product(ins[0], ins[0], where),
    "integer_pow": lambda e, ins, where, forms: (
        _product(ins[0], ins[0], where) if e.params["y"] == 2 else None
    ),
    "div": _form_div,
    "exp": lambda e, ins, where, forms: _exp(ins[0], where),
    "select_n": _form_select,
    "stop_gradient": _form_stop,
    "copy": lambda e, ins, where, forms: ins[0],
    "copy_p": lambda e, ins, where, forms: ins[0],
    "convert_element_type": _form_convert,
    "broadcast_in_dim": _form_broadcast,
}


def _form_rule(e, ins: list, where: str, forms: _Forms) -> tuple:
    """The form of a column-wise equation's output computed from reductions (``ins``: its
    inputs' forms), or Refused."""
    (out,) = e.outvars
    rule = _FORM_RULES.get(e.primitive.name)
    form = None if rule is None else rule(e, ins, where, forms)
    if form is None:
        raise Refused(
            f"{where} of a column-wise value computed from a column reduction ({_type(out)})"
        )
    return form


# ------------------------------------------------------------------------------------------
# Recipes: each column reduction from the accumulators, after the sweep.


@dataclasses.dataclass(frozen=True)
class _Operand:
    """The operand of a ``reduce_*`` over ``axes``: its form, its column axis ``col``, the
    accumulation dtype and the shapes the reduction goes through."""

    form: tuple
    col: int
    axes: tuple
    dtype: Any
    shape: tuple  # all columns
    reduced: tuple  # reduced over ``axes``
    percol: tuple  # reduced over the columns only
    rest: tuple  # the other reduced axes, numbered without the columns

    @classmethod
    def of(cls, v, form: tuple, col: int, axes: tuple) -> _Operand:
        """The operand ``v`` (columns along ``col``) reduced over ``axes``."""
        shape = _shape(v)
        return cls(
            form=form,
            col=col,
            axes=axes,
            dtype=_acc_dtype(v.aval.dtype),
            shape=shape,
            reduced=tuple(s for k, s in enumerate(shape) if k not in axes),
            percol=tuple(s for k, s in enumerate(shape) if k != col),
            rest=tuple(k if k < col else k - 1 for k in axes if k != col),
        )

    def drop_col(self, x):
        """A per-row coefficient as a value of the shape reduced over the columns."""
        return _drop_col(x, self.col, len(self.shape))

    def finish(self, x, red):
        """A value computed from the columns' reductions (and per-row coefficients) reduced
        over the operand's other reduced axes with ``red``."""
        x = jnp.broadcast_to(x, self.percol)
        return red(x, self.rest) if self.rest else x


def _reduce_rule(e, form, axis, size: int, acc, where: str):
    """``(recipe, accumulators used, variables the recipe reads)`` of a column reduction."""
    name = e.primitive.name
    if name == "dot_general":
        return _dot_rule(e, form, axis, acc, where)
    v = e.invars[0]
    col = axis[v]
    if name == "gather":
        return _gather_rule(e, form(v), col, size, acc, where)
    # A value computed from a reduction is reduced over the columns tile by tile, then over
    # its other reduced axes after its per-row coefficients are applied (``_Operand.finish``).
    op = _Operand.of(v, form(v), col, tuple(e.params["axes"]))
    if name in ("reduce_max", "reduce_min"):
        return _extremum_rule(op, "max" if name == "reduce_max" else "min", acc, where)
    return _sum_rule(op, size, acc)


def _dot_rule(e, form, axis, acc, where: str):
    """A matmul contracting the columns of two reduction-free column-wise values: one
    accumulator, its product summed tile by tile."""
    (out,) = e.outvars
    lhs, rhs = e.invars
    bl, br = _pure(form(lhs)), _pure(form(rhs))
    if bl is None or br is None:
        raise Refused(f"{where}: a matmul over the columns of a value computed from a reduction")
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
    return (lambda env, st: st[a]), [a], set()


def _extremum_rule(op: _Operand, kind: str, acc, where: str):
    """A maximum or minimum (``kind`` "max" or "min"): of the body of the form's varying
    part, tile by tile; its per-row terms (a shift by a reduction's result) are added after,
    then the other reduced axes reduced."""
    varying = [t for t in op.form if t.body != _ONE or t.expo is not None]
    const = [t.coef for t in op.form if t.body == _ONE and t.expo is None]
    body = _pure(tuple(varying))
    if body is None:
        raise Refused(f"{where}: the {kind}imum of a value computed from a reduction")
    over = (op.col,) if const else op.axes
    out = op.percol if const else op.reduced
    a = acc(
        (kind, body, op.shape, over),
        lambda: _Acc(kind, body, op.shape, op.col, over, op.dtype, out),
    )
    reads: set = set()
    for c in const:
        _vars(c, reads)

    def recipe(env, st):
        cache: dict = {}
        x = st[a][0] if isinstance(st[a], tuple) else st[a]
        if not const:
            return x
        for c in const:
            x = x + op.drop_col(_evaluate(c, env, cache))
        return op.finish(x, jnp.max if kind == "max" else jnp.min)

    return recipe, [a], reads


def _sum_rule(op: _Operand, size: int, acc):
    """A sum: of a reduction-free value, one accumulator; of a form, the sum of its terms
    (:func:`_sum_parts`), then of the other reduced axes."""
    body = _pure(op.form)
    if body is not None:
        a = acc(
            ("sum", body, op.shape, op.axes),
            lambda: _Acc("sum", body, op.shape, op.col, op.axes, op.dtype, op.reduced),
        )
        return (lambda env, st: st[a]), [a], set()
    parts, reads = _sum_parts(op, acc)

    def recipe(env, st):
        cache: dict = {}
        total = 0
        for part in parts:
            total = total + _sum_part(part, op, size, env, st, cache)
        return op.finish(total, jnp.sum)

    return recipe, [p.acc for p in parts if p.acc is not None], reads


class _SumPart(NamedTuple):
    """One term of a sum over the columns: a per-row term times the number of columns
    (``kind`` "count"), a coefficient times its body's sum ("sum"), or a coefficient times its
    exponentials' sum ("exp", shifted by ``shift``); ``acc`` holds the per-tile sum."""

    kind: str
    coef: tuple | None
    shift: tuple | None
    acc: int | None


def _sum_parts(op: _Operand, acc) -> tuple[list[_SumPart], set]:
    """The terms of the sum of a form, their accumulators, and the variables their
    coefficients and shifts read."""
    parts: list[_SumPart] = []
    reads: set = set()
    for t in op.form:
        for x in (t.coef, t.shift):
            _vars(x, reads)
        if t.expo is None and t.body == _ONE:
            parts.append(_SumPart("count", t.coef, None, None))
        elif t.expo is None:
            k = acc(
                ("sum", t.body, op.shape, (op.col,)),
                lambda t=t: _Acc("sum", t.body, op.shape, op.col, (op.col,), op.dtype, op.percol),
            )
            parts.append(_SumPart("sum", t.coef, None, k))
        else:
            k = acc(
                ("expsum", t.expo, t.body, op.shape),
                lambda t=t: _Acc(
                    "expsum",
                    t.body,
                    op.shape,
                    op.col,
                    (op.col,),
                    np.result_type(op.dtype, np.float32),
                    op.percol,
                    expo=t.expo,
                ),
            )
            parts.append(_SumPart("exp", t.coef, t.shift, k))
    return parts, reads


def _sum_part(part: _SumPart, op: _Operand, size: int, env: dict, st: list, cache: dict):
    """One term of a sum from the accumulators: the online log-sum-exp's sum is rescaled
    from its running maximum to the term's shift."""
    c = 1 if part.coef is None else op.drop_col(_evaluate(part.coef, env, cache))
    if part.kind == "count":
        return c * size
    if part.kind == "sum":
        return c * st[part.acc]
    best, s = st[part.acc]
    e = _finite(jax.lax.stop_gradient(best))
    if part.shift is not None:
        e = e - op.drop_col(_evaluate(part.shift, env, cache))
    return c * s * jnp.exp(e)


def _gather_rule(e, f, col, size, acc, where):
    """``(recipe, accumulators used, variables the recipe reads)`` of the gather of one
    column per row (``take_along_axis``) of a value of form ``f``."""
    idx, (out,) = e.invars[1], e.outvars
    operand = e.invars[0]
    dtype = _acc_dtype(operand.aval.dtype)

    def gathered(body):
        return acc(
            ("gather", body, id(e)),
            lambda: _Acc("gather", body, _shape(operand), col, (col,), dtype, _shape(out), eqn=e),
        )

    parts, reads = _gather_parts(f, gathered)
    if _jc.is_var(idx):
        reads.add(idx)
    mode, fill = e.params["mode"], _gather_fill(e)

    def recipe(env, st):
        total = jnp.broadcast_to(_gathered_total(parts, env, st), _shape(out))
        if mode == jax.lax.GatherScatterMode.FILL_OR_DROP:
            i = jnp.asarray(env[idx] if _jc.is_var(idx) else idx.val)[..., 0]
            ok = (i >= 0) & (i < size)
            total = jnp.where(ok, total, jnp.asarray(fill, total.dtype))
        return total

    used = [k for part in parts for k in part[2:] if k is not None]
    return recipe, used, reads


def _gather_parts(f: tuple, gathered) -> tuple[list, set]:
    """Per term of the form: ``(coef, shift, expo, body)``, the last two the accumulators of
    its gathered factors (None where it has none); and the variables the coefficients and
    shifts read."""
    parts = []
    reads: set = set()
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
    return parts, reads


def _gather_fill(e):
    """The value a ``FILL_OR_DROP`` gather gives where its index is out of bounds."""
    fill = e.params.get("fill_value")
    if fill is None:
        fill = np.nan if jnp.issubdtype(e.outvars[0].aval.dtype, jnp.inexact) else 0
    return fill


def _gathered_total(parts: list, env: dict, st: list):
    """The sum of the gathered terms, each its coefficient times its gathered body and
    exponential factor (shifted)."""
    cache: dict = {}
    total = 0
    for coef, shift, expo, body in parts:
        c = 1 if coef is None else _evaluate(coef, env, cache)
        x = c if body is None else c * st[body]
        if expo is not None:
            z = st[expo] if shift is None else st[expo] - _evaluate(shift, env, cache)
            x = x * jnp.exp(z)
        total = total + x
    return total
