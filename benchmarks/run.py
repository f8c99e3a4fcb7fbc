"""Benchmark command line.

Usage: ``python -m benchmarks.run [--case NAME ...] [--json PATH] [--time] [--repeats N]``.

Prints one table (a row per case: stock figures, then per variant its figures and their ratios to
stock) and optionally writes every figure, with jax version, backend and date, to a JSON file.
Variants are the scan implementations registered in :mod:`benchmarks.cases` that exist in this
install (``jaxmem.scan`` once jaxmem has it); with none, the table shows stock only.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Mapping, Sequence

from benchmarks import cases, harness


def _repeats(text: str) -> int:
    n = int(text)
    if n < harness.MIN_REPEATS:
        raise argparse.ArgumentTypeError(
            f"--repeats must be >= {harness.MIN_REPEATS} (docs/design.md §3), got {n}"
        )
    return n


def build_parser() -> argparse.ArgumentParser:
    """Returns the command-line parser."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=(
            "Benchmark jax.lax.scan (stock) against jaxmem scan variants: compiled temp bytes of "
            "the jitted gradient, saved-residual bytes of the loss, optionally step time; "
            "variant figures are also given as ratios to stock."
        ),
    )
    p.add_argument(
        "--case",
        nargs="+",
        action="extend",
        choices=list(cases.CASES),
        metavar="NAME",
        help=f"cases to run (default: all): {', '.join(cases.CASES)}",
    )
    p.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write every figure here")
    p.add_argument(
        "--time", action="store_true", help="also time fwd+bwd of the jitted gradient (warm)"
    )
    p.add_argument(
        "--repeats",
        type=_repeats,
        default=harness.MIN_REPEATS,
        metavar="N",
        help=f"timed runs per column, interleaved (default and minimum {harness.MIN_REPEATS})",
    )
    return p


def main(
    argv: Sequence[str] | None = None, *, variants: Mapping[str, cases.ScanImpl] | None = None
) -> int:
    """Runs the benchmarks.

    Args:
      argv: Command-line arguments (default ``sys.argv[1:]``).
      variants: Label -> scan implementation to compare against stock; default: the registered
        variants available in this install (:func:`benchmarks.cases.variants`).

    Returns:
      The exit status: 0, or 1 if any column failed to measure.
    """
    args = build_parser().parse_args(argv)
    selected = [cases.CASES[n] for n in dict.fromkeys(args.case or cases.CASES)]
    variants = cases.variants() if variants is None else dict(variants)
    env = harness.environment()
    print(
        f"jax {env['jax_version']} | backend {env['backend']} ({env['device_kind']}) | "
        f"{env['date']} | variants: {', '.join(variants) or 'none'}",
        flush=True,
    )
    results = harness.run(selected, variants, timed=args.time, repeats=args.repeats)
    print(harness.format_table(results, timed=args.time))
    if args.json is not None:
        data = harness.to_dict(results, timed=args.time, repeats=args.repeats)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2, default=harness.json_default) + "\n")
        print(f"wrote {args.json}")
    return 1 if harness.has_errors(results) else 0


if __name__ == "__main__":
    sys.exit(main())
