"""``jaxmem.optimize(train_step, budget=...)`` against a framework's own remat policies.

``python -m benchmarks.budget [--model gpt|nnx|equinox] [--quick] [--sizes k=v,...] [--rounds N]
[--json PATH] [--plot PATH]`` measures a GPT train step written the way each model's users
write it, the layer stack's body under full remat (``nothing_saveable``, the default of most
frameworks) and an SGD-momentum update in one jitted step: ``gpt``, plain JAX (``lax.scan``
over stacked parameters, ``jax.checkpoint``, ``jax.value_and_grad``); ``nnx``, Flax NNX
(``nnx.vmap`` init, ``nnx.scan`` over ``nnx.remat``, ``nnx.value_and_grad``); ``equinox``
(``eqx.filter_vmap`` init, ``lax.scan`` over ``eqx.filter_checkpoint``,
``eqx.filter_value_and_grad``). The same blocks and attention in each.

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
import functools
import json
import pathlib
import textwrap
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from benchmarks import harness
from benchmarks.harness import compiled_flops, format_mib, time_interleaved

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


def _attention(q, k, v, heads: int):
    """Causal softmax attention of ``[b, t, d]`` projections, the same in every model."""
    b, t, d = q.shape
    split = lambda a: a.reshape(b, t, heads, d // heads)
    s = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / (d // heads) ** 0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None, None], s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), split(v)).reshape(b, t, d)


def _cross_entropy(logits, tokens):
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1))


def _sgd_momentum(params, momentum, grads):
    momentum = jax.tree.map(lambda m, g: 0.9 * m + g, momentum, grads)
    return jax.tree.map(lambda p, m: p - 1e-2 * m, params, momentum), momentum


def make_step(
    sizes: Sizes, policy=cp.nothing_saveable, *, remat: bool = True, model="gpt", wrap=None
):
    """The train step: ``(params, momentum, tokens) -> (loss, params, momentum)``. ``policy``:
    the body's ``jax.checkpoint`` policy; ``remat=False``: no ``jax.checkpoint``. ``model``:
    one of :data:`MODELS`. ``wrap``: applied to the loss the step differentiates (e.g.
    ``jaxmem.optimize``: the step written around ``optimize(loss)``)."""
    return MODELS[model][0](sizes, policy if remat else None, wrap or (lambda f: f))


def make_args(sizes: Sizes, seed: int = 0, model="gpt"):
    """Parameters, zero momentum and a batch of tokens."""
    params = MODELS[model][1](sizes, seed)
    momentum = jax.tree.map(jnp.zeros_like, params)
    tokens = jax.random.randint(jax.random.key(seed + 1), (sizes.batch, sizes.seq), 0, sizes.vocab)
    return params, momentum, tokens


def _gpt_step(sizes: Sizes, policy, wrap):
    """Plain JAX: ``lax.scan`` over stacked parameters, the body under ``jax.checkpoint``."""

    def block(x, p):
        q, k, v = jnp.split(_norm(x, p["g1"]) @ p["qkv"], 3, -1)
        x = x + _attention(q, k, v, sizes.heads) @ p["o"]
        return x + jax.nn.gelu(_norm(x, p["g2"]) @ p["up"]) @ p["down"]

    body = lambda x, p: (block(x, p), None)
    if policy is not None:
        body = jax.checkpoint(body, policy=policy)

    def loss(params, tokens):
        x = params["emb"][tokens]
        x, _ = jax.lax.scan(body, x, params["blocks"])
        return _cross_entropy(x @ params["emb"].T, tokens)

    def train_step(params, momentum, tokens):
        value, grads = jax.value_and_grad(wrap(loss))(params, tokens)
        return value, *_sgd_momentum(params, momentum, grads)

    return train_step


def _gpt_params(sizes: Sizes, seed: int):
    L, d, v = sizes.layers, sizes.d, sizes.vocab
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    n = lambda *s: jax.random.normal(next(keys), s) * 0.02
    return {
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


@functools.lru_cache
def _nnx_model(sizes: Sizes, seed: int):
    """Flax NNX: the blocks made by ``nnx.vmap`` (one stacked module); the graph and the
    parameters' state (one per sizes and seed: the step's graph is the parameters')."""
    from flax import nnx

    d = sizes.d

    class Block(nnx.Module):
        def __init__(self, rngs):
            linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
            self.norm1, self.norm2 = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)
            self.qkv, self.o = linear(d, 3 * d), linear(d, d)
            self.up, self.down = linear(d, 4 * d), linear(4 * d, d)

        def __call__(self, x):
            q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, -1)
            x = x + self.o(_attention(q, k, v, sizes.heads))
            return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    class GPT(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(sizes.vocab, d, rngs=rngs)

            @nnx.split_rngs(splits=sizes.layers)
            @nnx.vmap(in_axes=0, out_axes=0)
            def blocks(rngs):
                return Block(rngs)

            self.blocks = blocks(rngs)

    return nnx.split(GPT(nnx.Rngs(seed)))


def _nnx_step(sizes: Sizes, policy, wrap):
    """``nnx.scan`` over the stacked blocks under ``nnx.remat``, ``nnx.value_and_grad``."""
    from flax import nnx

    graphdef, _ = _nnx_model(sizes, 0)  # make_args' seed 0

    def loss(model, tokens):
        body = lambda x, block: block(x)
        if policy is not None:
            body = nnx.remat(body, policy=policy)
        x = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(
            model.emb(tokens), model.blocks
        )
        return _cross_entropy(model.emb.attend(x), tokens)

    def train_step(state, momentum, tokens):
        value, grads = nnx.value_and_grad(wrap(loss))(nnx.merge(graphdef, state), tokens)
        return value, *_sgd_momentum(state, momentum, grads)

    return train_step


@functools.lru_cache
def _equinox_model(sizes: Sizes, seed: int):
    """Equinox: per-sequence modules, the blocks made by ``eqx.filter_vmap``; the model's
    arrays and the rest (one per sizes and seed: the step's static part is the arrays')."""
    import equinox as eqx

    d = sizes.d

    class Block(eqx.Module):
        norm1: eqx.nn.RMSNorm
        norm2: eqx.nn.RMSNorm
        qkv: eqx.nn.Linear
        o: eqx.nn.Linear
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k = jax.random.split(key, 4)
            self.norm1, self.norm2 = eqx.nn.RMSNorm(d), eqx.nn.RMSNorm(d)
            self.qkv = eqx.nn.Linear(d, 3 * d, use_bias=False, key=k[0])
            self.o = eqx.nn.Linear(d, d, use_bias=False, key=k[1])
            self.up = eqx.nn.Linear(d, 4 * d, use_bias=False, key=k[2])
            self.down = eqx.nn.Linear(4 * d, d, use_bias=False, key=k[3])

        def __call__(self, x):  # one sequence, [t, d]
            tokens = lambda f, a: jax.vmap(f)(a)
            q, k, v = jnp.split(tokens(self.qkv, tokens(self.norm1, x)), 3, -1)
            x = x + tokens(self.o, _attention(q[None], k[None], v[None], sizes.heads)[0])
            mlp = lambda a: self.down(jax.nn.gelu(self.up(self.norm2(a))))
            return x + tokens(mlp, x)

    class GPT(eqx.Module):
        emb: eqx.nn.Embedding
        blocks: Block

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            # Scaled as the others' (N(0, 1) would make the tied logits one-hot: loss 0).
            self.emb = eqx.nn.Embedding(weight=jax.random.normal(k1, (sizes.vocab, d)) * 0.02)
            self.blocks = eqx.filter_vmap(Block)(jax.random.split(k2, sizes.layers))

    return eqx.partition(GPT(jax.random.key(seed)), eqx.is_array)


def _equinox_step(sizes: Sizes, policy, wrap):
    """``lax.scan`` over the stacked blocks' arrays under ``eqx.filter_checkpoint``,
    ``eqx.filter_value_and_grad``."""
    import equinox as eqx

    _, static = _equinox_model(sizes, 0)  # make_args' seed 0

    def loss(model, tokens):
        block_static = static.blocks

        def body(x, p):
            return jax.vmap(eqx.combine(p, block_static))(x), None

        if policy is not None:
            body = eqx.filter_checkpoint(body, policy=policy)
        x = jax.vmap(jax.vmap(model.emb))(tokens)
        x, _ = jax.lax.scan(body, x, eqx.filter(model.blocks, eqx.is_array))
        return _cross_entropy(x @ model.emb.weight.T, tokens)

    def train_step(params, momentum, tokens):
        model = eqx.combine(params, static)
        value, grads = eqx.filter_value_and_grad(wrap(loss))(model, tokens)
        return value, *_sgd_momentum(params, momentum, eqx.filter(grads, eqx.is_array))

    return train_step


# Each model as its users write it: (make the step at a policy, make the parameters).
MODELS = {
    "gpt": (_gpt_step, _gpt_params),
    "nnx": (_nnx_step, lambda sizes, seed: _nnx_model(sizes, seed)[1]),
    "equinox": (_equinox_step, lambda sizes, seed: _equinox_model(sizes, seed)[0]),
}


def compiled_figures(fn, args) -> tuple[int, float, object]:
    """Peak bytes and FLOPs of ``jax.jit(fn)`` compiled in full at ``args``, and the program."""
    comp = jax.jit(fn).lower(*args).compile()
    return jaxmem.peak_bytes(comp), compiled_flops(comp), comp


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


def measure(sizes: Sizes, rounds: int, model: str = "gpt") -> dict:
    args = make_args(sizes, model=model)
    default = make_step(sizes, model=model)
    want = jax.jit(default)(*args)
    policies = {}
    for label, policy in POLICIES.items():
        fn = make_step(sizes, policy, remat=policy is not None, model=model)
        peak, flops, comp = compiled_figures(fn, args)
        policies[label] = dict(peak=peak, flops=flops, program=comp)
    spread = max(largest_error(p["program"](*args), want) for p in policies.values())
    lean, planning = harness.wall_seconds(  # the other budgets reuse its compiles
        lambda: jaxmem.optimize(default, budget=2**62).budget_plan(*args)
    )
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
    screen = time_interleaved({k: p["program"] for k, p in fits.items()}, *args, repeats=3)
    fastest = min(screen, key=lambda k: screen[k].median_s)
    paired = time_interleaved(  # A A B B: each timed run after an untimed one of its own
        {"ours": comp, "theirs": fits[fastest]["program"]}, *args, repeats=rounds
    )
    ours, theirs = paired["ours"].median_s, paired["theirs"].median_s
    timed = dict(
        budget=b, chosen=plan.chosen.key, peak=peak, seconds=ours, fastest_policy=fastest,
        fastest_seconds=theirs, ratio=ours / theirs,
    )  # fmt: skip
    # The frontier: each policy's and each plan's step time.
    frontier = [*policies.values(), *plans]
    times = time_interleaved({i: p["program"] for i, p in enumerate(frontier)}, *args, repeats=5)
    for i, p in enumerate(frontier):
        p["seconds"] = times[i].median_s
    for p in [*policies.values(), *plans]:
        del p["program"]
    return dict(
        jax=jax.__version__,
        model=model,
        backend=jax.default_backend(),
        sizes=dataclasses.asdict(sizes),
        policies=policies,
        policy_spread=spread,
        lean_no_remat_peak=lean_peak,
        planning_s=planning,
        plans=plans,
        time=timed,
    )


def table(result: dict) -> str:
    policies = [
        [k, format_mib(p["peak"]), f"{p['flops'] / 1e9:.3f}", f"{p['seconds'] * 1e3:.2f} ms"]
        for k, p in result["policies"].items()
    ]
    plans = []
    for p in result["plans"]:
        least = p["least_policy_flops"]
        plans.append(
            [
                format_mib(p["budget"]),
                p["chosen"],
                format_mib(p["peak"]),
                f"{p['flops'] / 1e9:.3f}",
                f"{p['flops'] / least:.4f}x" if least else "n/a (no policy fits)",
                f"{p['seconds'] * 1e3:.2f} ms",
                f"{p['error']:.1e}",
            ]
        )
    plans_head = ["B", "chosen", "peak", "GFLOPs", "/ least-FLOPs policy that fits", "time", "err"]
    t = result["time"]
    lines = [
        f"{result['model']}: jax {result['jax']} ({result['backend']}), {result['sizes']}",
        "framework policies:",
        textwrap.indent(harness.table(["policy", "peak", "GFLOPs", "time"], policies), "  "),
        f"  (their outputs differ from the default's by {result['policy_spread']:.1e})",
        "optimize(step, budget=B):",
        textwrap.indent(harness.table(plans_head, plans, align="rl"), "  "),
        f"  planned in {result['planning_s']:.1f} s (first trace; other budgets reuse it)",
        f'objective="time", B {format_mib(t["budget"])}: {t["chosen"]}, peak '
        f"{format_mib(t['peak'])}, {t['seconds'] * 1e3:.2f} ms vs {t['fastest_policy']} "
        f"{t['fastest_seconds'] * 1e3:.2f} ms: {t['ratio']:.3f}x",
    ]
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
    title = f"{result['model']} train step, jax {result['jax']} ({result['backend']})"
    ax.set_title(f"{title}; dotted: budgets")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.budget", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--rounds", type=int, default=11, help="paired rounds of the time bar")
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt", help="the model")
    parser.add_argument(
        "--sizes", default="", help="overrides of the sizes, e.g. 'batch=2,seq=512' (Sizes' fields)"
    )
    parser.add_argument("--json", type=pathlib.Path, help="write every figure to this file")
    parser.add_argument("--plot", type=pathlib.Path, help="draw the frontier to this file")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    try:
        given = dict(kv.split("=") for kv in args.sizes.split(",") if kv)
        sizes = dataclasses.replace(sizes, **{k: int(v) for k, v in given.items()})
    except (TypeError, ValueError) as e:
        parser.error(f"--sizes {args.sizes!r}: {e}")
    result = measure(sizes, 3 if args.quick else args.rounds, args.model)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
