"""What the tests share: tolerances, tree comparisons, the references every trick is checked
against (``jax.lax.scan`` and a plain Python loop), deterministic random arrays, and reading a
lowered module's host placements.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

f32, f16, bf16 = jnp.float32, jnp.float16, jnp.bfloat16

# f32 bodies: max relative difference 1e-6 (with atol = 1e-6 * max|reference|).
F32_RTOL = 1e-6
# Bodies that round to bf16/f16: XLA may keep 16-bit intermediates in excess (f32) precision
# inside a fusion, and fuses differently in a scan body, an unrolled Python loop and the custom
# VJP's recomputation, so one rounding step of a 16-bit float (2**-8 for bf16) can differ
# between equally correct programs. 2e-2 relative is a few bf16 ulps, still far below the size
# of any wrong gradient.
LOW_RTOL = 2e-2

T, B, D = 3, 2, 4

# The installed jax as (major, minor, patch), for what differs between its versions.
JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:3])

# ------------------------------------------------------------------------------------------
# Comparison helpers and references.


def _draws_setting() -> int:
    text = os.environ.get("JAXMEM_DRAWS", "1")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"JAXMEM_DRAWS={text!r}: expected a positive integer")
    return int(text)


# One in DRAWS of the random draws runs (JAXMEM_DRAWS, for CI time; unset: all). Read here
# alone: conftest.py thins the seeded draws of the tests marked ``sampled`` by it, draws() the
# examples of the hypothesis searches.
DRAWS = _draws_setting()


def draws(n: int) -> int:
    """How many of ``n`` random draws a test makes: one in :data:`DRAWS`, at least one."""
    return max(1, n // DRAWS)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def assert_trees_close(actual, expected, rtol: float = F32_RTOL, what: str = ""):
    """Same tree, dtypes and shapes; float leaves within rtol (atol = rtol * max|expected|).

    Integer and boolean leaves must be equal; float0 leaves (cotangents of integer inputs) are
    compared by dtype and shape only.
    """
    a_paths, a_tree = jax.tree_util.tree_flatten_with_path(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, f"{what}: tree structure {a_tree} != {e_tree}"
    for (path, a), e in zip(a_paths, e_leaves, strict=True):
        where = f"{what}{jax.tree_util.keystr(path)}"
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != {e.dtype}"
        assert a.shape == e.shape, f"{where}: shape {a.shape} != {e.shape}"
        if e.dtype == jax.dtypes.float0:
            continue
        if not jnp.issubdtype(e.dtype, jnp.inexact):
            np.testing.assert_array_equal(a, e, err_msg=where)
            continue
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        assert np.all(np.isfinite(e64)), f"{where}: the reference is not finite"
        if e64.size == 0:
            continue
        atol = rtol * float(np.max(np.abs(e64)))
        err = np.abs(a64 - e64)
        bad = ~(err <= atol + rtol * np.abs(e64))
        if np.any(bad):
            scale = max(float(np.max(np.abs(e64))), np.finfo(np.float64).tiny)
            raise AssertionError(
                f"{where}: {int(bad.sum())} of {e64.size} elements differ; max |diff| = "
                f"{float(err.max()):.3g}, max |diff| / max|ref| = {float(err.max()) / scale:.3g} "
                f"(rtol {rtol})\nactual:\n{a}\nexpected:\n{e}"
            )


def loop_scan(f, init, xs=None, length=None, reverse=False, unroll=1):
    """A plain Python loop with the semantics of :func:`jax.lax.scan` (the second reference)."""
    del unroll
    x_leaves, x_tree = jax.tree.flatten(xs)
    n = length if length is not None else x_leaves[0].shape[0]
    carry = init
    ys = [None] * n
    for t in reversed(range(n)) if reverse else range(n):
        carry, ys[t] = f(carry, jax.tree.unflatten(x_tree, [leaf[t] for leaf in x_leaves]))
    if n == 0:
        x_struct = jax.tree.unflatten(
            x_tree, [jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype) for leaf in x_leaves]
        )
        _, y_struct = jax.eval_shape(f, init, x_struct)
        return carry, jax.tree.map(lambda s: jnp.zeros((0, *s.shape), s.dtype), y_struct)
    return carry, jax.tree.map(lambda *leaves: jnp.stack(leaves), *ys)


SCANS: dict[str, Callable] = {"lax": jax.lax.scan, "loop": loop_scan}


def scalarize(out):
    """A scalar loss of every float leaf of ``out``: random linear term plus half a square.

    Its gradient sends a different, value-dependent cotangent into every output element.
    """
    leaves = [leaf for leaf in jax.tree.leaves(out) if _is_float(leaf)]
    # f32, or f64 for the float64 runs of a case (below).
    dtype = functools.reduce(jnp.promote_types, [leaf.dtype for leaf in leaves], f32)
    total = jnp.zeros((), dtype)
    for i, leaf in enumerate(leaves):
        w = jnp.asarray(np.random.default_rng(100 + i).standard_normal(leaf.shape), dtype)
        x = leaf.astype(dtype)
        total = total + jnp.sum(w * x) + 0.5 * jnp.sum(x * x)
    return total


def values_and_grads_fn(run: Callable, scan: Callable, nargs: int = 3) -> Callable:
    """``args -> (run(scan, *args), grad of scalarize(run(scan, *args)) w.r.t. every arg)``."""

    def loss(*a):
        out = run(scan, *a)
        return scalarize(out), out

    f = jax.value_and_grad(loss, argnums=tuple(range(nargs)), has_aux=True, allow_int=True)

    def values_and_grads(*args):
        (_, out), grads = f(*args)
        return out, grads

    return values_and_grads


class Rand:
    """Deterministic random arrays, seeded from the case name."""

    def __init__(self, name: str):
        self.rng = np.random.default_rng(zlib.crc32(name.encode()))

    def normal(self, shape, scale=1.0, dtype=f32):
        return jnp.asarray(scale * self.rng.standard_normal(shape), dtype)

    def ints(self, shape, low, high, dtype=jnp.int32):
        return jnp.asarray(self.rng.integers(low, high, shape), dtype)

    def bools(self, shape):
        return jnp.asarray(self.rng.random(shape) < 0.5)


def placements(text: str) -> tuple[int, int]:
    """(# to-host, # to-device) placement annotations in a lowered module's text."""
    return (
        text.count('_xla_buffer_placement = "pinned_host"'),
        text.count('_xla_buffer_placement = "device"'),
    )


def structs(tree):
    """ShapeDtypeStructs (keeping concrete arrays' shardings, memory kind included)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree,
    )


def lower_text(fn, args, platform: str) -> str:
    """The StableHLO text of ``jit(fn)`` exported for ``platform`` (no such device needed)."""
    exported = jax.export.export(jax.jit(fn), platforms=[platform])(*structs(args))
    return exported.mlir_module()


def assert_trees_equal(actual, expected):
    """Same structure, and every leaf bit-identical (dtype and shape included)."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape
        assert np.array_equal(a, e), (a, e)
