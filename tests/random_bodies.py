"""Random scan bodies for the memory property tests: small programs of ops on [B, D] values,
drawn from a seed, built as a step and a loss for either scan, and the bound they are held to::

    jaxmem_temp <= SLACK_RATIO * stock_temp + SLACK_BYTES

(``tests/scan/test_scan_memory.py`` says what the bodies vary and why the shapes are what they are;
``tests/scan/test_scan_unrolled.py`` runs them unrolled.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from jaxmem._src.jax_compat import compile_to_measure

N_BODIES = 200
SLACK_RATIO = 1.02
SLACK_BYTES = 16 * 1024

f32, bf16 = jnp.float32, jnp.bfloat16

# ------------------------------------------------------------------------------------------
# Bodies: a list of ops, each making a new [B, D] value from earlier ones.

# One-input ops (on an earlier value) and two-input ops (on two earlier values).
UNARY_OPS = (
    "dot_w",  # v @ w, w [D, D] closed over
    "dot_wt",  # v @ w.T (JAX stacks the transposed weight per step, docs/design.md §1)
    "dot_w2",  # v @ w2, a second closed-over weight
    "tanh",
    "sin",
    "exp_tanh",  # exp of a bounded input
    "sigmoid",
    "leaky",  # where(v > 0, v, 0.1 v)
    "square",
    "softmax",  # over the last axis
    "layernorm",
    "scale_bias",  # v * g + b, g and b [D] closed over
    "bf16_tanh",  # tanh computed in bf16, cast back to f32
    "roll",  # slicing + concatenation back to the same shape
    "counter",  # + 0.1 * the int counter of the carry (bodies with a counter only)
)
BINARY_OPS = ("mul", "add", "sub", "mul_tanh")  # a * b, a + b, a - b, a * tanh(b)
YS_KINDS = ("none", "carry", "carry_in", "x", "inter", "pair", "second")
# "weighted": the final carry squared plus the ys times fixed (constant) weights.
LOSS_KINDS = ("ys", "final", "both", "ys_first", "final_first", "weighted")
# Remat presets as jax.checkpoint_policies objects; the stock equivalent of
# jaxmem.scan(step, policy=p) is lax.scan over jax.checkpoint(step, policy=p).
POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything": jax.checkpoint_policies.everything_saveable,
}


@dataclasses.dataclass(frozen=True)
class Body:
    """A random scan step and the loss around it.

    ``ops[k] = (name, i, j)`` makes value ``3 + k`` from values ``i`` (and ``j`` for binary ops);
    values 0, 1, 2 are the carry-in ``h``, the xs slice ``x`` and the second carry leaf ``c``
    (bodies with ``two_carry``; else 2 is ``h`` again). The new ``h`` is the last value; the new
    ``c`` is value ``c_from``.
    """

    seed: int
    t: int  # steps
    b: int
    d: int
    ops: tuple[tuple[str, int, int], ...]
    two_carry: bool
    c_from: int
    counter: bool
    ys: str
    ys_at: int  # which value, for ys in ("inter", "pair")
    loss: str
    reverse: bool
    unroll: int
    policy: str | None  # a key of POLICIES: each step under jax.checkpoint(policy=...)
    prevent_cse: bool  # the stock equivalent's jax.checkpoint(prevent_cse=...), with a policy
    value: bool  # jax.value_and_grad (as a training step) rather than jax.grad

    def __str__(self) -> str:
        names = ["h", "x", "c" if self.two_carry else "h"]
        lines = []
        for k, (op, i, j) in enumerate(self.ops):
            args = names[i] if op in UNARY_OPS else f"{names[i]}, {names[j]}"
            lines.append(f"  v{k + 3} = {op}({args})")
            names.append(f"v{k + 3}")
        carry = f"(h={names[-1]}, c={names[self.c_from]})" if self.two_carry else names[-1]
        return (
            f"Body(seed={self.seed}, T={self.t}, B={self.b}, D={self.d}, "
            f"reverse={self.reverse}, unroll={self.unroll}, counter={self.counter}, "
            f"policy={self.policy}, prevent_cse={self.prevent_cse}, "
            f"{'value_and_grad' if self.value else 'grad'})\n"
            + "\n".join(lines)
            + f"\n  carry out {carry}; ys {self.ys}"
            + (f"@v{self.ys_at}" if self.ys in ("inter", "pair") else "")
            + f"; loss {self.loss}"
        )


def draw_body(seed: int) -> Body:
    rng = np.random.RandomState(seed)
    counter = rng.rand() < 0.2
    two_carry = rng.rand() < 0.35
    n_ops = rng.randint(1, 7)
    unary = UNARY_OPS if counter else tuple(op for op in UNARY_OPS if op != "counter")
    ops = []
    for k in range(n_ops):
        n_vals = 3 + k
        # Inputs lean towards recent values, so bodies are chains with side branches.
        i = int(rng.choice([n_vals - 1, rng.randint(0, n_vals)])) if k else int(rng.randint(0, 3))
        j = int(rng.randint(0, n_vals))
        op = str(rng.choice(BINARY_OPS)) if rng.rand() < 0.3 else str(rng.choice(unary))
        ops.append((op, i, j))
    n_vals = 3 + n_ops
    # Lengths with and without a remainder for each unroll (21 = 2 * 10 + 1 = 4 * 5 + 1).
    t, unroll = int(rng.choice([7, 16, 21, 24, 29, 32])), int(rng.choice([1, 1, 2, 2, 3, 4]))
    return Body(
        seed=seed,
        t=t,
        b=int(rng.choice([16, 32])),
        d=int(rng.choice([64, 96, 128])),
        ops=tuple(ops),
        two_carry=two_carry,
        c_from=int(rng.randint(0, n_vals)),
        counter=counter,
        ys=str(rng.choice(YS_KINDS)),
        ys_at=int(rng.randint(3, n_vals)),
        loss=str(rng.choice(LOSS_KINDS)),
        reverse=bool(rng.rand() < 0.25),
        unroll=unroll,
        policy=None if rng.rand() < 0.6 else str(rng.choice(list(POLICIES))),
        # jax.checkpoint's default (True) is what most code has, False what jax advises in a
        # scan and what jaxmem applies; each is leaner on some bodies (on jax 0.12.0.1, True on
        # 11 of 30 policy bodies, by up to 28%).
        prevent_cse=bool(rng.rand() < 0.5),
        value=bool(rng.rand() < 0.5),
    )


def _layernorm(v):
    m = jnp.mean(v, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(v - m), axis=-1, keepdims=True)
    return (v - m) * jax.lax.rsqrt(var + 1e-5)


def _apply(op: str, a, b, p, i):
    if op == "dot_w":
        return a @ p["w"]
    if op == "dot_wt":
        return a @ p["w"].T
    if op == "dot_w2":
        return a @ p["w2"]
    if op == "tanh":
        return jnp.tanh(a)
    if op == "sin":
        return jnp.sin(a)
    if op == "exp_tanh":
        return jnp.exp(jnp.tanh(a))
    if op == "sigmoid":
        return jax.nn.sigmoid(a)
    if op == "leaky":
        return jnp.where(a > 0, a, 0.1 * a)
    if op == "square":
        return a * a
    if op == "softmax":
        return jax.nn.softmax(a, axis=-1)
    if op == "layernorm":
        return _layernorm(a)
    if op == "scale_bias":
        return a * p["g"][None, :] + p["bias"][None, :]
    if op == "bf16_tanh":
        return jnp.tanh(a.astype(bf16)).astype(f32)
    if op == "roll":
        return jnp.concatenate([a[:, 1:], a[:, :1] * 0.5], axis=1)
    if op == "counter":
        return a + 0.1 * i.astype(f32)
    if op == "mul":
        return a * b
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul_tanh":
        return a * jnp.tanh(b)
    raise ValueError(f"unknown op {op!r}")


def make_step(body: Body, p):
    """The step ``(carry, x) -> (carry, ys)`` of ``body``, closing over the parameters ``p``."""

    def step(carry, x):
        carry = list(carry) if isinstance(carry, tuple) else [carry]
        i = carry.pop() if body.counter else None
        h = carry[0]
        c = carry[1] if body.two_carry else h
        vals = [h, x, c]
        for op, a, b in body.ops:
            vals.append(_apply(op, vals[a], vals[b], p, i))
        new = [vals[-1]] + ([vals[body.c_from]] if body.two_carry else [])
        if body.counter:
            new.append(i + 1)
        ys = {
            "none": None,
            "carry": vals[-1],
            "carry_in": h,
            "x": x,
            "inter": vals[body.ys_at],
            "pair": (vals[-1], vals[body.ys_at]),
            "second": (c, vals[-1]) if body.two_carry else vals[-1],
        }[body.ys]
        return (tuple(new) if len(new) > 1 else new[0]), ys

    return step


def make_loss(body: Body, scan):
    def loss(p, xs, h0):
        init = [h0["h"]] + ([h0["c"]] if body.two_carry else [])
        if body.counter:
            init.append(jnp.int32(0))
        init = tuple(init) if len(init) > 1 else init[0]
        final, ys = scan(make_step(body, p), init, xs, reverse=body.reverse, unroll=body.unroll)
        final = [v for v in jax.tree.leaves(final) if jnp.issubdtype(v.dtype, jnp.inexact)]
        ys = jax.tree.leaves(ys)
        kind = body.loss if ys else "final"  # no ys to read: the loss reads the final carry
        parts = {
            "ys": ys,
            "final": final,
            "both": ys + final,
            "ys_first": ys[:1],  # with ys pairs, the second ys is ignored
            "final_first": final[:1],  # with two carry leaves, c's final value is ignored
            "weighted": final,
        }[kind]
        total = sum(jnp.sum(v**2) for v in parts)
        if kind == "weighted":
            total += sum(jnp.sum(v * fixed_weights(v.shape, k)) for k, v in enumerate(ys))
        return total

    return loss


def fixed_weights(shape, k: int):
    """Constant weights for a ys of ``shape`` (baked into the program, not an argument)."""
    return np.random.default_rng(k).standard_normal(shape).astype(np.float32)


def scans(body: Body):
    """``(jaxmem's scan, lax.scan's equivalent)`` for ``body``: with a policy, jaxmem.scan's
    ``policy=`` against lax.scan over the step under ``jax.checkpoint(policy=...,
    prevent_cse=...)``."""
    if body.policy is None:
        return jaxmem.scan, jax.lax.scan
    policy = POLICIES[body.policy]

    def ours(f, *args, **kwargs):
        return jaxmem.scan(f, *args, **kwargs, policy=policy)

    def stock(f, *args, **kwargs):
        step = jax.checkpoint(f, policy=policy, prevent_cse=body.prevent_cse)
        return jax.lax.scan(step, *args, **kwargs)

    return ours, stock


def arg_structs(body: Body):
    s = lambda *shape: jax.ShapeDtypeStruct(shape, f32)
    p = {"w": s(body.d, body.d), "w2": s(body.d, body.d), "g": s(body.d), "bias": s(body.d)}
    h0 = {"h": s(body.b, body.d)} | ({"c": s(body.b, body.d)} if body.two_carry else {})
    return p, s(body.t, body.b, body.d), h0


def temp_bytes(loss, args, value: bool = False) -> int:
    """Compiled temp bytes of ``jit(grad(loss))`` (``value``: of ``jit(value_and_grad(loss))``)
    with respect to every argument."""
    argnums = tuple(range(len(args)))
    grad = jax.jit((jax.value_and_grad if value else jax.grad)(loss, argnums=argnums))
    return compile_to_measure(grad.lower(*args)).memory_analysis().temp_size_in_bytes


def assert_not_above_stock(
    loss_of, args, what: str, scans=(jaxmem.scan, jax.lax.scan), value=False
):
    ours = temp_bytes(loss_of(scans[0]), args, value)
    stock = temp_bytes(loss_of(scans[1]), args, value)
    bound = SLACK_RATIO * stock + SLACK_BYTES
    assert ours <= bound, (
        f"jaxmem.scan compiled temp {ours:,d} B > {SLACK_RATIO} x lax.scan's {stock:,d} B "
        f"+ {SLACK_BYTES:,d} B (x{ours / max(stock, 1):.3f}) on jax {jax.__version__}\n{what}"
    )
