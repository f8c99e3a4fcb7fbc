"""``jaxmem.lint``: the memory settings of a program that do nothing, found by tracing it and
compiling its gradient with and without each of jaxmem's options (docs/lint.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.tree_util import tree_flatten, tree_unflatten

from jaxmem._src import checks
from jaxmem._src import format as _format
from jaxmem._src import jax_compat as _jc
from jaxmem._src.remat import flops as _flops
from jaxmem._src.remat import policy_checks as _policy_checks
from jaxmem._src.scan import findings as _findings
from jaxmem._src.scan import hooks as _hooks
from jaxmem._src.scan import lint as _scan_lint
from jaxmem._src.scan import primitive as _primitive

Finding = _findings.Finding


def lint(fn: Callable, *args: Any, **kwargs: Any) -> tuple[Finding, ...]:
    """The memory settings of ``fn(*args, **kwargs)`` that do nothing, each where it was given.

    Four kinds of :class:`Finding` (docs/lint.md has an example of each):

    - ``name_unmatched``: a checkpoint name in a remat policy (``jax.checkpoint_policies``'
      ``save_only_these_names`` and its kin, :mod:`jaxmem.policies`, a :class:`jaxmem.RematPlan`
      applied with ``policy="auto"``) that no value inside the ``jax.checkpoint`` it governs
      carries (:func:`jaxmem.name`, ``jax.ad_checkpoint.checkpoint_name``): a name tagged only
      elsewhere in the program does not count, since the policy cannot act on it.
    - ``offload_noop``: offload (``offload=`` of a jaxmem loop, an offloading policy) that moves
      nothing: of a value that is not a residual (a scan carry, jax#23869), or on a backend
      whose host memory is the device's (CPU).
    - ``stacked_params``: a scan (``lax.scan``, :func:`jaxmem.scan`, Flax's scans, which run
      ``lax.scan``) whose step returns a parameter (a loop-invariant value, or its xs slice
      unchanged or cast, copied, reshaped) as a ys output that the program uses: the weights
      held twice. A ``lax.scan`` whose such ys nothing reads is not reported (XLA drops it).
    - ``option_noop``: an option of a jaxmem loop (``compress``, ``checkpoints``, ``policy``
      and, off CPU, ``offload``, given to :func:`jaxmem.scan`, :func:`jaxmem.scanned`,
      :func:`jaxmem.optimize` or a :mod:`jaxmem.flax` layer) with which the gradient's
      compiled temp is no lower than without it (``jax.jit(jax.grad(fn))`` compiled both ways
      at XLA:CPU's fast level, whose temp and FLOPs are those of the default: the message gives
      both). An option is turned off at one call site at a time. Also
      ``optimize(..., chunk_tokens=True)`` where the function calls no attention it runs
      blocked (warned where it is traced).

    The first three kinds and the ``option_noop`` cases decidable without compiling are also
    warned, as :class:`jaxmem.LintWarning`, where a jaxmem loop is traced with the setting.

    ``fn`` is traced, and its gradient compiled, not run. The gradient is with respect to every
    floating-point array among ``args`` and ``kwargs``. A ``fn`` that does not return one float
    scalar has no such gradient: then only what tracing ``fn`` finds is checked (names, offload
    by the backend, stacked parameters), not ``option_noop`` nor what a loop's gradient plan
    shows (offload of a non-residual, ``compress`` that encodes nothing).

    Args:
      fn: the program, typically a scalar loss.
      *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
      **kwargs: its keyword arguments.

    Returns:
      The findings, without repeats, in the order found (the program's own first, then its
      gradient's); empty for a program whose every setting acts.

    Raises:
      TypeError: ``fn`` is not callable, or an argument leaf cannot be traced (the message gives
        its pytree path, e.g. ``args[1]['w']``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> def loss(w, xs, h0):  # every ys is read by the loss: nothing for compress to encode
      ...   step = lambda h, x: (jnp.tanh(h @ w + x),) * 2
      ...   _, ys = jaxmem.scan(step, h0, xs, compress="int8")
      ...   return jnp.sum(ys**2)
      >>> args = jnp.eye(16), jnp.ones((8, 4, 16)), jnp.zeros((4, 16))
      >>> [(f.kind, f.subject) for f in jaxmem.lint(loss, *args)]
      [('option_noop', "compress='int8'")]
      >>> jaxmem.lint(lambda w, xs, h0: jnp.sum(jax.lax.scan(
      ...     lambda h, x: (jnp.tanh(h @ w + x),) * 2, h0, xs)[1]), *args)
      ()
    """
    checks.check_callable(fn, "fn", "jaxmem.lint")
    checks.check_traceable(args, "args", "jaxmem.lint")
    checks.check_traceable(kwargs, "kwargs", "jaxmem.lint")
    with _findings.collecting() as found:
        with _hooks.linting():
            closed = jax.make_jaxpr(fn)(*args, **kwargs)
        jaxpr = _jc.open_jaxpr(closed)
        _check_program(jaxpr)
        if _is_scalar_loss(jaxpr):
            _check_options(_gradient(fn, args, kwargs))
    return _findings.unique(found)


def _is_scalar_loss(jaxpr) -> bool:
    outs = jaxpr.outvars
    return len(outs) == 1 and outs[0].aval.shape == () and _jc.is_float(outs[0])


# --- what the traced program shows --------------------------------------------------------------


def _is_jaxmem_loop(eqn) -> bool:
    """A jaxmem loop's equation (jax 0.12's ``jaxmem_scan``, 0.10.2's hijax call of it): its
    step was checked when the loop was traced, at the user's call (``scan/lint.py``)."""
    prim = eqn.params.get("_prim")
    return eqn.primitive.name.startswith("jaxmem") or isinstance(prim, _primitive.JaxmemScan)


def _walk(jaxpr, used_out, site=None) -> Iterator[tuple[Any, list[bool], Any]]:
    """Each equation of ``jaxpr`` (at any depth, not inside jaxmem loops) with, per output,
    whether the program uses it (``used_out``: per output of ``jaxpr``), and the user's line
    of the nearest equation around it that has one (``site``, that of ``jaxpr``'s: JAX records
    no user frame for some equations of a traced body, a ``jax.checkpoint`` in a loop's step). A
    call's body is walked with its outputs' use; other bodies (loops, branches, checkpoints) as
    used whole."""
    live = {v for v, u in zip(jaxpr.outvars, used_out, strict=True) if u and _jc.is_var(v)}
    used_of: dict[int, list[bool]] = {}
    for eqn in reversed(jaxpr.eqns):
        used = [_jc.is_var(v) and v in live for v in eqn.outvars]
        used_of[id(eqn)] = used
        if any(used) or eqn.effects:
            live.update(v for v in eqn.invars if _jc.is_var(v))
    for eqn in jaxpr.eqns:
        used = used_of[id(eqn)]
        subs = [] if _is_jaxmem_loop(eqn) else _jc.subjaxprs(eqn)
        at = (_findings.eqn_site(eqn) or site) if subs else site
        yield eqn, used, at
        call = eqn.primitive.name in _jc.CALL_PRIMITIVES
        if call and len(subs) == 1 and len(subs[0].outvars) == len(eqn.outvars):
            yield from _walk(subs[0], used, at)
        else:
            for sub in subs:
                yield from _walk(sub, [True] * len(sub.outvars), at)


def _check_program(jaxpr) -> None:
    """The structural findings of a traced program: ``lax.scan`` steps returning parameters as
    used ys, and ``jax.checkpoint`` policies naming what their function does not carry."""
    for eqn, used, site in _walk(jaxpr, [True] * len(jaxpr.outvars)):
        if eqn.primitive.name == "scan":
            _check_lax_scan(eqn, used, site)
        else:
            for issue in _policy_checks.check_remat(eqn):
                _scan_lint.report_issue(issue, site)


def _check_lax_scan(eqn, used: list[bool], site) -> None:
    n_consts, n_carry = _jc.scan_counts(eqn)
    body = _jc.open_jaxpr(eqn.params["jaxpr"])
    ys = [v.aval for v in body.outvars[n_carry:]]
    found = _scan_lint.stacked_inputs(body, n_consts, n_carry, exact_xs=True)
    found = [(i, kind) for i, kind in found if used[n_carry + i]]
    if found:
        _scan_lint.report_stacked(found, len(ys), eqn.params["length"], ys, site, "a lax.scan step")


# --- what compiling the gradient with and without each option shows ------------------------------


@dataclasses.dataclass(frozen=True)
class _Gradient:
    """``jax.grad`` of the program with respect to its float leaves, and those leaves."""

    fn: Callable
    args: tuple


def _gradient(fn: Callable, args: tuple, kwargs: dict) -> _Gradient:
    leaves, tree = tree_flatten((args, kwargs))
    diff = [_jc.is_float(x) for x in leaves]

    def loss(float_leaves):
        it = iter(float_leaves)
        full = [next(it) if d else x for x, d in zip(leaves, diff, strict=True)]
        a, k = tree_unflatten(tree, full)
        return fn(*a, **k)

    return _Gradient(jax.grad(loss), (tuple(x for x, d in zip(leaves, diff, strict=True) if d),))


@dataclasses.dataclass(frozen=True)
class _Measured:
    temp: int
    flops: float


def _measure(grad: _Gradient, switched_off: frozenset = frozenset()) -> _Measured:
    with _hooks.linting(switched_off):
        lowered = jax.jit(grad.fn).lower(*grad.args)
    compiled = _jc.compile_to_measure(lowered)
    return _Measured(compiled.memory_analysis().temp_size_in_bytes, _flops.compiled_flops(compiled))


def _given(opts) -> list[tuple[str, str]]:
    """The memory options a loop was given, ``(option, as written)``: those whose effect is
    measured (offload only where it can act)."""
    out = []
    for option, off in _hooks.SWITCHABLE.items():
        value = getattr(opts, option)
        if value == off or (option == "offload" and _policy_checks.offload_does_nothing()):
            continue
        if option == "policy" and callable(value):
            shown = _policy_checks.describe(value)
        else:
            shown = repr(tuple(sorted(value)) if isinstance(value, frozenset) else value)
        out.append((option, f"{option}={shown}"))
    return out


def _check_options(grad: _Gradient) -> None:
    """``option_noop``: each option of each jaxmem loop, turned off at its call site, against
    the program as written."""
    with _hooks.collect_calls() as calls:
        base = _measure(grad)
    pairs = {}
    for site, opts in calls:
        for option, shown in _given(opts):
            pairs.setdefault((site, option), shown)
    for (site, option), shown in pairs.items():
        with _findings.collecting():  # the variant's own findings are the program's again
            without = _measure(grad, frozenset({(site, option)}))
        if base.temp < without.temp:
            continue
        flops = "the same FLOPs" if base.flops == without.flops else "more FLOPs"
        if base.flops < without.flops:
            flops = "fewer FLOPs"
        _findings.report(
            "option_noop",
            shown,
            f"saves no memory: the gradient's compiled temp is {_format.format_bytes(base.temp)} "
            f"with it and {_format.format_bytes(without.temp)} without it, at {flops} "
            f"({base.flops:.4g} and {without.flops:.4g}). Drop it (docs/lint.md says why a "
            "setting can do nothing).",
            site,
        )
