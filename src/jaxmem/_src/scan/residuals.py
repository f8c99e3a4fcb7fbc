"""Residual analysis of one scan step, and the plan :func:`jaxmem.scan` runs, as small jaxprs.

This module traces one step ``(consts, carry, x) -> (carry', y)`` under :func:`jax.vjp`, takes the
residuals the VJP closes over, and decides for each one how the backward pass of
:func:`jaxmem.scan` will get it back:

* ``"xs"``, ``"const"``, ``"carry"``, ``"ys"``: the residual *is* an xs slice, a loop invariant
  (a closed-over constant, a literal, or a value computed from constants only, hoisted out of the
  loop), the carry (in or out), or a ys output. Nothing is stacked for it, beyond the carry
  sequence, which is kept once for the whole scan when any residual needs it.
* ``"recomputed"``: a cheap function (elementwise, convert, transpose, reshape, broadcast, slice,
  select, compare; no dot, conv or reduction) of values that are available in the backward step.
* ``"stacked"``: the residual itself is one of the *partial activations*, the values the forward
  loop emits per step.

Which values to stack is a minimum cut (:mod:`jaxmem._src.scan.mincut`): every residual must be
reachable from stored values through cheap equations only, and the bytes stored per step are
minimised. Whether to keep each carry leaf's sequence is decided on top of it, by trying the
subsets of carry leaves that some residual could use.

:func:`plan_step` reads as its steps: :func:`trace_step_vjp`, :func:`loop_invariants`,
:func:`carry_candidates`, :func:`choose_stores` (the min-cut), :func:`classify`, and
:func:`build_jaxprs`, which cuts the traced jaxpr into the three closed jaxprs the custom VJP
runs with JAX's own evaluator: ``hoist`` (loop invariants, once), ``forward`` (one step emitting
carry, ys and the partial activations) and ``rebuild`` (one backward step's residuals).

References:
  torch_xla scan "partial activations" (only non-aliased residuals are returned by the forward).
  Jain et al., Checkmate (2020) and the functorch min-cut rematerialization partitioner, for the
  min-cut formulation of what to save.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxmem._src import jax_compat as jc
from jaxmem._src.scan import mincut as mincut
from jaxmem._src.scan import recompute_cost as _pricing

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

# Where a residual comes from in the backward pass.
RESIDUAL_CLASSES = ("xs", "const", "carry", "ys", "recomputed", "stacked")

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


def _is_float(v) -> bool:
    dtype = getattr(v.aval, "dtype", None)
    return dtype is not None and np.issubdtype(dtype, np.inexact)


def _is_cheap(eqn) -> bool:
    name = eqn.primitive.name
    if name in _EXACT_COMPARISONS:
        return not any(_is_float(v) for v in eqn.invars)
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


def needed_eqns(eqns, targets, available) -> list:
    """The equations (in order) that compute ``targets`` from the variables in ``available``."""
    producer = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.outvars:
            producer[v] = i
    needed: set[int] = set()
    stack = [v for v in targets if _is_var(v)]
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


# ------------------------------------------------------------------------------------------
# Step 1: the step's VJP as one jaxpr J: (*consts, *carry, *x) -> (*carry', *y, *residuals).


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """The forward-with-residuals jaxpr of one step and its variable groups.

    Attributes:
      jaxpr: the open jaxpr ``J``.
      consts: values of ``J``'s constvars (concrete arrays).
      const_in, carry_in, x_in: ``J``'s input variables, by group.
      carry_out, y_out, res_out: ``J``'s outputs (variables or literals), by group.
      res_treedef: tree structure of the VJP function; its leaves are the residuals.
    """

    jaxpr: Any
    consts: list
    const_in: list
    carry_in: list
    x_in: list
    carry_out: list
    y_out: list
    res_out: list
    res_treedef: Any


def trace_step_vjp(body, n_consts: int, n_carry: int, in_avals: Sequence) -> TracedStep:
    """Traces ``jax.vjp`` of one step; its residuals become outputs of the returned jaxpr.

    Args:
      body: closed jaxpr of the step: inputs ``(*consts, *carry, *x)``, outputs
        ``(*carry_out, *y)``.
      n_consts: number of constant inputs.
      n_carry: number of carry leaves.
      in_avals: abstract values of all inputs, in order.
    """
    step_fn = jc.jaxpr_as_fun(body)
    treedef_box = []

    def fwd_step(*args):
        def step(consts, carry, x):
            outs = step_fn(*consts, *carry, *x)
            return list(outs[:n_carry]), list(outs[n_carry:])

        groups = (args[:n_consts], args[n_consts : n_consts + n_carry], args[n_consts + n_carry :])
        (c_out, y), vjp_fn = jax.vjp(step, *map(list, groups))
        res, treedef = jax.tree_util.tree_flatten(vjp_fn)
        treedef_box.append(treedef)
        return c_out, y, res

    closed = jax.make_jaxpr(fwd_step)(*map(jc.struct, in_avals))
    jaxpr = jc.open_jaxpr(closed)
    n_y = len(jc.open_jaxpr(body).outvars) - n_carry
    ins, outs = list(jaxpr.invars), list(jaxpr.outvars)
    return TracedStep(
        jaxpr=jaxpr,
        consts=jc.jaxpr_consts(closed),
        const_in=ins[:n_consts],
        carry_in=ins[n_consts : n_consts + n_carry],
        x_in=ins[n_consts + n_carry :],
        carry_out=outs[:n_carry],
        y_out=outs[n_carry : n_carry + n_y],
        res_out=outs[n_carry + n_y :],
        res_treedef=treedef_box[-1],
    )


# ------------------------------------------------------------------------------------------
# Step 2: loop invariants.


def loop_invariants(traced: TracedStep) -> set:
    """Variables computed from constants only (JAX hoists these out of the loop; so do we)."""
    const_only = set(traced.jaxpr.constvars) | set(traced.const_in)
    for eqn in traced.jaxpr.eqns:
        if eqn.effects:
            continue
        if all((not _is_var(u)) or u in const_only for u in eqn.invars):
            const_only.update(eqn.outvars)
    return const_only


# ------------------------------------------------------------------------------------------
# Step 3: which carry sequences could be kept.


def carry_from_ys(traced: TracedStep) -> list[int]:
    """Per carry leaf, the index of a y output that *is* its carry-out, or -1.

    Such a leaf's whole sequence is ys (shifted by one step) plus init: it is free.
    """
    return [
        traced.y_out.index(c) if _is_var(c) and c in traced.y_out else -1 for c in traced.carry_out
    ]


def carry_candidates(traced: TracedStep, from_y: Sequence[int]) -> list[tuple[int, ...]]:
    """The subsets of carry leaves whose kept sequence the min-cut is asked to consider.

    Leaves with bytes that are not already free (read from ys). All subsets of up to 6 such
    leaves; beyond that none, all, and all-but-one.
    """
    cands = [i for i, v in enumerate(traced.carry_in) if _nbytes(v.aval) > 0 and from_y[i] < 0]
    if len(cands) <= 6:
        return list(
            itertools.chain.from_iterable(
                itertools.combinations(cands, k) for k in range(len(cands) + 1)
            )
        )
    return [(), tuple(cands)] + [tuple(c for c in cands if c != i) for i in cands]


# ------------------------------------------------------------------------------------------
# Step 4: the min-cut.


@dataclasses.dataclass(frozen=True)
class Stores:
    """What the backward step has: kept carry leaves, stored values, and everything free."""

    kept_carry: tuple[int, ...]
    stored: frozenset
    free: frozenset


def _graph(jaxpr, cheap: Callable, host: frozenset = frozenset()):
    """Min-cut costs and ops of ``jaxpr``; a value in ``host`` (kept in host memory) costs no
    device bytes, only the unit that makes the cut prefer fewer values."""
    cost = lambda v: 1 if v in host else _cost(v.aval)
    costs = {v: cost(v) for v in itertools.chain(jaxpr.constvars, jaxpr.invars)}
    ops = []
    for eqn in jaxpr.eqns:
        costs.update((v, cost(v)) for v in eqn.outvars)
        inputs = tuple(u for u in eqn.invars if _is_var(u))
        ops.append(mincut.Op(inputs, tuple(eqn.outvars), cheap(eqn)))
    return costs, ops


def choose_stores(
    traced: TracedStep,
    base_free: set,
    candidates: Sequence[tuple[int, ...]],
    cheap: Callable,
    host: frozenset = frozenset(),
) -> Stores:
    """The cheapest stores over the candidate carry subsets (a kept carry costs its bytes; a
    value in ``host``, offloaded by name, no device bytes)."""
    targets = [v for v in traced.res_out if _is_var(v)]
    costs, ops = _graph(traced.jaxpr, cheap, host)
    best = None
    for subset in candidates:
        free = set(base_free)
        for i in subset:
            free.add(traced.carry_in[i])
            if _is_var(traced.carry_out[i]):
                free.add(traced.carry_out[i])
        cost, stored = mincut.min_cut(costs, ops, free, set(traced.carry_in) - free, targets)
        if cost is None:
            continue
        # A kept carry sequence costs its bytes and wins ties against other single values:
        # it serves both the carry-in and the carry-out, and is what offload="carries" moves.
        cost += sum(_nbytes(traced.carry_in[i].aval) * _TIE for i in subset)
        if best is None or cost < best[0]:
            best = (cost, Stores(tuple(subset), stored, frozenset(free)))
    if best is None:
        raise AssertionError("jaxmem internal error: no store set makes the residuals available")
    return best[1]


# ------------------------------------------------------------------------------------------
# Step 5: classification, and the whole plan of one step.


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The plan for one scan step: what to keep, and the three jaxprs that run it.

    Attributes:
      traced: the step's VJP (:class:`TracedStep`).
      res_classes: one of RESIDUAL_CLASSES per residual.
      stacked_vars: the partial activations: variables of ``J`` emitted per step.
      hoisted_vars: variables computed from constants only that the backward step reads.
      stack_carry: per carry leaf, whether the carry sequence of that leaf is kept.
      carry_out_read: per carry leaf, whether the backward step reads its carry-out from the
        kept sequence (the next step's carry-in; the scan's final carry for the last step). A
        kept leaf whose carry-out no residual needs (a remat policy keeps only the step's
        inputs) keeps no final carry beside its sequence.
      carry_from_y: per carry leaf, the index of a y output that *is* its carry-out, or -1.
      carry_in_read: per carry leaf, whether the backward step reads its carry-in.
      need_y: per y leaf, whether the backward step reads it.
      carry_seq_y: per carry leaf whose sequence is kept, the y output that *is* its carry-in
        (that ys stack serves as the sequence), or -1.
      hoist: closed jaxpr ``(*consts) -> (*hoisted)``.
      forward: closed jaxpr ``(*consts, *hoisted, *carry, *x) -> (*carry', *y, *stacked)``.
      rebuild: closed jaxpr ``(*consts, *hoisted, *x, *ys_read, *kept_carry_out,
        *kept_carry_in, *carry_in_from_ys, *stacked) -> (*residuals)``; its input groups are
        :attr:`rebuild_inputs`.
    """

    traced: TracedStep
    res_classes: tuple[str, ...]
    stacked_vars: tuple
    hoisted_vars: tuple
    stack_carry: tuple[bool, ...]
    carry_out_read: tuple[bool, ...]
    carry_from_y: tuple[int, ...]
    carry_in_read: tuple[bool, ...]
    need_y: tuple[bool, ...]
    carry_seq_y: tuple[int, ...]
    hoist: Any
    forward: Any
    rebuild: Any

    # Variable groups of J, by name.
    @property
    def const_invars(self):
        return self.traced.const_in

    @property
    def carry_invars(self):
        return self.traced.carry_in

    @property
    def x_invars(self):
        return self.traced.x_in

    @property
    def carry_outvars(self):
        return self.traced.carry_out

    @property
    def y_outvars(self):
        return self.traced.y_out

    @property
    def res_outvars(self):
        return self.traced.res_out

    @property
    def res_treedef(self):
        return self.traced.res_treedef

    @property
    def carry_read_from_y(self) -> tuple[tuple[int, int], ...]:
        """``(carry leaf, index among the ys read)`` for carry-ins read from the ys sequence."""
        ys_read = [i for i, n in enumerate(self.need_y) if n]
        return tuple(
            (i, ys_read.index(j))
            for i, (j, r) in enumerate(zip(self.carry_from_y, self.carry_in_read, strict=True))
            if j >= 0 and r
        )


def classify(traced: TracedStep, const_only: set, stores: Stores, from_y) -> tuple[str, ...]:
    """Where the backward step gets each residual (one of RESIDUAL_CLASSES)."""
    n_carry = len(traced.carry_in)
    x_set = set(traced.x_in)
    y_set = {v for v in traced.y_out if _is_var(v)}
    stored = {v for v in stores.stored if v not in const_only and v not in y_set}
    carry_set = (
        {traced.carry_in[i] for i in stores.kept_carry}
        | {traced.carry_out[i] for i in stores.kept_carry if _is_var(traced.carry_out[i])}
        | {traced.carry_in[i] for i in range(n_carry) if from_y[i] >= 0}
    )
    classes = []
    for v in traced.res_out:
        if not _is_var(v) or v in const_only:
            classes.append("const")
        elif v in x_set:
            classes.append("xs")
        elif v in stored:
            classes.append("stacked")
        elif v in carry_set:
            classes.append("carry")
        elif v in y_set:
            classes.append("ys")
        else:
            classes.append("recomputed")
    return tuple(classes)


def _distinct_invars(groups: Sequence[Sequence]) -> list:
    """Input variables for a jaxpr from ``groups``; a repeated variable's later places (and
    literals) get fresh, unused variables: the caller passes the same value to each place."""
    seen, out = set(), []
    for v in itertools.chain.from_iterable(groups):
        if _is_var(v) and v not in seen:
            seen.add(v)
            out.append(v)
        else:
            out.append(jc.new_var(v.aval))
    return out


def _sub_jaxpr(traced: TracedStep, in_groups: Sequence[Sequence], outs: Sequence):
    """The closed jaxpr computing ``outs`` from the variables of ``in_groups`` (and J's consts)."""
    invars = _distinct_invars(in_groups)
    available = set(invars) | set(traced.jaxpr.constvars)
    eqns = needed_eqns(traced.jaxpr.eqns, outs, available)
    jaxpr = jc.make_jaxpr(traced.jaxpr, invars=invars, outvars=list(outs), eqns=eqns)
    return jc.closed_jaxpr(jaxpr, traced.consts)


def build_jaxprs(
    traced, hoisted, stacked, stack_carry, carry_out_read, carry_from_y, carry_in_read, need_y
):
    """The ``hoist``, ``forward`` and ``rebuild`` jaxprs of a plan (see :class:`StepPlan`)."""
    hoist = _sub_jaxpr(traced, [traced.const_in], hoisted)
    forward = _sub_jaxpr(
        traced,
        [traced.const_in, hoisted, traced.carry_in, traced.x_in],
        [*traced.carry_out, *traced.y_out, *stacked],
    )
    rebuild = _sub_jaxpr(
        traced,
        [
            traced.const_in,
            hoisted,
            traced.x_in,
            [v for v, n in zip(traced.y_out, need_y, strict=True) if n],
            [v for v, r in zip(traced.carry_out, carry_out_read, strict=True) if r],
            [v for v, k in zip(traced.carry_in, stack_carry, strict=True) if k],
            [
                traced.carry_in[i]
                for i, (j, r) in enumerate(zip(carry_from_y, carry_in_read, strict=True))
                if j >= 0 and r
            ],
            stacked,
        ],
        traced.res_out,
    )
    return hoist, forward, rebuild


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
        if name in _CHOOSERS and any(_is_float(v) for v in eqn.invars):
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
            floats = list(dict.fromkeys(v for v in eqn.invars if _is_var(v) and _is_float(v)))
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


def _priced_cut(traced: TracedStep, body, base_free: set, candidates, model=None, host=frozenset()):
    """The cut of ``recompute="auto"`` (:mod:`jaxmem._src.scan.recompute_cost`): recompute only what
    fuses, and keep the most expensive recompute instead while the recomputes cost more than the
    model's budget of the step's time. Returns the recompute predicate and the stores."""
    model = _pricing.for_backend() if model is None else model
    allowed = _pricing.plan_filter(_is_cheap, base_free | set(traced.carry_in), model)
    kept: set[int] = set()  # ids of equations the budget took out of the recomputable set

    def cheap(eqn) -> bool:
        return id(eqn) not in kept and allowed(eqn)

    budget = model.budget * _pricing.step_seconds(jc.open_jaxpr(body).eqns, model)
    targets = [v for v in traced.res_out if _is_var(v)]
    # What keeping every residual would cost in bytes: a recompute is credited with the memory
    # traffic of the bytes it saves.
    never = lambda e: False
    most = _stored_bytes(traced, choose_stores(traced, base_free, candidates, never, host), host)
    for attempt in range(_MAX_PRICED_CUTS):
        stores = choose_stores(traced, base_free, candidates, cheap, host)
        recomputed = needed_eqns(traced.jaxpr.eqns, targets, stores.free | stores.stored)
        seconds = [_pricing.eqn_seconds(e, model) for e in recomputed]
        saved = _pricing.traffic_seconds(max(0, most - _stored_bytes(traced, stores, host)), model)
        if not recomputed or sum(seconds) - saved <= budget or attempt == _MAX_PRICED_CUTS - 1:
            break
        kept.add(id(recomputed[int(np.argmax(seconds))]))
    return cheap, stores


def _stored_bytes(traced: TracedStep, stores: Stores, host: frozenset = frozenset()) -> int:
    """Device bytes a cut keeps per step: its stored values and kept carry leaves."""
    kept = sum(_nbytes(traced.carry_in[i].aval) for i in stores.kept_carry)
    return kept + sum(kept_bytes(v.aval) for v in stores.stored if v not in host)


def named_vars(jaxpr, names) -> frozenset:
    """The variables of ``jaxpr`` named one of ``names``: the input or the output of a
    ``checkpoint_name`` equation (:func:`jaxmem.name`) with that name, at any depth."""
    out = set()
    for eqn in iter_eqns(jaxpr):
        if jc.eqn_checkpoint_name(eqn) in names:
            out.update(v for v in (*eqn.invars, *eqn.outvars) if _is_var(v))
    return frozenset(out)


# Cuts the budget of recompute="auto" may make (each after keeping one more recompute).
_MAX_PRICED_CUTS = 8


def plan_step(
    body,
    n_consts: int,
    n_carry: int,
    in_avals: Sequence,
    recompute: str,
    host_names: frozenset = frozenset(),
) -> StepPlan:
    """Traces the VJP of one step and plans where each residual comes from.

    Args:
      body: closed jaxpr of the step: inputs ``(*consts, *carry, *x)``, outputs
        ``(*carry_out, *y)``.
      n_consts: number of constant inputs.
      n_carry: number of carry leaves.
      in_avals: abstract values of the inputs (consts, carry, one x slice).
      recompute: ``"auto"`` (cheap recomputes that fuse, within a time budget:
        :mod:`jaxmem._src.scan.recompute_cost`), ``"cheap"`` or ``"none"``.
      host_names: checkpoint names of values kept in host memory (``offload=`` names): they
        cost the cut no device bytes, so it keeps them rather than what is computed from them.

    Returns:
      A :class:`StepPlan`.
    """
    traced = trace_step_vjp(body, n_consts, n_carry, in_avals)
    const_only = loop_invariants(traced)
    from_y = carry_from_ys(traced)
    # A y the backward step reads is not copied, but it is not free either: reading it keeps its
    # whole stack alive through the backward loop (lax.scan frees ys once the loss's backward has
    # read them, and never computes ys the loss ignores). So the min-cut prices a y like any
    # stored value, and a carry leaf whose carry-out is a y like any kept carry sequence; what
    # it picks among the y outputs is then read from ys, not stacked again.
    y_vars = {v for v in traced.y_out if _is_var(v)}
    base_free = const_only | set(traced.x_in)
    candidates = carry_candidates(traced, [-1] * len(traced.carry_in))
    host = named_vars(traced.jaxpr, host_names) if host_names else frozenset()
    if recompute == "auto":
        cheap, stores = _priced_cut(traced, body, base_free, candidates, host=host)
    else:
        cheap = _is_cheap if recompute == "cheap" else (lambda eqn: False)
        stores = choose_stores(traced, base_free, candidates, cheap, host)
    # Kept carry leaves whose carry-out is a y are read from ys (shifted), not stacked.
    from_y = [j if i in stores.kept_carry else -1 for i, j in enumerate(from_y)]

    # What the backward step evaluates, and from what.
    available = stores.free | stores.stored
    targets = [v for v in traced.res_out if _is_var(v)]
    recompute_eqns = needed_eqns(traced.jaxpr.eqns, targets, available)
    assert all(cheap(e) for e in recompute_eqns)
    read_by_bwd = set(targets) | {u for e in recompute_eqns for u in e.invars if _is_var(u)}
    eqn_outs = {v for e in traced.jaxpr.eqns for v in e.outvars}
    hoisted = tuple(
        v
        for v in dict.fromkeys(itertools.chain(targets, stores.stored, read_by_bwd))
        if v in const_only and v in eqn_outs and v in available
    )
    stacked = tuple(
        v for v in dict.fromkeys(stores.stored) if v not in const_only and v not in y_vars
    )
    stack_carry = tuple(i in stores.kept_carry and from_y[i] < 0 for i in range(n_carry))
    carry_seq_y = tuple(
        traced.y_out.index(v) if stack_carry[i] and v in y_vars else -1
        for i, v in enumerate(traced.carry_in)
    )
    carry_in_read = tuple(v in read_by_bwd for v in traced.carry_in)
    # A y that is an input of the step (a pass-through: nnx.scan returns the layers' state) is
    # read from that input, never from its ys stack.
    inputs = {*traced.const_in, *traced.x_in}
    need_y = [
        _is_var(v) and v in read_by_bwd and v not in const_only and v not in inputs
        for v in traced.y_out
    ]
    for i, j in enumerate(from_y):
        if j >= 0 and carry_in_read[i]:
            need_y[j] = True
    for j in carry_seq_y:
        if j >= 0:
            need_y[j] = True
    need_y = tuple(need_y)
    # A kept carry-out is an input of the rebuild only where it is read and not bound earlier in
    # the rebuild's inputs (as a const, hoisted value, xs slice or y read back).
    earlier = {*traced.const_in, *hoisted, *traced.x_in}
    earlier |= {v for v, n in zip(traced.y_out, need_y, strict=True) if n}
    carry_out_read = tuple(
        stack_carry[i] and _is_var(v) and v in read_by_bwd and v not in earlier
        for i, v in enumerate(traced.carry_out)
    )
    hoist, forward, rebuild = build_jaxprs(
        traced, hoisted, stacked, stack_carry, carry_out_read, from_y, carry_in_read, need_y
    )
    forward = pin_chooser_operands(forward)
    return StepPlan(
        traced=traced,
        res_classes=classify(traced, const_only, stores, from_y),
        stacked_vars=stacked,
        hoisted_vars=hoisted,
        stack_carry=stack_carry,
        carry_out_read=carry_out_read,
        carry_from_y=tuple(from_y),
        carry_in_read=carry_in_read,
        need_y=need_y,
        hoist=hoist,
        forward=forward,
        rebuild=rebuild,
        carry_seq_y=carry_seq_y,
    )


# ------------------------------------------------------------------------------------------
# The public view of a plan.


@dataclasses.dataclass(frozen=True)
class PlannedResidual:
    """One residual of a scan step's VJP, and where :func:`jaxmem.scan` gets it from.

    Attributes:
      shape: shape of the per-step value.
      dtype: numpy dtype name.
      bytes: bytes of the per-step value.
      kind: one of ``"xs"``, ``"const"``, ``"carry"``, ``"ys"``, ``"recomputed"``, ``"stacked"``;
        ``"checkpoint"`` for a carry leaf a checkpointed scan stores (``ScanPlan.stacked``).
      source: ``file:line (function)`` of the operation that produced it, or the input it is.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> step = lambda c, x: (jnp.sin(c) * x, None)  # recompute="cheap": the fewest bytes
      >>> plan = jaxmem.scan_residuals(step, jnp.ones(3), jnp.ones((5, 3)), recompute="cheap")
      >>> [(r.kind, r.shape, r.bytes) for r in plan.residuals]  # x, cos(c), sin(c)
      [('xs', (3,), 12), ('recomputed', (3,), 12), ('recomputed', (3,), 12)]
    """

    shape: tuple[int, ...]
    dtype: str
    bytes: int
    kind: str
    source: str


@dataclasses.dataclass(frozen=True)
class ScanPlan:
    """What :func:`jaxmem.scan` keeps for the backward pass of one scan, next to ``lax.scan``.

    Attributes:
      length: number of steps.
      residuals: every residual of one step's VJP, classified.
      stacked: what is kept per step for the backward pass: the partial activations
        (kind ``"stacked"``), the carry leaves whose sequence is kept (kind ``"carry"``) and the ys
        outputs the backward pass reads (kind ``"ys"``: kept alive, not copied).
      stacked_bytes: bytes stacked over the whole scan (``length`` times the per-step ``stacked``).
      stock_stacked_bytes: bytes :func:`jax.lax.scan` stacks for the same step (its loop-stacked
        residuals), or None when not measured.
      schedule: with ``checkpoints``, the :class:`jaxmem.CheckpointSchedule` (then ``stacked``
        lists the carry leaves, kind ``"checkpoint"``, and ``stacked_bytes`` is the bytes of the
        checkpoints: one step's residuals are live at a time); None otherwise.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> step = lambda c, x: (jnp.sin(c) * x, None)
      >>> plan = jaxmem.scan_residuals(step, jnp.ones(3), jnp.ones((5, 3)), recompute="cheap")
      >>> plan.stacked_bytes, plan.stock_stacked_bytes, plan.ratio  # carry sequence vs 2 stacks
      (60, 120, 0.5)
      >>> plan.counts()["recomputed"], [r.kind for r in plan.stacked]
      (2, ['carry'])

      The default, ``recompute="auto"``, prices recomputes against the step's time: this step
      has no dot to hide a sine and a cosine behind, so it keeps them, as ``lax.scan`` does.

      >>> jaxmem.scan_residuals(step, jnp.ones(3), jnp.ones((5, 3))).ratio
      1.0
    """

    length: int
    residuals: tuple[PlannedResidual, ...]
    stacked: tuple[PlannedResidual, ...]
    stacked_bytes: int
    stock_stacked_bytes: int | None
    schedule: Any = None

    @property
    def ratio(self) -> float | None:
        """``stacked_bytes / stock_stacked_bytes`` (None when the stock figure is unknown or 0)."""
        if not self.stock_stacked_bytes:
            return None
        return self.stacked_bytes / self.stock_stacked_bytes

    def counts(self) -> dict[str, int]:
        """Number of residuals of each kind."""
        return {k: sum(r.kind == k for r in self.residuals) for k in RESIDUAL_CLASSES}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return {
            "length": self.length,
            "residuals": [dataclasses.asdict(r) for r in self.residuals],
            "stacked": [dataclasses.asdict(r) for r in self.stacked],
            "stacked_bytes": self.stacked_bytes,
            "stock_stacked_bytes": self.stock_stacked_bytes,
            "schedule": None if self.schedule is None else dataclasses.asdict(self.schedule),
            "counts": self.counts(),
        }

    def __str__(self) -> str:
        def row(r):
            return f"  {r.dtype}{list(r.shape)!s:<18} {r.bytes:>12,d} B  {r.kind:<10} {r.source}"

        lines = [f"scan plan: {self.length} steps, {len(self.residuals)} residuals per step"]
        lines += [row(r) for r in self.residuals]
        if self.schedule is None:
            lines.append("kept per step (partial activations, carry sequences, ys read back):")
        else:
            lines.append(f"kept per checkpoint ({self.schedule.checkpoints} at most):")
        lines += [row(r) for r in self.stacked] or ["  (nothing)"]
        stock = (
            "not measured"
            if self.stock_stacked_bytes is None
            else f"{self.stock_stacked_bytes:,d} B"
        )
        ratio = "" if self.ratio is None else f" ({self.ratio:.2f}x)"
        if self.schedule is not None:
            lines.append(str(self.schedule))
        lines.append(f"stacked over the scan: {self.stacked_bytes:,d} B{ratio}; lax.scan: {stock}")
        return "\n".join(lines)


def _var_source(eqn_of, v, role: str) -> str:
    eqn = eqn_of.get(v)
    if eqn is None:
        return role
    return jc.summarize_source(eqn.source_info)


def summarize(
    plan: StepPlan, length: int, stock_stacked_bytes: int | None, schedule: Any = None
) -> ScanPlan:
    """The public :class:`ScanPlan` of an analysed step (of a checkpointed scan with
    ``schedule``, a :class:`jaxmem.CheckpointSchedule`: its checkpoints are its only stack)."""
    jaxpr = plan.traced.jaxpr
    eqn_of = {v: e for e in jaxpr.eqns for v in e.outvars}
    role = {}
    for v in plan.const_invars:
        role[v] = "const"
    for v in plan.carry_invars:
        role[v] = "carry"
    for v in plan.x_invars:
        role[v] = "xs"

    def planned(v, kind):
        aval = v.aval
        return PlannedResidual(
            shape=tuple(aval.shape),
            dtype=str(aval.dtype) if hasattr(aval, "dtype") else "",
            bytes=kept_bytes(aval) if kind == "stacked" else _nbytes(aval),
            kind=kind,
            source=("literal" if not _is_var(v) else _var_source(eqn_of, v, role.get(v, "const"))),
        )

    residuals = tuple(
        planned(v, kind) for v, kind in zip(plan.res_outvars, plan.res_classes, strict=True)
    )
    stacked = (
        tuple(planned(v, "stacked") for v in plan.stacked_vars)
        + tuple(
            planned(v, "carry")
            for v, keep, j in zip(
                plan.carry_invars, plan.stack_carry, plan.carry_seq_y, strict=True
            )
            if keep and j < 0  # a kept sequence that is a ys stack is listed as that y
        )
        + tuple(
            planned(v, "ys") for v, need in zip(plan.y_outvars, plan.need_y, strict=True) if need
        )
    )
    if schedule is not None:
        stacked = tuple(planned(v, "checkpoint") for v in plan.carry_invars)
        return ScanPlan(
            length=length,
            residuals=residuals,
            stacked=stacked,
            stacked_bytes=schedule.kept_bytes,
            stock_stacked_bytes=stock_stacked_bytes,
            schedule=schedule,
        )
    per_step = sum(r.bytes for r in stacked)
    return ScanPlan(
        length=length,
        residuals=residuals,
        stacked=stacked,
        stacked_bytes=per_step * length,
        stock_stacked_bytes=stock_stacked_bytes,
    )


# ------------------------------------------------------------------------------------------
# Which cotangents of the backward loop can be nonzero (known only in the backward pass).


def live_cotangents(traced: TracedStep, live_final: Sequence[bool], live_y: Sequence[bool]):
    """Which cotangents of a step can be nonzero in the backward loop, given the loss's.

    Args:
      traced: the step's VJP.
      live_final: per carry leaf, whether the cotangent of the final carry can be nonzero (False
        where the custom VJP got a symbolic zero: the loss ignores that leaf of the final carry).
      live_y: per y leaf, the same for the ys.

    Returns:
      ``(live_carry, live_in)``. ``live_carry``: per carry leaf, whether its cotangent can be
      nonzero in some step: a fixed point over the steps, since the carry-in cotangent of a step
      is nonzero only if the carry-in reaches, in the step's dataflow, a carry-out or a y whose
      cotangent is nonzero (what ``lax.scan``'s DCE of its linearized loop finds). ``live_in``:
      per input of ``J`` (consts, carry, x), whether it reaches an output with a nonzero
      cotangent. All other cotangents are zero in every step. Conservative: an equation's
      outputs depend on all its inputs.
    """
    jaxpr = traced.jaxpr
    deps: dict = {v: 1 << k for k, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        mask = 0
        for u in eqn.invars:
            if _is_var(u):
                mask |= deps.get(u, 0)
        if mask:
            for v in eqn.outvars:
                deps[v] = mask
    dep = lambda v: deps.get(v, 0) if _is_var(v) else 0
    from_ys = 0
    for v, live in zip(traced.y_out, live_y, strict=True):
        if live:
            from_ys |= dep(v)
    n_consts = len(traced.const_in)
    live = [bool(b) for b in live_final]
    while True:
        reach = from_ys
        for j, v in enumerate(traced.carry_out):
            if live[j]:
                reach |= dep(v)
        new = [live[i] or bool(reach >> (n_consts + i) & 1) for i in range(len(live))]
        if new == live:
            return live, [bool(reach >> k & 1) for k in range(len(jaxpr.invars))]
        live = new
