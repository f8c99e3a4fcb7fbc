"""Long-scan benchmark: checkpointed ``jaxmem.scan`` against ``lax.scan`` and Equinox.

The case ``long_rnn``: an RNN ``h = tanh(h @ W + x @ U)`` over T steps, B=16, H=256, x width 64,
f32; parameters ``W[H, H]``, ``U[64, H]``, ``h0[B, H]``, inputs ``xs[T, B, 64]``; the step returns
``(h, None)`` and the loss is ``sum(h_T**2)`` (the final carry only), differentiated with respect
to ``(W, U, h0)`` (not ``xs``). Its gradient through ``lax.scan`` keeps O(T) residuals; binomial
(Revolve) checkpointing keeps at most ``k`` carries and recomputes forward steps instead.

Columns, for each T of ``--lengths`` (default 512 2048 8192):

- ``lax.scan``, the reference;
- ``jaxmem.scan`` (no checkpoints: the lean scan, still O(T));
- ``jaxmem.scan(checkpoints=k)``, ``k`` from ``--checkpoints`` (default 64);
- ``jaxmem.scan(checkpoints="sqrt")`` (``k = ceil(sqrt(T))``);
- ``equinox checkpointed (k)``: ``equinox.internal.scan(..., kind="checkpointed",
  checkpoints=k)``, when Equinox imports (``pip install jaxmem[bench]``).

Each column: compiled temp bytes of ``jax.jit(jax.grad(loss, argnums=(0, 1, 2)))`` (docs/design.md
§3: ``memory_analysis().temp_size_in_bytes``), as a ratio to ``lax.scan``'s and to
``jaxmem.scan``'s; forward + backward time of that compiled gradient (same process, warm, the
columns interleaved, median of ``--repeats``; :func:`benchmarks.harness.time_interleaved`) as a
ratio to ``lax.scan``'s and to Equinox's; the gradient's max relative error against
``lax.scan``'s; for the checkpointed jaxmem columns, the forward steps of their schedule
(``jaxmem.scan_residuals(..., checkpoints=k).schedule.forward_steps``).

Then a sweep over ``k`` (default 8 16 32 64 128 256) at one T (``--sweep-length``, default 2048):
temp and time of ``jaxmem.scan(checkpoints=k)`` and of Equinox at the same ``k``, with
``lax.scan`` timed alongside as the reference of the gradient error.

Criteria of the issue, printed as PASS, FAIL or SKIPPED (a criterion whose inputs were not
measured, e.g. Equinox absent or T not among ``--lengths``, is SKIPPED; a column that failed to
measure FAILs the criteria that read it):

(a) at T=2048 and ``k = --checkpoints`` (64): ``jaxmem.scan(checkpoints=k)`` temp <= 0.15x
    ``jaxmem.scan``'s; temp <= 1.1x Equinox's at the same k; fwd+bwd time (median) <= Equinox's;
(b) ``checkpoints="sqrt"``: temp at T=8192 <= 6x temp at T=512.

``--quick`` (for tests) uses B=2, H=8, x width 4, T in 16 64, k=4, a sweep over k in 2 8 at
T=64 and 2 repeats, compiled without LLVM optimization; its criteria are the same bounds at T=64
(a) and T=16 vs 64 (b), and say nothing about the issue's sizes.

Usage: ``python -m benchmarks.long_rnn [--quick] [--json PATH] [--lengths T ...]
[--checkpoints K] [--sweep-length T] [--sweep K ...] [--repeats N] [--no-check]``.
Prints two tables (bytes in MiB, 2^20, as every benchmark) and the criteria; ``--json`` writes
every figure with the run's environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import jaxmem
from benchmarks import harness
from benchmarks.harness import format_mib

ScanImpl = Callable[..., Any]
"""A scan with the call signature ``scan(f, init, xs)`` of :func:`jax.lax.scan`."""

LAX = "lax.scan"
LEAN = "jaxmem.scan"
SQRT = 'jaxmem.scan(checkpoints="sqrt")'

TEMP_VS_LEAN = 0.15
"""Criterion (a): checkpointed temp / ``jaxmem.scan`` temp must not exceed this."""

TEMP_VS_EQUINOX = 1.1
"""Criterion (a): checkpointed temp / Equinox's temp at the same k must not exceed this."""

SQRT_GROWTH = 6.0
"""Criterion (b): ``checkpoints="sqrt"`` temp at the longest T / at the shortest, at most."""


def checkpointed_label(k: int) -> str:
    """Column label of ``jaxmem.scan(checkpoints=k)``."""
    return f"jaxmem.scan(checkpoints={k})"


def equinox_label(k: int) -> str:
    """Column label of Equinox's checkpointed scan with ``k`` checkpoints."""
    return f"equinox checkpointed ({k})"


# ----------------------------------------------------------------------------------------------
# The case.


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Sizes of the RNN (the length T is per point).

    Attributes:
      batch: B.
      hidden: H, the carry width.
      x_width: width of each step's input.
    """

    batch: int
    hidden: int
    x_width: int

    def __str__(self) -> str:
        return f"B={self.batch} H={self.hidden} x width={self.x_width}, f32"


@dataclasses.dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
      sizes: the RNN's sizes.
      lengths: the T of the main table.
      checkpoints: k of the ``jaxmem.scan(checkpoints=k)`` and Equinox columns.
      sweep_length: the T of the sweep over k.
      sweep: the k of the sweep.
      repeats: timed runs per column.
      accept_length: the T of criterion (a).
      sqrt_lengths: the shortest and longest T of criterion (b).
      fast_compile: compile with :data:`FAST_COMPILE` (the same temp bytes, slower code).
    """

    sizes: Sizes
    lengths: tuple[int, ...]
    checkpoints: int
    sweep_length: int
    sweep: tuple[int, ...]
    repeats: int
    accept_length: int
    sqrt_lengths: tuple[int, int]
    fast_compile: bool = False


FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
"""XLA options of ``--quick``: no LLVM optimization, a faster compile on CPU. Buffer assignment
(hence temp bytes) runs before code generation and is the same; the times are of slower code."""

DEFAULT = Config(
    Sizes(batch=16, hidden=256, x_width=64),
    lengths=(512, 2048, 8192),
    checkpoints=64,
    sweep_length=2048,
    sweep=(8, 16, 32, 64, 128, 256),
    repeats=harness.MIN_REPEATS,
    accept_length=2048,
    sqrt_lengths=(512, 8192),
)
"""The issue's sizes and criteria."""

QUICK = Config(
    Sizes(batch=2, hidden=8, x_width=4),
    lengths=(16, 64),
    checkpoints=4,
    sweep_length=64,
    sweep=(2, 8),
    repeats=2,
    accept_length=64,
    sqrt_lengths=(16, 64),
    fast_compile=True,
)
"""Tiny sizes for tests (``--quick``)."""


def make_args(sizes: Sizes, length: int) -> tuple[jax.Array, ...]:
    """Returns ``(W, U, h0, xs)``, normal with variance-preserving scales, for T = ``length``."""
    kw, ku, kh, kx = jax.random.split(jax.random.key(0), 4)
    b, h, x = sizes.batch, sizes.hidden, sizes.x_width
    return (
        jax.random.normal(kw, (h, h)) / h**0.5,
        jax.random.normal(ku, (x, h)) / x**0.5,
        jax.random.normal(kh, (b, h)),
        jax.random.normal(kx, (length, b, x)),
    )


def make_step(W: jax.Array, U: jax.Array) -> Callable:
    """The step ``h -> tanh(h @ W + x @ U)``, returning ``(h, None)``."""

    def step(h, x):
        return jnp.tanh(h @ W + x @ U), None

    return step


def make_loss(scan: ScanImpl) -> Callable:
    """``loss(W, U, h0, xs) = sum(h_T**2)`` with the RNN scanned by ``scan``."""

    def loss(W, U, h0, xs):
        h, _ = scan(make_step(W, U), h0, xs)
        return jnp.sum(h**2)

    return loss


def grad_fn(scan: ScanImpl) -> Callable:
    """The gradient of :func:`make_loss` with respect to ``(W, U, h0)``."""
    return jax.grad(make_loss(scan), argnums=(0, 1, 2))


def equinox_scan(k: int) -> ScanImpl | None:
    """Equinox's checkpointed scan with ``k`` checkpoints, or None when Equinox is absent."""
    try:
        import equinox.internal as eqxi  # noqa: PLC0415 - optional comparison point
    except ImportError:
        return None

    def scan(f, init, xs):
        length = jax.tree.leaves(xs)[0].shape[0]
        return eqxi.scan(f, init, xs, length, kind="checkpointed", checkpoints=k)

    return scan


def columns(k: int) -> dict[str, ScanImpl]:
    """Label -> scan of the main table, ``lax.scan`` first; Equinox only when it imports."""
    impls = {
        LAX: jax.lax.scan,
        LEAN: jaxmem.scan,
        checkpointed_label(k): functools.partial(jaxmem.scan, checkpoints=k),
        SQRT: functools.partial(jaxmem.scan, checkpoints="sqrt"),
    }
    eqx = equinox_scan(k)
    if eqx is not None:
        impls[equinox_label(k)] = eqx
    return impls


def schedule_steps(args: Sequence[jax.Array], checkpoints: int | str) -> int | None:
    """Forward steps of jaxmem's schedule (``scan_residuals(...).schedule``), None if unknown.

    Args:
      args: ``(W, U, h0, xs)``, as :func:`make_args` returns them.
      checkpoints: the ``checkpoints`` argument of :func:`jaxmem.scan`.
    """
    W, U, h0, xs = args
    try:
        plan = jaxmem.scan_residuals(make_step(W, U), h0, xs, checkpoints=checkpoints)
        return int(plan.schedule.forward_steps)
    except Exception:  # noqa: BLE001 - a figure for the table, not a measurement.
        return None


# ----------------------------------------------------------------------------------------------
# Measuring.


@dataclasses.dataclass
class Column:
    """The figures of one scan at one T.

    Attributes:
      label: the column's label.
      temp_bytes: compiled temp bytes of the jitted gradient.
      time_min_s: fastest timed fwd+bwd run, seconds.
      time_median_s: median timed fwd+bwd run, seconds.
      grad_rel_err: max |g - g_lax| / max |g_lax| over the three gradients.
      forward_steps: step evaluations of jaxmem's checkpointing schedule (jaxmem's checkpointed
        columns only).
      error: the exception text where compiling or running this column failed, else None.
    """

    label: str
    temp_bytes: int | None = None
    time_min_s: float | None = None
    time_median_s: float | None = None
    grad_rel_err: float | None = None
    forward_steps: int | None = None
    error: str | None = None


@dataclasses.dataclass
class Point:
    """Every column at one T (main table) or one k (sweep)."""

    length: int
    checkpoints: int | None
    columns: dict[str, Column]

    def ratio(self, label: str, ref: str, field: str) -> float | None:
        """``columns[label].<field> / columns[ref].<field>``, None where either is missing."""
        if label not in self.columns or ref not in self.columns:
            return None
        num = getattr(self.columns[label], field)
        den = getattr(self.columns[ref], field)
        return None if num is None or not den else num / den


def measure_point(
    length: int,
    checkpoints: int | None,
    impls: Mapping[str, ScanImpl],
    config: Config,
    steps: Mapping[str, int | str] | None = None,
) -> Point:
    """Compiles, measures and times (interleaved) the gradient under each scan at one T.

    Args:
      length: T.
      checkpoints: the k this point is about (for the sweep), else None.
      impls: label -> scan; the first is the reference of the gradient errors.
      config: sizes and repeats.
      steps: label -> ``checkpoints`` argument, for the columns whose schedule is reported.

    Returns:
      The point; a column that fails to compile or run holds the error text, not figures.
    """
    args = make_args(config.sizes, length)
    point = Point(length, checkpoints, {})
    compiled = {}
    for label, impl in impls.items():
        col = point.columns[label] = Column(label)
        try:
            options = FAST_COMPILE if config.fast_compile else None
            compiled[label] = jax.jit(grad_fn(impl)).lower(*args).compile(options)
        except Exception as e:  # noqa: BLE001 - a failing column is reported, not fatal.
            col.error = harness._error_text(e)
            continue
        col.temp_bytes = compiled[label].memory_analysis().temp_size_in_bytes
        if steps and label in steps:
            col.forward_steps = schedule_steps(args, steps[label])
    try:
        times = harness.time_interleaved(compiled, *args, repeats=config.repeats)
    except Exception as e:  # noqa: BLE001
        for label in compiled:
            point.columns[label].error = harness._error_text(e)
        return point
    ref = next(iter(impls))
    for label, t in times.items():
        col = point.columns[label]
        col.time_min_s, col.time_median_s = t.min_s, t.median_s
        if ref in times:
            col.grad_rel_err = harness._rel_err(t.output, times[ref].output)
    return point


def run(config: Config) -> tuple[list[Point], list[Point]]:
    """Measures the main table (one point per T) and the sweep (one point per k)."""
    impls = columns(config.checkpoints)
    steps = {checkpointed_label(config.checkpoints): config.checkpoints, SQRT: "sqrt"}
    main = []
    for length in config.lengths:
        main.append(measure_point(length, None, impls, config, steps))
        print(f"  measured T={length}", file=sys.stderr, flush=True)
    # The sweep: one interleaved group at the sweep T, so that every k is timed alike.
    sweep_impls: dict[str, ScanImpl] = {LAX: jax.lax.scan}
    sweep_steps: dict[str, int | str] = {}
    for k in config.sweep:
        sweep_impls[checkpointed_label(k)] = functools.partial(jaxmem.scan, checkpoints=k)
        sweep_steps[checkpointed_label(k)] = k
        eqx = equinox_scan(k)
        if eqx is not None:
            sweep_impls[equinox_label(k)] = eqx
    group = measure_point(config.sweep_length, None, sweep_impls, config, sweep_steps)
    print(f"  measured the sweep at T={config.sweep_length}", file=sys.stderr, flush=True)
    sweep = []
    for k in config.sweep:
        cols = {LAX: group.columns[LAX]}
        for label in (checkpointed_label(k), equinox_label(k)):
            if label in group.columns:
                cols[label] = group.columns[label]
        sweep.append(Point(config.sweep_length, k, cols))
    return main, sweep


# ----------------------------------------------------------------------------------------------
# Criteria.

PASS, FAIL, SKIPPED = "PASS", "FAIL", "SKIPPED"


@dataclasses.dataclass(frozen=True)
class Check:
    """One criterion.

    Attributes:
      name: what is checked.
      verdict: ``"PASS"``, ``"FAIL"`` or ``"SKIPPED"`` (its inputs were not measured).
      detail: the figures it was decided on, or why it was skipped.
    """

    name: str
    verdict: str
    detail: str


def _figure(points: Mapping[int, Point], length: int, label: str, field: str):
    """``(value, None)``, or ``(None, (verdict, reason))`` where the figure is missing: SKIPPED
    when it was not measured (T not in the run, no such column), FAIL when measuring failed."""
    if length not in points:
        return None, (SKIPPED, f"T={length} not measured")
    col = points[length].columns.get(label)
    if col is None:
        return None, (SKIPPED, f"no {label} column")
    value = getattr(col, field)
    if value is None:
        return None, (FAIL, f"{label} at T={length}: {col.error or 'not measured'}")
    return value, None


def _bound(name: str, num, den, factor: float, describe: Callable[[Any], str]) -> Check:
    """``num <= factor * den``; SKIPPED/FAIL when a figure is missing."""
    for value, missing in (num, den):
        if value is None:
            return Check(name, *missing)
    ratio = num[0] / den[0]
    detail = f"{describe(num[0])} vs {describe(den[0])}: x{ratio:.3f} (bound x{factor:g})"
    return Check(name, PASS if ratio <= factor else FAIL, detail)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def check(points: Sequence[Point], config: Config) -> list[Check]:
    """The issue's criteria on the main table (see the module docstring)."""
    by_length = {p.length: p for p in points}
    t, k = config.accept_length, config.checkpoints
    ours, eqx = checkpointed_label(k), equinox_label(k)
    temp = lambda label, length=t: _figure(by_length, length, label, "temp_bytes")
    time = lambda label: _figure(by_length, t, label, "time_median_s")
    short, long = config.sqrt_lengths
    return [
        _bound(
            f"(a) T={t}: {ours} temp <= {TEMP_VS_LEAN}x {LEAN}",
            temp(ours),
            temp(LEAN),
            TEMP_VS_LEAN,
            format_mib,
        ),
        _bound(
            f"(a) T={t}: {ours} temp <= {TEMP_VS_EQUINOX}x {eqx}",
            temp(ours),
            temp(eqx),
            TEMP_VS_EQUINOX,
            format_mib,
        ),
        _bound(f"(a) T={t}: {ours} fwd+bwd time <= {eqx}", time(ours), time(eqx), 1.0, _ms),
        _bound(
            f"(b) {SQRT} temp at T={long} <= {SQRT_GROWTH:g}x at T={short}",
            temp(SQRT, long),
            temp(SQRT, short),
            SQRT_GROWTH,
            format_mib,
        ),
    ]


def passed(checks: Sequence[Check]) -> bool:
    """No criterion failed (SKIPPED ones do not count either way)."""
    return all(c.verdict != FAIL for c in checks)


# ----------------------------------------------------------------------------------------------
# Output.


def _x(r: float | None) -> str:
    return "-" if r is None else f"x{r:.3f}"


def _errors(points: Sequence[Point]) -> list[str]:
    seen, out = set(), []
    for p in points:
        for c in p.columns.values():
            if c.error and (p.length, c.label) not in seen:
                seen.add((p.length, c.label))
                out.append(f"  T={p.length} / {c.label}: {c.error}")
    return out


def _err(e: float | None) -> str:
    return "-" if e is None else f"{e:.1e}"


def format_main(points: Sequence[Point], config: Config) -> str:
    """One row per (T, column).

    ``temp``: compiled temp bytes of the jitted gradient; ``/lax``, ``/jaxmem``: its ratio to
    ``lax.scan``'s and ``jaxmem.scan``'s. ``fwd steps``: step evaluations of jaxmem's schedule.
    ``time``: median fwd+bwd; ``t/lax``, ``t/eqx``: its ratio to ``lax.scan``'s and Equinox's
    (at ``k = --checkpoints``). ``grad err``: max |g - g_lax| / max |g_lax|.
    """
    eqx = equinox_label(config.checkpoints)
    header = ["T", "column", "temp", "/lax", "/jaxmem", "fwd steps", "time", "t/lax", "t/eqx"]
    header.append("grad err")
    rows = []
    for p in points:
        for label, c in p.columns.items():
            rows.append(
                [
                    str(p.length),
                    label,
                    format_mib(c.temp_bytes),
                    _x(p.ratio(label, LAX, "temp_bytes")),
                    _x(p.ratio(label, LEAN, "temp_bytes")),
                    "-" if c.forward_steps is None else str(c.forward_steps),
                    _ms(c.time_median_s),
                    _x(p.ratio(label, LAX, "time_median_s")),
                    _x(p.ratio(label, eqx, "time_median_s")),
                    "-" if label == LAX else _err(c.grad_rel_err),
                ]
            )
    lines = [harness.table(header, rows, align="ll")]
    errors = _errors(points)
    return "\n".join(lines + (["", "errors:", *errors] if errors else []))


def format_sweep(points: Sequence[Point]) -> str:
    """One row per k: jaxmem's and Equinox's temp and median time, and their ratios."""
    header = ["k", "jaxmem temp", "eqx temp", "j/eqx", "fwd steps", "jaxmem time", "eqx time"]
    header += ["j/eqx", "j/lax", "grad err"]
    rows = []
    for p in points:
        ours, eqx = checkpointed_label(p.checkpoints), equinox_label(p.checkpoints)
        c = p.columns[ours]
        e = p.columns.get(eqx, Column(eqx))
        rows.append(
            [
                str(p.checkpoints),
                format_mib(c.temp_bytes),
                format_mib(e.temp_bytes),
                _x(p.ratio(ours, eqx, "temp_bytes")),
                "-" if c.forward_steps is None else str(c.forward_steps),
                _ms(c.time_median_s),
                _ms(e.time_median_s),
                _x(p.ratio(ours, eqx, "time_median_s")),
                _x(p.ratio(ours, LAX, "time_median_s")),
                _err(c.grad_rel_err),
            ]
        )
    lines = [harness.table(header, rows)]
    if points:
        lax = points[0].columns[LAX]
        lines.insert(
            0,
            f"sweep over k at T={points[0].length}: lax.scan temp {format_mib(lax.temp_bytes)}, "
            f"time {_ms(lax.time_median_s)}",
        )
    errors = _errors(points)
    return "\n".join(lines + (["", "errors:", *errors] if errors else []))


def format_checks(checks: Sequence[Check]) -> str:
    """One line per criterion, then the overall verdict (SKIPPED ones counted apart)."""
    rows = [[c.verdict, f"{c.name}: {c.detail}"] for c in checks]
    lines = [harness.table(None, rows, align="ll")] if rows else []
    skipped = sum(c.verdict == SKIPPED for c in checks)
    verdict = PASS if passed(checks) else FAIL
    lines.append(verdict + (f" ({skipped} skipped)" if skipped else ""))
    return "\n".join(lines)


def _point_dict(p: Point, eqx: str) -> dict[str, Any]:
    out: dict[str, Any] = {"length": p.length, "checkpoints": p.checkpoints, "columns": {}}
    for label, c in p.columns.items():
        d = dataclasses.asdict(c)
        d["ratios"] = {
            "temp_bytes_vs_lax": p.ratio(label, LAX, "temp_bytes"),
            "temp_bytes_vs_jaxmem": p.ratio(label, LEAN, "temp_bytes"),
            "temp_bytes_vs_equinox": p.ratio(label, eqx, "temp_bytes"),
            "time_median_vs_lax": p.ratio(label, LAX, "time_median_s"),
            "time_median_vs_equinox": p.ratio(label, eqx, "time_median_s"),
        }
        out["columns"][label] = d
    return out


def to_dict(
    main: Sequence[Point], sweep: Sequence[Point], checks: Sequence[Check], config: Config
) -> dict[str, Any]:
    """Every figure of a run, JSON-ready, with the run's environment and configuration."""
    out: dict[str, Any] = {**harness.environment(), "case": "long_rnn"}
    out["equinox_version"] = _equinox_version()
    out["config"] = dataclasses.asdict(config)
    out["points"] = [_point_dict(p, equinox_label(config.checkpoints)) for p in main]
    out["sweep"] = [_point_dict(p, equinox_label(p.checkpoints)) for p in sweep]
    out["checks"] = [dataclasses.asdict(c) for c in checks]
    out["passed"] = passed(checks)
    return out


def _equinox_version() -> str | None:
    try:
        import equinox  # noqa: PLC0415

        return equinox.__version__
    except ImportError:
        return None


# ----------------------------------------------------------------------------------------------
# Command line.


def build_parser() -> argparse.ArgumentParser:
    """Returns the command-line parser."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.long_rnn",
        description=(
            "Compiled temp bytes and fwd+bwd time of the gradient of a long RNN: lax.scan, "
            "jaxmem.scan, jaxmem.scan with binomial checkpointing (k and sqrt) and Equinox's "
            "checkpointed scan (when installed); then a sweep over k."
        ),
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes and 2 repeats, for tests")
    p.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write every figure here")
    p.add_argument("--lengths", nargs="+", type=int, metavar="T", help="default 512 2048 8192")
    p.add_argument("--checkpoints", type=int, metavar="K", help="k of the columns (default 64)")
    p.add_argument("--sweep-length", type=int, metavar="T", help="T of the sweep (default 2048)")
    p.add_argument(
        "--sweep", nargs="+", type=int, metavar="K", help="k of the sweep (8 16 32 64 128 256)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        metavar="N",
        help=f"timed runs per column, interleaved (default and minimum {harness.MIN_REPEATS}; "
        "2 with --quick)",
    )
    p.add_argument("--no-check", action="store_true", help="exit 0 even when a criterion fails")
    return p


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = build_parser()
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULT
    config = dataclasses.replace(
        base,
        lengths=tuple(sorted(set(args.lengths))) if args.lengths else base.lengths,
        checkpoints=args.checkpoints or base.checkpoints,
        sweep_length=args.sweep_length or base.sweep_length,
        sweep=tuple(sorted(set(args.sweep))) if args.sweep else base.sweep,
        repeats=args.repeats or base.repeats,
    )
    if not args.quick and config.repeats < harness.MIN_REPEATS:
        parser.error(f"--repeats must be >= {harness.MIN_REPEATS} (docs/design.md §3)")
    if min(config.lengths + config.sweep + (config.checkpoints, config.sweep_length)) < 1:
        parser.error("lengths and checkpoint counts must be positive")
    return args, config


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints both tables and the criteria.

    Args:
      argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
      The exit status: 0, or 1 if a criterion fails (SKIPPED ones do not) and ``--no-check`` is
      not given.
    """
    args, config = _parse(argv)
    env = harness.environment()
    eqx = _equinox_version()
    print(
        f"jax {env['jax_version']} | backend {env['backend']} ({env['device_kind']}) | "
        f"equinox {eqx or 'not installed'} | {env['date']}\n"
        f"case long_rnn: h = tanh(h @ W + x @ U), {config.sizes}; loss sum(h_T**2), grad "
        f"w.r.t. (W, U, h0) | k={config.checkpoints} | sqrt: k=ceil(sqrt(T)) | median of "
        f"{config.repeats} interleaved runs",
        flush=True,
    )
    main_points, sweep_points = run(config)
    checks = check(main_points, config)
    print(format_main(main_points, config))
    print()
    print(format_sweep(sweep_points))
    print()
    print(format_checks(checks))
    if args.json is not None:
        data = to_dict(main_points, sweep_points, checks, config)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2, default=harness.json_default) + "\n")
        print(f"wrote {args.json}")
    return 0 if passed(checks) or args.no_check else 1


if __name__ == "__main__":
    sys.exit(main())
