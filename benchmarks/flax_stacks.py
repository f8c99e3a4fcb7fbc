"""Flax layer stacks: ``jaxmem.flax.linen.scan_layers`` against ``nn.scan`` (and ``nn.remat``),
``jaxmem.flax.nnx.ScanLayers`` against ``nnx.scan`` (and ``nnx.remat``).

The reference GPT block (:class:`jaxmem.demo.models.Block`) stacked ``L`` times; compiled temp
bytes of ``jax.jit(jax.grad(loss))`` with respect to the parameters and the input, for no remat
and for each policy, next to the ``nn.scan(nn.remat(block, policy))`` equivalent. Only compiled,
never run (``jax.ShapeDtypeStruct`` arguments). The NNX rows: a GPT-style NNX block
(:class:`NNXBlock`, causal attention and a GELU MLP) stacked by ``ScanLayers`` and by
``nnx.scan`` over the same layers (``nnx.remat(policy=...)`` in each step for the policy rows).
Bytes in MiB (2^20), as every benchmark.

Usage: ``python -m benchmarks.flax_stacks [--json PATH] [--small]``.
"""

from __future__ import annotations

import argparse
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.harness import format_mib, table
from jaxmem import policies
from jaxmem.demo import models
from jaxmem.flax import linen as jl
from jaxmem.flax import nnx as jn

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
"""XLA options for tests (``compiler_options=FAST_COMPILE``): no LLVM optimization, a faster
compile on CPU. Buffer assignment (hence temp bytes) runs before code generation: the same."""

POLICIES = (None, "nothing", "dots", "selective")


class _PairBlock(models.Block):
    """The block in nn.scan's ``(carry, y)`` form."""

    def __call__(self, h):
        return models.Block.__call__(self, h), None


def temp_bytes(model, shape, compiler_options: dict | None = None) -> int:
    """Compiled temp bytes of ``jit(grad(mean(model(h)**2)))`` w.r.t. params and ``h[shape]``."""
    h = jax.ShapeDtypeStruct(shape, jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), h)["params"]

    def loss(p, h):
        out = model.apply({"params": p}, h)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.mean(out**2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), compiler_options=compiler_options)
    compiled = grad.lower(params, h).compile()
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


class NNXBlock(nnx.Module):
    """A GPT-style NNX block: pre-LN causal self-attention, then a pre-LN GELU MLP."""

    def __init__(self, d: int, heads: int, d_ff: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, d_ff, rngs=rngs)
        self.down = nnx.Linear(d_ff, d, rngs=rngs)

    def __call__(self, h):
        mask = nnx.make_causal_mask(jnp.ones(h.shape[:2]))
        h = h + self.attn(self.ln1(h), mask=mask)
        return h + self.down(jax.nn.gelu(self.up(self.ln2(h))))


def _nnx_scan_loss(policy):
    """``mean(stack(h)**2)`` with the layers run by ``nnx.scan`` (and ``nnx.remat(policy)``)."""

    def loss(layers, h):
        call = lambda block, h: block(h)
        if policy is not None:
            call = nnx.remat(call, policy=policy, prevent_cse=False)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(h, block):
            return call(block, h)

        return jnp.mean(forward(h, layers) ** 2)

    return loss


def nnx_temp_bytes(module, loss, shape, compiler_options: dict | None = None) -> int:
    """Compiled temp bytes of ``jit(grad(loss))`` w.r.t. the module's state and ``h[shape]``."""
    graphdef, state = nnx.split(module)
    h = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)

    def pure(state, h):
        return loss(nnx.merge(graphdef, state), h)

    grad = jax.jit(jax.grad(pure, argnums=(0, 1)), compiler_options=compiler_options)
    compiled = grad.lower(state, h).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def measure_nnx(
    layers: int,
    batch: int,
    seq: int,
    d: int,
    heads: int,
    d_ff: int,
    compiler_options: dict | None = None,
) -> list[dict]:
    """One row per policy: temp bytes of ScanLayers and of nnx.scan over the same layers
    (``compiler_options``: XLA options of every compile, e.g. :data:`FAST_COMPILE`)."""
    rows = []
    for name in POLICIES:
        ours = jn.ScanLayers(
            lambda rngs: NNXBlock(d, heads, d_ff, rngs=rngs), layers, rngs=nnx.Rngs(0), policy=name
        )
        policy = None if name is None else policies.by_name(name)
        shape = (batch, seq, d)
        loss = lambda m, h: jnp.mean(m(h) ** 2)
        o = nnx_temp_bytes(ours, loss, shape, compiler_options)
        s = nnx_temp_bytes(ours.layers, _nnx_scan_loss(policy), shape, compiler_options)
        rows.append({"policy": name or "no remat", "nnx_scan": s, "ScanLayers": o, "ratio": o / s})
    return rows


def _print_rows(rows: list[dict], stock: str, ours: str) -> None:
    cells = [
        [r["policy"], format_mib(r[stock]), format_mib(r[ours]), f"{r['ratio']:.2f}x"] for r in rows
    ]
    print(table(["policy", stock, ours, "ratio"], cells))


def main(argv: list[str] | None = None) -> int:
    """Prints the table; ``--json PATH`` writes it."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.flax_stacks", description=__doc__)
    parser.add_argument("--json", help="write the figures to this path")
    parser.add_argument("--small", action="store_true", help="a tiny model (for tests)")
    args = parser.parse_args(argv)
    sizes = (4, 2, 16, 32, 4, 128) if args.small else (4, 8, 128, 256, 4, 1024)
    rows = measure(*sizes)
    print(
        f"GPT block stack L={sizes[0]} B={sizes[1]} S={sizes[2]} D={sizes[3]} H={sizes[4]} "
        f"F={sizes[5]}, f32; temp of jit(grad) (jax {jax.__version__}, {jax.default_backend()})"
    )
    _print_rows(rows, "nn_scan", "scan_layers")
    nnx_rows = measure_nnx(*sizes)
    print("NNX GPT-style block stack, same sizes:")
    _print_rows(nnx_rows, "nnx_scan", "ScanLayers")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sizes, "rows": rows, "nnx_rows": nnx_rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
