"""``jaxmem.scan``: a drop-in for :func:`jax.lax.scan` whose VJP stacks only partial activations.

Data flow (see ``docs/design.md`` §2):

1. The body is traced once to a jaxpr; closed-over traced values (parameters of an outer
   ``jit``/``grad``/``vmap``) become explicit inputs, so they get gradients.
2. :func:`jaxmem._src.scan.residuals.plan_step` traces the step's VJP and decides, for each
   residual, whether the backward step reads it from an xs slice, a constant, the carry sequence,
   a ys output, recomputes it cheaply, or needs it stacked (a *partial activation*).
3. Forward: a :func:`jax.lax.scan` that emits ys, the partial activations and, for the carry
   leaves some residual needs, the carry sequence (once).
4. Backward: a reverse :func:`jax.lax.scan` that rebuilds each step's residuals and applies the
   step's VJP; constant cotangents accumulate in its carry.

Forward-mode differentiation (``jvp``, ``jacfwd``, ``linearize``) cannot pass through a custom
VJP: :func:`scan` raises :class:`ForwardModeError` and names :func:`jax.lax.scan` as the way out.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.tree_util import keystr, tree_flatten, tree_unflatten

from jaxmem._src import checks
from jaxmem._src import jax_compat as _jc
from jaxmem._src import listing as _listing
from jaxmem._src.remat import auto as _auto
from jaxmem._src.scan import options as _opts
from jaxmem._src.scan import residuals as _res
from jaxmem._src.scan import schedule as _schedule
from jaxmem._src.scan.residuals import ScanPlan


class ForwardModeError(TypeError):
    """Raised when forward-mode AD (``jax.jvp``, ``jax.jacfwd``) meets :func:`jaxmem.scan`."""


_FORWARD_MODE_MESSAGE = (
    "jaxmem.scan supports reverse-mode differentiation only (jax.grad, jax.vjp, jax.jacrev, and "
    "jax.hessian, whose reverse pass comes first): its memory savings come from a custom VJP, and "
    "JAX cannot apply forward-mode autodiff (jax.jvp, jax.jacfwd, jax.linearize) to a custom VJP. "
    "Use jax.lax.scan where you need forward mode."
)


# ------------------------------------------------------------------------------------------
# Input checks (before any tracing), with path-aware messages.


def _aval(x) -> _jc.ShapedArray:
    """The type of ``x``: shape, dtype, weak type, sharding and varying manual axes."""
    return jax.typeof(x)


# ------------------------------------------------------------------------------------------
# Tracing the body.


class _Body:
    """The traced body: a jaxpr with inputs ``(*traced_consts, *carry, *x)``."""

    def __init__(self, jaxpr, consts: list, n_carry: int, carry_tree, y_tree):
        self.jaxpr = jaxpr
        self.consts = consts
        self.n_carry = n_carry
        self.carry_tree = carry_tree
        self.y_tree = y_tree

    def __call__(self, consts, carry, x):
        outs = _jc.jaxpr_as_fun(self.jaxpr)(*consts, *carry, *x)
        return list(outs[: self.n_carry]), list(outs[self.n_carry :])


def _trace_body(
    f, fname, init_tree, init_paths, carry_avals, xs_tree, x_avals, diff_consts=False
) -> _Body:
    n_carry = len(carry_avals)
    out_trees = []

    def flat_body(carry_leaves, x_leaves):
        carry = tree_unflatten(init_tree, carry_leaves)
        x = tree_unflatten(xs_tree, x_leaves)
        out = f(carry, x)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"{fname} body must return a pair (carry, y), got {checks.describe(out)}."
            )
        new_carry, y = out
        new_leaves, new_tree = tree_flatten(new_carry)
        y_paths, y_leaves, y_tree = _opts.check_leaves(y, "y", f"{fname} body output")
        if new_tree != init_tree:
            raise TypeError(
                f"{fname} body changed the carry's tree structure: init is {init_tree} but "
                f"the body returned {new_tree}. Return a carry with the same structure as init."
            )
        out_trees.append(y_tree)
        return new_leaves + y_leaves

    closed = jax.make_jaxpr(flat_body)(
        [_jc.struct(a) for a in carry_avals], [_jc.struct(a) for a in x_avals]
    )
    jaxpr = _jc.open_jaxpr(closed)
    consts = _jc.jaxpr_consts(closed)
    # Traced constants (tracers of an outer transformation) become explicit inputs, so they get
    # cotangents; concrete constants stay constants.
    # With diff_consts, concrete float constants count as traced too (as parameters would be).
    is_traced = [
        isinstance(c, _jc.Tracer)
        or (diff_consts and jnp.issubdtype(jnp.result_type(c), jnp.inexact))
        for c in consts
    ]
    traced_vars = [v for v, t in zip(jaxpr.constvars, is_traced, strict=True) if t]
    traced_vals = [c for c, t in zip(consts, is_traced, strict=True) if t]
    kept_vars = [v for v, t in zip(jaxpr.constvars, is_traced, strict=True) if not t]
    kept_vals = [c for c, t in zip(consts, is_traced, strict=True) if not t]
    jaxpr = _jc.make_jaxpr(jaxpr, constvars=kept_vars, invars=traced_vars + list(jaxpr.invars))
    body = _Body(_jc.closed_jaxpr(jaxpr, kept_vals), traced_vals, n_carry, init_tree, out_trees[-1])
    out_avals = [v.aval for v in jaxpr.outvars[:n_carry]]
    return body, out_avals


def _prepare(f, init, xs, length, unroll, recompute, fname, diff_consts=False):
    """Checks the arguments and traces the body (promoting weak-typed init leaves once)."""
    checks.check_callable(f, "the body f(carry, x)", fname)
    recompute = _opts.check_recompute(recompute, fname)
    unroll = _opts.check_unroll(unroll, fname)
    init_paths, init_leaves, init_tree = _opts.check_leaves(init, "init", fname)
    xs_paths, xs_leaves, xs_tree = _opts.check_leaves(xs, "xs", fname)
    length = _opts.infer_length(xs_paths, xs_leaves, length, fname)
    init_leaves = [x if isinstance(x, _jc.Tracer) else jnp.asarray(x) for x in init_leaves]
    xs_leaves = [x if isinstance(x, _jc.Tracer) else jnp.asarray(x) for x in xs_leaves]
    carry_avals = [_aval(x) for x in init_leaves]
    x_avals = [_jc.unstacked(_aval(x), length) for x in xs_leaves]
    body, out_avals = _trace_body(
        f, fname, init_tree, init_paths, carry_avals, xs_tree, x_avals, diff_consts
    )
    changed = False
    for i, (a_in, a_out) in enumerate(zip(carry_avals, out_avals, strict=True)):
        if a_in.weak_type and not _jc.typematch(a_in, a_out):
            init_leaves[i] = jax.lax.convert_element_type(
                init_leaves[i], jax.dtypes.result_type(init_leaves[i], a_out)
            )
            changed = True
    if changed:
        carry_avals = [_aval(x) for x in init_leaves]
        body, out_avals = _trace_body(
            f, fname, init_tree, init_paths, carry_avals, xs_tree, x_avals, diff_consts
        )
    for path, a_in, a_out in zip(init_paths, carry_avals, out_avals, strict=True):
        if not _jc.typematch(a_in, a_out):
            raise TypeError(
                f"{fname} body changed the type of the carry: init{keystr(path)} is "
                f"{a_in.str_short()} but the body returned {a_out.str_short()} for it. The "
                "carry must keep its shape and dtype across steps (cast it, or fix init)."
            )
    return body, init_leaves, xs_leaves, xs_tree, length, unroll, recompute


# ------------------------------------------------------------------------------------------
# The custom VJP.


def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _zeros_ct(aval, length=None):
    """A zero cotangent for a primal of type ``aval`` (stacked ``length`` times when given):
    its sharding and varying manual axes kept; float0 for integer and boolean values."""
    if length is not None:
        aval = _jc.stacked(aval, length)
    if _is_float(aval):
        return _jc.zeros(aval)
    return np.zeros(aval.shape, jax.dtypes.float0)


def _with_zeros(avals, indices, values, length=None, zero=None):
    """Cotangents for every primal of ``avals``: ``values`` at ``indices``, zeros elsewhere.

    The zeros are ``zero(aval)`` when given (e.g. symbolic zeros for the step's VJP), else
    arrays (stacked ``length`` times when given).
    """
    out = [_zeros_ct(a, length) if zero is None else zero(a) for a in avals]
    for i, value in zip(indices, values, strict=True):
        out[i] = value
    return out


class _Live(NamedTuple):
    """Indices of the cotangents that can be nonzero: float and live (the others are zero in
    every step, docs/design.md §2, step 5)."""

    consts: list
    carry: list
    x: list
    y: list


def _live(traced, avals, ct_final, ct_ys) -> _Live:
    """Which cotangents of a scan's backward loop can be nonzero, given the loss's.

    ``avals``: (consts, carry, x, y) types of the step. Zero in every step: the ys and final carry
    leaves the loss ignores (symbolic zeros), carry leaves that reach no output with a nonzero
    cotangent, and the inputs that reach none. The step's VJP gets symbolic zeros for them, so
    what only their paths read (the carry sequence of a carry the loss never sees, say) is never
    read and XLA drops it, as lax.scan's DCE does; the loop neither carries nor emits their
    cotangents (zeros are returned, made outside the loop).
    """
    const_avals, carry_avals, x_avals, y_avals = avals
    is_zero = lambda ct: isinstance(ct, SymbolicZero)
    live_carry, live_in = _res.live_cotangents(
        traced,
        [_is_float(a) and not is_zero(ct) for a, ct in zip(carry_avals, ct_final, strict=True)],
        [_is_float(a) and not is_zero(ct) for a, ct in zip(y_avals, ct_ys, strict=True)],
    )
    n_in = len(const_avals) + len(carry_avals)
    return _Live(
        consts=[i for i, a in enumerate(const_avals) if _is_float(a) and live_in[i]],
        carry=[i for i, a in enumerate(carry_avals) if _is_float(a) and live_carry[i]],
        x=[i for i, a in enumerate(x_avals) if _is_float(a) and live_in[n_in + i]],
        y=[i for i, a in enumerate(y_avals) if _is_float(a) and not is_zero(ct_ys[i])],
    )


def _input_cotangents(avals, live: _Live, values, length: int, spaces):
    """The custom VJP's result: cotangents of (consts, init, xs), zeros where not live; those of
    inputs in host memory (``spaces``) put there."""
    const_avals, carry_avals, x_avals, _ = avals
    ct_consts, ct_init, ct_xs = values
    cts = (
        _with_zeros(const_avals, live.consts, ct_consts),
        _with_zeros(carry_avals, live.carry, ct_init),
        _with_zeros(x_avals, live.x, ct_xs, length),
    )
    spaces = iter(spaces or [])
    return tuple(
        [
            _to_host(ct)
            if next(spaces, None) == jax.memory.Space.Host and ct.dtype != jax.dtypes.float0
            else ct
            for ct in group
        ]
        for group in cts
    )


def _has_remat(jaxpr) -> bool:
    """Whether ``jaxpr`` runs a ``jax.checkpoint`` (its primitive is "remat2" on 0.10 and 0.12)."""
    return any(e.primitive.name == "remat2" for e in _res.iter_eqns(jaxpr))


def _pin_invariants(treedef, res: list, at: list, cts, ct_carry) -> list:
    """``res`` with its loop-invariant residuals ``res[at]`` passed through a barrier with the
    loop-carried cotangent, where the backward step would compute more bytes from them alone
    than they hold: what a remat recomputes from them (a table of sines from positions) then
    stays in the loop, as jax.checkpoint's ``prevent_cse`` keeps it there, where XLA would hoist
    it out of the loop and keep it alive all along. Where it would not, the barrier would only
    copy the residuals into every step, and ``res`` is returned as it is."""
    backward = jax.make_jaxpr(lambda r: tree_unflatten(treedef, r)(cts))(res)
    jaxpr = _jc.open_jaxpr(backward)
    invariant = [i in at for i in range(len(res))]
    own = sum(_jc.nbytes(res[i].aval) for i in at)
    if _res.invariant_bytes(jaxpr, invariant) <= own:
        return res
    pinned, _ = jax.lax.optimization_barrier(([res[i] for i in at], ct_carry))
    for i, v in zip(at, pinned, strict=True):
        res[i] = v
    return res


def _pack(mask):
    """A boolean mask kept as bits: 8 elements of the last axis to a byte (``uint8``)."""
    return jnp.packbits(mask, axis=-1)


def _unpack(bits, n: int):
    """The mask :func:`_pack` packed, its last axis ``n`` long."""
    return jnp.unpackbits(bits, axis=-1, count=n).astype(jnp.bool_)


def _to_host(x):
    return jax.device_put(x, jax.memory.Space.Host)


def _to_device(x):
    return jax.device_put(x, jax.memory.Space.Device)


def _offload_masks(plan, offload, fname: str):
    """Which stacked values and which kept carry sequences live in host memory."""
    n_kept = sum(plan.stack_carry)
    if offload is None:
        return [False] * len(plan.stacked_vars), [False] * n_kept
    if offload == "residuals":
        return [True] * len(plan.stacked_vars), [False] * n_kept
    if offload == "carries":
        return [False] * len(plan.stacked_vars), [True] * n_kept
    if offload == "all":
        return [True] * len(plan.stacked_vars), [True] * n_kept
    # Names: a value is named n when it is the input or the output of checkpoint_name(., n).
    found = {_jc.eqn_checkpoint_name(e) for e in _res.iter_eqns(plan.traced.jaxpr)} - {None}
    missing = sorted(set(offload) - found)
    if missing:
        raise ValueError(
            f"{fname} got offload names {missing} that name no value of the step; the step's "
            f"names are {sorted(found)}. Name values with jaxmem.name(x, name)."
        )
    named = _res.named_vars(plan.traced.jaxpr, frozenset(offload))
    mask = [v in named for v in plan.stacked_vars]
    return mask, [False] * n_kept


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A step's plan and where its stacks live: what the custom VJP's rules read."""

    step: _res.StepPlan
    offload_stacked: tuple[bool, ...]  # per partial activation: kept in host memory
    offload_carry: tuple[bool, ...]  # per kept carry sequence: kept in host memory
    packed: tuple[int | None, ...]  # per partial activation: a mask kept as bits (its length)


class _Saved(NamedTuple):
    """What the forward pass keeps for the backward pass (the custom VJP's residuals)."""

    consts: list
    hoisted: list
    xs: list
    ys_read: list  # the ys the backward pass reads
    stacked: list  # the partial activations, one stack each
    carry_seq: list  # the kept carry sequences (carry-in of every step)
    final_kept: list  # the final carry of the kept leaves (carry-out of the last step)
    init_from_y: list  # init of the carry leaves read from ys


def _loop_unroll(length: int, unroll):
    """The unroll factor of :func:`scan`'s forward and backward loops: ``unroll`` where it
    divides ``length`` (or unrolls it whole), the whole length where ``unroll`` covers more than
    half of it, else the largest divisor of ``length`` below ``unroll``.

    ``lax.scan`` runs ``length % unroll`` remainder steps after the unrolled loop by slicing each
    scanned input in two and concatenating each output: a copy of every stack the forward loop
    emits and the backward loop reads (1.12x lax.scan's temp at T=21, unroll=2). Unrolling is a
    speed hint with the same results, so the loops unroll by a divisor instead.
    """
    u = int(unroll)
    if isinstance(unroll, bool) or u <= 1 or length <= u or length % u == 0:
        return unroll
    if 2 * u > length:  # One unrolled trip and the rest: unroll it whole instead.
        return length
    return max(d for d in range(1, u) if length % d == 0)


def _scan_loop(f, init, xs, length: int, reverse: bool, unroll):
    """``jax.lax.scan`` with the unroll of :func:`_loop_unroll` (no remainder steps)."""
    unroll = _loop_unroll(length, unroll)
    return jax.lax.scan(f, init, xs, length=length, reverse=reverse, unroll=unroll)


def _primal_scan(vjp, consts, init, xs):
    """The scan itself (a custom VJP's primal, run when nothing differentiates it)."""

    def step(c, x):
        _tick(0)
        return vjp.body(consts, c, x)

    return jax.lax.scan(step, init, xs, length=vjp.length, reverse=vjp.reverse, unroll=vjp.unroll)


class _LeanScan:
    """The custom VJP of one :func:`scan`: a forward loop that emits the partial activations
    and a reverse loop that rebuilds each step's residuals from them (docs/design.md §2)."""

    def __init__(self, body, length, reverse, unroll, recompute, offload, fname, spaces=None):
        # The body without its traced constants: they are the custom VJP's first argument, and
        # a reference here (kept alive by the rules) would leak the enclosing trace's tracers.
        self.body = _Body(body.jaxpr, [], body.n_carry, body.carry_tree, body.y_tree)
        self.n_consts = len(body.consts)
        self.length = length
        self.reverse = reverse
        self.unroll = unroll
        self.recompute = recompute
        self.offload = offload
        self.fname = fname
        # Memory spaces of the inputs: inputs in host memory get their cotangents there.
        self.spaces = spaces
        self.run = jax.custom_vjp(self._primal)
        # Symbolic zeros: the backward pass learns which cotangents the loss makes zero.
        self.run.defvjp(self._fwd, self._bwd, symbolic_zeros=True)

    @functools.cached_property
    def plan(self) -> _Plan:
        """The plan, made on first use (it depends only on the body's input types)."""
        jaxpr = self.body.jaxpr
        in_avals = [v.aval for v in _jc.open_jaxpr(jaxpr).invars]
        names = self.offload if isinstance(self.offload, frozenset) else frozenset()
        step = _res.plan_step(
            jaxpr, self.n_consts, self.body.n_carry, in_avals, self.recompute, names
        )
        stacked, carry = _offload_masks(step, self.offload, self.fname)
        collectors = _PLAN_COLLECTORS.get()
        if collectors:  # The summary traces stock lax.scan: only when someone asks.
            summary = self.summary(step)
            for collector in collectors:
                collector.append(summary)
        packed = tuple(
            v.aval.shape[-1] if _res.packs_bits(v.aval) else None for v in step.stacked_vars
        )
        return _Plan(step, tuple(stacked), tuple(carry), packed)

    def summary(self, step) -> ScanPlan:
        return _res.summarize(step, self.length, _stock_stacked_bytes(self.body, step, self.length))

    def _scan(self, f, init, xs, reverse):
        return _scan_loop(f, init, xs, self.length, reverse, self.unroll)

    def _primal(self, consts, init, xs):
        return _primal_scan(self, consts, init, xs)

    def _fwd(self, consts, init, xs):
        # With symbolic_zeros=True each leaf comes as CustomVJPPrimal(value, perturbed).
        consts, init, xs = jax.tree.map(
            lambda p: p.value, (consts, init, xs), is_leaf=lambda p: isinstance(p, CustomVJPPrimal)
        )
        plan = self.plan
        step_plan = plan.step
        n_carry, n_y = self.body.n_carry, len(step_plan.y_outvars)
        hoisted = _jc.jaxpr_as_fun(step_plan.hoist)(*consts)
        forward = _jc.jaxpr_as_fun(step_plan.forward)

        def step(carry, x):
            _tick(0)
            outs = forward(*consts, *hoisted, *carry, *x)
            c_out, y, stacked = outs[:n_carry], outs[n_carry : n_carry + n_y], outs[n_carry + n_y :]
            stacked = [_pack(v) if n else v for v, n in zip(stacked, plan.packed, strict=True)]
            stacked = [
                _to_host(v) if off else v
                for v, off in zip(stacked, plan.offload_stacked, strict=True)
            ]
            kept = [_to_host(carry[i]) if off else carry[i] for i, off in emitted]
            return list(c_out), (list(y), stacked, kept)

        # Kept carry sequences; one whose carry-in is a y output is that ys stack (not emitted).
        kept_leaves = [i for i, keep in enumerate(step_plan.stack_carry) if keep]
        emitted = [
            (i, off)
            for i, off in zip(kept_leaves, plan.offload_carry, strict=True)
            if step_plan.carry_seq_y[i] < 0
        ]
        final, (ys, stacked, carry_seq) = self._scan(step, list(init), list(xs), self.reverse)
        carry_seq = iter(carry_seq)
        carry_seq = [
            ys[step_plan.carry_seq_y[i]] if step_plan.carry_seq_y[i] >= 0 else next(carry_seq)
            for i in kept_leaves
        ]
        saved = _Saved(
            consts=list(consts),
            hoisted=list(hoisted),
            xs=list(xs),
            ys_read=[y for y, need in zip(ys, step_plan.need_y, strict=True) if need],
            stacked=stacked,
            carry_seq=carry_seq,
            final_kept=[c for c, r in zip(final, step_plan.carry_out_read, strict=True) if r],
            init_from_y=[init[i] for i, _ in step_plan.carry_read_from_y],
        )
        return (final, ys), saved

    def _carry_in_from_ys(self, saved: _Saved, t):
        """Carry-ins read from ys: step t's is y[t - 1] (y[t + 1] if reverse), or init."""
        pairs = self.plan.step.carry_read_from_y
        if self.length == 0:  # The loop body is traced but never runs.
            return list(saved.init_from_y)
        first, back = (self.length - 1, 1) if self.reverse else (0, -1)
        prev = jnp.clip(t + back, 0, self.length - 1)
        return [
            jnp.where(
                t == first,
                init_v,
                jax.lax.dynamic_index_in_dim(saved.ys_read[k], prev, keepdims=False),
            )
            for (_, k), init_v in zip(pairs, saved.init_from_y, strict=True)
        ]

    def _bwd(self, saved: _Saved, cts):
        plan = self.plan
        step_plan = plan.step
        ct_final, ct_ys = cts
        const_avals = [v.aval for v in step_plan.const_invars]
        carry_avals = [v.aval for v in step_plan.carry_invars]
        x_avals = [v.aval for v in step_plan.x_invars]
        y_avals = [v.aval for v in step_plan.y_outvars]
        avals = (const_avals, carry_avals, x_avals, y_avals)
        live = _live(step_plan.traced, avals, ct_final, ct_ys)
        float_consts, float_carry, float_x, float_y = live
        rebuild = _jc.jaxpr_as_fun(step_plan.rebuild)
        remat = _has_remat(_jc.open_jaxpr(self.body.jaxpr))
        pin_at = [i for i, k in enumerate(step_plan.res_classes) if k == "const"] if remat else []
        # Unrolled, the backward steps' recomputes sit beside the forward steps' computations
        # in one straight-line program, and XLA would schedule a full remat's recompute (its
        # residuals are the step's inputs alone) in the forward, keeping what it was to
        # recompute: 2.5x lax.scan's temp over jax.checkpoint at T=7 unrolled. The inputs then
        # pass a barrier with the cotangent, as jax.checkpoint's prevent_cse passes a remat's.
        # Where the policy saves values too, the barrier measured above stock (1.10x on a body
        # saving its dots) and the recompute from saved values stays where it is.
        unroll = _loop_unroll(self.length, self.unroll)
        inputs_only = all(k in ("carry", "xs", "const") for k in step_plan.res_classes)
        pin_all = remat and inputs_only and (unroll is True or int(unroll) > 1)

        def step(bcarry, inp):
            ct_carry, ct_consts, c_out = bcarry
            t, x, y_read, stacked_t, c_in, ct_y = inp
            stacked_t = [
                _to_device(v) if off else v
                for v, off in zip(stacked_t, plan.offload_stacked, strict=True)
            ]
            stacked_t = [
                _unpack(v, n) if n else v for v, n in zip(stacked_t, plan.packed, strict=True)
            ]
            c_in = [
                _to_device(c) if off else c for c, off in zip(c_in, plan.offload_carry, strict=True)
            ]
            res = rebuild(
                *saved.consts,
                *saved.hoisted,
                *x,
                *y_read,
                *c_out,
                *c_in,
                *self._carry_in_from_ys(saved, t),
                *stacked_t,
            )
            cts = (
                _with_zeros(carry_avals, float_carry, ct_carry, zero=_jc.zero_cotangent),
                _with_zeros(y_avals, float_y, ct_y, zero=_jc.zero_cotangent),
            )
            if pin_all:
                res, _ = jax.lax.optimization_barrier((list(res), ct_carry))
            elif pin_at:
                res = _pin_invariants(step_plan.res_treedef, list(res), pin_at, cts, ct_carry)
            vjp_fn = tree_unflatten(step_plan.res_treedef, res)
            d_consts, d_carry, d_x = vjp_fn(cts)
            new_ct_consts = [
                acc + d_consts[i] for acc, i in zip(ct_consts, float_consts, strict=True)
            ]
            new_ct_carry = [d_carry[i] for i in float_carry]
            c_out = [c for c, r in zip(c_in, out_read, strict=True) if r]
            return (new_ct_carry, new_ct_consts, c_out), [d_x[i] for i in float_x]

        # Per kept carry sequence: whether its carry-out is read (the next step's carry-in).
        out_read = [
            r for r, k in zip(step_plan.carry_out_read, step_plan.stack_carry, strict=True) if k
        ]

        init_b = (
            # A live leaf's final cotangent can still be a symbolic zero (the loss ignores the
            # final carry, a y reads the carry).
            [
                _zeros_ct(carry_avals[i]) if isinstance(ct_final[i], SymbolicZero) else ct_final[i]
                for i in float_carry
            ],
            [_zeros_ct(const_avals[i]) for i in float_consts],
            list(saved.final_kept),
        )
        inputs = (
            jnp.arange(self.length, dtype=jnp.int32),
            saved.xs,
            saved.ys_read,
            saved.stacked,
            saved.carry_seq,
            [ct_ys[i] for i in float_y],
        )
        (ct_init_f, ct_consts_f, _), ct_xs_f = self._scan(step, init_b, inputs, not self.reverse)
        values = (ct_consts_f, ct_init_f, ct_xs_f)
        return _input_cotangents(avals, live, values, self.length, self.spaces)


# ------------------------------------------------------------------------------------------
# Counting forward steps at run time.


class StepCounter:
    """Counts the steps :func:`scan` evaluates at run time (see :func:`step_counter`).

    Attributes:
      forward_steps: evaluations of scan bodies so far, forward sweeps and recomputation
        included (a step taped for its backward pass counts once; recomputation a remat policy
        does inside one step's backward pass does not count).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> with jaxmem.step_counter() as counter:
      ...   _ = jax.block_until_ready(
      ...       jaxmem.scan(lambda c, x: (c + x, None), 0.0, jnp.ones(5)))
      >>> counter
      StepCounter(forward_steps=5)
    """

    def __init__(self):
        self.forward_steps = 0

    def __repr__(self):
        return f"StepCounter(forward_steps={self.forward_steps})"


# The counters of the step_counter blocks active in this context (thread, task): a block in one
# thread does not count the scans another thread traces.
_STEP_COUNTERS: contextvars.ContextVar[tuple[StepCounter, ...]] = contextvars.ContextVar(
    "jaxmem_step_counters", default=()
)


@contextlib.contextmanager
def step_counter():
    """Counts, at run time, the forward steps of every :func:`scan` traced inside the block.

    Each evaluation of a scan's step (the forward sweep, each step recomputed from a checkpoint,
    and each step taped for its backward pass) reports to the counter through a host callback, so
    the count is what ran, not what was planned. Only scans *traced* inside the block count: a
    function compiled before (and cached by ``jax.jit``) is not re-traced. Meant for tests and
    for checking a schedule; the callbacks cost time.

    Yields:
      A :class:`StepCounter`; read ``forward_steps`` after the results are ready.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> loss = lambda w: jaxmem.scan(lambda c, _: (jnp.sin(c * w), None), 1.0, None,
      ...                              length=10, checkpoints=2)[0]
      >>> with jaxmem.step_counter() as counter:
      ...   jax.block_until_ready(jax.grad(loss)(0.5))
      Array(...)
      >>> counter.forward_steps == jaxmem.scan_residuals(
      ...     lambda c, _: (jnp.sin(c * 0.5), None), 1.0, None, length=10,
      ...     checkpoints=2).schedule.forward_steps
      True
    """
    counter = StepCounter()
    token = _STEP_COUNTERS.set((*_STEP_COUNTERS.get(), counter))
    try:
        yield counter
    finally:
        _STEP_COUNTERS.reset(token)


def _tick(index):
    """Reports one step evaluation to the counters active at trace time (nothing if none)."""
    counters = _STEP_COUNTERS.get()
    if not counters:
        return

    def record(_):
        for counter in counters:
            counter.forward_steps += 1

    jax.debug.callback(record, index)


# ------------------------------------------------------------------------------------------
# Checkpointed scans: a binomial (Revolve) schedule (schedule.py) run by two loops.


def _index(stack, i):
    return jax.lax.dynamic_index_in_dim(stack, i, keepdims=False)


def _put(stack, value, i):
    return jax.lax.dynamic_update_index_in_dim(stack, value, i, 0)


def _store(bufs, carry, slot, write):
    """Writes ``carry`` into checkpoint ``slot`` where ``write`` (in place, as a select of one
    slot: the buffers are loop state)."""
    at = jnp.where(write, slot, 0)
    return [
        _put(b, jax.lax.select(write, c, _index(b, at)), at)
        for b, c in zip(bufs, carry, strict=True)
    ]


def _stack_of(aval, length: int):
    """An array of ``length`` values of type ``aval`` to fill (zeros; a key array of zero keys)."""
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        return jnp.zeros((length, *aval.shape), aval.dtype)
    return _jc.zeros(_jc.stacked(aval, length))


class _CheckpointedScan:
    """The custom VJP of one :func:`scan` with ``checkpoints``: the forward sweep stores at most
    ``k`` carries where the binomial schedule says; the backward loop restores the nearest one,
    advances to the step it reverses (storing carries on the way) and applies that step's VJP.
    One step's activations are live at a time; the checkpoints are the only stack."""

    def __init__(self, body, length, reverse, unroll, slots, offload, fname, spaces=None):
        self.body = _Body(body.jaxpr, [], body.n_carry, body.carry_tree, body.y_tree)
        self.n_consts = len(body.consts)
        self.length = length
        self.reverse = reverse
        self.unroll = unroll
        self.slots = slots
        self.offload_checkpoints = offload in ("carries", "all")
        self.fname = fname
        self.spaces = spaces
        self.tables = _schedule.revolve(length, slots)
        invars = _jc.open_jaxpr(body.jaxpr).invars
        n_c, n_k = self.n_consts, body.n_carry
        self.const_avals = [v.aval for v in invars[:n_c]]
        self.carry_avals = [v.aval for v in invars[n_c : n_c + n_k]]
        self.x_avals = [v.aval for v in invars[n_c + n_k :]]
        self.y_avals = [v.aval for v in _jc.open_jaxpr(body.jaxpr).outvars[n_k:]]
        self.run = jax.custom_vjp(self._primal)
        self.run.defvjp(self._fwd, self._bwd, symbolic_zeros=True)

    @functools.cached_property
    def traced(self):
        in_avals = [*self.const_avals, *self.carry_avals, *self.x_avals]
        return _res.trace_step_vjp(self.body.jaxpr, self.n_consts, self.body.n_carry, in_avals)

    def _x_index(self, p):
        """The xs index of the step at position ``p`` of the processing order."""
        return self.length - 1 - p if self.reverse else p

    def _x_at(self, xs, p):
        """The xs slice of the step at position ``p`` of the processing order."""
        return [_index(v, self._x_index(p)) for v in xs]

    def _primal(self, consts, init, xs):
        return _primal_scan(self, consts, init, xs)

    def _fwd(self, consts, init, xs):
        consts, init, xs = jax.tree.map(
            lambda p: p.value, (consts, init, xs), is_leaf=lambda p: isinstance(p, CustomVJPPrimal)
        )
        length, tables = self.length, self.tables
        snap_slot, snap_when = jnp.asarray(tables.snap_slot), jnp.asarray(tables.snap_when)
        # The checkpoint slots, each holding the initial carry (slot 0's for good).
        bufs = [jnp.broadcast_to(c[None], (self.slots, *c.shape)) for c in init]
        ys = [_stack_of(a, length) for a in self.y_avals]

        def sweep(state, p):
            carry, bufs, ys = state
            j = self._x_index(p)
            bufs = _store(bufs, carry, snap_slot[p], snap_when[p] == length - 1)
            _tick(p)
            carry, y = self.body(consts, carry, self._x_at(xs, p))
            return (carry, bufs, [_put(s, v, j) for s, v in zip(ys, y, strict=True)]), None

        (carry, bufs, ys), _ = jax.lax.scan(
            sweep,
            (list(init), bufs, ys),
            jnp.arange(length - 1, dtype=jnp.int32),
            unroll=self.unroll,
        )
        # The last step is taped here: its VJP is the first one the backward pass applies.
        j = self._x_index(length - 1)
        _tick(length - 1)
        (final, y), vjp_last = jax.vjp(self.body, list(consts), carry, self._x_at(xs, length - 1))
        ys = [_put(s, v, j) for s, v in zip(ys, y, strict=True)]
        if self.offload_checkpoints:
            bufs = [_to_host(b) for b in bufs]
        return (final, ys), (list(consts), list(xs), bufs, vjp_last)

    def _bwd(self, saved, cts):
        consts, xs, bufs, vjp_last = saved
        if self.offload_checkpoints:
            bufs = [_to_device(b) for b in bufs]
        ct_final, ct_ys = cts
        length, tables = self.length, self.tables
        const_avals, carry_avals = self.const_avals, self.carry_avals
        x_avals, y_avals = self.x_avals, self.y_avals
        avals = (const_avals, carry_avals, x_avals, y_avals)
        live = _live(self.traced, avals, ct_final, ct_ys)
        float_consts, float_carry, float_x, float_y = live

        def apply(vjp_fn, ct_carry, p):
            j = self._x_index(p)
            d_consts, d_carry, d_x = vjp_fn(
                (
                    _with_zeros(carry_avals, float_carry, ct_carry, zero=_jc.zero_cotangent),
                    _with_zeros(
                        y_avals,
                        float_y,
                        [_index(ct_ys[i], j) for i in float_y],
                        zero=_jc.zero_cotangent,
                    ),
                )
            )
            return (
                [d_consts[i] for i in float_consts],
                [d_carry[i] for i in float_carry],
                [d_x[i] for i in float_x],
            )

        ct_carry = [
            _zeros_ct(carry_avals[i]) if isinstance(ct_final[i], SymbolicZero) else ct_final[i]
            for i in float_carry
        ]
        d_consts, ct_carry, d_x = apply(vjp_last, ct_carry, length - 1)
        j_last = self._x_index(length - 1)
        ct_xs = [
            _put(_zeros_ct(x_avals[i], length), d, j_last)
            for i, d in zip(float_x, d_x, strict=True)
        ]
        restore_slot = jnp.asarray(tables.restore_slot)
        restore_pos = jnp.asarray(tables.restore_pos)
        snap_slot, snap_when = jnp.asarray(tables.snap_slot), jnp.asarray(tables.snap_when)

        def back(state, u):
            ct_carry, acc, ct_xs, bufs = state
            slot = restore_slot[u]
            carry = [_index(b, slot) for b in bufs]

            def advance(p, st):
                carry, bufs = st
                bufs = _store(bufs, carry, snap_slot[p], snap_when[p] == u)
                _tick(p)
                carry, _ = self.body(consts, carry, self._x_at(xs, p))
                return carry, bufs

            carry, bufs = jax.lax.fori_loop(restore_pos[u], u, advance, (carry, bufs))
            _tick(u)
            _, vjp_fn = jax.vjp(self.body, list(consts), carry, self._x_at(xs, u))
            d_consts, ct_carry, d_x = apply(vjp_fn, ct_carry, u)
            acc = [a + d for a, d in zip(acc, d_consts, strict=True)]
            j = self._x_index(u)
            ct_xs = [_put(s, d, j) for s, d in zip(ct_xs, d_x, strict=True)]
            return (ct_carry, acc, ct_xs, bufs), None

        (ct_init, ct_consts, ct_xs, _), _ = jax.lax.scan(
            back,
            (ct_carry, d_consts, ct_xs, bufs),
            jnp.arange(length - 1, dtype=jnp.int32),
            reverse=True,
            unroll=self.unroll,
        )
        return _input_cotangents(avals, live, (ct_consts, ct_init, ct_xs), length, self.spaces)


# The collectors of the collect_plans blocks active in this context (thread, task); analysis
# appends to each. The planner compiles in threads: a block collects what its own thread traces.
_PLAN_COLLECTORS: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar(
    "jaxmem_plan_collectors", default=()
)


@contextlib.contextmanager
def collect_plans():
    """Collects the :class:`ScanPlan` of every :func:`scan` differentiated inside the block."""
    plans: list = []
    token = _PLAN_COLLECTORS.set((*_PLAN_COLLECTORS.get(), plans))
    try:
        yield plans
    finally:
        _PLAN_COLLECTORS.reset(token)


def _stock_stacked_bytes(body: _Body, plan, length: int) -> int:
    """Bytes :func:`jax.lax.scan` stacks for the same step: its loop-stacked residuals."""
    structs = [
        [_jc.struct(v.aval) for v in vs]
        for vs in (plan.const_invars, plan.carry_invars, plan.x_invars)
    ]
    structs[2] = [_jc.struct(_jc.stacked(v.aval, length)) for v in plan.x_invars]

    def stock_loss(consts, init, xs):
        final, ys = jax.lax.scan(lambda c, x: body(consts, c, x), init, xs, length=length)
        leaves = [x for x in [*final, *ys] if jnp.issubdtype(x.dtype, jnp.inexact)]
        return sum((jnp.sum(x.astype(jnp.float32)) for x in leaves), jnp.float32(0))

    return _listing.loop_stacked_bytes(_listing.saved_residuals(stock_loss, *structs), length)


def scan_residuals(f: Callable, init: Any, xs: Any = None, length: int | None = None, **kwargs):
    """The plan :func:`scan` makes for the gradient of one scan, next to what ``lax.scan`` stacks.

    Takes the arguments of :func:`scan`. Nothing is computed: the step is traced abstractly
    (arrays or :class:`jax.ShapeDtypeStruct` work alike). The plan is the one for a gradient with
    respect to everything: ``init``, ``xs`` and the floating-point arrays ``f`` closes over (its
    parameters, as in training).

    Args:
      f: the step, ``f(carry, x) -> (carry, y)``.
      init: the initial carry.
      xs: the scanned-over inputs, or None with ``length``.
      length: the number of steps.
      **kwargs: ``reverse``, ``unroll``, ``recompute``, ``policy``, ``offload`` and
        ``checkpoints`` as in :func:`scan`. With ``checkpoints`` the plan's ``schedule`` is the
        binomial schedule (checkpoints kept, forward steps in all, bytes kept).

    Returns:
      A :class:`ScanPlan`: each residual of one step with its shape, dtype, bytes and kind
      (``xs``/``const``/``carry``/``ys``/``recomputed``/``stacked``), what is stacked per step,
      and the total stacked bytes for the whole scan next to ``lax.scan``'s.

    Raises:
      Whatever :func:`scan` raises for these arguments.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> w = jnp.ones((8, 8))
      >>> plan = jaxmem.scan_residuals(
      ...     lambda h, x: (jnp.tanh(h @ w + x),) * 2, jnp.zeros((4, 8)), jnp.ones((16, 4, 8)))
      >>> [(r.kind, r.bytes) for r in plan.stacked]  # kept per step: the ys, read back
      [('ys', 128)]
      >>> plan.stacked_bytes, plan.ratio <= 0.5  # lax.scan also stacks h and tanh's residuals
      (2048, True)
    """
    unknown = set(kwargs) - {"reverse", "unroll", "recompute", "policy", "offload", "checkpoints"}
    if unknown:
        raise TypeError(
            f"jaxmem.scan_residuals got unexpected keyword arguments: {sorted(unknown)}."
        )
    fname = "jaxmem.scan_residuals"
    checks.check_callable(f, "the body f(carry, x)", fname)
    for argname, tree in (("init", init), ("xs", xs)):
        _opts.check_leaves(tree, argname, fname, allow_structs=True)
    plans = []
    checkpoints = _auto.resolve_checkpoints(kwargs.get("policy"), kwargs.get("checkpoints"))
    f = _opts.apply_policy(f, kwargs.get("policy"), fname)
    offload = _opts.check_offload(kwargs.get("offload"), fname)

    def trace(init, xs):
        body, init_leaves, xs_leaves, _, n, unroll, recompute = _prepare(
            f,
            init,
            xs,
            length,
            kwargs.get("unroll", 1),
            kwargs.get("recompute", "auto"),
            fname,
            diff_consts=True,
        )
        lean = _LeanScan(
            body, n, bool(kwargs.get("reverse", False)), unroll, recompute, offload, fname
        )
        step = lean.plan.step
        schedule = None
        slots = _opts.check_checkpoints(checkpoints, offload, n, fname)
        if slots is not None:
            carry_bytes = sum(_jc.nbytes(v.aval) for v in step.carry_invars)
            schedule = _schedule.describe(n, slots, carry_bytes)
        stock = _stock_stacked_bytes(lean.body, step, n)
        plans.append(_res.summarize(step, n, stock, schedule))

    jax.eval_shape(trace, init, xs)
    return plans[0]


def scan(
    f: Callable,
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    *,
    recompute: str = "auto",
    policy: Callable | str | None = None,
    offload: str | tuple[str, ...] | None = None,
    checkpoints: int | str | None = None,
):
    """Scans ``f`` over the leading axis of ``xs``, like :func:`jax.lax.scan`, with a lean VJP.

    The forward semantics, arguments and checks are those of :func:`jax.lax.scan`. The gradient
    is computed by a custom VJP that does not stack residuals that are xs slices or loop-invariant
    constants, keeps the carry sequence at most once and serves residuals equal to the carry or a
    ys output from it, recomputes cheap functions of those where that costs no step time
    (``recompute="auto"``), and stacks only the rest: the *partial activations*.
    :func:`jaxmem.scan_residuals` shows the plan.

    Args:
      f: the step, ``f(carry, x) -> (carry, y)``.
      init: the initial carry, a pytree of arrays.
      xs: a pytree of arrays with a common leading axis, or None (then ``length`` is required).
      length: the number of steps; must agree with the leading axis of ``xs``.
      reverse: scan from the end of ``xs`` to the start (outputs stay in ``xs`` order).
      unroll: loop unrolling, an int or a bool, passed to :func:`jax.lax.scan` (forward and
        backward loops).
      recompute: which residuals the backward step recomputes from the values it has, instead
        of stacking them. ``"cheap"``: every cheap function (elementwise, convert, transpose,
        reshape, broadcast, slice, select, ordering compare; never an exact float comparison,
        whose recompute could differ in rounding), the fewest bytes. ``"auto"`` (default): the
        cheap functions whose recompute fuses into the backward step (not a transpose of a
        computed value, on CPU) while the recomputes are priced within 5% of the step's time
        (:mod:`jaxmem._src.scan.recompute_cost`). ``"none"``: stacks them all.
      policy: a remat policy applied to each step, as ``jax.checkpoint(f, policy=policy)``
        (a :mod:`jaxmem.policies` policy, one of ``jax.checkpoint_policies``, or a preset name
        such as ``"nothing"``, ``"dots"`` or ``"dots_saveable"``, see
        :func:`jaxmem.policies.by_name`); the residuals it saves are then deduplicated as
        without a policy. ``"auto"``: the policy of the
        :func:`jaxmem.use_plan` active when the step is traced, and its ``checkpoints`` where
        this call gives none (no remat outside any plan, with a one-time warning); the plan is
        part of ``jax.jit``'s cache key.
      offload: keep stacked values in host memory (``pinned_host``) between the forward and the
        backward pass, each step's slice brought back in the backward loop: ``"residuals"`` (the
        partial activations), ``"carries"`` (the kept carry sequence), ``"all"``, or a tuple of
        checkpoint names (:func:`jaxmem.name`) selecting partial activations. On CPU this is the
        identity (results are bit-identical); on GPU/TPU the lowered loop carries host-placement
        annotations. With ``checkpoints``: ``"carries"`` or ``"all"`` keep the checkpoints in
        host memory between the forward and the backward pass (the other modes raise: nothing
        else is stacked).
      checkpoints: bound the memory of a long scan by the number of stored carries, for
        recomputation: ``None`` (default) stacks the partial activations of every step; an int
        ``k`` stores at most ``k`` carries (the initial one included; a ``k`` above the length is
        clamped to it) and reverses the scan with the binomial schedule of Griewank and Walther's
        Revolve, which evaluates the fewest forward steps for ``k`` stored carries (each step at
        most ``r + 1`` times, ``r`` the least integer with ``C(k + r, k) >= length``); ``"sqrt"``
        is ``k = ceil(sqrt(length))``. One step's activations are live at a time (its VJP is
        applied right after it is recomputed, under ``policy`` if given; ``recompute`` does not
        apply). :func:`scan_residuals` shows the schedule, :func:`step_counter` counts the steps
        evaluated. The backward pass's inner loop has a dynamic trip count, so ``unroll``
        applies to the forward sweep and the loop over steps, not to recomputation.

    Returns:
      ``(final_carry, stacked_ys)``, as :func:`jax.lax.scan`.

    Raises:
      TypeError: ``f`` not callable, a non-array leaf in ``init``/``xs`` (named by its path), a
        carry whose type changes across a step (both types shown), ``f`` not returning a pair.
      ValueError: leading-axis sizes that disagree with each other or with ``length`` (every
        size and path named), no ``xs`` and no ``length``, a bad ``recompute``, ``checkpoints``
        not positive or a string other than ``"sqrt"`` (a ``TypeError`` for a non-integer),
        ``checkpoints`` with an ``offload`` other than ``"carries"``/``"all"``.
      ForwardModeError: when differentiated in forward mode (``jax.jvp``, ``jax.jacfwd``); use
        :func:`jax.lax.scan` there. Where the forward-mode transformation is applied to an
        already staged function (``jax.jvp(jax.jit(f))``, or calling the linear function that
        ``jax.linearize`` returns), JAX itself raises ``TypeError: can't apply forward-mode
        autodiff (jvp) to a custom_vjp function`` when the staged code runs; ``ForwardModeError``
        is a ``TypeError`` too, so ``except TypeError`` covers both. ``jax.hessian`` (forward
        over reverse) works.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> def loss(w, xs, h0):
      ...   def step(h, x):
      ...     h = jnp.tanh(h @ w + x)
      ...     return h, h
      ...   _, ys = jaxmem.scan(step, h0, xs)
      ...   return jnp.sum(ys**2)
      >>> w, xs, h0 = jnp.eye(3) * 0.5, jnp.ones((5, 2, 3)), jnp.zeros((2, 3))
      >>> g = jax.grad(loss)(w, xs, h0)
      >>> def stock(w, xs, h0):
      ...   _, ys = jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x),) * 2, h0, xs)
      ...   return jnp.sum(ys**2)
      >>> bool(jnp.allclose(g, jax.grad(stock)(w, xs, h0), rtol=1e-6))
      True
    """
    fname = "jaxmem.scan"
    checkpoints = _auto.resolve_checkpoints(policy, checkpoints)
    f = _opts.apply_policy(f, policy, fname)
    offload = _opts.check_offload(offload, fname)
    body, init_leaves, xs_leaves, _, length, unroll, recompute = _prepare(
        f, init, xs, length, unroll, recompute, fname
    )
    slots = _opts.check_checkpoints(checkpoints, offload, length, fname)
    inputs = (body.consts, init_leaves, xs_leaves)
    spaces = [jax.typeof(v).memory_space for group in inputs for v in group]
    if slots is None:
        lean = _LeanScan(body, length, bool(reverse), unroll, recompute, offload, fname, spaces)
    else:
        lean = _CheckpointedScan(body, length, bool(reverse), unroll, slots, offload, fname, spaces)
    try:
        final, ys = lean.run(*inputs)
    except TypeError as e:
        if "forward-mode" in str(e):
            raise ForwardModeError(_FORWARD_MODE_MESSAGE) from e
        raise
    return tree_unflatten(body.carry_tree, final), tree_unflatten(body.y_tree, ys)


def scanned(fn: Callable | None = None, *, recompute: str = "auto", **scan_kwargs):
    """Turns a per-step function ``fn(carry, x)`` into ``g(init, xs, **kw)`` that runs :func:`scan`.

    Usable bare (``@jaxmem.scanned``) or with options (``@jaxmem.scanned(recompute="none")``).
    Keyword arguments of the call (``length``, ``reverse``, ``unroll``) override the decorator's.

    Args:
      fn: the step function ``fn(carry, x) -> (carry, y)``.
      recompute: as in :func:`scan`.
      **scan_kwargs: default ``length``/``reverse``/``unroll`` for :func:`scan`.

    Returns:
      The scanning function ``g(init, xs=None, **kw) -> (final_carry, ys)`` (or, without ``fn``,
      a decorator that makes one).

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> @jaxmem.scanned
      ... def cumsum(c, x):
      ...   return c + x, c + x
      >>> cumsum(0.0, jnp.arange(4.0))[1]
      Array([0., 1., 3., 6.], dtype=float32)
    """
    _opts.check_recompute(recompute, "jaxmem.scanned")
    unknown = set(scan_kwargs) - {"length", "reverse", "unroll", "policy", "offload", "checkpoints"}
    if unknown:
        raise TypeError(f"jaxmem.scanned got unexpected keyword arguments: {sorted(unknown)}.")
    if fn is None:
        return functools.partial(scanned, recompute=recompute, **scan_kwargs)
    checks.check_callable(fn, "the step fn(carry, x)", "jaxmem.scanned")

    @functools.wraps(fn)
    def run(init, xs=None, **kw):
        opts = {**scan_kwargs, **kw}
        return scan(fn, init, xs, recompute=recompute, **opts)

    return run
