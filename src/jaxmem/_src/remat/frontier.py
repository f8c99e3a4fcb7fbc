"""The memory/recompute frontier of a step: every candidate plan compiled and measured, the Pareto
set marked, the planner's picks per budget; tabulated and plotted.
"""

from __future__ import annotations

import dataclasses
import json
import time as _time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxmem._src import plots as _plots
from jaxmem._src.remat.planner import (
    PRESETS,
    _check_budget,
    _offload_measurable,
    _Search,
    _time_gradients,
    plan,
)
from jaxmem._src.remat.remat_plan import Candidate, RematPlan


@dataclasses.dataclass(frozen=True)
class FrontierPoint:
    """One measured (or unmeasurable) configuration on the memory / recompute plane.

    Attributes:
      key: the candidate (:attr:`Candidate.key`: ``"preset dots"``, ``"save a,b"``, ...).
      kind: ``"no remat"``, ``"preset"`` (``"save nothing"`` is the preset ``nothing``),
        ``"names"`` (a set of saved names the search compiled), ``"checkpoints"`` or
        ``"offload"``.
      temp_bytes: compiled temp of the gradient (None: not measurable here).
      recompute_flops: FLOPs above the no-remat gradient's (None: not measurable here).
      step_time_s: median measured step time (``frontier(time=True)``), else None.
      pareto: no other measured point has both less temp and fewer FLOPs.
      picked_for: the budgets (bytes) for which :func:`plan` picked this point.
      note: why a point is not measured.
    """

    key: str
    kind: str
    temp_bytes: int | None
    recompute_flops: float | None
    step_time_s: float | None = None
    pareto: bool = False
    picked_for: tuple[int, ...] = ()
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Frontier:
    """The Pareto frontier of (temp, recompute) over the presets and the planner's plans.

    Attributes:
      points: every point, by increasing temp (unmeasurable ones last).
      plans: the planner's :class:`RematPlan` for each budget of the sweep (below-reach budgets
        skipped).
      chosen: the plan for ``frontier(budget=...)``, marked in :meth:`plot` (or None).
      baseline_flops: FLOPs of the no-remat gradient.
      compiles: AOT compiles in all; seconds: wall time in all.

    Examples:
      >>> f = Frontier(
      ...     points=(FrontierPoint("no remat", "no remat", 300, 0.0, pareto=True),
      ...             FrontierPoint("preset dots", "preset", 200, 10.0, pareto=True),
      ...             FrontierPoint("preset everything", "preset", 300, 5.0)),
      ...     plans=(), chosen=None, baseline_flops=100.0, compiles=3, seconds=1.0)
      >>> [p.key for p in f.pareto()]
      ['no remat', 'preset dots']
      >>> f.point("preset dots").temp_bytes
      200
    """

    points: tuple[FrontierPoint, ...]
    plans: tuple[RematPlan, ...]
    chosen: RematPlan | None
    baseline_flops: float
    compiles: int
    seconds: float

    def pareto(self) -> list[FrontierPoint]:
        """The points on the frontier, by increasing temp."""
        return [p for p in self.points if p.pareto]

    def point(self, key: str) -> FrontierPoint:
        """The point of a candidate key (``"preset dots"``, ``"no remat"``...)."""
        for p in self.points:
            if p.key == key:
                return p
        raise KeyError(f"Frontier: no point {key!r}; keys: {', '.join(p.key for p in self.points)}")

    def to_dict(self) -> dict[str, Any]:
        """The frontier as plain data."""
        return {
            "points": [dataclasses.asdict(p) for p in self.points],
            "plans": [p.to_dict() for p in self.plans],
            "chosen": None if self.chosen is None else self.chosen.to_dict(),
            "baseline_flops": self.baseline_flops,
            "compiles": self.compiles,
            "seconds": self.seconds,
        }

    def to_json(self) -> str:
        """The frontier as a JSON string."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def __str__(self) -> str:
        rows = [
            f"Frontier: {len(self.points)} points, {self.compiles} compiles, {self.seconds:.1f} s"
            f" (recompute as % of the no-remat gradient's {self.baseline_flops:.4g} FLOPs)",
            f"  {'temp MiB':>9} {'recompute':>9} {'time ms':>8}  {'':1} {'kind':8} candidate",
        ]
        for p in self.points:
            temp = "-" if p.temp_bytes is None else f"{p.temp_bytes / 2**20:.3f}"
            pct = (
                "-"
                if p.recompute_flops is None
                else f"{100 * p.recompute_flops / max(self.baseline_flops, 1):.1f}%"
            )
            ms = "-" if p.step_time_s is None else f"{1e3 * p.step_time_s:.2f}"
            mark = "*" if p.pareto else " "
            notes = [p.note] if p.note else []
            if p.picked_for:
                mibs = ", ".join(f"{b / 2**20:.3f}" for b in p.picked_for)
                notes.append(f"planned for {mibs} MiB")
            note = f"  ({'; '.join(notes)})" if notes else ""
            rows.append(f"  {temp:>9} {pct:>9} {ms:>8}  {mark} {p.kind:8} {p.key}{note}")
        rows.append("  * on the Pareto frontier (no other point has less temp and fewer FLOPs)")
        if self.chosen is not None:
            c = self.chosen
            rows.append(f"  chosen for {c.budget / 2**20:.3f} MiB: {c.candidate.key}")
        return "\n".join(rows)

    def plot(self, path: str | None = None, *, y: str = "flops", title: str | None = None):
        """Memory vs recompute (or step time): presets labelled, plans and the chosen marked.

        Args:
          path: where to save the figure (PNG, ...); None only returns it.
          y: ``"flops"`` (recompute FLOPs, % of the no-remat gradient) or ``"time"`` (measured
            step time: needs ``frontier(time=True)``).
          title: the figure title.

        Returns:
          The matplotlib figure.

        Raises:
          ValueError: ``y`` is neither, or ``"time"`` without measured times.
        """
        if y not in ("flops", "time"):
            raise ValueError(f"Frontier.plot: y must be 'flops' or 'time', got {y!r}")
        if y == "time" and not any(p.step_time_s is not None for p in self.points):
            raise ValueError("Frontier.plot(y='time'): no step times; run frontier(time=True)")

        def yval(p):
            if y == "time":
                return None if p.step_time_s is None else 1e3 * p.step_time_s
            if p.recompute_flops is None:
                return None
            return 100 * p.recompute_flops / max(self.baseline_flops, 1)

        chosen_key, budget = None, None
        if self.chosen is not None and self.chosen.measured_temp_bytes is not None:
            chosen_key, budget = self.chosen.candidate.key, self.chosen.budget
        points = [
            {
                "temp": p.temp_bytes,
                "y": yval(p),
                "kind": "preset" if p.kind in ("preset", "no remat") else "candidate",
                "label": "nothing (full remat)"
                if p.key == "save nothing"
                else p.key.removeprefix("preset "),
                "pareto": p.pareto,
                "picked": bool(p.picked_for),
                "chosen": p.key == chosen_key,
            }
            for p in self.points
            if p.temp_bytes is not None and yval(p) is not None
        ]
        ylabel = "step time (ms)" if y == "time" else "recompute FLOPs (% of the no-remat gradient)"
        title = title or "Memory vs recompute: presets (squares) and planned policies"
        fig = _plots.frontier(points, ylabel=ylabel, title=title, budget=budget)
        if path is not None:
            fig.savefig(path)
        return fig


def _pareto_keys(measured: dict[str, tuple[int, float]]) -> set[str]:
    keys = set()
    for k, (t, f) in measured.items():
        dominated = any(
            (t2 <= t and f2 <= f) and (t2 < t or f2 < f) for k2, (t2, f2) in measured.items()
        )
        if not dominated:
            keys.add(k)
    return keys


def _sweep_budgets(budgets: int | Sequence[int], lo: int, hi: int, caller: str) -> list[int]:
    """The budgets to plan for: ``budgets`` of them from ``lo`` to ``hi``, or those given."""
    if isinstance(budgets, int) and not isinstance(budgets, bool):
        if budgets < 0:
            raise ValueError(f"{caller}: budgets={budgets}; give a count >= 0 or a list of bytes")
        return [int(b) for b in np.linspace(lo, hi, budgets)] if budgets > 1 else [lo][:budgets]
    return [_check_budget(b, caller) for b in budgets]


def _step_times(
    loss_fn: Callable,
    args: Sequence[Any],
    argnums: int | Sequence[int],
    measured: dict[str, tuple[int, float]],
    picks: dict[str, list[int]],
) -> dict[str, float]:
    """Median step times of the no-remat, preset and picked points, measured interleaved."""
    timed = {"no remat", "save nothing", *(f"preset {n}" for n in PRESETS[1:]), *picks}
    keys = sorted(timed & set(measured))
    search = _Search(jax.grad(loss_fn, argnums=argnums), args, 0)
    cands = [Candidate.from_key(k) for k in keys]
    return dict(zip(keys, _time_gradients(search, cands), strict=True))


def _kind(key: str) -> str:
    """The :attr:`FrontierPoint.kind` of a candidate key."""
    c = Candidate.from_key(key)
    if c.no_remat:
        return "no remat"
    if c.offload:
        return "offload"
    if c.checkpoints is not None:
        return "checkpoints"
    if c.preset is not None or not c.save:
        return "preset"
    return "names"


def _measured_points(
    measured: dict[str, tuple[int, float]],
    base: float,
    picks: dict[str, list[int]],
    times: dict[str, float],
) -> list[FrontierPoint]:
    """A point per measured candidate, by increasing temp, then FLOPs, then key."""
    pareto = _pareto_keys(measured)
    points = []
    for k, (t, f) in sorted(measured.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0])):
        note = "the preset nothing: full remat" if k == "save nothing" else ""
        picked = tuple(picks.get(k, ()))
        points.append(
            FrontierPoint(k, _kind(k), t, f - base, times.get(k), k in pareto, picked, note)
        )
    return points


def _offload_point(plans: Sequence[RematPlan]) -> FrontierPoint:
    """The point of offloading every name the plans know: unmeasured, offload is the identity."""
    names = sorted({n for p in plans for n in p.save | p.recompute})
    return FrontierPoint(
        Candidate(offload=frozenset(names)).key,
        "offload",
        None,
        None,
        note=f"not measurable here ({jax.default_backend()}: host offload is the identity)",
    )


def _below_reach_point(budgets: Sequence[int]) -> FrontierPoint:
    """The unmeasured point noting the budgets skipped as below full remat's temp."""
    return FrontierPoint(
        "below reach",
        "names",
        None,
        None,
        note="budgets below the smallest reachable temp skipped: "
        + ", ".join(str(b) for b in budgets),
    )


def frontier(
    loss_fn: Callable,
    *args: Any,
    budgets: int | Sequence[int] = 5,
    budget: int | None = None,
    argnums: int | Sequence[int] = 0,
    max_compiles: int = 16,
    time: bool = False,
    known: Sequence[tuple[str, int, float]] = (),
) -> Frontier:
    """The memory / recompute frontier of ``loss_fn``'s gradient: presets and planned policies.

    Compiles the presets (:data:`PRESETS`) and no remat, then runs :func:`plan` for each of
    ``budgets`` (spread between full remat's temp and no remat's, reusing every earlier
    measurement), and marks which points are Pareto-optimal.

    Args:
      loss_fn: the loss (its stacks use ``policy="auto"``, as for :func:`plan`).
      *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
      budgets: how many budgets to plan for, evenly spread from full remat to no remat, or the
        budgets themselves (bytes; those below full remat are skipped with a note).
      budget: a budget whose plan is :attr:`Frontier.chosen` (marked in the plot; the budget
        must be reachable, else ``chosen`` is None and a point notes it).
      argnums: as in :func:`jax.grad`.
      max_compiles: per :func:`plan` call.
      time: also measure each preset's and each plan's step time (interleaved; needs arrays).
      known: measurements to reuse, as for :func:`plan` (e.g. an earlier plan's
        :attr:`RematPlan.trials`).

    Returns:
      A :class:`Frontier`.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> def loss(w, xs):
      ...     def step(h, x):
      ...         a = jaxmem.name(jnp.sin(h @ w + x), "mlp_in")
      ...         b = jaxmem.name(jnp.cos(a @ w), "mlp_act")
      ...         return jnp.tanh(b @ w), None
      ...     return jaxmem.scan(step, jnp.zeros((2, 8)), xs, policy="auto")[0].sum()
      >>> f = jaxmem.frontier(loss, jnp.eye(8), jnp.ones((4, 2, 8)), budgets=2)
      >>> f.point("no remat").recompute_flops
      0.0
      >>> all(p.pareto for p in f.points if p.key == "no remat")
      True
    """
    caller = "jaxmem.frontier"
    start = _time.perf_counter()
    if budget is not None:
        budget = _check_budget(budget, caller)
    loose = plan(
        loss_fn, *args, budget=2**62, argnums=argnums, max_compiles=max_compiles, known=known
    )
    measured = {k: (t, f) for k, t, f in loose.trials}
    lo = min(t for t, _ in measured.values())
    hi = measured["no remat"][0]
    sweep = _sweep_budgets(budgets, lo, hi, caller)

    def plan_for(b: int) -> RematPlan:
        """The plan for budget ``b``, reusing every measurement so far and adding its own."""
        trials = [(k, t, f) for k, (t, f) in measured.items()]
        p = plan(loss_fn, *args, budget=b, argnums=argnums, max_compiles=max_compiles, known=trials)
        measured.update({k: (t, f) for k, t, f in p.trials})
        return p

    below = [b for b in sweep if b < lo]
    plans = [plan_for(b) for b in sweep if b >= lo]
    chosen = None
    if budget is not None and budget < lo:
        below.append(budget)
    elif budget is not None:
        chosen = plan_for(budget)
    compiles = sum(p.compiles for p in (loose, *plans, chosen) if p is not None)

    base = loose.baseline_flops or 0.0
    picks: dict[str, list[int]] = {}
    for p in plans:  # The sweep's picks (the chosen plan is marked on its own).
        picks.setdefault(p.candidate.key, []).append(p.budget)
    times = _step_times(loss_fn, args, argnums, measured, picks) if time else {}
    points = _measured_points(measured, base, picks, times)
    if not _offload_measurable():
        points.append(_offload_point(plans + [loose]))
    if below:
        points.append(_below_reach_point(below))
    return Frontier(
        points=tuple(points),
        plans=tuple(plans),
        chosen=chosen,
        baseline_flops=base,
        compiles=compiles,
        seconds=_time.perf_counter() - start,
    )
