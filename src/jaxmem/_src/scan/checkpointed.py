"""The checkpointed VJP: a binomial (Revolve) schedule of stored carries, each segment re-run and
its steps differentiated with the lean plan.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jaxmem._src import jax_compat as _jc
from jaxmem._src import vjp_primitive as _vjp_primitive
from jaxmem._src.scan import residuals as _res
from jaxmem._src.scan import schedule as _schedule
from jaxmem._src.scan.hooks import _tick
from jaxmem._src.scan.trace import _Body
from jaxmem._src.scan.vjp_parts import (
    _input_cotangents,
    _live,
    _primal_scan,
    _to_device,
    _to_host,
    _with_zeros,
    _zeros_ct,
)


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


def _differentiable(fast, static):
    """``fast``, reverse-differentiated as ``static`` (the same function): JAX cannot
    reverse-differentiate a loop with a dynamic trip count, which the backward pass runs, and
    grad of grad differentiates that backward pass. The first argument is an integer."""

    def fwd(u, *args):
        return fast(u, *args), (u, args)

    def bwd(saved, ct):
        u, args = saved
        _, vjp = jax.vjp(lambda *a: static(u, *a), *args)
        return (None, *vjp(ct))

    return _vjp_primitive.custom_vjp(fast, fwd=fwd, bwd=bwd, name="checkpoint_advance")


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

    def __init__(self, body, length, reverse, opts, slots: int, spaces=None):
        self.body = _Body(body.jaxpr, [], body.n_carry, body.carry_tree, body.y_tree)
        self.n_consts = len(body.consts)
        self.length = length
        self.reverse = reverse
        # The loop's options (:class:`~jaxmem._src.scan.options.ScanOptions`), whole; ``slots``
        # is their ``checkpoints`` resolved against the length.
        self.opts = opts
        self.slots = slots
        self.offload_checkpoints = opts.offload in ("carries", "all")
        self.spaces = spaces
        self.tables = _schedule.revolve(length, slots)
        invars = _jc.open_jaxpr(body.jaxpr).invars
        n_c, n_k = self.n_consts, body.n_carry
        self.const_avals = [v.aval for v in invars[:n_c]]
        self.carry_avals = [v.aval for v in invars[n_c : n_c + n_k]]
        self.x_avals = [v.aval for v in invars[n_c + n_k :]]
        self.y_avals = [v.aval for v in _jc.open_jaxpr(body.jaxpr).outvars[n_k:]]

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

        (carry, bufs, ys), _ = _jc.lax_scan(
            sweep,
            (list(init), bufs, ys),
            jnp.arange(length - 1, dtype=jnp.int32),
            unroll=self.opts.unroll,
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
        """The backward loop: the last step's VJP (taped by the forward), then each earlier
        step's, its carry restored from the nearest checkpoint and advanced to it."""
        consts, xs, bufs, vjp_last = saved
        if self.offload_checkpoints:
            bufs = [_to_device(b) for b in bufs]
        ct_final, ct_ys = cts
        length = self.length
        avals = (self.const_avals, self.carry_avals, self.x_avals, self.y_avals)
        live = _live(self.traced, avals, ct_final, ct_ys)
        _, float_carry, float_x, _ = live
        ct_carry = [
            _zeros_ct(self.carry_avals[i]) if isinstance(ct_final[i], SymbolicZero) else ct_final[i]
            for i in float_carry
        ]
        d_consts, ct_carry, d_x = self._apply(vjp_last, ct_carry, length - 1, live, ct_ys)
        j_last = self._x_index(length - 1)
        ct_xs = [
            _put(_zeros_ct(self.x_avals[i], length), d, j_last)
            for i, d in zip(float_x, d_x, strict=True)
        ]
        restore_slot = jnp.asarray(self.tables.restore_slot)
        advance = self._advance()

        def back(state, u):
            ct_carry, acc, ct_xs, bufs = state
            carry = [_index(b, restore_slot[u]) for b in bufs]
            carry, bufs = advance(u, list(consts), list(xs), carry, bufs)
            _tick(u)
            _, vjp_fn = jax.vjp(self.body, list(consts), carry, self._x_at(xs, u))
            d_consts, ct_carry, d_x = self._apply(vjp_fn, ct_carry, u, live, ct_ys)
            acc = [a + d for a, d in zip(acc, d_consts, strict=True)]
            j = self._x_index(u)
            ct_xs = [_put(s, d, j) for s, d in zip(ct_xs, d_x, strict=True)]
            return (ct_carry, acc, ct_xs, bufs), None

        (ct_init, ct_consts, ct_xs, _), _ = _jc.lax_scan(
            back,
            (ct_carry, d_consts, ct_xs, bufs),
            jnp.arange(length - 1, dtype=jnp.int32),
            reverse=True,
            unroll=self.opts.unroll,
        )
        return _input_cotangents(avals, live, (ct_consts, ct_init, ct_xs), length, self.spaces)

    def _apply(self, vjp_fn, ct_carry, p, live, ct_ys):
        """Step ``p``'s VJP on the carry's cotangent and its ys' slices: the cotangents of the
        live (float) consts, carry and xs slice."""
        float_consts, float_carry, float_x, float_y = live
        j = self._x_index(p)
        ct_y = [_index(ct_ys[i], j) for i in float_y]
        d_consts, d_carry, d_x = vjp_fn(
            (
                _with_zeros(self.carry_avals, float_carry, ct_carry, zero=_jc.zero_cotangent),
                _with_zeros(self.y_avals, float_y, ct_y, zero=_jc.zero_cotangent),
            )
        )
        return (
            [d_consts[i] for i in float_consts],
            [d_carry[i] for i in float_carry],
            [d_x[i] for i in float_x],
        )

    def _advance(self):
        """``advance(u, consts, xs, carry, bufs)``: from the carry of step ``restore_pos[u]``
        to step ``u``'s, storing checkpoints on the way; a loop with a dynamic trip count,
        differentiated (grad of grad) as the schedule's longest advance with the steps past
        ``u`` skipped (a static trip count)."""
        tables = self.tables
        # The advance is a primitive whose rules run later: it reads the schedule from NumPy
        # (no array of this trace closed over).
        table = lambda a, i: jnp.asarray(a)[i]
        steps = np.arange(self.length) - tables.restore_pos
        longest = max(1, int(steps[:-1].max(initial=0)))

        def advance_step(u, p, consts, xs, carry, bufs):
            write = table(tables.snap_when, p) == u
            bufs = _store(bufs, carry, table(tables.snap_slot, p), write)
            carry, _ = self.body(consts, carry, self._x_at(xs, p))
            return carry, bufs

        def dynamic(u, consts, xs, carry, bufs):
            def step(p, st):
                _tick(p)
                return advance_step(u, p, consts, xs, *st)

            return jax.lax.fori_loop(table(tables.restore_pos, u), u, step, (carry, bufs))

        def static(u, consts, xs, carry, bufs):
            def step(i, st):
                p = table(tables.restore_pos, u) + i
                return jax.lax.cond(
                    p < u, lambda st: advance_step(u, p, consts, xs, *st), lambda st: st, st
                )

            return jax.lax.fori_loop(0, longest, step, (carry, bufs))

        return _differentiable(dynamic, static)
