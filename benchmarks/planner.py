"""Memory-budget planner benchmark: ``jaxmem.plan`` against every preset, on two GPTs.

Models (both next-token cross-entropy, f32, stacks with ``policy="auto"``):

- ``reference``: the GPT of :mod:`jaxmem.demo.models` (pre-LN, fused qkv, GELU MLP; the model
  the planner was developed on);
- ``heldout``: :mod:`benchmarks.models.heldout_gpt`, written separately as an NNX user would
  (RMSNorm, separate q/k/v projections, rotary embeddings, SwiGLU MLP, untied head), never
  used while developing the planner.

For each model: the presets of :data:`jaxmem.policies.PRESETS` are compiled *directly*
(the stack built with ``policy=<preset>``, not through ``"auto"``), giving each one's compiled
gradient temp (``memory_analysis().temp_size_in_bytes``) and recompute FLOPs
(``cost_analysis()["flops"]`` minus the no-remat gradient's). Then ``jaxmem.frontier`` plans for
``--budgets`` budgets (default 5) spread evenly from the smallest temp the presets reach to no
remat's, and each plan is checked: it fits (measured temp <= budget) and its recompute FLOPs are
<= those of the cheapest preset that fits the same budget.

Then the planning time: ``jaxmem.plan`` on a 12-layer d=512 reference GPT (vocabulary 4096,
batch 8, sequence 256; abstract arguments, compiled, never run) at the budget halfway between
full remat and no remat, wall time of the whole call (``max_compiles=16``, the default). The
issue asks for under a minute on 2 cores.

Criteria (PASS / FAIL): (a) every plan fits and costs no more than the cheapest fitting preset,
on both models; (b) planning the 12-layer d=512 GPT takes < 60 s.

``--quick`` (for tests): 2-layer d=32 models, 3 budgets, at most 4 compiles per plan, and the
timing case at 2 layers d=64 (its criterion then says nothing about the issue's size).

Usage: ``python -m benchmarks.planner [--quick] [--budgets N] [--json PATH] [--no-check]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jaxmem
from benchmarks import harness

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of one run."""

    layers: int = 6
    d_model: int = 256
    heads: int = 4
    d_ff: int = 1024
    vocab: int = 4096
    seq: int = 128
    batch: int = 8
    budgets: int = 5
    timing_layers: int = 12
    timing_d_model: int = 512
    timing_seq: int = 256
    timing_batch: int = 8
    max_compiles: int = 16


DEFAULT = Config()
QUICK = Config(
    layers=2,
    d_model=32,
    heads=2,
    d_ff=64,
    vocab=64,
    seq=16,
    batch=2,
    budgets=3,
    timing_layers=2,
    timing_d_model=64,
    timing_seq=16,
    timing_batch=2,
    max_compiles=4,
)


# ------------------------------------------------------------------------------------------
# The two models: make(policy) -> (loss_fn, params, tokens).


def reference(config: Config, *, layers=None, d_model=None, seq=None, batch=None, abstract=False):
    """The demo GPT: ``make(policy) -> (loss, params, tokens)``."""
    from jaxmem.demo.models import GPT, GPTConfig, abstract_params, next_token_loss

    d = d_model or config.d_model
    cfg = GPTConfig(
        vocab_size=config.vocab,
        seq_len=seq or config.seq,
        num_layers=layers or config.layers,
        d_model=d,
        num_heads=config.heads,
        d_ff=4 * d if d_model else config.d_ff,
    )
    b = batch or config.batch
    if abstract:
        params = abstract_params(cfg)
        tokens = jax.ShapeDtypeStruct((b, cfg.seq_len), jnp.int32)
    else:
        tokens = jax.random.randint(jax.random.key(1), (b, cfg.seq_len), 0, cfg.vocab_size)
        params = GPT(cfg).init(jax.random.key(0), tokens)["params"]

    def make(policy):
        model = GPT(cfg, scan_impl=functools.partial(jaxmem.scan, policy=policy))
        return next_token_loss(model), params, tokens

    return make


def heldout(config: Config):
    """The held-out NNX GPT (:mod:`benchmarks.models.heldout_gpt`): ``make(policy)``."""
    from benchmarks.models import heldout_gpt

    cfg = heldout_gpt.HeldoutConfig(
        vocab_size=config.vocab,
        seq_len=config.seq,
        num_layers=config.layers,
        d_model=config.d_model,
        num_heads=config.heads,
        d_ff=config.d_ff,
    )

    def make(policy):
        return heldout_gpt.make_loss(cfg, policy=policy, batch_size=config.batch)

    return make


MODELS: dict[str, Callable[[Config], Callable]] = {"reference": reference, "heldout": heldout}


# ------------------------------------------------------------------------------------------
# Measuring.


def compiled_cost(loss: Callable, *args: Any) -> tuple[int, float]:
    """(temp bytes, FLOPs) of ``jax.jit(jax.grad(loss))`` compiled for ``args``."""
    c = jax.jit(jax.grad(loss)).lower(*args).compile()
    return int(c.memory_analysis().temp_size_in_bytes), harness.compiled_flops(c)


@dataclasses.dataclass
class ModelResult:
    """One model's presets, frontier and checked plans."""

    name: str
    presets: dict[str, tuple[int, float]]  # preset -> (temp, recompute flops)
    no_remat: tuple[int, float]
    frontier: Any
    rows: list[dict[str, Any]]


def run_model(name: str, make: Callable, budgets: int, max_compiles: int = 16) -> ModelResult:
    """Presets compiled directly, then the planner's frontier, each plan checked."""
    loss, params, tokens = make(None)
    no_remat = compiled_cost(loss, params, tokens)
    presets = {}
    for p in jaxmem.policies.PRESETS:
        loss_p, *_ = make(jaxmem.policies.by_name(p))
        temp, flops = compiled_cost(loss_p, params, tokens)
        presets[p] = (temp, flops - no_remat[1])
    lo = min(t for t, _ in presets.values())
    budget_list = [int(lo + i * (no_remat[0] - lo) / (budgets - 1)) for i in range(budgets)]
    loss_auto, *_ = make("auto")
    front = jaxmem.frontier(
        loss_auto, params, tokens, budgets=budget_list, max_compiles=max_compiles
    )
    rows = []
    for p in front.plans:
        fitting = {k: f for k, (t, f) in presets.items() if t <= p.budget}
        cheapest = min(fitting, key=fitting.get) if fitting else None
        rows.append(
            {
                "budget_bytes": p.budget,
                "plan": p.candidate.key,
                "temp_bytes": p.measured_temp_bytes,
                "recompute_flops": p.recompute_flops,
                "recompute_pct": 100 * p.recompute_flops / no_remat[1],
                "cheapest_preset": cheapest,
                "cheapest_preset_pct": None
                if cheapest is None
                else 100 * fitting[cheapest] / no_remat[1],
                "fits": p.measured_temp_bytes <= p.budget,
                "not_costlier": cheapest is None
                or p.recompute_flops <= fitting[cheapest] + 1e-6 * no_remat[1],
                "compiles": p.compiles,
                "seconds": p.seconds,
            }
        )
    return ModelResult(name, presets, no_remat, front, rows)


def planning_time(config: Config) -> dict[str, Any]:
    """Wall time of one jaxmem.plan call on the timing GPT (abstract arguments)."""
    make = reference(
        config,
        layers=config.timing_layers,
        d_model=config.timing_d_model,
        seq=config.timing_seq,
        batch=config.timing_batch,
        abstract=True,
    )
    loss, params, tokens = make("auto")
    full, _ = compiled_cost(make(jaxmem.policies.nothing)[0], params, tokens)
    top, _ = compiled_cost(make(None)[0], params, tokens)
    budget = (full + top) // 2
    p, seconds = harness.wall_seconds(
        lambda: jaxmem.plan(loss, params, tokens, budget=budget, max_compiles=config.max_compiles)
    )
    return {
        "layers": config.timing_layers,
        "d_model": config.timing_d_model,
        "budget_bytes": budget,
        "seconds": seconds,
        "compiles": p.compiles,
        "plan": p.candidate.key,
        "temp_bytes": p.measured_temp_bytes,
        "fits": p.measured_temp_bytes <= budget,
        "cores": os.cpu_count(),
    }


# ------------------------------------------------------------------------------------------
# Report.


def _mib(b):
    return "-" if b is None else f"{b / MIB:.2f}"


def format_model(r: ModelResult) -> str:
    rows = []
    for row in r.rows:
        preset = (
            "-"
            if row["cheapest_preset"] is None
            else f"{row['cheapest_preset']} {row['cheapest_preset_pct']:.1f}%"
        )
        rows.append(
            [
                _mib(row["budget_bytes"]),
                _mib(row["temp_bytes"]),
                f"{row['recompute_pct']:.1f}%",
                preset,
                "PASS" if row["fits"] and row["not_costlier"] else "FAIL",
                row["compiles"],
                f"{row['seconds']:.1f}",
                row["plan"],
            ]
        )
    head = ["budget", "temp", "recompute", "cheapest fitting preset", "ok", "compiles", "s", "plan"]
    presets = ", ".join(
        f"{k} {_mib(t)}/{100 * f / r.no_remat[1]:.1f}%" for k, (t, f) in r.presets.items()
    )
    return (
        f"{r.name}: no remat temp {_mib(r.no_remat[0])} MiB, {r.no_remat[1]:.4g} FLOPs; presets "
        f"(temp MiB / recompute %): {presets}\n"
        + textwrap.indent(harness.table(head, rows, align="rrrrrrrl"), "  ")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    parser.add_argument("--budgets", type=int, default=None, help="budgets per model (>= 2)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--json", type=pathlib.Path, help="write every figure here")
    parser.add_argument("--no-check", action="store_true", help="exit 0 even if a check fails")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else DEFAULT
    if args.budgets is not None:
        if args.budgets < 2:
            parser.error("--budgets must be >= 2")
        config = dataclasses.replace(config, budgets=args.budgets)
    env = harness.environment()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} cores")
    results = []
    for name in args.models:
        r = run_model(name, MODELS[name](config), config.budgets, config.max_compiles)
        results.append(r)
        print(format_model(r), flush=True)
    timing = planning_time(config)
    print(
        f"planning a {timing['layers']}-layer d={timing['d_model']} GPT at "
        f"{_mib(timing['budget_bytes'])} MiB: {timing['seconds']:.1f} s, {timing['compiles']} "
        f"compiles, plan {timing['plan']} ({_mib(timing['temp_bytes'])} MiB)"
    )
    checks = {
        "(a) plans fit and cost <= the cheapest fitting preset": all(
            row["fits"] and row["not_costlier"] for r in results for row in r.rows
        ),
        "(b) planning the timing GPT < 60 s": timing["seconds"] < 60 and timing["fits"],
    }
    for k, v in checks.items():
        print(f"{'PASS' if v else 'FAIL'} {k}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "environment": env,
                    "config": dataclasses.asdict(config),
                    "models": [
                        {
                            "name": r.name,
                            "presets": r.presets,
                            "no_remat": r.no_remat,
                            "rows": r.rows,
                            "frontier": r.frontier.to_dict(),
                        }
                        for r in results
                    ],
                    "planning_time": timing,
                    "checks": checks,
                },
                indent=1,
                default=str,
            )
        )
    return 0 if args.no_check or all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
