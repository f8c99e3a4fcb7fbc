"""Which parts of a jaxpr are row-wise, and how to run them on a chunk of the rows.

A value is *row-wise along axis a* when, for every row ``i`` along ``a``, its slice ``i`` depends
only on slice ``i`` of some inputs (the *split* inputs, each along its own axis) and on values
that do not vary with the rows (the *parameters*). The tail of a loss that ends in
``reduce_sum(t)`` over the rows of a row-wise ``t`` can then run chunk by chunk
(:mod:`jaxmem._src.chunking.chunked`). This module answers the two questions that needs:

1. :func:`find_tail`: walking back from a scalar ``reduce_sum``, the largest set of equations
   whose outputs are row-wise, given per-primitive rules (:mod:`.row_rules`: from the row axis
   of an equation's output, the row axis of each input, or None for an input shared by every
   row; an equation without a rule, or whose rule does not apply, ends the tail there). The set
   is closed: none of its intermediates is used outside it, so none has to exist in full.
2. :func:`run_tail`: evaluates those equations on ``rows`` rows instead of the traced count,
   rewriting the few parameters that spell a shape (``broadcast_in_dim``'s ``shape``,
   ``reshape``'s ``new_sizes``, ``iota``'s ``shape``, ``slice``'s limits, ``gather``'s
   ``slice_sizes``); ``jit`` calls inside the tail are entered and rewritten the same way.

A ``jax.custom_jvp`` function (``relu``; on jax 0.12 also ``logsumexp`` and ``softmax``) is
row-wise when its body is and, unless its rule is the derivative of its body (then its body
runs in its place, as a call's), when its rule is too: a chunk runs it as a ``jax.custom_jvp``
of its body on the chunk's rows whose rule is its rule on those rows, so that the chunk is
differentiated by the function's own rule.

Conservative by construction: an equation is row-wise only when its rule proves it from the
shapes and parameters, so an unknown primitive (random bits, collectives, custom VJP rules,
effects) keeps the tail from passing through it, never the other way round.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import source_info_util as _siu

from jaxmem._src import jax_compat as _jc
from jaxmem._src.chunking.row_rules import _RULES, _gather, _shape

_CALLS = ("jit", "pjit", "closed_call", "core_call")
# Equations that run a sub-jaxpr (entered by the walk): calls, and functions with a custom JVP rule
# (``jax.custom_jvp``; on jax 0.12 ``jax.nn.logsumexp`` and ``jax.nn.softmax`` among them).
_NESTED = (*_CALLS, *_jc.CUSTOM_JVP_PRIMITIVES)
_LAYOUT = ("transpose", "reshape", "squeeze", "broadcast_in_dim", "expand_dims")


def _inlined(eqn) -> bool:
    """Whether a tail runs ``eqn``'s body in its place: a call, or a custom_jvp function whose
    rule is the derivative of its body (:func:`jax_compat.rule_is_body_derivative`: on jax 0.12
    the log-sum-exp of a cross-entropy, which then runs as it is written out on 0.10.2). Any
    other custom_jvp function runs with its own rule (:func:`_custom_jvp_at`)."""
    return eqn.primitive.name in _CALLS or _jc.rule_is_body_derivative(eqn)


def _call_axes(eqn, out_axes, rules: bool = True) -> dict:
    """The axes of the equations inside a row-wise call or custom_jvp function (nested calls
    included)."""
    (sub,) = _jc.subjaxprs(eqn)
    return _inner_axes(sub, out_axes, rules and _inlined(eqn))[1]


def _call(eqn, out_axes, rules: bool = True):
    """The input axes of a call or custom_jvp function whose body is row-wise. The rules of the
    custom_jvp functions inside a body that is differentiated (a call's) are checked with it
    (``rules``), those inside a custom_jvp function's body are not: its own rule stands for
    the body (:func:`_nested`)."""
    (sub,) = _jc.subjaxprs(eqn)
    found = _inner_axes(sub, out_axes, rules and _inlined(eqn))
    return None if found is None else found[0]


class _Rule(NamedTuple):
    """The JVP rule of a custom_jvp function (:func:`jax_compat.custom_jvp_rule`: the primals
    then their tangents in, the primal outputs then the tangents not in ``out_zeros`` out), its
    constants, and the axes of its equations."""

    jaxpr: Any
    consts: list
    out_zeros: list
    axes: Axes


def _rule(eqn, ins: list, outs: list) -> _Rule | None:
    """The JVP rule of a row-wise custom_jvp function ``eqn`` (input axes ``ins``, output axes
    ``outs``), when it is row-wise too: each primal on its axis, its tangent on the same, its
    constants shared. The rules of the custom_jvp functions it calls are checked when they run
    (the rule of a softmax calls the softmax: checked ahead, they would never end)."""
    jaxpr, consts, out_zeros = _jc.custom_jvp_rule(eqn)
    primals = ins[eqn.params["num_consts"] :]
    tangent_outs = [a for a, zero in zip(outs, out_zeros, strict=True) if not zero]
    found = _inner_required(jaxpr, [*outs, *tangent_outs], rules=False)
    if found is None:
        return None
    required, axes = found
    want = zip(jaxpr.invars, [*primals, *primals], strict=True)
    if any(required.get(v, k) != k for v, k in want):
        return None
    if any(required.get(v) is not None for v in jaxpr.constvars):
        return None
    return _Rule(jaxpr, consts, out_zeros, axes)


def _nested(eqn, ins: list, outs: list, rules: bool = True) -> Axes | None:
    """The axes of the equations inside a row-wise call or custom_jvp function (``{}`` for
    another primitive); for a custom_jvp function, with ``rules``, also its JVP rule (under
    ``("rule", id(eqn))``), or None when that rule is not row-wise."""
    if eqn.primitive.name not in _NESTED:
        return {}
    axes = _call_axes(eqn, outs, rules)
    if rules and not _inlined(eqn):
        rule = _rule(eqn, ins, outs)
        if rule is None:
            return None
        axes[("rule", id(eqn))] = rule
    return axes


def in_axes(eqn, out_axes: list, rules: bool = True) -> list | None:
    """The rows' axis of each input of ``eqn``, or None when it is not row-wise. A custom_jvp
    function is judged by its body here, its rule by :func:`_nested`; ``rules``: whether the
    rules of those inside a call are checked (:func:`_call`)."""
    name = eqn.primitive.name
    rule = _RULES.get(name)
    if (rule is None and name not in _NESTED) or eqn.effects or None in out_axes:
        return None
    if len(out_axes) != 1 and name != "split":
        return None
    try:
        axes = _call(eqn, out_axes, rules) if name in _NESTED else rule(eqn, out_axes)
    except (KeyError, IndexError, ValueError, TypeError, AttributeError):
        return None  # parameters this rule does not know (another JAX version): not row-wise
    if axes is None or len(axes) != len(eqn.invars):
        return None
    for v, k in zip(eqn.invars, axes, strict=True):
        if k is not None and (not _jc.is_var(v) or k >= len(_shape(v))):
            return None
    return axes


# Per equation (by id) of a tail: (input axes, output axes), for run_tail; per custom_jvp
# function, under ("rule", id), its JVP rule (:class:`_Rule`, or None where it is not row-wise).
Axes = dict


def _inner_axes(jaxpr, out_axes: list, rules: bool = True) -> tuple[list, Axes] | None:
    """Input axes of a called jaxpr whose every equation must be row-wise, or None."""
    found = _inner_required(jaxpr, out_axes, rules)
    if found is None:
        return None
    required, axes = found
    return [required.get(v) for v in jaxpr.invars], axes


def _inner_required(jaxpr, out_axes: list, rules: bool) -> tuple[dict, Axes] | None:
    """The axis needed of each value a jaxpr reads (those it does not read absent) and the axes
    of its equations, when every equation needed is row-wise; else None."""
    required = _output_axes(jaxpr.outvars, out_axes)
    if required is None:
        return None
    axes: Axes = {}
    for eqn in reversed(jaxpr.eqns):
        outs = [required.get(v, "unused") for v in eqn.outvars if not _jc.is_drop_var(v)]
        if all(o == "unused" for o in outs):
            continue  # not needed: run_tail skips it
        ins = _needed_in_axes(eqn, outs, axes, rules)
        if ins is None:
            return None
        for v, k in zip(eqn.invars, ins, strict=True):
            if _jc.is_var(v) and required.setdefault(v, k) != k:
                return None
        axes[id(eqn)] = (ins, outs)
    return required, axes


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


def _needed_in_axes(eqn, outs: list, axes: Axes, rules: bool) -> list | None:
    """The input axes of an equation of a called jaxpr whose outputs are needed with axes
    ``outs``, or None when it is not row-wise; a call's inner axes join ``axes``."""
    if any(o == "unused" for o in outs):
        return None
    if all(o is None for o in outs):
        # Shared by every row: runs unchanged.
        return None if eqn.effects else [None] * len(eqn.invars)
    ins = in_axes(eqn, outs, rules)
    nested = None if ins is None else _nested(eqn, ins, outs, rules)
    if nested is None:
        return None
    axes.update(nested)
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
    values = [
        (v, walk.required[v])
        for v in produced
        if not _jc.is_drop_var(v) and walk.required.get(v) is not None
    ]
    for i in sorted(walk.members):
        values += _body_values(eqns[i], walk.axes)
    sizes = [(v, _jc.nbytes(v.aval), k) for v, k in values]
    largest_var, largest_bytes, largest_axis = max(
        sizes, key=lambda p: p[1], default=(t, _jc.nbytes(t.aval), axis)
    )
    largest = (largest_var, largest_bytes)
    rows_of_largest = _shape(largest_var)[largest_axis]
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
        sum(b for _, b, _ in sizes),
    )


def _body_values(eqn, axes: Axes) -> list[tuple[Any, int]]:
    """``(value, row axis)`` of the row-wise values a custom_jvp function of a tail creates in
    its body (those of custom_jvp functions inside included): they count among the tail's, as
    they would written out (on jax 0.10.2, the log-sum-exp of a cross-entropy is)."""
    if eqn.primitive.name not in _jc.CUSTOM_JVP_PRIMITIVES:
        return []
    (sub,) = _jc.subjaxprs(eqn)
    results = set(sub.outvars)  # the function's outputs: counted as the tail's own
    out = []
    for e in sub.eqns:
        if id(e) not in axes:
            continue
        defined = [v for v in e.outvars if not _jc.is_drop_var(v)]
        out += [
            (v, k)
            for v, k in zip(defined, axes[id(e)][1], strict=True)
            if k is not None and v not in results
        ]
        out += _body_values(e, axes)
    return out


def origins(jaxpr, outer=None) -> dict[Any, str]:
    """Where each value of ``jaxpr`` is created (``"exp at file:line (fn)"``), those in the
    bodies of its custom_jvp functions included (a tail's largest value can be there:
    :func:`_body_values`), at the function's call where JAX's body has no user frame."""
    out = {}
    for eqn in jaxpr.eqns:
        info = source_of(eqn, outer)
        where = f"{eqn.primitive.name} at {_jc.summarize_source(info)}"
        out.update((v, where) for v in eqn.outvars)
        if eqn.primitive.name in _jc.CUSTOM_JVP_PRIMITIVES:
            out.update(origins(_jc.subjaxprs(eqn)[0], info))
    return out


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
        ok = ins is not None and not self._conflicts(eqn, ins)
        nested = _nested(eqn, ins, outs) if ok else None
        if nested is None:
            for v in eqn.outvars:
                self.stops.setdefault(v, eqn.primitive.name)
            return
        self._join(i, eqn, ins, outs, nested)

    def _conflicts(self, eqn, ins: list) -> bool:
        """Whether an input of ``eqn`` would need another row axis than the tail needs."""
        return any(
            _jc.is_var(v) and self.required.get(v, k) != k
            for v, k in zip(eqn.invars, ins, strict=True)
        )

    def _join(self, i: int, eqn, ins: list, outs: list, nested: Axes) -> None:
        """Adds equation ``i`` to the tail, its inputs needed with axes ``ins`` (``nested``:
        the axes inside it, :func:`_nested`)."""
        for v, k in zip(eqn.invars, ins, strict=True):
            if _jc.is_var(v):
                self.required[v] = k
        self.members[i] = (ins, outs)
        self.axes.update(nested)
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


def _users(jaxpr, dead_read: bool = False) -> dict[Any, set[int]]:
    """The equations that read each variable. Dead equations (``_ = sign z`` in jnp.log of a
    sum) read nothing unless ``dead_read``."""
    dead_set = set() if dead_read else dead(jaxpr)
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


def bind_at(eqn, invals: Sequence, params: dict | None, info) -> list:
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
        if _inlined(eqn):
            body, consts_b = _jc.call_body(eqn)
            if all(a is None for a in out_axes):  # shared by every row: runs as written
                return _jc.jaxpr_as_fun(_jc.closed_jaxpr(body, consts_b))(*invals)
            return _eval(body, consts_b, invals, axes, rows, info)
        if eqn.primitive.name in _jc.CUSTOM_JVP_PRIMITIVES:
            return _custom_jvp_at(eqn, invals, axes, rows, info)
        return bind_at(eqn, invals, rewrite(eqn, out_axes, rows), info)

    return _jc.eval_eqns(jaxpr, consts, args, apply)


def _custom_jvp_at(eqn, invals: Sequence, axes: Axes, rows: int, info) -> list:
    """A custom_jvp function's equation on ``rows`` rows: a ``jax.custom_jvp`` of its body on
    the rows whose rule is its own rule on the rows, so that a chunk is differentiated as the
    function is (the rows' shapes in both rewritten by :func:`_eval`)."""
    _, out_axes = axes[id(eqn)]
    if all(a is None for a in out_axes):  # shared by every row: runs as written
        return bind_at(eqn, invals, None, info)
    body, consts_b = _jc.call_body(eqn)
    n = eqn.params["num_consts"]

    def jvp(primals, tangents):
        rule = _rule_at(eqn, axes)
        ins = [*primals[n:], *tangents[n:]]  # the rule sees no constants (as JAX's)
        out = _eval(rule.jaxpr, rule.consts, ins, rule.axes, rows, info)
        outs, nonzero = out[: len(rule.out_zeros)], iter(out[len(rule.out_zeros) :])
        tangents_out = [
            _jc.zero_tangent_value(jax.typeof(x)) if zero else next(nonzero)
            for x, zero in zip(outs, rule.out_zeros, strict=True)
        ]
        return outs, tangents_out

    f = jax.custom_jvp(lambda *xs: _eval(body, consts_b, xs, axes, rows, info))
    f.defjvp(jvp)
    with _siu.user_context(info.traceback, name_stack=info.name_stack):
        return list(f(*invals))


def _rule_at(eqn, axes: Axes) -> _Rule:
    """The row-wise rule of a custom_jvp function of a tail, read from ``axes`` or, for one
    inside another's rule (differentiated twice), found now and kept there."""
    key = ("rule", id(eqn))
    if key not in axes:
        axes[key] = _rule(eqn, *axes[id(eqn)])
    if axes[key] is None:
        raise NotImplementedError(
            "jaxmem.autochunk: the custom_jvp function at "
            f"{_jc.summarize_source(eqn.source_info)}, inside another's derivative rule, has a "
            "rule that does not run row by row: this higher derivative of the loss cannot be "
            "taken chunk by chunk (call the loss without autochunk for it)"
        )
    return axes[key]


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
