"""Reversible layer stacks: ``jaxmem.reversible_scan`` against the same stack scanned.

``python -m benchmarks.reversible [--quick] [--no-time] [--no-drift] [--json PATH]`` prints,
every figure measured in this run (docs/design.md §3: compiled ``temp_size_in_bytes`` of the
jitted gradient; times interleaved in one process, medians):

1. Memory against depth (4, 8, 16, 32 layers) of a GPT-style stack in the RevViT / Reformer
   form: two ``[batch, seq, d]`` streams, ``f`` = pre-LayerNorm causal multi-head attention,
   ``g`` = pre-LayerNorm MLP (gelu, 4d), ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``. The same
   layer and parameters run four ways: ``jaxmem.reversible_scan`` (nothing stored per layer),
   ``jaxmem.scan`` (partial activations), ``lax.scan`` of ``jax.checkpoint(layer)`` (full remat:
   one carry per layer) and plain ``lax.scan`` (stock). The loss is the mean square of both
   final streams.
2. Step time (value and gradient) at depth 16, interleaved, against ``jaxmem.scan`` and stock.
3. Drift: the relative gradient error ``||g - g_ref|| / ||g_ref||`` over all parameters, of the
   reversible stack against the direct computation (a Python loop over the layers, not scanned,
   not reversible) in float32, for float32 and bfloat16 parameters and streams, depths 4 to 64,
   with and without ``anchor_every``. The bfloat16 rows also give the direct computation's own
   error in bfloat16 (what bfloat16 costs without any reconstruction). Two initializations:
   GPT-2's (residual branches scaled down with depth) and unit gain (branches as large as their
   inputs, where reconstruction error grows fastest). Smaller widths.

``--quick`` runs tiny shapes (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import pathlib
import platform
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import jaxmem
from benchmarks.harness import MIN_REPEATS, format_mib, table, time_interleaved


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seq: int
    d: int
    heads: int


DEFAULT = Shape(batch=8, seq=128, d=256, heads=4)
QUICK = Shape(batch=2, seq=8, d=16, heads=2)
DRIFT = Shape(batch=4, seq=32, d=64, heads=4)


# ------------------------------------------------------------------------------------------
# The stack.


def _layer_norm(x, scale):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    scale = scale.reshape((1,) * (x.ndim - 1) + scale.shape)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * scale


def make_fg(heads: int) -> tuple[Callable, Callable]:
    """``f`` (pre-LN causal attention) and ``g`` (pre-LN MLP) of one layer's params."""

    def f(p, x):
        b, t, d = x.shape
        h = _layer_norm(x, p["ln1"])
        q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)

        def heads_of(a):
            return a.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3)

        q, k, v = heads_of(q), heads_of(k), heads_of(v)
        scores = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(d // heads)
        mask = jnp.tril(jnp.ones((1, 1, t, t), bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        att = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
        out = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        return out @ p["proj"]

    def g(p, y):
        h = _layer_norm(y, p["ln2"])
        return jax.nn.gelu(h @ p["fc"]) @ p["out"]

    return f, g


INITS = ("gpt2", "unit")


def make_params(
    depth: int, d: int, dtype=jnp.float32, seed: int = 0, init: str = "gpt2"
) -> dict[str, jax.Array]:
    """``init="gpt2"``: GPT-2's normal(0.02), output projections scaled by 1/sqrt(2 depth) (the
    residual branches shrink with depth). ``"unit"``: normal(1/sqrt(fan_in)) everywhere, no
    depth scaling (each branch about as large as its input: the reconstruction's hard case)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    if init == "gpt2":
        std = {"qkv": 0.02, "fc": 0.02, "proj": 0.02 / math.sqrt(2 * depth)}
        std["out"] = std["proj"]
    elif init == "unit":
        std = {"qkv": d**-0.5, "fc": d**-0.5, "proj": d**-0.5, "out": (4 * d) ** -0.5}
    else:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    p = {
        "ln1": jnp.ones((depth, d)),
        "qkv": std["qkv"] * jax.random.normal(keys[0], (depth, d, 3 * d)),
        "proj": std["proj"] * jax.random.normal(keys[1], (depth, d, d)),
        "ln2": jnp.ones((depth, d)),
        "fc": std["fc"] * jax.random.normal(keys[2], (depth, d, 4 * d)),
        "out": std["out"] * jax.random.normal(keys[3], (depth, 4 * d, d)),
    }
    return jax.tree.map(lambda a: a.astype(dtype), p)


def make_streams(shape: Shape, dtype=jnp.float32, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    dims = (shape.batch, shape.seq, shape.d)
    return jax.random.normal(k1, dims, dtype), jax.random.normal(k2, dims, dtype)


def _stream_loss(y1, y2):
    return jnp.mean(jnp.square(y1.astype(jnp.float32))) + jnp.mean(
        jnp.square(y2.astype(jnp.float32))
    )


def losses(heads: int) -> dict[str, Callable]:
    """The four variants of the same stack, each ``loss(params, streams)``."""
    f, g = make_fg(heads)

    def layer(x, p):
        x1, x2 = x
        y1 = x1 + f(p, x2)
        return (y1, x2 + g(p, y1)), None

    def scanned(scan):
        def loss(params, streams):
            (y1, y2), _ = scan(layer, streams, params)
            return _stream_loss(y1, y2)

        return loss

    def reversible(params, streams):
        return _stream_loss(*jaxmem.reversible_scan(f, g, streams, params))

    return {
        "reversible_scan": reversible,
        "jaxmem.scan": scanned(jaxmem.scan),
        "full remat": scanned(lambda fn, c, xs: jax.lax.scan(jax.checkpoint(fn), c, xs)),
        "lax.scan": scanned(jax.lax.scan),
    }


def direct_loss(heads: int, depth: int) -> Callable:
    """The stack as written: a Python loop over the layers (the reference of the drift table)."""
    f, g = make_fg(heads)

    def loss(params, streams):
        x1, x2 = streams
        for layer in range(depth):
            p = jax.tree.map(lambda a, i=layer: a[i], params)
            x1 = x1 + f(p, x2)
            x2 = x2 + g(p, x1)
        return _stream_loss(x1, x2)

    return loss


# ------------------------------------------------------------------------------------------
# Measurements.


def _temp(loss: Callable, *args) -> int:
    grad = jax.jit(jax.grad(loss))
    return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes


def bench_memory(shape: Shape, depths: Sequence[int]) -> dict[str, Any]:
    """Temp of the gradient per variant and depth (abstract arguments: nothing runs)."""
    variants = losses(shape.heads)
    streams = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), make_streams(shape))
    rows = []
    for depth in depths:
        params = jax.eval_shape(lambda depth=depth: make_params(depth, shape.d))
        rows.append(
            {"depth": depth, "temp": {k: _temp(fn, params, streams) for k, fn in variants.items()}}
        )
    base = rows[0]["temp"]["reversible_scan"]
    for row in rows:
        t = row["temp"]
        row["reversible_over_shallowest"] = t["reversible_scan"] / base
        row["ratios"] = {k: t["reversible_scan"] / v for k, v in t.items()}
    return {"shape": dataclasses.asdict(shape), "rows": rows}


def _rel_err(got: Any, want: Any) -> float:
    pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    num = sum(float(jnp.sum(jnp.square(a.astype(jnp.float32) - b))) for a, b in pairs)
    den = sum(float(jnp.sum(jnp.square(b))) for _, b in pairs)
    return math.sqrt(num / den)


def bench_time(shape: Shape, depth: int, repeats: int) -> dict[str, Any]:
    """Interleaved value-and-gradient times of the variants at one depth, and their errors."""
    variants = losses(shape.heads)
    params, streams = make_params(depth, shape.d), make_streams(shape)
    fns = {k: jax.jit(jax.value_and_grad(fn)) for k, fn in variants.items()}
    times = time_interleaved(fns, params, streams, repeats=repeats)
    want = times["lax.scan"].output[1]
    res: dict[str, Any] = {"depth": depth, "repeats": repeats, "variants": {}}
    for k, t in times.items():
        res["variants"][k] = {
            "min_s": t.min_s,
            "median_s": t.median_s,
            "over_jaxmem_scan": t.median_s / times["jaxmem.scan"].median_s,
            "over_lax_scan": t.median_s / times["lax.scan"].median_s,
            "rel_err": _rel_err(t.output[1], want),
        }
    return res


def bench_drift(
    shape: Shape, depths: Sequence[int], anchors: Sequence[int | None]
) -> dict[str, Any]:
    """Relative gradient error of the reversible stack against the direct float32 loop, for
    both initializations (:func:`make_params`)."""
    f, g = make_fg(shape.heads)
    rows = []
    for init, depth in itertools.product(INITS, depths):
        params32 = make_params(depth, shape.d, init=init)
        streams32 = make_streams(shape)
        ref_loss = direct_loss(shape.heads, depth)
        want = jax.jit(jax.grad(ref_loss))(params32, streams32)
        row: dict[str, Any] = {"init": init, "depth": depth}
        for dtype in (jnp.float32, jnp.bfloat16):
            name = jnp.dtype(dtype).name
            params = jax.tree.map(lambda a, dt=dtype: a.astype(dt), params32)
            streams = tuple(s.astype(dtype) for s in streams32)
            if dtype != jnp.float32:
                direct = jax.jit(jax.grad(ref_loss))(params, streams)
                row[f"{name} direct"] = _rel_err(direct, want)
            for k in anchors:

                def loss(params, streams, k=k):
                    y = jaxmem.reversible_scan(f, g, streams, params, anchor_every=k)
                    return _stream_loss(*y)

                got = jax.jit(jax.grad(loss))(params, streams)
                row[f"{name} anchor_every={k}"] = _rel_err(got, want)
        rows.append(row)
    return {"shape": dataclasses.asdict(shape), "anchors": list(anchors), "rows": rows}


# ------------------------------------------------------------------------------------------
# Output.


def _tables(memory, timing, drift) -> str:
    mib = format_mib
    s = memory["shape"]
    names = list(memory["rows"][0]["temp"])
    head = ["depth", *names, f"reversible / depth {memory['rows'][0]['depth']}"]
    head += ["reversible / full remat", "reversible / jaxmem.scan"]
    rows = [
        [
            row["depth"],
            *(mib(row["temp"][k]) for k in names),
            f"{row['reversible_over_shallowest']:.3f}x",
            f"{row['ratios']['full remat']:.3f}x",
            f"{row['ratios']['jaxmem.scan']:.3f}x",
        ]
        for row in memory["rows"]
    ]
    out = [
        f"Gradient temp, GPT-style reversible stack (batch {s['batch']}, seq {s['seq']}, "
        f"d {s['d']}, {s['heads']} heads, f32), jax {jax.__version__}:",
        table(head, rows, align="r", markdown=True),
    ]
    if timing:
        out.append(
            f"\nStep time (value and gradient), depth {timing['depth']}, interleaved, median of "
            f"{timing['repeats']}:"
        )
        head = ["variant", "median", "/ jaxmem.scan", "/ lax.scan", "gradient rel. err"]
        rows = [
            [
                k,
                f"{v['median_s'] * 1e3:.1f} ms",
                f"{v['over_jaxmem_scan']:.2f}x",
                f"{v['over_lax_scan']:.2f}x",
                f"{v['rel_err']:.1e}",
            ]
            for k, v in timing["variants"].items()
        ]
        out.append(table(head, rows, markdown=True))
    if drift:
        s = drift["shape"]
        cols = [k for k in drift["rows"][0] if k not in ("init", "depth")]
        out.append(
            f"\nDrift: relative gradient error ||g - g_ref|| / ||g_ref|| against the direct "
            f"float32 loop (batch {s['batch']}, seq {s['seq']}, d {s['d']}):"
        )
        rows = [
            [row["init"], row["depth"], *(f"{row[c]:.1e}" for c in cols)] for row in drift["rows"]
        ]
        out.append(table(["init", "depth", *cols], rows, markdown=True))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmarks, prints the tables; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reversible", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--no-time", action="store_true", help="no step times")
    parser.add_argument("--no-drift", action="store_true", help="no drift table")
    parser.add_argument("--json", type=pathlib.Path, help="write every figure to this file")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    args = parser.parse_args(argv)
    if args.quick:
        memory = bench_memory(QUICK, (2, 6))
        timing = None if args.no_time else bench_time(QUICK, 2, 3)
        drift = None if args.no_drift else bench_drift(QUICK, (2,), (None, 1))
    else:
        memory = bench_memory(DEFAULT, (4, 8, 16, 32))
        timing = None if args.no_time else bench_time(DEFAULT, 16, args.repeats)
        drift = None if args.no_drift else bench_drift(DRIFT, (4, 8, 16, 32, 64), (None, 4, 8))
    print(_tables(memory, timing, drift))
    if args.json:
        out = {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "memory": memory,
            "time": timing,
            "drift": drift,
        }
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
