"""The memory demo: a GPT training step's gradient under several scan and remat configurations.

Demo code (see :mod:`jaxmem.demo`), not library API. Run it as ``python -m jaxmem demo`` (what
``make demo`` runs) or ``python -m jaxmem.demo``, with the same options (``--help``).

The same small GPT (:mod:`jaxmem.demo.models`) is differentiated with its layer stack run by
``jax.lax.scan`` with no remat, with ``jax.checkpoint`` under the ``nothing_saveable`` and
``dots_saveable`` policies, and, where this install has it, by ``jaxmem.scan``. For each
configuration the demo compiles ``jax.jit(jax.grad(loss))`` and lists the residuals the gradient
saves (both from shapes alone: parameters and tokens are ``jax.ShapeDtypeStruct``), prints one
table with ratios to the first configuration (sizes in binary units, as
:func:`jaxmem.profile` prints them), then each configuration's peak and the three source lines
that hold the most of it (from XLA's buffer assignment), and saves a figure
(:mod:`jaxmem.demo.plots`): temp per configuration split into saved residuals and other temp.
It also runs each configuration's gradient (same process, interleaved, median of
:data:`TIME_REPEATS` or ``--repeats``), so the table has a step-time column and the figure a
panel of memory against step time, and it ends on one line of what jaxmem wins, computed from
the measured figures (:func:`conclusion`). ``--no-time`` compiles from shapes alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from jaxmem.demo import models, plots

DEFAULT_OUTPUT = "demo_memory.png"

DESCRIPTION = (
    "Memory of a small GPT's training-step gradient (jax.grad of next-token cross-entropy) with "
    "its layer stack run by jax.lax.scan with no remat, with jax.checkpoint under the "
    "nothing_saveable and dots_saveable policies, and by jaxmem.scan where available. Prints "
    "the compiled temp bytes of jax.jit(jax.grad(loss)), its peak, the bytes of the residuals "
    "the gradient saves and its step time, with ratios to the first configuration, then each "
    "configuration's peak and its top three contributors by source line, one line of what "
    "jaxmem wins, and saves a figure (temp per configuration, split into saved residuals and "
    "other temp; temp against step time). With --no-time everything is compiled from shapes "
    "alone (nothing is run)."
)

TIME_REPEATS = 3
"""Timed runs per configuration (the median is reported); ``--repeats`` changes it."""


@dataclasses.dataclass(frozen=True)
class Configuration:
    """How the layer stack is run and differentiated.

    Attributes:
      scan_impl: Signature of :func:`jax.lax.scan`.
      policy: Remat policy on each block step; None for no remat.
      linear_ce: Compute the loss with :func:`jaxmem.losses.linear_cross_entropy` (no
        ``[tokens, vocab]`` logits) instead of optax on the logits.
    """

    scan_impl: models.ScanImpl
    policy: models.Policy | None = None
    linear_ce: bool = False


def configurations() -> dict[str, Configuration]:
    """Returns the configurations this install offers, label -> configuration, baseline first."""
    policies = jax.checkpoint_policies
    out = {
        "no remat": Configuration(jax.lax.scan),
        "checkpoint nothing_saveable": Configuration(jax.lax.scan, policies.nothing_saveable),
        "checkpoint dots_saveable": Configuration(jax.lax.scan, policies.dots_saveable),
    }
    lean_scan = getattr(jaxmem, "scan", None)
    if lean_scan is not None:
        out["jaxmem.scan"] = Configuration(lean_scan)
        out["jaxmem.scan + dots_saveable"] = Configuration(lean_scan, policies.dots_saveable)
    named = getattr(jaxmem, "policies", None)
    if named is not None:
        selective = named.selective()
        out["checkpoint selective()"] = Configuration(jax.lax.scan, selective)
        if lean_scan is not None:
            out["jaxmem.scan + selective()"] = Configuration(lean_scan, selective)
            # GPU/TPU move the carry sequence (the layer inputs) to pinned_host. On CPU host
            # offload is the identity (jaxmem.lint's offload_noop): no row that does nothing.
            if jax.default_backend() != "cpu":
                out["jaxmem.scan offload=carries"] = Configuration(
                    functools.partial(lean_scan, offload="carries")
                )
            out["jaxmem.scan + selective() + linear CE"] = Configuration(
                lean_scan, selective, linear_ce=True
            )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the demo's options (model size, batch, output path) to ``parser``."""
    d = models.GPTConfig()
    size = parser.add_argument_group("model size")
    size.add_argument(
        "--layers", type=int, default=d.num_layers, help="transformer blocks (default: %(default)s)"
    )
    size.add_argument(
        "--d-model",
        type=int,
        default=d.d_model,
        help="residual stream width (default: %(default)s)",
    )
    size.add_argument(
        "--heads", type=int, default=d.num_heads, help="attention heads (default: %(default)s)"
    )
    size.add_argument(
        "--d-ff", type=int, default=d.d_ff, help="MLP hidden width (default: %(default)s)"
    )
    size.add_argument(
        "--vocab", type=int, default=d.vocab_size, help="vocabulary size (default: %(default)s)"
    )
    size.add_argument(
        "--seq", type=int, default=d.seq_len, help="tokens per sequence (default: %(default)s)"
    )
    size.add_argument(
        "--batch", type=int, default=8, help="sequences per training step (default: %(default)s)"
    )
    size.add_argument(
        "--untied", action="store_true", help="separate output projection (default: tied)"
    )
    parser.add_argument(
        "-o",
        "--output",
        default=DEFAULT_OUTPUT,
        metavar="PATH",
        help=f"where to save the figure (default: {DEFAULT_OUTPUT})",
    )
    parser.add_argument(
        "--time",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "run each configuration's gradient on random data and report its step time (same "
            "process, runs interleaved, the median of --repeats; compiled with full "
            "optimization), adding memory against step time to the figure; --no-time compiles "
            "from shapes alone, nothing run (default: time)"
        ),
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=TIME_REPEATS,
        metavar="N",
        help="timed runs of each configuration, after one untimed (default: %(default)s)",
    )
    parser.add_argument(
        "--full-optimization",
        action="store_true",
        help="compile with XLA's full backend optimization (slower; same memory figures)",
    )


def config_from_args(args: argparse.Namespace) -> models.GPTConfig:
    """Returns the model configuration the parsed options describe."""
    return models.GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        num_layers=args.layers,
        d_model=args.d_model,
        num_heads=args.heads,
        d_ff=args.d_ff,
        tie_embeddings=not args.untied,
    )


def check_args(args: argparse.Namespace) -> None:
    """Checks the parsed options before anything is traced.

    Raises:
      ValueError: sizes that make no model (e.g. heads that do not divide ``--d-model``) or a
        batch below 1; the message says which option to change.
    """
    config_from_args(args)
    if args.batch < 1:
        raise ValueError(f"--batch must be a positive int, got {args.batch}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be a positive int, got {args.repeats}")


# Nothing is run, only compiled for its memory analysis; buffer assignment happens before LLVM,
# so its optimization level changes compile time (about halved), never the memory figures.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _loss(config: models.GPTConfig, c: Configuration) -> Any:
    """``loss(params, tokens)`` of the GPT of ``config`` run as ``c`` says."""
    make = models.linear_ce_next_token_loss if c.linear_ce else models.next_token_loss
    return make(models.GPT(config, c.scan_impl, c.policy))


def measure(
    config: models.GPTConfig,
    batch_size: int,
    configs: dict[str, Configuration],
    *,
    fast_compile: bool = True,
) -> jaxmem.Comparison:
    """Profiles the training step's gradient of ``config`` under each configuration.

    Args:
      config: Model sizes.
      batch_size: Sequences per step.
      configs: Label -> configuration; the first is the baseline of every ratio.
      fast_compile: Compile with XLA's backend (LLVM) optimization level 0; the memory
        figures are the same, the compile is faster.

    Returns:
      A comparison whose reports hold the compiled figures of ``jax.jit(jax.grad(loss))`` and
      the saved-residual listing of ``loss`` (what that gradient keeps between its passes).
    """
    params = models.abstract_params(config, batch_size)
    tokens = jax.ShapeDtypeStruct((batch_size, config.seq_len), jnp.int32)
    jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE if fast_compile else None)
    losses = {label: _loss(config, c) for label, c in configs.items()}
    grads = jaxmem.compare({k: jit(jax.grad(f)) for k, f in losses.items()}, params, tokens)
    # The listing of each loss: traced, not compiled.
    return jaxmem.Comparison(
        {
            label: dataclasses.replace(
                report, residuals=jaxmem.residuals(losses[label], params, tokens)
            )
            for label, report in grads.reports.items()
        }
    )


def _param_count(config: models.GPTConfig) -> int:
    return sum(math.prod(p.shape) for p in jax.tree.leaves(models.abstract_params(config)))


MIB = 2**20
FASTER = 0.98
"""A step time below this fraction of another's is faster: within 2% is the timing's noise."""
TABLE_FIELDS = {"temp": "temp_bytes", "peak": "peak_bytes", "residual": "residual_bytes"}
SAME_FIELDS = {"argument": "argument_bytes", "output": "output_bytes"}


def _cell(value: float | None, base: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    shown = f"{value / MIB:.2f} MiB" if unit == "bytes" else f"{value * 1e3:.1f} ms"
    return f"{shown} (x{value / base:.2f})" if base else shown


def table(comparison: jaxmem.Comparison, times: Mapping[str, float] | None = None) -> str:
    """The demo's table: each configuration's temp, peak and saved residual bytes and, where
    timed, its step time, each with its ratio to the baseline (the first configuration).

    The argument and output bytes, the same in every configuration (the parameters and their
    gradient), are one line under the table; where they differ they are columns.
    """
    base = comparison.reports[comparison.baseline]
    reports = comparison.reports.values()
    same = {k: f for k, f in SAME_FIELDS.items() if len({getattr(r, f) for r in reports}) == 1}
    fields = TABLE_FIELDS | {k: f for k, f in SAME_FIELDS.items() if k not in same}
    header = ["configuration", *fields, *(["step time"] if times else [])]
    rows = []
    for label, report in comparison.reports.items():
        row = [label]
        row += [_cell(getattr(report, f), getattr(base, f), "bytes") for f in fields.values()]
        if times:
            row.append(_cell(times[label], times[comparison.baseline], "seconds"))
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    lines = [line(r) for r in [header, ["-" * w for w in widths], *rows]]
    if same:
        figures = ", ".join(f"{k} {getattr(base, f) / MIB:.2f} MiB" for k, f in same.items())
        lines.append(f"{figures} in every configuration")
    return "\n".join(lines)


def _peaks(comparison: jaxmem.Comparison) -> str:
    lines = ["Peak and its top three contributors:"]
    lines += [f"  {label}: {r.peak_summary()}" for label, r in comparison.reports.items()]
    return "\n".join(lines)


def conclusion(
    ratios: Mapping[str, tuple[float, float | None]],
    baseline: str,
    drop_in: str | None,
    stock: Sequence[str],
    lean: Sequence[str],
) -> str:
    """One line of what jaxmem wins, from the measured ratios to the baseline.

    Args:
      ratios: label -> (temp ratio, step-time ratio or None where not timed).
      baseline: the label the ratios are to.
      drop_in: the label of ``jaxmem.scan`` as a drop-in (no policy), or None.
      stock: the labels of stock JAX's remat (``jax.checkpoint`` with its own policies).
      lean: the labels that use jaxmem (its scan, its policies or its loss).

    Returns:
      ``"conclusion: ..."``: the drop-in's temp and time against the baseline's, stock's
      policies' the same way, and for each stock policy the leanest jaxmem configuration that
      needs no more temp and runs faster (by more than 2%: :data:`FASTER`), where one does.

    Examples:
      >>> ratios = {"no remat": (1.0, 1.0), "checkpoint dots": (0.51, 0.84),
      ...           "jaxmem.scan": (0.51, 0.66), "jaxmem.scan + x": (0.47, 0.67)}
      >>> print(conclusion(ratios, "no remat", "jaxmem.scan", ["checkpoint dots"],
      ...                  ["jaxmem.scan", "jaxmem.scan + x"]))
      conclusion: jaxmem.scan, code unchanged: 0.51x no remat's temp at 0.66x its step time; \
checkpoint dots 0.51x at 0.84x; jaxmem.scan + x beats checkpoint dots: 0.47x temp at 0.67x time
    """

    def figures(label: str) -> str:
        temp, time_ = ratios[label]
        return f"{temp:.2f}x" + ("" if time_ is None else f" at {time_:.2f}x")

    parts = []
    if drop_in is not None:
        temp, time_ = ratios[drop_in]
        at = "" if time_ is None else f" at {time_:.2f}x its step time"
        parts.append(f"{drop_in}, code unchanged: {temp:.2f}x {baseline}'s temp{at}")
    parts += [f"{label} {figures(label)}" for label in stock]
    for label in stock:
        temp, time_ = ratios[label]
        if time_ is None:
            continue
        wins = [j for j in lean if ratios[j][0] <= temp and ratios[j][1] < time_ * FASTER]
        if wins:
            j = min(wins, key=lambda k: ratios[k])
            parts.append(f"{j} beats {label}: {ratios[j][0]:.2f}x temp at {ratios[j][1]:.2f}x time")
    return "conclusion: " + "; ".join(parts)


def _is_stock(c: Configuration) -> bool:
    """Stock JAX: ``lax.scan``, no remat or one of ``jax.checkpoint_policies``, optax's loss."""
    own = vars(jax.checkpoint_policies).values()
    policy_is_stock = c.policy is None or any(c.policy is p for p in own)
    return c.scan_impl is jax.lax.scan and policy_is_stock and not c.linear_ce


def _conclusion(
    comparison: jaxmem.Comparison,
    times: Mapping[str, float] | None,
    configs: Mapping[str, Configuration],
) -> str:
    """:func:`conclusion` of the measured figures (ratios to the baseline)."""
    base = comparison.baseline
    ratios = {
        label: (
            comparison.ratio(label, "temp_bytes"),
            None if times is None else times[label] / times[base],
        )
        for label in comparison.reports
    }
    lean_scan = getattr(jaxmem, "scan", None)
    drop_in = next(
        (k for k, c in configs.items() if c == Configuration(lean_scan) and k != base), None
    )
    stock = [k for k, c in configs.items() if _is_stock(c) and c.policy is not None]
    lean = [k for k, c in configs.items() if not _is_stock(c)]
    return conclusion(ratios, base, drop_in, stock, lean)


def _random_inputs(config: models.GPTConfig, batch_size: int) -> tuple[Any, jax.Array]:
    # numpy, not Flax's init: initialising with jax would compile more than the timed steps.
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda p: jnp.asarray(0.02 * rng.standard_normal(p.shape), p.dtype),
        models.abstract_params(config, batch_size),
    )
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch_size, config.seq_len)))
    return params, tokens.astype(jnp.int32)


def time_steps(
    config: models.GPTConfig,
    batch_size: int,
    configs: dict[str, Configuration],
    repeats: int = TIME_REPEATS,
    settle: int = 1,
) -> dict[str, float]:
    """Median step time in seconds of each configuration's ``jax.jit(jax.grad(loss))``.

    Measured as the benchmarks measure (docs/design.md §3, ``benchmarks.harness``'s
    ``time_interleaved``; the demo has its own copy, as the installed package has no
    ``benchmarks``): same process and inputs (random parameters and tokens); each gradient is
    compiled with full optimization and run once to warm up, then ``repeats`` interleaved rounds
    (A B C, A B C, ...) in which each runs ``settle`` times untimed and once timed, so that a
    timed run follows a run of its own and not another's tail, each waited for with
    :func:`jax.block_until_ready`.
    """
    params, tokens = _random_inputs(config, batch_size)
    steps = {label: jax.jit(jax.grad(_loss(config, c))) for label, c in configs.items()}
    for step in steps.values():
        jax.block_until_ready(step(params, tokens))
    samples: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(repeats):
        for label, step in steps.items():
            for _ in range(settle):
                jax.block_until_ready(step(params, tokens))
            start = time.perf_counter()
            jax.block_until_ready(step(params, tokens))
            samples[label].append(time.perf_counter() - start)
    return {label: statistics.median(s) for label, s in samples.items()}


def run(args: argparse.Namespace) -> int:
    """Runs the demo for parsed options; prints the tables, saves the figure, returns 0."""
    start = time.perf_counter()
    config = config_from_args(args)
    configs = configurations()
    print(
        f"GPT: {config.num_layers} layers, d_model {config.d_model}, {config.num_heads} heads, "
        f"d_ff {config.d_ff}, vocab {config.vocab_size}, "
        f"{'tied' if config.tie_embeddings else 'untied'} output projection; "
        f"{_param_count(config):,} parameters"
    )
    print(
        f"training step: jax.grad of next-token cross-entropy, batch {args.batch} x seq "
        f"{config.seq_len} tokens; jax {jax.__version__} on {jax.default_backend()}"
    )
    print(
        "temp = compiled temp bytes of jax.jit(jax.grad(loss)); residual = bytes the gradient "
        "saves between its forward and backward pass"
    )
    if jax.default_backend() == "cpu":
        print(
            "no offload row: on CPU host offload is the identity (on GPU/TPU, jaxmem.scan "
            "offload=carries moves the layer inputs to pinned_host)"
        )
    print()
    comparison = measure(config, args.batch, configs, fast_compile=not args.full_optimization)
    times = time_steps(config, args.batch, configs, args.repeats) if args.time else None
    if times:
        print(
            f"step time = median of {args.repeats} runs of jax.jit(jax.grad(loss)), compiled "
            "with full optimization, interleaved in one process"
        )
    print(f"ratios (x) to {comparison.baseline!r}\n")
    print(table(comparison, times))
    print(_peaks(comparison))
    print(_conclusion(comparison, times, configs))
    path = plots.plot(comparison, args.output, times)
    print(f"\nwrote {path} ({time.perf_counter() - start:.1f} s)")
    return 0


def build_parser(prog: str = "python -m jaxmem.demo") -> argparse.ArgumentParser:
    """Returns the parser of the demo's own command line, ``python -m jaxmem.demo``."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``python -m jaxmem.demo`` with ``argv`` (default ``sys.argv[1:]``); returns 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        parser.error(str(e))
    return run(args)
