"""``jaxmem.optimize``: unmodified programs, their scans run as ``jaxmem.scan``.

Each case is a loss written without jaxmem (plain JAX, Flax linen and NNX, Equinox): the
gradient of ``optimize(loss)`` equals the loss's own (f32, 1e-5 of the largest), its compiled
temp is at most the explicit jaxmem version's x 1.02 + 16 KiB where one exists and never above
stock, and ``explain`` lists every scan.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from benchmarks import optimize as gpt_bench
from jaxmem._src import jax_compat as jc
from jaxmem._src.jax_compat import compile_to_measure

KIB16 = 16 * 1024
R = np.random.default_rng(0)


def f32(*shape, scale=1.0):
    return jnp.asarray(R.standard_normal(shape) * scale, jnp.float32)


def temp(f, *args):
    return compile_to_measure(jax.jit(f).lower(*args)).memory_analysis().temp_size_in_bytes


def close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol * max(1.0, np.abs(y).max()))


def run_and_temp(f, *args):
    """``jax.jit(f)(*args)`` and that program's compiled temp: called first, the jit's lowering
    and compile are cached, so ``lower().compile()`` after it reads the same executable."""
    jitted = jax.jit(f)
    out = jitted(*args)
    return out, jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


def check(loss, args, explicit=None, below=None, scans=1):
    """Gradients equal; temp <= explicit x 1.02 + 16 KiB and <= stock (<= below x stock)."""
    opt = jaxmem.optimize(loss)
    argnums = tuple(range(len(args)))
    want, stock = run_and_temp(jax.grad(loss, argnums), *args)
    close(jax.grad(opt, argnums)(*args), want)  # un-jitted
    got, ours = run_and_temp(jax.grad(opt, argnums), *args)
    close(got, want)
    assert ours <= stock, (ours, stock)
    if explicit is not None:
        lean = temp(jax.grad(explicit, argnums), *args)
        assert ours <= 1.02 * lean + KIB16, (ours, lean)
        if lean <= 0.7 * stock:  # where the explicit version reaches 0.7x stock, so does this
            assert ours <= 0.7 * stock, (ours, stock)
    if below is not None:
        assert ours <= below * stock, (ours, stock)
    report = opt.explain(*args)
    assert sum(s.rewritten for s in report.scans) == scans, str(report)
    return report


# ------------------------------------------------------------------------------------------
# Plain JAX.

T, B, D = 24, 16, 64
W, U, XS, H0 = f32(D, D, scale=0.2), f32(D, D, scale=0.2), f32(T, B, D), f32(B, D)


def rnn(scan):
    def loss(w, xs, h0):
        h, ys = scan(lambda h, x: (jnp.tanh(h @ w + x),) * 2, h0, xs)
        return jnp.sum(h**2) + jnp.sum(jnp.sin(ys))

    return loss


def test_plain_rnn():
    report = check(rnn(jax.lax.scan), (W, XS, H0), explicit=rnn(jaxmem.scan), below=0.7)
    (scan,) = report.scans
    assert scan.length == T and "test_optimize.py" in scan.source
    assert scan.kept_bytes < scan.stock_bytes


def test_explain_reports_the_compiled_gradient_of_a_rolled_loop():
    """A rolled loop's figures are its gradient compiled alone, ``lax.scan``'s and jaxmem's (the
    stacks and the backward step's temporaries as XLA schedules them), and the saving they claim
    is the whole loss's within 10%."""
    args = (W, XS, H0)
    (scan,) = jaxmem.optimize(rnn(jax.lax.scan)).explain(*args).scans

    def alone(scan):
        def loss(w, h0, xs):
            h, ys = scan(lambda h, x: (jnp.tanh(h @ w + x),) * 2, h0, xs)
            return jnp.sum(h**2) + jnp.sum(ys**2)

        return temp(jax.grad(loss, argnums=(0, 1, 2)), W, H0, XS)

    assert (scan.stock_bytes, scan.kept_bytes) == (alone(jax.lax.scan), alone(jaxmem.scan))
    stock = temp(jax.grad(rnn(jax.lax.scan), argnums=(0, 1, 2)), *args)
    ours = temp(jax.grad(rnn(jaxmem.scan), argnums=(0, 1, 2)), *args)
    claimed, compiled = scan.stock_bytes - scan.kept_bytes, stock - ours
    assert compiled > 0 and abs(claimed - compiled) <= 0.1 * compiled, (scan, stock, ours)


def test_explain_reports_each_scans_saving_in_the_loss():
    """``saved_bytes``: the loss's ``value_and_grad`` temp under ``lax.scan`` less that with this
    scan alone run as ``jaxmem.scan`` (the others left), one rolled loop and one unrolled whole;
    None where the function is not a loss."""

    def two_loops(first, second):
        def loss(w, xs, h0):
            h, ys = first(lambda h, x: (jnp.tanh(h @ w + x),) * 2, h0, xs)
            _, zs = second(lambda h, x: (jnp.sin(h @ w + x),) * 2, h, xs)
            return jnp.sum(ys**2) + jnp.sum(zs**2)

        return loss

    full = functools.partial(jaxmem.scan, unroll=True)
    stock_full = functools.partial(jax.lax.scan, unroll=True)
    args = (W, XS, H0)
    report = jaxmem.optimize(two_loops(jax.lax.scan, stock_full)).explain(*args)
    grad_temp = lambda loss: temp(jax.value_and_grad(loss, argnums=(0, 1, 2)), *args)
    stock = grad_temp(two_loops(jax.lax.scan, stock_full))
    want = [
        stock - grad_temp(two_loops(jaxmem.scan, stock_full)),
        stock - grad_temp(two_loops(jax.lax.scan, full)),
    ]
    assert [s.saved_bytes for s in report.scans] == want and min(want) > 0, str(report)
    assert "the gradient's temp" in str(report.scans[0])
    vector = lambda w, xs, h0: two_loops(jax.lax.scan, jax.lax.scan)(w, xs, h0) * jnp.ones(2)
    assert [s.saved_bytes for s in jaxmem.optimize(vector).explain(*args).scans] == [None, None]


GPT = gpt_bench.Sizes(layers=4, batch=2, seq=16, d=32, heads=4)
GPT_ARGS = gpt_bench.make_args(GPT)


def stack(scan, step_wrap=lambda f: f):
    """A GPT-style transformer stack (pre-LN causal attention and a gelu MLP per layer) scanned
    inside a nested ``jax.jit``, its step optionally wrapped (``jax.checkpoint``)."""
    wrapped = lambda f, init, xs: scan(step_wrap(f), init, xs)

    def loss(params, x):
        return jax.jit(gpt_bench.make_loss(GPT, wrapped))(params, x)

    return loss


def test_transformer_stack_in_a_nested_jit():
    check(stack(jax.lax.scan), GPT_ARGS, explicit=stack(jaxmem.scan))


def test_step_under_checkpoint_dots():
    wrap = functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_saveable)
    check(stack(jax.lax.scan, wrap), GPT_ARGS, explicit=stack(jaxmem.scan, wrap))


def test_scan_inside_checkpoint_and_cond():
    def loss(w, xs, h0):
        inner = jax.checkpoint(rnn(jax.lax.scan))
        return jax.lax.cond(
            jnp.sum(h0) > -1e9, lambda: inner(w, xs, h0), lambda: rnn(jax.lax.scan)(w, xs, -h0)
        )

    check(loss, (W, XS, H0), scans=2)


def test_nested_scans_reverse_and_no_xs():
    def loss(w, xs, h0):
        def outer(h, x):
            inner, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w + x), None), h, None, length=3)
            return inner, jnp.sum(inner)

        h, ys = jax.lax.scan(outer, h0, xs, reverse=True)
        return jnp.sum(h**2) + jnp.sum(ys)

    check(loss, (W, XS[:6], H0), scans=2)


def test_fori_loop_and_map():
    def loss(w, xs, h0):
        h = jax.lax.fori_loop(0, 5, lambda i, h: jnp.tanh(h @ w + xs[i]), h0)
        return jnp.sum(h**2) + jnp.sum(jax.lax.map(lambda x: jnp.sin(x @ w), xs[:4]))

    check(loss, (W, XS, H0), scans=2)


def test_scan_inside_shard_map():
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((len(jax.devices()),), ("data",), (jax.sharding.AxisType.Auto,))
    n = len(jax.devices())

    def loss(w, xs, h0):
        f = jax.shard_map(
            lambda w, xs, h0: jax.lax.psum(rnn(jax.lax.scan)(w, xs, h0), "data"),
            mesh=mesh,
            in_specs=(P(), P(None, "data"), P("data")),
            out_specs=P(),
        )
        return f(w, xs, h0)

    check(loss, (W, XS[:, : 8 * n], H0[: 8 * n]))


def test_custom_vjp_is_left_alone():
    @jax.custom_vjp
    def mine(w, xs, h0):
        return rnn(jax.lax.scan)(w, xs, h0)

    mine.defvjp(lambda *a: (mine(*a), a), lambda a, g: tuple(0.5 * x for x in a))
    loss = lambda w, xs, h0: mine(w, xs, h0) + rnn(jax.lax.scan)(w, xs, h0)
    report = check(loss, (W, XS, H0), scans=1)
    alone = [s for s in report.scans if not s.rewritten]
    assert len(alone) == 1 and "custom_vjp" in alone[0].why


def test_no_scan_runs_unchanged_and_keywords():
    loss = lambda w, *, scale=2.0: jnp.sum(jnp.sin(w) * scale)
    opt = jaxmem.optimize(loss)
    assert str(opt.explain(W)) == "no scan found: the function runs unchanged"
    close(jax.grad(opt)(W, scale=3.0), jax.grad(loss)(W, scale=3.0))


def test_forward_mode_and_vmap():
    loss = rnn(jax.lax.scan)
    opt = jaxmem.optimize(loss)
    close(jax.jvp(opt, (W, XS, H0), (U, XS, H0)), jax.jvp(loss, (W, XS, H0), (U, XS, H0)))
    ws = jnp.stack([W, 0.5 * W])
    f = lambda g: jax.vmap(jax.grad(g), in_axes=(0, None, None))(ws, XS, H0)
    close(f(opt), f(loss))


def test_options_and_errors():
    opt = jaxmem.optimize(rnn(jax.lax.scan), checkpoints=4)
    close(jax.grad(opt)(W, XS, H0), jax.grad(rnn(jax.lax.scan))(W, XS, H0))
    seen = []
    per_scan = jaxmem.optimize(
        rnn(jax.lax.scan), options=lambda s: seen.append(s.length) or {"recompute": "none"}
    )
    close(jax.grad(per_scan)(W, XS, H0), jax.grad(rnn(jax.lax.scan))(W, XS, H0))
    assert seen == [T]
    with pytest.raises(ValueError, match="jaxmem.optimize"):
        jaxmem.optimize(rnn(jax.lax.scan), recompute="bogus")
    with pytest.raises(TypeError, match="not both"):
        jaxmem.optimize(rnn(jax.lax.scan), policy="dots", options=lambda s: {})
    with pytest.raises(TypeError, match="jaxmem.optimize"):
        jaxmem.optimize(3)

    @jaxmem.optimize(recompute="cheap")
    def decorated(w, xs, h0):
        return rnn(jax.lax.scan)(w, xs, h0)

    close(jax.grad(decorated)(W, XS, H0), jax.grad(rnn(jax.lax.scan))(W, XS, H0))


# ------------------------------------------------------------------------------------------
# Flax linen and NNX, Equinox: their own scans.


def test_flax_linen_scan_and_remat_scan():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + nn.Dense(D)(jax.nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(h)))), None

    class Stack(nn.Module):
        scan: object

        @nn.compact
        def __call__(self, h):
            f = self.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
            return f()(h, None)[0]

    params = Stack(nn.scan).init(jax.random.key(0), H0)
    loss = lambda p, h: jnp.sum(Stack(nn.scan).apply(p, h) ** 2)
    explicit = lambda p, h: jnp.sum(Stack(jaxmem.flax.linen.scan).apply(p, h) ** 2)
    (scan,) = check(loss, (params, H0), explicit=explicit).scans
    # The scan is Flax's; the report also names the user's line that led to it.
    assert "flax" in scan.source and "test_optimize.py" in scan.called_from
    assert str(scan).index("test_optimize.py") < str(scan).index("flax")  # the user's line first

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, h):
            return Block()(h, None)[0]

    class Remat(nn.Module):
        @nn.compact
        def __call__(self, h):
            return nn.remat_scan(Layer, lengths=(2, 2))()(h)

    params = Remat().init(jax.random.key(0), H0)
    check(lambda p, h: jnp.sum(Remat().apply(p, h) ** 2), (params, H0), scans=2)


def test_flax_nnx_scan():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln = nnx.LayerNorm(D, rngs=rngs)
            self.up = nnx.Linear(D, 2 * D, rngs=rngs)
            self.down = nnx.Linear(2 * D, D, rngs=rngs)

        def __call__(self, h):
            return h + self.down(jax.nn.gelu(self.up(self.ln(h))))

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return Block(nnx.Rngs(key))

    blocks = make(jax.random.split(jax.random.key(0), 4))
    graphdef, state = nnx.split(blocks)

    def loss(state, h):
        blocks = nnx.merge(graphdef, state)

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block, h):
            return block(h)

        return jnp.sum(run(blocks, h) ** 2)

    check(loss, (state, H0))


def test_equinox_mlp_stack():
    eqx = pytest.importorskip("equinox")
    for activation in (jax.nn.relu, jax.nn.gelu):
        keys = jax.random.split(jax.random.key(0), 4)
        mlps = eqx.filter_vmap(
            lambda k, a=activation: eqx.nn.MLP(D, D, 2 * D, 1, activation=a, key=k)
        )(keys)
        params, static = eqx.partition(mlps, eqx.is_array)
        loss = functools.partial(_eqx_loss, eqx, static, jax.lax.scan)
        check(loss, (params, H0), explicit=functools.partial(_eqx_loss, eqx, static, jaxmem.scan))


def _eqx_loss(eqx, static, scan, params, h):
    """An Equinox MLP stack the way Equinox's users scan one: filter_vmap-made layers,
    partitioned, recombined in the step."""

    def step(h, p):
        return h + jax.vmap(eqx.combine(p, static))(h), None

    return jnp.sum(scan(step, h, params)[0] ** 2)


# ------------------------------------------------------------------------------------------
# Package layout: the public name.


def test_public_face():
    assert jaxmem.optimize.__module__.startswith("jaxmem._src.optimize")
    assert {"optimize", "Optimized", "Explanation", "ScanReport"} <= set(jaxmem.__all__)


def test_chunk_loss_runs_autochunk_on_the_tail():
    """A naive LM-head cross-entropy after a scanned stack: with chunk_loss=True the [N, V]
    logits are never whole (autochunk), the gradient unchanged."""
    n, v = 512, 16384  # 32 MiB of logits
    head = f32(D, v, scale=0.1)
    labels = jnp.asarray(R.integers(0, v, n))
    xs = f32(4, n, D)

    def loss(w, head, xs):
        h, _ = jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), jnp.zeros((n, D)), xs)
        logits = h @ head
        lse = jax.nn.logsumexp(logits, axis=-1)
        return jnp.mean(lse - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0])

    args = (W, head, xs)
    opt = jaxmem.optimize(loss, chunk_loss=True)
    close(jax.grad(opt, (0, 1))(*args), jax.grad(loss, (0, 1))(*args))
    plain = temp(jax.grad(jaxmem.optimize(loss), (0, 1)), *args)
    chunked = temp(jax.grad(opt, (0, 1)), *args)
    assert chunked < 0.5 * plain, (chunked, plain)


# ------------------------------------------------------------------------------------------
# Scans JAX itself built: the forward and transposed loops of a differentiated scan (read from
# every form of lax.scan's parameters), run and equal to the function's own values.


def _sgd_step(loss):
    """A train step as users jit it: value_and_grad inside, then an update."""

    def train_step(w, xs, h0):
        value, g = jax.value_and_grad(loss)(w, xs, h0)
        return w - 0.1 * g, value

    return train_step


def _jax_built(name):
    loss = rnn(jax.lax.scan)
    return {
        "train_step": _sgd_step(loss),
        "grad": jax.grad(loss, argnums=(0, 1, 2)),
        "value_and_grad": jax.value_and_grad(loss),
        "vjp": lambda w, xs, h0: jax.vjp(lambda w: loss(w, xs, h0), w)[1](jnp.float32(1)),
        "linearize": lambda w, xs, h0: jax.linearize(lambda w: loss(w, xs, h0), w)[1](U),
        "linear_transpose": lambda w, xs, h0: jax.linear_transpose(
            lambda x: jax.lax.scan(lambda c, x: (c @ w + x,) * 2, h0 * 0, x)[1], xs
        )(xs),
        "jvp": lambda w, xs, h0: jax.jvp(lambda w: loss(w, xs, h0), (w,), (U,)),
        "vmap_grad": lambda w, xs, h0: jax.vmap(jax.grad(loss), (None, None, 0))(
            w, xs, jnp.stack([h0, -h0])
        ),
        "grad_of_checkpoint": jax.grad(jax.checkpoint(loss)),
        "hessian_vector": lambda w, xs, h0: jax.jvp(
            jax.grad(lambda w: loss(w, xs, h0)), (w,), (U,)
        ),
    }[name]


JAX_BUILT = [
    "train_step",
    "grad",
    "value_and_grad",
    "vjp",
    "linearize",
    "linear_transpose",
    "jvp",
    "vmap_grad",
    "grad_of_checkpoint",
    "hessian_vector",
]


@pytest.mark.parametrize("remat3", [False, True], ids=["remat2", "remat3"])
@pytest.mark.parametrize("name", JAX_BUILT)
def test_optimize_runs_scans_jax_built(name, remat3):
    before = jax.config.jax_remat3
    jax.config.update("jax_remat3", remat3)
    try:
        fn = _jax_built(name)
        opt = jaxmem.optimize(fn)
        want = fn(W, XS, H0)
        close(opt(W, XS, H0), want)
        close(jax.jit(opt)(W, XS, H0), want)
        report = opt.explain(W, XS, H0)
        assert report.scans and all(s.rewritten for s in report.scans), str(report)
    finally:
        jax.config.update("jax_remat3", before)


# What the function differentiates itself, as if it were written around optimize(loss).
_LEAN_AS = {
    "train_step": lambda: _sgd_step(jaxmem.optimize(rnn(jax.lax.scan))),
    "grad": lambda: jax.grad(jaxmem.optimize(rnn(jax.lax.scan)), argnums=(0, 1, 2)),
    "value_and_grad": lambda: jax.value_and_grad(jaxmem.optimize(rnn(jax.lax.scan))),
    "vmap_grad": lambda: (
        lambda w, xs, h0: jax.vmap(jax.grad(jaxmem.optimize(rnn(jax.lax.scan))), (None, None, 0))(
            w, xs, jnp.stack([h0, -h0])
        )
    ),
}


@pytest.mark.parametrize("name", sorted(_LEAN_AS))
def test_optimize_makes_a_function_differentiating_inside_lean(name):
    """``optimize(train_step)``: the scan its own ``value_and_grad`` differentiates runs as
    jaxmem.scan (caught at its bind), the same program as ``value_and_grad(optimize(loss))``;
    and below lax.scan's."""
    fn = _jax_built(name)
    want, stock = run_and_temp(fn, W, XS, H0)
    got, ours = run_and_temp(jaxmem.optimize(fn), W, XS, H0)
    close(got, want)
    lean = temp(_LEAN_AS[name](), W, XS, H0)
    assert ours <= 1.02 * lean + KIB16 and ours < 0.9 * stock, (ours, lean, stock)
    assert "bind" not in vars(jc.scan_p)  # the catch is undone after the trace
    (scan,) = jaxmem.optimize(fn).explain(W, XS, H0).scans
    assert scan.rewritten and scan.kept_bytes < scan.stock_bytes, scan
    assert "test_optimize.py" in scan.source and "intercept" not in scan.source, scan


def test_optimize_catches_a_scan_a_library_imported():
    """A scan bound under another name (``from jax.lax import scan`` in a library, fori_loop
    with static bounds) is caught too; forward mode is left to JAX."""
    from jax.lax import scan as imported

    def loss(w, xs, h0):
        h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), h0)
        return rnn(imported)(w, xs, h)

    step = _sgd_step(loss)
    want, stock = run_and_temp(step, W, XS, H0)
    got, ours = run_and_temp(jaxmem.optimize(step), W, XS, H0)
    close(got, want)
    assert ours < 0.9 * stock, (ours, stock)
    forward = lambda w, xs, h0: jax.jvp(lambda w: loss(w, xs, h0), (w,), (U,))
    close(jaxmem.optimize(forward)(W, XS, H0), forward(W, XS, H0))


def _inside_steps():
    """Train steps whose scans are caught: a closure over an argument not differentiated, a
    reversed loop unrolled in part with an int counter and ``has_aux``; nested scans (``xs=None``
    inside); a body under a framework's ``jax.checkpoint`` policy; grad of a vmap."""
    u = f32(D, D, scale=0.2)

    def counter(w, xs, h0):
        def step(c, x):
            h, i = c
            h = jnp.tanh(h @ w + x * i.astype(jnp.float32) + jnp.sin(h @ u))
            return (h, i + 1), h * 2

        (h, i), ys = jax.lax.scan(step, (h0, jnp.int32(0)), xs, reverse=True, unroll=2)
        return jnp.sum(ys**2) + jnp.sum(h), (i, ys[0])

    def nested(w, xs, h0):
        def outer(h, x):
            return (
                jax.lax.scan(lambda c, _: (jnp.tanh(c @ w + x), None), h, None, length=3)[0],
            ) * 2

        return jnp.sum(jax.lax.scan(outer, h0, xs)[1])

    def policy(w, xs, h0):
        dots = jax.checkpoint_policies.dots_saveable
        body = jax.checkpoint(lambda h, x: (jnp.tanh(h @ w + x),) * 2, policy=dots)
        return jnp.sum(jax.lax.scan(body, h0, xs)[1] ** 2)

    return {
        "counter": lambda w, xs, h0: jax.value_and_grad(counter, has_aux=True)(w, xs, h0),
        "nested": jax.grad(nested, argnums=(0, 2)),
        "policy": jax.value_and_grad(policy),
        "grad_of_vmap": jax.grad(
            lambda w, xs, h0: jnp.sum(jax.vmap(lambda h: policy(w, xs, h))(jnp.stack([h0, -h0])))
        ),
    }


@pytest.mark.parametrize("name", ["counter", "nested", "policy", "grad_of_vmap"])
def test_optimize_inside_equals_stock_and_is_not_above_it(name):
    fn = _inside_steps()[name]
    want, stock = run_and_temp(fn, W, XS, H0)
    got, ours = run_and_temp(jaxmem.optimize(fn), W, XS, H0)
    close(got, want)
    close(jaxmem.optimize(fn)(W, XS, H0), want)  # un-jitted
    assert ours < stock, (ours, stock)


def test_effects_in_a_caught_scan_run_as_under_lax_scan(capfd):
    def loss(w, xs, h0):
        def step(h, x):
            h = jnp.tanh(h @ w + x)
            jax.debug.print("h={s}", s=jnp.sum(h))
            return h, h

        return jnp.sum(jax.lax.scan(step, h0, xs[:3])[1])

    fn = jax.value_and_grad(loss)
    jax.block_until_ready(fn(W, XS, H0))
    want = capfd.readouterr().out.count("h=")
    jax.block_until_ready(jaxmem.optimize(fn)(W, XS, H0))
    assert capfd.readouterr().out.count("h=") == want == 3


@pytest.mark.parametrize("wrap", [jax.jit, jax.checkpoint], ids=["jit", "checkpoint"])
def test_a_scan_in_a_jit_the_step_differentiates_is_still_stock(wrap):
    """Known gap: ``value_and_grad(jax.jit(loss))`` (or of ``jax.checkpoint(loss)``) inside the
    step: the jit traces its scan before the differentiation meets it, and JAX differentiates
    the traced jaxpr (values equal, temp 0.99x-1.00x stock on both versions). Plan: catch the
    ``jit`` / ``remat`` bind under reverse mode too and evaluate its jaxpr with the rewriter (as
    the equation-level rewrite inlines a jit). Strict: fails once the scan is lean."""
    fn = _sgd_step(wrap(rnn(jax.lax.scan)))
    want, stock = run_and_temp(fn, W, XS, H0)
    got, ours = run_and_temp(jaxmem.optimize(fn), W, XS, H0)
    close(got, want)
    assert 0.95 * stock <= ours <= 1.02 * stock + KIB16, (ours, stock)


def test_scan_counts_read_every_form():
    """``(num_consts, num_carry)`` of each scan JAX builds: the body's inputs in that order,
    consistent with the equation's operands and the body's carry outputs."""
    jaxprs = [jax.make_jaxpr(_jax_built(n))(W, XS, H0) for n in JAX_BUILT]
    scans = [e for j in jaxprs for e in _all_eqns(j.jaxpr) if e.primitive.name == "scan"]
    assert len(scans) >= len(JAX_BUILT) + 5
    for eqn in scans:
        n_consts, n_carry = jc.scan_counts(eqn)
        body = jc.open_jaxpr(eqn.params["jaxpr"])
        assert len(body.invars) == len(eqn.invars) >= n_consts + n_carry
        carry_in = [v.aval for v in body.invars[n_consts : n_consts + n_carry]]
        carry_out = [v.aval for v in body.outvars[:n_carry]]
        assert [a.shape for a in carry_in] == [a.shape for a in carry_out]
        assert [e.aval.shape for e in eqn.outvars[:n_carry]] == [a.shape for a in carry_in]


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jc.subjaxprs(eqn):
            yield from _all_eqns(sub)


# ------------------------------------------------------------------------------------------
# Drop-in: what a function returns besides arrays passes through; jax.lax.scan = jaxmem.scan.


def test_non_array_outputs_pass_through():
    loss = rnn(jax.lax.scan)
    tagged = lambda w, xs, h0: (loss(w, xs, h0), "tag", 3, {"n": 2.5, "b": True})
    out = jaxmem.optimize(tagged)(W, XS, H0)
    assert out[1:] == ("tag", 3, {"n": 2.5, "b": True})
    assert type(out[2]) is int and type(out[3]["n"]) is float
    close(out[0], loss(W, XS, H0))
    g, aux = jax.grad(jaxmem.optimize(lambda w: (loss(w, XS, H0), "aux")), has_aux=True)(W)
    assert aux == "aux"
    close(g, jax.grad(loss)(W, XS, H0))


def _runs_jaxmem_scan(f, *args) -> bool:
    """Whether ``f`` stages a ``jaxmem_scan`` (printed by name on 0.12, as its class on 0.10.2)."""
    jaxpr = str(jax.make_jaxpr(f)(*args))
    return "jaxmem_scan" in jaxpr or "JaxmemScan" in jaxpr


@pytest.fixture
def lax_scan_is_jaxmem_scan():
    original = jax.lax.scan
    jax.lax.scan = jaxmem.scan
    yield original
    jax.lax.scan = original


def test_lax_scan_swapped_for_jaxmem_scan_plain_loop(lax_scan_is_jaxmem_scan):
    stock = rnn(lax_scan_is_jaxmem_scan)
    swapped = rnn(lambda *a, **k: jax.lax.scan(*a, **k))
    close(jax.grad(swapped, (0, 1, 2))(W, XS, H0), jax.grad(stock, (0, 1, 2))(W, XS, H0))
    assert _runs_jaxmem_scan(swapped, W, XS, H0)
    close(jax.jit(jax.grad(jaxmem.optimize(swapped)))(W, XS, H0), jax.grad(stock)(W, XS, H0))


def test_lax_scan_swapped_for_jaxmem_scan_flax_linen(lax_scan_is_jaxmem_scan):
    nn = pytest.importorskip("flax.linen")

    class Cell(nn.Module):
        @nn.compact
        def __call__(self, h, x):
            h = jnp.tanh(nn.Dense(D)(h) + x)
            return h, jnp.sin(h)

    model = nn.scan(Cell, variable_broadcast="params", split_rngs={"params": False})()
    params = model.init(jax.random.key(0), H0, XS)

    def loss(params):
        h, ys = model.apply(params, H0, XS)
        return jnp.sum(h**2) + jnp.sum(ys)

    swapped = jax.grad(loss)(params)
    assert _runs_jaxmem_scan(loss, params)
    jax.lax.scan = lax_scan_is_jaxmem_scan
    close(swapped, jax.grad(loss)(params))
