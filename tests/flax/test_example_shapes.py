"""Flax's own examples at a spread of shapes: compiled gradient temp against stock Flax.

- Gemma: Flax's ``examples/gemma`` ``Block`` stacked with ``nnx.scan`` (``benchmarks.peers``'s
  Gemma cases), ``jaxmem.flax.nnx.scan(policy=p)`` against ``nnx.scan`` over
  ``nnx.remat(policy=p)`` at Flax's defaults, for ``p`` in ``nothing`` and ``dots``: at most
  1.02x stock + 16 KiB.
- lm1b: Flax's ``examples/lm1b`` decoder layer stacked with ``nn.scan`` (``benchmarks.lm1b``),
  ``jaxmem.flax.linen.scan`` against ``nn.scan``, no remat: under
  :data:`benchmarks.lm1b.MAX_NO_REMAT_RATIO`.

The shapes vary layers, batch, sequence, width, heads, head size and key/value heads around each
benchmark's. Compiled with :data:`benchmarks.lm1b.FAST_COMPILE` (the same buffer assignment,
seconds per compile); nothing runs but Gemma's parameter init.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

from benchmarks import lm1b, peers

GEMMA_BOUND, SLACK = 1.02, 16 * 1024

# (layers, batch, seq, embed, hidden, heads, head_dim, kv_heads); the first is the benchmark's.
GEMMA_SHAPES = (
    peers.FULL.gemma,
    (2, 1, 8, 32, 64, 2, 16, 1),
    (2, 2, 32, 64, 256, 4, 16, 1),
    (2, 4, 16, 64, 128, 2, 32, 2),
    (3, 2, 64, 128, 256, 4, 32, 1),
    (2, 8, 16, 32, 128, 8, 8, 1),
)

# benchmarks.lm1b.Sizes fields.
LM1B_SHAPES = (
    {"layers": 4, "batch": 2, "seq": 16, "emb": 32, "mlp": 128, "heads": 4},
    {"layers": 4, "batch": 4, "seq": 32, "emb": 32, "mlp": 128, "heads": 4},
    {"layers": 4, "batch": 1, "seq": 64, "emb": 32, "mlp": 128, "heads": 8},
    {"layers": 4, "batch": 4, "seq": 64, "emb": 64, "mlp": 256, "heads": 4},
    {"layers": 4, "batch": 8, "seq": 32, "emb": 64, "mlp": 256, "heads": 2},
    {"layers": 2, "batch": 2, "seq": 128, "emb": 64, "mlp": 256, "heads": 8},
)


def _id(shape) -> str:
    if isinstance(shape, dict):
        return "-".join(f"{k}{v}" for k, v in shape.items())
    return "x".join(map(str, shape))


def temp_bytes(fn, *args) -> int:
    compiled = jax.jit(fn).lower(*args).compile(lm1b.FAST_COMPILE)
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("shape", GEMMA_SHAPES, ids=_id)
def test_gemma_policies_not_above_nnx_remat(shape):
    with jax.numpy_rank_promotion("allow"):  # Flax's Gemma code broadcasts implicitly
        cases = peers.gemma_cases(dataclasses.replace(peers.QUICK, gemma=shape))
    assert [c.name for c in cases] == ["gemma no remat", "gemma nothing", "gemma dots"]
    for case in cases[1:]:
        stock, ours = case.impls
        assert (stock.role, ours.role) == (peers.STOCK, peers.JAXMEM)
        with jax.numpy_rank_promotion("allow"):
            s, o = temp_bytes(stock.fn, *case.args), temp_bytes(ours.fn, *case.args)
        assert o <= GEMMA_BOUND * s + SLACK, f"{case.name}: {o} B against {s} B ({o / s:.4f}x)"


@pytest.mark.parametrize("fields", LM1B_SHAPES, ids=_id)
def test_lm1b_no_remat_below_the_bar(fields):
    sizes = dataclasses.replace(lm1b.FULL, **fields)
    stock, ours = lm1b.models(sizes, None)
    s = lm1b.temp_bytes(stock, sizes, lm1b.FAST_COMPILE)
    o = lm1b.temp_bytes(ours, sizes, lm1b.FAST_COMPILE)
    assert o < lm1b.MAX_NO_REMAT_RATIO * s, f"{o} B against {s} B ({o / s:.4f}x)"
