"""What a recompute costs: the price list behind ``jaxmem.scan(recompute="auto")``.

The min-cut of :mod:`jaxmem._src.scan.residuals` minimises the bytes kept per step over the values
the backward step may recompute. With ``recompute="cheap"`` that is every cheap equation
(elementwise, data movement); with ``"auto"`` (the default) it is those whose recompute is nearly
free, in the sense of He & Yu's fusion-aware checkpointing: a chain of elementwise operations
recomputed in the backward step fuses into the fusion that reads its inputs, so it costs its
arithmetic (memory traffic is what a stored value would have cost anyway), and a recompute that
cannot fuse costs a pass over memory of its own. Two rules follow (:func:`plan_filter`, then the cut
of ``residuals._priced_cut``):

1. **A layout change of a computed value is kept, not recomputed** (where
   :attr:`CostModel.fused_transpose` is False). A transpose does not fuse into its consumer on
   XLA:CPU; recomputed in the backward step, it reads the stored value in the other layout, and
   the dots around it lose their fast path: on an Equinox MLP stack (``jax.vmap`` of ``Linear``
   is a dot followed by a transpose) the recompute of that transpose made ``jaxmem.scan`` 1.25x
   ``lax.scan``'s step time, for no memory (the transposed value has the same bytes). A
   transpose of an *input* (an xs slice, a loop invariant, a carry) folds into the dot that
   reads it and stays cheap: that is what keeps a transposed weight stack out of memory.
2. **A time budget.** The recomputes the cut chose are priced (:func:`eqn_seconds`: transcendental
   elements at :attr:`CostModel.transcendental_per_s`, arithmetic at
   :attr:`CostModel.elementwise_per_s`, unfused copies at :attr:`CostModel.bytes_per_s`) against
   the step's own time (:func:`step_seconds`: its dots at :attr:`CostModel.dot_flops_per_s`, the
   rest as above, three times over for forward and backward), less the memory traffic the
   recompute saves (each byte not kept is neither written in the forward step nor read in the
   backward step: :func:`traffic_seconds`). Above :attr:`CostModel.budget` of the step's time,
   the most expensive recompute is kept instead, and the cut is made again.

The constants live here and nowhere else, one :class:`CostModel` per backend
(:func:`for_backend`). They are orders of magnitude, not measurements of one machine: the
decisions they make are tested (``tests/scan/test_recompute_cost.py``) and the step times they
protect are measured by ``python -m benchmarks.peers`` against ``lax.scan``.

References:
  He & Yu, "Transcending Runtime-Memory Tradeoffs in Checkpointing by being Fusion Aware"
  (MLSys 2023).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from jaxmem._src import flop_count as _fc
from jaxmem._src import jax_compat as jc

# Elementwise functions evaluated by a polynomial or a loop of them: priced per element as
# transcendental; the rest of the cheap elementwise set as arithmetic.
TRANSCENDENTAL: frozenset[str] = frozenset(
    """
    acos acosh asin asinh atan atan2 atanh cbrt cos cosh erf erf_inv erfc exp exp2 expm1 log
    log1p log2 logistic pow rsqrt sin sinh sqrt tan tanh
    """.split()
)
# Recomputes that copy memory instead of fusing into their consumer.
LAYOUT: frozenset[str] = frozenset({"transpose", "rev"})
COPIES: frozenset[str] = frozenset({"concatenate", "pad", "all_gather"})
DOTS = _fc.DOTS


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Rates of one backend (per second) and the recompute budget.

    Attributes:
      dot_flops_per_s: matrix-multiply throughput (2 FLOPs per multiply-add).
      elementwise_per_s: elements per second of fused arithmetic (add, mul, select, compare...).
      transcendental_per_s: elements per second of exp, tanh, erf, log, ...
      bytes_per_s: memory bandwidth, for recomputes that copy (concatenate, pad, transpose).
      budget: the recompute time the backward step may add, as a fraction of the step's time.
      fused_transpose: whether a transpose of a computed value fuses into its consumer.
    """

    dot_flops_per_s: float
    elementwise_per_s: float
    transcendental_per_s: float
    bytes_per_s: float
    budget: float = 0.05
    fused_transpose: bool = False


# XLA:CPU, two cores with AVX2 (CI's machine): Eigen matmuls near 1e11 FLOP/s; a fused
# elementwise loop does 8-wide arithmetic per cycle and core, a polynomial (exp, erf, tanh) some
# 20 operations per element.
CPU = CostModel(
    dot_flops_per_s=1e11,
    elementwise_per_s=4e10,
    transcendental_per_s=2e9,
    bytes_per_s=2e10,
)
# A datacenter GPU: elementwise recomputes fused into the backward kernels are nearly free next
# to the tensor cores' matmuls, and XLA's transpose emitter tiles layout changes. CI has no GPU:
# the structure of the decisions is tested with it there. On one H200 (jax 0.11.2) its cuts ran
# the Equinox stacks at 0.84x-0.94x lax.scan's step time and benchmarks.run's cases at
# 0.76x-0.93x, each faster than recompute="none" (docs/scan.md, docs/benchmarks.md).
GPU = CostModel(
    dot_flops_per_s=4e14,
    elementwise_per_s=1e13,
    transcendental_per_s=2e12,
    bytes_per_s=2e12,
    fused_transpose=True,
)
_BY_PLATFORM = {"cpu": CPU, "gpu": GPU, "cuda": GPU, "rocm": GPU, "tpu": GPU}


def for_backend(platform: str | None = None) -> CostModel:
    """The cost model of ``platform`` (default: JAX's default backend)."""
    if platform is None:
        import jax

        platform = jax.default_backend()
    return _BY_PLATFORM.get(platform, CPU)


def eqn_seconds(eqn, model: CostModel) -> float:
    """Estimated time of one equation (a call's as the sum of its body's)."""
    name = eqn.primitive.name
    subs = jc.subjaxprs(eqn)
    if subs:
        return sum(eqn_seconds(e, model) for sub in subs for e in sub.eqns)
    if name in DOTS:
        return _fc.dot_flops(eqn) / model.dot_flops_per_s
    out_avals = [v.aval for v in eqn.outvars]
    if name in TRANSCENDENTAL:
        return _fc.elements(out_avals) / model.transcendental_per_s
    if name in COPIES or (name in LAYOUT and not model.fused_transpose):
        return 2 * sum(jc.nbytes(a) for a in out_avals) / model.bytes_per_s
    in_avals = [v.aval for v in eqn.invars if jc.is_var(v)]
    return max(_fc.elements(out_avals), _fc.elements(in_avals)) / model.elementwise_per_s


def traffic_seconds(nbytes: int, model: CostModel) -> float:
    """Time to write ``nbytes`` kept in the forward step and read them back in the backward."""
    return 2 * nbytes / model.bytes_per_s


def step_seconds(eqns: Iterable, model: CostModel) -> float:
    """Estimated time of a step's forward and backward pass: three times its forward's."""
    return 3 * sum(eqn_seconds(e, model) for e in eqns)


def fuses(eqn, inputs: frozenset | set, model: CostModel) -> bool:
    """Whether recomputing ``eqn`` in the backward step fuses into what reads it: False for a
    layout change (transpose) of a value the step computes, unless the backend fuses those;
    ``inputs`` are the step's inputs and loop invariants (their layout changes fold into the
    dots that read them)."""
    if eqn.primitive.name in LAYOUT and not model.fused_transpose:
        return all((not jc.is_var(u)) or u in inputs for u in eqn.invars)
    return True


def plan_filter(
    cheap: Callable, inputs: frozenset | set, model: CostModel
) -> Callable[[object], bool]:
    """The recompute predicate of ``recompute="auto"``: cheap and fusing (rule 1)."""
    return lambda eqn: cheap(eqn) and fuses(eqn, inputs, model)
