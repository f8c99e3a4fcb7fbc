"""Compressed residuals: ``jaxmem.scan(compress=...)`` per format, measured (docs/compress.md).

``python -m benchmarks.compress [--quick] [--no-time] [--no-train] [--steps N] [--json PATH]
[--png PATH]`` prints, every figure measured in this run (docs/design.md §3: compiled
``temp_size_in_bytes`` of the jitted gradient, XLA's FLOP count, times interleaved in one
process):

1. The transformer stack (pre-LN causal attention and a gelu MLP, f32, params stacked as xs,
   B=8 S=128 D=256 H=4 F=1024) at 4 and 8 layers, per format (None, bf16, fp8, int8): kept
   bytes (:func:`jaxmem.scan_residuals`), gradient temp, per-layer growth (temp at 8 layers
   minus 4), gradient FLOPs, step time (value and gradient, median), whether the loss is
   bit-identical to ``compress=None``'s (under ``jit`` and under ``value_and_grad``), and the
   gradient error (global relative norm against ``compress=None``), each against the issue's
   bars.
2. The design cases (``benchmarks.cases``): kept bytes, temp, FLOPs and gradient error per
   format.
3. Training: a small GPT (2 layers, ``jaxmem.scan`` over them) on a synthetic copy task (the
   second half of each sequence repeats the first: learnable by attention; the first half is
   random, its loss stays at log(vocab)), 300 steps of adamw (optax), per format; the final
   loss (mean of the last 20 steps) against the lossless run's, and the loss curves in one plot
   (``--png``, docs/_static/compress_training.png).

``--quick`` runs tiny shapes and a short training (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from benchmarks import cases as _cases
from benchmarks.harness import format_mib, table, time_interleaved

FORMATS = (None, "bf16", "fp8", "int8")

# The bars, per format: temp at 4 layers over compress=None's, per-layer growth over
# compress=None's, gradient FLOPs over compress=None's, gradient relative error.
BARS = {
    "bf16": {"temp": 0.75, "growth": 0.55, "flops": 1.05, "grad_err": 5e-3},
    "fp8": {"temp": 0.60, "growth": 0.30, "flops": 1.05, "grad_err": 4e-2},
    "int8": {"temp": 0.60, "growth": 0.30, "flops": 1.05, "grad_err": 4e-2},
}
# Training: final loss within this fraction of the lossless run's.
TRAIN_BARS = {"bf16": 0.02, "fp8": 0.04, "int8": 0.04}


@dataclasses.dataclass(frozen=True)
class Stack:
    layers: tuple[int, int] = (4, 8)
    batch: int = 8
    seq: int = 128
    d: int = 256
    heads: int = 4
    ff: int = 1024


FULL = Stack()
QUICK = Stack(layers=(2, 4), batch=2, seq=16, d=32, heads=2, ff=64)


@dataclasses.dataclass(frozen=True)
class Train:
    steps: int = 300
    layers: int = 2
    batch: int = 32
    seq: int = 32
    d: int = 64
    heads: int = 4
    ff: int = 256
    vocab: int = 32
    lr: float = 3e-3
    last: int = 20  # the final loss is the mean of the last this many steps


TRAIN = Train()
QUICK_TRAIN = Train(steps=30, batch=8, seq=16, d=32, heads=2, ff=64, last=5)


def _label(fmt: str | None) -> str:
    return "none" if fmt is None else fmt


# ------------------------------------------------------------------------------------------
# The stack.


def _layer_norm(x, scale):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale.reshape((1,) * (x.ndim - 1) + scale.shape)


def block(x, p, heads: int):
    """Pre-LN block: causal multi-head softmax attention, then a gelu MLP."""
    b, s, d = x.shape
    dh = d // heads
    h = _layer_norm(x, p["ln1"])
    qkv = (h @ p["qkv"]).reshape(b, s, 3, heads, dh)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
    causal = jnp.tril(jnp.ones((s, s), jnp.bool_))[None, None]
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d) @ p["o"]
    return x + jax.nn.gelu(_layer_norm(x, p["ln2"]) @ p["w1"]) @ p["w2"]


def make_params(key, layers: int, d: int, ff: int) -> dict[str, jax.Array]:
    keys = jax.random.split(key, 4)

    def normal(k, shape, fan_in):
        return jax.random.normal(k, (layers, *shape), jnp.float32) / math.sqrt(fan_in)

    return {
        "ln1": jnp.ones((layers, d), jnp.float32),
        "ln2": jnp.ones((layers, d), jnp.float32),
        "qkv": normal(keys[0], (d, 3 * d), d),
        "o": normal(keys[1], (d, d), d),
        "w1": normal(keys[2], (d, ff), d),
        "w2": normal(keys[3], (ff, d), ff),
    }


def stack_args(shape: Stack, layers: int):
    params = make_params(jax.random.key(2), layers, shape.d, shape.ff)
    x = jax.random.normal(jax.random.key(3), (shape.batch, shape.seq, shape.d), jnp.float32)
    return params, x


def run_stack(x, params, heads: int, compress: str | None):
    """The layers as one ``jaxmem.scan`` over the stacked params."""
    x, _ = jaxmem.scan(lambda x, p: (block(x, p, heads), None), x, params, compress=compress)
    return x


def stack_loss(heads: int, compress: str | None):
    def loss(params, x):
        return jnp.mean(run_stack(x, params, heads, compress) ** 2)

    return loss


def rel_err(got, ref) -> float:
    """Global relative norm ``||got - ref|| / ||ref||`` over every leaf."""
    num = sum(
        float(jnp.sum((a - b) ** 2))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True)
    )
    den = sum(float(jnp.sum(b**2)) for b in jax.tree.leaves(ref))
    return math.sqrt(num / den) if den else 0.0


def _flops(compiled) -> float | None:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return None if cost is None else cost.get("flops")


def _compiled_grad(loss, args):
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return grad.lower(*jax.eval_shape(lambda: args)).compile()


def measure_stack(shape: Stack, timed: bool, repeats: int) -> dict[str, Any]:
    """Section 1: the transformer stack per format (see the module docstring)."""
    rows: dict[str, dict[str, Any]] = {}
    depths = shape.layers
    for fmt in FORMATS:
        row: dict[str, Any] = {"temp": {}, "kept": {}, "flops": {}}
        for layers in depths:
            args = jax.eval_shape(lambda layers=layers: stack_args(shape, layers))
            compiled = _compiled_grad(stack_loss(shape.heads, fmt), args)
            row["temp"][layers] = compiled.memory_analysis().temp_size_in_bytes
            row["flops"][layers] = _flops(compiled)
            plan = jaxmem.scan_residuals(
                lambda x, p: (block(x, p, shape.heads), None), args[1], args[0], compress=fmt
            )
            row["kept"][layers] = plan.stacked_bytes
        rows[_label(fmt)] = row
    base = rows["none"]
    d0, d1 = depths
    args = stack_args(shape, d0)
    ref_loss, ref_grad = jax.jit(jax.value_and_grad(stack_loss(shape.heads, None), argnums=(0, 1)))(
        *args
    )
    ref_value = jax.jit(stack_loss(shape.heads, None))(*args)
    fns = {}
    for fmt in FORMATS:
        row = rows[_label(fmt)]
        row["temp_ratio"] = row["temp"][d0] / base["temp"][d0]
        row["growth"] = row["temp"][d1] - row["temp"][d0]
        row["growth_ratio"] = row["growth"] / (base["temp"][d1] - base["temp"][d0])
        row["flops_ratio"] = row["flops"][d0] / base["flops"][d0] if base["flops"][d0] else None
        vg = jax.jit(jax.value_and_grad(stack_loss(shape.heads, fmt), argnums=(0, 1)))
        loss, grad = vg(*args)
        value = jax.jit(stack_loss(shape.heads, fmt))(*args)
        row["forward_identical"] = bool(loss == ref_loss) and bool(value == ref_value)
        row["grad_err"] = rel_err(grad, ref_grad)
        fns[_label(fmt)] = vg
    if timed:
        for label, t in time_interleaved(fns, *args, repeats=repeats).items():
            rows[label]["median_s"] = t.median_s
        for row in rows.values():
            row["time_ratio"] = row["median_s"] / rows["none"]["median_s"]
    for fmt in FORMATS[1:]:
        row, bar = rows[fmt], BARS[fmt]
        row["meets"] = {
            "temp": row["temp_ratio"] <= bar["temp"],
            "growth": row["growth_ratio"] <= bar["growth"],
            "flops": row["flops_ratio"] is not None and row["flops_ratio"] <= bar["flops"],
            "grad_err": row["grad_err"] <= bar["grad_err"],
            "forward_identical": row["forward_identical"],
        }
    return {"shape": dataclasses.asdict(shape), "rows": rows}


def format_stack(res: dict[str, Any]) -> str:
    d0, d1 = res["shape"]["layers"]
    head = [
        "format",
        f"kept@{d0}",
        f"temp@{d0}",
        "x",
        f"growth/{d1 - d0}",
        "x",
        "flops x",
        "time",
        "x",
        "grad err",
        "fwd=",
        "",
    ]
    rows = []
    for label, r in res["rows"].items():
        bar = BARS.get(label, {})
        time_s = r.get("median_s")
        rows.append(
            [
                label,
                format_mib(r["kept"][d0]),
                format_mib(r["temp"][d0]),
                f"{r['temp_ratio']:.3f}x",
                format_mib(r["growth"]),
                f"{r['growth_ratio']:.3f}x",
                f"{(r['flops_ratio'] or 0):.4f}x",
                "-" if time_s is None else f"{time_s * 1e3:.1f} ms",
                f"{r.get('time_ratio', 0):.2f}x",
                f"{r['grad_err']:.2e}",
                "yes" if r["forward_identical"] else "NO",
            ]
        )
        if bar:
            met = "met: " + ", ".join(k for k, ok in r["meets"].items() if ok)
            if not all(r["meets"].values()):
                met += "; MISSED: " + ", ".join(k for k, ok in r["meets"].items() if not ok)
            rows.append(
                [
                    "  bars",
                    "",
                    "",
                    f"{bar['temp']:.2f}x",
                    "",
                    f"{bar['growth']:.2f}x",
                    f"{bar['flops']:.2f}x",
                    "",
                    "",
                    f"{bar['grad_err']:.0e}",
                    "",
                    met,
                ]
            )
    title = f"Transformer stack {res['shape']}: gradient, per format"
    return title + "\n" + table(head, rows, align="l" + "r" * 10 + "l")


# ------------------------------------------------------------------------------------------
# The design cases.


def measure_cases(names: Sequence[str]) -> dict[str, Any]:
    """Section 2: kept bytes, temp, FLOPs and gradient error per format on the design cases."""
    out = {}
    for name in names:
        case = _cases.CASES[name]
        args = case.make_args()
        argnums = case.argnums()
        ref = None
        rows = {}
        for fmt in FORMATS:
            scan = functools.partial(jaxmem.scan, compress=fmt)
            loss = case.make_loss(scan)
            grad = jax.jit(jax.grad(loss, argnums=argnums))
            compiled = grad.lower(*case.abstract_args()).compile()
            report = jaxmem.profile(loss, *case.abstract_args())
            g = compiled(*args)
            ref = g if fmt is None else ref
            rows[_label(fmt)] = {
                "kept": sum(p.stacked_bytes for p in report.scan_plans),
                "temp": compiled.memory_analysis().temp_size_in_bytes,
                "flops": _flops(compiled),
                "grad_err": rel_err(g, ref),
            }
        out[name] = rows
    return out


def format_cases(res: dict[str, Any]) -> str:
    rows = []
    for name, by_format in res.items():
        base = by_format["none"]
        for label, r in by_format.items():
            flops = r["flops"] / base["flops"] if base["flops"] else float("nan")
            rows.append(
                [
                    name,
                    label,
                    format_mib(r["kept"]),
                    format_mib(r["temp"]),
                    f"{r['temp'] / base['temp']:.3f}x",
                    f"{flops:.4f}x",
                    f"{r['grad_err']:.2e}",
                ]
            )
    head = ["case", "format", "kept", "temp", "x", "flops x", "grad err"]
    title = "Design cases: gradient, per format (ratios against compress=None)"
    return title + "\n" + table(head, rows, align="ll")


# ------------------------------------------------------------------------------------------
# Training.


def copy_batch(key, cfg: Train) -> jax.Array:
    """Sequences whose second half repeats the first (random tokens)."""
    half = jax.random.randint(key, (cfg.batch, cfg.seq // 2), 0, cfg.vocab)
    return jnp.concatenate([half, half], axis=1)


def gpt_params(key, cfg: Train) -> dict[str, Any]:
    k_emb, k_pos, k_stack = jax.random.split(key, 3)
    return {
        "emb": jax.random.normal(k_emb, (cfg.vocab, cfg.d), jnp.float32) * 0.02,
        "pos": jax.random.normal(k_pos, (cfg.seq, cfg.d), jnp.float32) * 0.02,
        "stack": make_params(k_stack, cfg.layers, cfg.d, cfg.ff),
        "ln": jnp.ones((cfg.d,), jnp.float32),
    }


def gpt_loss(params, tokens, cfg: Train, compress: str | None):
    """Next-token cross-entropy over every position (the first half's is irreducible)."""
    x = params["emb"][tokens[:, :-1]] + params["pos"][None, : cfg.seq - 1]
    x = run_stack(x, params["stack"], cfg.heads, compress)
    logits = _layer_norm(x, params["ln"]) @ params["emb"].T
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = tokens[:, 1:]
    return -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))


def train(cfg: Train, compress: str | None) -> list[float]:
    """The loss at every step of adamw on fresh copy batches (same seeds for every format)."""
    import optax

    opt = optax.adamw(cfg.lr, weight_decay=0.01)
    params = gpt_params(jax.random.key(0), cfg)
    state = opt.init(params)

    @jax.jit
    def step(params, state, key):
        loss, grads = jax.value_and_grad(gpt_loss)(params, copy_batch(key, cfg), cfg, compress)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for key in jax.random.split(jax.random.key(1), cfg.steps):
        params, state, loss = step(params, state, key)
        losses.append(float(loss))
    return losses


def measure_training(cfg: Train) -> dict[str, Any]:
    curves = {_label(fmt): train(cfg, fmt) for fmt in FORMATS}
    final = {label: float(np.mean(c[-cfg.last :])) for label, c in curves.items()}
    base = final["none"]
    rows = {}
    for label, loss in final.items():
        rows[label] = {"final": loss, "ratio": loss / base, "first": curves[label][0]}
        if label in TRAIN_BARS:
            rows[label]["meets"] = abs(loss / base - 1) <= TRAIN_BARS[label]
    # The floor: the targets in the first half (all but its first token) are random (log vocab
    # each), those of the second half are determined (0): a model that learns the copy reaches
    # about half of log(vocab).
    floor = math.log(cfg.vocab) * (cfg.seq // 2 - 1) / (cfg.seq - 1)
    return {"config": dataclasses.asdict(cfg), "floor": floor, "rows": rows, "curves": curves}


def format_training(res: dict[str, Any]) -> str:
    cfg = res["config"]
    rows = []
    for label, r in res["rows"].items():
        bar = TRAIN_BARS.get(label)
        rows.append(
            [
                label,
                f"{r['first']:.3f}",
                f"{r['final']:.4f}",
                f"{r['ratio']:.4f}x",
                "" if bar is None else f"±{bar:.0%}",
                "" if bar is None else ("met" if r["meets"] else "MISSED"),
            ]
        )
    title = (
        f"Training: small GPT on the copy task, {cfg['steps']} steps of adamw; final loss = mean "
        f"of the last {cfg['last']} (floor {res['floor']:.3f}, log(vocab) = "
        f"{math.log(cfg['vocab']):.3f})"
    )
    head = ["format", "first", "final", "x", "bar", ""]
    return title + "\n" + table(head, rows, align="lrrrrl")


def plot_training(res: dict[str, Any]):
    """The loss curves per format (top) and each format's loss minus the lossless run's at the
    same step (bottom), one ``matplotlib.figure.Figure``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 5.5), dpi=120, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    base = np.asarray(res["curves"]["none"])
    for i, (label, curve) in enumerate(res["curves"].items()):
        steps, color = np.arange(1, len(curve) + 1), f"C{i}"
        top.plot(steps, curve, label=label, linewidth=1, color=color)
        if label != "none":
            bottom.plot(steps, np.asarray(curve) - base, label=label, linewidth=1, color=color)
    top.axhline(res["floor"], color="gray", linestyle=":", linewidth=1, label="floor")
    cfg = res["config"]
    top.set_title(f"Small GPT, copy task, {cfg['steps']} steps of adamw: loss by compress format")
    top.set_ylabel("cross-entropy")
    top.legend(loc="upper right")
    bottom.axhline(0, color="gray", linewidth=0.5)
    bottom.set_xlabel("step")
    bottom.set_ylabel("minus lossless")
    bottom.legend(loc="lower right", ncols=3)
    return fig


# ------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compress", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    parser.add_argument("--no-time", action="store_true", help="skip the step times")
    parser.add_argument("--no-train", action="store_true", help="skip the training run")
    parser.add_argument("--no-cases", action="store_true", help="skip the design cases")
    parser.add_argument("--steps", type=int, default=None, help="training steps")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per format")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--png", type=pathlib.Path, default=None, help="the training plot")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    cfg = QUICK_TRAIN if args.quick else TRAIN
    if args.steps:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    repeats = args.repeats or (3 if args.quick else 11)
    out: dict[str, Any] = {"jax": jax.__version__, "backend": jax.default_backend()}
    print(f"jax {jax.__version__} on {jax.default_backend()}")
    out["stack"] = measure_stack(shape, not args.no_time, repeats)
    print(format_stack(out["stack"]), "\n", flush=True)
    if not args.no_cases:
        names = ["rnn_ys"] if args.quick else list(_cases.CASES)
        out["cases"] = measure_cases(names)
        print(format_cases(out["cases"]), "\n", flush=True)
    if not args.no_train:
        out["training"] = measure_training(cfg)
        print(format_training(out["training"]), flush=True)
        if args.png:
            args.png.parent.mkdir(parents=True, exist_ok=True)
            plot_training(out["training"]).savefig(args.png)
            print(f"wrote {args.png}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
