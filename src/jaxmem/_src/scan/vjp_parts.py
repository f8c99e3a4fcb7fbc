"""What the lean and the checkpointed VJP share: input cotangents, pinned invariants, host moves,
the loop and its primal.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.tree_util import tree_unflatten

from jaxmem._src import jax_compat as _jc
from jaxmem._src.scan import jaxprs as _jaxprs
from jaxmem._src.scan.hooks import _tick


def _zeros_ct(aval, length=None):
    """A zero cotangent for a primal of type ``aval`` (stacked ``length`` times when given):
    its sharding and varying manual axes kept; float0 for integer and boolean values."""
    if length is not None:
        aval = _jc.stacked(aval, length)
    if _jc.is_float(aval):
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
    live_carry, live_in = live_cotangents(
        traced,
        [_jc.is_float(a) and not is_zero(ct) for a, ct in zip(carry_avals, ct_final, strict=True)],
        [_jc.is_float(a) and not is_zero(ct) for a, ct in zip(y_avals, ct_ys, strict=True)],
    )
    n_in = len(const_avals) + len(carry_avals)
    return _Live(
        consts=[i for i, a in enumerate(const_avals) if _jc.is_float(a) and live_in[i]],
        carry=[i for i, a in enumerate(carry_avals) if _jc.is_float(a) and live_carry[i]],
        x=[i for i, a in enumerate(x_avals) if _jc.is_float(a) and live_in[n_in + i]],
        y=[i for i, a in enumerate(y_avals) if _jc.is_float(a) and not is_zero(ct_ys[i])],
    )


def live_cotangents(traced, live_final, live_y) -> tuple[list[bool], list[bool]]:
    """Which cotangents of a step can be nonzero in the backward loop, given the loss's.

    Args:
      traced: the step's VJP (:class:`~jaxmem._src.scan.residuals.TracedStep`).
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
    dep = _input_masks(traced.jaxpr)
    from_ys = 0
    for v, live in zip(traced.y_out, live_y, strict=True):
        from_ys |= dep(v) if live else 0
    n_consts = len(traced.const_in)
    live = [bool(b) for b in live_final]
    while True:
        reach = from_ys
        for v, carried in zip(traced.carry_out, live, strict=True):
            reach |= dep(v) if carried else 0
        new = [live[i] or bool(reach >> (n_consts + i) & 1) for i in range(len(live))]
        if new == live:
            return live, [bool(reach >> k & 1) for k in range(len(traced.jaxpr.invars))]
        live = new


def _input_masks(jaxpr):
    """``dep(v)``: the inputs of ``jaxpr`` that value ``v`` depends on, as a bit mask (bit
    ``k``: input ``k``; a literal depends on none)."""
    deps: dict = {v: 1 << k for k, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        mask = 0
        for u in eqn.invars:
            mask |= deps.get(u, 0) if _jc.is_var(u) else 0
        if mask:
            deps.update((v, mask) for v in eqn.outvars)
    return lambda v: deps.get(v, 0) if _jc.is_var(v) else 0


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
    return any(e.primitive.name == "remat2" for e in _jaxprs.iter_eqns(jaxpr))


def _prevents_cse(jaxpr) -> bool:
    """Whether ``jaxpr`` runs a ``jax.checkpoint`` with ``prevent_cse=True`` (its default), which
    keeps its recompute from being merged with, or hoisted out of, the loop around it."""
    return any(
        e.primitive.name == "remat2" and e.params.get("prevent_cse", True)
        for e in _jaxprs.iter_eqns(jaxpr)
    )


def _pin_invariants(treedef, res: list, at: list, cts, ct_carry) -> list:
    """``res`` with its loop-invariant residuals ``res[at]`` passed through a barrier with the
    loop-carried cotangent, where the backward step would compute more bytes from them alone
    than they hold: what a remat recomputes from them (a table of sines from positions) then
    stays in the loop, as jax.checkpoint's ``prevent_cse`` keeps it there, where XLA would hoist
    it out of the loop and keep it alive all along. Where it would not, the barrier would only
    copy the residuals into every step, and ``res`` is returned as it is.

    Only under a ``jax.checkpoint`` with ``prevent_cse=True``, or under jaxmem's own
    (``scan(..., policy=...)``, where pinning measured leaner on Gemma's block: 1.025x -> 1.017x
    ``nnx.remat``). Under ``prevent_cse=False`` (MaxText's scanned layers) ``lax.scan``'s backward
    loop computes those values once, outside the loop, and so does jaxmem's: pinned, MaxText's
    llama2 under full remat held two more rotary tables at the backward step's peak (+208 KiB,
    1.004x stock's temp).

    The cotangents change from step to step: they enter the backward step's jaxpr as inputs,
    not as constants (what is computed from them alone is not hoisted, and a barrier counted
    for it costs a value of the step per unrolled step: 1.09x lax.scan's temp at unroll 4)."""
    leaves, ct_def = jax.tree.flatten(cts, is_leaf=_jc.is_symbolic_zero)
    arrays = [i for i, leaf in enumerate(leaves) if not _jc.is_symbolic_zero(leaf)]

    def backward(r, ct_arrays):
        given = dict(zip(arrays, ct_arrays, strict=True))
        ct = [given.get(i, leaf) for i, leaf in enumerate(leaves)]
        return tree_unflatten(treedef, r)(jax.tree.unflatten(ct_def, ct))

    jaxpr = _jc.open_jaxpr(jax.make_jaxpr(backward)(res, [leaves[i] for i in arrays]))
    invariant = [i in at for i in range(len(res))] + [False] * len(arrays)
    own = sum(_jc.nbytes(res[i].aval) for i in at)
    if _jaxprs.invariant_bytes(jaxpr, invariant) <= own:
        return res
    pinned, _ = jax.lax.optimization_barrier(([res[i] for i in at], ct_carry))
    for i, v in zip(at, pinned, strict=True):
        res[i] = v
    return res


def _to_host(x):
    return jax.device_put(x, jax.memory.Space.Host)


def _to_device(x):
    return jax.device_put(x, jax.memory.Space.Device)


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
    return _jc.lax_scan(f, init, xs, length=length, reverse=reverse, unroll=unroll)


def _primal_scan(vjp, consts, init, xs):
    """The scan itself (a custom VJP's primal, run when nothing differentiates it)."""

    def step(c, x):
        _tick(0)
        return vjp.body(consts, c, x)

    return _jc.lax_scan(
        step, init, xs, length=vjp.length, reverse=vjp.reverse, unroll=vjp.opts.unroll
    )
