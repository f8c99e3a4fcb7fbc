"""``jaxmem.optimize(train_step, budget=...)`` against a framework's own remat policies.

``python -m benchmarks.budget [--quick] [--rounds N] [--json PATH] [--plot PATH]`` measures a
plain-JAX GPT train step written the way its users write it: ``lax.scan`` over stacked layer
parameters, the body under ``jax.checkpoint(policy=nothing_saveable)`` (full remat, the default
of most frameworks), ``jax.value_and_grad`` and an SGD-momentum update in one jitted step.

1. The framework's own policies (``jax.checkpoint_policies``: full remat, ``dots_saveable``,
   ``dots_with_no_batch_dims_saveable``, no remat): the compiled step's peak (temp + arguments +
   outputs - aliased, ``memory_analysis``) and FLOPs (``cost_analysis``).
2. ``optimize(step, budget=B)`` at budgets from the leanest policy's peak to no remat's, and one
   just above jaxmem's lean no-remat peak: the peak of ``jax.jit`` of it (compiled in full),
   its FLOPs, against the fewest FLOPs among the policies that fit ``B``; its loss and new
   parameters against stock's.
3. ``objective="time"`` at twice the default policy's peak: step time against the fastest
   policy that fits, interleaved (A A B B) over ``--rounds`` paired rounds.
4. ``--plot``: step time against peak (the frontier): the policies and the plans.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from benchmarks.harness import format_mib
from jaxmem._src.optimize.budget import peak_bytes
from jaxmem._src.remat.flops import _flops as flops_of

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: int = 4
    d: int = 256
    seq: int = 128
    batch: int = 8
    heads: int = 4
    vocab: int = 512


FULL = Sizes()
QUICK = Sizes(layers=3, d=64, seq=32, batch=4, heads=2, vocab=128)

# The framework's own choices: jax.checkpoint_policies, the default first.
cp = jax.checkpoint_policies
POLICIES = {
    "full remat (default)": cp.nothing_saveable,
    "dots_saveable": cp.dots_saveable,
    "dots_with_no_batch_dims_saveable": cp.dots_with_no_batch_dims_saveable,
    "no remat": None,
}


def _norm(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g[None, None]


def make_step(sizes: Sizes, policy=cp.nothing_saveable, *, remat: bool = True):
    """The train step: ``(params, momentum, tokens) -> (loss, params, momentum)``. ``policy``:
    the body's ``jax.checkpoint`` policy; ``remat=False``: no ``jax.checkpoint``."""
    d, h = sizes.d, sizes.heads

    def block(x, p):
        b, t, _ = x.shape
        q, k, v = jnp.split(_norm(x, p["g1"]) @ p["qkv"], 3, -1)
        split = lambda a: a.reshape(b, t, h, d // h)
        s = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / (d // h) ** 0.5
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None, None], s, -1e9)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), split(v)).reshape(b, t, d)
        x = x + a @ p["o"]
        return x + jax.nn.gelu(_norm(x, p["g2"]) @ p["up"]) @ p["down"]

    body = lambda x, p: (block(x, p), None)
    if remat:
        body = jax.checkpoint(body, policy=policy)

    def loss(params, tokens):
        x = params["emb"][tokens]
        x, _ = jax.lax.scan(body, x, params["blocks"])
        logits = x @ params["emb"].T
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1))

    def train_step(params, momentum, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        momentum = jax.tree.map(lambda m, g: 0.9 * m + g, momentum, grads)
        params = jax.tree.map(lambda p, m: p - 1e-2 * m, params, momentum)
        return value, params, momentum

    return train_step


def make_args(sizes: Sizes, seed: int = 0):
    """Parameters, zero momentum and a batch of tokens."""
    L, d, v = sizes.layers, sizes.d, sizes.vocab
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    n = lambda *s: jax.random.normal(next(keys), s) * 0.02
    params = {
        "emb": n(v, d),
        "blocks": {
            "qkv": n(L, d, 3 * d),
            "o": n(L, d, d),
            "up": n(L, d, 4 * d),
            "down": n(L, 4 * d, d),
            "g1": jnp.ones((L, d)),
            "g2": jnp.ones((L, d)),
        },
    }
    momentum = jax.tree.map(jnp.zeros_like, params)
    tokens = jax.random.randint(next(keys), (sizes.batch, sizes.seq), 0, v)
    return params, momentum, tokens


def compiled_figures(fn, args) -> tuple[int, float, object]:
    """Peak bytes and FLOPs of ``jax.jit(fn)`` compiled in full at ``args``, and the program."""
    comp = jax.jit(fn).lower(*args).compile()
    return peak_bytes(comp), flops_of(comp), comp


def largest_error(a, b) -> float:
    """The largest absolute difference over the leaves, over the largest magnitude."""
    err = scale = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        err = max(err, float(np.abs(x - y).max()))
        scale = max(scale, float(np.abs(y).max()))
    return err / max(scale, 1.0)


def budgets(policies: dict, lean_peak: int) -> list[int]:
    """Four budgets from the leanest policy's peak to no remat's, and one just above jaxmem's
    lean no-remat peak."""
    lo = min(p["peak"] for p in policies.values())
    hi = policies["no remat"]["peak"]
    out = [int(lo + (hi - lo) * f) for f in (0.0, 1 / 3, 2 / 3, 1.0)]
    return sorted({*out, int(lean_peak * 1.01)})


def _paired_times(fa, fb, args, rounds: int) -> tuple[float, float]:
    """Median seconds of two compiled programs, A A B B in each round after a warm run."""
    ta, tb = [], []
    jax.block_until_ready(fa(*args))
    jax.block_until_ready(fb(*args))
    for _ in range(rounds):
        for f, out in ((fa, ta), (fa, ta), (fb, tb), (fb, tb)):
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            out.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


def measure(sizes: Sizes, rounds: int) -> dict:
    args = make_args(sizes)
    default = make_step(sizes)
    want = jax.jit(default)(*args)
    policies = {}
    for label, policy in POLICIES.items():
        fn = make_step(sizes, policy, remat=policy is not None)
        peak, flops, comp = compiled_figures(fn, args)
        policies[label] = dict(peak=peak, flops=flops, program=comp)
    spread = max(largest_error(p["program"](*args), want) for p in policies.values())
    t = time.perf_counter()
    lean = jaxmem.optimize(default, budget=2**62).budget_plan(*args)
    planning = time.perf_counter() - t  # the other budgets reuse its compiles
    lean_peak = next(t.peak_bytes for t in lean.trials if t.key == "lean, no remat")
    plans, programs = [], {}  # the chosen setting -> jax.jit(optimized) compiled in full
    for b in budgets(policies, lean_peak):
        opt = jaxmem.optimize(default, budget=b)
        plan = opt.budget_plan(*args)
        if plan.chosen.key not in programs:
            programs[plan.chosen.key] = compiled_figures(opt, args)
        peak, flops, comp = programs[plan.chosen.key]
        fit = [p["flops"] for p in policies.values() if p["peak"] <= b]
        plans.append(
            dict(
                budget=b,
                chosen=plan.chosen.key,
                peak=peak,
                flops=flops,
                least_policy_flops=min(fit) if fit else None,
                error=largest_error(comp(*args), want),
                program=comp,
            )
        )
    # objective="time" at twice the default's peak.
    b = 2 * policies["full remat (default)"]["peak"]
    opt = jaxmem.optimize(default, budget=b, objective="time")
    plan = opt.budget_plan(*args)
    peak, flops, comp = compiled_figures(opt, args)
    fits = {k: p for k, p in policies.items() if p["peak"] <= b}
    times = {k: statistics.median([_time_one(p["program"], args) for _ in range(3)])
             for k, p in fits.items()}  # fmt: skip
    fastest = min(times, key=times.get)
    ours, theirs = _paired_times(comp, fits[fastest]["program"], args, rounds)
    timed = dict(
        budget=b, chosen=plan.chosen.key, peak=peak, seconds=ours, fastest_policy=fastest,
        fastest_seconds=theirs, ratio=ours / theirs,
    )  # fmt: skip
    # The frontier: each policy's and each plan's step time.
    for p in [*policies.values(), *plans]:
        p["seconds"] = statistics.median([_time_one(p["program"], args) for _ in range(5)])
    for p in [*policies.values(), *plans]:
        del p["program"]
    return dict(
        jax=jax.__version__,
        backend=jax.default_backend(),
        sizes=dataclasses.asdict(sizes),
        policies=policies,
        policy_spread=spread,
        lean_no_remat_peak=lean_peak,
        planning_s=planning,
        plans=plans,
        time=timed,
    )


def _time_one(f, args) -> float:
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t


def table(result: dict) -> str:
    lines = [
        f"jax {result['jax']} ({result['backend']}), {result['sizes']}",
        "framework policies:",
    ]
    for k, p in result["policies"].items():
        lines.append(
            f"  {k:34s} peak {format_mib(p['peak']):>12s}  {p['flops'] / 1e9:7.3f} GFLOPs  "
            f"{p['seconds'] * 1e3:8.2f} ms"
        )
    lines.append(f"  (their outputs differ from the default's by {result['policy_spread']:.1e})")
    lines.append("optimize(step, budget=B):")
    for p in result["plans"]:
        least = p["least_policy_flops"]
        ratio = f"{p['flops'] / least:.4f}x" if least else "n/a (no policy fits)"
        lines.append(
            f"  B {format_mib(p['budget']):>12s}: {p['chosen']:34s} peak {format_mib(p['peak'])}"
            f"  {p['flops'] / 1e9:7.3f} GFLOPs ({ratio} the least-FLOPs policy that fits)  "
            f"{p['seconds'] * 1e3:8.2f} ms  err {p['error']:.1e}"
        )
    lines.append(f"  planned in {result['planning_s']:.1f} s (first trace; other budgets reuse it)")
    t = result["time"]
    lines.append(
        f'objective="time", B {format_mib(t["budget"])}: {t["chosen"]}, peak '
        f"{format_mib(t['peak'])}, {t['seconds'] * 1e3:.2f} ms vs {t['fastest_policy']} "
        f"{t['fastest_seconds'] * 1e3:.2f} ms: {t['ratio']:.3f}x"
    )
    return "\n".join(lines)


def plot(result: dict, path: pathlib.Path) -> None:
    """Step time against peak: the framework's policies and the budget's plans."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    ax = fig.subplots()
    for k, p in result["policies"].items():
        ax.scatter(p["peak"] / MiB, p["seconds"] * 1e3, marker="s", color="tab:orange")
        ax.annotate(k, (p["peak"] / MiB, p["seconds"] * 1e3), xytext=(5, 4),
                    textcoords="offset points", fontsize=8)  # fmt: skip
    xs = [p["peak"] / MiB for p in result["plans"]]
    ys = [p["seconds"] * 1e3 for p in result["plans"]]
    ax.scatter(xs, ys, marker="*", s=120, color="tab:blue", label="optimize(step, budget=B)")
    for p in result["plans"]:
        ax.axvline(p["budget"] / MiB, color="tab:blue", ls=":", lw=0.6)
    ax.set_xlabel("compiled step peak (MiB: temp + arguments + outputs - aliased)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"GPT train step, jax {result['jax']} ({result['backend']}); dotted: budgets")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.budget", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--rounds", type=int, default=11, help="paired rounds of the time bar")
    parser.add_argument("--json", type=pathlib.Path, help="write every figure to this file")
    parser.add_argument("--plot", type=pathlib.Path, help="draw the frontier to this file")
    args = parser.parse_args(argv)
    result = measure(QUICK if args.quick else FULL, 3 if args.quick else args.rounds)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
