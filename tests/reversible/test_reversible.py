"""jaxmem.reversible / reversible_scan: gradients equal the direct (unscanned, non-reversible)
computation, memory does not grow with depth, bad input gets clear errors."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem

B, D, H = 3, 8, 16


def f(p, x2):
    return jnp.tanh(jax.nn.gelu(x2 @ p["f1"]) @ p["f2"])


def g(p, y1):
    return jnp.sin(y1 @ p["g1"]) @ p["g2"]


def make_params(depth, scale=0.3, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    shapes = {"f1": (D, H), "f2": (H, D), "g1": (D, H), "g2": (H, D)}
    return {
        n: scale * jax.random.normal(kk, (depth, *s)) / math.sqrt(s[0])
        for kk, (n, s) in zip(k, shapes.items(), strict=True)
    }


X = (jax.random.normal(jax.random.key(10), (B, D)), jax.random.normal(jax.random.key(11), (B, D)))


def layer_slice(params, layer):
    return jax.tree.map(lambda a: a[layer], params)


def direct(fns, params, streams, depth):
    """The coupling as written: a Python loop over layers, every update in order."""
    s = list(streams)
    for layer in range(depth):
        p = layer_slice(params, layer)
        for i, fn in enumerate(fns):
            s[i] = jax.tree.map(jnp.add, s[i], fn(p, *(s[:i] + s[i + 1 :])))
    return tuple(s)


def loss_of(run):
    def loss(params, streams):
        out = run(params, streams)
        return sum(jnp.sum(jnp.cos(v) * (k + 1)) for k, v in enumerate(jax.tree.leaves(out)))

    return loss


def rel_err(a, b):
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    num = sum(float(jnp.sum((u - v) ** 2)) for u, v in pairs)
    den = sum(float(jnp.sum(v**2)) for v in jax.tree.leaves(b))
    return math.sqrt(num / den)


def grads(run, params, streams):
    return jax.jit(jax.value_and_grad(loss_of(run), argnums=(0, 1), allow_int=True))(
        params, streams
    )


@functools.cache
def _direct_at_depth_16():
    """The reference for every anchor_every below, computed (and compiled) once."""
    params = make_params(16)
    want = grads(lambda p, x: direct((f, g), p, x, 16), params, X)
    return params, want, direct((f, g), params, X, 16)


@pytest.mark.parametrize("anchor_every", [None, 1, 3, 4, 16, 100])
def test_gradients_equal_the_direct_computation_at_depth_16(anchor_every):
    params, want, want_out = _direct_at_depth_16()
    got = grads(
        lambda p, x: jaxmem.reversible_scan(f, g, x, p, anchor_every=anchor_every), params, X
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert rel_err(got[1], want[1]) < 1e-5
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # The outputs are the direct computation's, eagerly too.
    out = jaxmem.reversible_scan(f, g, X, params, anchor_every=anchor_every)
    for a, b in zip(out, want_out, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_three_and_four_stream_couplings():
    depth = 6
    k = jax.random.split(jax.random.key(3), 4)
    params = {"w": 0.4 * jax.random.normal(k[0], (depth, 4, D, D)) / math.sqrt(D)}
    three = (
        lambda p, x2, x3: jnp.tanh(x2 @ p["w"][0] + x3 @ p["w"][1]),
        lambda p, y1, x3: jnp.sin(y1 * x3) @ p["w"][2],
        lambda p, y1, y2: jax.nn.gelu((y1 - y2) @ p["w"][3]),
    )
    streams3 = (*X, jax.random.normal(k[1], (B, D)))
    four = tuple(lambda p, *o, i=i: jnp.tanh((o[0] * o[1] + o[2]) @ p["w"][i]) for i in range(4))
    streams4 = (*streams3, jax.random.normal(k[2], (B, D)))
    for fns, streams in ((three, streams3), (four, streams4)):
        coupling = jaxmem.reversible(*fns)
        want = grads(lambda p, x, fns=fns: direct(fns, p, x, depth), params, streams)
        got = grads(lambda p, x, c=coupling: c.scan(x, p), params, streams)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        assert rel_err(got[1], want[1]) < 1e-5
        back = coupling.inverse(layer_slice(params, 0), coupling(layer_slice(params, 0), streams))
        for a, b in zip(back, streams, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_pytree_streams_of_different_shapes_and_closed_over_arrays():
    """x1 a dict, x2 an array of another width: f maps x2-like to x1-like and g back; an array
    the functions close over gets its gradient summed over layers."""
    depth = 5
    shared = jax.random.normal(jax.random.key(4), (D, 2 * D)) * 0.2
    params = {"a": 0.2 * jax.random.normal(jax.random.key(5), (depth, 2 * D, D))}
    streams = ({"h": X[0], "s": X[1][:, 0]}, jax.random.normal(jax.random.key(6), (B, 2 * D)))

    def f2(p, x2):
        h = jnp.tanh(x2 @ p["a"])
        return {"h": h, "s": jnp.sum(h, axis=-1)}

    def coupling(shared):
        def g2(p, y1):
            return jnp.sin(y1["h"] @ shared) + y1["s"][:, None]

        return f2, g2

    def rev(params, streams, shared):
        return jaxmem.reversible_scan(*coupling(shared), streams, params)

    def ref(params, streams, shared):
        return direct(coupling(shared), params, streams, depth)

    def loss(run):
        def value(params, streams, shared):
            return loss_of(lambda p, x: run(p, x, shared))(params, streams)

        return jax.jit(jax.grad(value, argnums=(0, 1, 2)))

    want = loss(ref)(params, streams, shared)
    got = loss(rev)(params, streams, shared)
    # f32 rounding of the inverted layers and of the reference (1.2e-5 on an AMD EPYC CPU with
    # jax 0.12.0.1, 2.6e-6 with 0.10.2); in float64 the two agree to 1e-12.
    assert rel_err(got, want) < 3e-5
    assert float(jnp.abs(want[2]).max()) > 1e-3  # the closed-over array does get a gradient
    assert rel_err(got[2], want[2]) < 3e-5
    with jax.enable_x64(True):
        args64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (params, streams, shared))
        want, got = loss(ref)(*args64), loss(rev)(*args64)
        assert jax.tree.leaves(got)[0].dtype == jnp.float64
        assert rel_err(got, want) < 1e-12


def _dropout(key, x, rate=0.5):
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0.0)


def _dropout_fns():
    def fd(p, x2):
        k = jax.random.fold_in(p["key"], 0)
        return _dropout(k, jnp.maximum(x2 * p["w"], -x2))

    def gd(p, y1):
        k = jax.random.fold_in(p["key"], 1)
        return _dropout(k, y1 * p["v"])

    return fd, gd


def test_dropout_masks_replay_exactly():
    """Small integers and power-of-two scales: every value is exact in float32, so the
    reconstruction is exact and the gradients are bit-equal to the direct computation's with
    the same per-layer keys, and differ from it with other keys."""
    depth = 8
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.integers(-1, 2, (depth, B, D)), jnp.float32),
        "v": jnp.asarray(rng.integers(-1, 2, (depth, B, D)), jnp.float32) * 0.5,
        "key": jax.random.split(jax.random.key(7), depth),
    }
    streams = tuple(jnp.asarray(rng.integers(-3, 4, (B, D)), jnp.float32) for _ in range(2))
    fd, gd = _dropout_fns()

    def loss(run):
        return lambda p, x: sum(jnp.sum(v * v) for v in run(p, x))

    def rev(p, x):
        return jaxmem.reversible_scan(fd, gd, x, p)

    want = jax.grad(loss(lambda p, x: direct((fd, gd), p, x, depth)), (0, 1), allow_int=True)(
        params, streams
    )
    got = jax.jit(jax.grad(loss(rev), (0, 1), allow_int=True))(params, streams)
    assert got[0]["key"].dtype == jax.dtypes.float0
    for name in ("w", "v"):
        np.testing.assert_array_equal(got[0][name], want[0][name])
    np.testing.assert_array_equal(got[1], want[1])
    other = dict(params, key=jax.random.split(jax.random.key(8), depth))
    moved = jax.grad(loss(lambda p, x: direct((fd, gd), p, x, depth)), allow_int=True)(
        other, streams
    )
    assert not np.array_equal(moved["w"], got[0]["w"])


def test_dropout_with_keys_in_params_nonlinear():
    depth = 16
    params = dict(make_params(depth), key=jax.random.split(jax.random.key(9), depth))

    def fd(p, x2):
        return _dropout(jax.random.fold_in(p["key"], 0), f(p, x2), 0.25)

    def gd(p, y1):
        return _dropout(jax.random.fold_in(p["key"], 1), g(p, y1), 0.25)

    want = grads(lambda p, x: direct((fd, gd), p, x, depth), params, X)
    got = grads(lambda p, x: jaxmem.reversible_scan(fd, gd, x, p), params, X)
    for name in ("f1", "f2", "g1", "g2"):
        np.testing.assert_allclose(got[1][0][name], want[1][0][name], rtol=1e-4, atol=1e-5)


def test_policy_inside_f_and_g_keeps_gradients():
    depth = 4
    params = make_params(depth)
    want = grads(lambda p, x: jaxmem.reversible_scan(f, g, x, p), params, X)
    for policy in ("dots", jax.checkpoint_policies.nothing_saveable):
        got = grads(
            lambda p, x, pol=policy: jaxmem.reversible_scan(f, g, x, p, policy=pol), params, X
        )
        assert rel_err(got[1], want[1]) < 1e-6


def test_bfloat16_streams_keep_their_dtype():
    depth = 4
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), make_params(depth))
    streams = tuple(v.astype(jnp.bfloat16) for v in X)
    out = jaxmem.reversible_scan(f, g, streams, params)
    assert [v.dtype for v in out] == [jnp.bfloat16] * 2
    got = grads(lambda p, x: jaxmem.reversible_scan(f, g, x, p), params, streams)
    ref = grads(
        lambda p, x: direct((f, g), p, x, depth),
        jax.tree.map(lambda a: a.astype(jnp.float32), params),
        tuple(v.astype(jnp.float32) for v in streams),
    )
    assert jax.tree.leaves(got[1])[0].dtype == jnp.bfloat16
    assert rel_err(jax.tree.map(lambda a: a.astype(jnp.float32), got[1]), ref[1]) < 0.05


# ------------------------------------------------------------------------------------------
# Memory, structurally.

BIG_B, BIG_D = 64, 128


def _mlp(p, x):
    return jnp.tanh(jax.nn.gelu(x @ p["a"]) @ p["b"])


def _big_params(depth):
    k = jax.random.split(jax.random.key(0), 2)
    return {
        "a": 0.05 * jax.random.normal(k[0], (depth, BIG_D, 4 * BIG_D)),
        "b": 0.05 * jax.random.normal(k[1], (depth, 4 * BIG_D, BIG_D)),
    }


def _temp(loss, *args):
    c = jax.jit(jax.grad(loss)).lower(*args).compile()
    return c.memory_analysis().temp_size_in_bytes


def _rev_loss(anchor_every=None):
    def loss(p, x):
        y1, y2 = jaxmem.reversible_scan(_mlp, _mlp, x, p, anchor_every=anchor_every)
        return jnp.sum(y1 * y2)

    return loss


def _layer(x, p):
    x1, x2 = x
    x1 = x1 + _mlp(p, x2)
    return (x1, x2 + _mlp(p, x1)), None


def _scan_loss(scan):
    def loss(p, x):
        (y1, y2), _ = scan(_layer, x, p)
        return jnp.sum(y1 * y2)

    return loss


BIG_X = (jnp.ones((BIG_B, BIG_D)), jnp.zeros((BIG_B, BIG_D)))


def test_temp_does_not_grow_with_depth_and_stays_below_full_remat():
    temps = {depth: _temp(_rev_loss(), _big_params(depth), BIG_X) for depth in (4, 32)}
    assert temps[32] <= 1.15 * temps[4], temps
    remat = _temp(
        _scan_loss(lambda fn, c, xs: jax.lax.scan(jax.checkpoint(fn), c, xs)),
        _big_params(32),
        BIG_X,
    )
    stock = _temp(_scan_loss(jax.lax.scan), _big_params(32), BIG_X)
    assert temps[32] <= remat < stock, (temps, remat, stock)


def test_saved_residuals_are_the_final_streams_and_the_anchors():
    """What the VJP keeps: the parameters, the final streams and (with anchor_every=k) the
    inputs of each k-layer segment. Nothing else, whatever the depth."""
    depth = 12
    params = _big_params(depth)
    stream_bytes = 2 * BIG_B * BIG_D * 4
    param_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
    for anchor_every, anchors in ((None, 0), (4, 3), (5, 2), (12, 1)):
        _, pullback = jax.vjp(_rev_loss(anchor_every), params, BIG_X)
        saved = {id(v): v for v in jax.tree.leaves(pullback) if hasattr(v, "nbytes")}
        total = sum(v.nbytes for v in saved.values())
        assert total == param_bytes + stream_bytes * (1 + anchors), (anchor_every, total)


# ------------------------------------------------------------------------------------------
# Bad input.


def test_bad_input_messages():
    params = make_params(2)
    with pytest.raises(
        TypeError,
        match=r"f\(p, x2\) must return arrays like stream x1 .*float32\[3,8\].*float32\[3,16\]",
    ):
        jaxmem.reversible_scan(lambda p, x2: x2 @ p["f1"], g, X, params)
    with pytest.raises(TypeError, match=r"g\(p, y1\) must return the structure of stream x2"):
        jaxmem.reversible_scan(f, lambda p, y1: (y1, y1), X, params)
    with pytest.raises(TypeError, match=r"f\(p, x2\) must return arrays like stream x1 .*dtype"):
        jaxmem.reversible_scan(lambda p, x2: f(p, x2).astype(jnp.bfloat16), g, X, params)
    # x1 a dict and x2 an array, f written as if the streams were alike:
    with pytest.raises(
        TypeError,
        match=r"f\(p, x2\) must return the structure of stream x1 \(PyTreeDef\(\{'h': \*\}\)",
    ):
        jaxmem.reversible_scan(f, g, ({"h": X[0]}, X[1]), params)
    with pytest.raises(TypeError, match=r"streams must be a tuple \(x1, x2\) of 2 pytrees"):
        jaxmem.reversible_scan(f, g, X[0], params)
    with pytest.raises(TypeError, match=r"streams must be a tuple \(x1, x2, x3\)"):
        jaxmem.reversible(f, g, g).scan(X, params)
    with pytest.raises(TypeError, match=r"streams\[1\] has dtype int32"):
        jaxmem.reversible_scan(f, g, (X[0], jnp.ones((B, D), jnp.int32)), params)
    with pytest.raises(
        ValueError, match=r"params\['f2'\] has leading axis 3, but params\['f1'\] has 2"
    ):
        jaxmem.reversible_scan(f, g, X, dict(params, f2=jnp.zeros((3, H, D))))
    with pytest.raises(ValueError, match=r"has leading axis 2, but length is 4"):
        jaxmem.reversible_scan(f, g, X, params, length=4)
    with pytest.raises(TypeError, match=r"params\['s'\] is a scalar"):
        jaxmem.reversible_scan(f, g, X, dict(params, s=1.0))
    with pytest.raises(ValueError, match="give length"):
        jaxmem.reversible_scan(lambda p, x: x, lambda p, x: x, X)
    with pytest.raises(ValueError, match="anchor_every must be >= 1"):
        jaxmem.reversible_scan(f, g, X, params, anchor_every=0)
    with pytest.raises(TypeError, match="anchor_every must be None or an int"):
        jaxmem.reversible_scan(f, g, X, params, anchor_every=True)
    with pytest.raises(TypeError, match="at least two functions"):
        jaxmem.reversible(f)
    with pytest.raises(TypeError, match=r"g must be callable"):
        jaxmem.reversible_scan(f, 3, X, params)


def test_length_without_params():
    out = jaxmem.reversible_scan(lambda p, x2: 0.5 * x2, lambda p, y1: -0.25 * y1, X, length=3)
    want = direct((lambda p, x2: 0.5 * x2, lambda p, y1: -0.25 * y1), None, X, 3)
    for a, b in zip(out, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("anchor_every", [None, 2])
def test_every_transformation_matches_the_direct_loop(anchor_every):
    """Forward mode, forward over reverse, reverse over reverse and vmap of each, against the
    same layers run by a Python loop."""
    params = make_params(4)

    def loss(run):
        return lambda p, x: sum(jnp.sum(jnp.sin(y)) for y in run(p, x))

    ours = loss(lambda p, x: jaxmem.reversible_scan(f, g, x, p, anchor_every=anchor_every))
    ref = loss(lambda p, x: direct((f, g), p, x, 4))
    x2 = tuple(jnp.stack([v, -v]) for v in X)

    def modes(params, X, x2):
        return {
            "jvp": lambda h: jax.jvp(h, (params, X), (params, X)),
            "jacfwd": lambda h: jax.jacfwd(h, argnums=1)(params, X),
            "linearize": lambda h: jax.linearize(h, params, X)[1](params, X),
            "hessian": lambda h: jax.hessian(lambda x: h(params, x))(X),
            "grad_of_grad": lambda h: jax.grad(
                lambda p: sum(jnp.sum(v**2) for v in jax.tree.leaves(jax.grad(h)(p, X)))
            )(params),
            "vmap_of_grad": lambda h: jax.vmap(jax.grad(h), in_axes=(None, 0))(params, x2),
            "grad_of_vmap": lambda h: jax.grad(
                lambda p: jnp.sum(jax.vmap(h, in_axes=(None, 0))(p, x2))
            )(params),
            "vmap_of_jvp": lambda h: jax.vmap(
                lambda t: jax.jvp(lambda x: h(params, x), (X,), (t,))[1]
            )(x2),
        }

    def every_mode(h):
        """All the modes of h in one jitted program (one compile, not one per mode)."""
        return jax.jit(lambda *a: {n: m(h) for n, m in modes(*a).items()})(params, X, x2)

    got_all, want_all = every_mode(ours), every_mode(ref)
    assert set(got_all) == set(want_all) == set(modes(params, X, x2))
    for name in got_all:
        got, want = got_all[name], want_all[name]
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)


# ------------------------------------------------------------------------------------------
# On a device mesh (the root conftest gives 8 CPU devices).


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")
@pytest.mark.parametrize(
    "axis_type",
    [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit],
    ids=["auto", "explicit"],
)
def test_data_parallel_on_a_mesh(axis_type):
    """Streams sharded over 'data', weights over 'model': values, gradients and the gradients'
    shardings equal the direct computation's on the same sharded inputs."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    depth, batch = 4, 8
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    params = make_params(depth)
    streams = tuple(jax.random.normal(jax.random.key(i), (batch, D)) for i in (20, 21))
    with jax.set_mesh(mesh):
        params = {
            k: jax.device_put(
                v, NamedSharding(mesh, P(None, None, "model") if k[1] == "1" else P())
            )
            for k, v in params.items()
        }
        streams = tuple(jax.device_put(v, NamedSharding(mesh, P("data"))) for v in streams)
        want = grads(lambda p, x: direct((f, g), p, x, depth), params, streams)
        got = grads(lambda p, x: jaxmem.reversible_scan(f, g, x, p), params, streams)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert rel_err(got[1], want[1]) < 1e-5
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)


def test_vmap_over_an_ensemble_and_reverse_over_reverse():
    """vmap of the gradient (3 stacks with their own weights and inputs) and the gradient of a
    gradient norm equal the direct loop's."""
    depth, members = 4, 3
    params = jax.vmap(lambda s: make_params(depth, seed=s))(jnp.arange(members))
    streams = tuple(jnp.stack([v + m for m in range(members)]) for v in X)

    def rev(p, x):
        return loss_of(lambda p, x: jaxmem.reversible_scan(f, g, x, p))(p, x)

    def ref(p, x):
        return loss_of(lambda p, x: direct((f, g), p, x, depth))(p, x)

    got = jax.jit(jax.vmap(jax.grad(rev, argnums=(0, 1))))(params, streams)
    want = jax.jit(jax.vmap(jax.grad(ref, argnums=(0, 1))))(params, streams)
    assert rel_err(got, want) < 1e-5
    p0 = jax.tree.map(lambda a: a[0], params)

    def grad_norm(loss):
        return lambda p: sum(jnp.sum(v**2) for v in jax.tree.leaves(jax.grad(loss)(p, X)))

    rev_rev = jax.jit(jax.grad(grad_norm(rev)))(p0)
    assert rel_err(rev_rev, jax.jit(jax.grad(grad_norm(ref)))(p0)) < 1e-4
