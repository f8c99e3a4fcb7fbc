"""How much arithmetic an equation does: the one count behind both of jaxmem's cost models,
what a recompute costs in step time (:mod:`jaxmem._src.scan.recompute_cost`) and what
recomputing a checkpoint name's segment costs in FLOPs (:mod:`jaxmem._src.remat.flops`)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

# The contractions: their FLOPs are 2 x output elements x the contracted size.
DOTS: frozenset[str] = frozenset({"dot_general", "conv_general_dilated", "ragged_dot"})


def elements(avals: Iterable) -> int:
    """The number of elements of ``avals`` (a scalar has one; a token or a unit none)."""
    return sum(int(np.prod(getattr(a, "shape", ()), dtype=np.int64)) for a in avals)


def dot_flops(eqn) -> int:
    """2 x output elements x contracted size (dot_general); a conv's as its output x kernel."""
    out = elements(v.aval for v in eqn.outvars)
    if eqn.primitive.name == "dot_general":
        (lhs_c, _), _ = eqn.params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        k = int(np.prod([shape[d] for d in lhs_c], dtype=np.int64))
        return 2 * out * k
    kernel = eqn.invars[1].aval.shape
    return 2 * out * int(np.prod(kernel[1:], dtype=np.int64))


def eqn_flops(eqn) -> float:
    """The FLOPs of one equation: a contraction's (:func:`dot_flops`), one per output element
    for anything else."""
    if eqn.primitive.name in DOTS:
        return float(dot_flops(eqn))
    return float(elements(v.aval for v in eqn.outvars if hasattr(v.aval, "dtype")))
