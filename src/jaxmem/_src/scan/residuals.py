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
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxmem._src import jax_compat as jc
from jaxmem._src.scan import compress as _compress
from jaxmem._src.scan import mincut as mincut
from jaxmem._src.scan import recompute_cost as _pricing
from jaxmem._src.scan.jaxprs import (
    _TIE,
    _is_cheap,
    _is_var,
    _nbytes,
    eval_inlined,
    iter_eqns,
    kept_bytes,
    needed_eqns,
    sub_jaxpr,
)
from jaxmem._src.scan.pins import pin_chooser_operands

# Where a residual comes from in the backward pass.
RESIDUAL_CLASSES = ("xs", "const", "carry", "ys", "recomputed", "stacked")


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
    step_fn = functools.partial(eval_inlined, body)  # calls inlined: finer cuts
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


def _graph(jaxpr, cheap: Callable, host: frozenset, size: Callable[[Any], int]):
    """Min-cut costs and ops of ``jaxpr``; a value in ``host`` (kept in host memory) costs no
    device bytes, only the unit that makes the cut prefer fewer values; ``size`` gives the bytes
    a value takes kept (:attr:`KeptSize.value`)."""
    cost = lambda v: 1 if v in host else size(v) * _TIE + 1
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
    size: KeptSize | None = None,
) -> Stores:
    """The cheapest stores over the candidate carry subsets (a kept carry costs its bytes; a
    value in ``host``, offloaded by name, no device bytes; ``size``: the bytes kept values
    take, :func:`kept_size`)."""
    size = kept_size(traced, None) if size is None else size
    targets = [v for v in traced.res_out if _is_var(v)]
    costs, ops = _graph(traced.jaxpr, cheap, host, size.value)
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
        cost += sum(size.carry(i) * _TIE for i in subset)
        if best is None or cost < best[0]:
            best = (cost, Stores(tuple(subset), stored, frozenset(free)))
    if best is None:
        raise AssertionError("jaxmem internal error: no store set makes the residuals available")
    return best[1]


# ------------------------------------------------------------------------------------------
# Step 5: classification, and the whole plan of one step.


@dataclasses.dataclass(frozen=True)
class SplitStep:
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
      enc_stacked: per partial activation, how it is stored (a
        :class:`jaxmem._src.scan.compress.Encoding`; format None without ``compress``).
      enc_carry: per kept carry sequence, how it is stored.
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
    enc_stacked: tuple
    enc_carry: tuple

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
    def rebuild_inputs(self) -> tuple[tuple[str, int], ...]:
        """The input groups of :attr:`rebuild`, in order: ``(name, number of inputs)``."""
        return (
            ("consts", len(self.const_invars)),
            ("hoisted", len(self.hoisted_vars)),
            ("x", len(self.x_invars)),
            ("ys_read", sum(self.need_y)),
            ("kept_carry_out", sum(self.carry_out_read)),
            ("kept_carry_in", sum(self.stack_carry)),
            ("carry_in_from_ys", len(self.carry_read_from_y)),
            ("stacked", len(self.stacked_vars)),
        )

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


def _in_program_order(jaxpr, variables) -> list:
    """``variables`` (a set) in the order ``jaxpr`` binds them: constants, inputs, then each
    equation's outputs."""
    order = itertools.chain(jaxpr.constvars, jaxpr.invars, *(e.outvars for e in jaxpr.eqns))
    return [v for v in order if v in variables]


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


def _sub_jaxpr(
    traced: TracedStep, in_groups: Sequence[Sequence], outs: Sequence, effects: bool = False
):
    """The closed jaxpr computing ``outs`` from the variables of ``in_groups`` (and J's consts);
    with ``effects``, the step's equations with effects too."""
    return sub_jaxpr(traced.jaxpr, traced.consts, _distinct_invars(in_groups), outs, effects)


def build_jaxprs(
    traced, hoisted, stacked, stack_carry, carry_out_read, carry_from_y, carry_in_read, need_y
):
    """The ``hoist``, ``forward`` and ``rebuild`` jaxprs of a plan (see :class:`SplitStep`)."""
    hoist = _sub_jaxpr(traced, [traced.const_in], hoisted)
    forward = _sub_jaxpr(
        traced,
        [traced.const_in, hoisted, traced.carry_in, traced.x_in],
        [*traced.carry_out, *traced.y_out, *stacked],
        effects=True,  # each effect of the step runs once a step, in the forward loop
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


def _priced_cut(
    traced: TracedStep, body, base_free: set, candidates, model=None, host=frozenset(), size=None
):
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
    # traffic of the bytes it saves, counted at full width (under compress, a kept value is
    # still read and written at full width by its encode and decode).
    never = lambda e: False
    most = _stored_bytes(traced, choose_stores(traced, base_free, candidates, never, host), host)
    for attempt in range(_MAX_PRICED_CUTS):
        stores = choose_stores(traced, base_free, candidates, cheap, host, size)
        recomputed = needed_eqns(traced.jaxpr.eqns, targets, stores.free | stores.stored)
        seconds = [_pricing.eqn_seconds(e, model) for e in recomputed]
        saved = _pricing.traffic_seconds(max(0, most - _stored_bytes(traced, stores, host)), model)
        if not recomputed or sum(seconds) - saved <= budget or attempt == _MAX_PRICED_CUTS - 1:
            break
        kept.add(id(recomputed[int(np.argmax(seconds))]))
    return cheap, stores


def _stored_bytes(
    traced: TracedStep, stores: Stores, host: frozenset = frozenset(), size=None
) -> int:
    """Device bytes a cut keeps per step: its stored values and kept carry leaves."""
    size = kept_size(traced, None) if size is None else size
    kept = sum(size.carry(i) for i in stores.kept_carry)
    return kept + sum(size.value(v) for v in stores.stored if v not in host)


@dataclasses.dataclass(frozen=True)
class KeptSize:
    """How a kept value is stored per step (:mod:`jaxmem._src.scan.compress`), and its bytes:
    ``encoding(v)`` / ``value(v)`` for a value of the step, ``carry_encoding(i)`` / ``carry(i)``
    for the carry sequence of carry leaf ``i``."""

    encoding: Callable[[Any], _compress.Encoding]
    carry_encoding: Callable[[int], _compress.Encoding]
    traced: TracedStep

    def value(self, v) -> int:
        enc = self.encoding(v)
        return kept_bytes(v.aval) if enc.format is None else enc.nbytes  # a mask: its bits

    def carry(self, i: int) -> int:
        enc = self.carry_encoding(i)
        return _nbytes(self.traced.carry_in[i].aval) if enc.format is None else enc.nbytes


def kept_size(traced: TracedStep, compress: str | None) -> KeptSize:
    """Kept values under ``compress``: a value the loop stacks is encoded; a y, and a carry
    sequence read from ys (its carry-in or its carry-out is a y), are read back as they are; a
    mask is kept as bits. The cut prices values by these sizes, so under ``"fp8"`` it may keep
    softmax's exponentials (1 byte an element) rather than the scores they are recomputed from
    (kept as bf16: they feed ``exp``)."""
    encoded = _compress.encoder(traced.jaxpr, compress)
    plain = _compress.encoder(traced.jaxpr, None)
    ys = {v for v in traced.y_out if _is_var(v)}

    def encoding(v) -> _compress.Encoding:
        return plain(v) if v in ys else encoded(v)

    def carry_encoding(i: int) -> _compress.Encoding:
        v, out = traced.carry_in[i], traced.carry_out[i]
        from_ys = v in ys or (_is_var(out) and out in ys)  # a carry-out may be a literal
        return plain(v) if from_ys else encoded(v)

    return KeptSize(encoding, carry_encoding, traced)


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


def _cut(traced, body, const_only, recompute: str, host_names, size) -> tuple[Stores, Callable]:
    """Step 1 of :func:`plan_step`: the min-cut of what the backward step keeps, and which
    equations it may recompute.

    A y the backward step reads is not copied, but it is not free either: reading it keeps its
    whole stack alive through the backward loop (lax.scan frees ys once the loss's backward has
    read them, and never computes ys the loss ignores). So the min-cut prices a y like any
    stored value, and a carry leaf whose carry-out is a y like any kept carry sequence; what it
    picks among the y outputs is then read from ys, not stacked again."""
    base_free = const_only | set(traced.x_in)
    candidates = carry_candidates(traced, [-1] * len(traced.carry_in))
    host = named_vars(traced.jaxpr, host_names) if host_names else frozenset()
    if recompute == "auto":
        cheap, stores = _priced_cut(traced, body, base_free, candidates, host=host, size=size)
    else:
        cheap = _is_cheap if recompute == "cheap" else (lambda eqn: False)
        stores = choose_stores(traced, base_free, candidates, cheap, host, size)
    return stores, cheap


def _backward_reads(traced, available, cheap) -> tuple[list, set]:
    """Step 2: the residuals the backward step needs, and every value it reads to rebuild them
    (each recompute cheap, from what is ``available``)."""
    targets = [v for v in traced.res_out if _is_var(v)]
    recompute_eqns = needed_eqns(traced.jaxpr.eqns, targets, available)
    assert all(cheap(e) for e in recompute_eqns)
    return targets, set(targets) | {u for e in recompute_eqns for u in e.invars if _is_var(u)}


def _ys_read(traced, read_by_bwd, available, const_only, from_y, carry_in_read) -> list[bool]:
    """Step 3: per y, whether the backward loop reads it back from ys.

    A y that is an input of the step (a pass-through: nnx.scan returns the layers' state) is
    read from that input, never from its ys stack. A y the cut did not keep is recomputed from
    what it kept, not read back: reading it would keep its whole stack alive, which the cut
    priced as not kept (a y the loss ignores: 1.06x lax.scan's temp where a leaky relu's output
    was read back beside the kept pre-activation its mask needs)."""
    inputs = {*traced.const_in, *traced.x_in}
    need_y = [
        _is_var(v)
        and v in read_by_bwd
        and v in available
        and v not in const_only
        and v not in inputs
        for v in traced.y_out
    ]
    for i, j in enumerate(from_y):
        if j >= 0 and carry_in_read[i]:
            need_y[j] = True
    return need_y


def plan_step(
    body,
    n_consts: int,
    n_carry: int,
    in_avals: Sequence,
    recompute: str,
    host_names: frozenset = frozenset(),
    compress: str | None = None,
) -> SplitStep:
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
      A :class:`SplitStep`.
    """
    traced = trace_step_vjp(body, n_consts, n_carry, in_avals)
    const_only = loop_invariants(traced)
    y_vars = {v for v in traced.y_out if _is_var(v)}
    size = kept_size(traced, compress)
    stores, cheap = _cut(traced, body, const_only, recompute, host_names, size)
    # Kept carry leaves whose carry-out is a y are read from ys (shifted), not stacked.
    from_y = [j if i in stores.kept_carry else -1 for i, j in enumerate(carry_from_ys(traced))]
    available = stores.free | stores.stored
    targets, read_by_bwd = _backward_reads(traced, available, cheap)
    eqn_outs = {v for e in traced.jaxpr.eqns for v in e.outvars}
    # The cut's sets in program order: the loop's stacks, and so the compiled program, are the
    # same in every process (a set of variables iterates in the order of their ids).
    stored = _in_program_order(traced.jaxpr, stores.stored)
    hoisted = tuple(
        v
        for v in dict.fromkeys(
            itertools.chain(targets, stored, _in_program_order(traced.jaxpr, read_by_bwd))
        )
        if v in const_only and v in eqn_outs and v in available
    )
    stacked = tuple(v for v in stored if v not in const_only and v not in y_vars)
    stack_carry = tuple(i in stores.kept_carry and from_y[i] < 0 for i in range(n_carry))
    carry_seq_y = tuple(
        traced.y_out.index(v) if stack_carry[i] and v in y_vars else -1
        for i, v in enumerate(traced.carry_in)
    )
    carry_in_read = tuple(v in read_by_bwd for v in traced.carry_in)
    need_y = _ys_read(traced, read_by_bwd, available, const_only, from_y, carry_in_read)
    need_y = tuple(n or j in carry_seq_y for j, n in enumerate(need_y))
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
    return SplitStep(
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
        enc_stacked=tuple(size.encoding(v) for v in stacked),
        enc_carry=tuple(size.carry_encoding(i) for i, keep in enumerate(stack_carry) if keep),
    )


# ------------------------------------------------------------------------------------------
# The public view of a plan.
