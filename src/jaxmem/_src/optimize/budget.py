"""``jaxmem.optimize(fn, budget=...)``: the program of least recompute whose compiled peak fits.

At the first call for each input signature the budget is planned: every :class:`Setting` (the
function as written, jaxmem's lean scans with the framework's remat kept or replaced, and
``lax.scan`` under each preset policy) is compiled ahead of time (nothing runs), its peak read
from ``memory_analysis()`` (temp + arguments + outputs - aliased) and its FLOPs from
``cost_analysis()``; the setting of fewest FLOPs whose peak is within the budget is taken (ties:
the smaller peak, then the earlier setting), or with ``objective="time"`` the fastest of those
that fit, timed on the machine at hand.

The steps: :func:`settings` (the candidates), :func:`measure` (compile each, in threads),
:func:`swaps` and :func:`combined` (where scans are called from several places: a setting per
call site, :class:`PerScan`), :func:`choose` (the objective over those within the budget),
:func:`unreachable` (the error when none fits).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import re
import statistics
import time as _time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._src import jax_compat as _jc
from jaxmem._src.remat import flops as _flops_mod
from jaxmem._src.remat import planner as _planner
from jaxmem._src.remat import policies as _policies

OBJECTIVES = ("flops", "time")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One way to run the function's scans, the same for every scan.

    Attributes:
      loop: ``"as written"`` (the function unchanged: its own ``lax.scan`` and remat),
        ``"jaxmem"`` (each scan as :func:`jaxmem.scan`, the lean residuals) or ``"lax"`` (each
        scan as ``lax.scan``, the step under ``jax.checkpoint`` of ``policy``).
      step_remat: ``"keep"`` the ``jax.checkpoint`` inside a scan's step (a framework's remat:
        ``jax.checkpoint``, ``nnx.remat``, ``eqx.filter_checkpoint``) or ``"drop"`` it (the same
        values; ``policy`` then decides what the gradient recomputes).
      policy: a :mod:`jaxmem.policies` preset name for each scan's step, or None (no remat).
      checkpoints: :func:`jaxmem.scan`'s ``checkpoints=`` (None: every step's residuals kept).
    """

    loop: str
    step_remat: str = "keep"
    policy: str | Callable | None = None
    checkpoints: str | int | None = None
    offload: str | None = None

    @property
    def key(self) -> str:
        """A short readable name, e.g. ``"lean, dots"`` or ``"lax.scan, full remat"``."""
        if self.loop == "as written":
            return "as written"
        loop = "lean" if self.loop == "jaxmem" else "lax.scan"
        if self.step_remat == "keep":
            parts = [loop, "own remat"]
        else:
            policy = self.policy
            if isinstance(policy, _policies.Save):
                policy = f"save {','.join(policy.names)}"
            parts = [loop, _POLICY_KEYS.get(policy, policy or "no remat")]
        if self.checkpoints is not None:
            parts.append(f"checkpoints={self.checkpoints}")
        if self.offload is not None:
            parts.append(f"offload={self.offload}")
        return ", ".join(parts)

    def options(self, base: Callable) -> Callable:
        """``base``'s options for a scan (``jaxmem.optimize``'s others: recompute, offload,
        compress) with this setting's ``policy`` and ``checkpoints``."""
        if self.step_remat == "keep":
            return base

        def options(found):
            given = dict(base(found), policy=self.policy)
            if self.loop == "jaxmem":
                given["checkpoints"] = self.checkpoints
                if self.offload is not None:
                    given["offload"] = self.offload
            return given

        return options

    def decision(self, base: Callable) -> Callable:
        """``Rewriter.decide``: this setting for every scan."""
        fixed = (self.loop, self.step_remat, self.options(base))
        return lambda found: fixed

    def for_source(self, source: str) -> Setting:
        """The setting of the scan called at ``source``: this one."""
        return self


@dataclasses.dataclass(frozen=True)
class PerScan:
    """A :class:`Setting` per scan, by where the scan is called (``file:line (function)``, as
    :attr:`~jaxmem._src.optimize.rewrite.Found.source`; the scans of one call site share it);
    the others run as ``rest``."""

    by_source: tuple[tuple[str, Setting], ...]
    rest: Setting

    @property
    def key(self) -> str:
        own = "; ".join(f"{_short(src)}: {s.key}" for src, s in self.by_source)
        return f"{own}; other scans: {self.rest.key}"

    def for_source(self, source: str) -> Setting:
        return dict(self.by_source).get(source, self.rest)

    def decision(self, base: Callable) -> Callable:
        def decide(found):
            s = self.for_source(found.source)
            return s.loop, s.step_remat, s.options(base)

        return decide


def _short(source: str) -> str:
    """``"path/to/model.py:12 (block)"`` -> ``"model.py:12"``."""
    return os.path.basename(source.split(" (")[0])


_POLICY_KEYS = {None: "no remat", "nothing": "full remat"}
AS_WRITTEN = Setting("as written")


def settings() -> tuple[Setting, ...]:
    """Step 1: the candidates, in the order ties go to: the function as written, jaxmem's lean
    scans (the step's own remat kept, or none), ``lax.scan`` under each preset policy (a
    framework's own choices). jaxmem's lean scans under a preset's policy measure as
    ``lax.scan``'s under it (the policy decides what is kept), so they are not tried."""
    lean = [Setting("jaxmem", "keep"), Setting("jaxmem", "drop")]
    lax = [Setting("lax", "drop", p) for p in (None, "dots", "dots_no_batch", "nothing")]
    return (AS_WRITTEN, *lean, *lax)


def _save(names) -> Setting:
    return Setting("lax", "drop", _policies.Save(tuple(sorted(names))))


def singles(names: Sequence[str]) -> tuple[Setting, ...]:
    """Where the steps name values (``jax.ad_checkpoint.checkpoint_name``: MaxText's layers, a
    user's): ``lax.scan`` saving each name alone, each measured against full remat by
    :func:`prefixes`."""
    return tuple(_save([n]) for n in sorted(names))


def prefixes(names: Sequence[str], trials: dict) -> tuple[Setting, ...]:
    """``lax.scan`` saving the first 2, 3, ... names ranked by the FLOPs each saves alone per
    byte of peak it adds (measured: ``trials`` maps a setting's key to its (peak, FLOPs), full
    remat's and each single name's among them); names that save no FLOPs alone are left out.
    A framework's name-based policies (MaxText's ``save_dot_except_mlp``: the projections, not
    the MLP) are such sets."""
    base = trials.get(Setting("lax", "drop", "nothing").key)
    if base is None:
        return ()
    gains = []
    for n in names:
        got = trials.get(_save([n]).key)
        if got is None or got[0] is None:
            continue
        saved, added = base[1] - got[1], got[0] - base[0]
        if saved > 0:
            gains.append((-saved / max(added, 1), n))
    ranked = [n for _, n in sorted(gains)]
    return tuple(_save(ranked[:k]) for k in range(2, len(ranked) + 1))


def swaps(sources: Sequence[str], base: Setting, others: Sequence[Setting]) -> tuple:
    """Where the function has scans at 2 or more call sites: ``base`` for every scan but one,
    that one under each of ``others`` (:func:`combined` joins the best of each)."""
    if len(sources) < 2:
        return ()
    return tuple(PerScan(((src, s),), base) for src in sources for s in others if s != base)


def combined(base: Setting, trials: dict, cands: Sequence, budget: int) -> PerScan | None:
    """The swaps of :func:`swaps` joined: for each call site, its swap of fewest FLOPs whose peak
    fits the budget (fewer than ``base``'s), or where ``base`` does not fit, of the smallest
    peak (smaller than ``base``'s); None where fewer than two call sites gain. ``trials`` maps a
    setting's key to its (peak, FLOPs)."""
    here = trials.get(base.key)
    if here is None or here[0] is None:
        return None
    fits = here[0] <= budget
    best: dict[str, tuple] = {}
    for c in cands:
        if not isinstance(c, PerScan) or c.rest != base or len(c.by_source) != 1:
            continue
        peak, flops = trials.get(c.key, (None, None))
        if peak is None:
            continue
        src, s = c.by_source[0]
        gain = (here[1] - flops, -peak) if fits else (here[0] - peak, -flops)
        if (fits and (peak > budget or flops >= here[1])) or (not fits and peak >= here[0]):
            continue
        if src not in best or gain > best[src][0]:
            best[src] = (gain, s)
    if len(best) < 2:
        return None
    return PerScan(tuple((src, s) for src, (_, s) in sorted(best.items())), base)


def fallbacks() -> tuple[Setting, ...]:
    """The candidates tried when none of :func:`settings` fits: ``checkpoints="sqrt"`` (each
    step recomputed from a stored carry, more FLOPs for less memory on long loops), and where
    the backend measures host offload (not on CPU, where it is the identity), the lean scans'
    residuals, or the stored carries, in host memory."""
    out = [Setting("jaxmem", "drop", None, "sqrt"), Setting("jaxmem", "drop", "nothing", "sqrt")]
    if _planner.offload_measurable():
        out += [
            Setting("jaxmem", "drop", None, offload="residuals"),
            Setting("jaxmem", "drop", None, "sqrt", offload="carries"),
        ]
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class BudgetTrial:
    """One setting as compiled (:attr:`BudgetPlan.trials`).

    Attributes:
      key: the setting, e.g. ``"as written"``, ``"lean, no remat"``, ``"lax.scan, dots"``.
      peak_bytes: the compiled peak, temp + arguments + outputs - aliased (None where it did
        not compile).
      flops: the compiled FLOPs (``cost_analysis``; None where it did not compile).
      seconds: the median step time under ``objective="time"`` (None where not timed).
      error: why it did not compile ("" where it did).

    Examples:
      >>> from jaxmem import BudgetTrial
      >>> print(BudgetTrial("lean, no remat", 3 * 2**20, 2.5e9))
      lean, no remat: peak 3.0 MiB, 2.500 GFLOPs
    """

    key: str
    peak_bytes: int | None
    flops: float | None
    seconds: float | None = None
    error: str = ""

    def __str__(self) -> str:
        if self.peak_bytes is None:
            return f"{self.key}: did not compile ({self.error})"
        timed = f", {self.seconds * 1e3:.2f} ms" if self.seconds is not None else ""
        return f"{self.key}: peak {_mib(self.peak_bytes)}, {self.flops / 1e9:.3f} GFLOPs{timed}"


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """What ``optimize(fn, budget=...)`` chose for one input signature.

    Attributes:
      budget_bytes: the budget.
      objective: ``"flops"`` or ``"time"``.
      chosen: the chosen :class:`BudgetTrial` (its ``key`` names the setting).
      as_written: the function as written, compiled the same way (its own remat).
      trials: every setting tried, in order.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> def loss(w, xs):
      ...     body = jax.checkpoint(lambda h, x: (jnp.tanh(h @ w + x), None))
      ...     return jnp.sum(jax.lax.scan(body, jnp.zeros(64), xs)[0])
      >>> step = jaxmem.optimize(jax.grad(loss), budget="64MiB")
      >>> plan = step.explain(jnp.eye(64), jnp.ones((32, 64))).budget
      >>> plan.chosen.peak_bytes <= plan.budget_bytes, plan.chosen.flops <= plan.as_written.flops
      (True, True)
    """

    budget_bytes: int
    objective: str
    chosen: BudgetTrial
    as_written: BudgetTrial
    trials: tuple[BudgetTrial, ...]

    def __str__(self) -> str:
        c, w = self.chosen, self.as_written
        lines = [
            f"budget {_mib(self.budget_bytes)}: {c.key}, peak {_mib(c.peak_bytes)}, "
            f"{c.flops / 1e9:.3f} GFLOPs ({_ratio(c.flops, w.flops)} of the function as written: "
            f"peak {_mib(w.peak_bytes)}, {w.flops / 1e9:.3f} GFLOPs)",
            "tried:",
        ]
        lines += [f"  {t}" for t in self.trials]
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if b else "n/a"


def peak_bytes(compiled) -> int:
    """A compiled program's peak: temp + arguments + outputs - aliased (per device).

    What ``optimize(fn, budget=B)`` keeps at or under ``B``; public as ``jaxmem.peak_bytes``.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxmem
        >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
        >>> jaxmem.peak_bytes(compiled) >= 32  # the 16-byte argument and output, at least
        True
    """
    m = compiled.memory_analysis()
    return int(
        m.temp_size_in_bytes
        + m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
    )


def abstract(x) -> jax.ShapeDtypeStruct:
    """An argument's shape and dtype, and its sharding where it is a concrete array."""
    concrete = isinstance(x, jax.Array) and not _is_tracer(x)
    sharding = x.sharding if concrete else None
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding)


def compile_many(
    run: Callable[[Setting], Callable], cands: Sequence[Setting], specs: Sequence, fast: bool
) -> list:
    """``jax.jit(run(setting))`` lowered at ``specs`` and compiled, for each setting, in threads
    (tracing is not thread-safe; XLA's compiles are, outside the GIL); an exception in place of
    a program that did not lower or compile. ``fast``: XLA's fast backend level on CPU."""
    lowered = []
    for s in cands:
        try:
            lowered.append(jax.jit(run(s)).lower(*specs))
        except Exception as e:  # noqa: BLE001 - recorded as the trial's error
            lowered.append(e)

    def compile_one(low):
        if isinstance(low, Exception):
            return low
        try:
            return _jc.compile_to_measure(low) if fast else low.compile()
        except Exception as e:  # noqa: BLE001 - recorded as the trial's error
            return e

    # Settings that lower to the same program (a framework's full remat and "lax.scan, full
    # remat"; a step with nothing to keep under two policies) are compiled once.
    first: dict[str, int] = {}
    which = [first.setdefault(_program_text(low), i) for i, low in enumerate(lowered)]
    distinct = sorted(set(which))
    workers = max(1, min(len(distinct), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        done = dict(
            zip(distinct, pool.map(compile_one, [lowered[i] for i in distinct]), strict=True)
        )
    return [done[i] for i in which]


def _program_text(low) -> str:
    """A lowered program's StableHLO without its module's name (the jitted function's), or a
    unique string for an exception (never shared)."""
    if isinstance(low, Exception):
        return f"error {id(low)}"
    return re.sub(r"^module @\S+", "module", low.as_text(), count=1)


def measure(
    run: Callable[[Setting], Callable], cands: Sequence[Setting], arrays: Sequence
) -> list[BudgetTrial]:
    """Step 2: each setting compiled at the arrays' shapes (XLA's fast backend level on CPU,
    whose buffer assignment and FLOPs are the same as the default's): its peak and FLOPs. The
    function as written must compile (its error is raised); another setting that does not is
    recorded with its error."""
    specs = [abstract(a) for a in arrays]
    out = []
    for s, comp in zip(cands, compile_many(run, cands, specs, fast=True), strict=True):
        if isinstance(comp, Exception):
            if s == AS_WRITTEN:
                raise comp
            out.append(BudgetTrial(s.key, None, None, error=f"{type(comp).__name__}: {comp}"))
        else:
            out.append(BudgetTrial(s.key, peak_bytes(comp), _flops_mod.compiled_flops(comp)))
    return out


# Measured settings by (function, its options, input signature, settings), and the names its
# steps use: each optimize(fn, budget=...) of one function and options shares them (they do not
# depend on the budget). The function is held with them, so that its id is not reused while the
# entry lives.
_MEASURED: collections.OrderedDict = collections.OrderedDict()
_MEASURED_SIZE = 32


def clear_caches() -> None:
    """Forget the budget planner's measured settings, as :func:`jax.clear_caches` does JAX's.

    The next ``optimize(fn, budget=...)`` measures again (what a cold start costs).

    Examples:
        >>> import jaxmem
        >>> jaxmem.clear_caches()
    """
    _MEASURED.clear()


def _cached(fn: Callable, full: tuple, compute: Callable[[], tuple]) -> tuple:
    hit = _MEASURED.get(full)
    if hit is not None and hit[0] is fn:
        _MEASURED.move_to_end(full)
        return hit[1]
    value = compute()
    _MEASURED[full] = (fn, value)
    while len(_MEASURED) > _MEASURED_SIZE:
        _MEASURED.popitem(last=False)
    return value


def measured(
    fn: Callable, key: tuple, run: Callable, cands: Sequence[Setting], arrays: Sequence
) -> list[BudgetTrial]:
    """:func:`measure`, cached by ``(fn, key, cands)`` (``key``: the options and the input
    signature) over every optimized function."""
    full = (id(fn), key, tuple(cands))
    return list(_cached(fn, full, lambda: tuple(measure(run, cands, arrays))))


def value_names(fn: Callable, key: tuple, run: Callable, arrays: Sequence) -> list[str]:
    """The checkpoint names the function's steps give values (a framework's name-based
    policies select them), found by one trace of ``run(AS_WRITTEN)``; cached as
    :func:`measured`."""

    def discover():
        found = _flops_mod.discover(run(AS_WRITTEN), [abstract(a) for a in arrays])
        return tuple(sorted({e.name for e in found}))

    return list(_cached(fn, (id(fn), key, "names"), discover))


def scan_sources(fn: Callable, key: tuple, find: Callable[[], list[str]]) -> list[str]:
    """The call sites of the function's outermost scans (``find()``: one trace), in the order
    met; cached as :func:`measured`."""
    return list(_cached(fn, (id(fn), key, "sources"), lambda: tuple(dict.fromkeys(find()))))


def timed(
    run: Callable[[Setting], Callable], cands: Sequence[Setting], arrays: Sequence
) -> list[float]:
    """Each setting's median step time in seconds on the arrays (zeros where they are tracers:
    the function called under an outer ``jit``), compiled in full, each run once untimed, then
    timed in interleaved rounds."""
    specs = [abstract(a) for a in arrays]
    compiled = compile_many(run, cands, specs, fast=False)
    for c in compiled:
        if isinstance(c, Exception):
            raise c
    return time_many(compiled, stand_ins(arrays))


# Timed settings within this fraction of the fastest are as fast (the timing's noise): the
# fewest FLOPs among them is taken, as on an accelerator.
_TIME_TIE = 0.02


def choose(
    trials: Sequence[BudgetTrial], budget: int, objective: str, timed: Callable | None = None
) -> tuple[int | None, list[BudgetTrial]]:
    """Step 3: the index of the trial chosen (None: none fits), and the trials (with their
    seconds where timed). ``timed(indices) -> seconds`` times the fitting trials for
    ``objective="time"`` (one of each set with the same peak and FLOPs: the same program)."""
    trials = list(trials)
    fits = [i for i, t in enumerate(trials) if t.peak_bytes is not None and t.peak_bytes <= budget]
    if not fits:
        return None, trials
    by_flops = lambda i: (trials[i].flops, trials[i].peak_bytes, i)
    if objective != "time" or timed is None:
        return min(fits, key=by_flops), trials
    distinct = list({(trials[i].peak_bytes, trials[i].flops): i for i in reversed(fits)}.values())
    distinct.sort()
    if len(distinct) == 1:
        return distinct[0], trials
    for i, sec in zip(distinct, timed(distinct), strict=True):
        trials[i] = dataclasses.replace(trials[i], seconds=sec)
    fastest = min(trials[i].seconds for i in distinct)
    near = [i for i in distinct if trials[i].seconds <= fastest * (1 + _TIME_TIE)]
    return min(near, key=by_flops), trials


def time_many(fns: Sequence[Callable], args: Sequence, rounds: int = 7) -> list[float]:
    """The median seconds of each function on ``args``, each run once untimed, then timed in
    interleaved rounds (A B C .. A B C ..)."""
    for f in fns:
        jax.block_until_ready(f(*args))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, f in enumerate(fns):
            t = _time.perf_counter()
            jax.block_until_ready(f(*args))
            times[i].append(_time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def stand_ins(arrays: Sequence) -> list:
    """Concrete arrays to time on: the arrays themselves, or host zeros where they are tracers
    (the function called under an outer ``jit``, where ``jnp.zeros`` would be traced too)."""
    return [np.zeros(np.shape(a), a.dtype) if _is_tracer(a) else a for a in arrays]


def _is_tracer(x) -> bool:
    return isinstance(x, _jc.Tracer)


def unreachable(caller: str, budget: int, trials: Sequence[BudgetTrial], chunk_loss: bool) -> str:
    """Step 4: the message when no setting fits: the smallest peak reached, and what would lower
    it further."""
    ok = [t for t in trials if t.peak_bytes is not None]
    low = min(ok, key=lambda t: t.peak_bytes)
    more = []
    if not _planner.offload_measurable():
        more.append(
            f"host offload (jaxmem.scan(offload=...); not measurable on {jax.default_backend()}, "
            "where it is the identity)"
        )
    if not chunk_loss:
        more.append("a chunked loss (chunk_loss=True, or jaxmem.losses.linear_cross_entropy)")
    more.append("a smaller batch or sequence, or more devices on the mesh")
    return (
        f"{caller}: budget={budget} bytes ({_mib(budget)}) is below the smallest reachable peak, "
        f"{low.peak_bytes} bytes ({_mib(low.peak_bytes)}, {low.key}). What would lower it "
        f"further: {'; '.join(more)}."
    )
