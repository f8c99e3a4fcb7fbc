"""Tracing a loop body once: avals, the closed-over constants made explicit, the traced step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.tree_util import keystr, tree_flatten, tree_unflatten

from jaxmem._src import checks
from jaxmem._src import jax_compat as _jc
from jaxmem._src.scan import draws as _draws
from jaxmem._src.scan import options as _opts


def _aval(x) -> _jc.ShapedArray:
    """The type of ``x``: shape, dtype, weak type, sharding and varying manual axes."""
    return jax.typeof(x)


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


def _prepare(f, init, xs, length, fname, diff_consts=False):
    """Checks the arguments and traces the body (promoting weak-typed init leaves once)."""
    checks.check_callable(f, "the body f(carry, x)", fname)
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
    drawn = _draws.predraw(body.jaxpr, body.consts, body.n_carry, xs_leaves, length)
    if drawn is not None:
        closed, bits = drawn
        body = _Body(closed, body.consts, body.n_carry, body.carry_tree, body.y_tree)
        xs_leaves = [*xs_leaves, *bits]
    return body, init_leaves, xs_leaves, xs_tree, length
