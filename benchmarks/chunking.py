"""Automatic chunking of loss tails: ``jaxmem.autochunk`` against the naive loss and its peers.

``python -m benchmarks.chunking [--quick] [--no-time] [--json PATH]`` prints four tables, every
figure measured in this run (docs/design.md §3: compiled ``temp_size_in_bytes`` of the jitted
value-and-gradient, times interleaved in one process):

1. Cross-entropy of an LM head at everyone's defaults, ``optax.softmax_cross_entropy_with_
   integer_labels(x @ w, y).mean()`` (f32) at N=4096 D=512 V=32768 and N=8192 D=1024 V=32768:
   the naive loss, ``autochunk`` of it (tiles of tokens and vocabulary), the hand-written
   ``jaxmem.losses.linear_cross_entropy`` at its defaults and at autochunk's tiles, and tokamax's
   ``linear_softmax_cross_entropy_loss(implementation="chunked_xla")`` at its defaults (where
   the installed tokamax has it).
2. The same loss with ``autochunk(columns=False)`` (chunks of tokens only, the vocabulary whole)
   against ``linear_cross_entropy`` at the same chunking, and ``jax-cce`` 0.1.0 at the same
   block bytes (N=8192 D=1024 V=32768).
3. Step times at N=2048 D=512 V=16384, interleaved: the median over rounds of each variant's time
   over the naive loss's in the same round.
4. A big-MLP head with a per-token loss, ``mean((gelu(x @ w1) @ w2 - t) ** 2)`` (N=8192,
   d=1024), and the training step of a GPT-2-small-shaped model (12 layers, d 768, 12 heads,
   vocabulary 50257; batch and sequence scaled to this CPU): the gradient as written and with
   ``autochunk`` (the AutoChunker's GPT-2 table, in JAX).

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
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmem
from benchmarks.harness import MIN_REPEATS, format_mib, table, time_interleaved
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


def _tokamax():
    """tokamax's chunked XLA loss at its defaults, or None (not installed, or a version without
    ``implementation="chunked_xla"``: tokamax 0.0.12 says so with a ValueError)."""
    try:
        import tokamax  # noqa: PLC0415
    except ImportError:
        return None

    def loss(x, w, y):
        return tokamax.linear_softmax_cross_entropy_loss(
            x, y, w, reduction="mean", implementation="chunked_xla"
        )

    s = jax.ShapeDtypeStruct
    try:
        jax.eval_shape(
            loss, s((128, 128), jnp.float32), s((128, 256), jnp.float32), s((128,), jnp.int32)
        )
    except ValueError:
        return None
    return loss


def _cce():
    try:
        import jax_cce  # noqa: PLC0415
    except ImportError:
        print("jax-cce not installed (pip install jaxmem[bench]): its columns are skipped")
        return None
    return lambda x, w, y, chunk: jax_cce.linear_cross_entropy(x, w.T, y, chunk_size=chunk)


def bench_defaults(n: int, d: int, v: int) -> dict[str, Any]:
    """Temp of the CE gradient at everyone's defaults (and lce at autochunk's tiles)."""
    s = jax.ShapeDtypeStruct
    args = (s((n, d), jnp.float32), s((d, v), jnp.float32), s((n,), jnp.int32))
    lean = jaxmem.autochunk(naive_ce)
    tail = lean.explain(*args).tails[0]
    rows, cols = tail.chunk_size, tail.column_chunk_size or v
    res: dict[str, Any] = {
        "N": n,
        "D": d,
        "V": v,
        "tiles": [rows, cols],
        "report": str(lean.explain(*args)),
        "naive": _temp(naive_ce, *args),
        "autochunk": _temp(lean, *args),
        "linear_cross_entropy": _temp(lambda x, w, y: linear_cross_entropy(x, w, y), *args),
        "linear_cross_entropy_same_tiles": _temp(
            lambda x, w, y: linear_cross_entropy(x, w, y, chunk_size=cols, token_chunk_size=rows),
            *args,
        ),
    }
    tk = _tokamax()
    res["tokamax"] = None if tk is None else _temp(tk, *args)
    for k in ("naive", "linear_cross_entropy", "linear_cross_entropy_same_tiles", "tokamax"):
        res[f"autochunk_over_{k}"] = None if res[k] is None else res["autochunk"] / res[k]
    return res


def bench_rows(n: int, d: int, v: int, row_chunks: Sequence[int]) -> dict[str, Any]:
    """Temp of the CE gradient in chunks of tokens only: autochunk(columns=False), lce at the
    same chunking, lce and jax-cce in vocabulary chunks of the same block bytes."""
    s = jax.ShapeDtypeStruct
    args = (s((n, d), jnp.float32), s((d, v), jnp.float32), s((n,), jnp.int32))
    cce = _cce()
    res: dict[str, Any] = {"N": n, "D": d, "V": v, "naive": _temp(naive_ce, *args), "rows": []}
    for rows in row_chunks:
        cols = rows * v // n  # the same block bytes: [rows, V] and [N, cols]
        lean = jaxmem.autochunk(naive_ce, chunk_size=rows, columns=False)
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
    return res


def time_ce(n: int, d: int, v: int, repeats: int) -> dict[str, Any]:
    """Interleaved value-and-grad times at everyone's defaults, against the naive loss.

    ``over_naive`` is the median over the rounds of the variant's time over the naive loss's
    time in the same round (paired, so that the load of the machine cancels).
    """
    kx, kw, ky = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (n, d))
    w = jax.random.normal(kw, (d, v)) / np.sqrt(d)
    y = jax.random.randint(ky, (n,), 0, v)
    losses = {
        "naive": naive_ce,
        "autochunk": jaxmem.autochunk(naive_ce, warn=False),
        "autochunk(columns=False)": jaxmem.autochunk(naive_ce, columns=False, warn=False),
        "linear_cross_entropy": lambda x, w, y: linear_cross_entropy(x, w, y),
    }
    tk = _tokamax()
    if tk is not None:
        losses["tokamax chunked_xla"] = tk
    fns = {k: jax.jit(jax.value_and_grad(f, argnums=(0, 1))) for k, f in losses.items()}
    times = time_interleaved(fns, x, w, y, repeats=repeats)
    want = times["naive"].output
    base = times["naive"].samples_s
    res: dict[str, Any] = {"N": n, "D": d, "V": v, "repeats": repeats, "times": {}}
    for k, t in times.items():
        res["times"][k] = {
            "min_s": t.min_s,
            "median_s": t.median_s,
            "over_naive": float(np.median(np.array(t.samples_s) / np.array(base))),
            "rel_err": _rel_err(t.output, want),
        }
    return res


def bench_mlp(n: int, d: int, run: bool, limit: int | None) -> dict[str, Any]:
    """The big-MLP head with a per-token squared error: naive vs autochunk temp (and values)."""

    def head(x, w1, w2, t):
        return jnp.mean((jax.nn.gelu(x @ w1) @ w2 - t) ** 2)

    s = jax.ShapeDtypeStruct
    shapes = [(n, d), (d, 4 * d), (4 * d, d), (n, d)]
    args = [s(sh, jnp.float32) for sh in shapes]
    lean = _autochunk(head, limit)
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


def _autochunk(f, limit: int | None):
    return jaxmem.autochunk(f) if limit is None else jaxmem.autochunk(f, max_chunk_bytes=limit)


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


def bench_gpt2(quick: bool, time_it: bool, repeats: int, limit: int | None) -> dict[str, Any]:
    """The whole training-step gradient, as written / autochunk / linear_cross_entropy head."""
    config, batch = gpt2_config(quick)
    model = models.GPT(config, jax.lax.scan)
    written = models.next_token_loss(model)
    losses = {
        "as written": written,
        "autochunk": _autochunk(written, limit),
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


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"x{x:.3f}"


def _tables(defaults, rows, ce_time, mlp, gpt) -> str:
    mib = format_mib
    out = ["Cross-entropy at everyone's defaults: temp of the value-and-gradient"]
    head = ["N", "D", "V", "naive", "autochunk", "(tiles)", "linCE", "linCE@ac", "tokamax"]
    head += ["ac/linCE", "ac/@ac", "ac/tokamax"]
    out.append(
        table(
            head,
            [
                [
                    r["N"],
                    r["D"],
                    r["V"],
                    mib(r["naive"]),
                    mib(r["autochunk"]),
                    f"{r['tiles'][0]}x{r['tiles'][1]}",
                    mib(r["linear_cross_entropy"]),
                    mib(r["linear_cross_entropy_same_tiles"]),
                    mib(r["tokamax"]),
                    _ratio(r["autochunk_over_linear_cross_entropy"]),
                    _ratio(r["autochunk_over_linear_cross_entropy_same_tiles"]),
                    _ratio(r["autochunk_over_tokamax"]),
                ]
                for r in defaults
            ],
            align="r",
        )
    )
    out.append(
        "  linCE: linear_cross_entropy at its defaults; linCE@ac: at autochunk's tiles (tokens x "
        "vocabulary); tokamax: linear_softmax_cross_entropy_loss(implementation='chunked_xla') "
        "at its defaults ('-': not in the installed tokamax)"
    )
    out.append(defaults[-1]["report"])
    out.append(
        f"\nChunks of tokens only (autochunk(columns=False)), N={rows['N']} D={rows['D']} "
        f"V={rows['V']}: naive temp {mib(rows['naive'])}"
    )
    head = ["chunk (rows | cols)", "block", "autochunk", "linCE rows", "linCE cols", "jax-cce"]
    head += ["ac/rows", "ac/cols", "ac/naive"]
    out.append(
        table(
            head,
            [
                [
                    f"{r['chunk_rows']} | {r['chunk_cols']}",
                    mib(r["block_bytes"]),
                    mib(r["autochunk"]),
                    mib(r["linear_cross_entropy_same_tiles"]),
                    mib(r["linear_cross_entropy"]),
                    mib(r["jax_cce"]),
                    f"{r['autochunk_over_lce_same_tiles']:.3f}",
                    f"{r['autochunk_over_lce']:.3f}",
                    f"{r['autochunk_over_naive']:.4f}",
                ]
                for r in rows["rows"]
            ],
            align="r",
        )
    )
    out.append(
        "  linCE rows: linear_cross_entropy at the same chunking (token tiles of `rows`, the "
        "vocabulary whole); linCE cols: at the same block bytes in vocabulary chunks of `cols`"
    )
    if ce_time:
        out.append(
            f"\nCE time N={ce_time['N']} D={ce_time['D']} V={ce_time['V']}, everyone at its "
            f"defaults, {ce_time['repeats']} interleaved rounds (median of the per-round ratio):"
        )
        times = [
            [k, f"{t['median_s'] * 1e3:.1f} ms", f"x{t['over_naive']:.3f}", f"{t['rel_err']:.1e}"]
            for k, t in ce_time["times"].items()
        ]
        head = ["loss", "median", "/ naive", "max rel. err"]
        out.append(textwrap.indent(table(head, times), "  "))
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
    head = ["step", "temp", "/ as written"]
    if "time" in gpt:
        head += ["time", "/ as written", "max rel. err"]
    steps = []
    for k, t in gpt["temp"].items():
        row = [k, mib(t), f"x{gpt['temp_over_written'][k]:.3f}"]
        if "time" in gpt:
            tt = gpt["time"][k]
            row += [f"{tt['median_s']:.2f} s", f"x{tt['over_written']:.2f}", f"{tt['rel_err']:.1e}"]
        steps.append(row)
    out.append(textwrap.indent(table(head, steps), "  "))
    out.append(gpt["report"])
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the three benchmarks, prints the tables; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chunking", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--no-time", action="store_true", help="memory only")
    parser.add_argument("--json", type=pathlib.Path, help="write every figure to this file")
    parser.add_argument(
        "--repeats", type=int, default=21, help="interleaved rounds of the CE time table"
    )
    args = parser.parse_args(argv)
    time_it = not args.no_time
    # Tiny shapes need a tiny max_chunk_bytes to chunk at all; else autochunk's defaults.
    limit = 32 * 1024 if args.quick else None
    if args.quick:
        defaults = [bench_defaults(256, 128, 16384)]
        rows = bench_rows(256, 32, 2048, (64,))
        ce_time = time_ce(256, 32, 2048, 3) if time_it else None
        mlp = bench_mlp(256, 32, run=True, limit=limit)
    else:
        defaults = [bench_defaults(4096, 512, 32768), bench_defaults(8192, 1024, 32768)]
        rows = bench_rows(8192, 1024, 32768, (256, 1024))
        ce_time = time_ce(2048, 512, 16384, args.repeats) if time_it else None
        mlp = bench_mlp(8192, 1024, run=False, limit=limit)
    gpt = bench_gpt2(args.quick, time_it, 3 if args.quick else MIN_REPEATS, limit)
    print(_tables(defaults, rows, ce_time, mlp, gpt))
    if args.json:
        out = {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "cross_entropy_defaults": defaults,
            "cross_entropy_rows": rows,
            "cross_entropy_time": ce_time,
            "mlp_head": mlp,
            "gpt2": gpt,
        }
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
