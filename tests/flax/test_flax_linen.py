"""jaxmem.flax.linen: scan_layers against nn.scan (values, gradients, rngs, collections), memory,
remat, and misuse errors."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem.policies as policies
from benchmarks import flax_stacks as flax_bench
from jaxmem.demo.models import Block as GPTBlock
from jaxmem.flax import linen as jl

L = 3


class Block(nn.Module):
    """Pre-LN MLP block with a broadcast mask, dropout, a sown value and batch statistics."""

    d_ff: int = 8
    rate: float = 0.3

    @nn.compact
    def __call__(self, h, mask, deterministic):
        x = nn.Dense(self.d_ff)(nn.LayerNorm()(h)) * mask
        x = nn.Dropout(self.rate)(jax.nn.gelu(x), deterministic=deterministic)
        self.sow("intermediates", "x", jnp.sum(x))
        return h + nn.Dense(h.shape[-1])(x)


class PairBlock(Block):
    """The same block in nn.scan's (carry, y) form."""

    def __call__(self, h, mask, deterministic):
        return Block.__call__(self, h, mask, deterministic), None


class Scanned(nn.Module):
    """A block whose second argument is scanned (one slice per layer)."""

    @nn.compact
    def __call__(self, h, bias):
        return jnp.tanh(nn.Dense(h.shape[-1])(h) + bias), jnp.sum(h)


def max_rel(a, b):
    """Largest relative difference over the leaves (numpy: no eager JAX ops to compile)."""

    def rel(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.max(np.abs(x - y), initial=0.0) / (np.max(np.abs(y), initial=0.0) + 1e-30))

    return max(jax.tree.leaves(jax.tree.map(rel, a, b)), default=0.0)


def assert_parity(a, b, tol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert max_rel(a, b) <= tol


def stock_scan(cls, **kw):
    kw = {"variable_axes": {"params": 0}, "split_rngs": {"params": True, "dropout": True}, **kw}
    return nn.scan(cls, length=L, **kw)


H = np.random.default_rng(3).normal(size=(2, 5, 4)).astype(np.float32)
MASK = np.ones((1, 1, 8), np.float32)
MASK[..., 3] = 0.0


@pytest.mark.parametrize("deterministic", [True, False], ids=["no_dropout", "dropout"])
def test_parity_with_nn_scan(deterministic):
    axes = {"params": 0, "intermediates": 0}
    ours = jl.scan_layers(Block, L, variable_axes=axes)()
    ref = stock_scan(PairBlock, variable_axes=axes, in_axes=nn.broadcast)()
    params = jax.jit(ours.init, static_argnums=3)(jax.random.key(0), H, MASK, True)["params"]
    ref_params = jax.jit(ref.init, static_argnums=3)(jax.random.key(0), H, MASK, True)["params"]
    assert_parity(params, ref_params, tol=0.0)  # same layout and values: interchangeable

    def loss(model, unpack):
        def f(p, h):
            out, state = model.apply(
                {"params": p},
                h,
                MASK,
                deterministic,
                rngs={"dropout": jax.random.key(7)},
                mutable=["intermediates"],
            )
            return jnp.sum(unpack(out) ** 2), state

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

    (v, state), grads = loss(ours, lambda o: o)(params, H)
    (v_ref, state_ref), grads_ref = loss(ref, lambda o: o[0])(params, H)
    assert_parity((v, state, grads), (v_ref, state_ref, grads_ref))
    assert state["intermediates"]["x"][0].shape == (L,)


def test_scanned_args_and_ys_and_reverse():
    ours = jl.scan_layers(Scanned, L, in_axes=0, carry_only=False, reverse=True)()
    ref = stock_scan(Scanned, in_axes=0, reverse=True)()
    bias = np.random.default_rng(1).normal(size=(L, 1, 4)).astype(np.float32)
    h = np.ones((2, 4), np.float32)
    params = jax.jit(ref.init)(jax.random.key(0), h, bias)["params"]
    assert_parity(params, jax.jit(ours.init)(jax.random.key(0), h, bias)["params"], tol=0.0)

    def f(model):
        def loss(p, h, bias):
            c, ys = model.apply({"params": p}, h, bias)
            return jnp.sum(c**2) + jnp.sum(jnp.sin(ys))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, h, bias)

    assert_parity(f(ours), f(ref))


class BNBlock(nn.Module):
    @nn.compact
    def __call__(self, h, train):
        return h + nn.BatchNorm(use_running_average=not train)(nn.Dense(4)(h))


class BNPair(BNBlock):
    def __call__(self, h, train):
        return BNBlock.__call__(self, h, train), None


def test_batch_stats_collection():
    axes = {"params": 0, "batch_stats": 0}
    ours = jl.scan_layers(BNBlock, L, variable_axes=axes)()
    ref = stock_scan(BNPair, variable_axes=axes, in_axes=nn.broadcast)()
    h = np.random.default_rng(2).normal(size=(6, 4)).astype(np.float32)
    variables = jax.jit(ours.init, static_argnums=2)(jax.random.key(0), h, False)
    assert variables["batch_stats"]["BatchNorm_0"]["mean"].shape == (L, 4)
    apply = functools.partial(jax.jit, static_argnums=2, static_argnames="mutable")
    out, upd = apply(ours.apply)(variables, h, True, mutable="batch_stats")
    (out_ref, _), upd_ref = apply(ref.apply)(variables, h, True, mutable="batch_stats")
    assert_parity((out, upd), (out_ref, upd_ref))


def test_gpt_block_matches_nn_scan_with_policy():
    class Pair(GPTBlock):
        def __call__(self, h):
            return GPTBlock.__call__(self, h), None

    h = np.random.default_rng(1).normal(size=(1, 4, 8)).astype(np.float32)
    ours = jl.scan_layers(GPTBlock, 2, policy="selective")(num_heads=2, d_ff=16)
    ref = nn.scan(
        nn.remat(Pair, policy=policies.selective(), prevent_cse=False),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=2,
    )(num_heads=2, d_ff=16)
    params = jax.jit(ref.init)(jax.random.key(0), h)["params"]
    g = jax.jit(jax.grad(lambda p, h: jnp.sum(ours.apply({"params": p}, h) ** 2), (0, 1)))(
        params, h
    )
    g_ref = jax.jit(jax.grad(lambda p, h: jnp.sum(ref.apply({"params": p}, h)[0] ** 2), (0, 1)))(
        params, h
    )
    assert_parity(g, g_ref)


# ------------------------------------------------------------------------------------------
# Memory: compiled temp bytes of the training-step gradient of a GPT-style stack.

LM, BM, SM, DM, FM, HM = 4, 2, 16, 32, 128, 4


class GPTPair(GPTBlock):
    def __call__(self, h):
        return GPTBlock.__call__(self, h), None


def _temp_bytes(model):
    # Only temp bytes are read: compiled without LLVM optimization (same buffers, faster).
    return flax_bench.temp_bytes(model, (BM, SM, DM), flax_bench.FAST_COMPILE)


def _stock(policy=None):
    cls = GPTPair if policy is None else nn.remat(GPTPair, policy=policy, prevent_cse=False)
    return nn.scan(cls, variable_axes={"params": 0}, split_rngs={"params": True}, length=LM)(
        num_heads=HM, d_ff=FM
    )


def test_memory_without_remat():
    ours = _temp_bytes(jl.scan_layers(GPTBlock, LM)(num_heads=HM, d_ff=FM))
    stock = _temp_bytes(_stock())
    assert ours <= 0.6 * stock, (ours, stock)  # measured: 0.43x


@pytest.mark.parametrize("name", ["nothing", "dots", "selective"])
def test_memory_with_policy(name):
    ours = _temp_bytes(jl.scan_layers(GPTBlock, LM, policy=name)(num_heads=HM, d_ff=FM))
    stock = _temp_bytes(_stock(policies.by_name(name)))
    assert ours <= 1.02 * stock, (ours, stock)


# ------------------------------------------------------------------------------------------
# remat and misuse.


@pytest.mark.parametrize(
    "policy", [None, "dots", policies.selective(), jax.checkpoint_policies.dots_saveable]
)
def test_remat_matches_nn_remat(policy):
    x = np.ones((2, 4), np.float32)

    def make(deco):
        @deco
        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(4)(jnp.tanh(nn.Dense(8)(x)))

        return MLP()

    ours = make(jl.remat(policy=policy))
    resolved = policies.by_name(policy) if isinstance(policy, str) else policy
    ref = make(functools.partial(nn.remat, policy=resolved))
    params = jax.jit(ref.init)(jax.random.key(0), x)
    g = jax.jit(jax.grad(lambda p: jnp.sum(ours.apply(p, x) ** 2)))(params)
    g_ref = jax.jit(jax.grad(lambda p: jnp.sum(ref.apply(p, x) ** 2)))(params)
    assert_parity(g, g_ref)
    assert isinstance(jl.remat(Block), type)  # bare form on a class


def test_errors():
    with pytest.raises(TypeError, match="flax.linen.Module subclass"):
        jl.scan_layers(lambda h: h, L)
    with pytest.raises(TypeError, match="Module instance"):
        jl.scan_layers(Block(), L)
    with pytest.raises(TypeError, match="bound method"):
        jl.scan_layers(Block().__call__, L)
    with pytest.raises(TypeError, match="bound method"):
        jl.remat(Block().__call__)
    with pytest.raises(ValueError, match="length >= 1"):
        jl.scan_layers(Block, 0)
    with pytest.raises(TypeError, match="int >= 1"):
        jl.scan_layers(Block, 2.0)
    with pytest.raises(ValueError, match="unknown policy 'full'"):
        jl.scan_layers(Block, L, policy="full")
    with pytest.raises(TypeError, match="variable_axes"):
        jl.scan_layers(Block, L, variable_axes={"params": nn.broadcast})
    # Variables stacked for another length (or not stacked) are named, with the fix.
    stack2, stack = jl.scan_layers(Block, 2)(), jl.scan_layers(Block, L)()
    params = jax.eval_shape(lambda k: stack2.init(k, H, MASK, True), jax.random.key(0))["params"]
    with pytest.raises(ValueError, match=r"params\['Dense_0'\]\['bias'\] has shape \(2, 8\)"):
        jax.eval_shape(lambda p: stack.apply({"params": p}, H, MASK, True), params)
    unstacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params)
    with pytest.raises(ValueError, match="length=3 along variable axis 0"):
        jax.eval_shape(lambda p: stack.apply({"params": p}, H, MASK, True), unstacked)


# ------------------------------------------------------------------------------------------
# jaxmem.flax.linen.scan: nn.scan's signature (Flax's own tests: test_flax_linen_upstream.py).


class SharedCell(nn.Module):
    """Broadcast (shared) params, dropout, a scanned input."""

    @nn.compact
    def __call__(self, h, x):
        h = jnp.tanh(nn.Dense(4, name="shared")(h) + x)
        y = nn.Dropout(0.5, deterministic=False)(h)
        return h, jnp.sum(y, axis=-1)


def _shared_scan(scan):
    kw = dict(variable_broadcast="params", in_axes=0, out_axes=1)
    return scan(SharedCell, split_rngs={"params": False, "dropout": True}, **kw)()


def test_scan_matches_nn_scan_broadcast_carry_dropout():
    ours, ref = _shared_scan(jl.scan), _shared_scan(nn.scan)
    h, xs = H[0], np.random.default_rng(4).normal(size=(L, 5, 4)).astype(np.float32)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    v, v_ref = jax.jit(ours.init)(rngs, h, xs), jax.jit(ref.init)(rngs, h, xs)
    assert_parity(v, v_ref, tol=0.0)
    assert v["params"]["shared"]["kernel"].shape == (4, 4)  # broadcast: computed once, unstacked

    def f(model):
        def loss(p, h, xs):
            c, ys = model.apply({"params": p}, h, xs, rngs={"dropout": jax.random.key(2)})
            return jnp.sum(c**2) + jnp.sum(jnp.sin(ys)), ys

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            v["params"], h, xs
        )

    assert_parity(f(ours), f(ref))  # same dropout masks, outputs and gradients


def test_scan_function_form_and_policy():
    def body(cell, c, x):
        return cell(c, x)

    class Model(nn.Module):
        scan: object

        @nn.compact
        def __call__(self, h, xs):
            f = self.scan(body, variable_axes={"params": 0}, split_rngs={"params": True})
            return f(Scanned(), h, xs)  # length inferred from xs

    ours = Model(functools.partial(jl.scan, policy="dots"))
    ref = Model(nn.scan)
    h, xs = np.ones((2, 4), np.float32), np.random.default_rng(5).normal(size=(L, 1, 4))
    params = jax.jit(ref.init)(jax.random.key(0), h, xs)
    assert_parity(jax.jit(ours.init)(jax.random.key(0), h, xs), params, tol=0.0)

    def g(model):
        return jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, h, xs)[1] ** 2)))(params)

    assert_parity(g(ours), g(ref))


def test_forward_mode_matches_nn_scan():
    """Forward mode (jvp, linearize, jacfwd, hessian, vmap of jvp) and grad of grad through the
    drop-in equal nn.scan's (the same parameters)."""
    h, xs = np.ones((2, 4), np.float32), np.linspace(-1, 1, L * 4, dtype=np.float32)
    xs = xs.reshape(L, 1, 4)
    kwargs = dict(variable_axes={"params": 0}, split_rngs={"params": True})
    ours, ref = jl.scan(Scanned, **kwargs)(), nn.scan(Scanned, **kwargs)()
    params = ours.init(jax.random.key(0), h, xs)
    loss = lambda m: lambda p, h: jnp.sum(m.apply(p, h, xs)[0] ** 2)
    for transform in (
        lambda m: jax.jvp(lambda h: m.apply(params, h, xs), (h,), (h,)),
        lambda m: jax.jvp(loss(m), (params, h), (params, h)),
        lambda m: jax.linearize(loss(m), params, h)[1](params, h),
        lambda m: jax.jacfwd(lambda h: m.apply(params, h, xs)[0])(h),
        lambda m: jax.hessian(loss(m), argnums=1)(params, h),
        lambda m: jax.vmap(lambda t: jax.jvp(lambda h: loss(m)(params, h), (h,), (t,)))(
            np.stack([h, 2 * h])
        ),
        lambda m: jax.grad(lambda p: jnp.sum(jax.grad(loss(m), argnums=1)(p, h) ** 2))(params),
    ):
        # Jitted: one program each, not op by op.
        got, want = (jax.jit(lambda m=m: transform(m))() for m in (ours, ref))  # noqa: B023
        assert_parity(got, want, tol=1e-5)


def test_scan_errors():
    with pytest.raises(NotImplementedError, match=r"_split_transpose.*nn\.scan"):
        jl.scan(Scanned, variable_axes={"params": 0}, _split_transpose=True)
    h, xs = np.ones((2, 4), np.float32), np.ones((L, 1, 4), np.float32)
    with pytest.raises(ValueError, match="length should be specified manually"):
        jl.scan(Scanned, variable_axes={"params": 0}, in_axes=nn.broadcast)().init(
            jax.random.key(0), h, xs
        )
    # A broadcast variable initialised from the loop's data: as nn.scan, a data dependency error.
    shared = jl.scan(Scanned, variable_broadcast="params", split_rngs={"params": True})()
    with pytest.raises(ValueError, match="broadcasted variable has a data dependency"):
        shared.init(jax.random.key(0), h, xs)
    with pytest.raises(ValueError, match="check_constancy_invariants=False"):
        jl.scan(
            Scanned,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            out_axes=nn.broadcast,
            check_constancy_invariants=False,
        )().init(jax.random.key(0), h, xs)
