"""The public view of a plan: each residual with its source, kind and bytes (ScanResiduals, as
jaxmem.scan_residuals returns it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxmem._src import jax_compat as jc
from jaxmem._src.scan.jaxprs import (
    _is_var,
    _nbytes,
    kept_bytes,
)
from jaxmem._src.scan.residuals import RESIDUAL_CLASSES, SplitStep


@dataclasses.dataclass(frozen=True)
class PlannedResidual:
    """One residual of a scan step's VJP, and where :func:`jaxmem.scan` gets it from.

    Attributes:
      shape: shape of the per-step value.
      dtype: numpy dtype name.
      bytes: bytes of the per-step value.
      kind: one of ``"xs"``, ``"const"``, ``"carry"``, ``"ys"``, ``"recomputed"``, ``"stacked"``;
        ``"checkpoint"`` for a carry leaf a checkpointed scan stores (``ScanResiduals.stacked``).
      source: ``file:line (function)`` of the operation that produced it, or the input it is.
      encoding: for a value kept under ``compress``, the format it is stored in (``"bf16"``,
        ``"fp8"``, ``"int8"``; ``bytes`` is then the encoded size, scales included), else None.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> step = lambda c, x: (jnp.sin(c) * x, None)  # recompute="cheap": the fewest bytes
      >>> plan = jaxmem.scan_residuals(step, jnp.ones(3), jnp.ones((5, 3)), recompute="cheap")
      >>> [(r.kind, r.shape, r.bytes) for r in plan.residuals]  # x, cos(c), sin(c)
      [('xs', (3,), 12), ('recomputed', (3,), 12), ('recomputed', (3,), 12)]
    """

    shape: tuple[int, ...]
    dtype: str
    bytes: int
    kind: str
    source: str
    encoding: str | None = None


@dataclasses.dataclass(frozen=True)
class ScanResiduals:
    """What :func:`jaxmem.scan` keeps for the backward pass of one scan, next to ``lax.scan``.

    Attributes:
      length: number of steps.
      residuals: every residual of one step's VJP, classified.
      stacked: what is kept per step for the backward pass: the partial activations
        (kind ``"stacked"``), the carry leaves whose sequence is kept (kind ``"carry"``) and the ys
        outputs the backward pass reads (kind ``"ys"``: kept alive, not copied).
      stacked_bytes: bytes stacked over the whole scan (``length`` times the per-step ``stacked``).
      stock_stacked_bytes: bytes :func:`jax.lax.scan` stacks for the same step (its loop-stacked
        residuals), or None when not measured.
      schedule: with ``checkpoints``, the :class:`jaxmem.CheckpointSchedule` (then ``stacked``
        lists the carry leaves, kind ``"checkpoint"``, and ``stacked_bytes`` is the bytes of the
        checkpoints: one step's residuals are live at a time); None otherwise.
      program: ``"lean"``, or ``"stock"`` for a loop unrolled whole whose gradient compiles
        leaner as ``lax.scan``'s own (:mod:`jaxmem._src.scan.unrolled`): it runs so, and then
        ``stacked`` is empty and ``stacked_bytes`` is ``stock_stacked_bytes``.
      compiled: for a loop unrolled whole, ``(lax.scan's, program's)`` temp bytes of the loop's
        gradient compiled alone (the figures ``program`` is chosen by: a straight-line program
        keeps what XLA's schedule keeps, not the stacks counted above); None otherwise. The
        plans :meth:`jaxmem.Optimized.explain` reports hold it for rolled loops too.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> step = lambda c, x: (jnp.sin(c) * x, None)
      >>> plan = jaxmem.scan_residuals(step, jnp.ones(3), jnp.ones((5, 3)), recompute="cheap")
      >>> plan.stacked_bytes, plan.stock_stacked_bytes, plan.ratio  # carry sequence vs 2 stacks
      (60, 120, 0.5)
      >>> plan.counts()["recomputed"], [r.kind for r in plan.stacked]
      (2, ['carry'])

      The default, ``recompute="auto"``, prices recomputes against the step's time: this step
      has no dot to hide a sine and a cosine behind, so it keeps them, as ``lax.scan`` does.

      >>> jaxmem.scan_residuals(step, jnp.ones(3), jnp.ones((5, 3))).ratio
      1.0

      Unrolled whole, a loop runs the program whose gradient, compiled alone, needs the least
      temp; ``compiled`` holds ``lax.scan``'s temp and that program's (three compilations at the
      first trace):

      >>> w = jnp.eye(8) * 0.5
      >>> rnn = lambda h, x: (jnp.tanh(h @ w + x),) * 2
      >>> plan = jaxmem.scan_residuals(rnn, jnp.zeros((4, 8)), jnp.ones((16, 4, 8)), unroll=True)
      >>> plan.program, plan.compiled[1] < plan.compiled[0]
      ('lean', True)
    """

    length: int
    residuals: tuple[PlannedResidual, ...]
    stacked: tuple[PlannedResidual, ...]
    stacked_bytes: int
    stock_stacked_bytes: int | None
    schedule: Any = None
    program: str = "lean"
    compiled: tuple[int, int] | None = None

    @property
    def ratio(self) -> float | None:
        """``stacked_bytes / stock_stacked_bytes`` (None when the stock figure is unknown or 0)."""
        if not self.stock_stacked_bytes:
            return None
        return self.stacked_bytes / self.stock_stacked_bytes

    def counts(self) -> dict[str, int]:
        """Number of residuals of each kind."""
        return {k: sum(r.kind == k for r in self.residuals) for k in RESIDUAL_CLASSES}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return {
            "length": self.length,
            "residuals": [dataclasses.asdict(r) for r in self.residuals],
            "stacked": [dataclasses.asdict(r) for r in self.stacked],
            "stacked_bytes": self.stacked_bytes,
            "stock_stacked_bytes": self.stock_stacked_bytes,
            "schedule": None if self.schedule is None else dataclasses.asdict(self.schedule),
            "program": self.program,
            "compiled": None if self.compiled is None else list(self.compiled),
            "counts": self.counts(),
        }

    def __str__(self) -> str:
        def row(r):
            kind = r.kind if r.encoding is None else f"{r.kind}:{r.encoding}"
            return f"  {r.dtype}{list(r.shape)!s:<18} {r.bytes:>12,d} B  {kind:<10} {r.source}"

        lines = [f"scan plan: {self.length} steps, {len(self.residuals)} residuals per step"]
        lines += [row(r) for r in self.residuals]
        if self.schedule is None:
            lines.append("kept per step (partial activations, carry sequences, ys read back):")
        else:
            lines.append(f"kept per checkpoint ({self.schedule.checkpoints} at most):")
        lines += [row(r) for r in self.stacked] or ["  (nothing)"]
        stock = (
            "not measured"
            if self.stock_stacked_bytes is None
            else f"{self.stock_stacked_bytes:,d} B"
        )
        ratio = "" if self.ratio is None else f" ({self.ratio:.2f}x)"
        if self.schedule is not None:
            lines.append(str(self.schedule))
        lines.append(f"stacked over the scan: {self.stacked_bytes:,d} B{ratio}; lax.scan: {stock}")
        return "\n".join(lines)


def as_stock(plan: ScanResiduals) -> ScanResiduals:
    """``plan`` for a loop that runs as ``lax.scan``'s own VJP (:mod:`jaxmem._src.scan.unrolled`):
    nothing of jaxmem's kept, ``lax.scan``'s bytes."""
    return dataclasses.replace(
        plan, stacked=(), stacked_bytes=plan.stock_stacked_bytes, program="stock"
    )


def _var_source(eqn_of, v, role: str) -> str:
    eqn = eqn_of.get(v)
    if eqn is None:
        return role
    return jc.summarize_source(eqn.source_info)


def summarize(
    plan: SplitStep,
    length: int,
    stock_stacked_bytes: int | None,
    schedule: Any = None,
) -> ScanResiduals:
    """The public :class:`ScanResiduals` of an analysed step (of a checkpointed scan with
    ``schedule``, a :class:`jaxmem.CheckpointSchedule`: its checkpoints are its only stack;
    under ``compress``, each kept value with its encoded size, :attr:`SplitStep.enc_stacked`)."""
    jaxpr = plan.traced.jaxpr
    eqn_of = {v: e for e in jaxpr.eqns for v in e.outvars}
    role = {}
    for v in plan.const_invars:
        role[v] = "const"
    for v in plan.carry_invars:
        role[v] = "carry"
    for v in plan.x_invars:
        role[v] = "xs"

    def planned(v, kind, enc=None):
        aval = v.aval
        nbytes = kept_bytes(aval) if kind == "stacked" else _nbytes(aval)
        encoded = enc is not None and enc.format is not None
        return PlannedResidual(
            shape=tuple(aval.shape),
            dtype=str(aval.dtype) if hasattr(aval, "dtype") else "",
            bytes=enc.nbytes if encoded else nbytes,
            kind=kind,
            source=("literal" if not _is_var(v) else _var_source(eqn_of, v, role.get(v, "const"))),
            encoding=enc.format if encoded else None,
        )

    kept_carry = [
        (v, j)
        for v, keep, j in zip(plan.carry_invars, plan.stack_carry, plan.carry_seq_y, strict=True)
        if keep
    ]
    enc_stacked, enc_carry = plan.enc_stacked, plan.enc_carry

    residuals = tuple(
        planned(v, kind) for v, kind in zip(plan.res_outvars, plan.res_classes, strict=True)
    )
    stacked = (
        tuple(planned(v, "stacked", e) for v, e in zip(plan.stacked_vars, enc_stacked, strict=True))
        + tuple(
            planned(v, "carry", e)
            for (v, j), e in zip(kept_carry, enc_carry, strict=True)
            if j < 0  # a kept sequence that is a ys stack is listed as that y
        )
        + tuple(
            planned(v, "ys") for v, need in zip(plan.y_outvars, plan.need_y, strict=True) if need
        )
    )
    if schedule is not None:
        stacked = tuple(planned(v, "checkpoint") for v in plan.carry_invars)
        return ScanResiduals(
            length=length,
            residuals=residuals,
            stacked=stacked,
            stacked_bytes=schedule.kept_bytes,
            stock_stacked_bytes=stock_stacked_bytes,
            schedule=schedule,
        )
    per_step = sum(r.bytes for r in stacked)
    return ScanResiduals(
        length=length,
        residuals=residuals,
        stacked=stacked,
        stacked_bytes=per_step * length,
        stock_stacked_bytes=stock_stacked_bytes,
    )
