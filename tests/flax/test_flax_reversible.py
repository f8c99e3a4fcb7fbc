"""jaxmem.flax reversible_layers (linen) and ReversibleLayers (NNX): gradients against a direct
Python loop over the same per-layer parameters and dropout keys, parameter layout, policies,
memory structure (temp bytes flat in depth), and misuse errors."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.flax import linen as jl
from jaxmem.flax import nnx as jn

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
        x = jnp.tanh(nn.Dense(2 * self.width)(h)) * scale
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


class Sharded(nn.Module):
    @nn.compact
    def __call__(self, h):
        init = nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        return nn.Dense(D, kernel_init=init)(h)


class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
        meta = {nn.PARTITION_NAME: "layers"}
        return jl.reversible_layers(Sharded, Sharded, 3, metadata_params=meta)(name="rev")((x, x))


def test_linen_submodule_layout_and_partitioning():
    variables = Outer().init(jax.random.key(0), X1)
    specs = nn.get_partition_spec(variables)["params"]["rev"]
    assert specs["f"]["Dense_0"]["kernel"] == jax.sharding.PartitionSpec("layers", "embed", "mlp")
    assert nn.unbox(variables)["params"]["rev"]["g"]["Dense_0"]["kernel"].shape == (3, D, D)
    y1, y2 = Outer().apply(variables, X1)
    assert y1.shape == y2.shape == (B, D)


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


class Plain(nn.Module):
    @nn.compact
    def __call__(self, h):
        return jnp.tanh(nn.Dense(D)(h))


def test_linen_class_and_blocks_without_arguments():
    Stack = jl.reversible_layers(Plain, Plain, 2)
    assert Stack.__name__ == "ReversiblePlainPlain" and "reversible_layers" in Stack.__doc__
    y = Stack().init_with_output(jax.random.key(0), (X1, X2))[0]
    assert [v.shape for v in y] == [(B, D), (B, D)]


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
    with pytest.raises(TypeError, match="split_rngs"):
        jl.reversible_layers(Mlp, Mlp, 2, split_rngs=["dropout"])
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


# ------------------------------------------------------------------------------------------
# NNX


class NnxMlp(nnx.Module):
    def __init__(self, width=D, rate=0.0, *, rngs):
        self.up = nnx.Linear(width, 2 * width, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, h, scale, deterministic=True):
        x = self.drop(jnp.tanh(self.up(h)) * scale, deterministic=deterministic)
        return 0.5 * self.down(x)


def _nnx_stack(length=L, rate=0.0, seed=0, **kw):
    def make(rngs):
        return NnxMlp(rate=rate, rngs=rngs)

    return jn.reversible_layers(make, make, length, rngs=nnx.Rngs(seed, dropout=seed + 1), **kw)


def _layer(stacked, i):
    """Layer ``i`` of a stacked block, as its own module (a copy)."""
    graphdef, state = nnx.split(stacked)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


def _nnx_direct(stack, x1, x2, scale, deterministic):
    for i in range(stack.length):
        x1 = x1 + _layer(stack.f, i)(x2, scale, deterministic)
        x2 = x2 + _layer(stack.g, i)(x1, scale, deterministic)
    return x1, x2


def _nnx_grads(stack, deterministic=True, direct=False):
    graphdef, params, rest = nnx.split(stack, nnx.Param, ...)
    scale = jnp.float32(1.5)

    def loss(params, x1, x2, rest):
        m = nnx.merge(graphdef, params, rest, copy=True)
        if direct:
            y1, y2 = _nnx_direct(m, x1, x2, scale, deterministic)
        else:
            y1, y2 = m((x1, x2), scale, deterministic)
        return jnp.sum(jnp.sin(y1) * y2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, X1, X2, rest)


def test_nnx_layout_and_distinct_init():
    stack = _nnx_stack()
    assert stack.f.up.kernel.shape == (L, D, 2 * D)
    assert stack.g.down.bias.shape == (L, D)
    params = nnx.state(stack, nnx.Param)
    assert all(x.shape[0] == L for x in jax.tree.leaves(params))
    kf, kg = stack.f.up.kernel[...], stack.g.up.kernel[...]
    for i in range(L):  # every layer and block initialized with its own key
        assert not np.allclose(kf[i], kf[(i + 1) % L])
        assert not np.allclose(kf[i], kg[i])
    keys = jax.random.key_data(stack.f.drop.rngs.key[...])
    assert keys.shape[0] == L and len({tuple(np.ravel(k)) for k in keys}) == L


@pytest.mark.parametrize("policy", [None, "dots", jax.checkpoint_policies.nothing_saveable])
def test_nnx_gradients_match_direct_loop(policy):
    stack = _nnx_stack(policy=policy)
    assert_close(_nnx_grads(stack), _nnx_grads(stack, direct=True))


def test_nnx_dropout_replays_per_layer_keys():
    stack = _nnx_stack(rate=0.5, anchor_every=3)
    got = _nnx_grads(stack, deterministic=False)
    assert_close(got, _nnx_grads(stack, deterministic=False, direct=True))
    other = _nnx_stack(rate=0.5, seed=5)
    nnx.update(other, nnx.state(stack, nnx.Param))  # same params, other dropout keys
    assert max_rel(got, _nnx_grads(other, deterministic=False, direct=True)) > 1e-2


def test_nnx_rng_counters_advance_like_the_layers():
    stack, ref = _nnx_stack(rate=0.5), _nnx_stack(rate=0.5)
    y = stack((X1, X2), 1.0, False)
    first = tuple(np.asarray(v) for v in y)
    want = _nnx_direct(ref, X1, X2, 1.0, False)
    assert_close(y, want)
    counts = stack.f.drop.rngs.count[...]
    np.testing.assert_array_equal(counts, np.ones(L))
    np.testing.assert_array_equal(stack.g.drop.rngs.count[...], np.ones(L))
    second = stack((X1, X2), 1.0, False)  # new masks on the next call
    assert max_rel(second, first) > 1e-2
    stack((X1, X2), 1.0, True)  # deterministic: no draws
    np.testing.assert_array_equal(stack.f.drop.rngs.count[...], 2 * np.ones(L))


class NnxWide(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(D, D + 8, rngs=rngs)

    def __call__(self, h, *args):
        return self.lin(h)


def test_nnx_errors():
    def make(rngs):
        return NnxMlp(rngs=rngs)

    with pytest.raises(TypeError, match=r"the f block \(NnxWide\) returned float32\[2,24\].*x1"):
        jn.reversible_layers(lambda rngs: NnxWide(rngs=rngs), make, 2, rngs=nnx.Rngs(0))((X1, X2))
    with pytest.raises(ValueError, match=r"g.*BatchStat state"):
        jn.reversible_layers(make, lambda rngs: nnx.BatchNorm(D, rngs=rngs), 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="Module instance"):
        jn.ReversibleLayers(NnxMlp(rngs=nnx.Rngs(0)), make, 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="must return an nnx.Module"):
        jn.ReversibleLayers(lambda rngs: 1.0, make, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="length >= 1"):
        jn.ReversibleLayers(make, make, 0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown policy"):
        jn.ReversibleLayers(make, make, 2, rngs=nnx.Rngs(0), policy="bogus")
    stack = jn.ReversibleLayers(make, make, 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"pair of streams \(x1, x2\)"):
        stack(X1, 1.0)


def _nnx_temp(depth, rate=0.0):
    x = jnp.ones((BM, DM))

    def make(rngs):
        return NnxMlp(DM, rate, rngs=rngs)

    stack = jn.reversible_layers(make, make, depth, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(stack, nnx.Param, ...)

    def loss(params, x, rest):
        y1, y2 = nnx.merge(graphdef, params, rest, copy=True)((x, x), 1.0, rate == 0.0)
        return jnp.sum(y1 * y2)

    compiled = jax.jit(jax.grad(loss)).lower(params, x, rest).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("rate", [0.0, 0.5], ids=["no_dropout", "dropout"])
def test_nnx_memory_flat_in_depth(rate):
    # With dropout the RNG counters are advanced by a loop over the layers whose block
    # computations are dead code: it must not add activation memory either.
    shallow, deep = _nnx_temp(2, rate), _nnx_temp(16, rate)
    assert deep <= 1.15 * shallow, (shallow, deep)
