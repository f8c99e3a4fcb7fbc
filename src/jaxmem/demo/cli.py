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
With ``--time`` it also runs each configuration's gradient (same process, interleaved, median of
:data:`TIME_REPEATS`) and adds memory against step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Sequence
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
    "the compiled temp bytes of jax.jit(jax.grad(loss)) and the bytes of the residuals the "
    "gradient saves, with ratios to the first configuration, then each configuration's peak and "
    "its top three contributors by source line, and saves a figure (temp per configuration, "
    "split into saved residuals and other temp). Everything is compiled from shapes alone "
    "(nothing is run) unless --time is given."
)

TIME_REPEATS = 5
"""Timed runs per configuration with ``--time`` (the median is reported)."""


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
            # On CPU host offload is the identity: same device figures; GPU/TPU move the
            # carry sequence (the layer inputs) to pinned_host.
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
        action="store_true",
        help=(
            "also run each configuration's gradient on random data and report its step time "
            f"(same process, runs interleaved, median of {TIME_REPEATS}; compiled with full "
            "optimization), adding memory against step time to the figure"
        ),
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


def _summary(comparison: jaxmem.Comparison) -> str:
    base = comparison.baseline
    lines = [f"summary (ratios to {base!r}):"]
    for label in list(comparison.reports)[1:]:
        temp = comparison.ratio(label, "temp_bytes")
        res = comparison.ratio(label, "residual_bytes")
        lines.append(f"  {label}: temp x{temp:.2f}, residual x{res:.2f}")
    return "\n".join(lines)


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
) -> dict[str, float]:
    """Median step time in seconds of each configuration's ``jax.jit(jax.grad(loss))``.

    Same process and inputs (random parameters and tokens); each gradient is compiled with full
    optimization and run once to warm up, then the timed runs are interleaved (A B C A B C ...),
    each waited for with :func:`jax.block_until_ready`.
    """
    params, tokens = _random_inputs(config, batch_size)
    steps = {label: jax.jit(jax.grad(_loss(config, c))) for label, c in configs.items()}
    for step in steps.values():
        jax.block_until_ready(step(params, tokens))
    samples: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(repeats):
        for label, step in steps.items():
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
            "on CPU host offload is the identity: offload rows show the same device figures as "
            "the row without offload (on GPU/TPU the stacks move to pinned_host)"
        )
    print()
    comparison = measure(config, args.batch, configs, fast_compile=not args.full_optimization)
    print(comparison)
    if len(comparison.reports) > 1:
        print(_summary(comparison))
    times = None
    if args.time:
        times = time_steps(config, args.batch, configs, TIME_REPEATS)
        base = times[comparison.baseline]
        print(f"\nstep time (median of {TIME_REPEATS}, interleaved, same process):")
        for label, t in times.items():
            print(f"  {label}: {t * 1e3:.1f} ms (x{t / base:.2f})")
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
