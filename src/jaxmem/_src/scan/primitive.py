"""``jaxmem_scan``: one loop of :func:`jaxmem.scan` as a JAX primitive with every rule.

A scan is bound as a hijax primitive (:data:`jaxmem._src.jax_compat.HiPrimitive`), except on
jax 0.10.2 under ``jax.check_tracer_leaks`` (:func:`jaxmem._src.jax_compat.hiprim_usable`), where
it runs as the custom VJP of its rules (reverse mode only). The primitive's rules are:

- evaluation and lowering: the plain loop (``jax.lax.scan`` of the step);
- reverse mode: the lean VJP of :class:`~jaxmem._src.scan.lean._LeanScan` (or the binomial
  schedule of :class:`~jaxmem._src.scan.checkpointed._CheckpointedScan`), unchanged;
- forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``): the JVP of the plain loop, as
  fast and as small as ``jax.lax.scan``'s (reverse over forward differentiates that loop with
  ``lax.scan``'s residuals). Where JAX linearizes by JVP and partial evaluation (a
  ``jax.checkpoint`` around the scan), which cannot split a primitive into known and unknown
  parts, the rule returns the lean forward loop's outputs and residuals (known) and
  :class:`_LinearizedScan` of the tangents, whose transpose is the lean backward loop (and whose
  own reverse mode, reached by grad of the JVP of a jitted function, is that of lax.scan's JVP);
- batching (``jax.vmap``): a jaxmem scan of the vmapped step, the batch axis of the scanned
  inputs and outputs right after the time axis;
- DCE and remat: the primitive's defaults (an unused scan is removed; ``jax.checkpoint`` around
  it recomputes it whole, as around ``jax.lax.scan`` with no policy).

The primitive prints as ``jaxmem_scan[length=... reverse=... jaxpr=...]`` in a jaxpr on jax 0.12
(0.10.2 prints every hijax primitive as ``call_hi_primitive[_prim=JaxmemScan[...]]``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal
from jax.tree_util import tree_unflatten

from jaxmem._src import jax_compat as _jc
from jaxmem._src.scan import findings as _findings
from jaxmem._src.scan import lint as _lint
from jaxmem._src.scan import options as _opts
from jaxmem._src.scan import summary as _summary
from jaxmem._src.scan import unrolled as _unrolled
from jaxmem._src.scan.checkpointed import _CheckpointedScan
from jaxmem._src.scan.hooks import _PLAN_COLLECTORS
from jaxmem._src.scan.hooks import quiet_plans as _quiet_plans
from jaxmem._src.scan.lean import _LeanScan
from jaxmem._src.scan.trace import _drop_forwarded, _prepare
from jaxmem._src.scan.vjp_parts import _loop_unroll


class Loop(NamedTuple):
    """One loop traced: its step (constants explicit), inputs and checkpoint slots."""

    body: Any  # the step (:class:`~jaxmem._src.scan.trace._Body`), forwarded carries dropped
    inputs: tuple  # (consts, init, xs) leaves
    length: int
    slots: int | None  # checkpoint slots (None: the lean VJP)
    restore: Any  # puts the dropped carries back into the outputs

    @property
    def spaces(self) -> list:
        """The inputs' memory spaces: inputs in host memory get their cotangents there."""
        return [jax.typeof(v).memory_space for group in self.inputs for v in group]

    def lean(self, reverse: bool, opts: _opts.ScanOptions) -> _LeanScan:
        """The lean VJP's rules for this loop."""
        rules = _LeanScan(self.body, self.length, reverse, opts, self.spaces)
        rules.measure_compress = _compress_temps
        return rules


_COMPRESS_TEMPS: dict = {}


def _compress_temps(rules) -> tuple[int, int] | None:
    """The compiled temp bytes of the loop's gradient alone with its ``compress=`` and without
    (:func:`jaxmem._src.scan.unrolled.compiled_temp`; None where either does not compile
    alone), cached per loop signature: two compilations at the first of each."""
    body = _jc.open_jaxpr(rules.body.jaxpr)
    avals = [v.aval for v in body.invars]
    n, c = rules.n_consts, rules.body.n_carry
    xs = tuple(_jc.stacked(a, rules.length) for a in avals[n + c :])
    in_avals = (tuple(avals[:n]), tuple(avals[n : n + c]), xs)
    opts = dataclasses.replace(rules.opts, site=None, fname="")
    key = (str(rules.body.jaxpr), in_avals, rules.length, bool(rules.reverse), opts)
    if key not in _COMPRESS_TEMPS:

        def program(compress):
            probe = copy.copy(rules)  # as the unrolled chooser's variants; its own plan
            probe.__dict__.pop("plan", None)
            probe.opts = dataclasses.replace(opts, compress=compress)
            probe.measure_compress = None
            return lambda *g: _bind(probe, tuple(tuple(x) for x in g))

        with _quiet_plans(), _findings.collecting():
            temps = tuple(
                _unrolled.compiled_temp(program(c), in_avals) for c in (opts.compress, None)
            )
        _COMPRESS_TEMPS[key] = None if None in temps else temps
    return _COMPRESS_TEMPS[key]


def trace_loop(f, init, xs, length, opts: _opts.ScanOptions, diff_consts=False) -> Loop:
    """Traces the step ``f`` of a loop under ``opts`` (as :meth:`ScanOptions.for_step` returns
    them): what :func:`run` runs and :func:`jaxmem.scan_residuals` reports."""
    prepared = _prepare(f, init, xs, length, opts.fname, diff_consts=diff_consts)
    body, init_leaves, xs_leaves, _, length = prepared
    body, init_leaves, restore = _drop_forwarded(body, init_leaves, xs_leaves)
    slots = _opts.check_checkpoints(opts.checkpoints, opts.offload, length, opts.fname)
    inputs = (tuple(body.consts), tuple(init_leaves), tuple(xs_leaves))
    return Loop(body, inputs, length, slots, restore)


def run(f, init, xs, length, reverse: bool, opts: _opts.ScanOptions, check: bool = False):
    """Traces ``f`` and runs it as one ``jaxmem_scan``: ``(final carry, ys)`` as pytrees.

    ``opts`` are the loop's options as :meth:`~jaxmem._src.scan.options.ScanOptions.for_step`
    returns them (``checkpoints`` resolved against the active plan, ``own_remat`` set). With
    ``check`` (a user's call, not a loop a rule makes) the loop's trace-time findings are
    reported at ``opts.site`` (:func:`jaxmem._src.scan.lint.check_loop`)."""
    loop = trace_loop(f, init, xs, length, opts)
    body, inputs, slots, restore = loop.body, loop.inputs, loop.slots, loop.restore
    if check and opts.site is not None:
        _check(loop, reverse, opts)
    if slots is None:
        rules = loop.lean(reverse, opts)
    else:
        rules = _CheckpointedScan(body, loop.length, reverse, opts, slots, loop.spaces)
    choice = None  # the program of a loop unrolled whole or in part (scan's unrolled module)
    if slots is None and _chooses_unrolled(rules):
        choice, _ = _unrolled_choice(rules, inputs, body)
        rules.roll_backward = choice == "rolled_backward"
        collectors = _PLAN_COLLECTORS.get()
        if collectors:  # the program that runs reports its plan (the candidates did not)
            with _quiet_plans():
                step = rules.plan.step
            summary = rules.summary(step)
            summary = _summary.as_stock(summary) if choice in _unrolled.STOCK else summary
            for collector in collectors:
                collector.append(summary)
    if choice in _unrolled.STOCK:
        guarded = rules.body.preventing_cse() if choice == "stock_prevent_cse" else None
        final, ys = _stock_program(rules, guarded)(*inputs)
    else:
        final, ys = _bind(rules, inputs)
    final, ys = restore(final, ys)
    return tree_unflatten(body.carry_tree, final), tree_unflatten(body.y_tree, ys)


def _check(loop: Loop, reverse: bool, opts: _opts.ScanOptions) -> None:
    """The trace-time findings of a user's loop; with checkpoints, those that compare it with
    the lean VJP's plan (made quietly: it reports neither a plan nor findings of its own)."""
    _lint.check_loop(loop, opts, opts.site)
    if loop.slots is None:
        return
    _lint.check_checkpointed(loop, opts, opts.site)
    k = opts.checkpoints
    if isinstance(k, int) and not isinstance(k, bool) and k >= loop.length > 1:
        lean_opts = dataclasses.replace(opts, checkpoints=None, offload=None, site=None)
        with _quiet_plans():
            plan = loop.lean(reverse, lean_opts).plan
        _lint.check_checkpoints(loop, opts, plan, opts.site)


def _bind(rules, inputs):
    """The loop on ``inputs`` ``(consts, init, xs)``: a ``jaxmem_scan`` of its rules, or their
    custom VJP where the primitive is not usable (jax 0.10.2 checking leaks: there forward mode
    raises JAX's TypeError)."""
    if _jc.hiprim_usable():
        return JaxmemScan(rules, inputs)(*inputs)
    return _custom_vjp(rules)(*(list(g) for g in inputs))


def unrolled_program(rules, loop: Loop):
    """For a loop unrolled whole or in part, the program that runs it and the compiled temp bytes
    of each candidate's gradient on the loop alone (:func:`jaxmem._src.scan.unrolled.measure`,
    :func:`~jaxmem._src.scan.unrolled.keep_unroll`); None for any other loop. What
    :func:`jaxmem.scan_residuals` reports."""
    if not _chooses_unrolled(rules):
        return None
    return _unrolled_choice(rules, loop.inputs, loop.body)


def loop_temps(rules, loop: Loop) -> tuple:
    """The compiled temp bytes of the loop's gradient alone, ``(lax.scan's, jaxmem's)`` (each
    None where it does not compile alone), by :func:`jaxmem._src.scan.unrolled.compiled_temp`."""
    in_avals = tuple(tuple(jax.typeof(v) for v in g) for g in loop.inputs)

    def stock(consts, init, xs):
        return rules._primal(list(consts), list(init), list(xs))

    def lean(consts, init, xs):
        return _bind(rules, (tuple(consts), tuple(init), tuple(xs)))

    with _quiet_plans():
        return tuple(_unrolled.compiled_temp(p, in_avals) for p in (stock, lean))


def _chooses_unrolled(rules) -> bool:
    """Whether the program of a loop unrolled whole or in part is chosen by compiling (not with
    offload or compress, which ask for the lean VJP's stacks)."""
    unroll = _loop_unroll(rules.length, rules.opts.unroll)
    return (
        (rules.unrolled_whole or int(unroll) > 1)
        and rules.length > 1
        and rules.opts.offload is None
        and rules.opts.compress is None
        and _jc.hiprim_usable()
    )


def _unrolled_choice(rules, inputs, body) -> tuple[str, dict]:
    """The program of a loop unrolled whole (:func:`jaxmem._src.scan.unrolled.measure`) or in
    part (:func:`~jaxmem._src.scan.unrolled.keep_unroll`) and each candidate's temp: of its
    programs, each a function of ``(consts, init, xs)``."""

    def lean(roll: bool):
        def program(consts, init, xs):
            _ = rules.plan  # made once, shared by the copy
            variant = copy.copy(rules)
            variant.roll_backward = roll
            groups = (tuple(consts), tuple(init), tuple(xs))
            return JaxmemScan(variant, groups)(*groups)

        return program

    whole = rules.unrolled_whole
    programs = {"unrolled": lean(False), "stock": _stock_program(rules)}
    if whole:  # a loop unrolled in part keeps its unroll or runs as stock (keep_unroll)
        programs["rolled_backward"] = lean(True)
    guarded = rules.body.preventing_cse() if rules.opts.own_remat else None
    if guarded is not None:
        programs["stock_prevent_cse"] = _stock_program(rules, guarded)
    in_avals = tuple(tuple(jax.typeof(v) for v in g) for g in inputs)
    # Not the caller's name: jaxmem.scan and scan_residuals share a choice.
    key = (
        str(body.jaxpr),
        in_avals,
        rules.length,
        bool(rules.reverse),
        rules.opts.unroll,
        rules.opts.recompute,
        rules.opts.own_remat,  # the backward loop pins loop invariants (or not)
        whole,
    )
    measure = _unrolled.measure if whole else _unrolled.keep_unroll
    with _quiet_plans():  # the candidates report no plan; run reports the one that runs
        return measure(key, programs, in_avals)


def _stock_program(rules, body=None):
    """``lax.scan``'s own program for the loop, a function of ``(consts, init, xs)``; of
    ``body`` in place of the loop's step where one is given (the step with each
    ``jax.checkpoint`` at ``prevent_cse=True``,
    :meth:`~jaxmem._src.scan.trace._Body.preventing_cse`)."""
    if body is not None:
        rules = copy.copy(rules)
        rules.body = body
    return lambda consts, init, xs: rules._primal(list(consts), list(init), list(xs))


def _custom_vjp(rules):
    """The loop as a ``jax.custom_vjp`` of its rules (symbolic zeros: the backward pass learns
    which cotangents the loss makes zero), where it is not a primitive."""

    def fwd(*args):
        values = jax.tree.map(
            lambda p: p.value if isinstance(p, CustomVJPPrimal) else p,
            args,
            is_leaf=lambda p: isinstance(p, CustomVJPPrimal),
        )
        return rules._fwd(*values)

    run = jax.custom_vjp(rules._primal)
    run.defvjp(fwd, rules._bwd, symbolic_zeros=True)
    return run


_is_zero = _jc.is_symbolic_zero


class JaxmemScan(_jc.HiPrimitive):
    """One :func:`jaxmem.scan` loop: inputs ``(consts, init, xs)``, outputs ``(final, ys)``."""

    def __init__(self, rules, inputs):
        self.rules = rules
        self.in_avals = tuple(tuple(jax.typeof(v) for v in group) for group in inputs)
        body = _jc.open_jaxpr(rules.body.jaxpr)
        n_carry = rules.body.n_carry
        out = [v.aval for v in body.outvars]
        ys = tuple(_jc.stacked(a, rules.length) for a in out[n_carry:])
        # The final carry has the carry's types (shardings included), the ys the step's.
        self.out_aval = (self.in_avals[1], ys)
        # The step's effects (jax.debug.print, callbacks): the loop is kept where its outputs
        # are unused, as lax.scan is, and ordered effects are ordered with the program's.
        self.effects = frozenset(rules.body.jaxpr.effects)
        self.params = dict(
            length=rules.length,
            reverse=bool(rules.reverse),
            unroll=rules.opts.unroll,
            checkpoints=getattr(rules, "slots", None),
            recompute=rules.opts.recompute,
            jaxpr=rules.body.jaxpr,
            _rules=rules,
        )
        super().__init__()

    # -- evaluation ------------------------------------------------------------------------------

    def expand(self, consts, init, xs):
        final, ys = self.rules._primal(list(consts), list(init), list(xs))
        return tuple(final), tuple(ys)

    # -- reverse mode: the lean VJP ------------------------------------------------------------

    def vjp_fwd(self, nzs_in, consts, init, xs):
        (final, ys), saved = self.rules._fwd(list(consts), list(init), list(xs))
        return (tuple(final), tuple(ys)), saved

    def vjp_bwd_retval(self, saved, cts):
        ct_final, ct_ys = cts
        to_sym = lambda ct: _jc.to_symbolic_zero(ct) if _is_zero(ct) else ct
        cts = ([to_sym(c) for c in ct_final], [to_sym(c) for c in ct_ys])
        ct_consts, ct_init, ct_xs = self.rules._bwd(saved, cts)
        return tuple(ct_consts), tuple(ct_init), tuple(ct_xs)

    # -- forward mode -----------------------------------------------------------------------

    def jvp(self, primals, tangents):
        if _jc.in_forward_mode():
            # jax.jvp / jax.jacfwd / jax.linearize: lax.scan's JVP, as fast and as small.
            return _stock_jvp(self, primals, tangents)
        # Linearized by JVP and partial evaluation (jax.checkpoint around the scan): the primal
        # and the lean residuals from the forward loop (known), the tangents from a primitive
        # linear in them whose transpose is the lean backward loop.
        primals = tuple(tuple(g) for g in primals)
        nz = tuple(tuple(not _is_zero(t) for t in g) for g in tangents)
        out, saved = self.vjp_fwd(nz, *primals)
        nz_tangents = tuple(t for g in tangents for t in g if not _is_zero(t))
        if not nz_tangents:
            return out, jax.tree.map(lambda a: _jc.zero_tangent(a), self.out_aval)
        tangent = _LinearizedScan(self, nz, saved, primals, nz_tangents)
        return out, tangent.outputs(tangent(saved, primals, nz_tangents))

    lin, linearized = _jc.LINEARIZE_FROM_JVP

    # -- batching: a jaxmem scan of the vmapped step -------------------------------------------

    def batch(self, axis_data, args, dims):
        consts, init, xs = (list(g) for g in args)
        k_dims, c_dims, x_dims = (list(g) for g in dims)
        size = axis_data.size
        body = self.rules.body
        n_carry = body.n_carry
        k_b = [d is not None for d in k_dims]
        x_b = [d is not None for d in x_dims]
        # The carry leaves the step batches, to a fixed point (as lax.scan's batching rule).
        c_b = [d is not None for d in c_dims]
        while True:
            out_b = _depends(body.jaxpr, k_b + c_b + x_b)
            new = [c or o for c, o in zip(c_b, out_b[:n_carry], strict=True)]
            if new == c_b:
                break
            c_b = new
        y_b = out_b[n_carry:]
        consts = [
            x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(consts, k_dims, strict=True)
        ]
        init = [
            jnp.moveaxis(c, d, 0)
            if d is not None
            else (jnp.broadcast_to(c, (size, *c.shape)) if b else c)
            for c, d, b in zip(init, c_dims, c_b, strict=True)
        ]
        # A batched xs leaf has its batch axis right after the time axis.
        xs = [x if d is None else jnp.moveaxis(x, d, 1) for x, d in zip(xs, x_dims, strict=True)]
        axis = lambda b: 0 if b else None
        vmapped = jax.vmap(
            lambda k, c, x: body(k, c, x),
            in_axes=([axis(b) for b in k_b], [axis(b) for b in c_b], [axis(b) for b in x_b]),
            out_axes=([axis(b) for b in c_b], [axis(b) for b in y_b]),
            **_jc.vmap_axis_params(axis_data),
        )
        final, ys = run(
            lambda c, x: tuple(vmapped(consts, c, x)),
            init,
            xs,
            self.rules.length,
            bool(self.rules.reverse),
            self.rules.opts,
        )
        out = (tuple(final), tuple(ys))
        out_dims = (tuple(axis(b) for b in c_b), tuple(1 if b else None for b in y_b))
        return out, out_dims


def _depends(jaxpr, batched_in: list) -> list:
    """Per output of ``jaxpr``: whether it depends on an input marked in ``batched_in`` (what
    ``jax.vmap`` can batch; an over-approximation, so an output marked False is unbatched)."""
    jaxpr = _jc.open_jaxpr(jaxpr)
    marked = {v for v, b in zip(jaxpr.invars, batched_in, strict=True) if b}
    for eqn in jaxpr.eqns:
        if any(_jc.is_var(v) and v in marked for v in eqn.invars):
            marked.update(eqn.outvars)
    return [_jc.is_var(v) and v in marked for v in jaxpr.outvars]


def _stock_jvp(prim, primals, tangents):
    """The JVP of the plain loop (``jax.lax.scan`` of the step), symbolic zeros instantiated."""
    tangents = tuple(
        tuple(_jc.instantiate_tangent(p, t) for p, t in zip(pg, tg, strict=True))
        for pg, tg in zip(primals, tangents, strict=True)
    )
    return jax.jvp(prim.expand, primals, tangents)


class _LinearizedScan(_jc.HiPrimitive):
    """The tangents of one ``jaxmem_scan`` as a function of its input tangents (linear in them),
    given its lean residuals and its primal inputs: its transpose is the lean backward loop; run
    forward (a JVP of a checkpointed function), it computes ``lax.scan``'s JVP."""

    def __init__(self, scan: JaxmemScan, nz, saved, primals, nz_tangents):
        self.scan = scan
        self.nz = nz
        typeof = lambda tree: jax.tree.map(jax.typeof, tree)
        self.in_avals = (typeof(saved), typeof(primals), typeof(nz_tangents))
        final, ys = scan.out_aval
        self.float_out = tuple(tuple(_jc.is_float(a) for a in g) for g in (final, ys))
        self.out_aval = tuple(
            tuple(a.to_tangent_aval() for a, f in zip(g, fl, strict=True) if f)
            for g, fl in zip((final, ys), self.float_out, strict=True)
        )
        self.params = dict(_scan=scan, _nz=nz)
        super().__init__()

    def outputs(self, float_tangents):
        """The tangents of every output: these for the float ones, symbolic zeros elsewhere."""
        out = []
        for g, fl, avals in zip(float_tangents, self.float_out, self.scan.out_aval, strict=True):
            it = iter(g)
            out.append(
                tuple(
                    next(it) if f else _jc.zero_tangent(a) for f, a in zip(fl, avals, strict=True)
                )
            )
        return tuple(out)

    def _full_tangents(self, primals, nz_tangents):
        it = iter(nz_tangents)
        return tuple(
            tuple(
                next(it) if n else _jc.zero_tangent(jax.typeof(p))
                for p, n in zip(pg, ng, strict=True)
            )
            for pg, ng in zip(primals, self.nz, strict=True)
        )

    def expand(self, saved, primals, nz_tangents):
        _, tangents = _stock_jvp(self.scan, primals, self._full_tangents(primals, nz_tangents))
        return tuple(
            tuple(t for t, f in zip(g, fl, strict=True) if f)
            for g, fl in zip(tangents, self.float_out, strict=True)
        )

    def jvp(self, primals, tangents):
        primals, tangents = (
            tuple(primals),
            tuple(
                jax.tree.map(_jc.instantiate_tangent, p, t, is_leaf=_is_zero)
                for p, t in zip(primals, tangents, strict=True)
            ),
        )
        return jax.jvp(self.expand, primals, tangents)

    # Reverse mode through the tangents themselves (grad of jvp of a jitted function, where JAX
    # linearizes the inner JVP by partial evaluation): the VJP of lax.scan's JVP, which is what
    # this primitive computes when run forward.
    def vjp_fwd(self, nzs_in, saved, primals, nz_tangents):
        return self.expand(saved, primals, nz_tangents), (saved, primals, nz_tangents)

    def vjp_bwd_retval(self, res, cts):
        cts = jax.tree.map(
            lambda c, a: _jc.zero_tangent_value(a) if _is_zero(c) else c,
            cts,
            self.out_aval,
            is_leaf=_is_zero,
        )
        _, pull = jax.vjp(self.expand, *res)
        return pull(cts)

    def transpose(self, cts, saved, primals, nz_accums):
        if all(_is_zero(c) for g in cts for c in g):
            return None
        it_cts = [iter(g) for g in cts]
        full = tuple(
            [next(it) if f else _jc.zero_tangent(a) for f, a in zip(fl, avals, strict=True)]
            for it, fl, avals in zip(it_cts, self.float_out, self.scan.out_aval, strict=True)
        )
        ct_in = self.scan.vjp_bwd_retval(saved, full)
        flat = [
            c for g, ng in zip(ct_in, self.nz, strict=True) for c, n in zip(g, ng, strict=True) if n
        ]
        for acc, c in zip(nz_accums, flat, strict=True):
            if isinstance(acc, _jc.GradAccum):
                acc.accum(c)
        return None

    def batch(self, axis_data, args, dims):
        out_dims = tuple(tuple(0 for _ in g) for g in self.out_aval)
        out = jax.vmap(
            self.expand, in_axes=tuple(dims), out_axes=out_dims, **_jc.vmap_axis_params(axis_data)
        )(*args)
        return out, out_dims


# Printed in jaxprs as jaxmem_scan[...] (jax 0.12 prints a hijax primitive by its class's name).
JaxmemScan.__name__ = JaxmemScan.__qualname__ = "jaxmem_scan"
