"""A memory-budget planner: which checkpoint names to save so the gradient fits a budget.

:func:`plan` chooses, for the checkpoint names a loss uses (:data:`jaxmem.NAMES`), which to save
on the device and which to recompute, so that the compiled gradient's temp memory (XLA's
``memory_analysis().temp_size_in_bytes``) fits ``budget`` with as little recomputation
(``cost_analysis()`` FLOPs above the no-remat gradient's) as it can find. The search is a
sequence of named steps:

1. :func:`_discover`: the names the loss uses, each with a cheap estimate of the bytes saving it
   costs (its value's size, times the length of the loops around it) and of the FLOPs that
   saving it avoids recomputing (the equations between it and the named values or inputs
   before it).
2. :func:`_measure` the two ends: save no name (the smallest temp, the most recomputation) and
   save every name; and the gradient without remat (the FLOPs baseline).
3. :func:`_greedy`: names ranked by FLOPs avoided per byte, added while the predicted temp
   (the save-nothing temp plus the estimated bytes, scaled so the save-every-name set predicts
   its measured temp) fits; each candidate is then compiled to confirm, growing the set while it
   fits and shrinking it when it does not, at most ``max_compiles`` compiles in all.

Layer stacks opt in with ``policy="auto"`` (:func:`jaxmem.scan`, :mod:`jaxmem.flax` stacks);
``with use_plan(p):`` makes "auto" mean ``p.policy`` for the stacks traced inside the block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from jaxmem._src import auto as _auto
from jaxmem._src import jax_compat as _jc
from jaxmem._src import policies as _policies

# ------------------------------------------------------------------------------------------
# The result.

_NO_REMAT = "<no remat>"  # How Plan.trials names the gradient without remat.


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to do with each checkpoint name so a gradient fits a memory budget.

    Attributes:
      save: names saved on the device.
      recompute: names recomputed in the backward pass.
      offload: names offloaded to host memory (empty: this prototype plans no offload).
      budget: the temp-memory budget in bytes the plan was made for (None if made by hand).
      measured_temp_bytes: compiled temp of the gradient under the plan (``memory_analysis``).
      predicted_temp_bytes: the planner's estimate before compiling.
      recompute_flops: FLOPs of the planned gradient minus those of the no-remat gradient.
      baseline_flops: FLOPs of the no-remat gradient (``cost_analysis``).
      no_remat: the gradient without any remat fits: :attr:`policy` saves everything.
      compiles: AOT compiles the search ran.
      seconds: wall time of the search.
      trials: every measured candidate, ``(sorted names saved, temp bytes, flops)``; the
        gradient without remat is ``(("<no remat>",), temp, flops)``.

    Examples:
      >>> p = Plan(save=frozenset({"mlp_in"}), recompute=frozenset({"mlp_act"}))
      >>> p.policy
      save('mlp_in')
      >>> Plan.from_json(p.to_json()) == p
      True
    """

    save: frozenset[str]
    recompute: frozenset[str] = frozenset()
    offload: frozenset[str] = frozenset()
    budget: int | None = None
    measured_temp_bytes: int | None = None
    predicted_temp_bytes: int | None = None
    recompute_flops: float | None = None
    baseline_flops: float | None = None
    no_remat: bool = False
    compiles: int = 0
    seconds: float = 0.0
    trials: tuple[tuple[tuple[str, ...], int, float], ...] = ()

    def __post_init__(self):
        for field in ("save", "recompute", "offload"):
            value = getattr(self, field)
            if isinstance(value, str) or not all(isinstance(n, str) for n in value):
                raise TypeError(f"Plan.{field} must be a set of checkpoint names, got {value!r}")
            object.__setattr__(self, field, frozenset(value))
        both = self.save & self.recompute
        if both:
            raise ValueError(
                f"Plan: {sorted(both)} both saved and recomputed; give each one action"
            )
        object.__setattr__(self, "trials", tuple((tuple(n), t, f) for n, t, f in self.trials))

    @property
    def policy(self) -> _policies.Policy:
        """The remat policy: ``jaxmem.policies.save(*self.save)`` (``everything`` if no remat).

        Usable as ``jaxmem.scan(policy=...)``, in :mod:`jaxmem.flax` stacks and in
        ``jax.checkpoint(policy=...)``.
        """
        if self.no_remat:
            return _policies.everything
        return _policies.Save(tuple(sorted(self.save)))

    def validate(self, loss_fn: Callable, *args: Any) -> Plan:
        """Checks that the plan's names all occur in ``loss_fn`` (traced, not compiled).

        Args:
          loss_fn: the loss the plan is for.
          *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).

        Returns:
          The plan itself.

        Raises:
          ValueError: a name of the plan does not occur; the message lists those that do.
        """
        occurring = {e.name for e in _discover(loss_fn, args)}
        unknown = sorted((self.save | self.recompute | self.offload) - occurring)
        if unknown:
            raise ValueError(
                f"Plan: {', '.join(map(repr, unknown))} not among the checkpoint names loss_fn "
                f"uses: {', '.join(sorted(occurring)) or '(none)'}."
            )
        return self

    def to_json(self) -> str:
        """The plan as a JSON string (sets as sorted lists)."""
        d = dataclasses.asdict(self)
        for field in ("save", "recompute", "offload"):
            d[field] = sorted(d[field])
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan :meth:`to_json` wrote."""
        d = json.loads(text)
        d["trials"] = tuple((tuple(n), t, f) for n, t, f in d.get("trials", ()))
        return cls(**d)

    def __str__(self) -> str:
        def mib(b):
            return "?" if b is None else f"{b / 2**20:.3f} MiB"

        lines = [
            f"Plan for budget {mib(self.budget)}: temp {mib(self.measured_temp_bytes)} measured "
            f"({mib(self.predicted_temp_bytes)} predicted)",
            f"  save:      {', '.join(sorted(self.save)) or '-'}"
            + ("  (no remat at all)" if self.no_remat else ""),
            f"  recompute: {', '.join(sorted(self.recompute)) or '-'}",
        ]
        if self.offload:
            lines.append(f"  offload:   {', '.join(sorted(self.offload))}")
        if self.recompute_flops is not None and self.baseline_flops:
            pct = 100 * self.recompute_flops / self.baseline_flops
            lines.append(
                f"  recompute: {self.recompute_flops:.4g} FLOPs ({pct:.1f}% over the no-remat "
                f"gradient's {self.baseline_flops:.4g})"
            )
        lines.append(f"  search:    {self.compiles} compiles, {self.seconds:.1f} s")
        return "\n".join(lines)


@contextlib.contextmanager
def use_plan(plan: Plan) -> Iterator[Plan]:
    """Applies ``plan`` to every ``policy="auto"`` stack traced inside the block.

    The policy is chosen when the stack is traced, so trace (or jit anew) inside the block:
    a function jitted and cached before keeps the policy it was traced with.

    Args:
      plan: a :class:`Plan` (from :func:`plan` or :meth:`Plan.from_json`).

    Yields:
      ``plan``.

    Raises:
      TypeError: ``plan`` is not a :class:`Plan`.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> def loss(w, xs):
      ...     step = lambda h, x: (jnp.tanh(jaxmem.name(h * w + x, "mlp_act")), None)
      ...     return jaxmem.scan(step, jnp.zeros(4), xs, policy="auto")[0].sum()
      >>> p = Plan(save=frozenset({"mlp_act"}))
      >>> with use_plan(p):
      ...     g = jax.grad(loss)(1.0, jnp.ones((3, 4)))
    """
    if not isinstance(plan, Plan):
        raise TypeError(
            f"jaxmem.use_plan: expected a jaxmem.Plan, got {type(plan).__name__}; make one with "
            "jaxmem.plan(loss_fn, *args, budget=...)."
        )
    # No remat is no jax.checkpoint at all (`everything` under jax.checkpoint still differs:
    # XLA's cost analysis counts more FLOPs for it).
    with _auto.use_policy(None if plan.no_remat else plan.policy):
        yield plan


# ------------------------------------------------------------------------------------------
# Step 1: the names a loss uses, with estimates.


@dataclasses.dataclass(frozen=True)
class NameEstimate:
    """A checkpoint name's estimated cost of saving (bytes) and of recomputing (FLOPs)."""

    name: str
    bytes: int
    flops: float


def _eqn_flops(eqn) -> float:
    out = sum(
        _jc.nbytes(v.aval) // max(getattr(v.aval.dtype, "itemsize", 1), 1)
        for v in eqn.outvars
        if hasattr(v.aval, "dtype")
    )
    if eqn.primitive.name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        k = 1
        for d in lhs_contract:
            k *= shape[d]
        return 2.0 * out * k
    return float(out)


def _segment_flops(jaxpr, index: int) -> float:
    """FLOPs of the equations that compute equation ``index``'s input from named values/inputs."""
    producer = {}
    for i, eqn in enumerate(jaxpr.eqns[:index]):
        for v in eqn.outvars:
            producer[v] = i
    seen, stack, total = set(), list(jaxpr.eqns[index].invars), 0.0
    while stack:
        v = stack.pop()
        if not _jc.is_var(v) or v in seen or v not in producer:
            continue
        seen.add(v)
        eqn = jaxpr.eqns[producer[v]]
        if _jc.eqn_checkpoint_name(eqn) is not None:
            continue  # A named value: saved or recomputed on its own account.
        total += _eqn_flops(eqn)
        stack.extend(eqn.invars)
    return total


def _walk(jaxpr, mult: int, out: dict, seen: set) -> None:
    if id(jaxpr) in seen:
        return
    seen.add(id(jaxpr))
    for i, eqn in enumerate(jaxpr.eqns):
        name = _jc.eqn_checkpoint_name(eqn)
        if name is not None:
            b, f = out.get(name, (0, 0.0))
            out[name] = (
                b + mult * sum(_jc.nbytes(v.aval) for v in eqn.outvars),
                f + mult * _segment_flops(jaxpr, i),
            )
        length = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for sub in _jc.subjaxprs(eqn):
            _walk(sub, mult * int(length), out, seen)


def _discover(loss_fn: Callable, args: Sequence[Any]) -> list[NameEstimate]:
    """Step 1: the checkpoint names ``loss_fn`` uses, with bytes and recompute-FLOPs estimates."""
    with _auto.use_policy(_policies.nothing):
        closed = jax.make_jaxpr(loss_fn)(*args)
    found: dict[str, tuple[int, float]] = {}
    _walk(_jc.open_jaxpr(closed), 1, found, set())
    return [NameEstimate(n, b, f) for n, (b, f) in sorted(found.items())]


# ------------------------------------------------------------------------------------------
# Step 2: compile and measure.


@dataclasses.dataclass
class _Search:
    """The state of one search: the function, its compiles, and their results."""

    grad_fn: Callable
    args: Sequence[Any]
    max_compiles: int
    results: dict = dataclasses.field(default_factory=dict)  # key -> (temp, flops)
    compiles: int = 0


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # Older jax: one dict per computation.
        return float(sum((c or {}).get("flops", 0.0) for c in cost))
    return float((cost or {}).get("flops", 0.0))


def _measure(search: _Search, key: Any, policy: Callable | None) -> tuple[int, float]:
    """Compiles the gradient with "auto" meaning ``policy``: (temp bytes, FLOPs); cached by key."""
    if key in search.results:
        return search.results[key]
    with _auto.use_policy(policy):
        # A new jit object each time: jit's trace cache does not see the context variable.
        compiled = jax.jit(lambda *a: search.grad_fn(*a)).lower(*search.args).compile()
    search.compiles += 1
    result = (int(compiled.memory_analysis().temp_size_in_bytes), _flops(compiled))
    search.results[key] = result
    return result


def _measure_names(search: _Search, names: frozenset[str]) -> tuple[int, float]:
    return _measure(search, names, _policies.Save(tuple(sorted(names))))


# ------------------------------------------------------------------------------------------
# Step 3: greedy over FLOPs avoided per byte, confirmed by compiles.


def _rank(estimates: Sequence[NameEstimate]) -> list[NameEstimate]:
    """Names by FLOPs avoided per byte saved, best first (ties: fewer bytes first)."""
    return sorted(estimates, key=lambda e: (-e.flops / max(e.bytes, 1), e.bytes, e.name))


def _greedy(
    search: _Search, ranked: list[NameEstimate], budget: int, lo: int, scale: float
) -> tuple[frozenset[str], int]:
    """Confirms candidates by compiling; returns the fitting set with the fewest FLOPs.

    Starts from a knapsack fill on the predicted temps; then, while compiles remain, grows a
    fitting candidate by the best-ranked name predicted to still fit (predictions corrected by
    the last measurement's error) and shrinks one that does not fit by its worst-ranked name.
    Returns the fitting set with the fewest FLOPs among all measured ones (saving nothing fits:
    the caller checked), and its predicted temp.
    """
    by_name = {e.name: e for e in ranked}

    def predict(names, offset=0.0):
        return lo + offset + scale * sum(by_name[n].bytes for n in names)

    chosen: set[str] = set()
    for e in ranked:  # Knapsack fill on the predictions.
        if predict(chosen | {e.name}) <= budget:
            chosen.add(e.name)
    candidate: frozenset[str] | None = frozenset(chosen)
    visited: dict[frozenset[str], int] = {frozenset(): lo}  # Candidate -> predicted temp.
    while candidate is not None:
        if candidate not in search.results and search.compiles >= search.max_compiles:
            break
        visited[candidate] = int(predict(candidate))
        temp, _ = _measure_names(search, candidate)
        offset = temp - predict(candidate)  # Correct the next prediction by this one's error.
        if temp <= budget:
            nexts = [
                candidate | {e.name}
                for e in ranked
                if e.name not in candidate and predict(candidate | {e.name}, offset) <= budget
            ]
        else:
            ordered = [e.name for e in ranked if e.name in candidate]
            nexts = [candidate - {n} for n in reversed(ordered)]
        candidate = next((c for c in nexts if c not in visited), None)

    fits = [
        (flops, temp, sorted(k))
        for k, (temp, flops) in search.results.items()
        if isinstance(k, frozenset) and temp <= budget
    ]
    _, _, best = min(fits)
    best = frozenset(best)
    return best, visited.get(best, int(predict(best)))


# ------------------------------------------------------------------------------------------
# The entry point.


def plan(
    loss_fn: Callable,
    *args: Any,
    budget: int,
    max_compiles: int = 12,
    argnums: int | Sequence[int] = 0,
    known: Sequence[tuple[Sequence[str], int, float]] = (),
) -> Plan:
    """Chooses which checkpoint names to save so ``loss_fn``'s gradient fits ``budget``.

    ``loss_fn``'s layer stacks opt in with ``policy="auto"`` (:func:`jaxmem.scan`,
    :mod:`jaxmem.flax` stacks); the plan is then applied with ``with jaxmem.use_plan(p):``.
    The gradient is ``jax.grad(loss_fn, argnums)``; its temp memory is XLA's compile-time
    ``memory_analysis().temp_size_in_bytes`` and its cost ``cost_analysis()["flops"]``.

    Args:
      loss_fn: the loss, ``loss_fn(*args) -> scalar``.
      *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
      budget: the temp-memory budget in bytes.
      max_compiles: at most this many new AOT compiles (at least 3: save nothing, save every
        name, no remat; fewer are used where ``known`` has them).
      argnums: what the gradient is taken with respect to, as in :func:`jax.grad`.
      known: measurements to reuse instead of compiling again: the :attr:`Plan.trials` of an
        earlier plan of the same ``loss_fn``, argument shapes and ``argnums`` (for a sweep over
        budgets). Not checked: trials of another function give a wrong plan.

    Returns:
      A :class:`Plan`.

    Raises:
      ValueError: ``budget`` is below the temp of saving no name (the smallest reachable; the
        message gives it); ``max_compiles < 3``; ``loss_fn`` uses no checkpoint name.

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
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise TypeError(f"{caller}: budget must be a number of bytes (an int >= 0), got {budget!r}")
    if max_compiles < 3:
        raise ValueError(f"{caller}: max_compiles={max_compiles}; it needs at least 3.")
    start = time.perf_counter()
    estimates = _discover(loss_fn, args)
    if not estimates:
        raise ValueError(
            f"{caller}: loss_fn uses no checkpoint name; tag activations with jaxmem.name(x, ...) "
            'in a stack with policy="auto".'
        )
    names = frozenset(e.name for e in estimates)
    search = _Search(jax.grad(loss_fn, argnums=argnums), args, max_compiles)
    for trial_names, temp, flops in known:
        key = "no_remat" if tuple(trial_names) == (_NO_REMAT,) else frozenset(trial_names)
        search.results[key] = (int(temp), float(flops))

    lo, _ = _measure_names(search, frozenset())
    if budget < lo:
        raise ValueError(
            f"{caller}: budget={budget} bytes is below the smallest reachable temp, {lo} bytes "
            f"({lo / 2**20:.3f} MiB: every name recomputed, {', '.join(sorted(names))}). Raise "
            "the budget, or shrink what no name covers (batch, sequence, loss)."
        )
    base_temp, base_flops = _measure(search, "no_remat", None)
    hi, _ = _measure_names(search, names)

    if base_temp <= budget:
        best, pred, no_remat = names, base_temp, True
    elif hi <= budget:
        best, pred, no_remat = names, hi, False
    else:
        total = sum(e.bytes for e in estimates)
        scale = (hi - lo) / total if total else 0.0
        best, pred = _greedy(search, _rank(estimates), budget, lo, scale)
        no_remat = False
    temp, flops = search.results["no_remat" if no_remat else best]
    trials = tuple(
        (tuple(sorted(k)) if isinstance(k, frozenset) else (_NO_REMAT,), t, f)
        for k, (t, f) in search.results.items()
    )
    return Plan(
        save=best,
        recompute=names - best,
        budget=budget,
        measured_temp_bytes=temp,
        predicted_temp_bytes=int(pred),
        recompute_flops=flops - base_flops,
        baseline_flops=base_flops,
        no_remat=no_remat,
        compiles=search.compiles,
        seconds=time.perf_counter() - start,
        trials=trials,
    )
