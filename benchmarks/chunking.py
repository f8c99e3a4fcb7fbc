"""Automatic chunking of loss tails: ``jaxmem.autochunk`` against the naive loss and its peers.

``python -m benchmarks.chunking [--quick] [--no-time] [--json PATH]`` prints three tables, every
figure measured in this run (DESIGN.md section 3: compiled ``temp_size_in_bytes`` of the jitted
value-and-gradient, times interleaved in one process, min/median):

1. Cross-entropy of an LM head, ``optax.softmax_cross_entropy_with_integer_labels(x @ w, y)
   .mean()`` at N=8192 tokens, D=1024, V=32768 (f32): the naive loss, ``autochunk`` of it
   (chunks of rows), the hand-written ``jaxmem.losses.linear_cross_entropy`` and ``jax-cce``
   0.1.0 (both chunks of vocabulary columns, all tokens at once: ``token_chunk_size=N``) at the
   same chunking: the chunk's ``[rows, V]`` or ``[N, columns]`` block of the same bytes. Times
   at N=2048, D=512, V=16384 (the N=8192 step takes seconds per run on a CPU).
2. A big-MLP head with a per-token loss: ``mean((gelu(x @ w1) @ w2 - t) ** 2)``, tokens x 4d
   hidden (N=8192, d=1024): naive vs ``autochunk``.
3. The training step of a GPT-2-small-shaped model (12 layers, d 768, 12 heads, vocabulary
   50257; batch and sequence scaled to this CPU): the gradient of the next-token loss as
   written, with ``autochunk`` around the same loss, and with the hand-written
   ``linear_cross_entropy`` head: the AutoChunker's GPT-2 table, in JAX.

``--quick`` runs tiny shapes (a smoke test of the script). Values and gradients of every chunked
variant are compared with the naive ones where the script runs them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmem
from benchmarks.harness import MIN_REPEATS, format_mib, time_interleaved
from jaxmem.demo import models
from jaxmem.losses import linear_cross_entropy


def _temp(f: Callable, *args, argnums=(0, 1)) -> int:
    grad = jax.jit(jax.value_and_grad(f, argnums=argnums))
    return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes


def _rel_err(got, want) -> float:
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    return max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)) for a, b in pairs)


def naive_ce(x, w, y):
    """The naive LM-head loss: optax cross-entropy of the full ``[N, V]`` logits."""
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()


def _cce():
    try:
        import jax_cce  # noqa: PLC0415
    except ImportError:
        print("jax-cce not installed (pip install jaxmem[bench]): its columns are skipped")
        return None
    return lambda x, w, y, chunk: jax_cce.linear_cross_entropy(x, w.T, y, chunk_size=chunk)


def bench_ce(n: int, d: int, v: int, row_chunks: Sequence[int], limit: int) -> dict[str, Any]:
    """Temp of the CE gradient: naive, autochunk, linear_cross_entropy, jax-cce per chunking.

    Two ``linear_cross_entropy`` columns: at the same chunking as autochunk (token tiles of
    ``rows``, the vocabulary in one chunk) and at the same block bytes with vocabulary chunks
    only (its leanest layout for that block: all tokens, ``cols`` columns).
    """
    s = jax.ShapeDtypeStruct
    args = (s((n, d), jnp.float32), s((d, v), jnp.float32), s((n,), jnp.int32))
    cce = _cce()
    res: dict[str, Any] = {"N": n, "D": d, "V": v, "naive": _temp(naive_ce, *args), "rows": []}
    for rows in row_chunks:
        cols = rows * v // n  # the same block bytes: [rows, V] and [N, cols]
        lean = jaxmem.autochunk(naive_ce, chunk_size=rows)
        row: dict[str, Any] = {
            "chunk_rows": rows,
            "chunk_cols": cols,
            "block_bytes": rows * v * 4,
            "autochunk": _temp(lean, *args),
            "linear_cross_entropy": _temp(
                lambda x, w, y, c=cols: linear_cross_entropy(
                    x, w, y, chunk_size=c, token_chunk_size=n
                ),
                *args,
            ),
        }
        row["linear_cross_entropy_same_tiles"] = _temp(
            lambda x, w, y, r=rows: linear_cross_entropy(x, w, y, chunk_size=v, token_chunk_size=r),
            *args,
        )
        row["jax_cce"] = (
            None if cce is None else _temp(lambda x, w, y, c=cols: cce(x, w, y, c), *args)
        )
        row["autochunk_over_lce"] = row["autochunk"] / row["linear_cross_entropy"]
        row["autochunk_over_lce_same_tiles"] = (
            row["autochunk"] / row["linear_cross_entropy_same_tiles"]
        )
        row["autochunk_over_naive"] = row["autochunk"] / res["naive"]
        res["rows"].append(row)
    default = jaxmem.autochunk(naive_ce, max_chunk_bytes=limit)
    res["default_report"] = str(default.explain(*args))
    res["default_autochunk"] = _temp(default, *args)
    return res


def time_ce(n: int, d: int, v: int, rows: int, repeats: int) -> dict[str, Any]:
    """Interleaved value-and-grad times: naive, autochunk (chunks of ``rows``), lce, jax-cce."""
    kx, kw, ky = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (n, d))
    w = jax.random.normal(kw, (d, v)) / np.sqrt(d)
    y = jax.random.randint(ky, (n,), 0, v)
    cols = rows * v // n
    losses = {
        "naive": naive_ce,
        "autochunk": jaxmem.autochunk(naive_ce, chunk_size=rows),
        "linear_cross_entropy": lambda x, w, y: linear_cross_entropy(
            x, w, y, chunk_size=cols, token_chunk_size=n
        ),
    }
    cce = _cce()
    if cce is not None:
        losses["jax_cce"] = lambda x, w, y: cce(x, w, y, cols)
    fns = {k: jax.jit(jax.value_and_grad(f, argnums=(0, 1))) for k, f in losses.items()}
    times = time_interleaved(fns, x, w, y, repeats=repeats)
    want = times["naive"].output
    res: dict[str, Any] = {"N": n, "D": d, "V": v, "chunk_rows": rows, "repeats": repeats}
    for k, t in times.items():
        res[k] = {
            "min_s": t.min_s,
            "median_s": t.median_s,
            "over_naive": t.median_s / times["naive"].median_s,
            "rel_err": _rel_err(t.output, want),
        }
    return res


def bench_mlp(n: int, d: int, run: bool, limit: int) -> dict[str, Any]:
    """The big-MLP head with a per-token squared error: naive vs autochunk temp (and values)."""

    def head(x, w1, w2, t):
        return jnp.mean((jax.nn.gelu(x @ w1) @ w2 - t) ** 2)

    s = jax.ShapeDtypeStruct
    shapes = [(n, d), (d, 4 * d), (4 * d, d), (n, d)]
    args = [s(sh, jnp.float32) for sh in shapes]
    lean = jaxmem.autochunk(head, max_chunk_bytes=limit)
    res: dict[str, Any] = {"N": n, "d": d, "report": str(lean.explain(*args))}
    res["naive"] = _temp(head, *args, argnums=(0, 1, 2))
    res["autochunk"] = _temp(lean, *args, argnums=(0, 1, 2))
    res["autochunk_over_naive"] = res["autochunk"] / res["naive"]
    if run:
        keys = jax.random.split(jax.random.key(1), 4)
        vals = [
            jax.random.normal(k, sh) / np.sqrt(sh[0]) for k, sh in zip(keys, shapes, strict=True)
        ]
        grad = [jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))) for f in (lean, head)]
        res["rel_err"] = _rel_err(grad[0](*vals), grad[1](*vals))
    return res


def gpt2_config(quick: bool) -> tuple[models.GPTConfig, int]:
    """GPT-2 small (12 layers, d 768, 12 heads, vocabulary 50257), sequence 128, batch 8."""
    if quick:
        return models.GPTConfig(
            vocab_size=1000, seq_len=16, num_layers=2, d_model=32, num_heads=2, d_ff=128
        ), 2
    config = models.GPTConfig(
        vocab_size=50257, seq_len=128, num_layers=12, d_model=768, num_heads=12, d_ff=3072
    )
    return config, 8


def bench_gpt2(quick: bool, time_it: bool, repeats: int, limit: int) -> dict[str, Any]:
    """The whole training-step gradient, as written / autochunk / linear_cross_entropy head."""
    config, batch = gpt2_config(quick)
    model = models.GPT(config, jax.lax.scan)
    written = models.next_token_loss(model)
    losses = {
        "as written": written,
        "autochunk": jaxmem.autochunk(written, max_chunk_bytes=limit),
        "linear_cross_entropy head": models.linear_ce_next_token_loss(model),
    }
    params = models.abstract_params(config, batch)
    tokens = jax.ShapeDtypeStruct((batch, config.seq_len), jnp.int32)
    res: dict[str, Any] = {
        "config": {
            "layers": config.num_layers,
            "d_model": config.d_model,
            "heads": config.num_heads,
            "vocab": config.vocab_size,
            "seq": config.seq_len,
            "batch": batch,
        },
        "report": str(losses["autochunk"].explain(params, tokens)),
        "temp": {k: _temp(f, params, tokens, argnums=0) for k, f in losses.items()},
    }
    base = res["temp"]["as written"]
    res["temp_over_written"] = {k: t / base for k, t in res["temp"].items()}
    if time_it:
        concrete = model.init(jax.random.key(0), jnp.zeros((batch, config.seq_len), jnp.int32))
        toks = jax.random.randint(jax.random.key(1), (batch, config.seq_len), 0, config.vocab_size)
        fns = {k: jax.jit(jax.value_and_grad(f)) for k, f in losses.items()}
        times = time_interleaved(fns, concrete["params"], toks, repeats=repeats)
        want = times["as written"].output
        res["time"] = {
            k: {
                "median_s": t.median_s,
                "over_written": t.median_s / times["as written"].median_s,
                "rel_err": _rel_err(t.output, want),
            }
            for k, t in times.items()
        }
    return res


def _tables(ce, ce_time, mlp, gpt) -> str:
    mib = format_mib
    out = [f"Cross-entropy N={ce['N']} D={ce['D']} V={ce['V']}: naive temp {mib(ce['naive'])}"]
    out.append(
        f"{'chunk (rows | cols)':>20} {'block':>10} {'autochunk':>11} {'linCE rows':>11} "
        f"{'linCE cols':>11} {'jax-cce':>11} {'ac/rows':>8} {'ac/cols':>8} {'ac/naive':>9}"
    )
    for r in ce["rows"]:
        out.append(
            f"{r['chunk_rows']:>9} | {r['chunk_cols']:<8} {mib(r['block_bytes']):>10} "
            f"{mib(r['autochunk']):>11} {mib(r['linear_cross_entropy_same_tiles']):>11} "
            f"{mib(r['linear_cross_entropy']):>11} {mib(r['jax_cce']):>11} "
            f"{r['autochunk_over_lce_same_tiles']:>8.3f} {r['autochunk_over_lce']:>8.3f} "
            f"{r['autochunk_over_naive']:>9.4f}"
        )
    out.append(
        "  linCE rows: linear_cross_entropy at autochunk's chunking (token tiles of `rows`, the "
        "vocabulary whole); linCE cols: at the same block bytes in vocabulary chunks of `cols`"
    )
    out.append(f"default autochunk: temp {mib(ce['default_autochunk'])}")
    out.append(ce["default_report"])
    if ce_time:
        out.append(
            f"\nCE time N={ce_time['N']} D={ce_time['D']} V={ce_time['V']}, chunks of "
            f"{ce_time['chunk_rows']} rows (same block for the others), median of "
            f"{ce_time['repeats']}:"
        )
        for k, t in ce_time.items():
            if isinstance(t, dict):
                out.append(
                    f"  {k:<22} {t['median_s'] * 1e3:8.1f} ms  x{t['over_naive']:.2f} naive  "
                    f"max rel. err {t['rel_err']:.1e}"
                )
    out.append(
        f"\nMLP head N={mlp['N']} d={mlp['d']} (hidden 4d): naive {mib(mlp['naive'])}, "
        f"autochunk {mib(mlp['autochunk'])} (x{mlp['autochunk_over_naive']:.3f})"
        + (f", max rel. err {mlp['rel_err']:.1e}" if "rel_err" in mlp else "")
    )
    c = gpt["config"]
    out.append(
        f"\nGPT-2-small-shaped training step ({c['layers']} layers, d {c['d_model']}, vocab "
        f"{c['vocab']}, batch {c['batch']} x seq {c['seq']}): gradient temp"
    )
    for k, t in gpt["temp"].items():
        line = f"  {k:<26} {mib(t):>12}  x{gpt['temp_over_written'][k]:.3f}"
        if "time" in gpt:
            tt = gpt["time"][k]
            line += (
                f"   time {tt['median_s']:.2f} s x{tt['over_written']:.2f}  "
                f"max rel. err {tt['rel_err']:.1e}"
            )
        out.append(line)
    out.append(gpt["report"])
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the three benchmarks, prints the tables; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chunking", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--no-time", action="store_true", help="memory only")
    parser.add_argument("--json", type=pathlib.Path, help="write every figure to this file")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    args = parser.parse_args(argv)
    time_it = not args.no_time
    # autochunk's default max_chunk_bytes (16 MiB); tiny shapes need a tiny one to chunk at all.
    limit = 32 * 1024 if args.quick else jaxmem.autochunk(naive_ce).max_chunk_bytes
    if args.quick:
        ce = bench_ce(256, 32, 2048, (64,), limit)
        ce_time = time_ce(256, 32, 2048, 64, 3) if time_it else None
        mlp = bench_mlp(256, 32, run=True, limit=limit)
    else:
        ce = bench_ce(8192, 1024, 32768, (256, 512, 1024, 2048), limit)
        ce_time = time_ce(2048, 512, 16384, 512, args.repeats) if time_it else None
        mlp = bench_mlp(8192, 1024, run=False, limit=limit)
    gpt = bench_gpt2(args.quick, time_it, 3 if args.quick else args.repeats, limit)
    print(_tables(ce, ce_time, mlp, gpt))
    if args.json:
        out = {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "cross_entropy": ce,
            "cross_entropy_time": ce_time,
            "mlp_head": mlp,
            "gpt2": gpt,
        }
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
