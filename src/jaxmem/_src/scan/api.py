"""``jaxmem.scan``: a drop-in for :func:`jax.lax.scan` whose VJP stacks only partial activations.

Data flow (see ``docs/design.md`` §2):

1. The body is traced once to a jaxpr; closed-over traced values (parameters of an outer
   ``jit``/``grad``/``vmap``) become explicit inputs, so they get gradients.
2. :func:`jaxmem._src.scan.residuals.plan_step` traces the step's VJP and decides, for each
   residual, whether the backward step reads it from an xs slice, a constant, the carry sequence,
   a ys output, recomputes it cheaply, or needs it stacked (a *partial activation*).
3. Forward: a :func:`jax.lax.scan` that emits ys, the partial activations and, for the carry
   leaves some residual needs, the carry sequence (once).
4. Backward: a reverse :func:`jax.lax.scan` that rebuilds each step's residuals and applies the
   step's VJP; constant cotangents accumulate in its carry.

The loop is bound as one ``jaxmem_scan`` primitive (:mod:`jaxmem._src.scan.primitive`) whose
rules are steps 3-4 for reverse mode, ``lax.scan``'s JVP for forward mode, and a ``jaxmem_scan``
of the vmapped step for batching; on jax 0.10.2 under ``jax.check_tracer_leaks`` it is a custom
VJP of steps 3-4 (``jax_compat.hiprim_usable``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from jaxmem._src import checks
from jaxmem._src import jax_compat as _jc
from jaxmem._src.scan import findings as _findings
from jaxmem._src.scan import hooks as _hooks
from jaxmem._src.scan import options as _opts
from jaxmem._src.scan import primitive as _primitive
from jaxmem._src.scan import schedule as _schedule
from jaxmem._src.scan import summary as _summary
from jaxmem._src.scan import unrolled as _unrolled
from jaxmem._src.scan.lean import _stock_stacked_bytes


class ForwardModeError(TypeError):
    """Raised by :func:`jaxmem.scan` under forward-mode AD (``jax.jvp``, ``jax.jacfwd``) only on
    jax 0.10.2 under ``jax.check_tracer_leaks``, where it is a custom VJP (everywhere else it is a
    primitive with forward mode)."""


_FORWARD_MODE_MESSAGE = (
    "jaxmem.scan supports reverse-mode differentiation only (jax.grad, jax.vjp, jax.jacrev, "
    "jax.hessian) on jax 0.10.2 under jax.check_tracer_leaks: there it is a custom VJP (0.10.2 "
    "reports its primitive as a leaked tracer), and JAX cannot apply forward-mode autodiff "
    "(jax.jvp, jax.jacfwd, jax.linearize) to one. Turn the leak check off, or use jax >= 0.11."
)


def scan_residuals(f: Callable, init: Any, xs: Any = None, length: int | None = None, **kwargs):
    """The plan :func:`scan` makes for the gradient of one scan, next to what ``lax.scan`` stacks.

    Takes the arguments of :func:`scan`. Nothing is computed: the step is traced abstractly
    (arrays or :class:`jax.ShapeDtypeStruct` work alike). The plan is the one for a gradient with
    respect to everything: ``init``, ``xs`` and the floating-point arrays ``f`` closes over (its
    parameters, as in training).

    Args:
      f: the step, ``f(carry, x) -> (carry, y)``.
      init: the initial carry.
      xs: the scanned-over inputs, or None with ``length``.
      length: the number of steps.
      **kwargs: ``reverse``, ``unroll``, ``recompute``, ``policy``, ``offload``,
        ``checkpoints`` and ``compress`` as in :func:`scan` (under ``compress`` a kept value's
        ``bytes`` are its encoded size and its ``encoding`` names the format). With
        ``checkpoints`` the plan's ``schedule`` is the binomial schedule (checkpoints kept,
        forward steps in all, bytes kept).

    Returns:
      A :class:`ScanResiduals`: each residual of one step with its shape, dtype, bytes and kind
      (``xs``/``const``/``carry``/``ys``/``recomputed``/``stacked``), what is stacked per step,
      and the total stacked bytes for the whole scan next to ``lax.scan``'s.

    Raises:
      Whatever :func:`scan` raises for these arguments.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> w = jnp.ones((8, 8))
      >>> plan = jaxmem.scan_residuals(
      ...     lambda h, x: (jnp.tanh(h @ w + x),) * 2, jnp.zeros((4, 8)), jnp.ones((16, 4, 8)))
      >>> [(r.kind, r.bytes) for r in plan.stacked]  # kept per step: the ys, read back
      [('ys', 128)]
      >>> plan.stacked_bytes, plan.ratio <= 0.5  # lax.scan also stacks h and tanh's residuals
      (2048, True)
    """
    return _residual_plan(f, init, xs, length, kwargs, measure=False)


def measured_plan(f: Callable, init: Any, xs: Any = None, length: int | None = None, **kwargs):
    """:func:`scan_residuals`' plan with :attr:`ScanResiduals.compiled` for every loop that compiles
    alone (a rolled loop too: two more compilations, its gradient under ``lax.scan`` and under
    the program that runs it). What :meth:`jaxmem.Optimized.explain` reports: the stacks are
    not all that a gradient keeps (the backward step's temporaries, what XLA's schedule
    overlaps)."""
    return _residual_plan(f, init, xs, length, kwargs, measure=True)


def _residual_plan(f, init, xs, length, kwargs, *, measure: bool):
    known = {"reverse", "unroll", "recompute", "policy", "offload", "checkpoints", "compress"}
    unknown = set(kwargs) - known
    if unknown:
        raise TypeError(
            f"jaxmem.scan_residuals got unexpected keyword arguments: {sorted(unknown)}."
        )
    fname = "jaxmem.scan_residuals"
    checks.check_callable(f, "the body f(carry, x)", fname)
    for argname, tree in (("init", init), ("xs", xs)):
        _opts.check_leaves(tree, argname, fname, allow_structs=True)
    plans = []
    opts = _opts.ScanOptions.create(
        fname,
        policy=kwargs.get("policy"),
        offload=kwargs.get("offload"),
        recompute=kwargs.get("recompute", "auto"),
        unroll=kwargs.get("unroll", 1),
        checkpoints=kwargs.get("checkpoints"),
        compress=kwargs.get("compress"),
    )
    f, opts = opts.for_step(f)

    def trace(init, xs):
        loop = _primitive.trace_loop(f, init, xs, length, opts, diff_consts=True)
        n, slots = loop.length, loop.slots
        lean = loop.lean(bool(kwargs.get("reverse", False)), opts)
        step = lean.plan.step
        schedule = None
        if slots is not None:
            carry_bytes = sum(_jc.nbytes(v.aval) for v in step.carry_invars)
            schedule = _schedule.describe(n, slots, carry_bytes)
        stock = _stock_stacked_bytes(lean.body, step, n)
        summary = _summary.summarize(step, n, stock, schedule)
        unrolled = None if slots is not None else _primitive.unrolled_program(lean, loop)
        if unrolled is not None:
            choice, temps = unrolled
            summary = _summary.as_stock(summary) if choice in _unrolled.STOCK else summary
            if temps["stock"] is not None and temps[choice] is not None:
                summary = dataclasses.replace(summary, compiled=(temps["stock"], temps[choice]))
        elif measure and slots is None:
            temps = _primitive.loop_temps(lean, loop)
            if None not in temps:
                summary = dataclasses.replace(summary, compiled=temps)
        plans.append(summary)

    jax.eval_shape(trace, init, xs)
    return plans[0]


def scan(
    f: Callable,
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    _split_transpose: bool = False,
    *,
    recompute: str = "auto",
    policy: Callable | str | None = None,
    offload: str | tuple[str, ...] | None = None,
    checkpoints: int | str | None = None,
    compress: str | None = None,
):
    """Scans ``f`` over the leading axis of ``xs``, like :func:`jax.lax.scan`, with a lean VJP.

    The forward semantics, arguments and checks are those of :func:`jax.lax.scan`. The gradient
    is computed by a VJP that does not stack residuals that are xs slices or loop-invariant
    constants, keeps the carry sequence at most once and serves residuals equal to the carry or a
    ys output from it, recomputes cheap functions of those where that costs no step time
    (``recompute="auto"``), and stacks only the rest: the *partial activations*.
    :func:`jaxmem.scan_residuals` shows the plan.

    Args:
      f: the step, ``f(carry, x) -> (carry, y)``.
      init: the initial carry, a pytree of arrays.
      xs: a pytree of arrays with a common leading axis, or None (then ``length`` is required).
      length: the number of steps; must agree with the leading axis of ``xs``.
      reverse: scan from the end of ``xs`` to the start (outputs stay in ``xs`` order).
      unroll: loop unrolling, an int or a bool, passed to :func:`jax.lax.scan` (forward and
        backward loops).
      _split_transpose: accepted as :func:`jax.lax.scan` accepts it (Flax passes it), so that
        ``jax.lax.scan = jaxmem.scan`` runs a library's loops. It splits the transpose of
        ``lax.scan``'s own VJP, which jaxmem does not run: ``True`` warns and changes nothing
        (the values are the same either way).
      recompute: which residuals the backward step recomputes from the values it has, instead
        of stacking them. ``"cheap"``: every cheap function (elementwise, convert, transpose,
        reshape, broadcast, slice, select, ordering compare; never an exact float comparison,
        whose recompute could differ in rounding), the fewest bytes. ``"auto"`` (default): the
        cheap functions whose recompute fuses into the backward step (not a transpose of a
        computed value, on CPU) while the recomputes are priced within 5% of the step's time
        (:mod:`jaxmem._src.scan.recompute_cost`). ``"none"``: stacks them all.
      policy: a remat policy applied to each step, as ``jax.checkpoint(f, policy=policy)``
        (a :mod:`jaxmem.policies` policy, one of ``jax.checkpoint_policies``, or a preset name
        such as ``"nothing"``, ``"dots"`` or ``"dots_saveable"``, see
        :func:`jaxmem.policies.by_name`); the residuals it saves are then deduplicated as
        without a policy. ``"auto"``: the policy of the
        :func:`jaxmem.use_plan` active when the step is traced, and its ``checkpoints`` where
        this call gives none (no remat outside any plan, with a one-time warning); the plan is
        part of ``jax.jit``'s cache key.
      offload: keep stacked values in host memory (``pinned_host``) between the forward and the
        backward pass, each step's slice brought back in the backward loop: ``"residuals"`` (the
        partial activations), ``"carries"`` (the kept carry sequence), ``"all"``, or a tuple of
        checkpoint names (:func:`jaxmem.name`) selecting partial activations. On CPU this is the
        identity (results are bit-identical); on GPU/TPU the lowered loop carries host-placement
        annotations. With ``checkpoints``: ``"carries"`` or ``"all"`` keep the checkpoints in
        host memory between the forward and the backward pass (the other modes raise: nothing
        else is stacked).
      checkpoints: bound the memory of a long scan by the number of stored carries, for
        recomputation: ``None`` (default) stacks the partial activations of every step; an int
        ``k`` stores at most ``k`` carries (the initial one included; a ``k`` above the length is
        clamped to it) and reverses the scan with the binomial schedule of Griewank and Walther's
        Revolve, which evaluates the fewest forward steps for ``k`` stored carries (each step at
        most ``r + 1`` times, ``r`` the least integer with ``C(k + r, k) >= length``); ``"sqrt"``
        is ``k = ceil(sqrt(length))``. One step's activations are live at a time (its VJP is
        applied right after it is recomputed, under ``policy`` if given; ``recompute`` does not
        apply). :func:`scan_residuals` shows the schedule, :func:`step_counter` counts the steps
        evaluated. ``unroll`` applies to the forward sweep and the loop over steps, not to
        recomputation (a loop with a dynamic trip count).
      compress: store the float values kept for the backward pass (the partial activations
        and the kept carry sequence) in fewer bits, **lossy**: ``None`` (default, exact),
        ``"bf16"`` (rounded to bfloat16, 2 bytes a value), ``"fp8"`` (float8_e4m3fn) or
        ``"int8"``, the last two with one f32 scale per row of the last axis (its absolute
        maximum), 1 byte a value. Each value is encoded in the forward step and decoded in the
        backward step: the forward values are bit-identical to ``compress=None``'s and nothing
        is recomputed (the gradient's FLOPs are those of ``compress=None`` plus the codec's
        elementwise work). Masks (kept as bits), integers, xs, constants, the ys read back and
        the final carry are kept as they are; so is a value whose last axis is shorter than 16
        under ``"fp8"``/``"int8"`` (its scales would cost more than they save). Under
        ``"fp8"``/``"int8"`` a value that feeds ``exp`` in the step (attention scores, masked
        or not) is stored as bf16, and row statistics (a norm's mean and scale, softmax's
        maximum and sum) are kept exact under every format. The gradient is approximate:
        docs/compress.md has the measured errors (on a 4-layer transformer stack, a global
        relative error of 4.5e-4 for bf16, 6.9e-3 for fp8, 2.0e-3 for int8; more where a
        recurrence compounds it). It applies to first-order reverse mode (under ``jit``, ``vmap``,
        ``jax.checkpoint``); higher-order differentiation (``jax.hessian``, grad of grad)
        raises ``NotImplementedError``: no derivative flows through the kept integer bits.
        Not with ``checkpoints``. Kept only where the loop's gradient, compiled alone with and
        without it when the loop is first differentiated, has less temp with it; else the loop
        runs without it (exact, to any order) and warns ``option_noop``.

    Returns:
      ``(final_carry, stacked_ys)``, as :func:`jax.lax.scan`.

    Raises:
      TypeError: ``f`` not callable, a non-array leaf in ``init``/``xs`` (named by its path), a
        carry whose type changes across a step (both types shown), ``f`` not returning a pair.
      ValueError: leading-axis sizes that disagree with each other or with ``length`` (every
        size and path named), no ``xs`` and no ``length``, a bad ``recompute``, ``checkpoints``
        not positive or a string other than ``"sqrt"`` (a ``TypeError`` for a non-integer),
        ``checkpoints`` with an ``offload`` other than ``"carries"``/``"all"``, a ``compress``
        other than None, ``"bf16"``, ``"fp8"``, ``"int8"`` (or with ``checkpoints``).
      NotImplementedError: higher-order differentiation of a scan whose ``compress`` encodes
        a kept value.

    Every JAX transformation applies: forward mode (``jax.jvp``, ``jax.jacfwd``,
    ``jax.linearize``) computes ``lax.scan``'s JVP; ``jax.vmap`` keeps the lean VJP; grad of
    grad differentiates the backward pass (with ``checkpoints``, its recomputation loops run
    to the schedule's longest advance there, a static trip count). On jax 0.10.2 under
    ``jax.check_tracer_leaks`` the scan is a custom VJP: forward mode raises
    :class:`ForwardModeError`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> def loss(w, xs, h0):
      ...   def step(h, x):
      ...     h = jnp.tanh(h @ w + x)
      ...     return h, h
      ...   _, ys = jaxmem.scan(step, h0, xs)
      ...   return jnp.sum(ys**2)
      >>> w, xs, h0 = jnp.eye(3) * 0.5, jnp.ones((5, 2, 3)), jnp.zeros((2, 3))
      >>> g = jax.grad(loss)(w, xs, h0)
      >>> def stock(w, xs, h0):
      ...   _, ys = jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x),) * 2, h0, xs)
      ...   return jnp.sum(ys**2)
      >>> bool(jnp.allclose(g, jax.grad(stock)(w, xs, h0), rtol=1e-6))
      True
    """
    fname = "jaxmem.scan"
    _opts.check_split_transpose(_split_transpose, fname)
    opts = _opts.ScanOptions.create(
        fname,
        policy=policy,
        offload=offload,
        recompute=recompute,
        unroll=unroll,
        checkpoints=checkpoints,
        compress=compress,
    )
    return run_with(f, init, xs, length, bool(reverse), opts)


def run_with(f: Callable, init: Any, xs: Any, length: int | None, reverse: bool, opts):
    """:func:`scan` with its options checked already (a :class:`ScanOptions`, passed whole
    from an entry point such as a Flax layer, whose name the errors then carry).

    The loop's findings (:mod:`jaxmem._src.scan.lint`) are reported at the user's line that
    called it; :func:`jaxmem.lint` reads its options there and turns them off one at a time."""
    site = _findings.user_site()
    opts = dataclasses.replace(_hooks.called(site, opts), site=site)
    f, opts = opts.for_step(f)
    try:
        return _primitive.run(f, init, xs, length, reverse, opts, check=True)
    except (TypeError, NotImplementedError) as e:  # the custom VJP (jax_compat.hiprim_usable)
        # JAX's TypeError names forward mode; with jax_custom_vjp3 it is a bare
        # NotImplementedError, under a jvp the name stack shows.
        if not _jc.hiprim_usable() and ("forward-mode" in str(e) or _jc.in_forward_mode()):
            raise ForwardModeError(_FORWARD_MODE_MESSAGE) from e
        raise


def lax_scan(f: Callable, init: Any, xs: Any = None, *, policy: Any = None, **kwargs):
    """``jax.lax.scan(f, init, xs, **kwargs)`` with ``f`` under ``jax.checkpoint`` of ``policy``
    (a preset name or a policy; None: no remat): the stock loop, as a framework's remat runs it,
    bound from jaxmem (:func:`jaxmem.optimize` leaves the scans jaxmem binds as they are)."""
    return jax.lax.scan(_opts.apply_policy(f, policy, "jaxmem.optimize"), init, xs, **kwargs)


def scanned(fn: Callable | None = None, *, recompute: str = "auto", **scan_kwargs):
    """Turns a per-step function ``fn(carry, x)`` into ``g(init, xs, **kw)`` that runs :func:`scan`.

    Usable bare (``@jaxmem.scanned``) or with options (``@jaxmem.scanned(recompute="none")``).
    Keyword arguments of the call (``length``, ``reverse``, ``unroll``) override the decorator's.

    Args:
      fn: the step function ``fn(carry, x) -> (carry, y)``.
      recompute: as in :func:`scan`.
      **scan_kwargs: default ``length``/``reverse``/``unroll`` for :func:`scan`.

    Returns:
      The scanning function ``g(init, xs=None, **kw) -> (final_carry, ys)`` (or, without ``fn``,
      a decorator that makes one).

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> @jaxmem.scanned
      ... def cumsum(c, x):
      ...   return c + x, c + x
      >>> cumsum(0.0, jnp.arange(4.0))[1]
      Array([0., 1., 3., 6.], dtype=float32)
    """
    known = {"length", "reverse", "unroll", "policy", "offload", "checkpoints", "compress"}
    unknown = set(scan_kwargs) - known
    if unknown:
        raise TypeError(f"jaxmem.scanned got unexpected keyword arguments: {sorted(unknown)}.")
    names = ("policy", "offload", "unroll", "checkpoints", "compress")
    options = {k: scan_kwargs[k] for k in names if k in scan_kwargs}
    _opts.ScanOptions.create("jaxmem.scanned", recompute=recompute, **options)
    if fn is None:
        return functools.partial(scanned, recompute=recompute, **scan_kwargs)
    checks.check_callable(fn, "the step fn(carry, x)", "jaxmem.scanned")

    @functools.wraps(fn)
    def run(init, xs=None, **kw):
        opts = {**scan_kwargs, **kw}
        return scan(fn, init, xs, recompute=recompute, **opts)

    return run
