"""jaxmem.flax reversible_layers (linen) and ReversibleLayers (NNX): gradients against a direct
Python loop over the same per-layer parameters and dropout keys, parameter layout, policies,
memory structure (temp bytes flat in depth), and misuse errors."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.flax import linen as jl

L, B, D = 8, 2, 16


def max_rel(a, b):
    """Largest relative difference over the leaves (in numpy)."""

    def rel(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.max(np.abs(x - y), initial=0.0) / (np.max(np.abs(y), initial=0.0) + 1e-30))

    return max(jax.tree.leaves(jax.tree.map(rel, a, b)), default=0.0)


def assert_close(a, b, tol=1e-4):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert max_rel(a, b) <= tol, max_rel(a, b)


X1 = np.random.default_rng(0).normal(size=(B, D)).astype(np.float32)
X2 = np.random.default_rng(1).normal(size=(B, D)).astype(np.float32)


# ------------------------------------------------------------------------------------------
# linen


class Mlp(nn.Module):
    """A residual branch with a broadcast scale argument and optional dropout."""

    width: int = D
    rate: float = 0.0

    @nn.compact
    def __call__(self, h, scale, deterministic=True):
        x = jnp.tanh(nn.Dense(2 * D)(h)) * scale
        x = nn.Dropout(self.rate)(x, deterministic=deterministic)
        return 0.5 * nn.Dense(self.width)(x)


class Direct(nn.Module):
    """The reference: a Python loop over layers with the stack's per-layer params and keys."""

    f_block: object
    g_block: object
    length: int

    @nn.compact
    def __call__(self, streams, scale, deterministic, params):
        x1, x2 = streams
        f, g = self.f_block(parent=None), self.g_block(parent=None)
        kf = kg = [None] * self.length
        if self.has_rng("dropout"):  # the stack's derivation: one make_rng per block
            kf = jax.random.split(self.make_rng("dropout"), self.length)
            kg = jax.random.split(self.make_rng("dropout"), self.length)
        for i in range(self.length):
            p_f = jax.tree.map(lambda a, i=i: a[i], params["f"])
            p_g = jax.tree.map(lambda a, i=i: a[i], params["g"])
            rf = {} if kf[i] is None else {"dropout": kf[i]}
            rg = {} if kg[i] is None else {"dropout": kg[i]}
            x1 = x1 + f.apply({"params": p_f}, x2, scale, deterministic, rngs=rf)
            x2 = x2 + g.apply({"params": p_g}, x1, scale, deterministic, rngs=rg)
        return x1, x2


def _linen_grads(model, params, rngs, deterministic=True, direct=False):
    scale = jnp.float32(1.5)

    def loss(p, x1, x2):
        if direct:
            y1, y2 = model.apply({}, (x1, x2), scale, deterministic, p, rngs=rngs)
        else:
            y1, y2 = model.apply({"params": p}, (x1, x2), scale, deterministic, rngs=rngs)
        return jnp.sum(jnp.sin(y1) * y2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, X1, X2)


def _linen_init(stack):
    return stack.init(jax.random.key(0), (X1, X2), 1.0, True)["params"]


def test_linen_layout_and_distinct_init():
    G = functools.partial(Mlp, rate=0.0)
    params = _linen_init(jl.reversible_layers(Mlp, G, L)())
    assert set(params) == {"f", "g"}
    shapes = jax.tree.map(jnp.shape, params)
    assert shapes["f"]["Dense_0"]["kernel"] == (L, D, 2 * D)
    assert shapes["g"]["Dense_1"]["bias"] == (L, D)
    assert all(s[0] == L for s in jax.tree.leaves(shapes, is_leaf=lambda s: isinstance(s, tuple)))
    kf, kg = params["f"]["Dense_0"]["kernel"], params["g"]["Dense_0"]["kernel"]
    for i in range(L):  # every layer and block initialized with its own key
        assert not np.allclose(kf[i], kf[(i + 1) % L])
        assert not np.allclose(kf[i], kg[i])
    ref = Mlp().init(jax.random.key(1), X2, 1.0)["params"]
    assert jax.tree.structure(ref) == jax.tree.structure(jax.tree.map(lambda a: a[0], params["f"]))


@pytest.mark.parametrize("policy", [None, "dots", jax.checkpoint_policies.nothing_saveable])
def test_linen_gradients_match_direct_loop(policy):
    stack = jl.reversible_layers(Mlp, Mlp, L, policy=policy)()
    params = _linen_init(stack)
    got = _linen_grads(stack, params, {})
    want = _linen_grads(Direct(Mlp, Mlp, L), params, {}, direct=True)
    assert_close(got, want)


def test_linen_dropout_replays_per_layer_keys():
    block = functools.partial(Mlp, rate=0.5)
    stack = jl.reversible_layers(block, block, L, anchor_every=3)()
    params = _linen_init(stack)
    rngs = {"dropout": jax.random.key(7)}
    got = _linen_grads(stack, params, rngs, deterministic=False)
    ref = Direct(block, block, L)
    want = _linen_grads(ref, params, rngs, deterministic=False, direct=True)
    assert_close(got, want)
    other = _linen_grads(ref, params, {"dropout": jax.random.key(8)}, False, direct=True)
    assert max_rel(got, other) > 1e-2  # the masks matter: other keys, other gradients
    no_drop = _linen_grads(stack, params, rngs, deterministic=True)
    assert max_rel(got, no_drop) > 1e-2


def test_linen_unsplit_params_stream_is_shared_by_layers():
    params = _linen_init(jl.reversible_layers(Mlp, Mlp, 3, split_rngs={"params": False})())
    for leaf in jax.tree.leaves(params):  # one key for every layer: identical layers
        np.testing.assert_array_equal(leaf[0], leaf[2])
    assert not np.allclose(params["f"]["Dense_0"]["kernel"], params["g"]["Dense_0"]["kernel"])


class Wide(nn.Module):
    @nn.compact
    def __call__(self, h, *args):
        return nn.Dense(D + 8)(h)


class WithBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, h, *args):
        return nn.BatchNorm(use_running_average=False)(nn.Dense(D)(h))


def test_linen_errors():
    with pytest.raises(TypeError, match=r"f_block \(Wide\) returned float32\[2,24\].*x1"):
        _linen_init(jl.reversible_layers(Wide, Mlp, 2)())
    with pytest.raises(ValueError, match=r"g_block \(WithBatchNorm\) creates variables in "):
        _linen_init(jl.reversible_layers(Mlp, WithBatchNorm, 2)())
    with pytest.raises(TypeError, match="pass the class itself"):
        jl.reversible_layers(Mlp(), Mlp, 2)
    with pytest.raises(ValueError, match="length >= 1"):
        jl.reversible_layers(Mlp, Mlp, 0)
    with pytest.raises(ValueError, match="unknown policy"):
        jl.reversible_layers(Mlp, Mlp, 2, policy="bogus")
    with pytest.raises(ValueError, match="anchor_every"):
        jl.reversible_layers(Mlp, Mlp, 2, anchor_every=0)
    stack = jl.reversible_layers(Mlp, Mlp, 3)()
    with pytest.raises(TypeError, match=r"pair of streams \(x1, x2\)"):
        stack.init(jax.random.key(0), X1, 1.0)
    params = jax.tree.map(lambda a: a[:2], _linen_init(stack))
    with pytest.raises(ValueError, match="reversible_layers: .*leading axis 2"):
        stack.apply({"params": params}, (X1, X2), 1.0)
    with pytest.raises(ValueError, match="params has no entry 'g'"):
        stack.apply({"params": {"f": params["f"]}}, (X1, X2), 1.0)


# ------------------------------------------------------------------------------------------
# Memory: the compiled gradient's temp bytes do not grow with depth.

BM, DM = 32, 128


def _linen_temp(depth, reversible=True):
    x = jnp.ones((BM, DM))
    block = functools.partial(Mlp, width=DM)
    if reversible:
        model = jl.reversible_layers(block, block, depth)()
    else:
        model = Direct(block, block, depth)
    params = jl.reversible_layers(block, block, depth)().init(jax.random.key(0), (x, x), 1.0)
    params = params["params"]

    def loss(p, x):
        if reversible:
            y1, y2 = model.apply({"params": p}, (x, x), 1.0)
        else:
            y1, y2 = model.apply({}, (x, x), 1.0, True, p)
        return jnp.sum(y1 * y2)

    compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_linen_memory_flat_in_depth():
    shallow, deep = _linen_temp(2), _linen_temp(16)
    assert deep <= 1.15 * shallow, (shallow, deep)
    stored = _linen_temp(16, reversible=False)  # the loop stores every layer's activations
    assert deep < 0.5 * stored, (deep, stored)
