"""Random masks drawn before the loop: a step's dropout masks keyed by its input, drawn by a scan
of their own over ``xs`` and passed to the step as bits.

A draw keyed by the step's input (a layer's dropout key, split per layer) reads no activation,
so XLA may place it anywhere in the step, and its threefry rounds need several buffers the size
of the mask in 32-bit words (counters, the rounds' state, its loop copies). Drawn inside the
loop, they are live on top of everything the loop keeps, at the forward pass's last step: Flax's
lm1b decoder layer at batch 4, 64 tokens, drew six ``[4, 64, 1024]`` u32 buffers for one
dropout there and set the gradient's peak. Drawn before the loop, nothing the loop keeps is live
yet; the step reads its masks back from bits (8 to a byte), which the backward pass also reads
instead of keeping the masks itself. The masks are the same bits: each step draws with its own
key, as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._src import jax_compat as jc
from jaxmem._src.scan.jaxprs import _is_var, packs_bits, sub_jaxpr

# Primitives that draw random bits: the typed-key primitive, and threefry on raw uint32 keys.
_DRAWS = frozenset({"random_bits", "threefry2x32"})


def _draws(eqn) -> bool:
    """Whether ``eqn`` draws random bits (itself, or inside a called jaxpr)."""
    if eqn.primitive.name in _DRAWS:
        return True
    return any(_draws(e) for sub in jc.subjaxprs(eqn) for e in sub.eqns)


def _is_bool(v) -> bool:
    return getattr(v.aval, "dtype", None) == np.dtype(bool)


def drawn_masks(jaxpr, carry: slice, xs: slice) -> list:
    """The boolean masks of ``jaxpr`` (a step ``(*consts, *carry, *x) -> outs``) that are drawn
    from random bits and computed from the step's input ``x`` (and constants) alone, where the
    step leaves that part of it: a mask a carry-dependent equation reads, or a non-boolean value
    computed from it (``keep.astype(f32) / keep_prob``), or a step output. Only masks that pack
    to bits (:func:`jaxmem._src.scan.jaxprs.packs_bits`) and equations without effects count."""
    carried = set(jaxpr.invars[carry])
    from_x = set(jaxpr.invars[xs])
    drawn: set = set()
    exits: set = set()
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if _is_var(v)]
        outs = [v for v in eqn.outvars if not jc.is_drop_var(v)]
        if eqn.effects or any(v in carried for v in ins):
            carried.update(outs)
            exits.update(v for v in ins if v in drawn)
            continue
        if any(v in from_x for v in ins):
            from_x.update(outs)
        if _draws(eqn) or any(v in drawn for v in ins):
            drawn.update(outs)
        if not all(_is_bool(v) for v in outs):
            exits.update(v for v in ins if v in drawn)
    exits.update(v for v in jaxpr.outvars if _is_var(v) and v in drawn)
    return [
        v for v in dict.fromkeys(exits) if v in from_x and v not in carried and packs_bits(v.aval)
    ]


def predraw(closed, traced_consts: list, n_carry: int, xs_leaves: list, length: int):
    """The step ``closed`` (``(*traced_consts, *carry, *x) -> outs``) with its masks
    (:func:`drawn_masks`) drawn before the loop: a ``lax.scan`` over ``xs`` draws them and packs
    them to bits. Returns the new step, taking the bits as further ``x`` inputs and unpacking
    them, and the bits' stacks to append to ``xs``; None when no mask is drawn so."""
    jaxpr = jc.open_jaxpr(closed)
    n_consts = len(traced_consts)
    x_slice = slice(n_consts + n_carry, None)
    masks = drawn_masks(jaxpr, slice(n_consts, n_consts + n_carry), x_slice)
    if not masks:
        return None
    consts = jc.jaxpr_consts(closed)
    inputs = [*jaxpr.invars[:n_consts], *jaxpr.invars[x_slice]]
    draw = sub_jaxpr(jaxpr, consts, inputs, masks)
    rest = sub_jaxpr(jaxpr, consts, [*jaxpr.invars, *masks], jaxpr.outvars)
    counts = [v.aval.shape[-1] for v in masks]
    producer = {v: e for e in jaxpr.eqns for v in e.outvars if _is_var(v)}

    def draw_step(_, x):
        drawn = jc.jaxpr_as_fun(draw)(*traced_consts, *x)
        return None, [jnp.packbits(m, axis=-1) for m in drawn]

    _, bits = jc.lax_scan(draw_step, None, list(xs_leaves), length=length)

    n_in = len(jaxpr.invars)

    def step(*args):
        unpacked = []
        for b, n, v in zip(args[n_in:], counts, masks, strict=True):
            with jc.eqn_context(producer[v]):  # listed at the line that drew the mask
                unpacked.append(jnp.unpackbits(b, axis=-1, count=n).astype(jnp.bool_))
        return jc.jaxpr_as_fun(rest)(*args[:n_in], *unpacked)

    avals = [v.aval for v in jaxpr.invars] + [jc.unstacked(jax.typeof(b), length) for b in bits]
    return jax.make_jaxpr(step)(*[jc.struct(a) for a in avals]), bits
