"""Loops unrolled: which program runs them, chosen by compiling each on the loop alone.

A loop unrolled whole (``unroll=True`` or ``unroll >= length``) is one straight-line program,
and there XLA's schedule, more than the residuals kept, sets the memory. These programs compute
the same values and gradients (the fourth under ``policy=`` only):

- ``"rolled_backward"``: the lean VJP with its forward loop unrolled as asked and its backward
  loop rolled, each backward step's temporaries freed before the next (``lax.scan(...,
  unroll=True)``'s own straight-line gradient keeps more than its rolled loop's);
- ``"unrolled"``: the lean VJP with both loops unrolled;
- ``"stock"``: ``lax.scan``'s own VJP. Where every value of the step fuses (elementwise
  bodies), XLA runs stock's straight-line gradient in the outputs' buffers, with no temp at all,
  which neither lean program reaches;
- ``"stock_prevent_cse"``, under ``policy=`` only: ``lax.scan``'s VJP of the step under
  ``jax.checkpoint``'s default ``prevent_cse=True`` where jaxmem applies the policy at
  ``prevent_cse=False`` (right for a rolled loop). In a straight-line program XLA may merge a
  ``prevent_cse=False`` recompute with the forward pass, the policy then a no-op; which of the
  two is leaner depends on the body.

No one program is the leanest everywhere, so each is compiled on the loop alone, its gradient
that of a sum of squares of every float output with respect to every float input, and the one
with the least temp runs (ties in the order above). The loss around the loop is not known when
the program is chosen (the residuals' types depend on it), and a loss that reads part of the
outputs can reverse the order, so a lean winner must also be within 1.02x + 16 KiB of stock
under a loss of the final carry alone and one of the ys alone (where each is not the whole),
else the next one is tried, the leaner stock program last. Nothing runs: three compilations
(four under ``policy=``) at the first trace of each loop signature, and where a lean program
wins, four more (two for stock, two for it; two more for the next one where it fails), cached.

A loop unrolled in part (``1 < unroll < length``) keeps its backward loop unrolled alike, a
speed hint, where that is within the bar of the leanest stock program under each of the three
losses; else the leanest stock program runs (:func:`keep_unroll`): unrolled steps' small
buffers can be live at once.

The measurements behind each rule are in docs/design.md §7.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem._src import jax_compat as _jc

CANDIDATES = ("rolled_backward", "unrolled", "stock", "stock_prevent_cse")
STOCK = ("stock", "stock_prevent_cse")
"""The candidates that are ``lax.scan``'s own VJP."""

SLACK_RATIO, SLACK_BYTES = 1.02, 16 * 1024
"""How far above stock a lean program may be under a loss of part of the outputs."""


def measure(key, programs: dict, in_avals: tuple) -> tuple[str, dict]:
    """The candidate whose gradient compiles to the least temp (:data:`CANDIDATES` order on
    ties) among those within the slack of the leanest stock program's under a loss of part of
    the outputs (the final carry alone, the ys alone), and the compiled temp bytes of each under
    a loss of every output (None where one does not compile alone). ``programs[name](consts,
    init, xs) -> (final, ys)`` (lists of leaves; a subset of :data:`CANDIDATES` holding
    ``"stock"``); ``in_avals`` the types of ``(consts, init, xs)``; ``key`` identifies the loop
    for the cache."""
    cached = _CHOICES.get(key)
    if cached is not None:
        return cached
    names = [n for n in CANDIDATES if n in programs]
    temps = {name: compiled_temp(programs[name], in_avals) for name in names}
    known = {n: t for n, t in temps.items() if t is not None}
    ranked = sorted(known, key=lambda n: (known[n], CANDIDATES.index(n)))
    choice = ranked[0] if ranked else names[0]
    stocks = [n for n in ranked if n in STOCK]
    if stocks and choice not in STOCK:  # without stock's figures, the leanest runs
        fallback = programs[stocks[0]]
        parts = _parts(fallback, in_avals)
        bounds = {p: compiled_temp(fallback, in_avals, p) for p in parts}
        choice = next(n for n in ranked if n in STOCK or _within(programs[n], in_avals, bounds))
    _CHOICES[key] = (choice, temps)
    return choice, temps


def keep_unroll(key, programs: dict, in_avals: tuple) -> tuple[str, dict]:
    """For a loop unrolled in part: ``"unrolled"`` (the backward loop unrolled as the forward)
    where its gradient compiles within the slack of the leanest stock program's under a loss of
    every output and of each part (the final carry alone, the ys alone), else the leanest stock
    program; with the compiled temp bytes of each candidate measured (under a loss of every
    output). Unrolling is a speed hint, so the backward loop keeps it unless it costs memory
    over stock; it is not rolled instead, which can cost time over stock (docs/design.md §7),
    where ``lax.scan``'s VJP costs neither. Arguments as for :func:`measure`."""
    cached = _CHOICES.get(key)
    if cached is not None:
        return cached
    stocks = [n for n in STOCK if n in programs]
    temps = {name: compiled_temp(programs[name], in_avals) for name in stocks}
    known = sorted((n for n in stocks if temps[n] is not None), key=lambda n: temps[n])
    choice = "unrolled"  # as asked, also where no stock program is measurable alone
    if known:
        temps[choice] = compiled_temp(programs[choice], in_avals)
        fallback = programs[known[0]]
        # The partial losses only once the unrolled program is within under every output.
        within = _within_one(temps[choice], temps[known[0]]) and _within(
            programs[choice],
            in_avals,
            {p: compiled_temp(fallback, in_avals, p) for p in _parts(fallback, in_avals)},
        )
        choice = choice if within else known[0]
    _CHOICES[key] = (choice, temps)
    return choice, temps


_CHOICES: dict = {}


def _within_one(ours: int | None, stock: int | None) -> bool:
    return None in (ours, stock) or ours <= SLACK_RATIO * stock + SLACK_BYTES


def _within(program, in_avals, bounds: dict) -> bool:
    """Whether ``program``'s temp under each partial loss is within the slack of stock's
    (``bounds``: part -> stock's temp; a figure that does not compile is not held against it)."""
    for part, stock in bounds.items():
        if not _within_one(compiled_temp(program, in_avals, part), stock):
            return False
    return True


def _parts(program, in_avals) -> tuple[str, ...]:
    """The losses of part of the outputs that differ from a loss of every output: ``"carry"``
    (the final carry alone) where the ys hold a float, ``"ys"`` where the final carry does; each
    only where it reads a float."""
    final, ys = jax.eval_shape(program, *_structs(in_avals))
    floats = lambda group: any(jnp.issubdtype(v.dtype, jnp.inexact) for v in group)
    if not (floats(final) and floats(ys)):
        return ()
    return ("carry", "ys")


def _structs(in_avals) -> list[list]:
    return [[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in g] for g in in_avals]


def compiled_temp(program, in_avals, part: str = "all") -> int | None:
    """Compiled temp bytes of the gradient of a sum of squares of ``program``'s float outputs
    (``part``: ``"all"``, ``"carry"``: the final carry's alone, ``"ys"``: the ys' alone) with
    respect to its float inputs; None where it does not compile on its own (a loop inside
    ``shard_map`` whose types name manual axes)."""
    groups = _structs(in_avals)
    flat = [s for g in groups for s in g]
    is_float = [jnp.issubdtype(s.dtype, jnp.inexact) for s in flat]
    sizes = [len(g) for g in groups]

    def loss(floats, others):
        it_f, it_o = iter(floats), iter(others)
        args = [next(it_f) if f else next(it_o) for f in is_float]
        consts, init, xs = args[: sizes[0]], args[sizes[0] : sum(sizes[:2])], args[sum(sizes[:2]) :]
        final, ys = program(consts, init, xs)
        outputs = {"all": (*final, *ys), "carry": final, "ys": ys}[part]
        leaves = [v for v in outputs if jnp.issubdtype(v.dtype, jnp.inexact)]
        return sum((jnp.sum(jnp.square(v.astype(jnp.float32))) for v in leaves), jnp.float32(0))

    floats = [s for s, f in zip(flat, is_float, strict=True) if f]
    others = [s for s, f in zip(flat, is_float, strict=True) if not f]
    try:
        compiled = _jc.compile_to_measure(jax.jit(jax.grad(loss)).lower(floats, others))
    except Exception:  # noqa: BLE001 - the candidate is not measurable alone; others may be
        return None
    return compiled.memory_analysis().temp_size_in_bytes
