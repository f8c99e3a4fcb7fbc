"""Chooser pins: the float operands of a max or min whose JVP masks compare them with the result go
through one optimization barrier, so each mask sees the values the result was chosen from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxmem._src import jax_compat as jc
from jaxmem._src.scan.jaxprs import (
    _EXACT_COMPARISONS,
    _is_var,
)

# Choosers whose JVP locates the chosen operand with an exact comparison against the result:
# jax 0.10's max/min (``eq(x, max(x, y))``), reduce_max/reduce_min on every version
# (``eq(x, broadcast(max(x)))``).
_CHOOSERS = frozenset({"max", "min", "reduce_max", "reduce_min"})


# What carries a chooser's result unchanged to the comparison (reduce_max's JVP reshapes it).
_RESULT_VIEWS = frozenset({"reshape", "broadcast_in_dim", "expand_dims", "squeeze", "copy"})


def _compared_choosers(jaxpr) -> set:
    """The ids of the float chooser equations of ``jaxpr`` (its top level) whose result (or a
    reshape or broadcast of it) is compared for equality with one of their operands."""
    views: dict = {}  # variable -> id of the chooser equation whose result it is
    operands: dict = {}  # id of a chooser equation -> its operands
    compared = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _CHOOSERS and any(jc.is_float(v) for v in eqn.invars):
            views[eqn.outvars[0]] = id(eqn)
            operands[id(eqn)] = {v for v in eqn.invars if _is_var(v)}
        elif name in _RESULT_VIEWS and _is_var(eqn.invars[0]) and eqn.invars[0] in views:
            views[eqn.outvars[0]] = views[eqn.invars[0]]
        elif name in _EXACT_COMPARISONS and all(_is_var(v) for v in eqn.invars):
            a, b = eqn.invars
            for result, other in ((a, b), (b, a)):
                if result in views and other in operands[views[result]]:
                    compared.add(views[result])
    return compared


def _pins_choosers(jaxpr) -> bool:
    """Whether ``jaxpr`` (at any call depth) compares a float chooser's result for equality."""
    return bool(_compared_choosers(jaxpr)) or any(
        _pins_choosers(sub)
        for e in jaxpr.eqns
        if e.primitive.name in jc.CALL_PRIMITIVES
        for sub in jc.subjaxprs(e)
    )


def pin_chooser_operands(closed):
    """``closed`` with the float operands of each chooser (max, min, reduce_max, reduce_min)
    whose result a mask compares for equality passed through an optimization barrier, and every
    later equation reading the pinned values.

    A chooser's JVP mask compares its result with its operands for equality. XLA may compute
    the result from a rewritten expression (``max(tanh(a), tanh(tanh(a)))`` becomes
    ``tanh(max(a, tanh(a)))``: tanh is monotone) and each comparison's operands in another
    fusion, and a transcendental evaluated in two fusions may differ in its last bit: then no
    operand equals the result and the gradient through the chooser is lost (jax 0.10.2 at XLA
    -O0, a step of ``jaxmem.scan``'s forward; ``lax.scan``'s step happened to fuse otherwise).
    Behind the barrier the operands are values XLA cannot see into: the result *is* one of them,
    bit for bit, and the comparisons read the same values. Only such choosers are pinned (a
    barrier also changes how XLA fuses, hence rounds, what is around it): jax 0.12's max/min
    compare their operands with each other, and relu has no comparison with its result. A
    jaxpr without one is returned as it is.
    """
    jaxpr = jc.open_jaxpr(closed)
    if not _pins_choosers(jaxpr):
        return closed

    def run(*args):
        return _eval_pinned(jaxpr, jc.jaxpr_consts(closed), args)

    return jax.make_jaxpr(run)(*[jc.struct(v.aval) for v in jaxpr.invars])


def _eval_pinned(jaxpr, consts: Sequence, args: Sequence) -> list:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return env[v] if _is_var(v) else v.val

    segment: list = []
    compared = _compared_choosers(jaxpr)

    def flush():
        # Runs the equations gathered so far as one jaxpr (JAX's own evaluator binds them).
        if not segment:
            return
        defined = {v for e in segment for v in e.outvars}
        ins = list(
            dict.fromkeys(v for e in segment for v in e.invars if _is_var(v) and v not in defined)
        )
        outs = [v for v in dict.fromkeys(defined) if _is_var(v) and not jc.is_drop_var(v)]
        sub = jc.make_jaxpr(jaxpr, constvars=[], invars=ins, outvars=outs, eqns=segment)
        env.update(
            zip(outs, jc.jaxpr_as_fun(jc.closed_jaxpr(sub, []))(*map(read, ins)), strict=True)
        )
        segment.clear()

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if id(eqn) in compared:
            floats = list(dict.fromkeys(v for v in eqn.invars if _is_var(v) and jc.is_float(v)))
            if floats:
                flush()
                env.update(
                    zip(floats, jax.lax.optimization_barrier([env[v] for v in floats]), strict=True)
                )
        elif name in jc.CALL_PRIMITIVES and any(_pins_choosers(s) for s in jc.subjaxprs(eqn)):
            flush()
            (sub,) = [p for p in eqn.params.values() if jc.is_jaxpr(p)]
            sub = sub if jc.is_closed_jaxpr(sub) else jc.closed_jaxpr(sub, [])
            outs = _eval_pinned(jc.open_jaxpr(sub), jc.jaxpr_consts(sub), map(read, eqn.invars))
            env.update(
                (v, x) for v, x in zip(eqn.outvars, outs, strict=True) if not jc.is_drop_var(v)
            )
            continue
        segment.append(eqn)
    flush()
    return [read(v) for v in jaxpr.outvars]
