"""Measures benchmark cases: compiled temp bytes, residual bytes and step time, stock vs variants.

What is measured follows docs/design.md §3:

- temp bytes: ``memory_analysis().temp_size_in_bytes`` of ``jax.jit(jax.grad(loss, argnums=all))``
  (via :func:`jaxmem.profile` on the gradient function), compiled on abstract arguments;
- residual bytes: the total of the saved-residual listing of the loss
  (:attr:`jaxmem.MemoryReport.residual_bytes`), split by origin so that the residuals that are
  simply the arguments can be told apart from the ones the loop stacks;
- time (optional): forward + backward of the jitted gradient on concrete arguments, same process,
  warm (compiled and run once first), in rounds of stock / variant / ..., each timed run right
  after an untimed run of the same function; min and median of ``repeats`` runs.

Every variant figure is also given as a ratio to the stock figure of the same run.

This module is also the one timing loop (:func:`time_interleaved`; one-shot wall times of
planning: :func:`wall_seconds`), the one table formatter (:func:`table`) and the one bytes
formatter (:func:`format_mib`: MiB, 2^20 bytes) of every benchmark (:mod:`benchmarks.losses`,
:mod:`benchmarks.flax_stacks`, ...); ``tests/benchmarks/test_benchmarks.py`` checks that no other
module times with ``time.perf_counter`` or aligns a table itself.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from benchmarks.cases import Case, ScanImpl

STOCK = "stock"
"""Label of the reference column, ``make_loss(jax.lax.scan)``."""

MIN_REPEATS = 7
"""Fewest timed repeats per column (docs/design.md §3)."""

MIB = 2**20
"""Bytes in a MiB: the one unit of every benchmark table."""

T = TypeVar("T")


def compiled_flops(compiled) -> float:
    """A compiled program's FLOPs (``cost_analysis``; older jax gives one dict per computation)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        return float(sum((c or {}).get("flops", 0.0) for c in cost))
    return float((cost or {}).get("flops", 0.0))


def format_mib(n: float | None) -> str:
    """Formats a byte count in MiB (2^20 bytes), the unit of every benchmark table.

    Args:
      n: bytes, or None (shown as ``"-"``).

    Returns:
      ``"12.0 MiB"``; three decimals below 1 MiB, so that small shapes do not read as zero.

    Examples:
      >>> format_mib(3 * 2**20), format_mib(16.8e6), format_mib(2**10), format_mib(None)
      ('3.0 MiB', '16.0 MiB', '0.001 MiB', '-')
    """
    if n is None:
        return "-"
    mib = n / MIB
    return f"{mib:.1f} MiB" if mib == 0 or abs(mib) >= 1 else f"{mib:.3f} MiB"


@dataclasses.dataclass(frozen=True)
class Timing:
    """The timed runs of one function (see :func:`time_interleaved`).

    Attributes:
      min_s: Fastest run, seconds.
      median_s: Median run, seconds.
      samples_s: Every timed run, seconds, in order.
      output: What the warm-up run returned (for checking results against a reference).
    """

    min_s: float
    median_s: float
    samples_s: tuple[float, ...]
    output: Any


def time_interleaved(
    fns: Mapping[Any, Callable[..., Any]],
    *args: Any,
    repeats: int = MIN_REPEATS,
    settle: int = 1,
    setup: Callable[[Any], Sequence[Any]] | None = None,
) -> dict[Any, Timing]:
    """Times functions on the same arguments: warm, in interleaved rounds, min and median.

    docs/design.md §3: same process; each function is first run once (compiling it if it is
    a ``jax.jit`` function; its result is kept), then ``repeats`` rounds A B C, A B C, ...,
    each run waited for with :func:`jax.block_until_ready`. In a round each function runs
    ``settle`` times untimed and then once timed, so that a timed run follows a run of the
    same function, as in a training loop. A run leaves work behind it after its result is
    ready (on CPU, most likely a large temp buffer's pages going back: after the naive
    cross-entropy's 1 GiB, the next run took 0.08-0.1 s longer, an effect gone after 0.2 s);
    timed right after another function, a run would pay for that function's tail and not for
    its own.

    Args:
      fns: Label -> function of ``*args`` (jitted or compiled).
      *args: The arguments of every function.
      repeats: Timed runs per function.
      settle: Untimed runs of a function right before each of its timed runs (0: plain
        A B A B, each timed run right after the other functions' runs).
      setup: Called untimed with a function's label before each of its runs (warm-up, settling
        and timed); what it returns is that run's arguments instead of ``args`` (e.g. a fresh
        function to trace, so that no trace cache carries over from one run to the next).

    Returns:
      Label -> its timing, in the order of ``fns``.

    Examples:
      >>> import jax.numpy as jnp
      >>> t = time_interleaved({"a": jnp.sin, "b": jnp.cos}, jnp.zeros(3), repeats=3)
      >>> list(t), len(t["a"].samples_s), float(t["b"].output[0])
      (['a', 'b'], 3, 1.0)
    """
    if repeats < 1 or settle < 0:
        raise ValueError(f"time_interleaved: repeats >= 1 and settle >= 0, got {repeats}, {settle}")
    arguments = (lambda label: args) if setup is None else setup
    outputs = {  # warm-up
        label: jax.block_until_ready(fn(*arguments(label))) for label, fn in fns.items()
    }
    samples: dict[Any, list[float]] = {label: [] for label in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            for _ in range(settle):
                jax.block_until_ready(fn(*arguments(label)))
            run_args = arguments(label)
            start = time.perf_counter()
            jax.block_until_ready(fn(*run_args))
            samples[label].append(time.perf_counter() - start)
    return {
        label: Timing(min(ts), statistics.median(ts), tuple(ts), outputs[label])
        for label, ts in samples.items()
    }


def wall_seconds(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """Runs ``fn(*args)`` once; returns its result and the wall seconds it took.

    For one-shot costs that are not step times (planning a budget, a first trace), so that no
    other module reads the clock: step times go through :func:`time_interleaved`.

    Examples:
      >>> result, seconds = wall_seconds(divmod, 7, 2)
      >>> result, seconds >= 0
      ((3, 1), True)
    """
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def table(
    headers: Sequence[str] | None,
    rows: Iterable[Sequence[Any] | str],
    *,
    align: str = "l",
    groups: Sequence[tuple[str, int]] | None = None,
    markdown: bool = False,
) -> str:
    """Renders a text table: the one table formatter of every benchmark.

    Args:
      headers: The column names, or None for rows alone (no header line, no rule).
      rows: Each a sequence of cells (``str()`` of each; a row shorter than the others leaves
        its last cells blank), or a ``str``: a line of its own between the rows (a section
        title), as it is, not counted in the column widths.
      align: A letter per column, ``"l"`` (left) or ``"r"`` (right); the columns past its end
        are right-aligned (the default: the first column left, numbers right).
      groups: ``(label, number of columns)`` spans, in order, for a line above the header with
        each label centred over its columns in dashes (``""``: blank); plain tables only.
      markdown: A GitHub-flavoured markdown table (``| a | b |`` rows under a ``|---|---:|``
        rule) instead of plain text (columns two spaces apart, a dashed rule under the header,
        blank under a blank header: a column of notes).

    Returns:
      The table's lines, joined by newlines, without trailing spaces in plain text.

    Examples:
      >>> print(table(["case", "temp"], [["rnn", "1.0 MiB"], ["long name", "12.0 MiB"]]))
      case           temp
      ---------  --------
      rnn         1.0 MiB
      long name  12.0 MiB
      >>> print(table(["case", "x"], [["rnn", "x0.50"]], markdown=True))
      | case |     x |
      |------|------:|
      | rnn  | x0.50 |
    """
    if markdown and groups:
        raise ValueError("table: groups are for plain tables only")
    if align.strip("lr"):
        raise ValueError(f"table: align takes 'l' and 'r' letters, got {align!r}")
    body = [r if isinstance(r, str) else [str(c) for c in r] for r in rows]
    head = None if headers is None else [str(h) for h in headers]
    grid = [r for r in [head, *body] if isinstance(r, list)]
    ncols = max((len(r) for r in grid), default=0)
    widths = [max(len(r[i]) for r in grid if i < len(r)) for i in range(ncols)]
    if markdown:
        widths = [max(w, 1) for w in widths]
    right = [(align[i] if i < len(align) else "r") == "r" for i in range(ncols)]
    # A group label wider than its columns widens the last of them.
    start = 0
    for label, span in groups or ():
        missing = len(label) - (sum(widths[start : start + span]) + 2 * (span - 1))
        if missing > 0:
            widths[start + span - 1] += missing
        start += span

    def line(row: list[str]) -> str:
        row = row + [""] * (ncols - len(row))
        padded = [
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True)
        ]
        return f"| {' | '.join(padded)} |" if markdown else "  ".join(padded).rstrip()

    lines = []
    if groups:
        spans, start = [], 0
        for label, span in groups:
            width = sum(widths[start : start + span]) + 2 * (span - 1)
            spans.append(label.center(width, "-") if label else " " * width)
            start += span
        lines.append("  ".join(spans).rstrip())
    if head is not None:
        head += [""] * (ncols - len(head))
        if markdown:
            rule = ["-" * (w + 1) + (":" if r else "-") for w, r in zip(widths, right, strict=True)]
            lines += [line(head), f"|{'|'.join(rule)}|"]
        else:  # no rule under a blank header (a column of notes)
            rule = [("-" if h.strip() else " ") * w for h, w in zip(head, widths, strict=True)]
            lines += [line(head), "  ".join(rule).rstrip()]
    lines += [r if isinstance(r, str) else line(r) for r in body]
    return "\n".join(lines)


@dataclasses.dataclass
class Column:
    """The figures of one case under one scan implementation.

    Attributes:
      label: ``"stock"`` or a variant's label.
      temp_bytes: Compiled temp bytes of the jitted gradient.
      argument_bytes: Compiled argument bytes of the jitted gradient.
      output_bytes: Compiled output bytes of the jitted gradient.
      peak_bytes: Peak bytes of the jitted gradient, where the backend reports one.
      residual_bytes: Total bytes of the loss's saved-residual listing.
      residual_bytes_by_origin: The same total split by origin (argument, loop-stacked, ...).
      kept_bytes: What the backward pass keeps from the loop: ``lax.scan``'s loop-stacked
        residuals for stock; for ``jaxmem.scan`` its plans' ``ScanResiduals.stacked_bytes`` (partial
        activations, kept carry sequences and the ys read back), summed over the loss's scans.
      time_min_s: Fastest timed step, seconds (None unless timed).
      time_median_s: Median timed step, seconds (None unless timed).
      grad_rel_err: For a timed variant, max |g - g_stock| / max |g_stock| over all gradients.
      error: The exception text where measuring this column failed, else None.
    """

    label: str
    temp_bytes: int | None = None
    argument_bytes: int | None = None
    output_bytes: int | None = None
    peak_bytes: int | None = None
    residual_bytes: int | None = None
    residual_bytes_by_origin: dict[str, int] = dataclasses.field(default_factory=dict)
    kept_bytes: int | None = None
    time_min_s: float | None = None
    time_median_s: float | None = None
    grad_rel_err: float | None = None
    error: str | None = None

    @property
    def residual_bytes_non_argument(self) -> int | None:
        """Residual bytes that are not simply (slices of) the loss's arguments."""
        if self.residual_bytes is None:
            return None
        return self.residual_bytes - self.residual_bytes_by_origin.get("argument", 0)


@dataclasses.dataclass
class CaseResult:
    """All columns of one case; ``columns[STOCK]`` is the reference."""

    name: str
    description: str
    columns: dict[str, Column]

    def ratio(self, label: str, field: str) -> float | None:
        """Returns ``columns[label].<field> / columns[STOCK].<field>``, or None if unavailable."""
        num = getattr(self.columns[label], field)
        den = getattr(self.columns[STOCK], field)
        if num is None or den is None or den == 0:
            return None
        return num / den


def grad_fn(case: Case, scan_impl: ScanImpl):
    """Returns ``jax.grad`` of the case's loss under ``scan_impl`` w.r.t. every argument."""
    return jax.grad(case.make_loss(scan_impl), argnums=case.argnums())


def measure_memory(case: Case, label: str, scan_impl: ScanImpl) -> Column:
    """Measures the compile-time memory figures of one case under one scan implementation.

    Args:
      case: The benchmark case.
      label: Column label.
      scan_impl: Scan implementation with the signature of ``jax.lax.scan``.

    Returns:
      The column; on failure its ``error`` holds the exception and the figures stay None.
    """
    col = Column(label)
    args = case.abstract_args()
    try:
        grad_report = jaxmem.profile(grad_fn(case, scan_impl), *args)
        loss_report = jaxmem.profile(case.make_loss(scan_impl), *args)
    except Exception as e:  # noqa: BLE001 - a failing variant is reported, not fatal.
        col.error = _error_text(e)
        return col
    col.temp_bytes = grad_report.temp_bytes
    col.argument_bytes = grad_report.argument_bytes
    col.output_bytes = grad_report.output_bytes
    col.peak_bytes = grad_report.peak_bytes
    col.residual_bytes = loss_report.residual_bytes
    col.residual_bytes_by_origin = dict(loss_report.residual_bytes_by_origin or {})
    if loss_report.scan_plans:
        col.kept_bytes = sum(p.stacked_bytes for p in loss_report.scan_plans)
    else:
        col.kept_bytes = col.residual_bytes_by_origin.get("loop-stacked")
    return col


def measure_times(
    case: Case, impls: Mapping[str, ScanImpl], repeats: int
) -> dict[str, tuple[float, float, Any]]:
    """Times the jitted gradient of a case under several scan implementations, interleaved.

    Args:
      case: The benchmark case.
      impls: Label -> scan implementation; all are timed in the same process.
      repeats: Timed runs per implementation, in interleaved rounds (:func:`time_interleaved`).

    Returns:
      Label -> (min seconds, median seconds, gradients of the warm-up run).
    """
    args = case.make_args()
    compiled = {
        label: jax.jit(grad_fn(case, impl)).lower(*args).compile() for label, impl in impls.items()
    }
    times = time_interleaved(compiled, *args, repeats=repeats)
    return {label: (t.min_s, t.median_s, t.output) for label, t in times.items()}


def _rel_err(grads: Any, reference: Any) -> float:
    """Returns max |grads - reference| / max |reference| over all leaves."""
    diff = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), grads, reference)
    scale = jax.tree.map(lambda b: jnp.max(jnp.abs(b)), reference)
    den = max(float(s) for s in jax.tree.leaves(scale))
    return max(float(d) for d in jax.tree.leaves(diff)) / (den or 1.0)


def _error_text(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


def run_case(
    case: Case,
    variants: Mapping[str, ScanImpl],
    *,
    timed: bool = False,
    repeats: int = MIN_REPEATS,
) -> CaseResult:
    """Measures one case: the stock column, then one column per variant.

    Args:
      case: The benchmark case.
      variants: Label -> scan implementation; ``"stock"`` is reserved.
      timed: Whether to time the jitted gradients too.
      repeats: Timed runs per column.

    Returns:
      The case's result.

    Raises:
      ValueError: If a variant is labelled ``"stock"``.
    """
    if STOCK in variants:
        raise ValueError(f"variant label {STOCK!r} is reserved for jax.lax.scan; rename it.")
    impls = {STOCK: jax.lax.scan, **variants}
    result = CaseResult(case.name, case.description, {})
    for label, impl in impls.items():
        result.columns[label] = measure_memory(case, label, impl)
    if timed:
        ok = {label: impls[label] for label, col in result.columns.items() if col.error is None}
        if STOCK in ok:
            try:
                times = measure_times(case, ok, repeats)
            except Exception as e:  # noqa: BLE001
                for label in ok:
                    result.columns[label].error = _error_text(e)
            else:
                for label, (t_min, t_med, grads) in times.items():
                    col = result.columns[label]
                    col.time_min_s, col.time_median_s = t_min, t_med
                    if label != STOCK:
                        col.grad_rel_err = _rel_err(grads, times[STOCK][2])
    return result


def run(
    cases: Sequence[Case],
    variants: Mapping[str, ScanImpl],
    *,
    timed: bool = False,
    repeats: int = MIN_REPEATS,
) -> list[CaseResult]:
    """Measures every case (see :func:`run_case`)."""
    return [run_case(c, variants, timed=timed, repeats=repeats) for c in cases]


# ----------------------------------------------------------------------------------------------
# Output.


def environment() -> dict[str, Any]:
    """Returns the run's context: versions, backend, device, date."""
    device = jax.devices()[0]
    return {
        "jax_version": jax.__version__,
        "jaxlib_version": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
        "jaxmem_version": getattr(jaxmem, "__version__", None),
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def to_dict(
    results: Sequence[CaseResult], *, timed: bool, repeats: int | None = None
) -> dict[str, Any]:
    """Returns every figure of a run, JSON-ready, with the run's environment."""
    out: dict[str, Any] = {**environment(), "timed": timed, "repeats": repeats if timed else None}
    out["cases"] = {}
    for r in results:
        columns = {}
        for label, col in r.columns.items():
            d = dataclasses.asdict(col)
            d["residual_bytes_non_argument"] = col.residual_bytes_non_argument
            if label != STOCK:
                d["ratios"] = {
                    f: r.ratio(label, f)
                    for f in (
                        "temp_bytes",
                        "residual_bytes",
                        "residual_bytes_non_argument",
                        "kept_bytes",
                        "time_min_s",
                        "time_median_s",
                    )
                }
            columns[label] = d
        out["cases"][r.name] = {"description": r.description, "columns": columns}
    return out


def _x(r: float | None) -> str:
    return "-" if r is None else f"x{r:.2f}"


def format_table(results: Sequence[CaseResult], *, timed: bool) -> str:
    """Returns one plain-text table: a row per case, the stock group then one group per variant.

    Bytes are in MiB (2^20 bytes); ``xR`` is the ratio to the stock figure of the same run.
    ``temp``: compiled temp bytes of the jitted gradient. ``resid``: total of the loss's
    saved-residual listing. ``w/o args``: the same without residuals that are the loss's own
    arguments (alive anyway; docs/design.md §1 counts the rest). ``kept``: what the backward
    pass keeps from the loop (:attr:`Column.kept_bytes`). ``time``: step time of the
    jitted gradient, min over repeats for stock; min and median ratios for variants.
    """
    labels = list(results[0].columns) if results else [STOCK]
    groups = [
        ("", ["case"]),
        (STOCK, ["temp", "resid", "w/o args", "kept"] + (["time"] if timed else [])),
    ]
    variant_cols = ["temp", "x", "resid", "x", "w/o args", "x", "kept", "x"]
    if timed:
        variant_cols += ["time min", "med"]
    groups += [(label, variant_cols) for label in labels[1:]]
    header = [name for _, names in groups for name in names]
    rows = []
    errors = []
    for r in results:
        s = r.columns[STOCK]
        row = [
            r.name,
            format_mib(s.temp_bytes),
            format_mib(s.residual_bytes),
            format_mib(s.residual_bytes_non_argument),
            format_mib(s.kept_bytes),
        ]
        if timed:
            row.append("-" if s.time_min_s is None else f"{s.time_min_s * 1e3:.2f} ms")
        for label in labels[1:]:
            c = r.columns[label]
            row += [
                format_mib(c.temp_bytes),
                _x(r.ratio(label, "temp_bytes")),
                format_mib(c.residual_bytes),
                _x(r.ratio(label, "residual_bytes")),
                format_mib(c.residual_bytes_non_argument),
                _x(r.ratio(label, "residual_bytes_non_argument")),
                format_mib(c.kept_bytes),
                _x(r.ratio(label, "kept_bytes")),
            ]
            if timed:
                row += [_x(r.ratio(label, "time_min_s")), _x(r.ratio(label, "time_median_s"))]
        rows.append(row)
        errors += [f"{r.name} / {c.label}: {c.error}" for c in r.columns.values() if c.error]
    lines = [table(header, rows, groups=[(label, len(names)) for label, names in groups])]
    if errors:
        lines += ["", "errors:"] + [f"  {e}" for e in errors]
    return "\n".join(lines)


def has_errors(results: Sequence[CaseResult]) -> bool:
    """Returns whether any column of any case failed to measure."""
    return any(c.error for r in results for c in r.columns.values())


def json_default(x: Any) -> Any:
    """JSON fallback for numpy scalars."""
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
