"""Long context (issue 51): how the gradient's memory grows with the sequence length.

Two Llama-like decoders as their users write them, with the same sizes (2 layers scanned,
D=256, 4 heads, SwiGLU width 4D, vocabulary 2048, f32, RMSNorm, RoPE, causal attention through
``jax.nn.dot_product_attention``): :mod:`benchmarks.models.llama_long` (plain JAX, a params
dict, ``jax.lax.scan`` over stacked weights) and :mod:`benchmarks.models.llama_long_nnx` (Flax
NNX, ``nnx.vmap`` + ``nnx.scan``). For each, three columns:

- ``stock``: the loss as written, no remat;
- ``stock full remat``: each layer under ``jax.checkpoint(policy=nothing_saveable)``, stock
  JAX's leanest policy;
- ``jaxmem``: ``jaxmem.optimize(loss, chunk_tokens=True)`` of the loss as written (where the
  installed jaxmem lacks that API the column reads ``n/a`` with the error's type, and the
  criteria that read it FAIL).

Figures (docs/design.md §3): the compiled temp bytes of ``jax.jit(jax.value_and_grad(loss))``
with respect to the parameters at B=1 and S in 1024 .. 16384 (compiled on abstract arguments,
never run); the growth temp(8192) / temp(2048) per column; jaxmem's temp at 8192 over full
remat's; the longest power-of-two S (up to 65536) whose jaxmem temp fits in stock's temp at
S=2048; the step time of the value and gradient at S=2048, jaxmem against stock, in interleaved
rounds (:func:`benchmarks.harness.time_interleaved`, the median over rounds of the per-round
ratio); the gradients of jaxmem against stock at S=1024 (max |diff| / max |g|, over all
parameters).

Criteria of the issue, per model, printed as PASS or FAIL (exit status 1 if any fails):
growth <= 4.5; temp at 8192 <= 0.05x full remat's; longest fitting S >= 32768; time ratio
<= 1.00; gradients within 1e-5 of the largest.

jax 0.12.1 runs ``jax.nn.softmax`` through its custom JVP by default (``jax_softmax_custom_jvp``
True; False on 0.10.2), which keeps one ``[N, S, S]`` residual per layer where the other rule
keeps two: stock's temp without remat is 17% (S=1024) to 26% (S=8192) lower than with the flag
off, full remat's is the same. The issue's table (jax 0.12.0.1) matches the plain model on
0.10.2 within 2%. The flag is printed with the jax version. A full run takes about 4 minutes on
2 CPU cores (jax 0.12.1).

``--quick`` (for tests) runs D=32, 2 heads, V=64 at S in 64 .. 1024 with every criterion's
length scaled by 1/16 and 3 rounds; its criteria say nothing about the issue's sizes.

Usage: ``python -m benchmarks.long_context [--quick] [--json PATH] [--plot PATH]
[--model {plain,nnx}] [--repeats N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import pathlib
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxmem
from benchmarks import harness
from benchmarks.harness import format_mib
from benchmarks.lm1b import FAST_COMPILE
from benchmarks.long_rnn import FAIL, PASS, Check, format_checks, passed
from benchmarks.models import llama_long, llama_long_nnx
from benchmarks.models.llama_long import LlamaConfig

STOCK = "stock"
REMAT = "stock full remat"
JAXMEM = "jaxmem"
COLUMNS = (STOCK, REMAT, JAXMEM)

MAX_GROWTH = 4.5
"""Criterion: jaxmem's temp at the long length over its temp at the short one, at most."""

MAX_VS_REMAT = 0.05
"""Criterion: jaxmem's temp over stock full remat's at the long length, at most."""

MAX_TIME_RATIO = 1.0
"""Criterion: jaxmem's step time over stock's (median of the per-round ratios), at most."""

MAX_GRAD_ERR = 1e-5
"""Criterion: max |g_jaxmem - g_stock| / max |g_stock| over all parameters, at most."""


def chunk_tokens_available() -> bool:
    """Whether the installed ``jaxmem.optimize`` takes ``chunk_tokens`` (the jaxmem column)."""
    return "chunk_tokens" in inspect.signature(jaxmem.optimize).parameters


# ----------------------------------------------------------------------------------------------
# Configuration and models.


@dataclasses.dataclass(frozen=True)
class Config:
    """The sizes of one run.

    Attributes:
      model: the decoder's sizes.
      lengths: sequence lengths of the main table (B=1).
      growth: ``(short, long)``: the growth is temp(long) / temp(short); long is also where
        jaxmem is compared with full remat.
      fit_budget_length: stock's temp (no remat) at this length is the budget of the longest
        fitting S.
      fit_min_length: criterion: the longest S whose jaxmem temp fits is at least this.
      fit_max_length: the longest S tried (powers of two from ``fit_budget_length``).
      time_length: S of the timed step.
      grad_length: S of the gradient comparison.
      repeats: interleaved rounds of the timed step.
      batch: B.
      quick: compile without LLVM optimization even for the timed step (tests).
    """

    model: LlamaConfig = llama_long.DEFAULT
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    growth: tuple[int, int] = (2048, 8192)
    fit_budget_length: int = 2048
    fit_min_length: int = 32768
    fit_max_length: int = 65536
    time_length: int = 2048
    grad_length: int = 1024
    repeats: int = 11
    batch: int = 1
    quick: bool = False


FULL = Config()
QUICK = Config(
    model=LlamaConfig(d_model=32, num_heads=2, vocab_size=64),
    lengths=(64, 128, 256, 512, 1024),
    growth=(128, 512),
    fit_budget_length=128,
    fit_min_length=2048,
    fit_max_length=4096,
    time_length=128,
    grad_length=64,
    repeats=3,
    quick=True,
)


@dataclasses.dataclass(frozen=True)
class Model:
    """One decoder as the benchmark runs it.

    Attributes:
      name: its label.
      loss: ``(cfg, remat) -> (loss, abstract parameters)``: the loss as a function of
        ``(parameters, tokens)`` and its parameters' shapes.
      params: ``cfg -> concrete parameters`` of that loss (seeded).
    """

    name: str
    loss: Callable[[LlamaConfig, bool], tuple[Callable, Any]]
    params: Callable[[LlamaConfig], Any]


def _plain_loss(cfg: LlamaConfig, remat: bool) -> tuple[Callable, Any]:
    return llama_long.make_loss(cfg, remat=remat), llama_long.abstract_params(cfg)


def _nnx_params(cfg: LlamaConfig) -> Any:
    return llama_long_nnx.pure_loss(llama_long_nnx.Llama(cfg, rngs=nnx.Rngs(0)))[1]


MODELS = {
    "plain": Model(
        "plain JAX (llama_long)",
        _plain_loss,
        lambda cfg: llama_long.init(jax.random.key(0), cfg),
    ),
    "nnx": Model(
        "Flax NNX (llama_long_nnx)",
        lambda cfg, remat: llama_long_nnx.abstract_state(cfg, remat=remat),
        _nnx_params,
    ),
}


def column_loss(model: Model, cfg: LlamaConfig, label: str) -> tuple[Callable, Any]:
    """The loss of a column and its abstract parameters (``optimize`` raises where the installed
    jaxmem lacks ``chunk_tokens``: a TypeError)."""
    loss, params = model.loss(cfg, label == REMAT)
    return (jaxmem_loss(loss) if label == JAXMEM else loss), params


def jaxmem_loss(loss: Callable) -> Callable:
    """The jaxmem column's loss: ``jaxmem.optimize(loss, chunk_tokens=True)``."""
    return jaxmem.optimize(loss, chunk_tokens=True)


def _tokens(cfg: LlamaConfig, batch: int, length: int, concrete: bool = False) -> Any:
    if not concrete:
        return jax.ShapeDtypeStruct((batch, length), jnp.int32)
    return jax.random.randint(jax.random.key(1), (batch, length), 0, cfg.vocab_size, jnp.int32)


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]


# ----------------------------------------------------------------------------------------------
# Measuring.


@dataclasses.dataclass
class Result:
    """The figures of one model.

    Attributes:
      model: the model's label.
      temps: column -> S -> compiled temp bytes of the value-and-gradient (None: not measured).
      errors: column -> the first error that stopped it (its later figures are None).
      fit_budget: stock's temp at ``fit_budget_length``.
      time: the timed step (``stock_median_s``, ``jaxmem_median_s``, ``ratio``: median of the
        per-round ratios, ``samples``), or None.
      grad_err: max |g_jaxmem - g_stock| / max |g_stock| at ``grad_length``, or None.
      value_err: |loss_jaxmem - loss_stock| / |loss_stock| there, or None.
      skipped: why the time and the gradients were not measured, or None.
    """

    model: str
    temps: dict[str, dict[int, int | None]]
    errors: dict[str, str]
    fit_budget: int | None = None
    time: dict[str, Any] | None = None
    grad_err: float | None = None
    value_err: float | None = None
    skipped: str | None = None

    def temp(self, label: str, length: int) -> int | None:
        """A column's temp bytes at S=length, or None."""
        return self.temps.get(label, {}).get(length)

    def ratio(self, label: str, length: int, ref: str) -> float | None:
        """``temp(label) / temp(ref)`` at S=length, or None."""
        num, den = self.temp(label, length), self.temp(ref, length)
        return None if num is None or not den else num / den

    def growth(self, label: str, short: int, long: int) -> float | None:
        """A column's temp at ``long`` over its temp at ``short``, or None."""
        num, den = self.temp(label, long), self.temp(label, short)
        return None if num is None or not den else num / den

    def longest_fit(self, label: str, start: int) -> int | None:
        """The longest S from ``start`` on (powers of two, consecutive) whose temp fits in
        :attr:`fit_budget`, or None (none measured, or the first already too big)."""
        best, length = None, start
        while (t := self.temp(label, length)) is not None and self.fit_budget is not None:
            if t > self.fit_budget:
                break
            best, length = length, 2 * length
        return best


def _compile_temp(loss: Callable, params: Any, tokens: Any) -> int:
    """Compiled temp bytes; on CPU without LLVM optimization (:data:`FAST_COMPILE`: buffer
    assignment runs before code generation, the temp bytes are the same)."""
    lowered = jax.jit(jax.value_and_grad(loss)).lower(params, tokens)
    fast = jax.default_backend() == "cpu"
    compiled = lowered.compile(FAST_COMPILE) if fast else lowered.compile()
    return compiled.memory_analysis().temp_size_in_bytes


def measure_temp(model: Model, config: Config, label: str, length: int) -> int:
    """Compiled temp bytes of one column's value-and-gradient at S=length (compiled, not run)."""
    loss, params = column_loss(model, config.model, label)
    tokens = _tokens(config.model, config.batch, length)
    return _compile_temp(loss, params, tokens)


def _temps(model: Model, config: Config, result: Result) -> None:
    for label in COLUMNS:
        temps = result.temps.setdefault(label, {})
        for length in config.lengths:
            try:
                temps[length] = measure_temp(model, config, label, length)
            except Exception as e:  # noqa: BLE001 - a failing column is reported, not fatal.
                result.errors[label] = _error_text(e)
                for n in config.lengths:
                    temps.setdefault(n, None)
                break
    result.fit_budget = result.temp(STOCK, config.fit_budget_length)


def _fit(model: Model, config: Config, result: Result) -> None:
    """jaxmem's temp at the lengths past the table's, while it fits the budget."""
    length = max(config.lengths) * 2
    if result.errors.get(JAXMEM) or result.fit_budget is None:
        return
    if result.longest_fit(JAXMEM, config.fit_budget_length) != max(config.lengths):
        return  # already too big within the table
    while length <= config.fit_max_length:
        try:
            t = measure_temp(model, config, JAXMEM, length)
        except Exception as e:  # noqa: BLE001
            result.errors[JAXMEM] = _error_text(e)
            return
        result.temps[JAXMEM][length] = t
        if t > result.fit_budget:
            return
        length *= 2


def _runnable(model: Model, config: Config, label: str, length: int) -> Callable:
    loss, params = column_loss(model, config.model, label)
    lowered = jax.jit(jax.value_and_grad(loss)).lower(
        params, _tokens(config.model, config.batch, length)
    )
    return lowered.compile(FAST_COMPILE if config.quick else None)


def grad_error(got: Any, want: Any) -> float:
    """``max |got - want| / max |want|``, each maximum over every leaf."""
    pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs)
    scale = max(float(np.max(np.abs(np.asarray(b)))) for _, b in pairs)
    return diff / (scale or 1.0)


def _time_and_grads(model: Model, config: Config, result: Result) -> None:
    """The timed step at ``time_length`` and the gradients at ``grad_length``: jaxmem against
    stock (no remat), on the same seeded parameters and tokens."""
    if result.errors.get(JAXMEM) or result.errors.get(STOCK):
        failed = JAXMEM if result.errors.get(JAXMEM) else STOCK
        result.skipped = f"{failed} n/a ({result.errors[failed].split(':')[0]})"
        return
    params = model.params(config.model)
    cfg, batch = config.model, config.batch
    tokens = _tokens(cfg, batch, config.grad_length, concrete=True)
    (v_stock, g_stock), (v_ours, g_ours) = (
        _runnable(model, config, label, config.grad_length)(params, tokens)
        for label in (STOCK, JAXMEM)
    )
    result.grad_err = grad_error(g_ours, g_stock)
    result.value_err = abs(float(v_ours) - float(v_stock)) / abs(float(v_stock))
    tokens = _tokens(cfg, batch, config.time_length, concrete=True)
    fns = {label: _runnable(model, config, label, config.time_length) for label in (STOCK, JAXMEM)}
    times = harness.time_interleaved(fns, params, tokens, repeats=config.repeats)
    pairs = zip(times[JAXMEM].samples_s, times[STOCK].samples_s, strict=True)
    result.time = {
        "length": config.time_length,
        "repeats": config.repeats,
        "stock_median_s": times[STOCK].median_s,
        "jaxmem_median_s": times[JAXMEM].median_s,
        "ratio": statistics.median(a / b for a, b in pairs),
        "samples_s": {label: list(t.samples_s) for label, t in times.items()},
        "grad_err": grad_error(times[JAXMEM].output, times[STOCK].output),
    }


def measure(model: Model, config: Config, *, timed: bool = True) -> Result:
    """Every figure of one model: the temp table, the longest fitting S, and (``timed``) the
    step time and the gradient comparison."""
    result = Result(model.name, {}, {})
    _temps(model, config, result)
    _fit(model, config, result)
    if timed:
        _time_and_grads(model, config, result)
    return result


# ----------------------------------------------------------------------------------------------
# Criteria.


def _bound(name: str, value: float | None, bound: float, missing: str, digits: int) -> Check:
    if value is None:
        return Check(name, FAIL, missing)
    shown = f"{value:.{digits}e}" if value and abs(value) < 1e-3 else f"{value:.{digits}f}"
    return Check(name, PASS if value <= bound else FAIL, f"{shown} (bound {bound:g})")


def check(result: Result, config: Config) -> list[Check]:
    """The issue's criteria on one model's figures (a figure that was not measured FAILs)."""
    short, long = config.growth
    error = result.errors.get(JAXMEM)
    missing = f"{JAXMEM} n/a ({error.split(':')[0]})" if error else result.skipped or "n/a"
    fit = result.longest_fit(JAXMEM, config.fit_budget_length)
    time = None if result.time is None else result.time["ratio"]
    checks = [
        _bound(
            f"jaxmem temp({long}) / temp({short}) <= {MAX_GROWTH:g}",
            result.growth(JAXMEM, short, long),
            MAX_GROWTH,
            missing,
            2,
        ),
        _bound(
            f"jaxmem temp({long}) <= {MAX_VS_REMAT:g}x {REMAT}",
            result.ratio(JAXMEM, long, REMAT),
            MAX_VS_REMAT,
            missing,
            4,
        ),
    ]
    name = f"longest S with jaxmem temp <= stock temp({config.fit_budget_length}) >= "
    name += str(config.fit_min_length)
    if fit is None:
        checks.append(Check(name, FAIL, missing))
    else:
        verdict = PASS if fit >= config.fit_min_length else FAIL
        over = result.temp(JAXMEM, 2 * fit)
        detail = f"S={fit}" + (
            f" (S={2 * fit}: {format_mib(over)} > {format_mib(result.fit_budget)})"
            if over is not None
            else f" (longest tried: {config.fit_max_length})"
        )
        checks.append(Check(name, verdict, detail))
    checks += [
        _bound(
            f"step time at S={config.time_length}: jaxmem / stock <= {MAX_TIME_RATIO:.2f}",
            time,
            MAX_TIME_RATIO,
            missing,
            3,
        ),
        _bound(
            f"gradients at S={config.grad_length}: max|diff| / max|g| <= {MAX_GRAD_ERR:g}",
            result.grad_err,
            MAX_GRAD_ERR,
            missing,
            1,
        ),
    ]
    return checks


# ----------------------------------------------------------------------------------------------
# Output.


def _x(r: float | None, digits: int = 3) -> str:
    return "-" if r is None else f"x{r:.{digits}f}"


def _cell(result: Result, label: str, length: int) -> str:
    t = result.temp(label, length)
    if t is None and label in result.errors:
        return f"n/a ({result.errors[label].split(':')[0]})"
    return format_mib(t)


def format_result(result: Result, config: Config) -> str:
    """The temp table of one model, its summary figures and its errors."""
    lengths = sorted({n for temps in result.temps.values() for n in temps})
    header = ["S", *COLUMNS, "jaxmem/stock", "jaxmem/remat"]
    rows = [
        [
            str(n),
            *(_cell(result, label, n) for label in COLUMNS),
            _x(result.ratio(JAXMEM, n, STOCK), 4),
            _x(result.ratio(JAXMEM, n, REMAT), 4),
        ]
        for n in lengths
    ]
    short, long = config.growth
    budget = config.fit_budget_length
    summary = [
        [f"growth temp({long}) / temp({short})"]
        + [_x(result.growth(label, short, long), 2) for label in COLUMNS],
        [f"longest S within stock temp({budget}) = {format_mib(result.fit_budget)}"]
        + [str(result.longest_fit(label, budget) or "-") for label in COLUMNS],
    ]
    lines = [
        f"{result.model}: temp of jax.jit(jax.value_and_grad(loss)), B={config.batch}",
        harness.table(header, rows),
        "",
        harness.table(["", *COLUMNS], summary),
    ]
    if result.time is not None:
        t = result.time
        lines.append(
            f"step time at S={t['length']}: stock {t['stock_median_s'] * 1e3:.1f} ms, jaxmem "
            f"{t['jaxmem_median_s'] * 1e3:.1f} ms (medians); jaxmem / stock x{t['ratio']:.3f} "
            f"(median of {t['repeats']} paired rounds)"
        )
    if result.grad_err is not None:
        lines.append(
            f"gradients at S={config.grad_length}: max|diff| / max|g| {result.grad_err:.1e}, "
            f"loss rel. diff {result.value_err:.1e}"
        )
    if result.skipped:
        lines.append(f"time and gradients not measured: {result.skipped}")
    if result.errors:
        lines += ["errors:"] + [f"  {label}: {e}" for label, e in result.errors.items()]
    return "\n".join(lines)


def plot(results: Sequence[Result], config: Config, path: pathlib.Path) -> bool:
    """Temp against S, one panel per model, to ``path``; False where matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError:
        return False
    fig = Figure(figsize=(6 * len(results), 4.5), dpi=110)
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    for ax, result in zip(axes, results, strict=True):
        for label in COLUMNS:
            points = sorted((n, t) for n, t in result.temps.get(label, {}).items() if t)
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, [y / harness.MIB for y in ys], marker="o", label=label)
        if result.fit_budget:
            ax.axhline(result.fit_budget / harness.MIB, color="gray", ls=":", lw=0.8,
                       label=f"stock temp at S={config.fit_budget_length}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S (B=1)")
        ax.set_ylabel("gradient temp (MiB)")
        ax.set_title(result.model, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"value_and_grad temp vs length, jax {jax.__version__} ({jax.default_backend()})")
    fig.tight_layout()
    fig.savefig(path)
    return True


def to_dict(results: Sequence[Result], checks: dict[str, list[Check]], config: Config) -> dict:
    """Every figure of a run, JSON-ready, with the run's environment and configuration."""
    out: dict[str, Any] = {**harness.environment(), "benchmark": "long_context"}
    out["jax_softmax_custom_jvp"] = bool(jax.config.jax_softmax_custom_jvp)
    out["chunk_tokens_available"] = chunk_tokens_available()
    out["config"] = dataclasses.asdict(config) | {"model": str(config.model)}
    out["models"] = {}
    for r in results:
        d = dataclasses.asdict(r)
        d["temps"] = {label: {str(n): t for n, t in ts.items()} for label, ts in r.temps.items()}
        d["checks"] = [dataclasses.asdict(c) for c in checks[r.model]]
        out["models"][r.model] = d
    out["passed"] = all(passed(c) for c in checks.values())
    return out


# ----------------------------------------------------------------------------------------------
# Command line.


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints a table and the criteria per model.

    Returns:
      The exit status: 0, or 1 if a criterion fails.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_context", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write every figure")
    parser.add_argument("--plot", type=pathlib.Path, metavar="PATH", help="temp vs S, to a file")
    parser.add_argument("--model", choices=sorted(MODELS), action="append", help="default both")
    parser.add_argument("--repeats", type=int, help="paired rounds of the timed step (>= 11)")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 11 and not args.quick:
            parser.error("--repeats must be >= 11")
        config = dataclasses.replace(config, repeats=args.repeats)
    env = harness.environment()
    print(
        f"jax {env['jax_version']} (jax_softmax_custom_jvp={jax.config.jax_softmax_custom_jvp}) "
        f"| backend {env['backend']} ({env['device_kind']}) | {env['date']}\n"
        f"model: {config.model}\n"
        f"jaxmem column: jaxmem.optimize(loss, chunk_tokens=True)"
        + ("" if chunk_tokens_available() else " (not in the installed jaxmem)"),
        flush=True,
    )
    results, checks = [], {}
    for key in args.model or sorted(MODELS, reverse=True):
        result = measure(MODELS[key], config)
        checks[result.model] = check(result, config)
        results.append(result)
        print()
        print(format_result(result, config))
        print(format_checks(checks[result.model]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = to_dict(results, checks, config)
        args.json.write_text(json.dumps(data, indent=2, default=harness.json_default) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {args.plot}" if plot(results, config, args.plot) else "no matplotlib")
    return 0 if all(passed(c) for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
