"""Memory of jaxmem.flax.nnx stacks against nnx.scan: compiled temp of the training-step gradient.

The GPT-style NNX block of ``benchmarks.flax_stacks`` (pre-LN causal self-attention and a GELU MLP),
L layers stacked by :class:`jaxmem.flax.nnx.ScanLayers` and by ``nnx.scan`` over the same
``nnx.vmap``-created stack; the gradient with respect to every parameter and the input is compiled
for both, in the same process, and the temp bytes compared: no remat <= 0.6x, each policy <= 1.02x
(the policy applied as ``nnx.remat(policy=...)`` in every step of ``nnx.scan``).
"""

from __future__ import annotations

import pytest

from benchmarks import flax_stacks as flax_bench

SIZES = (4, 2, 16, 32, 4, 128)  # L, B, S, D, H, F


@pytest.fixture(scope="module")
def rows():
    # Only temp bytes are read: compiled without LLVM optimization (same buffers, faster).
    rows = flax_bench.measure_nnx(*SIZES, compiler_options=flax_bench.FAST_COMPILE)
    return {r["policy"]: r for r in rows}


def test_memory_without_remat(rows):
    r = rows["no remat"]
    # measured: 0.475x (jax 0.12.0.1), 0.437x (0.10.2)
    assert r["ScanLayers"] <= 0.6 * r["nnx_scan"], r


@pytest.mark.parametrize("name", ["nothing", "dots", "selective"])
def test_memory_with_policy(rows, name):
    r = rows[name]
    assert r["ScanLayers"] <= 1.02 * r["nnx_scan"], r
