""":func:`optimize`: jaxmem's lean scans for a program written with ``lax.scan`` (directly or
through a library), with no change to its code."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._src import checks
from jaxmem._src import jax_compat as _jc
from jaxmem._src.chunking import autochunk as _autochunk
from jaxmem._src.frames import is_model_file
from jaxmem._src.optimize import budget as _budget
from jaxmem._src.optimize import intercept as _intercept
from jaxmem._src.optimize import rewrite as _rw
from jaxmem._src.optimize import swaps as _swaps
from jaxmem._src.remat import remat_plan as _remat_plan
from jaxmem._src.scan import api as _scan_api
from jaxmem._src.scan import findings as _findings
from jaxmem._src.scan import options as _opts


@dataclasses.dataclass(frozen=True)
class ScanReport:
    """One scan of the program: where it was called, and what its gradient keeps.

    Attributes:
      source: ``file:line (function)`` of the scan call, as the jaxpr records it (a library's
        line when a library made the scan).
      length: the number of steps.
      rewritten: whether it runs as :func:`jaxmem.scan`.
      why: why it was left alone ("" when rewritten).
      called_from: the line outside installed packages that led to the scan (the user's call
        of ``nn.scan`` say), when it differs from ``source``; else "".
      stock_bytes: the temp bytes of the gradient of the loop under ``lax.scan``, compiled
        alone (:attr:`jaxmem.ScanResiduals.compiled`): its stacked residuals and the backward step's
        temporaries, as XLA schedules them. Under ``checkpoints=``, or where the loop does not
        compile alone (its types name a ``shard_map``'s manual axes), what ``lax.scan``
        stacks; None where neither is known.
      kept_bytes: the same for the program that runs the loop (:func:`jaxmem.scan`'s lean VJP,
        or the program chosen for a loop unrolled whole); under ``checkpoints=`` or where it
        does not compile alone, what :func:`jaxmem.scan` stacks.
      saved_bytes: the temp bytes the function's ``jax.value_and_grad`` (with respect to its
        float arguments) saves when this scan alone is rewritten, both programs compiled
        whole: the loop's saving as XLA schedules it among the rest of the function. None
        where the function does not return one float scalar (a loss), or for a scan nested in
        another scan's step.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> def loss(w, xs):
      ...     h, ys = jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x),) * 2, jnp.zeros(4), xs)
      ...     return jnp.sum(ys)
      >>> (scan,) = jaxmem.optimize(loss).explain(jnp.eye(4), jnp.ones((8, 4))).scans
      >>> scan.rewritten, scan.length, scan.kept_bytes < scan.stock_bytes
      (True, 8, True)
    """

    source: str
    length: int
    rewritten: bool
    why: str = ""
    called_from: str = ""
    stock_bytes: int | None = None
    kept_bytes: int | None = None
    saved_bytes: int | None = None

    @property
    def where(self) -> str:
        """The scan's line, the model's line first: where the scan is a framework's
        (``nnx.scan``, ``nn.scan``: its ``source`` is in the framework's transform internals),
        the user's line that led to it, then the framework's line.

        Examples:
          >>> ScanReport("/u/model.py:3:8 (loss)", 4, True).where
          '/u/model.py:3:8 (loss)'
        """
        if self.called_from and not is_model_file(self.source.split(":", 1)[0]):
            return f"{self.called_from} (through {self.source})"
        return self.source + (f", called from {self.called_from}" if self.called_from else "")

    def __str__(self) -> str:
        if not self.rewritten:
            return f"left alone: scan at {self.where}: {self.why}"
        kept = ""
        if self.stock_bytes is not None and self.kept_bytes is not None:
            kept = f", kept {_mib(self.stock_bytes)} -> {_mib(self.kept_bytes)}"
        if self.saved_bytes is not None:
            kept += f", the gradient's temp {_mib(self.saved_bytes)} less"
        return f"rewritten: scan of {self.length} steps at {self.where}{kept}"


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What :func:`optimize` does to a function at given arguments (``optimize(f).explain``):
    one :class:`ScanReport` per scan, the budget's plan (``budget=``), and under
    ``chunk_tokens=True`` one line per attention run blocked and per token-wise region run in
    chunks (``chunked``).

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> print(jaxmem.optimize(jnp.sin).explain(jnp.ones(3)))
      no scan found: the function runs unchanged
    """

    scans: tuple[ScanReport, ...]
    budget: _budget.BudgetPlan | None = None  # the budget's plan (optimize(..., budget=...))
    # chunk_tokens=True: one line per attention run blocked and per token-wise region chunked.
    chunked: tuple[str, ...] = ()

    def __str__(self) -> str:
        unchanged = "no scan found" + ("" if self.chunked else ": the function runs unchanged")
        lines = [str(s) for s in self.scans] or [unchanged]
        lines += self.chunked
        if self.budget is not None:
            lines.append(str(self.budget))
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Split:
    """The arguments' leaves: the arrays (traced) and the rest (static), and how to merge them
    back into ``(args, kwargs)``."""

    leaves: list
    tree: Any
    dynamic: list  # per leaf: an array

    @classmethod
    def of(cls, args, kwargs) -> _Split:
        leaves, tree = jax.tree.flatten((args, kwargs))
        return cls(leaves, tree, [_is_array(x) for x in leaves])

    @property
    def arrays(self) -> list:
        return [x for x, d in zip(self.leaves, self.dynamic, strict=True) if d]

    def merge(self, arrays):
        """``(args, kwargs)`` with ``arrays`` in place of the array leaves."""
        it = iter(arrays)
        full = [next(it) if d else x for x, d in zip(self.leaves, self.dynamic, strict=True)]
        return jax.tree.unflatten(self.tree, full)


def _split_outputs(result) -> tuple[list, Any, dict]:
    """The function's outputs: the leaves JAX computed, the tree, and the other leaves by
    index (returned as they are)."""
    out, tree = jax.tree.flatten(result)
    static = {i: x for i, x in enumerate(out) if not _is_traced_output(x)}
    return [x for i, x in enumerate(out) if i not in static], tree, static


_DEFAULT = _budget.Setting("jaxmem", "keep")  # every scan as jaxmem.scan, its step as written


def _signature(tree, leaves: list, dynamic: list) -> tuple:
    """What a budget's plan depends on: the tree, each array's shape, dtype and sharding over
    several devices (an array on one device and a tracer under ``jit`` share a plan), and the
    static leaves (by value where hashable, else by identity)."""
    parts = []
    for x, d in zip(leaves, dynamic, strict=True):
        if d:
            spec = _budget.abstract(x)
            sharding = spec.sharding
            if sharding is not None and len(sharding.device_set) <= 1:
                sharding = None
            parts.append((spec.shape, str(spec.dtype), sharding))
        else:
            try:
                hash(x)
                parts.append(("static", x))
            except TypeError:
                parts.append(("static id", id(x)))
    return (tree, tuple(parts))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Optimized:
    """``fn`` with every reachable ``lax.scan`` run as :func:`jaxmem.scan` (:func:`optimize`).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> cumsum = jaxmem.optimize(lambda xs: jax.lax.scan(lambda c, x: (c + x,) * 2, 0.0, xs)[1])
      >>> cumsum(jnp.arange(4.0)).tolist()
      [0.0, 1.0, 3.0, 6.0]
    """

    def __init__(
        self,
        fn: Callable,
        options: Callable,
        chunk_loss: bool,
        budget: int | None = None,
        objective: str = "flops",
        options_key: str | None = None,
        plan: Any = None,
        op_names: bool = False,
        chunk_tokens: bool = False,
    ):
        self._fn = fn
        self._chunk_tokens = chunk_tokens
        self._shared_tokens: _rw.Tokens | None = None  # a train step's, for its loss
        self._plan = plan  # a jaxmem.RematPlan applied to every scan (policy="auto"), or None
        self._op_names = op_names  # the steps' values named by op kind (rewrite.op_kind)
        self._options_key = options_key  # the options as given, for sharing a budget's trials
        self._options = options
        self._chunk_loss = chunk_loss
        self._budget = budget
        self._objective = objective
        self._plans: dict = {}  # input signature -> (BudgetPlan, Setting)
        functools.update_wrapper(self, fn)

    def _traced(self, args, kwargs, caught: _rw.Rewriter):
        """The function's jaxpr at these arguments (static: every leaf that is not an array),
        and its outputs: the tree, and the leaves that are not JAX arrays (a string tag, a Python
        number: returned as they are, as the function returns them). Each scan the function
        differentiates itself runs through ``caught`` (:mod:`~jaxmem._src.optimize.intercept`)."""
        split = _Split.of(args, kwargs)
        outputs = []

        swap = contextlib.nullcontext()
        if caught.tokens is not None:
            wrap = functools.partial(self._differentiated, tokens=caught.tokens)
            swap = _swaps.swapping(caught.tokens.attentions, wrap)

        def flat(*arrays):
            a, k = split.merge(arrays)
            with _intercept.catching(caught), swap:
                result = self._fn(*a, **k)
            computed, t, static = _split_outputs(result)
            outputs.append((t, static))
            return computed

        arrays = split.arrays
        closed = jax.make_jaxpr(flat)(*arrays)
        return closed, arrays, outputs[-1]

    def __call__(self, *args, **kwargs):
        setting = _DEFAULT if self._budget is None else self._planned(args, kwargs)[1]
        if self._plan is None:
            computed, (out_tree, static) = self._run(setting, args, kwargs)
        else:
            with _remat_plan.use_plan(self._plan):
                computed, (out_tree, static) = self._run(setting, args, kwargs)
        computed = iter(computed)
        n = out_tree.num_leaves
        return jax.tree.unflatten(
            out_tree, [static[i] if i in static else next(computed) for i in range(n)]
        )

    def budget_plan(self, *args, **kwargs) -> _budget.BudgetPlan:
        """The budget's plan at these arguments (planned at the first call for their
        signature: every setting compiled, nothing run; then cached).

        Raises:
          ValueError: no budget was given, or no setting fits it.
        """
        if self._budget is None:
            raise ValueError("jaxmem.optimize: budget_plan needs optimize(..., budget=...)")
        return self._planned(args, kwargs)[0]

    def _rewriter(self, setting, **kw) -> _rw.Rewriter:
        """A rewriter running each scan as ``setting`` (a budget's Setting or PerScan) says."""
        return _rw.Rewriter(
            self._options, op_names=self._op_names, decide=setting.decision(self._options), **kw
        )

    def _differentiated(self, fun: Callable, tokens: _rw.Tokens) -> Callable:
        """Under ``chunk_tokens=True``: what a ``jax.grad`` / ``jax.value_and_grad`` the function
        calls while traced differentiates in place of ``fun`` (a train step's loss): ``fun``
        run as this optimizes it, so that its tail is chunked as a loss given to it is; what
        it swaps and chunks is reported in ``tokens``, this trace's."""
        if isinstance(fun, Optimized):
            return fun
        inner = Optimized(fun, self._options, False, chunk_tokens=True, op_names=self._op_names)
        inner._shared_tokens = tokens
        return inner

    def _tokens(self) -> _rw.Tokens | None:
        """What one trace and its evaluation share under ``chunk_tokens=True`` (the lists of
        what is swapped and chunked: an outer trace's, for a train step's loss)."""
        if not self._chunk_tokens:
            return None
        outer = self._shared_tokens
        if outer is None:
            return _rw.Tokens()
        return _rw.Tokens(attentions=outer.attentions, chunked=outer.chunked)

    def _scan_sources(self, args, kwargs) -> list[str]:
        """Where the function's outermost scans are called (one trace), in the order met; not
        those with no source (a scan JAX binds again, as under a ``jax.checkpoint`` of the
        loss: the same loop, which follows the other scans' setting)."""
        sources: list[str] = []
        record = lambda found: found.source and sources.append(found.source)
        closed, arrays, _ = self._traced(args, kwargs, self._rewriter(_DEFAULT, on_found=record))
        rest = _rw.Rewriter(self._options, rewrite=False, on_found=record)
        jax.eval_shape(lambda *a: rest.eval_closed(closed, a), *arrays)
        return sources

    def _run(self, setting: _budget.Setting, args, kwargs):
        """The function's array outputs under ``setting``, and (the output tree, its static
        leaves)."""
        if setting == _budget.AS_WRITTEN:
            computed, tree, static = _split_outputs(self._fn(*args, **kwargs))
            return computed, (tree, static)
        # A budget's other settings are jaxmem's choices, not the user's: their loops report
        # nothing (jaxmem.lint, LintWarning). The default runs the options as the user gave them.
        quiet = _findings.collecting() if setting != _DEFAULT else contextlib.nullcontext()
        with quiet:
            tokens = self._tokens()
            caught = self._rewriter(setting, tokens=tokens)
            closed, arrays, outputs = self._traced(args, kwargs, caught)
            if tokens is not None and self._shared_tokens is None and not tokens.attentions:
                _swaps.warn_no_attention()
            rewriter = self._rewriter(setting, tokens=tokens)
            run = lambda *a: rewriter.eval_closed(closed, a)
            if self._chunk_loss:
                run = _autochunk.autochunk(run)
            elif self._chunk_tokens:  # a loss's tail the regions did not take (see explain)
                run = _autochunk.autochunk(run, warn=False)
            return run(*arrays), outputs

    def _planned(self, args, kwargs):
        """The budget's plan for these arguments' signature: ``(BudgetPlan, Setting)``, planned
        at the first call (every setting compiled; nothing runs)."""
        split = _Split.of(args, kwargs)
        arrays = split.arrays
        key = _signature(split.tree, split.leaves, split.dynamic)
        if key in self._plans:
            return self._plans[key]

        def run(setting):
            return lambda *a: self._run(setting, *split.merge(a))[0]

        shared = (self._options_key, self._chunk_loss, key)  # None: this object's own
        shared = shared if self._options_key is not None else (id(self), key)
        names = _budget.value_names(self._fn, shared, run, arrays)
        cands = [*_budget.settings(), *_budget.singles(names)]
        trials = _budget.measured(self._fn, shared, run, cands, arrays)
        more = _budget.prefixes(names, {t.key: (t.peak_bytes, t.flops) for t in trials})
        cands += more
        trials += _budget.measured(self._fn, shared, run, more, arrays) if more else []
        # Scans at several call sites: each under another setting, the others as the best
        # uniform one (or the leanest where none fits), then the best swap of each joined.
        sources = _budget.scan_sources(
            self._fn, shared, lambda: self._scan_sources(*split.merge(arrays))
        )
        base = _budget.choose(trials, self._budget, "flops")[0]
        if base is None:
            base = min(
                (i for i, t in enumerate(trials) if t.peak_bytes is not None),
                key=lambda i: trials[i].peak_bytes,
            )
        uniform = [c for c in _budget.settings() if c != cands[base]]
        more = list(_budget.swaps(sources, cands[base], uniform))
        trials += _budget.measured(self._fn, shared, run, more, arrays) if more else []
        cands += more
        joined = _budget.combined(
            cands[base], {t.key: (t.peak_bytes, t.flops) for t in trials}, cands, self._budget
        )
        if joined is not None:
            trials += _budget.measured(self._fn, shared, run, [joined], arrays)
            cands.append(joined)
        timed = lambda indices: _budget.timed(run, [cands[i] for i in indices], arrays)
        pick, trials = _budget.choose(trials, self._budget, self._objective, timed)
        if pick is None:
            cands += _budget.fallbacks()
            trials += _budget.measured(self._fn, shared, run, cands[len(trials) :], arrays)
            pick, trials = _budget.choose(trials, self._budget, self._objective, timed)
        if pick is None:
            raise ValueError(
                _budget.unreachable("jaxmem.optimize", self._budget, trials, self._chunk_loss)
            )
        plan = _budget.BudgetPlan(
            self._budget, self._objective, trials[pick], trials[0], tuple(trials)
        )
        self._plans[key] = (plan, cands[pick])
        return self._plans[key]

    def explain(self, *args, **kwargs) -> Explanation:
        """Each scan of the function at these arguments: rewritten (with the temp bytes of its
        gradient, ``lax.scan``'s and jaxmem's, each loop compiled alone: two compilations per
        scan; for a loss, what the loss's gradient saves by it: one compilation more per scan
        and one of the loss as it is) or left alone, and why."""
        plan, setting = (None, _DEFAULT) if self._budget is None else self._planned(args, kwargs)
        reports = []
        # The scans the function differentiates itself run as jaxmem.scan (as when called); each
        # is measured where it is met, its differentiation's trace live (those nested in its
        # step are not listed apart).
        options = lambda found: setting.for_source(found.source).options(self._options)(found)
        measure = lambda found: reports.extend(_measured([found], options))
        tokens = self._tokens()
        caught = self._rewriter(setting, on_found=measure, tokens=tokens)
        closed, arrays, _ = self._traced(args, kwargs, caught)
        rewriter = _rw.Rewriter(self._options, rewrite=False)
        outer = []

        def run(*a):
            rewriter.eval_closed(closed, a)
            outer.append(len(rewriter.found))  # those after it are nested in a scan's step
            reports.extend(_measured(rewriter.found, options))
            return []

        jax.eval_shape(run, *arrays)
        if not caught.found:  # the loss's own gradient, where the function does not take one
            saved = _savings_in_context(closed, arrays, options, outer[0])
            reports[: len(saved)] = [
                dataclasses.replace(r, saved_bytes=b) for r, b in zip(reports, saved, strict=False)
            ]
        # The scans the budget's plan runs as lax.scan or as written.
        reports = [
            r
            if (s := setting.for_source(r.source)).loop == "jaxmem"
            else ScanReport(r.source, r.length, False, _runs_as(s), r.called_from)
            for r in reports
        ]
        for source, why in _rw.left_alone(_jc.open_jaxpr(closed)):
            reports.append(ScanReport(source, 0, False, why))
        return Explanation(tuple(reports), plan, self._chunk_report(tokens, closed, arrays))

    def _chunk_report(self, tokens, closed, arrays) -> tuple[str, ...]:
        """Under ``chunk_tokens=True``: the attentions run blocked and the regions chunked (the
        function evaluated once more, abstractly, to find the regions of its own jaxpr)."""
        if tokens is None:
            return ()
        rewriter = _rw.Rewriter(self._options, tokens=tokens)
        jax.eval_shape(lambda *a: rewriter.eval_closed(closed, a), *arrays)
        lines = [f"attention at {where}: blocked ({t} x {s})" for t, s, where in tokens.attentions]
        if not tokens.attentions:
            lines.append(_swaps.NO_ATTENTION)
        return (*lines, *(f"chunked: {c}" for c in dict.fromkeys(tokens.chunked)))


def _runs_as(setting: _budget.Setting) -> str:
    if setting.loop == "as written":
        return "the budget's plan runs it as written"
    return f"the budget's plan runs it as {setting.key}"


def _measured(found: list, options: Callable) -> list[ScanReport]:
    """A report of each scan of ``found``, those its steps' evaluation adds to it included (a
    scan nested in another's step), with the temp bytes of its gradient compiled alone."""
    reports = []
    for scan in found:  # grows while a step is evaluated
        stock = kept = None
        try:
            plan = _scan_api.measured_plan(
                scan.step,
                list(scan.init),
                list(scan.xs) if scan.xs else None,
                length=scan.length,
                reverse=scan.reverse,
                unroll=scan.unroll,
                **_plan_options(options(scan)),
            )
            stock, kept = plan.compiled or (plan.stock_stacked_bytes, plan.stacked_bytes)
        except Exception:  # noqa: BLE001 - a listing only; the rewrite itself is tested
            pass
        reports.append(
            ScanReport(scan.source, scan.length, True, "", scan.called_from, stock, kept)
        )
    return reports


def by_op_kind(fn: Callable) -> Optimized:
    """``fn`` with each scan a ``policy="auto"`` :func:`jaxmem.scan` and its step's values named
    by op kind (:func:`~jaxmem._src.optimize.rewrite.op_kind`): what :func:`jaxmem.plan` plans
    on a program that names none (``optimize(fn, plan=p)`` applies the plan)."""
    return Optimized(fn, lambda found: {"policy": "auto"}, False, op_names=True)


def _savings_in_context(closed, arrays: list, options: Callable, count: int) -> list[int]:
    """For each of the first ``count`` scans met outside any scan's step: the temp bytes of the
    function's ``value_and_grad`` (with respect to its float arguments) under ``lax.scan`` less
    that with this scan alone rewritten. ``[]`` where the function is not a loss (one float
    scalar) or a program does not compile."""

    def evaluate(only, a):
        return _rw.Rewriter(options, rewrite=only is not None, only=only).eval_closed(closed, a)

    out = jax.eval_shape(lambda *a: evaluate(None, a), *arrays)
    floats = [i for i, x in enumerate(arrays) if jnp.issubdtype(x.dtype, jnp.floating)]
    if (
        count == 0
        or not floats
        or len(out) != 1
        or out[0].shape != ()
        or not jnp.issubdtype(out[0].dtype, jnp.floating)
    ):
        return []
    others = [x for i, x in enumerate(arrays) if i not in floats]

    def temp(only) -> int:
        def loss(params, rest):
            p, r = iter(params), iter(rest)
            a = [next(p) if i in floats else next(r) for i in range(len(arrays))]
            return evaluate(only, a)[0]

        grad = jax.jit(jax.value_and_grad(loss))
        compiled = _jc.compile_to_measure(grad.lower([arrays[i] for i in floats], others))
        return compiled.memory_analysis().temp_size_in_bytes

    try:
        stock = temp(None)
        return [stock - temp(i) for i in range(count)]
    except Exception:  # noqa: BLE001 - a listing only; the per-loop figures stand
        return []


def _plan_options(options: dict) -> dict:
    return {k: v for k, v in options.items() if k in ("recompute", "policy", "offload", "compress")}


def _is_traced_output(x) -> bool:
    """An output leaf the function computed with JAX (an array or a tracer); any other leaf (a
    string, a Python number, a NumPy array) depends on no argument and passes through."""
    return isinstance(x, (jax.Array, _jc.Tracer))


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or isinstance(x, _jc.Tracer)


def _check_budget(budget, objective, policy, checkpoints, options, fname: str):
    """``budget`` read as bytes (None stays None), checked against the options it excludes,
    and ``objective`` with it."""
    if objective not in _budget.OBJECTIVES:
        raise ValueError(
            f"{fname}: objective must be one of {', '.join(map(repr, _budget.OBJECTIVES))}, "
            f"got {objective!r}"
        )
    if budget is None:
        if objective != "flops":
            raise TypeError(
                f"{fname}: objective={objective!r} is the budget's; pass budget= with it"
            )
        return None
    budget = checks.byte_count(budget, "budget", fname)
    if policy is not None or checkpoints is not None or options is not None:
        raise TypeError(
            f"{fname}: budget= chooses each scan's policy and checkpoints; pass budget= or "
            "policy/checkpoints/options, not both"
        )
    return budget


def optimize(
    fn: Callable | None = None,
    *,
    recompute: str = "auto",
    policy: Any = None,
    offload: Any = None,
    checkpoints: Any = None,
    compress: str | None = None,
    chunk_loss: bool = False,
    options: Callable | None = None,
    budget: int | float | str | None = None,
    objective: str = "flops",
    plan: Any = None,
    chunk_tokens: bool = False,
):
    """``fn`` with every ``lax.scan`` it runs replaced by :func:`jaxmem.scan`, its code unchanged.

    The function is traced to a jaxpr at each call and evaluated equation by equation; each
    ``scan`` equation (``lax.scan``, ``lax.map``, a ``fori_loop`` with static bounds, and the scans
    Flax's ``nn.scan`` / ``nnx.scan`` and Equinox stacks make) runs as :func:`jaxmem.scan` with its
    own length, ``reverse`` and ``unroll``, the step evaluated the same way (nested scans, the
    step's ``jax.checkpoint`` policy and checkpoint names kept). Scans inside ``jit`` (inlined:
    an inner ``jit``'s ``in_shardings`` / ``out_shardings`` are not re-applied; the outer jit's
    and the arrays' shardings are), ``jax.checkpoint``, ``cond`` branches and ``shard_map``
    bodies are reached; those inside a
    ``custom_vjp`` function (its own gradient), a ``custom_jvp`` function or a ``while_loop`` are
    left alone. Apply it to the loss (``jax.grad(jaxmem.optimize(loss))``) or to a function that
    differentiates inside (a train step's ``jax.value_and_grad``, ``jax.grad``, ``jax.vjp``):
    each scan its own reverse-mode differentiation meets is caught where ``lax.scan`` binds its
    primitive and runs as :func:`jaxmem.scan` (forward mode leaves it to JAX). It composes
    with ``jax.jit``, ``jax.vmap`` and meshes. Array leaves of the arguments are traced; other
    leaves (Python numbers, strings, flags) are static, as with ``equinox.filter_jit``.

    Args:
      fn: the function (usable as ``@jaxmem.optimize`` or ``@jaxmem.optimize(...)``).
      recompute, policy, offload, checkpoints, compress: :func:`jaxmem.scan`'s options, for
        every scan (``compress``: the kept float values in fewer bits, lossy; docs/compress.md).
      chunk_loss: also run :func:`jaxmem.autochunk` on the function (a scalar loss whose tail is
        row-wise is computed in chunks).
      options: ``options(scan) -> dict``, :func:`jaxmem.scan`'s options for one scan (it has
        ``.source``, ``.length``, ``.reverse``, ``.init`` and ``.xs``), in place of the five above.
      budget: the compiled peak of ``jax.jit`` of the result (temp + arguments + outputs -
        aliased, per device) to fit: bytes as an int or a float, or a string (``"48MiB"``,
        ``"1.5GB"``, ``"8GiB"``). At the first call for each input signature every setting of
        the scans (the function as written, jaxmem's lean scans with the step's own remat kept
        or dropped, ``lax.scan`` under each preset policy; ``checkpoints="sqrt"`` where none of
        those fits) is compiled, nothing run, and the one of fewest FLOPs within the budget
        runs (docs/budget.md). :meth:`Optimized.budget_plan` shows the choice.
      objective: with ``budget``: ``"flops"`` (the fewest FLOPs; ties to the smaller peak) or
        ``"time"`` (the fastest fitting setting, timed here after an untimed run).
      plan: a :class:`jaxmem.RematPlan` from :func:`jaxmem.plan` for every scan (run as
        ``policy="auto"`` stacks under it; a plan of unmodified code names the steps' values by
        op kind, as it was planned).
      chunk_tokens: long context (docs/long_context.md): each ``jax.nn.dot_product_attention``
        on its XLA path (Flax's ``nnx.dot_product_attention`` and ``nnx.MultiHeadAttention``
        without dropout or sown weights included) runs as :func:`jaxmem.attention`, and every
        token-wise region (norms, projections, the MLP, the LM head and its loss: the
        equations that map each position on its own) whose largest intermediate is over 4 MiB
        runs in chunks of tokens, its gradient recomputing each chunk; the gradient's temp then
        grows linearly with the sequence length. Unless ``policy``, ``options``, ``plan`` or
        ``budget`` says otherwise, each scan then keeps its step's inputs alone for the
        backward (``policy=jax.checkpoint_policies.nothing_saveable``), its step recomputed
        chunk by chunk. In a function that differentiates inside, the ``jax.grad`` and
        ``jax.value_and_grad`` it calls differentiate their function run as ``optimize`` runs
        it (its loss head chunked too). ``explain`` lists what was chunked. With no such
        attention, nothing is (the lengths are the attentions'): it warns ``option_noop``.

    Returns:
      An :class:`Optimized` function with ``fn``'s signature and ``.explain(*args, **kwargs)``.

    Raises:
      TypeError: ``fn`` not callable, ``options`` given with any of the four options,
        ``budget`` with ``policy``, ``checkpoints`` or ``options``, ``plan`` with ``budget``,
        ``policy``, ``checkpoints`` or ``options`` or not a RematPlan, ``objective`` without
        ``budget``.
      ValueError: a bad option (as :func:`jaxmem.scan` raises it), a negative or malformed
        budget, an unknown objective; at the first call, a budget no setting fits (the message
        gives the smallest peak reached and what would lower it).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> def loss(w, xs):
      ...     h, _ = jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), jnp.zeros(4), xs)
      ...     return jnp.sum(h**2)
      >>> w, xs = jnp.eye(4) * 0.5, jnp.ones((8, 4))
      >>> g = jax.grad(jaxmem.optimize(loss))(w, xs)
      >>> bool(jnp.allclose(g, jax.grad(loss)(w, xs), rtol=1e-5))
      True
      >>> print(jaxmem.optimize(loss).explain(w, xs))  # doctest: +ELLIPSIS
      rewritten: scan of 8 steps at ...
    """
    fname = "jaxmem.optimize"
    given = dict(
        recompute=recompute,
        policy=policy,
        offload=offload,
        checkpoints=checkpoints,
        compress=compress,
    )
    if options is not None:
        if any(v is not None for k, v in given.items() if k != "recompute") or recompute != "auto":
            raise TypeError(
                f"{fname}: pass either options= (a function of the scan) or recompute/policy/"
                "offload/checkpoints/compress, not both"
            )
        choose = options
        options_key = None
    else:
        _opts.ScanOptions.create(fname, **given)  # checked once, here
        choose = lambda found: dict(given)
        options_key = repr(sorted(given.items()))
    if plan is not None:
        if not isinstance(plan, _remat_plan.RematPlan):
            raise TypeError(f"{fname}: plan must be a jaxmem.RematPlan, got {type(plan).__name__}")
        if budget is not None or policy is not None or checkpoints is not None or options:
            raise TypeError(
                f"{fname}: plan= decides each scan's policy and checkpoints; pass plan= or "
                "budget/policy/checkpoints/options, not both"
            )
        given["policy"] = "auto"  # every scan as a policy="auto" stack, resolved by the plan
    budget = _check_budget(budget, objective, policy, checkpoints, options, fname)
    if not isinstance(chunk_tokens, bool):
        raise TypeError(f"{fname}: chunk_tokens must be True or False, got {chunk_tokens!r}")
    if chunk_tokens and options is None and plan is None and budget is None and policy is None:
        # Long context: a layer keeps its input alone for the backward, the rest recomputed
        # (chunk by chunk), as MsT does; what a layer would keep grows with the sequence.
        given["policy"] = jax.checkpoint_policies.nothing_saveable
        choose = lambda found: dict(given)
    if chunk_tokens:
        options_key = None if options_key is None else repr(sorted(given.items())) + " tokens"

    def make(f):
        checks.check_callable(f, "fn", fname)
        op_names = plan is not None and plan.op_names
        return Optimized(
            f, choose, chunk_loss, budget, objective, options_key, plan, op_names, chunk_tokens
        )

    return make if fn is None else make(fn)
