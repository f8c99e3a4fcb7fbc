"""Residual analysis of one scan step: what its VJP saves, and where each value can come from.

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

Which values to stack is a minimum cut: every residual must be reachable from stored values
through cheap equations only, and the bytes stored per step are minimised (a max-flow / min-cut
over the step's dataflow graph, with each variable split into an in- and an out-node whose edge
costs the variable's size). Whether to keep each carry leaf's sequence is decided on top of it, by
trying the subsets of carry leaves that some residual could use.

References:
  torch_xla scan "partial activations" (only non-aliased residuals are returned by the forward).
  Jain et al., Checkmate (2020) and the functorch min-cut rematerialization partitioner, for the
  min-cut formulation of what to save.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core, source_info_util

# Primitives whose recomputation in the backward step is cheap: elementwise arithmetic and
# transcendental functions, comparisons and selects, type conversions and pure data movement
# (and device_put *to device*, see _is_cheap: re-fetching a host-resident slice beats stacking a
# device copy of it, while a copy *to host* is what an offloading policy wants stored).
# Not here on purpose: dot_general, conv, reductions, cumulative ops, sort, gather/scatter,
# random number generation, control flow.
CHEAP_PRIMITIVES: frozenset[str] = frozenset(
    """
    abs acos acosh add and asin asinh atan atan2 atanh bitcast_convert_type broadcast_in_dim cbrt
    ceil clamp complex concatenate conj convert_element_type copy copy_p cos cosh div
    dynamic_slice eq erf erf_inv erfc exp exp2 expand_dims expm1 floor ge gt imag integer_pow
    iota is_finite le log log1p logistic lt max min mul name ne neg nextafter not or pad
    population_count pow real reduce_precision rem reshape rev round rsqrt select_n
    shift_left shift_right_arithmetic shift_right_logical sign sin sinh slice split sqrt square
    squeeze sub tan tanh transpose xor
    """.split()
)

# Where a residual comes from in the backward pass.
RESIDUAL_CLASSES = ("xs", "const", "carry", "ys", "recomputed", "stacked")


def _nbytes(aval) -> int:
    if not hasattr(aval, "shape"):
        return 0
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):  # e.g. typed PRNG keys
        aval = core.physical_aval(aval)
    dtype = np.dtype(aval.dtype)
    if dtype == jax.dtypes.float0:
        return 0
    return int(np.prod(aval.shape, dtype=np.int64)) * dtype.itemsize


# Costs are bytes scaled by _TIE plus one per stored value: among cuts of equal bytes, the one
# storing fewer values (hence recomputing less) wins.
_TIE = 1 << 12


def _cost(aval) -> int:
    return _nbytes(aval) * _TIE + 1


def _is_cheap(eqn) -> bool:
    name = eqn.primitive.name
    if name in CHEAP_PRIMITIVES:
        return True
    if name == "device_put":
        return all(
            getattr(v.aval, "memory_space", None) != core.MemorySpace.Host for v in eqn.outvars
        )
    if name in ("jit", "pjit", "closed_call", "core_call"):
        inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
        inner = getattr(inner, "jaxpr", inner)
        return inner is not None and all(_is_cheap(e) for e in inner.eqns)
    return False


def _is_var(v) -> bool:
    return isinstance(v, core.Var)


@dataclasses.dataclass
class StepAnalysis:
    """The plan for one scan step (internal).

    Attributes:
      jaxpr: the forward-with-residuals jaxpr ``J``: inputs ``(*consts, *carry, *x)``, outputs
        ``(*carry_out, *y, *residuals)``.
      jaxpr_consts: values of ``J``'s constvars (concrete arrays).
      n_consts, n_carry, n_x, n_y, n_res: the sizes of the groups above.
      res_treedef: tree structure of the VJP function; its leaves are the residuals.
      res_classes: one of RESIDUAL_CLASSES per residual.
      stacked_vars: the partial activations: variables of ``J`` emitted per step.
      hoisted_vars: variables computed from constants only that the backward step reads.
      stack_carry: per carry leaf, whether the carry sequence of that leaf is kept.
      carry_from_y: per carry leaf, the index of a y output that *is* its carry-out (so the carry
        sequence is read from ys, shifted by one step, and init), or -1.
      carry_in_read: per carry leaf, whether the backward step reads its carry-in.
      need_y: per y leaf, whether the backward step reads it.
      recompute_eqns: the equations of ``J`` the backward step evaluates, in order.
    """

    jaxpr: Any
    jaxpr_consts: list
    n_consts: int
    n_carry: int
    n_x: int
    n_y: int
    n_res: int
    res_treedef: Any
    res_classes: list[str]
    stacked_vars: list
    hoisted_vars: list
    stack_carry: list[bool]
    carry_from_y: list[int]
    carry_in_read: list[bool]
    need_y: list[bool]
    recompute_eqns: list

    # --- variable groups of J --------------------------------------------------------------
    @property
    def const_invars(self):
        return self.jaxpr.invars[: self.n_consts]

    @property
    def carry_invars(self):
        return self.jaxpr.invars[self.n_consts : self.n_consts + self.n_carry]

    @property
    def x_invars(self):
        return self.jaxpr.invars[self.n_consts + self.n_carry :]

    @property
    def carry_outvars(self):
        return self.jaxpr.outvars[: self.n_carry]

    @property
    def y_outvars(self):
        return self.jaxpr.outvars[self.n_carry : self.n_carry + self.n_y]

    @property
    def res_outvars(self):
        return self.jaxpr.outvars[self.n_carry + self.n_y :]


def iter_eqns(jaxpr):
    """Yields the equations of ``jaxpr`` and, recursively, of the jaxprs in their parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, core.ClosedJaxpr):
                    yield from iter_eqns(sub.jaxpr)
                elif isinstance(sub, core.Jaxpr):
                    yield from iter_eqns(sub)


def eval_eqns(eqns, env: dict) -> None:
    """Evaluates ``eqns`` in order, reading and writing ``env`` (as :func:`jax.core.eval_jaxpr`)."""

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for eqn in eqns:
        bind_params = eqn.primitive.get_bind_params(eqn.params)
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with (
            source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
            eqn.ctx.manager,
        ):
            ans = eqn.primitive.bind(*map(read, eqn.invars), **bind_params)
        if eqn.primitive.multiple_results:
            env.update(zip(eqn.outvars, ans, strict=True))
        else:
            env[eqn.outvars[0]] = ans


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
# Max-flow / min-cut. Graphs here have a few thousand nodes at most.


class _FlowGraph:
    def __init__(self):
        self.adj: list[list[int]] = []
        self.to: list[int] = []
        self.cap: list[int] = []

    def node(self) -> int:
        self.adj.append([])
        return len(self.adj) - 1

    def edge(self, u: int, v: int, c: int) -> None:
        self.adj[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(c)
        self.adj[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0)

    def max_flow(self, s: int, t: int) -> int:
        """Edmonds-Karp: shortest augmenting paths, iterative (no recursion limit)."""
        flow = 0
        n = len(self.adj)
        while True:
            parent_edge = [-1] * n
            parent_edge[s] = -2
            q = collections.deque([s])
            while q and parent_edge[t] == -1:
                u = q.popleft()
                for e in self.adj[u]:
                    v = self.to[e]
                    if self.cap[e] > 0 and parent_edge[v] == -1:
                        parent_edge[v] = e
                        q.append(v)
            if parent_edge[t] == -1:
                return flow
            bottleneck, v = None, t
            while v != s:
                e = parent_edge[v]
                bottleneck = self.cap[e] if bottleneck is None else min(bottleneck, self.cap[e])
                v = self.to[e ^ 1]
            v = t
            while v != s:
                e = parent_edge[v]
                self.cap[e] -= bottleneck
                self.cap[e ^ 1] += bottleneck
                v = self.to[e ^ 1]
            flow += bottleneck

    def source_side(self, s: int) -> set[int]:
        seen = {s}
        q = collections.deque([s])
        while q:
            u = q.popleft()
            for e in self.adj[u]:
                if self.cap[e] > 0 and self.to[e] not in seen:
                    seen.add(self.to[e])
                    q.append(self.to[e])
        return seen


def _min_cut(jaxpr, free: set, unavailable: set, targets: list, cheap: Callable) -> tuple[int, set]:
    """Cheapest set of variables to store so that ``targets`` are recomputable (see module doc).

    Returns (bytes per step, set of stored variables). Free variables cost nothing; unavailable
    ones cannot be stored; targets that are neither must be stored or recomputed through cheap
    equations from stored or free variables.
    """
    g = _FlowGraph()
    src, sink = g.node(), g.node()
    total = sum(_nbytes(v.aval) for e in jaxpr.eqns for v in e.outvars) + sum(
        _nbytes(v.aval) for v in itertools.chain(jaxpr.invars, jaxpr.constvars)
    )
    inf = 4 * _TIE * (total + len(jaxpr.eqns) + len(jaxpr.invars)) + 1
    nodes: dict[Any, tuple[int, int]] = {}

    def var_nodes(v):
        if v not in nodes:
            nodes[v] = (g.node(), g.node())
        return nodes[v]

    for v in itertools.chain(jaxpr.constvars, jaxpr.invars):
        vin, vout = var_nodes(v)
        if v in unavailable and v not in free:
            g.edge(src, vout, inf)
    for eqn in jaxpr.eqns:
        is_cheap = cheap(eqn)
        for v in eqn.outvars:
            vin, vout = var_nodes(v)
            if v in free:
                continue
            g.edge(vin, vout, _cost(v.aval))
            if is_cheap:
                for u in eqn.invars:
                    if _is_var(u):
                        g.edge(var_nodes(u)[1], vin, inf)
            else:
                g.edge(src, vin, inf)
    for v in targets:
        if _is_var(v):
            g.edge(var_nodes(v)[1], sink, inf)
    cost = g.max_flow(src, sink)
    if cost >= inf:
        return cost, set()
    side = g.source_side(src)
    stored = {v for v, (vin, vout) in nodes.items() if vin in side and vout not in side}
    return cost, stored


def analyze_step(
    body_jaxpr: core.ClosedJaxpr,
    n_consts: int,
    n_carry: int,
    const_avals: Sequence,
    carry_avals: Sequence,
    x_avals: Sequence,
    recompute: str,
) -> StepAnalysis:
    """Traces the VJP of one step and plans where each residual comes from.

    Args:
      body_jaxpr: closed jaxpr of the step: inputs ``(*consts, *carry, *x)``, outputs
        ``(*carry_out, *y)``.
      n_consts: number of constant inputs.
      n_carry: number of carry leaves.
      const_avals, carry_avals, x_avals: abstract values of the inputs.
      recompute: ``"cheap"`` or ``"none"``.

    Returns:
      A :class:`StepAnalysis`.
    """
    n_out = len(body_jaxpr.jaxpr.outvars)
    n_y = n_out - n_carry
    treedef_box = []

    def step(consts, carry, x):
        outs = core.eval_jaxpr(body_jaxpr.jaxpr, body_jaxpr.consts, *consts, *carry, *x)
        return outs[:n_carry], outs[n_carry:]

    def fwd_step(consts, carry, x):
        (c_out, y), vjp_fn = jax.vjp(step, consts, carry, x)
        res, treedef = jax.tree_util.tree_flatten(vjp_fn)
        treedef_box.append(treedef)
        return c_out, y, res

    structs = [
        [
            jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
            for a in g
        ]
        for g in (const_avals, carry_avals, x_avals)
    ]
    closed = jax.make_jaxpr(fwd_step)(*structs)
    jaxpr = closed.jaxpr
    n_x = len(x_avals)
    n_res = len(jaxpr.outvars) - n_carry - n_y
    consts_in = jaxpr.invars[:n_consts]
    carry_in = jaxpr.invars[n_consts : n_consts + n_carry]
    x_in = jaxpr.invars[n_consts + n_carry :]
    carry_out = jaxpr.outvars[:n_carry]
    y_out = jaxpr.outvars[n_carry : n_carry + n_y]
    res_out = jaxpr.outvars[n_carry + n_y :]

    # Loop invariants: variables computed from constants only (JAX hoists these out of the loop).
    const_only = set(jaxpr.constvars) | set(consts_in)
    for eqn in jaxpr.eqns:
        if eqn.effects:
            continue
        if all((not _is_var(u)) or u in const_only for u in eqn.invars):
            const_only.update(eqn.outvars)

    base_free = const_only | set(x_in) | {v for v in y_out if _is_var(v)}
    # A carry leaf whose carry-out is a y output: its whole sequence is ys (shifted) plus init.
    carry_from_y = [
        y_out.index(carry_out[i]) if _is_var(carry_out[i]) and carry_out[i] in y_out else -1
        for i in range(n_carry)
    ]
    base_free |= {carry_in[i] for i in range(n_carry) if carry_from_y[i] >= 0}
    cheap = _is_cheap if recompute == "cheap" else (lambda eqn: False)
    targets = [v for v in res_out if _is_var(v)]

    # Carry leaves some residual could read (directly or through cheap recomputation).
    def free_with(leaves):
        free = set(base_free)
        for i in leaves:
            free.add(carry_in[i])
            if _is_var(carry_out[i]):
                free.add(carry_out[i])
        return free

    carry_unavailable = set(carry_in)
    candidates = [
        i for i in range(n_carry) if _nbytes(carry_in[i].aval) > 0 and carry_from_y[i] < 0
    ]
    best = None
    if len(candidates) <= 6:
        subsets = itertools.chain.from_iterable(
            itertools.combinations(candidates, k) for k in range(len(candidates) + 1)
        )
    else:  # Too many to try them all: none, all, and all-but-one.
        subsets = [(), tuple(candidates)] + [
            tuple(c for c in candidates if c != i) for i in candidates
        ]
    for subset in subsets:
        free = free_with(subset)
        cost, stored = _min_cut(jaxpr, free, carry_unavailable - free, targets, cheap)
        # A kept carry sequence costs its bytes and wins ties against other single values:
        # it serves both the carry-in and the carry-out, and is what offload="carries" moves.
        cost += sum(_nbytes(carry_in[i].aval) * _TIE for i in subset)
        if best is None or cost < best[0]:
            best = (cost, subset, stored, free)
    _, subset, stored, free = best
    stack_carry = [i in subset for i in range(n_carry)]

    # Plan the backward step: what it evaluates, and from what.
    available = free | stored
    recompute_eqns = needed_eqns(jaxpr.eqns, targets, available)
    for eqn in recompute_eqns:
        assert cheap(eqn), eqn
    read_by_bwd = set(targets) | {u for e in recompute_eqns for u in e.invars if _is_var(u)}
    eqn_outs = {v for e in jaxpr.eqns for v in e.outvars}
    hoisted = [
        v
        for v in dict.fromkeys(itertools.chain(targets, stored, read_by_bwd))
        if v in const_only and v in eqn_outs and v in available
    ]
    stored_per_step = [v for v in dict.fromkeys(stored) if v not in const_only]
    y_set = {v for v in y_out if _is_var(v)}
    carry_in_read = [carry_in[i] in read_by_bwd for i in range(n_carry)]
    need_y = [_is_var(v) and v in read_by_bwd and v not in const_only for v in y_out]
    for i, j in enumerate(carry_from_y):
        if j >= 0 and carry_in_read[i]:
            need_y[j] = True
    carry_set = (
        {carry_in[i] for i in subset}
        | {carry_out[i] for i in subset if _is_var(carry_out[i])}
        | {carry_in[i] for i in range(n_carry) if carry_from_y[i] >= 0}
    )
    stored_set = set(stored_per_step)
    consts_set = set(consts_in) | set(jaxpr.constvars)

    classes = []
    for v in res_out:
        if not _is_var(v) or v in const_only:
            classes.append("const")
        elif v in set(x_in):
            classes.append("xs")
        elif v in stored_set:
            classes.append("stacked")
        elif v in carry_set:
            classes.append("carry")
        elif v in y_set:
            classes.append("ys")
        else:
            classes.append("recomputed")
    del consts_set
    return StepAnalysis(
        jaxpr=jaxpr,
        jaxpr_consts=list(closed.consts),
        n_consts=n_consts,
        n_carry=n_carry,
        n_x=n_x,
        n_y=n_y,
        n_res=n_res,
        res_treedef=treedef_box[-1],
        res_classes=classes,
        stacked_vars=stored_per_step,
        hoisted_vars=hoisted,
        stack_carry=stack_carry,
        carry_from_y=carry_from_y,
        carry_in_read=carry_in_read,
        need_y=need_y,
        recompute_eqns=recompute_eqns,
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
      kind: one of ``"xs"``, ``"const"``, ``"carry"``, ``"ys"``, ``"recomputed"``, ``"stacked"``.
      source: ``file:line (function)`` of the operation that produced it, or the input it is.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> plan = jaxmem.scan_residuals(lambda c, x: (jnp.sin(c) * x, None), jnp.ones(3),
      ...                              jnp.ones((5, 3)))
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

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> plan = jaxmem.scan_residuals(lambda c, x: (jnp.sin(c) * x, None), jnp.ones(3),
      ...                              jnp.ones((5, 3)))
      >>> plan.stacked_bytes, plan.stock_stacked_bytes, plan.ratio  # carry sequence vs 2 stacks
      (60, 120, 0.5)
      >>> plan.counts()["recomputed"], [r.kind for r in plan.stacked]
      (2, ['carry'])
    """

    length: int
    residuals: tuple[PlannedResidual, ...]
    stacked: tuple[PlannedResidual, ...]
    stacked_bytes: int
    stock_stacked_bytes: int | None

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
            "counts": self.counts(),
        }

    def __str__(self) -> str:
        def row(r):
            return f"  {r.dtype}{list(r.shape)!s:<18} {r.bytes:>12,d} B  {r.kind:<10} {r.source}"

        lines = [f"scan plan: {self.length} steps, {len(self.residuals)} residuals per step"]
        lines += [row(r) for r in self.residuals]
        lines.append("kept per step (partial activations, carry sequences, ys read back):")
        lines += [row(r) for r in self.stacked] or ["  (nothing)"]
        stock = (
            "not measured"
            if self.stock_stacked_bytes is None
            else f"{self.stock_stacked_bytes:,d} B"
        )
        ratio = "" if self.ratio is None else f" ({self.ratio:.2f}x)"
        lines.append(f"stacked over the scan: {self.stacked_bytes:,d} B{ratio}; lax.scan: {stock}")
        return "\n".join(lines)


def _var_source(eqn_of, v, role: str) -> str:
    eqn = eqn_of.get(v)
    if eqn is None:
        return role
    return source_info_util.summarize(eqn.source_info)


def summarize(plan: StepAnalysis, length: int, stock_stacked_bytes: int | None) -> ScanPlan:
    """The public :class:`ScanPlan` of an analysed step."""
    jaxpr = plan.jaxpr
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
            bytes=_nbytes(aval),
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
            for v, keep in zip(plan.carry_invars, plan.stack_carry, strict=True)
            if keep
        )
        + tuple(
            planned(v, "ys") for v, need in zip(plan.y_outvars, plan.need_y, strict=True) if need
        )
    )
    per_step = sum(r.bytes for r in stacked)
    return ScanPlan(
        length=length,
        residuals=residuals,
        stacked=stacked,
        stacked_bytes=per_step * length,
        stock_stacked_bytes=stock_stacked_bytes,
    )
