"""What a remat policy keeps on the reference transformer block, against Korthikanti et al. 2022.

Demo and reference code (see :mod:`jaxmem.demo`), not library API. :func:`block_residual_bytes`
measures the residual bytes per layer that the gradient of a scanned stack of
:class:`jaxmem.demo.models.Block` layers saves under a policy (from shapes alone: nothing is
compiled or run); :func:`korthikanti_table` sets them next to the paper's 16-bit formulas (the
table in the README).

Examples:
  >>> from jaxmem import policies
  >>> block_residual_bytes(policies.nothing, b=1, s=8, h=16, a=2)  # the layer input, 2 s b h
  256.0

References:
  Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022,
  https://arxiv.org/abs/2205.05198.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jaxmem
from jaxmem import policies
from jaxmem.demo import models


def block_residual_bytes(
    policy: Callable[..., Any] | None,
    b: int,
    s: int,
    h: int,
    a: int,
    f: int | None = None,
    *,
    layers: int = 2,
    dtype: Any = jnp.bfloat16,
    scan: Callable[..., Any] | None = None,
) -> float:
    """Residual bytes per layer that the gradient of a scanned reference block stack saves.

    The stack is ``layers`` :class:`jaxmem.demo.models.Block` layers (pre-LN, causal softmax
    attention, GELU MLP) with parameters and activations in ``dtype``, run by ``scan`` (default
    :func:`jax.lax.scan`) over ``jax.checkpoint(step, policy=policy)`` (no checkpoint when
    ``policy`` is None). Counted from the saved-residual listing (what
    :func:`jax.ad_checkpoint.print_saved_residuals` prints), built from shapes only: the
    residuals with a leading axis of ``layers`` that are not arguments (what the loop stacks),
    divided by ``layers``.

    Args:
      policy: a remat policy, or None for no remat.
      b: batch size.
      s: sequence length.
      h: model width (``d_model``).
      a: attention heads.
      f: MLP width; ``4 * h`` by default.
      layers: layers in the stack.
      dtype: parameter and activation dtype.
      scan: the scan implementation, :func:`jax.lax.scan` or :func:`jaxmem.scan`.

    Returns:
      Stacked residual bytes divided by ``layers``.

    Examples:
      >>> block_residual_bytes(policies.nothing, b=1, s=8, h=16, a=2)  # the layer input, 2 s b h
      256.0
    """
    f = 4 * h if f is None else f
    block = models.Block(num_heads=a, d_ff=f)
    x = jax.ShapeDtypeStruct((b, s, h), dtype)
    one = jax.eval_shape(block.init, jax.random.key(0), x)["params"]
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct((layers, *p.shape), dtype), one)

    def step(carry, p):
        return block.apply({"params": p}, carry), None

    if scan is None:
        scan = jax.lax.scan
        if policy is not None:
            step = jax.checkpoint(step, policy=policy, prevent_cse=False)

        def run(x, params):
            return scan(step, x, params)[0]
    else:

        def run(x, params):
            return scan(step, x, params, policy=policy)[0]

    def loss(x, params):
        return jnp.sum(run(x, params).astype(jnp.float32))

    total = sum(
        r.bytes
        for r in jaxmem.residuals(loss, x, params)
        if r.origin != "argument" and r.shape[:1] == (layers,)
    )
    return total / layers


def korthikanti_table(b: int, s: int, h: int, a: int, f: int | None = None) -> str:
    """A markdown table: measured residual bytes per layer vs Korthikanti et al.'s formulas.

    Measures :func:`block_residual_bytes` (bf16 parameters and activations, ``jax.lax.scan``)
    under ``everything`` (no recomputation), ``dots``, ``selective()`` and ``nothing`` (full
    recomputation), next to the paper's 16-bit figures per layer: ``s b h (34 + 5 a s / h)``
    with no recomputation, ``34 s b h`` selective, ``2 s b h`` full (``34`` is ``18 + 4 f / h``
    for an MLP of width ``f``). The paper's block has dropout (1-byte masks) and keeps the
    LayerNorm outputs; ours has no dropout, and the JAX policies decide what else is kept.

    Args:
      b: batch size.
      s: sequence length.
      h: model width.
      a: attention heads.
      f: MLP width, ``4 * h`` by default.

    Returns:
      The table, in markdown.

    Examples:
      >>> print(korthikanti_table(b=1, s=8, h=16, a=2))  # doctest: +NORMALIZE_WHITESPACE
      | policy | measured B/layer | measured/sbh | paper formula | paper B/layer | ratio |
      |---|---:|---:|---|---:|---:|
      | everything (no remat) | ... | ... | sbh(34 + 5as/h) | 4,992 | ... |
      | dots | ... | ... | - | - | - |
      | selective() | 3,584 | 28.0 | 34sbh | 4,352 | 0.82 |
      | nothing (full remat) | 256 | 2.0 | 2sbh | 256 | 1.00 |

    References:
      Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
      2022, table 2, https://arxiv.org/abs/2205.05198.
    """
    f = 4 * h if f is None else f
    sbh = s * b * h
    k = 18 + 4 * f / h  # 34 when f = 4h
    kk = f"{k:g}"
    rows = [
        (
            "everything (no remat)",
            policies.everything,
            f"sbh({kk} + 5as/h)",
            sbh * (k + 5 * a * s / h),
        ),
        ("dots", policies.dots, "-", None),
        ("selective()", policies.selective(), f"{kk}sbh", sbh * k),
        ("nothing (full remat)", policies.nothing, "2sbh", 2 * sbh),
    ]
    lines = [
        "| policy | measured B/layer | measured/sbh | paper formula | paper B/layer | ratio |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for label, policy, formula, paper in rows:
        measured = block_residual_bytes(policy, b, s, h, a, f)
        paper_cells = ("-", "-") if paper is None else (f"{paper:,.0f}", f"{measured / paper:.2f}")
        lines.append(
            f"| {label} | {measured:,.0f} | {measured / sbh:.1f} | {formula} | "
            f"{paper_cells[0]} | {paper_cells[1]} |"
        )
    return "\n".join(lines)
