"""The checks of one loop that need no compiling: what :func:`jaxmem.scan` (and every loop jaxmem
runs, from :func:`jaxmem.optimize` and the Flax layers) reports while it is traced, and
:func:`jaxmem.lint` collects (:mod:`jaxmem._src.scan.findings`).

- ``stacked_params``: the step returns a value it closes over (a parameter) or a
  cast, copy or reshape of its xs slice (a layer's weights) as a ys output: the loop stacks a
  second copy of the weights (MaxText #4964). A ys that *is* the xs slice is the xs array itself
  in a jaxmem loop (``trace._drop_forwarded``), so it is not reported there.
- ``name_unmatched`` / ``offload_noop`` of the step's remat policy
  (:mod:`jaxmem._src.remat.policy_checks`).
- ``option_noop``: ``checkpoints`` of at least the length where the loop keeps no more without
  them, and ``compress`` where no kept value is encoded (the gradient keeps the same bytes).
- ``offload_noop``: ``offload`` that selects no kept value (a carry named for offload is not a
  residual: jax#23869), or on a backend where host memory is the device's.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxmem._src import format as _format
from jaxmem._src import jax_compat as _jc
from jaxmem._src.remat import auto as _auto
from jaxmem._src.remat import policy_checks as _policy_checks
from jaxmem._src.scan import findings as _findings

# Equations whose output holds the same values as their input, in another type or layout.
COPY_LIKE = frozenset(
    {
        "convert_element_type",
        "copy",
        "copy_p",
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "reduce_precision",
    }
)


def stacked_inputs(jaxpr, n_consts: int, n_carry: int, exact_xs: bool) -> list[tuple[int, str]]:
    """The ys outputs of a loop body ``jaxpr`` (inputs ``(*consts, *carry, *x)``, outputs
    ``(*carry, *y)``) that are a constant (``"const"``: a value the same in every step) or the
    xs slice (``"xs"``), unchanged or through :data:`COPY_LIKE` equations; floating-point
    arrays only: ``(y index, kind)``. An xs slice returned unchanged counts only with
    ``exact_xs`` (where the loop would copy it; ``lax.scan`` and jaxmem's both forward it)."""
    jaxpr = _jc.open_jaxpr(jaxpr) if _jc.is_closed_jaxpr(jaxpr) else jaxpr
    made_by = {v: e for e in jaxpr.eqns for v in e.outvars}
    origin = dict.fromkeys([*jaxpr.constvars, *jaxpr.invars[:n_consts]], "const")
    origin.update(dict.fromkeys(jaxpr.invars[n_consts + n_carry :], "xs"))
    found = []
    for i, y in enumerate(jaxpr.outvars[n_carry:]):
        if not _jc.is_var(y) or not _jc.is_float(y) or not y.aval.shape:
            continue
        v = y
        while v in made_by and made_by[v].primitive.name in COPY_LIKE:
            v = made_by[v].invars[0]
            if not _jc.is_var(v):
                break
        kind = origin.get(v) if _jc.is_var(v) else None
        if kind == "const" or (kind == "xs" and (v is not y or exact_xs)):
            found.append((i, kind))
    return found


def report_stacked(found, n_ys: int, length: int, avals, site, what: str) -> None:
    """Reports :func:`stacked_inputs`' findings of one loop (``avals``: its ys, one step's)."""
    for i, kind in found:
        stack = _format.format_bytes(_jc.nbytes(avals[i]) * length)
        source = "a value the same in every step" if kind == "const" else "the step's xs slice"
        subject = f"ys[{i}]" if n_ys > 1 else "ys"
        _findings.report(
            "stacked_params",
            subject,
            f"of {what} is {source} (a parameter), returned per step: the loop stacks "
            f"{stack} more, a second copy of the weights held with them. Return the parameters "
            "from outside the loop (or None as the y), not from its step.",
            site,
        )


def check_loop(loop, opts, site) -> None:
    """The trace-time checks of one jaxmem loop (:class:`~jaxmem._src.scan.primitive.Loop`),
    reported at ``site``, the user's call."""
    body = loop.body
    jaxpr = _jc.open_jaxpr(body.jaxpr)
    n_consts, n_carry = len(body.consts), body.n_carry
    ys = [v.aval for v in jaxpr.outvars[n_carry:]]
    found = stacked_inputs(body.jaxpr, n_consts, n_carry, exact_xs=False)
    report_stacked(found, len(ys), loop.length, ys, site, f"this {opts.fname} step")
    if _auto.is_auto(opts.policy) and _auto.in_trial():  # the planner's candidate, not the user's
        return
    for issue, at in _policy_checks.check_remats(jaxpr):
        report_issue(issue, site if at is None else _findings.eqn_site(at))


def report_issue(issue, site) -> None:
    """Reports a :class:`~jaxmem._src.remat.policy_checks.Issue` at ``site``."""
    _findings.report(issue.kind, issue.subject, issue.message, site)


def check_checkpointed(loop, opts, site) -> None:
    """``offload_noop`` of a checkpointed loop's offload (its checkpointed carries) where host
    memory is the device's."""
    if opts.offload is not None and _policy_checks.offload_does_nothing():
        _findings.report(
            "offload_noop",
            f"offload={_offload_repr(opts.offload)}",
            f"does nothing on the {jax.default_backend()} backend: host memory is the same "
            "memory, the checkpointed carries stay where they are. Offload where the "
            "accelerator has host memory (GPU, TPU); drop it here.",
            site,
        )


def check_checkpoints(loop, opts, lean_plan, site) -> None:
    """``option_noop`` where ``checkpoints`` stores every carry (``k >= length``) and the loop
    without checkpoints keeps no more bytes (``lean_plan``, the lean VJP's plan of the step)."""
    k = opts.checkpoints
    if not isinstance(k, int) or isinstance(k, bool) or k < loop.length or loop.length < 2:
        return
    step = lean_plan.step
    carries = sum(_jc.nbytes(v.aval) for v in step.carry_invars) * loop.length
    lean = _kept_bytes(step) * loop.length
    if lean > carries:
        return
    _findings.report(
        "option_noop",
        f"checkpoints={k!r}",
        f"is at least the length ({loop.length}): the checkpointed {opts.fname} stores every "
        f"carry ({_format.format_bytes(carries)}) and recomputes every step, where without "
        f"checkpoints it keeps {_format.format_bytes(lean)}. Drop checkpoints=, or pass fewer "
        "than the length.",
        site,
    )


def _kept_bytes(step) -> int:
    """Bytes the lean VJP keeps per step: its partial activations and carry sequences."""
    stacked = sum(e.nbytes for e in step.enc_stacked)
    return stacked + sum(e.nbytes for e in step.enc_carry)


def check_plan(layout, opts, site) -> None:
    """The checks of a loop's gradient plan (the lean VJP's
    :class:`~jaxmem._src.scan.lean._StackLayout`): ``offload`` and ``compress`` that change
    nothing kept."""
    if opts.offload is not None:
        _check_offload(layout, opts, site)
    step = layout.step
    encoded = [e for e in (*step.enc_stacked, *step.enc_carry) if e.format is not None]
    if opts.compress is not None and not encoded:
        _findings.report(
            "option_noop",
            f"compress={opts.compress!r}",
            f"encodes nothing: this {opts.fname}'s gradient keeps no float value it could "
            "store in fewer bits (what it reads back are its xs, constants or the ys the loss "
            "already holds), so the kept bytes are the same. Drop compress=.",
            site,
        )


def check_compress_temps(opts, temps: tuple[int, int], site) -> None:
    """``option_noop`` for ``compress=`` whose loop's gradient compiles to no less temp than
    without it (``temps``: with, without), so the loop runs without it."""
    _findings.report(
        "option_noop",
        f"compress={opts.compress!r}",
        f"saves nothing in this {opts.fname}: its gradient compiles to {temps[0]:,d} B of "
        f"temp with it and {temps[1]:,d} B without (the values kept are small beside what the "
        "backward pass holds anyway), so the loop runs without it. Drop compress=.",
        site,
    )


def _check_offload(layout, opts, site: Any) -> None:
    moved = any(layout.offload_stacked) or any(layout.offload_carry)
    subject = f"offload={_offload_repr(opts.offload)}"
    if not moved:
        _findings.report(
            "offload_noop",
            subject,
            f"selects no value this {opts.fname}'s gradient keeps: {_NOT_KEPT[_mode(opts)]}, "
            "so nothing moves to host memory (jax#23869). jaxmem.scan_residuals lists what "
            "the step keeps.",
            site,
        )
    elif _policy_checks.offload_does_nothing():
        _findings.report(
            "offload_noop",
            subject,
            f"does nothing on the {jax.default_backend()} backend: host memory is the same "
            "memory, the move is the identity. Offload where the accelerator has host memory "
            "(GPU, TPU); drop it here.",
            site,
        )


_NOT_KEPT = {
    "names": "what it names is not a residual (a carry, kept as the carry sequence, or a value "
    "read back from the xs or recomputed); offload 'carries' for the carry sequence, or name "
    "a value the step stacks",
    "residuals": "the step stacks no partial activation (what its gradient reads is its xs, "
    "constants, carries or ys)",
    "carries": "it keeps no carry sequence",
    "all": "it stacks no partial activation and keeps no carry sequence (what its gradient "
    "reads is its xs, constants or the ys the loss holds)",
}


def _mode(opts) -> str:
    return "names" if isinstance(opts.offload, frozenset) else opts.offload


def _offload_repr(offload) -> str:
    if isinstance(offload, frozenset):
        return repr(tuple(sorted(offload)))
    return repr(offload)
