"""Attribution benchmark: how much of what is live at the peak a profile points at the model.

``python -m benchmarks.attribution`` profiles each model's loss and its gradient (``jax.grad``),
as written and through ``jaxmem.optimize``, and prints, from the compiled program's buffers live
at the peak (:attr:`jaxmem.MemoryReport.peak_buffers`):

- ``attributed``: the share of the peak's bytes attributed to a line of the model's code (not
  JAX's, jaxlib's, jaxmem's, nor a framework's transform internals) or to an argument's pytree
  path;
- ``in body``: the share of the loop-stacked bytes (loop state of a ``while`` the forward pass
  runs, XLA's temp) attributed to a line whose call chain runs through the loop body's function;
- ``jaxmem``: bytes attributed to jaxmem's own files (the bar: 0);
- ``other``: the viewer's "other" band, the share of the peak outside its six largest groups, at
  the fold the viewer picks (line, call or function), which it names.

Models (4 layers, width 128, 4 heads, batch 2, sequence 64, f32):

- ``transformer``: a plain-JAX GPT-style stack scanned over its layers (:mod:`benchmarks.optimize`
  ``make_loss``);
- ``nnx``: a Flax NNX stack, its layers made by ``nnx.vmap`` and run by ``nnx.scan``, each a
  pre-LN block of ``nnx.MultiHeadAttention`` and a Linear-GELU-Linear MLP;
- ``levanter llama`` (optional, where Levanter imports: its own venv, ``make
  .venv-levanter/.installed-framework``): Levanter's ``LlamaLMHeadModel`` with its defaults
  (:mod:`benchmarks.frameworks`), the loss of its ``train_lm``.

``--json PATH`` also writes the rows; the run fails (exit status 1) where a bar is missed:
``attributed`` or ``in body`` under 98%, or any byte to jaxmem.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import jaxmem
from benchmarks import harness
from benchmarks.optimize import Sizes, make_args, make_loss

SIZES = Sizes(layers=4, batch=2, seq=64, d=128, heads=4)
BAR = 0.98


@dataclasses.dataclass(frozen=True)
class Model:
    """A loss on its arguments, and the name of its loop body's function (``in body`` looks for
    it in a loop-stacked buffer's call chain)."""

    name: str
    loss: Callable[..., jax.Array]
    args: tuple[Any, ...]
    body: str


def transformer(sizes: Sizes = SIZES) -> Model:
    """The plain-JAX GPT-style stack of :mod:`benchmarks.optimize`, scanned with ``lax.scan``."""
    return Model("transformer", make_loss(sizes, jax.lax.scan), make_args(sizes), "layer")


def nnx_stack(sizes: Sizes = SIZES) -> Model:
    """A Flax NNX stack as NNX users write one: ``nnx.vmap`` makes the layers, ``nnx.scan`` runs
    them; the loss takes the ``nnx.split`` state."""
    from flax import nnx  # noqa: PLC0415

    class Block(nnx.Module):
        def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
            self.ln1 = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(d, rngs=rngs)
            self.up = nnx.Linear(d, 4 * d, rngs=rngs)
            self.down = nnx.Linear(4 * d, d, rngs=rngs)

        def __call__(self, h):
            h = h + self.attn(self.ln1(h), mask=nnx.make_causal_mask(jnp.ones(h.shape[:2])))
            return h + self.down(jax.nn.gelu(self.up(self.ln2(h))))

    class Stack(nnx.Module):
        def __init__(self, n: int, d: int, heads: int, rngs: nnx.Rngs):
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(d, heads, rngs)

            self.blocks = make(rngs)

        def __call__(self, h):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def step(h, block):
                return block(h)

            return step(h, self.blocks)

    graphdef, state = nnx.split(Stack(sizes.layers, sizes.d, sizes.heads, nnx.Rngs(0)))

    def loss(state, x):
        return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

    x = jax.random.normal(jax.random.key(1), (sizes.batch, sizes.seq, sizes.d))
    return Model("nnx", loss, (state, x), "Block.__call__")


def levanter_llama() -> Model:
    """Levanter's Llama (:mod:`benchmarks.frameworks`), the loss of its ``train_lm``."""
    import equinox as eqx  # noqa: PLC0415
    import haliax as hax  # noqa: PLC0415
    from levanter.models.lm_model import LmExample  # noqa: PLC0415

    from benchmarks import frameworks  # noqa: PLC0415

    s = frameworks.Sizes(layers=4, emb=128, mlp=512, heads=4, head_dim=32, vocab=1024, batch=2,
                         seq=64)  # fmt: skip
    parts = frameworks._levanter_parts(s, "llama", True)  # its default: gradient checkpointing
    static, batch = parts.static, parts.batch

    def loss(params, tokens):
        example = hax.vmap(LmExample.causal, batch)(tokens)
        return parts.loss(eqx.combine(params, static), example)

    return Model("levanter llama", loss, (parts.params, parts.tokens), "LlamaDecoderLayer.__call__")


def models() -> list[Model]:
    """The models this benchmark measures: those whose framework imports here."""
    out = [transformer()]
    for builder in (nnx_stack, levanter_llama):
        try:
            out.append(builder())
        except ImportError as e:
            print(f"skipped {builder.__name__}: {e}", file=sys.stderr)
    return out


def _in_jaxmem(source: str) -> bool:
    return bool(source) and jaxmem.__path__[0] in source


def measure(model: Model, *, optimized: bool, grad: bool) -> dict[str, Any]:
    """One row: what the peak buffers of the model's loss (or its gradient) are attributed to."""
    loss = jaxmem.optimize(model.loss) if optimized else model.loss
    report = jaxmem.profile(jax.grad(loss) if grad else loss, *model.args)
    b = report.buffers
    if b is None:
        raise RuntimeError(f"{model.name}: no buffer view: {report.buffer_error}")
    peak = b.peak_bytes
    attributed = sum(x.bytes for x in b.peak_buffers if x.attribution)
    stacked = [
        x
        for x in b.peak_buffers
        if x.loop_state and x.kind == "temp" and "while" in x.op_name and not x.backward
    ]
    in_body = [x for x in stacked if any(f"({model.body})" in c or f".{model.body})" in c
                                         for c in x.chain)]  # fmt: skip
    fold, other = viewer_other(b)
    return {
        "model": model.name,
        "written": "optimize" if optimized else "as written",
        "of": "gradient" if grad else "loss",
        "peak_bytes": peak,
        "attributed": attributed / peak,
        "stacked_bytes": sum(x.bytes for x in stacked),
        "in_body": (sum(x.bytes for x in in_body) / sum(x.bytes for x in stacked))
        if stacked
        else None,
        "jaxmem_bytes": sum(
            x.bytes for x in b.peak_buffers if any(_in_jaxmem(c) for c in (x.source, *x.chain))
        ),
        "fold": fold,
        "other": other,
    }


FOLDS = ("line", "call", "function", "file")


def viewer_other(b: jaxmem.BufferReport, bands: int = 6) -> tuple[str, float]:
    """The viewer's "other" band: the share of the peak outside the ``bands`` largest groups, at
    the finest fold where it is under 10% (the coarsest where none is), and that fold."""
    for fold in FOLDS:
        sizes = sorted((g.bytes for g in b.by_source(fold)), reverse=True)
        other = sum(sizes[bands:]) / b.peak_bytes
        if other < 0.1:
            break
    return fold, other


def run() -> list[dict[str, Any]]:
    """Every model, as written and optimized, loss and gradient."""
    return [
        measure(m, optimized=o, grad=g)
        for m in models()
        for o in (False, True)
        for g in (False, True)
    ]


def failures(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The bars each row misses, as lines."""
    out = []
    for r in rows:
        what = f"{r['model']} {r['written']} {r['of']}"
        if r["attributed"] < BAR:
            out.append(f"{what}: {r['attributed']:.1%} of the peak attributed (bar {BAR:.0%})")
        if r["in_body"] is not None and r["in_body"] < BAR:
            out.append(f"{what}: {r['in_body']:.1%} of the loop-stacked bytes in the loop body")
        if r["jaxmem_bytes"]:
            out.append(f"{what}: {r['jaxmem_bytes']} bytes attributed to jaxmem's files")
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a text table."""
    pct = lambda v: "-" if v is None else f"{v:.1%}"
    return harness.table(
        ["model", "written", "of", "peak", "attributed", "in body", "jaxmem", "other (fold)"],
        [
            [r["model"], r["written"], r["of"], harness.format_mib(r["peak_bytes"]),
             pct(r["attributed"]), pct(r["in_body"]), f"{r['jaxmem_bytes']} B",
             f"{pct(r['other'])} ({r['fold']})"]
            for r in rows
        ],
        align="lll",
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.attribution", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    rows = run()
    print(f"jax {jax.__version__}, {jax.default_backend()}")
    print(table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)
    missed = failures(rows)
    for line in missed:
        print(f"FAIL {line}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
