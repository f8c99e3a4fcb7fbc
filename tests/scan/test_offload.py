"""Tests of host offload: :mod:`jaxmem.offload` and ``jaxmem.scan(..., offload=...)``.

On CPU offload is the identity, so values and gradients are compared bit for bit with the
non-offloaded computation. Whether offload happens on GPU/TPU is checked structurally, without the
hardware: the training step is lowered with ``jax.export`` for ``cuda`` and ``tpu`` and the
``annotate_device_placement`` custom calls are counted (``_xla_buffer_placement = "pinned_host"``
where a value goes to the host, ``"device"`` where it comes back).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmem
from jaxmem import offload
from jaxmem._src import offload as offload_src
from jaxmem._src.listing import saved_residuals
from tests.helpers import assert_trees_close, assert_trees_equal, lower_text, placements

# On CPU every offload is the identity (host memory is the same memory), and this module
# checks offload there: each loop warns offload_noop, as a user's would.
pytestmark = pytest.mark.filterwarnings("ignore:offload_noop:jaxmem.LintWarning")

L, B, D, F = 3, 2, 4, 8
SCAN_MODES = ("residuals", "carries", "all", "names")
PLATFORMS = ("cuda", "tpu")
# Offloaded names cost recompute="auto"'s cut no device bytes, so with offload it may keep a name
# and recompute what follows it where without offload it keeps the later value: a different plan,
# and a recomputed value may round differently (at XLA -O0 a recomputed tanh does). The bodies use
# the count-based cut, the same plan with and without offload, so that the bit-identity checks
# the placements alone.
RECOMPUTE = "cheap"


# ------------------------------------------------------------------------------------------
# Helpers and bodies.


def memory_kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def layernorm(x, g, b):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g[None] + b[None]


def block(x, p):
    """A pre-LN MLP block (layernorm, dot, gelu, dot, tanh, residual) with named values."""
    h = checkpoint_name(layernorm(x, p["g"], p["b"]), "mlp_in")
    u = checkpoint_name(h @ p["w1"], "mlpwi")
    y = jax.nn.gelu(u) @ p["w2"]
    x = x + jnp.tanh(y)
    return x, jnp.sum(x, -1)


def normal(rng, shape, scale=1.0):
    """Test data from numpy (no per-op compilation of jax.random in eager mode)."""
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def block_params(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "g": 1 + normal(rng, (L, D), 0.1),
        "b": normal(rng, (L, D), 0.1),
        "w1": normal(rng, (L, D, F), 0.5),
        "w2": normal(rng, (L, F, D), 0.3),
    }
    return params, normal(rng, (B, D))


def block_loss(offload_):
    def loss(params, x0):
        x, ys = jaxmem.scan(block, x0, params, offload=offload_, recompute=RECOMPUTE)
        return jnp.sum(x**2) + jnp.sum(ys)

    return loss


def rnn_loss(offload_):
    def loss(w, u, xs, h0):
        def step(h, x):
            a = checkpoint_name(h @ w, "pre") + x
            return jnp.tanh(a) * jax.nn.sigmoid(h @ u), None

        h, _ = jaxmem.scan(step, h0, xs, offload=offload_, recompute=RECOMPUTE)
        return jnp.sum(h**2)

    return loss


def rnn_args():
    rng = np.random.default_rng(1)
    return (
        normal(rng, (D, D), 0.5),
        normal(rng, (D, D), 0.5),
        normal(rng, (L, B, D)),
        normal(rng, (B, D)),
    )


CASES = {
    # name: (loss factory, args, the offload names, what the plan stacks: (#partial activations,
    # #carry sequences, #named partial activations)). The plans are checked below, so a change of
    # the residual analysis shows up as such, not as a wrong annotation count.
    "block": (block_loss, block_params, ("mlpwi",), (4, 1, 1)),
    "rnn": (rnn_loss, rnn_args, ("pre",), (2, 1, 1)),
}


def case(name, mode):
    make_loss, make_args, names, counts = CASES[name]
    return make_loss(names if mode == "names" else mode), make_args(), counts


def test_case_plans_stack_what_the_counts_say():
    params, x0 = block_params()
    kinds = [r.kind for r in jaxmem.scan_residuals(block, x0, params).stacked]
    assert (kinds.count("stacked"), kinds.count("carry")) == CASES["block"][3][:2]
    w, u, xs, h0 = rnn_args()

    def step(h, x):
        a = checkpoint_name(h @ w, "pre") + x
        return jnp.tanh(a) * jax.nn.sigmoid(h @ u), None

    kinds = [r.kind for r in jaxmem.scan_residuals(step, h0, xs).stacked]
    assert (kinds.count("stacked"), kinds.count("carry")) == CASES["rnn"][3][:2]


# ------------------------------------------------------------------------------------------
# jaxmem.scan(offload=...): bit-identical on CPU, placement annotations for GPU/TPU.


@functools.cache
def reference(name):
    """Value and gradients of a case without offload (computed once per case)."""
    loss, args, _ = case(name, None)
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))(*args)


@pytest.mark.parametrize("mode", SCAN_MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_scan_offload_is_bit_identical_on_cpu(name, mode):
    loss, args, _ = case(name, mode)
    argnums = tuple(range(len(args)))
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=argnums))(*args)
    ref_value, ref_grads = reference(name)
    assert_trees_equal((value, grads), (ref_value, ref_grads))
    if mode == "all":  # Eagerly too (the custom VJP runs op by op around the placements).
        assert_trees_equal(jax.grad(loss, argnums=argnums)(*args), ref_grads)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("mode", (None, *SCAN_MODES))
@pytest.mark.parametrize("name", sorted(CASES))
def test_scan_offload_lowers_to_placement_annotations(name, mode, platform):
    loss, args, (n_stacked, n_carry, n_named) = case(name, mode)
    text = lower_text(jax.grad(loss, argnums=tuple(range(len(args)))), args, platform)
    expected = {
        None: 0,
        "residuals": n_stacked,
        "carries": n_carry,
        "all": n_stacked + n_carry,
        "names": n_named,
    }[mode]
    # One to-host copy per offloaded stacked value in the forward loop, one copy back per value
    # in the backward loop.
    assert placements(text) == (expected, expected)
    if mode is not None:
        assert expected > 0  # Every mode offloads something in these bodies.


def test_scan_offload_names_select_only_the_named_values():
    params, x0 = block_params()
    texts = {
        names: lower_text(jax.grad(block_loss(names)), (params, x0), "cuda")
        for names in (("mlpwi",), ("mlp_in", "mlpwi"), ("mlp_in",))
    }
    assert placements(texts[("mlpwi",)]) == (1, 1)
    assert placements(texts[("mlp_in", "mlpwi")]) == (1, 1)
    # mlp_in (the layernorm output) is recomputed from stacked statistics, never stacked: naming
    # it offloads nothing (a name selects among the partial activations only).
    assert placements(texts[("mlp_in",)]) == (0, 0)


def test_scan_offload_names_that_name_nothing_raise():
    params, x0 = block_params()
    with pytest.raises(ValueError, match=r"\['nope'\].*\['mlp_in', 'mlpwi'\]"):
        jax.grad(block_loss(("nope",)))(params, x0)
    with pytest.raises(ValueError, match=r"\['nope'\].*\['mlp_in', 'mlpwi'\]"):
        jaxmem.scan_residuals(block, x0, params, offload=("mlpwi", "nope"))


@pytest.mark.parametrize("bad", ["bogus", 3, (), [1, 2], ("mlpwi", 3)])
def test_scan_bad_offload_values_raise(bad):
    params, x0 = block_params()
    with pytest.raises(ValueError, match="offload="):
        jaxmem.scan(block, x0, params, offload=bad)


# ------------------------------------------------------------------------------------------
# supported, to_host, to_device.


def test_supported():
    assert offload.supported()
    assert all(offload.supported(d) for d in jax.devices())
    assert "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}

    class Broken:
        def addressable_memories(self):
            raise RuntimeError("no memories")

    for not_a_device in ("cpu", None.__class__, Broken()):
        assert offload.supported(not_a_device) is False


@pytest.mark.parametrize(
    "make",
    [
        lambda: jnp.arange(6.0).reshape(2, 3),
        lambda: np.arange(6, dtype=np.int32),
        lambda: 2.5,
        lambda: jnp.ones((2,), jnp.bfloat16),
    ],
    ids=["jax", "numpy", "scalar", "bf16"],
)
def test_to_host_to_device_eager(make):
    x = make()
    h = offload.to_host(x)
    assert len(h.sharding.device_set) == 1 and h.sharding.is_fully_replicated
    assert h.sharding.memory_kind == "pinned_host"
    d = offload.to_device(h)
    assert d.sharding.memory_kind == "device"
    assert d.sharding.device_set == h.sharding.device_set
    assert_trees_equal((h, d), (jnp.asarray(x), jnp.asarray(x)))


def test_to_host_keeps_named_sharding():
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    tree = {
        "w": jax.device_put(jnp.arange(32.0).reshape(4, 8), NamedSharding(mesh, P("a", "b"))),
        "v": jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("b"))),
        "r": jax.device_put(jnp.arange(3), NamedSharding(mesh, P())),
    }
    host = offload.to_host(tree)
    back = offload.to_device(host)
    for moved, kind in ((host, "pinned_host"), (back, "device")):
        for k, x in tree.items():
            s = moved[k].sharding
            assert isinstance(s, NamedSharding)
            assert (s.mesh, s.spec, s.memory_kind) == (mesh, x.sharding.spec, kind)
            assert [sh.device for sh in moved[k].addressable_shards] == [
                sh.device for sh in x.addressable_shards
            ]
    assert_trees_equal(host, tree)
    assert_trees_equal(back, tree)


def test_to_host_inside_jit():
    mesh = jax.make_mesh((8,), ("data",))
    tree = {
        "x": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data"))),
        "y": jax.device_put(jnp.ones(3), NamedSharding(mesh, P())),
    }

    def roundtrip(t):
        return offload.to_device(offload.to_host(jax.tree.map(lambda v: v * 2, t)))

    # Outputs of jit moved by to_host are returned in host memory, sharding kept.
    host = jax.jit(offload.to_host)(tree)
    assert memory_kinds(host) == {"pinned_host"}
    assert host["x"].sharding.spec == P("data")
    assert memory_kinds(jax.jit(offload.to_device)(host)) == {"device"}
    assert_trees_equal(jax.jit(roundtrip)(tree), jax.tree.map(lambda v: v * 2, tree))
    single = {"x": jnp.arange(16.0), "y": jnp.ones(3)}
    for platform in PLATFORMS:
        assert placements(lower_text(roundtrip, (single,), platform)) == (2, 2)
        # With a mesh, jit adds its own device placement of the outputs: at least ours are there.
        n_host, n_device = placements(lower_text(roundtrip, (tree,), platform))
        assert n_host == 2 and n_device >= 2
        # A host-resident argument: only the way back is annotated.
        host_single = offload.to_host(single)
        assert placements(lower_text(offload.to_device, (host_single,), platform)) == (0, 2)
    # Nothing to do for a value already on the device.
    assert placements(lower_text(offload.to_device, (tree,), "cuda")) == (0, 0)


def test_to_host_under_grad_and_vmap():
    x = jnp.arange(4.0)

    def f(x):
        return jnp.sum(jnp.sin(offload.to_device(offload.to_host(x * 3))))

    def g(h):  # A host-resident argument, brought to the device (as fetch_params does).
        return jnp.sum(jnp.sin(offload.to_device(h) * 3))

    ref = jax.grad(lambda x: jnp.sum(jnp.sin(x * 3)))(x)
    assert_trees_equal(jax.grad(f)(x), ref)
    # (jax.jit(jax.grad(f)) fails inside JAX 0.10.2 itself, see the to_host docstring.)
    for grad_g in (jax.grad(g), jax.jit(jax.grad(g))):
        grad = grad_g(offload.to_host(x))
        assert grad.sharding.memory_kind == "pinned_host"
        assert_trees_equal(grad, ref)
    out = jax.vmap(offload.to_host)(jnp.ones((2, 3)))
    assert out.sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("fn", [offload.to_host, offload.to_device])
def test_non_array_leaf_names_its_path(fn):
    tree = {"a": [jnp.ones(2), "oops"], "b": 1.0}
    with pytest.raises(TypeError, match=r"jaxmem\.offload\.to_\w+: argument tree\['a'\]\[1\]"):
        fn(tree)
    with pytest.raises(TypeError, match=r"tree\['s'\]"):
        fn({"s": jax.ShapeDtypeStruct((2,), jnp.float32)})


def test_unsupported_backend_raises(monkeypatch):
    monkeypatch.setattr(offload_src, "supported", lambda device=None: False)
    with pytest.raises(RuntimeError, match="the cpu backend has no pinned_host memory"):
        offload.to_host(jnp.ones(2))
    with pytest.raises(RuntimeError, match="the cpu backend has no pinned_host memory"):
        jax.jit(offload.to_host)(jnp.ones(2))
    with pytest.raises(RuntimeError, match=r"offload_opt_state\(\.\.\.\)\.init"):
        offload.offload_opt_state(optax.adam(0.1)).init({"w": jnp.ones(2)})
    # Coming back needs no host memory.
    assert offload.to_device(jnp.ones(2)).sharding.memory_kind == "device"


# ------------------------------------------------------------------------------------------
# fetch_params: stacked layer parameters in host memory, one layer's slice fetched per step.


def plain_block(x, p):
    return jnp.tanh(layernorm(x, p["g"], p["b"]) @ p["w1"]) @ p["w2"] + x, None


def test_fetch_params_with_lax_scan_matches_device_params():
    params, x0 = block_params()
    host = offload.to_host(params)

    def loss(step):
        return lambda p, x: jnp.sum(jax.lax.scan(step, x, p)[0] ** 2)

    grad_fn = jax.value_and_grad(loss(offload.fetch_params(plain_block)), argnums=(0, 1))
    ref = jax.jit(jax.value_and_grad(loss(plain_block), argnums=(0, 1)))(params, x0)
    # Compiled alike, bit-identical; run op by op, the loss's sum may round differently (by one
    # ulp on jax 0.12.1), the gradients alike.
    for fn, same in ((grad_fn, assert_trees_close), (jax.jit(grad_fn), assert_trees_equal)):
        value, (g_params, g_x0) = fn(host, x0)
        same((value, (g_params, g_x0)), ref)
        assert memory_kinds(g_params) == {"pinned_host"}  # Cotangents live where params do.


def test_fetch_params_with_jaxmem_scan_forward():
    params, x0 = block_params()
    host = offload.to_host(params)
    step = offload.fetch_params(plain_block)
    ref = jaxmem.scan(plain_block, x0, params)
    assert_trees_equal(jaxmem.scan(step, x0, host), ref)
    assert_trees_equal(jax.jit(lambda p, x: jaxmem.scan(step, x, p))(host, x0), ref)


def test_fetch_params_with_jaxmem_scan_gradient_device_params():
    params, x0 = block_params()

    def loss(step):
        return lambda p, x: jnp.sum(jaxmem.scan(step, x, p)[0] ** 2)

    got = jax.jit(jax.grad(loss(offload.fetch_params(plain_block)), argnums=(0, 1)))(params, x0)
    assert_trees_equal(got, jax.jit(jax.grad(loss(plain_block), argnums=(0, 1)))(params, x0))


def test_fetch_params_with_jaxmem_scan_gradient_host_params():
    params, x0 = block_params()
    step = offload.fetch_params(plain_block)
    got = jax.grad(lambda p, x: jnp.sum(jaxmem.scan(step, x, p)[0] ** 2))(
        offload.to_host(params), x0
    )
    ref = jax.grad(lambda p, x: jnp.sum(jaxmem.scan(plain_block, x, p)[0] ** 2))(params, x0)
    assert_trees_equal(got, ref)


def test_fetch_params_does_not_stack_device_copies():
    params, x0 = block_params()

    def naive(x, p):  # Fetch without fetch_params: lax.scan stacks the device copies.
        return plain_block(x, offload.to_device(p))

    def device_copies(step):
        """Stacked values of jaxmem.scan's plan that are made by to_device (its _put)."""
        plan = jaxmem.scan_residuals(step, x0, params)
        return [r for r in plan.stacked if "(_put)" in r.source]

    assert device_copies(offload.fetch_params(plain_block)) == []
    # Stock lax.scan: the parameter residuals are the scanned-over (host) arguments themselves.
    host = offload.to_host(params)

    def stacked_shapes(step):
        res = saved_residuals(lambda p, x: jnp.sum(jax.lax.scan(step, x, p)[0]), host, x0)
        return {r.shape for r in res if r.origin != "argument"}

    param_shapes = {(L, D, F), (L, F, D), (L, D), (L, 1, D)}
    assert not stacked_shapes(offload.fetch_params(plain_block)) & param_shapes
    assert {(L, D, F), (L, F, D)} <= stacked_shapes(naive)

    # Casts and transposes of the fetched weights are made again too, not stacked.
    ws = offload.to_host(jnp.full((L, D, D), 0.1))

    def cast_t(h, w):
        w = w.T.astype(jnp.bfloat16)
        return jnp.tanh((h.astype(jnp.bfloat16) @ w).astype(jnp.float32)), None

    stacked = {
        r.shape
        for r in saved_residuals(
            lambda w, x: jnp.sum(jax.lax.scan(offload.fetch_params(cast_t), x, w)[0]), ws, x0
        )
        if r.origin != "argument"
    }
    assert (L, D, D) not in stacked


def test_fetch_params_lowers_to_device_placements():
    params, x0 = block_params()
    host = offload.to_host(params)
    step = offload.fetch_params(plain_block)

    def loss(p, x):
        return jnp.sum(jax.lax.scan(step, x, p)[0] ** 2)

    for platform in PLATFORMS:
        n_to_host, n_to_device = placements(lower_text(jax.grad(loss), (host, x0), platform))
        # Forward: one fetch per parameter leaf; backward: fetched again (g, w1, w2 feed the
        # backward step; b only adds), not stacked.
        assert (n_to_host, n_to_device) == (0, 4 + 3)
        n_fwd = placements(lower_text(loss, (host, x0), platform))
        assert n_fwd == (0, 4)
    # Parameters already on the device: nothing to fetch.
    assert placements(lower_text(jax.grad(loss), (params, x0), "cuda")) == (0, 0)


def test_fetch_params_checks_and_wraps():
    with pytest.raises(TypeError, match="fetch_params: step must be callable"):
        offload.fetch_params(3)
    assert offload.fetch_params(plain_block).__name__ == "plain_block"


# ------------------------------------------------------------------------------------------
# offload_opt_state: optimizer state in host memory between steps.


def train_step(opt):
    def step(params, state, batch):
        def loss(p):
            return jnp.mean((jnp.tanh(batch @ p["w"]) + p["b"][None]) ** 2)

        grads = jax.grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def opt_setup():
    rng = np.random.default_rng(2)
    params = {"w": normal(rng, (D, F)), "b": jnp.zeros(F)}
    return params, normal(rng, (B, D))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_offload_opt_state_matches_inner_optimizer(jit):
    params, batch = opt_setup()
    if jit:
        inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-3))
        wrap, n_steps = jax.jit, 3
    else:  # Op by op: keep it small.
        inner, wrap, n_steps = optax.sgd(1e-2, momentum=0.9), (lambda f: f), 1
    opt = offload.offload_opt_state(inner)
    step, ref_step = wrap(train_step(opt)), wrap(train_step(inner))
    state = wrap(opt.init)(params)
    ref_params, ref_state = params, inner.init(params)
    assert memory_kinds(state) == {"pinned_host"}
    for _ in range(n_steps):
        params, state = step(params, state, batch)
        ref_params, ref_state = ref_step(ref_params, ref_state, batch)
        assert memory_kinds(state) == {"pinned_host"}
        assert memory_kinds(params) == {"device"}
    assert_trees_equal((params, state), (ref_params, ref_state))


def test_offload_opt_state_lowers_to_placements():
    params, batch = opt_setup()
    opt = offload.offload_opt_state(optax.adam(1e-2))
    state = opt.init(params)
    n_leaves = len(jax.tree.leaves(state))  # count, mu['w'], mu['b'], nu['w'], nu['b']
    assert n_leaves == 5
    for platform in PLATFORMS:
        text = lower_text(train_step(opt), (params, state, batch), platform)
        assert placements(text) == (n_leaves, n_leaves)  # to the device and back, per leaf
        assert placements(lower_text(opt.init, (params,), platform)) == (n_leaves, 0)
    assert placements(lower_text(train_step(optax.adam(1e-2)), (params, state, batch), "cuda")) == (
        0,
        0,
    )


def test_offload_opt_state_passes_extra_args():
    seen = {}

    def update(updates, state, params=None, *, scale):
        seen["scale"] = scale
        return jax.tree.map(lambda g: g * scale, updates), state

    inner = optax.GradientTransformationExtraArgs(lambda p: {"n": jnp.zeros(())}, update)
    opt = offload.offload_opt_state(inner)
    updates, state = opt.update({"w": jnp.ones(2)}, opt.init({"w": jnp.ones(2)}), scale=3.0)
    assert seen == {"scale": 3.0}
    assert_trees_equal(updates, {"w": jnp.full(2, 3.0)})
    assert memory_kinds(state) == {"pinned_host"}


def test_offload_opt_state_checks_optimizer():
    with pytest.raises(TypeError, match="optimizer must be an optax.GradientTransformation"):
        offload.offload_opt_state(lambda p: p)


# ------------------------------------------------------------------------------------------
# The public namespace.


def test_public_names_have_docstrings():
    assert sorted(offload.__all__) == [
        "fetch_params",
        "offload_opt_state",
        "supported",
        "to_device",
        "to_host",
    ]
    for name in offload.__all__:
        doc = getattr(offload, name).__doc__
        assert doc and "Examples:" in doc, name
