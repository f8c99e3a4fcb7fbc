"""Flax's lm1b decoder layer stacked with ``jaxmem.flax.linen.scan`` against ``nn.scan``.

The decoder layer of Flax's lm1b example (:mod:`benchmarks.models.lm1b_model`: pre-LN
``MultiHeadDotProductAttention`` with a causal mask, relu MLP, dropout everywhere) stacked ``L``
times, in training mode (``deterministic=False``, a ``dropout`` rng). Rows: no remat and the
``nothing``, ``dots`` and ``selective`` policies (:func:`jaxmem.policies.by_name`), as
``nn.scan(nn.remat(layer, policy, prevent_cse=False))`` next to ``jaxmem.flax.linen.scan(layer,
policy=...)`` with otherwise the same arguments. Figures: compiled temp bytes of
``jax.jit(jax.grad(loss))`` with respect to the parameters and the input, compiled on abstract
arguments, never run. Bytes in MiB (2^20), as every benchmark.

The check (skipped with ``--no-check``): the no-remat ratio is under :data:`MAX_NO_REMAT_RATIO`.

Usage: ``python -m benchmarks.lm1b [--quick] [--json PATH] [--no-check]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks import harness
from benchmarks.harness import format_mib
from benchmarks.models import lm1b_model
from jaxmem import policies
from jaxmem.flax import linen as jl

POLICIES = (None, "nothing", "dots", "selective")
"""The rows: no remat, then :func:`jaxmem.policies.by_name` presets."""

MAX_NO_REMAT_RATIO = 0.67
"""The no-remat row's jaxmem / nn.scan temp ratio must be under this (issue 11)."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The stack's shape: ``layers`` decoder layers on ``(batch, seq, emb)`` f32 activations."""

    layers: int = 4
    batch: int = 8
    seq: int = 128
    emb: int = 256
    mlp: int = 1024
    heads: int = 4


FULL = Sizes()
QUICK = Sizes(layers=4, batch=2, seq=16, emb=32, mlp=128, heads=4)

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
"""XLA options of ``--quick``: no LLVM optimization, so that a compile takes seconds, not tens of
seconds, on CPU. Buffer assignment (hence temp bytes) runs before code generation and is the same
(checked at the quick shapes on jax 0.10 and 0.12)."""


def config(sizes: Sizes) -> lm1b_model.TransformerConfig:
    """The layer's hyperparameters: training mode, lm1b's dropout rates, ``qkv_dim = emb``."""
    return lm1b_model.TransformerConfig(
        num_heads=sizes.heads, qkv_dim=sizes.emb, mlp_dim=sizes.mlp, deterministic=False
    )


def causal_mask(batch: int, seq: int) -> jax.Array:
    """lm1b's decoder mask for unpadded inputs: ``(batch, 1, seq, seq)``, causal."""
    return nn.make_causal_mask(jnp.ones((batch, seq), jnp.int32), dtype=jnp.float32)


def make_loss(model):
    """``loss(params, x, rng) = mean(model(x, causal mask)**2)``, dropout drawn from ``rng``."""

    def loss(params, x, rng):
        out, _ = model.apply(
            {"params": params}, x, causal_mask(*x.shape[:2]), rngs={"dropout": rng}
        )
        return jnp.mean(out**2)

    return loss


def temp_bytes(model, sizes: Sizes, compiler_options: dict | None = None) -> int:
    """Compiled temp bytes of ``jit(grad(loss, argnums=(0, 1)))`` (params and input)."""
    x = jax.ShapeDtypeStruct((sizes.batch, sizes.seq, sizes.emb), jnp.float32)
    rng = jax.eval_shape(lambda: jax.random.key(0))
    mask = jax.eval_shape(lambda: causal_mask(sizes.batch, sizes.seq))
    params = jax.eval_shape(
        lambda x, m: model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, m),
        x,
        mask,
    )["params"]
    grad = jax.jit(jax.grad(make_loss(model), argnums=(0, 1)))
    compiled = grad.lower(params, x, rng).compile(compiler_options)
    return compiled.memory_analysis().temp_size_in_bytes


def models(sizes: Sizes, name: str | None):
    """The ``nn.scan`` stack and the ``jaxmem.flax.linen.scan`` stack for one row."""
    cfg = config(sizes)
    policy = None if name is None else policies.by_name(name)
    stock = lm1b_model.stack(nn.scan, cfg, sizes.layers, remat_policy=policy)
    ours = lm1b_model.stack(jl.scan, cfg, sizes.layers, policy=name)
    return stock, ours


def measure(sizes: Sizes, compiler_options: dict | None = None) -> list[dict]:
    """One row per policy: temp bytes of nn.scan and of jaxmem's scan, and their ratio."""
    rows = []
    for name in POLICIES:
        stock, ours = models(sizes, name)
        s = temp_bytes(stock, sizes, compiler_options)
        o = temp_bytes(ours, sizes, compiler_options)
        rows.append({"policy": name or "no remat", "nn_scan": s, "jaxmem": o, "ratio": o / s})
    return rows


def table(sizes: Sizes, rows: list[dict]) -> str:
    """The rows as the printed table."""
    s = sizes
    cells = [
        [r["policy"], format_mib(r["nn_scan"]), format_mib(r["jaxmem"]), f"{r['ratio']:.2f}x"]
        for r in rows
    ]
    return (
        f"lm1b decoder layer x{s.layers}, B={s.batch} S={s.seq} emb={s.emb} mlp={s.mlp} "
        f"heads={s.heads}, f32, dropout on; temp of jit(grad) "
        f"(jax {jax.__version__}, {jax.default_backend()})\n"
        + harness.table(["policy", "nn.scan", "jaxmem", "ratio"], cells)
    )


def main(argv: list[str] | None = None) -> int:
    """Prints the table; ``--json PATH`` writes it. Returns 1 if the check fails."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lm1b", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small shapes (for tests)")
    parser.add_argument("--json", help="write the figures to this path")
    parser.add_argument(
        "--no-check", action="store_true", help=f"skip the no-remat ratio < {MAX_NO_REMAT_RATIO}"
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    rows = measure(sizes, FAST_COMPILE if args.quick else None)
    print(table(sizes, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": dataclasses.asdict(sizes), "rows": rows}, f, indent=2)
    ratio = rows[0]["ratio"]
    if not args.no_check and not ratio < MAX_NO_REMAT_RATIO:
        print(f"FAIL: no-remat ratio {ratio:.3f} is not under {MAX_NO_REMAT_RATIO}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
