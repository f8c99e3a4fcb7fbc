"""A memory-budget planner: which checkpoint names to save so the gradient fits a budget.

:func:`plan` chooses what ``policy="auto"`` means for a loss's layer stacks so that the
compiled gradient's temp memory (XLA's ``memory_analysis().temp_size_in_bytes``) fits
``budget`` with as little recomputation (``cost_analysis()`` FLOPs above the no-remat
gradient's) as it can find. The compiler decides: estimates only order the search, and every
plan returned was compiled and measured. The search is a sequence of named steps:

1. :func:`_discover`: the names the loss uses, each with a cheap estimate of the bytes saving it
   costs (its value's size, times the length of the loops around it) and of the FLOPs that
   saving it avoids recomputing (the equations between it and the named values or inputs
   before it).
2. The ends and the presets, compiled: no remat (the FLOPs baseline), save every name, save
   nothing (full remat), and each preset of :mod:`jaxmem.policies` (``dots_no_batch``,
   ``dots``, ``selective``, ``everything``).
3. :func:`_greedy`: names ranked by FLOPs avoided per byte, added while the predicted temp
   (the save-nothing temp plus the estimated bytes, scaled so the save-every-name set predicts
   its measured temp) fits; each candidate is compiled to confirm, growing the set while it
   fits and shrinking it when it does not.
4. Below full remat: the same with ``checkpoints="sqrt"`` in the stacks (binomial
   checkpointing, :func:`jaxmem.scan`), and host offload of every name where the backend can
   measure it (not on CPU, where offload is the identity).

The plan is the fitting candidate with the fewest recompute FLOPs among all those measured
(ties: the smaller temp), so it never recomputes more than the cheapest fitting preset. All
compiles count against ``max_compiles``. The first round (the ends and the presets) compiles in
threads (XLA compiles outside the GIL); on CPU every candidate compiles with LLVM's
optimization off (``xla_backend_optimization_level=0``), which leaves the temp and FLOPs as they
are (both are read from the HLO before LLVM runs; the tests compare them with default
compiles) and compiles several times faster.

Layer stacks opt in with ``policy="auto"`` (:func:`jaxmem.scan`, :mod:`jaxmem.flax` stacks);
``with use_plan(p):`` makes "auto" mean ``p.policy`` (and ``p.checkpoints``) for the stacks
traced inside the block. :func:`frontier` maps the whole memory / recompute trade-off.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import statistics
import time as _time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxmem._src import checks
from jaxmem._src import jax_compat as _jc
from jaxmem._src import offload as _offload
from jaxmem._src.remat import auto as _auto
from jaxmem._src.remat.flops import NameEstimate, _discover, _flops
from jaxmem._src.remat.remat_plan import Candidate, RematPlan

PRESETS = ("nothing", "dots_no_batch", "dots", "selective", "everything")
"""The :mod:`jaxmem.policies` presets every search measures (``nothing`` is full remat)."""

_MIN_COMPILES = 3  # no remat, save every name, save nothing
_PATIENCE = 4  # The greedy stops after this many compiles that found nothing cheaper.
_FAST_COMPILE = _jc.FAST_COMPILE  # the same figures as a default compile, faster


def _offload_measurable() -> bool:
    """Whether offloading changes the compiled device temp here (not on CPU: the identity)."""
    return jax.default_backend() != "cpu" and _offload.supported()


offload_measurable = _offload_measurable  # for the other units


# ------------------------------------------------------------------------------------------
# A candidate: what "auto" means in one compile.


# ------------------------------------------------------------------------------------------
# The result.


# ------------------------------------------------------------------------------------------
# Step 1: the names a loss uses, with estimates.


# ------------------------------------------------------------------------------------------
# Step 2: compile and measure.


class _OutOfCompiles(Exception):
    """The search used its ``max_compiles``."""


@dataclasses.dataclass
class _Search:
    """The state of one search: the function, its compiles, and their results."""

    grad_fn: Callable
    args: Sequence[Any]
    max_compiles: int
    results: dict = dataclasses.field(default_factory=dict)  # Candidate -> (temp, flops)
    compiles: int = 0
    fast: bool = False  # Measure with _FAST_COMPILE.

    def compile(self, cand: Candidate, *, for_running: bool = False):
        options = _FAST_COMPILE if self.fast and not for_running else None
        setting = cand.setting() if for_running else dataclasses.replace(cand.setting(), trial=True)
        with _auto.use_setting(setting):
            return jax.jit(self.grad_fn).lower(*self.args).compile(options)

    def measure(self, cand: Candidate) -> tuple[int, float]:
        """Compiles the gradient with "auto" meaning ``cand``: (temp bytes, FLOPs); cached."""
        if cand in self.results:
            return self.results[cand]
        if self.compiles >= self.max_compiles:
            raise _OutOfCompiles
        compiled = self.compile(cand)
        self.compiles += 1
        result = (int(compiled.memory_analysis().temp_size_in_bytes), _flops(compiled))
        self.results[cand] = result
        return result

    def measure_many(self, cands: Sequence[Candidate]) -> None:
        """Measures ``cands`` (those within ``max_compiles``, in order), compiling in threads.

        XLA compiles outside the GIL, so on a machine with several cores the independent
        compiles of the search's first round overlap.
        """
        todo = [c for c in dict.fromkeys(cands) if c not in self.results]
        todo = todo[: max(self.max_compiles - self.compiles, 0)]
        workers = min(len(todo), os.cpu_count() or 1)
        if workers <= 1:
            for c in todo:
                self.measure(c)
            return
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            compiled = list(pool.map(self.compile, todo))
        for c, comp in zip(todo, compiled, strict=True):
            self.compiles += 1
            self.results[c] = (int(comp.memory_analysis().temp_size_in_bytes), _flops(comp))

    def fitting(self, budget: int) -> list[tuple[float, int, Candidate]]:
        """Measured candidates within ``budget``: ``(flops, temp, candidate)``, cheapest first."""
        fits = [(f, t, c) for c, (t, f) in self.results.items() if t <= budget]
        # Ties: the smaller temp, then the fewer names (saving a name that costs nothing is
        # noise), then the key (deterministic).
        return sorted(fits, key=lambda x: (x[0], x[1], len(x[2].save | x[2].offload), x[2].key))

    def trials(self) -> tuple[tuple[str, int, float], ...]:
        return tuple((c.key, t, f) for c, (t, f) in self.results.items())


# ------------------------------------------------------------------------------------------
# Step 3: greedy over FLOPs avoided per byte, confirmed by compiles.


def _rank(estimates: Sequence[NameEstimate]) -> list[NameEstimate]:
    """Names by FLOPs avoided per byte saved, best first (ties: fewer bytes first)."""
    return sorted(estimates, key=lambda e: (-e.flops / max(e.bytes, 1), e.bytes, e.name))


def _knapsack_fill(ranked: list[NameEstimate], predict: Callable, budget: int) -> frozenset[str]:
    """The names, taken in rank order, whose predicted temp together still fits ``budget``."""
    chosen: set[str] = set()
    for e in ranked:
        if predict(chosen | {e.name}) <= budget:
            chosen.add(e.name)
    return frozenset(chosen)


def _cheapest_flops(search: _Search, budget: int) -> float:
    """The FLOPs of the cheapest measured candidate within ``budget`` (inf: none fits)."""
    fits = search.fitting(budget)
    return fits[0][0] if fits else math.inf


def _grown(names: frozenset[str], ranked: list[NameEstimate]) -> list[frozenset[str]]:
    """``names`` plus each other name, in rank order."""
    return [names | {e.name} for e in ranked if e.name not in names]


def _cheapest_fitting_set(search: _Search, budget: int) -> frozenset[str] | None:
    """The saved names of the cheapest fitting plain name-set candidate so far, or None."""
    fits = [
        (f, sorted(c.save))
        for c, (t, f) in search.results.items()
        if t <= budget and not (c.no_remat or c.preset or c.offload or c.checkpoints)
    ]
    return frozenset(min(fits)[1]) if fits else None


def _next_sets(
    search: _Search,
    candidate: frozenset[str],
    temp: int,
    ranked: list[NameEstimate],
    budget: int,
    predict: Callable,
) -> list[frozenset[str]]:
    """The name sets to try after ``candidate`` measured ``temp``, best first."""
    if temp <= budget:
        offset = temp - predict(candidate)  # Correct the next prediction by this one's error.
        # Predicted to fit first; then the others (temps are not monotone in the names
        # saved: saving a value can shorten the live range of what computes it).
        return sorted(_grown(candidate, ranked), key=lambda c: predict(c, offset) > budget)
    # Too large: drop one name, the worst-ranked first.
    ordered = [e.name for e in ranked if e.name in candidate]
    nexts = [candidate - {n} for n in reversed(ordered)]
    # Then grow the cheapest fitting set found so far the same way.
    best = _cheapest_fitting_set(search, budget)
    if best is not None:
        nexts += _grown(best, ranked)
    return nexts


def _greedy(
    search: _Search, ranked: list[NameEstimate], budget: int, lo: int, scale: float
) -> dict[frozenset[str], int]:
    """Compiles name sets to confirm them; returns each tried set's predicted temp.

    Starts from a knapsack fill on the predicted temps; then, while compiles remain, grows a
    fitting set by the best-ranked name predicted to still fit (predictions corrected by the
    last measurement's error; then by the others, since temps are not monotone), and shrinks
    one that does not fit by its worst-ranked name, else grows the cheapest fitting set so far.
    Stops after ``_PATIENCE`` compiles that found nothing cheaper, or at ``max_compiles``.
    """
    by_name = {e.name: e for e in ranked}

    def predict(names, offset=0.0):
        return lo + offset + scale * sum(by_name[n].bytes for n in names)

    candidate: frozenset[str] | None = _knapsack_fill(ranked, predict, budget)
    visited: dict[frozenset[str], int] = {frozenset(): lo}  # Name set -> predicted temp.
    stale = 0  # Compiles since the cheapest fitting FLOPs last went down.
    while candidate is not None and stale < _PATIENCE:
        visited[candidate] = int(predict(candidate))
        before, compiles = _cheapest_flops(search, budget), search.compiles
        try:
            temp, _ = search.measure(Candidate(save=candidate))
        except _OutOfCompiles:
            break
        if _cheapest_flops(search, budget) < before:
            stale = 0
        elif search.compiles > compiles:  # Measurements reused from `known` are free.
            stale += 1
        nexts = _next_sets(search, candidate, temp, ranked, budget, predict)
        candidate = next((c for c in nexts if c not in visited), None)
    return visited


# ------------------------------------------------------------------------------------------
# The entry point.


def _check_budget(budget: Any, caller: str) -> int:
    return checks.byte_count(budget, "budget", caller)


def _time_gradients(search: _Search, cands: Sequence[Candidate], rounds: int = 5) -> list[float]:
    """Median step time of each candidate's gradient, measured interleaved, in seconds."""
    for a in search.args:
        for leaf in jax.tree.leaves(a):
            if isinstance(leaf, jax.ShapeDtypeStruct):
                raise ValueError(
                    "jaxmem.plan(time=True) runs the gradient: give arrays, not "
                    "jax.ShapeDtypeStruct, as arguments."
                )
    compiled = [search.compile(c, for_running=True) for c in cands]
    for c in compiled:
        jax.block_until_ready(c(*search.args))
    times: list[list[float]] = [[] for _ in cands]
    for _ in range(rounds):
        for i, c in enumerate(compiled):
            t = _time.perf_counter()
            jax.block_until_ready(c(*search.args))
            times[i].append(_time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def _below_reach_message(caller, budget, lo, lo_key, names, checkpoints_tried, offload_note):
    more = []
    if offload_note:
        more.append(f"host offload ({offload_note})")
    else:
        more.append("host offload of the stacks' carries (jaxmem.scan(offload='carries'))")
    if not checkpoints_tried:
        more.append("checkpoints= on long scans (jaxmem.scan(checkpoints='sqrt'))")
    more.append(
        "a chunked loss (jaxmem.losses.linear_cross_entropy) for a large output layer, "
        "or a smaller batch or sequence"
    )
    return (
        f"{caller}: budget={budget} bytes is below the smallest reachable temp, {lo} bytes "
        f"({lo / 2**20:.3f} MiB, {lo_key}; names: {', '.join(sorted(names))}). What would "
        f"lower it further: {'; '.join(more)}."
    )


def _check_max_compiles(max_compiles: Any, caller: str) -> None:
    """Raises unless ``max_compiles`` is an int of at least ``_MIN_COMPILES``."""
    if isinstance(max_compiles, bool) or not isinstance(max_compiles, int):
        raise TypeError(f"{caller}: max_compiles must be an int, got {max_compiles!r}")
    if max_compiles < _MIN_COMPILES:
        raise ValueError(f"{caller}: max_compiles={max_compiles}; it needs at least 3.")


def _discover_names(loss_fn: Callable, args: Sequence[Any], caller: str) -> list[NameEstimate]:
    """Step 1: the names ``loss_fn`` uses, with estimates; raises where it uses none."""
    estimates = _discover(loss_fn, args)
    if not estimates:
        raise ValueError(
            f"{caller}: loss_fn runs no scan and uses no checkpoint name; tag activations with "
            'jaxmem.name(x, ...) in a stack with policy="auto".'
        )
    return estimates


def _new_search(
    loss_fn: Callable,
    args: Sequence[Any],
    argnums: int | Sequence[int],
    max_compiles: int,
    known: Sequence[tuple[str, int, float]],
) -> _Search:
    """A search over the gradient of ``loss_fn``, starting from the ``known`` measurements."""
    fast = jax.default_backend() == "cpu"
    search = _Search(jax.grad(loss_fn, argnums=argnums), args, max_compiles, fast=fast)
    for key, temp, flops in known:
        search.results[Candidate.from_key(key)] = (int(temp), float(flops))
    return search


def _offload_choice(offload: bool | None) -> tuple[bool, list[str]]:
    """Whether to search host offload (None: where it is measurable), and the plan's notes."""
    notes = []
    measurable = _offload_measurable()
    if offload is None:
        offload = measurable
        if not measurable:
            notes.append(
                f"offload not measurable here ({jax.default_backend()}: host offload is the "
                "identity on CPU); plans with offload were not searched"
            )
    return offload, notes


def _measure_first_round(
    search: _Search, names: frozenset[str], presets: bool
) -> tuple[Candidate, Candidate, Candidate]:
    """Step 2: compiles the ends and the presets; returns (no remat, save every name, nothing)."""
    full = Candidate(save=frozenset())
    no_remat = Candidate(no_remat=True)
    every = Candidate(save=names)
    first = [no_remat, every, full]
    if presets:
        first += [Candidate(preset=p) for p in PRESETS[1:]]  # "nothing" is `full`.
    search.measure_many(first)
    return no_remat, every, full


def _search_names(
    search: _Search, estimates: Sequence[NameEstimate], budget: int, lo: int, hi: int
) -> dict[Candidate, int]:
    """Step 3: the greedy over name sets; returns each tried candidate's predicted temp.

    ``lo`` and ``hi``: the measured temps of saving nothing and every name, which scale the
    estimated bytes to predicted temps.
    """
    total = sum(e.bytes for e in estimates)
    scale = (hi - lo) / total if total else 0.0
    tried = _greedy(search, _rank(estimates), budget, lo, scale)
    return {Candidate(save=s): p for s, p in tried.items()}


def _measure_below_full_remat(
    search: _Search, names: frozenset[str], checkpoints: bool, offload: bool
) -> None:
    """Step 4: ``checkpoints="sqrt"``, then host offload of every name (within max_compiles)."""
    if checkpoints:
        with contextlib.suppress(_OutOfCompiles):
            search.measure(Candidate(checkpoints="sqrt"))
    if offload:
        with contextlib.suppress(_OutOfCompiles):
            search.measure(Candidate(offload=names))
            search.measure(Candidate(offload=names, checkpoints="sqrt"))


def _below_reach_error(search: _Search, caller, budget, names, checkpoints, offload, notes):
    """The ValueError of a budget below every measured temp (:func:`_below_reach_message`)."""
    t_min, key_min = min((t, c.key) for c, (t, _) in search.results.items())
    # Why offload was not searched, where it was not: not measurable here, or turned off.
    offload_note = None if offload else (notes[0] if notes else "not searched: offload=False")
    return ValueError(
        _below_reach_message(caller, budget, t_min, key_min, names, checkpoints, offload_note)
    )


def _saved_and_recomputed(
    best: Candidate, names: frozenset[str]
) -> tuple[frozenset[str], frozenset[str]]:
    """The names the plan ``best`` saves and recomputes (a preset's choice is not by name)."""
    if best.no_remat:
        return names, frozenset()
    if best.preset is not None:
        return frozenset(), frozenset()
    return best.save, names - best.save - best.offload


def plan(
    loss_fn: Callable,
    *args: Any,
    budget: int | float | str,
    max_compiles: int = 16,
    argnums: int | Sequence[int] = 0,
    presets: bool = True,
    checkpoints: bool = True,
    offload: bool | None = None,
    time: bool = False,
    known: Sequence[tuple[str, int, float]] = (),
) -> RematPlan:
    """Chooses what ``policy="auto"`` stacks do so ``loss_fn``'s gradient fits ``budget``.

    ``loss_fn``'s layer stacks opt in with ``policy="auto"`` (:func:`jaxmem.scan`,
    :mod:`jaxmem.flax` stacks) and tag activations with checkpoint names
    (:func:`jaxmem.name`); the plan is then applied with ``with jaxmem.use_plan(p):`` or as
    ``policy=p.policy``. Unmodified code (``lax.scan``, no names) is planned too: its scans run
    as ``policy="auto"`` stacks with each step's values named by op kind (``matmul_0``,
    ``batched_matmul_0``, ``norm_statistic_0``, ``activation_0``, ``exponential_0``, numbered in
    the step's order; :attr:`RematPlan.op_names`), and ``jaxmem.optimize(loss_fn, plan=p)`` applies
    the plan. The gradient is ``jax.grad(loss_fn, argnums)``; its temp memory is
    XLA's compile-time ``memory_analysis().temp_size_in_bytes`` (per device for sharded
    arguments) and its cost ``cost_analysis()["flops"]``. The plan is the measured candidate
    within the budget with the fewest recompute FLOPs (the module docstring lists the search).

    Args:
      loss_fn: the loss, ``loss_fn(*args) -> scalar``.
      *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
      budget: the temp-memory budget: bytes as an int or a float, or a string with a unit
        (``"48MiB"``, ``"1.5GB"``, ``"8GiB"``).
      max_compiles: at most this many AOT compiles in all (at least 3: no remat, save every
        name, save nothing); candidates found in ``known`` cost none.
      argnums: what the gradient is taken with respect to, as in :func:`jax.grad`.
      presets: also measure the :data:`PRESETS` (the plan is then never more expensive than
        the cheapest preset that fits).
      checkpoints: below full remat, try ``checkpoints="sqrt"`` in the stacks.
      offload: try host offload below full remat; None: where the backend can measure it (not
        on CPU, where offload is the identity: the plan says so in :attr:`RematPlan.notes`).
      time: also measure the planned gradient's step time against no remat (interleaved;
        needs arrays as arguments).
      known: measurements to reuse instead of compiling again: the :attr:`RematPlan.trials` of an
        earlier plan of the same ``loss_fn``, argument shapes and ``argnums`` (for a sweep over
        budgets). Not checked: trials of another function give a wrong plan.

    Returns:
      A :class:`RematPlan`.

    Raises:
      ValueError: ``budget`` is below the smallest reachable temp (the message gives it and
        what would lower it further); ``max_compiles < 3``; ``loss_fn`` runs no scan and uses
        no checkpoint name.
      ValueError: ``budget`` negative or not a size.
      TypeError: ``budget`` not a number or a string.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> def loss(w, xs):
      ...     def step(h, x):
      ...         a = jaxmem.name(jnp.sin(h @ w + x), "mlp_act")
      ...         return jnp.tanh(a @ w), None
      ...     return jaxmem.scan(step, jnp.zeros((2, 8)), xs, policy="auto")[0].sum()
      >>> w, xs = jnp.eye(8), jnp.ones((4, 2, 8))
      >>> p = plan(loss, w, xs, budget=10**6)
      >>> p.measured_temp_bytes <= 10**6
      True
      >>> with jaxmem.use_plan(p):
      ...     g = jax.grad(loss)(w, xs)
    """
    caller = "jaxmem.plan"
    budget = _check_budget(budget, caller)
    _check_max_compiles(max_compiles, caller)
    start = _time.perf_counter()
    estimates = _discover_names(loss_fn, args, caller)
    names = frozenset(e.name for e in estimates)
    search = _new_search(loss_fn, args, argnums, max_compiles, known)
    offload, notes = _offload_choice(offload)

    no_remat, every, full = _measure_first_round(search, names, presets)
    _, base_flops = search.results[no_remat]
    lo, _ = search.results[full]
    predicted: dict[Candidate, int] = {}
    if not search.fitting(budget):
        _measure_below_full_remat(search, names, checkpoints, offload)
        if not search.fitting(budget):
            raise _below_reach_error(search, caller, budget, names, checkpoints, offload, notes)
    elif not search.results[no_remat][0] <= budget:
        predicted = _search_names(search, estimates, budget, lo, search.results[every][0])
    flops, temp, best = search.fitting(budget)[0]

    step = base_step = None
    if time:
        step, base_step = _time_gradients(search, [best, no_remat])
    save, recompute = _saved_and_recomputed(best, names)
    return RematPlan(
        save=save,
        recompute=recompute,
        offload=best.offload,
        preset=best.preset,
        checkpoints=best.checkpoints,
        budget=budget,
        measured_temp_bytes=temp,
        predicted_temp_bytes=predicted.get(best),
        recompute_flops=flops - base_flops,
        baseline_flops=base_flops,
        no_remat=best.no_remat,
        compiles=search.compiles,
        seconds=_time.perf_counter() - start,
        trials=search.trials(),
        notes=tuple(notes),
        step_time_s=step,
        no_remat_step_time_s=base_step,
    )


# ------------------------------------------------------------------------------------------
# The frontier: every measured trade-off, presets and plans together.
