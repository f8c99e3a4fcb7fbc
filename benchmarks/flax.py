"""Flax layer stacks: ``jaxmem.flax.linen.scan_layers`` against ``nn.scan`` (and ``nn.remat``).

The reference GPT block (:class:`jaxmem.demo.models.Block`) stacked ``L`` times; compiled temp
bytes of ``jax.jit(jax.grad(loss))`` with respect to the parameters and the input, for no remat
and for each policy, next to the ``nn.scan(nn.remat(block, policy))`` equivalent. Only compiled,
never run (``jax.ShapeDtypeStruct`` arguments). Bytes in MiB (2^20), as every benchmark.

Usage: ``python -m benchmarks.flax [--json PATH] [--small]``.
"""

from __future__ import annotations

import argparse
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks.harness import format_mib
from jaxmem import policies
from jaxmem.demo import models
from jaxmem.flax import linen as jl

POLICIES = (None, "nothing", "dots", "selective")


class _PairBlock(models.Block):
    """The block in nn.scan's ``(carry, y)`` form."""

    def __call__(self, h):
        return models.Block.__call__(self, h), None


def temp_bytes(model, shape) -> int:
    """Compiled temp bytes of ``jit(grad(mean(model(h)**2)))`` w.r.t. params and ``h[shape]``."""
    h = jax.ShapeDtypeStruct(shape, jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), h)["params"]

    def loss(p, h):
        out = model.apply({"params": p}, h)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.mean(out**2)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, h).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def measure(layers: int, batch: int, seq: int, d: int, heads: int, d_ff: int) -> list[dict]:
    """Returns one row per policy: temp bytes of scan_layers and of the nn.scan equivalent."""
    rows = []
    for name in POLICIES:
        cls = _PairBlock
        if name is not None:
            cls = nn.remat(_PairBlock, policy=policies.by_name(name), prevent_cse=False)
        stock = nn.scan(
            cls, variable_axes={"params": 0}, split_rngs={"params": True}, length=layers
        )
        ours = jl.scan_layers(models.Block, layers, policy=name)
        shape = (batch, seq, d)
        s = temp_bytes(stock(num_heads=heads, d_ff=d_ff), shape)
        o = temp_bytes(ours(num_heads=heads, d_ff=d_ff), shape)
        rows.append({"policy": name or "no remat", "nn_scan": s, "scan_layers": o, "ratio": o / s})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Prints the table; ``--json PATH`` writes it."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.flax", description=__doc__)
    parser.add_argument("--json", help="write the figures to this path")
    parser.add_argument("--small", action="store_true", help="a tiny model (for tests)")
    args = parser.parse_args(argv)
    sizes = (4, 2, 16, 32, 4, 128) if args.small else (4, 8, 128, 256, 4, 1024)
    rows = measure(*sizes)
    print(
        f"GPT block stack L={sizes[0]} B={sizes[1]} S={sizes[2]} D={sizes[3]} H={sizes[4]} "
        f"F={sizes[5]}, f32; temp of jit(grad) (jax {jax.__version__}, {jax.default_backend()})"
    )
    print(f"{'policy':<12} {'nn.scan':>12} {'scan_layers':>12} {'ratio':>7}")
    for r in rows:
        print(
            f"{r['policy']:<12} {format_mib(r['nn_scan']):>12} "
            f"{format_mib(r['scan_layers']):>12} {r['ratio']:>6.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sizes, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
