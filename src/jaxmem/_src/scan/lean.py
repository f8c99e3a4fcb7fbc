"""The lean VJP: a forward loop that stacks only partial activations (and the carry sequence once),
a backward loop that rebuilds each step's residuals.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.tree_util import tree_unflatten

from jaxmem._src import jax_compat as _jc
from jaxmem._src import listing as _listing
from jaxmem._src.scan import compress as _compress
from jaxmem._src.scan import jaxprs as _jaxprs
from jaxmem._src.scan import lint as _lint
from jaxmem._src.scan import residuals as _res
from jaxmem._src.scan import summary as _summary
from jaxmem._src.scan.hooks import _PLAN_COLLECTORS, _tick
from jaxmem._src.scan.summary import ScanResiduals
from jaxmem._src.scan.trace import _Body
from jaxmem._src.scan.vjp_parts import (
    _has_remat,
    _input_cotangents,
    _live,
    _loop_unroll,
    _pin_invariants,
    _prevents_cse,
    _primal_scan,
    _scan_loop,
    _to_device,
    _to_host,
    _with_zeros,
    _zeros_ct,
)


def _pack(mask):
    """A boolean mask kept as bits: 8 elements of the last axis to a byte (``uint8``)."""
    return jnp.packbits(mask, axis=-1)


def _unpack(bits, n: int):
    """The mask :func:`_pack` packed, its last axis ``n`` long."""
    return jnp.unpackbits(bits, axis=-1, count=n).astype(jnp.bool_)


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
    found = {_jc.eqn_checkpoint_name(e) for e in _jaxprs.iter_eqns(plan.traced.jaxpr)} - {None}
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
class _StackLayout:
    """A step's plan and where its stacks live: what the custom VJP's rules read."""

    step: _res.SplitStep
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


class _Reads(NamedTuple):
    """How the backward loop reads what the forward kept (:meth:`_LeanScan._reads`)."""

    pin_at: list[int]  # residuals that pass a barrier with the cotangent (a remat's constants)
    pin_all: bool  # every residual passes it (a full remat unrolled whole)
    index_reads: bool  # the stacks read at an index that passes it, not sliced by the loop
    index_out: bool  # the carry-out read from the kept carry sequence
    out_read: list[bool]  # per kept carry sequence: its carry-out is read


def _encodes(step) -> bool:
    """Whether a step's plan keeps a value encoded (under ``compress=``)."""
    return any(e.format is not None for e in (*step.enc_stacked, *step.enc_carry))


class _LeanScan:
    """The custom VJP of one :func:`scan`: a forward loop that emits the partial activations
    and a reverse loop that rebuilds each step's residuals from them (docs/design.md §2)."""

    def __init__(self, body, length, reverse, opts, spaces=None):
        # The body without its traced constants: they are the custom VJP's first argument, and
        # a reference here (kept alive by the rules) would leak the enclosing trace's tracers.
        self.body = _Body(body.jaxpr, [], body.n_carry, body.carry_tree, body.y_tree)
        self.n_consts = len(body.consts)
        self.length = length
        self.reverse = reverse
        # The loop's options (:class:`~jaxmem._src.scan.options.ScanOptions`), whole.
        self.opts = opts
        # Memory spaces of the inputs: inputs in host memory get their cotangents there.
        self.spaces = spaces
        # Whether the backward loop runs rolled (:attr:`backward_unroll`; None: where the loop
        # is unrolled whole). :mod:`jaxmem._src.scan.unrolled` chooses, by compiling.
        self.roll_backward: bool | None = None
        # With compress=: ``measure_compress(rules) -> (temp with, temp without) | None``, the
        # loop's gradient compiled alone both ways (set by :mod:`jaxmem._src.scan.primitive`,
        # which binds loops; None: compress kept as given). See :attr:`plan`.
        self.measure_compress = None
        # Step plans by what they depend on, shared by this object's copies (the compress
        # probes plan the two settings the loop's own plan needs).
        self._steps: dict = {}

    @functools.cached_property
    def plan(self) -> _StackLayout:
        """The plan, made on first use (it depends only on the body's input types)."""
        jaxpr = self.body.jaxpr
        in_avals = [v.aval for v in _jc.open_jaxpr(jaxpr).invars]
        opts = self.opts
        names = opts.offload if isinstance(opts.offload, frozenset) else frozenset()

        def plan_step(compress):
            key = (jaxpr, self.n_consts, opts.recompute, names, compress)
            if key not in self._steps:
                self._steps[key] = _res.plan_step(
                    jaxpr,
                    self.n_consts,
                    self.body.n_carry,
                    in_avals,
                    opts.recompute,
                    names,
                    compress,
                )
            return self._steps[key]

        step = plan_step(opts.compress)
        if opts.compress is not None and self.measure_compress is not None and _encodes(step):
            # Encoded values small beside what the backward pass holds anyway (weights and
            # their gradients) can cost XLA's schedule more than they save: compress is kept
            # only where the loop's gradient compiles to less temp with it. Made here, when
            # the loop is differentiated, so that a forward pass compiles nothing more.
            temps = self.measure_compress(self)
            if temps is not None and temps[0] >= temps[1]:
                if opts.site is not None:
                    _lint.check_compress_temps(opts, temps, opts.site)
                opts = self.opts = dataclasses.replace(opts, compress=None)
                step = plan_step(None)
        stacked, carry = _offload_masks(step, opts.offload, opts.fname)
        collectors = _PLAN_COLLECTORS.get()
        if collectors:  # The summary traces stock lax.scan: only when someone asks.
            summary = self.summary(step)
            for collector in collectors:
                collector.append(summary)
        packed = tuple(
            v.aval.shape[-1] if _jaxprs.packs_bits(v.aval) else None for v in step.stacked_vars
        )
        layout = _StackLayout(step, tuple(stacked), tuple(carry), packed)
        if opts.site is not None:  # offload and compress that keep the same bytes
            _lint.check_plan(layout, opts, opts.site)
        return layout

    def summary(self, step) -> ScanResiduals:
        return _summary.summarize(
            step, self.length, _stock_stacked_bytes(self.body, step, self.length)
        )

    def _scan(self, f, init, xs, reverse):
        return _scan_loop(f, init, xs, self.length, reverse, self.opts.unroll)

    @property
    def unrolled_whole(self) -> bool:
        """Whether the loops are unrolled whole (``unroll=True`` or ``unroll >= length``)."""
        unroll = _loop_unroll(self.length, self.opts.unroll)
        return unroll is True or (not isinstance(unroll, bool) and int(unroll) >= self.length)

    @property
    def backward_unroll(self):
        """The backward loop's unroll: the forward's, or 1 where :attr:`roll_backward` says so
        (by default, where the loop is unrolled whole; the forward loop stays unrolled as
        asked). Unrolled whole, the backward loop is one straight-line program with the
        forward's, where XLA may keep every step's rebuilt residuals and cotangent arithmetic
        live at once; rolled, each backward step's temporaries are freed before the next
        (docs/design.md §7). Unrolled in part, the same holds for the steps of one
        unrolled trip, where stock's backward steps, which rebuild nothing, may need less."""
        unroll = _loop_unroll(self.length, self.opts.unroll)
        roll = self.unrolled_whole if self.roll_backward is None else self.roll_backward
        if roll and self.length > 1:
            return 1
        return unroll

    def _primal(self, consts, init, xs):
        return _primal_scan(self, consts, init, xs)

    def _fwd(self, consts, init, xs):
        plan = self.plan
        step_plan = plan.step
        # After the plan: compress= that encodes nothing (dropped where it saves nothing, or no
        # float kept) keeps every value exact, so higher-order derivatives are right.
        if _encodes(step_plan):
            _compress.check_first_order(
                self.opts.compress, (consts, init, xs), self.opts.fname, "the compressed values"
            )
        n_carry, n_y = self.body.n_carry, len(step_plan.y_outvars)
        hoisted = _jc.jaxpr_as_fun(step_plan.hoist)(*consts)
        forward = _jc.jaxpr_as_fun(step_plan.forward)

        def step(carry, x):
            _tick(0)
            outs = forward(*consts, *hoisted, *carry, *x)
            c_out, y, stacked = outs[:n_carry], outs[n_carry : n_carry + n_y], outs[n_carry + n_y :]
            stacked = [_pack(v) if n else v for v, n in zip(stacked, plan.packed, strict=True)]
            stacked = [
                _compress.encode(v, e) for v, e in zip(stacked, step_plan.enc_stacked, strict=True)
            ]
            stacked = [
                jax.tree.map(_to_host, v) if off else v
                for v, off in zip(stacked, plan.offload_stacked, strict=True)
            ]
            kept = [_compress.encode(carry[i], e) for i, _, e in emitted]
            kept = [
                jax.tree.map(_to_host, v) if off else v
                for v, (_, off, _) in zip(kept, emitted, strict=True)
            ]
            return list(c_out), (list(y), stacked, kept)

        # Kept carry sequences; one whose carry-in is a y output is that ys stack (not emitted).
        kept_leaves = [i for i, keep in enumerate(step_plan.stack_carry) if keep]
        emitted = [
            (i, off, enc)
            for i, off, enc in zip(
                kept_leaves, plan.offload_carry, step_plan.enc_carry, strict=True
            )
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
        ys = [saved.ys_read[k] for _, k in pairs]
        return self._adjacent(ys, saved.init_from_y, t, after=False)

    def _carry_out_from_seq(self, saved: _Saved, t, out_read):
        """Carry-outs read from the kept carry-ins: step t's is carry_seq[t + 1] (t - 1 if
        reverse), or the final carry."""
        seqs = [c for c, r in zip(saved.carry_seq, out_read, strict=True) if r]
        return self._adjacent(seqs, saved.final_kept, t, after=True)

    def _adjacent(self, stacks, edges, t, after: bool):
        """Per stack, its element of the step that runs after step t (``after``) or before it,
        in the loop's order; ``edges`` where step t is the last (first) to run."""
        d = 1 if after != self.reverse else -1
        edge = self.length - 1 if d == 1 else 0
        i = jnp.clip(t + d, 0, self.length - 1)
        return [
            jnp.where(t == edge, e, jax.lax.dynamic_index_in_dim(s, i, keepdims=False))
            for s, e in zip(stacks, edges, strict=True)
        ]

    def _bwd(self, saved: _Saved, cts):
        """The backward loop: each step rebuilds its residuals from what the forward kept and
        applies the step's VJP, in reverse; then the cotangents of the scan's inputs."""
        step_plan = self.plan.step
        ct_final, ct_ys = cts
        avals = tuple(
            [v.aval for v in vs]
            for vs in (
                step_plan.const_invars,
                step_plan.carry_invars,
                step_plan.x_invars,
                step_plan.y_outvars,
            )
        )
        const_avals, carry_avals = avals[0], avals[1]
        live = _live(step_plan.traced, avals, ct_final, ct_ys)
        float_consts, float_carry, _, float_y = live
        reads = self._reads(avals, live)
        init_b = (
            # A live leaf's final cotangent can still be a symbolic zero (the loss ignores the
            # final carry, a y reads the carry).
            [
                _zeros_ct(carry_avals[i]) if isinstance(ct_final[i], SymbolicZero) else ct_final[i]
                for i in float_carry
            ],
            [_zeros_ct(const_avals[i]) for i in float_consts],
            [] if reads.index_out else list(saved.final_kept),
        )
        read = ([], [], [], []) if reads.index_reads else (
            saved.xs, saved.ys_read, saved.stacked, saved.carry_seq
        )  # fmt: skip
        inputs = (jnp.arange(self.length, dtype=jnp.int32), *read, [ct_ys[i] for i in float_y])
        step = self._backward_step(saved, avals, live, reads)
        (ct_init_f, ct_consts_f, _), ct_xs_f = _scan_loop(
            step, init_b, inputs, self.length, not self.reverse, self.backward_unroll
        )
        values = (ct_consts_f, ct_init_f, ct_xs_f)
        return _input_cotangents(avals, live, values, self.length, self.spaces)

    def _reads(self, avals, live) -> _Reads:
        """How the backward loop reads what the forward kept, so that XLA schedules each
        step's reads when the step runs and keeps no more than ``lax.scan`` (docs/design.md §6,
        "The backward loop's reads", has the measurements behind each choice)."""
        plan, step_plan = self.plan, self.plan.step
        body_jaxpr = _jc.open_jaxpr(self.body.jaxpr)
        remat = _has_remat(body_jaxpr)
        # A remat's constants pass a barrier with the cotangent, as jax.checkpoint's
        # prevent_cse does, so that its recompute is not hoisted into the forward (also under
        # jaxmem's own policy=, whose checkpoint has prevent_cse=False).
        pin_at = (
            [i for i, k in enumerate(step_plan.res_classes) if k == "const"]
            if remat and (self.opts.own_remat or _prevents_cse(body_jaxpr))
            else []
        )
        # Unrolled whole, a full remat's recompute (from the step's inputs alone) would be
        # scheduled beside the forward: every input passes the barrier.
        unroll = self.backward_unroll
        inputs_only = all(k in ("carry", "xs", "const") for k in step_plan.res_classes)
        pin_all = remat and inputs_only and (unroll is True or int(unroll) >= self.length)
        # Unrolled in part, XLA would read every unrolled step's slices at the top of the loop
        # body, all live at once: each step reads the stacks at an index that passes a barrier
        # with the cotangent instead. Not for values back from host memory.
        index_reads = not isinstance(unroll, bool) and 1 < int(unroll) < self.length
        index_reads = index_reads and not any(plan.offload_stacked + plan.offload_carry)
        # Per kept carry sequence: whether its carry-out is read (the next step's carry-in).
        out_read = [
            r for r, k in zip(step_plan.carry_out_read, step_plan.stack_carry, strict=True) if k
        ]
        # That carry-out is read from the kept sequence, not threaded through the loop as a
        # carry of its own (one more carry-sized value and its copy); threaded where it comes
        # back from host memory or encoded, which reading would fetch and decode twice.
        index_out = (
            any(out_read)
            and self.length > 0
            and not any(plan.offload_carry)
            and all(e.format is None for e in step_plan.enc_carry)
        )
        # A step that reads nothing at its index from the forward's stacks has nothing to
        # order, and the barrier would only keep XLA from fusing the unrolled steps' cotangent
        # arithmetic; it stays under a remat (as jax.checkpoint's barrier) and where a carry's
        # cotangent goes through unchanged (XLA would take it for loop-invariant).
        if index_reads and not _reads_at_index(step_plan, index_out):
            index_reads = remat or _forwards_a_carry_cotangent(step_plan, avals, live)
        return _Reads(pin_at, pin_all, index_reads, index_out, out_read)

    def _kept_at(self, saved: _Saved, reads: _Reads, t, ct_carry, read):
        """Step ``t``'s slices of what the forward kept, on the device and decoded."""
        plan, step_plan = self.plan, self.plan.step
        x, y_read, stacked_t, c_in = read
        if reads.index_reads:
            t, ct_carry = jax.lax.optimization_barrier((t, ct_carry))
            x, y_read, stacked_t, c_in = jax.tree.map(
                lambda a: jax.lax.dynamic_index_in_dim(a, t, keepdims=False),
                (saved.xs, saved.ys_read, saved.stacked, saved.carry_seq),
            )
        stacked_t = [
            jax.tree.map(_to_device, v) if off else v
            for v, off in zip(stacked_t, plan.offload_stacked, strict=True)
        ]
        stacked_t = [
            _compress.decode(v, e) for v, e in zip(stacked_t, step_plan.enc_stacked, strict=True)
        ]
        stacked_t = [_unpack(v, n) if n else v for v, n in zip(stacked_t, plan.packed, strict=True)]
        c_in = [
            jax.tree.map(_to_device, c) if off else c
            for c, off in zip(c_in, plan.offload_carry, strict=True)
        ]
        c_in = [_compress.decode(c, e) for c, e in zip(c_in, step_plan.enc_carry, strict=True)]
        return t, ct_carry, (x, y_read, stacked_t, c_in)

    def _backward_step(self, saved: _Saved, avals, live, reads: _Reads):
        """One step of the backward loop: its residuals rebuilt, then the step's VJP."""
        step_plan = self.plan.step
        _, carry_avals, _, y_avals = avals
        float_consts, float_carry, float_x, float_y = live
        rebuild = _jc.jaxpr_as_fun(step_plan.rebuild)

        def step(bcarry, inp):
            ct_carry, ct_consts, c_out = bcarry
            t, *read, ct_y = inp
            t, ct_carry, (x, y_read, stacked_t, c_in) = self._kept_at(
                saved, reads, t, ct_carry, read
            )
            if reads.index_out:
                c_out = self._carry_out_from_seq(saved, t, reads.out_read)
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
            if reads.pin_all:
                res, _ = jax.lax.optimization_barrier((list(res), ct_carry))
            elif reads.pin_at:
                res = _pin_invariants(step_plan.res_treedef, list(res), reads.pin_at, cts, ct_carry)
            d_consts, d_carry, d_x = tree_unflatten(step_plan.res_treedef, res)(cts)
            new_ct_consts = [
                acc + d_consts[i] for acc, i in zip(ct_consts, float_consts, strict=True)
            ]
            new_ct_carry = [d_carry[i] for i in float_carry]
            if reads.index_out:
                c_out = []
            else:
                c_out = [c for c, r in zip(c_in, reads.out_read, strict=True) if r]
            return (new_ct_carry, new_ct_consts, c_out), [d_x[i] for i in float_x]

        return step


def _reads_at_index(step_plan, index_out: bool) -> bool:
    """Whether a backward step's rebuild uses a value it reads at its index from a stack the
    forward loop made: a y read back, a kept carry-in or (``index_out``) carry-out, a carry-in
    served from the ys, or a partial activation. Not an xs slice: the xs are an argument, live
    through the program, that lax.scan's backward loop slices the same way."""
    read = {"ys_read", "kept_carry_in", "carry_in_from_ys", "stacked"}
    read |= {"kept_carry_out"} if index_out else set()
    used = _jaxprs.used_invars(_jc.open_jaxpr(step_plan.rebuild))
    names = [name for name, n in step_plan.rebuild_inputs for _ in range(n)]
    return any(u and name in read for name, u in zip(names, used, strict=True))


def _forwards_a_carry_cotangent(step_plan, avals, live) -> bool:
    """Whether a backward step returns a carry's cotangent unchanged (the carry-out is the
    carry-in plus what does not depend on it, at any depth of calls and remats)."""
    if not live.carry:
        return False
    _, carry_avals, _, y_avals = avals
    res_structs = [_jc.struct(v.aval) for v in step_plan.traced.res_out]

    def bwd(res, ct_carry, ct_y):
        cts = (
            _with_zeros(carry_avals, live.carry, ct_carry, zero=_jc.zero_cotangent),
            _with_zeros(y_avals, live.y, ct_y, zero=_jc.zero_cotangent),
        )
        _, d_carry, _ = tree_unflatten(step_plan.res_treedef, res)(cts)
        return [d_carry[i] for i in live.carry]

    ct_carry = [_jc.struct(carry_avals[i]) for i in live.carry]
    ct_y = [_jc.struct(y_avals[i]) for i in live.y]
    jaxpr = jax.make_jaxpr(bwd)(res_structs, ct_carry, ct_y).jaxpr
    n_res = len(res_structs)
    forwarded = _jaxprs.forwarded_inputs(jaxpr)
    return any(k == n_res + j for j, k in enumerate(forwarded))


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
