"""Tracing a loop body once: avals, the closed-over constants made explicit, the traced step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.tree_util import keystr, tree_flatten, tree_unflatten

from jaxmem._src import checks
from jaxmem._src import jax_compat as _jc
from jaxmem._src.scan import draws as _draws
from jaxmem._src.scan import options as _opts


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

    def preventing_cse(self) -> _Body | None:
        """This body with each top-level ``jax.checkpoint`` (``remat2``) at ``prevent_cse=True``,
        its default, or None where none is at ``prevent_cse=False`` (how jaxmem applies
        ``policy=``). Built once per body: the unrolled chooser and the program it runs share it."""
        if not hasattr(self, "_guarded"):
            self._guarded = self._prevent_cse()
        return self._guarded

    def _prevent_cse(self) -> _Body | None:
        eqns = _jc.open_jaxpr(self.jaxpr).eqns
        if not any(e.primitive.name == "remat2" and not e.params["prevent_cse"] for e in eqns):
            return None
        eqns = [
            e.replace(params={**e.params, "prevent_cse": True})
            if e.primitive.name == "remat2"
            else e
            for e in eqns
        ]
        jaxpr = _jc.closed_jaxpr(
            _jc.make_jaxpr(self.jaxpr, eqns=eqns), _jc.jaxpr_consts(self.jaxpr)
        )
        return _Body(jaxpr, self.consts, self.n_carry, self.carry_tree, self.y_tree)


def _trace_body(
    f, fname, init_tree, init_paths, carry_avals, xs_tree, x_avals, diff_consts=False
) -> _Body:
    n_carry = len(carry_avals)
    out_trees = []

    def flat_body(carry_leaves, x_leaves):
        carry = tree_unflatten(init_tree, carry_leaves)
        x = tree_unflatten(xs_tree, x_leaves)
        out = f(carry, x)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):  # lax.scan takes a list
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


def _drop_forwarded(body: _Body, init_leaves: list, xs_leaves: list):
    """Takes out of the loop what the step only forwards, as ``jax.lax.scan`` does (both
    versions): a carry leaf returned unchanged (``carry_out[i]`` is ``carry_in[i]``) becomes a
    traced constant, and a ys leaf that is an xs slice (``y = x``) is dropped from the body.

    A pass-through carry is the same value in every step: as a constant its uses get their
    cotangents summed over the steps and nothing of it is kept per step (kept, its sequence was
    stacked: 2.5x ``lax.scan``'s temp on a [32, 64] carry over 7 steps). A forwarded ys is the
    xs array itself, whose cotangent then reaches the xs directly instead of entering the
    backward loop as a stacked input (1.85x on a [32, 32, 64] xs returned as ys).

    Returns ``(body, init_leaves, restore)``: the body with inputs ``(*consts, *moved, *carry,
    *x)`` and outputs ``(*carry, *y)`` for the carry and ys leaves it keeps, the initial values
    of the carry leaves kept, and ``restore(final, ys)``, which gives the original body's final
    carry and ys leaves from the loop's.
    """
    jaxpr = _jc.open_jaxpr(body.jaxpr)
    n_consts, n_carry = len(body.consts), body.n_carry
    carry_in = jaxpr.invars[n_consts : n_consts + n_carry]
    x_in = jaxpr.invars[n_consts + n_carry :]
    carry_out, ys_out = jaxpr.outvars[:n_carry], jaxpr.outvars[n_carry:]
    moved = [o is i for i, o in zip(carry_in, carry_out, strict=True)]
    ys_from = [next((j for j, x in enumerate(x_in) if x is y), None) for y in ys_out]
    if not any(moved) and all(j is None for j in ys_from):
        return body, init_leaves, lambda final, ys: (list(final), list(ys))
    pick = lambda seq, flags, keep: [v for v, f in zip(seq, flags, strict=True) if f == keep]
    computed = [j is None for j in ys_from]
    invars = [
        *jaxpr.invars[:n_consts],
        *pick(carry_in, moved, True),
        *pick(carry_in, moved, False),
        *x_in,
    ]
    outvars = [*pick(carry_out, moved, False), *pick(ys_out, computed, True)]
    closed = _jc.closed_jaxpr(
        _jc.make_jaxpr(jaxpr, invars=invars, outvars=outvars), _jc.jaxpr_consts(body.jaxpr)
    )
    consts = [*body.consts, *pick(init_leaves, moved, True)]
    kept = pick(init_leaves, moved, False)
    dropped = _Body(closed, consts, len(kept), body.carry_tree, body.y_tree)

    def restore(final, ys):
        final, ys = iter(final), iter(ys)
        final = [x if m else next(final) for x, m in zip(init_leaves, moved, strict=True)]
        return final, [next(ys) if j is None else xs_leaves[j] for j in ys_from]

    return dropped, kept, restore


def _prepare(f, init, xs, length, fname, diff_consts=False):
    """Checks the arguments and traces the body (promoting weak-typed init leaves once)."""
    checks.check_callable(f, "the body f(carry, x)", fname)
    init_paths, init_leaves, init_tree = _opts.check_leaves(init, "init", fname)
    xs_paths, xs_leaves, xs_tree = _opts.check_leaves(xs, "xs", fname)
    length = _opts.infer_length(xs_paths, xs_leaves, length, fname)
    init_leaves = [x if isinstance(x, _jc.Tracer) else jnp.asarray(x) for x in init_leaves]
    xs_leaves = [x if isinstance(x, _jc.Tracer) else jnp.asarray(x) for x in xs_leaves]
    carry_avals = [jax.typeof(x) for x in init_leaves]
    x_avals = [_jc.unstacked(jax.typeof(x), length) for x in xs_leaves]
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
        carry_avals = [jax.typeof(x) for x in init_leaves]
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
    drawn = _draws.predraw(body.jaxpr, body.consts, body.n_carry, xs_leaves, length)
    if drawn is not None:
        closed, bits = drawn
        body = _Body(closed, body.consts, body.n_carry, body.carry_tree, body.y_tree)
        xs_leaves = [*xs_leaves, *bits]
    return body, init_leaves, xs_leaves, xs_tree, length
