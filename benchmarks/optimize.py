"""``jaxmem.optimize`` on an unmodified 12-layer GPT-style loss: what the rewrite costs.

``python -m benchmarks.optimize [--quick] [--repeats N] [--json PATH]`` prints, for a loss
written with ``jax.lax.scan`` over its layers (pre-LN causal attention and a gelu MLP):

1. trace time of ``jax.jit(jax.grad(loss)).lower(...)`` (tracing and lowering, no compile) for
   ``optimize(loss)`` against the same loss written with ``jaxmem.scan`` by hand (the explicit
   version) and against stock, each the median of ``--repeats`` fresh traces, interleaved;
2. compiled gradient temp of the three;
3. compiled step time (value and gradient) of the three, interleaved, median of >= 21 rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp

import jaxmem
from benchmarks import harness
from benchmarks.harness import format_mib, time_interleaved


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: int = 12
    batch: int = 8
    seq: int = 128
    d: int = 256
    heads: int = 4


FULL = Sizes()
QUICK = Sizes(layers=3, batch=2, seq=8, d=16, heads=2)


def _ln(h):
    return (h - h.mean(-1, keepdims=True)) / (h.std(-1, keepdims=True) + 1e-5)


def make_loss(sizes: Sizes, scan):
    """A GPT-style stack scanned over its layers with ``scan`` (``lax.scan`` or jaxmem's)."""
    hd = sizes.d // sizes.heads

    def layer(h, p):
        b, t, d = h.shape
        q, k, v = jnp.split(_ln(h) @ p["qkv"], 3, axis=-1)
        split = lambda a: a.reshape(b, t, sizes.heads, hd)
        s = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / hd**0.5
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), split(v)).reshape(b, t, d)
        h = h + a @ p["out"]
        return h + jax.nn.gelu(_ln(h) @ p["up"]) @ p["down"], None

    def loss(params, x):
        h, _ = scan(layer, x, params)
        return jnp.mean(h**2)

    return loss


def make_args(sizes: Sizes):
    k = iter(jax.random.split(jax.random.key(0), 5))
    d, n = sizes.d, sizes.layers
    normal = lambda shape, scale: jax.random.normal(next(k), shape) * scale
    params = {
        "qkv": normal((n, d, 3 * d), d**-0.5),
        "out": normal((n, d, d), d**-0.5),
        "up": normal((n, d, 4 * d), d**-0.5),
        "down": normal((n, 4 * d, d), (4 * d) ** -0.5 / n),
    }
    return params, normal((sizes.batch, sizes.seq, d), 1.0)


def variants(sizes: Sizes) -> dict:
    stock = make_loss(sizes, jax.lax.scan)
    return {
        "stock": stock,
        "explicit jaxmem.scan": make_loss(sizes, jaxmem.scan),
        "jaxmem.optimize": jaxmem.optimize(stock),
    }


def trace_times(sizes: Sizes, repeats: int) -> dict[str, float]:
    """Median seconds of tracing and lowering ``jit(grad)``, interleaved, fresh each time.

    Through :func:`~benchmarks.harness.time_interleaved`: each run gets a fresh function (its
    ``setup``, untimed), so that nothing is cached between runs; one untimed warm-up trace each,
    then ``repeats`` rounds A B C (``settle=0``: a trace leaves no device work behind it).
    """
    args = make_args(sizes)
    lower = lambda fn: jax.jit(jax.grad(fn)).lower(*args)
    fresh = lambda name: (variants(sizes)[name],)
    times = time_interleaved(
        dict.fromkeys(variants(sizes), lower), repeats=repeats, settle=0, setup=fresh
    )
    return {n: t.median_s for n, t in times.items()}


def measure(sizes: Sizes, repeats: int) -> dict:
    args = make_args(sizes)
    fns = variants(sizes)
    temps = {
        n: jax.jit(jax.grad(f)).lower(*args).compile().memory_analysis().temp_size_in_bytes
        for n, f in fns.items()
    }
    traces = trace_times(sizes, max(5, repeats // 3))
    steps = time_interleaved(
        {n: jax.jit(jax.value_and_grad(f)) for n, f in fns.items()}, *args, repeats=repeats
    )
    return {
        "sizes": dataclasses.asdict(sizes),
        "jax": jax.__version__,
        "temp": temps,
        "trace_s": traces,
        "step_s": {n: t.median_s for n, t in steps.items()},
    }


def table(result: dict) -> str:
    ref = "explicit jaxmem.scan"
    rows = []
    for n, t in result["temp"].items():
        tr, st = result["trace_s"][n], result["step_s"][n]
        rows.append(
            [
                n,
                format_mib(t),
                f"{tr * 1e3:.0f}ms",
                f"{tr / result['trace_s'][ref]:.2f}x",
                f"{st * 1e3:.1f}ms",
                f"{st / result['step_s'][ref]:.2f}x",
            ]
        )
    head = ["variant", "temp", "trace", "/expl", "step", "/expl"]
    title = f"GPT-style stack {result['sizes']}, f32, jax {result['jax']}"
    return title + "\n" + harness.table(head, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.optimize", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json", type=pathlib.Path, help="write every figure to this file")
    args = parser.parse_args(argv)
    result = measure(QUICK if args.quick else FULL, 3 if args.quick else args.repeats)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
