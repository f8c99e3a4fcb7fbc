"""The step's jaxpr, as the plan reads it: which equations are cheap to recompute, the bytes a kept
value takes (masks as bits), walks over equations.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxmem._src import jax_compat as jc

# Primitives whose recomputation in the backward step is cheap: elementwise arithmetic and
# transcendental functions, comparisons and selects, type conversions and pure data movement
# (and device_put *to device*, see _is_cheap: re-fetching a host-resident slice beats stacking a
# device copy of it, while a copy *to host* is what an offloading policy wants stored).
# jax 0.12 adds log2, one_minus_square (tanh's derivative) and polynomial (elementwise).
# Not here on purpose: dot_general, conv, reductions, cumulative ops, sort, gather/scatter,
# random number generation, control flow.
CHEAP_PRIMITIVES: frozenset[str] = frozenset(
    """
    abs acos acosh add and asin asinh atan atan2 atanh bitcast_convert_type broadcast_in_dim cbrt
    ceil clamp complex concatenate conj convert_element_type copy copy_p cos cosh div
    dynamic_slice erf erf_inv erfc exp exp2 expand_dims expm1 floor ge gt imag integer_pow
    iota is_finite le log log1p log2 logistic lt max min mul name neg nextafter not
    one_minus_square or pad polynomial population_count pow real reduce_precision rem reshape
    rev round rsqrt select_n
    shift_left shift_right_arithmetic shift_right_logical sign sin sinh slice split sqrt square
    squeeze sub tan tanh transpose xor
    """.split()
    # Re-layouts on a mesh: recomputing one in the backward pass re-gathers a weight instead of
    # stacking its gathered copy per step, as FSDP (ZeRO-3) gathers parameters again there.
    + "reshard sharding_constraint all_gather".split()
)


_nbytes = jc.nbytes


_is_var = jc.is_var


# Costs are bytes scaled by _TIE plus one per stored value: among cuts of equal bytes, the one
# storing fewer values (hence recomputing less) wins.
_TIE = 1 << 12


def packs_bits(aval) -> bool:
    """Whether a kept value of type ``aval`` is stored as bits: a boolean mask (dropout's keep
    mask, a ``where`` condition) whose last axis is at least 2 long and not sharded in its type.
    :func:`jaxmem.scan` packs such a partial activation 8 to a byte in the forward step
    (``jnp.packbits`` on the last axis) and unpacks it in the backward step."""
    if getattr(aval, "dtype", None) != np.dtype(bool) or not aval.shape or aval.shape[-1] < 2:
        return False
    spec = tuple(getattr(getattr(aval, "sharding", None), "spec", ()) or ())
    return len(spec) < len(aval.shape) or spec[len(aval.shape) - 1] is None


def kept_bytes(aval) -> int:
    """Bytes a kept value of type ``aval`` takes: 1 bit per element for a packed mask."""
    if packs_bits(aval):
        rows = int(np.prod(aval.shape[:-1], dtype=np.int64))
        return rows * -(-aval.shape[-1] // 8)
    return _nbytes(aval)


def _cost(aval) -> int:
    return kept_bytes(aval) * _TIE + 1


# Exact comparisons of floating-point values. The backward step's recompute is a separate XLA
# computation from the forward step's: XLA may fold constants or fuse differently there, so a
# recomputed float is equal to the forward's value only up to rounding. A comparison for
# *equality* turns that rounding into a different mask: with jax 0.10.2, ``max(g, 0.1 * g)``'s
# JVP is ``eq(g, ans)`` and ``eq(0.1 * g, ans)`` against the output ``ans``, and comparing a
# recomputed ``0.1 * g`` with the forward's ``ans`` (a y, read back) dropped a quarter of the
# gradient. Every JVP rule that locates an extremum this way (max, min, reduce_max, argmax-based
# ``_eq_meet``, sort, ...) is of that kind, so such a mask is never recomputed: it is kept, as
# bits (:func:`packs_bits`). Orderings (lt, gt, ...) flip only at exact ties and stay cheap.
_EXACT_COMPARISONS = frozenset({"eq", "ne"})


def _is_cheap(eqn) -> bool:
    name = eqn.primitive.name
    if name in _EXACT_COMPARISONS:
        return not any(jc.is_float(v) for v in eqn.invars)
    if name in CHEAP_PRIMITIVES:
        return True
    if name == "device_put":
        return not any(jc.is_host(v.aval) for v in eqn.outvars)
    if name in jc.CALL_PRIMITIVES or name == "custom_jvp_call":
        # A custom_jvp function (relu, silu, softplus, ...) evaluates its call_jaxpr: cheap
        # when that is. Recomputing relu(u) from u lets the cut keep u alone where it kept
        # relu(u) and the bool mask u > 0 beside it.
        return all(_is_cheap(e) for sub in jc.subjaxprs(eqn) for e in sub.eqns)
    return False


def iter_eqns(jaxpr):
    """Yields the equations of ``jaxpr`` and, recursively, of the jaxprs in their parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jc.subjaxprs(eqn):
            yield from iter_eqns(sub)


def invariant_bytes(jaxpr, invariant: Sequence[bool]) -> int:
    """Bytes of the values ``jaxpr`` computes from its invariant inputs (and literals) alone, at
    any call depth (a remat's recompute included): what XLA could hoist out of a loop running
    ``jaxpr`` as its body, if the inputs marked in ``invariant`` do not change in it."""
    inv = {v for v, i in zip(jaxpr.invars, invariant, strict=True) if i}
    inv |= set(jaxpr.constvars)
    total = 0
    for eqn in jaxpr.eqns:
        ins = [not _is_var(v) or v in inv for v in eqn.invars]
        subs = jc.subjaxprs(eqn)
        if len(subs) == 1 and len(subs[0].invars) == len(eqn.invars):
            total += invariant_bytes(subs[0], ins)
        outs = [v for v in eqn.outvars if _is_var(v)]
        out_bytes = sum(_nbytes(v.aval) for v in outs)
        # XLA's loop-invariant code motion leaves size-inflating ops (a broadcast) in the loop,
        # and so what is computed from them.
        inflates = out_bytes > sum(_nbytes(v.aval) for v in eqn.invars if _is_var(v))
        if all(ins) and not eqn.effects and not subs and not inflates:
            inv.update(outs)
            total += out_bytes
    return total


def used_invars(jaxpr) -> list[bool]:
    """Per input of ``jaxpr``, whether an output depends on it (through any equation that
    computes an output, or has effects)."""
    live = {v for v in jaxpr.outvars if _is_var(v)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(_is_var(v) and v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if _is_var(v))
    return [v in live for v in jaxpr.invars]


def forwarded_inputs(jaxpr) -> list:
    """Per output of ``jaxpr``, the index of the input it is (passed through unchanged, at any
    depth of calls and remats), else None."""
    origin = {v: i for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        subs = jc.subjaxprs(eqn)
        if eqn.primitive.name not in (*jc.CALL_PRIMITIVES, "remat2") or len(subs) != 1:
            continue
        inner = forwarded_inputs(subs[0])
        if len(subs[0].invars) != len(eqn.invars) or len(inner) != len(eqn.outvars):
            continue
        for out, k in zip(eqn.outvars, inner, strict=True):
            if k is not None and _is_var(eqn.invars[k]) and eqn.invars[k] in origin:
                origin[out] = origin[eqn.invars[k]]
    return [origin.get(v) if _is_var(v) else None for v in jaxpr.outvars]


def needed_eqns(eqns, targets, available, effects: bool = False) -> list:
    """The equations (in order) that compute ``targets`` from the variables in ``available``;
    with ``effects``, also every equation with effects (``jax.debug.print``, callbacks) and what
    it reads, so that a loop running the result runs each effect once a step."""
    producer = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.outvars:
            producer[v] = i
    needed: set[int] = set()
    stack = [v for v in targets if _is_var(v)]
    if effects:
        for i, eqn in enumerate(eqns):
            if eqn.effects:
                needed.add(i)
                stack.extend(u for u in eqn.invars if _is_var(u))
    seen = set()
    while stack:
        v = stack.pop()
        if v in seen or v in available:
            continue
        seen.add(v)
        i = producer.get(v)
        if i is None:
            raise AssertionError(f"jaxmem internal error: no producer for {v}")
        if i not in needed:
            needed.add(i)
            stack.extend(u for u in eqns[i].invars if _is_var(u))
    return [eqns[i] for i in sorted(needed)]


def sub_jaxpr(jaxpr, consts, invars, outvars, effects: bool = False):
    """The closed jaxpr computing ``outvars`` from ``invars`` (and ``jaxpr``'s constvars, bound
    to ``consts``): the equations of ``jaxpr`` they need, in order; with ``effects``, every
    equation with effects too (:func:`needed_eqns`)."""
    eqns = needed_eqns(jaxpr.eqns, outvars, set(invars) | set(jaxpr.constvars), effects)
    sub = jc.make_jaxpr(jaxpr, invars=list(invars), outvars=list(outvars), eqns=eqns)
    return jc.closed_jaxpr(sub, consts)


def _plain_call(eqn) -> bool:
    """A call (``jit``) that only groups equations: no shardings, layouts or compiler options of
    its own, so evaluating its equations in place computes the same values (XLA inlines it)."""
    if eqn.primitive.name not in jc.CALL_PRIMITIVES:
        return False
    p = eqn.params
    shardings = (*p.get("in_shardings", ()), *p.get("out_shardings", ()))
    layouts = (*p.get("in_layouts", ()), *p.get("out_layouts", ()))
    return (
        all(type(s).__name__ == "UnspecifiedValue" for s in shardings)
        and all(x is None for x in layouts)
        and not p.get("compiler_options_kvs")
    )


def eval_inlined(closed, *args) -> list:
    """Evaluates a closed jaxpr on ``args`` as ``jax.core.jaxpr_as_fun`` does, except that a plain
    call (``jnp.where``'s ``jit``, a user's inner ``jit`` without shardings) is evaluated
    equation by equation instead of being bound whole.

    Traced, the step then has no call boundaries: the plan prices and recomputes each equation of
    a call on its own. A call is one value-producing unit to the cut, so one expensive or exactly
    compared equation in it (``jnp.where`` on a float mask computes ``mask != 0``) would make all
    its outputs stored, a zero tangent that ``where``'s derivative broadcasts included.
    """
    return _eval_inlined(jc.open_jaxpr(closed), jc.jaxpr_consts(closed), args)


def _eval_inlined(jaxpr, consts: Sequence, args: Sequence, inside_call: bool = False) -> list:
    # Inside an inlined call, equations keep the call's source line (the user's line: the
    # call's own equations point into the library that defines it, jnp.where's module).
    def apply(eqn, invals):
        with eqn.ctx.manager if inside_call else jc.eqn_context(eqn):
            if _plain_call(eqn):
                return _eval_inlined(*jc.call_body(eqn), invals, inside_call=True)
            return jc.bind_eqn(eqn, invals)

    return jc.eval_eqns(jaxpr, consts, args, apply)
