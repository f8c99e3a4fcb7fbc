"""What recomputing costs: FLOPs of a step's equations and of the segment each checkpoint name
closes, and the names a step has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxmem._src import flop_count as _fc
from jaxmem._src import jax_compat as _jc
from jaxmem._src.remat import auto as _auto
from jaxmem._src.remat import policies as _policies


@dataclasses.dataclass(frozen=True)
class NameEstimate:
    """A checkpoint name's estimated cost of saving (bytes) and of recomputing (FLOPs)."""

    name: str
    bytes: int
    flops: float


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
        total += _fc.eqn_flops(eqn)
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
    with _auto.use_setting(_auto.Setting(_policies.nothing)):
        closed = jax.make_jaxpr(loss_fn)(*args)
    found: dict[str, tuple[int, float]] = {}
    _walk(_jc.open_jaxpr(closed), 1, found, set())
    return [NameEstimate(n, b, f) for n, (b, f) in sorted(found.items())]


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # Older jax: one dict per computation.
        return float(sum((c or {}).get("flops", 0.0) for c in cost))
    return float((cost or {}).get("flops", 0.0))


# The names the other units use.
discover = _discover
compiled_flops = _flops
