"""jaxmem.flax.nnx: ScanLayers against nnx.scan (values, gradients, RNG and BatchNorm state),
remat both ways, and misuse errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem.policies as policies
from jaxmem.flax import nnx as jn

L, D, F = 3, 4, 8


class Block(nnx.Module):
    def __init__(self, *, rngs, rate=0.3, batch_norm=False):
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, F, rngs=rngs)
        self.down = nnx.Linear(F, D, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.bn = nnx.BatchNorm(D, rngs=rngs) if batch_norm else None

    def __call__(self, h, mask, deterministic=False):
        x = jax.nn.gelu(self.up(self.ln(h))) * mask
        h = h + self.down(self.drop(x, deterministic=deterministic))
        return h if self.bn is None else self.bn(h)


def max_rel(a, b):
    """Largest relative difference over the leaves (numpy: no eager JAX ops to compile)."""

    def rel(x, y):
        if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.max(np.abs(x - y), initial=0.0) / (np.max(np.abs(y), initial=0.0) + 1e-30))

    return max(jax.tree.leaves(jax.tree.map(rel, a, b)), default=0.0)


def reference(layers, h, mask, **kw):
    """The nnx.scan equivalent of ScanLayers.__call__."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(h, block):
        return block(h, mask, **kw)

    return forward(h, layers)


H = np.random.default_rng(0).normal(size=(6, D)).astype(np.float32)
MASK = np.ones((1, F), np.float32)


@pytest.mark.parametrize(
    "deterministic,batch_norm,policy",
    [(True, False, None), (False, False, None), (False, True, None), (False, False, "dots")],
    ids=["no_dropout", "dropout", "batch_norm", "dots"],
)
def test_parity_with_nnx_scan(deterministic, batch_norm, policy):
    stack = jn.ScanLayers(
        lambda rngs: Block(rngs=rngs, batch_norm=batch_norm),
        L,
        rngs=nnx.Rngs(0, dropout=1),
        policy=policy,
    )
    assert stack.layers.up.kernel.shape == (L, D, F)
    ref = nnx.clone(stack)

    @nnx.jit
    def ours(model, h):
        loss = lambda m, h: jnp.sum(m(h, MASK, deterministic=deterministic) ** 2)
        return nnx.value_and_grad(loss, argnums=(0, 1))(model, h)

    @nnx.jit
    def stock(model, h):
        def loss(m, h):
            return jnp.sum(reference(m.layers, h, MASK, deterministic=deterministic) ** 2)

        return nnx.value_and_grad(loss, argnums=(0, 1))(model, h)

    for _ in range(2):  # the second step sees the RNG counters / statistics the first one left
        (v, (g, gh)), (v_ref, (g_ref, gh_ref)) = ours(stack, H), stock(ref, H)
        assert max_rel((v, nnx.state(g), gh), (v_ref, nnx.state(g_ref), gh_ref)) <= 1e-6
        assert max_rel(nnx.state(stack), nnx.state(ref)) <= 1e-6
    if batch_norm:
        assert float(jnp.max(jnp.abs(stack.layers.bn.mean[...]))) > 0.0  # statistics moved
    if not deterministic:
        assert int(stack.layers.drop.rngs.count[...][0]) == 2  # 2 masks per layer


def test_scan_layers_function_and_reverse():
    def make(rngs):
        return nnx.Linear(D, D, rngs=rngs)

    stack = jn.scan_layers(make, L, rngs=nnx.Rngs(0), reverse=True, policy="nothing")
    layers = stack.layers
    out = nnx.jit(lambda m, h: m(h))(stack, H)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, reverse=True)
    def forward(h, layer):
        return layer(h)

    assert max_rel(out, forward(H, layers)) <= 1e-6


@pytest.mark.parametrize("policy", [None, "dots", policies.selective()])
def test_remat_both_ways(policy):
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(D, F, rngs=rngs), nnx.Linear(F, D, rngs=rngs)

        def __call__(self, x):
            return self.down(jnp.tanh(self.up(x)))

    class Remat(MLP):
        @jn.remat(policy=policy)
        def __call__(self, x):
            return MLP.__call__(self, x)

    @jn.remat
    def bare(m, x):
        return m(x)

    model = MLP(nnx.Rngs(0))
    rematted = Remat(nnx.Rngs(0))
    grad = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2)))
    g = grad(model, H)
    assert max_rel(nnx.state(grad(rematted, H)), nnx.state(g)) <= 1e-6
    g_bare = nnx.jit(nnx.grad(lambda m, x: jnp.sum(bare(m, x) ** 2)))(model, H)
    assert max_rel(nnx.state(g_bare), nnx.state(g)) <= 1e-6


def test_errors():
    make = lambda rngs: nnx.Linear(D, D, rngs=rngs)
    with pytest.raises(ValueError, match="length >= 1"):
        jn.scan_layers(make, 0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="Module instance"):
        jn.scan_layers(make(nnx.Rngs(0)), 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="must return an nnx.Module"):
        jn.scan_layers(lambda rngs: 1.0, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown policy 'full'"):
        jn.scan_layers(make, 2, rngs=nnx.Rngs(0), policy="full")
    model = make(nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"bound method Linear.__call__.*class body"):
        jn.remat(model.__call__)
    with pytest.raises(TypeError, match=r"bound method"):
        jn.remat(policy="dots")(model.__call__)
    with pytest.raises(TypeError, match="rematerializes functions"):
        jn.remat(nnx.Linear)
    # A stack whose layers were replaced by unstacked ones names the variable and the fix.
    stack = jn.scan_layers(make, 2, rngs=nnx.Rngs(0))
    stack.layers = make(nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"layers.bias has shape \(4,\).*length=2"):
        stack(H)


# ------------------------------------------------------------------------------------------
# jaxmem.flax.nnx.scan against nnx.scan.


def _stacked_blocks(batch_norm=True):
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(rngs):
        return Block(rngs=rngs, batch_norm=batch_norm)

    return create(nnx.Rngs(0, dropout=1))


@pytest.mark.parametrize(
    "graph,graph_updates,policy,reverse",
    [(True, True, None, False), (True, False, "dots", True), (False, False, None, False)],
    ids=["graph_updates", "graph_dots_reverse", "tree"],
)
def test_scan_matches_nnx_scan(graph, graph_updates, policy, reverse):
    # Values, gradients (layers and input) and written-back state (BatchNorm statistics, RNG
    # counters) equal nnx.scan's, in the three modes of nnx.scan.
    def run(scan_fn, **kw):
        blocks = _stacked_blocks()
        forward = scan_fn(
            lambda block, h: block(h, MASK),
            in_axes=(0, nnx.Carry),
            out_axes=nnx.Carry,
            reverse=reverse,
            graph=graph,
            graph_updates=graph_updates,
            **kw,
        )
        loss = lambda m, h: jnp.sum(forward(m, h) ** 2)
        out = nnx.value_and_grad(loss, argnums=(0, 1))(blocks, H)
        return out, nnx.state(blocks)

    (v, (g, gh)), state = run(jn.scan, policy=policy)
    (v_ref, (g_ref, gh_ref)), state_ref = run(nnx.scan)
    assert max_rel((v, nnx.state(g), gh), (v_ref, nnx.state(g_ref), gh_ref)) <= 1e-6
    assert max_rel(state, state_ref) <= 1e-6
    assert float(jnp.max(jnp.abs(state["bn"]["mean"][...]))) > 0.0  # statistics written back


def test_scan_state_axes_split_rngs_decorator():
    # The class-body decorator form with StateAxes (params scanned, dropout stream broadcast)
    # and split_rngs around it, as in Flax's docs; compared with nnx.scan's decorator.
    def model_cls(scan_fn):
        state_axes = nnx.StateAxes({(nnx.Param, "params"): 0, ...: None})

        class MLP(nnx.Module):
            @nnx.split_rngs(splits=L, only="params")
            @nnx.vmap(in_axes=(state_axes, state_axes))
            def __init__(self, rngs: nnx.Rngs):
                self.linear = nnx.Linear(D, D, rngs=rngs)
                self.drop = nnx.Dropout(0.5, rngs=rngs)

            @scan_fn(in_axes=(state_axes, nnx.Carry), out_axes=nnx.Carry)
            def __call__(self, x):
                return jnp.tanh(self.drop(self.linear(x)))

        return MLP

    def run(scan_fn):
        model = model_cls(scan_fn)(nnx.Rngs(params=0, dropout=1))
        grads = nnx.grad(lambda m: jnp.sum(m(H) ** 2))(model)
        return grads, nnx.state(model)

    ours = lambda **kw: jn.scan(policy="dots", **kw)
    (g, state), (g_ref, state_ref) = run(ours), run(nnx.scan)
    assert g.linear.kernel.shape == (L, D, D)
    assert max_rel((nnx.state(g), state), (nnx.state(g_ref), state_ref)) <= 1e-6


def test_scan_traces_once_and_closes_over_tracers():
    traces = []

    @jn.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def cumsum(c, x):
        traces.append(None)
        return c + x, c

    for _ in range(2):
        c, ys = cumsum(jnp.float32(0.0), jnp.arange(4.0))
    assert len(traces) == 1 and float(c) == 6.0 and ys.tolist() == [0.0, 0.0, 1.0, 3.0]

    # A body closing over values traced by an outer jit/grad: gradients reach them.
    def loss(scan_fn, w, xs):
        step = lambda c, x: (jnp.sin(c * w) + x, c)
        return jnp.sum(scan_fn(step, in_axes=(nnx.Carry, 0))(jnp.zeros(3), xs)[0] ** 2)

    xs = jnp.asarray(H[:4, :3])
    for w in (0.5, 2.0):
        g = jax.jit(jax.grad(lambda w: loss(jn.scan, w, xs)))(w)
        assert max_rel(g, jax.grad(lambda w: loss(nnx.scan, w, xs))(w)) <= 1e-6


def test_forward_mode_matches_nnx_scan():
    """Forward mode (jvp, linearize, jacfwd, hessian, vmap of jvp) and grad of grad through the
    drop-in equal nnx.scan's."""
    xs = jnp.asarray(H[:4, :3])

    def f(scan_fn):
        step = lambda c, x: (jnp.sin(c * 0.7) + x, jnp.cos(c))
        run = scan_fn(step, in_axes=(nnx.Carry, 0))
        return lambda c: jnp.sum(run(c, xs)[0] ** 2) + jnp.sum(run(c, xs)[1])

    c, t = jnp.asarray(H[0, :3]), jnp.asarray(H[1, :3])
    for transform in (
        lambda g: jax.jvp(g, (c,), (t,)),
        lambda g: jax.jacfwd(g)(c),
        lambda g: jax.hessian(g)(c),
        lambda g: jax.linearize(g, c)[1](t),
        lambda g: jax.vmap(lambda t: jax.jvp(g, (c,), (t,)))(jnp.stack([t, 2 * t])),
        lambda g: jax.grad(lambda c: jnp.sum(jax.grad(g)(c) ** 2))(c),
    ):
        # Jitted: one program each, not op by op.
        got, want = (jax.jit(lambda s=s: transform(f(s)))() for s in (jn.scan, nnx.scan))  # noqa: B023
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert max_rel(a, b) <= 1e-5


def test_scan_errors():
    with pytest.raises(ValueError, match="unknown policy 'full'"):
        jn.scan(lambda c, x: (c, x), policy="full")
    with pytest.raises(ValueError, match="recompute"):
        jn.scan(recompute="all")
    with pytest.raises(ValueError, match="Cannot broadcast output state"):
        jn.scan(lambda c, x: (c, x), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, None))
    model = nnx.Linear(D, D, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="bound methods"):
        jn.scan(model.__call__, in_axes=(nnx.Carry,), out_axes=nnx.Carry)
    with pytest.raises(TypeError, match="expects a function"):
        jn.scan(3)


class GPTBlock(nnx.Module):
    """A GPT-style block with dropout and BatchNorm: causal attention, a GELU MLP."""

    def __init__(self, *, rngs):
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, D, decode=False, dropout_rate=0.2, rngs=rngs)
        self.up = nnx.Linear(D, F, rngs=rngs)
        self.down = nnx.Linear(F, D, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.bn = nnx.BatchNorm(D, rngs=rngs)

    def __call__(self, h, mask, deterministic=False):
        causal = nnx.make_causal_mask(jnp.ones(h.shape[:2]))
        h = h + self.attn(self.ln(h), mask=causal, deterministic=deterministic)
        x = jax.nn.gelu(self.up(h)) * mask[None]
        return self.bn(h + self.down(self.drop(x, deterministic=deterministic)))


def test_parity_with_nnx_scan_gpt_block_dropout_batch_norm():
    """Values, gradients, RNG counters and BatchNorm statistics equal nnx.scan's, two steps."""
    stack = jn.ScanLayers(lambda rngs: GPTBlock(rngs=rngs), L, rngs=nnx.Rngs(0, dropout=1))
    ref = nnx.clone(stack)
    h = np.random.default_rng(2).normal(size=(2, 3, D)).astype(np.float32)

    @nnx.jit
    def ours(model, h):
        loss = lambda m, h: jnp.sum(m(h, MASK) ** 2)
        return nnx.value_and_grad(loss, argnums=(0, 1))(model, h)

    @nnx.jit
    def stock(model, h):
        loss = lambda m, h: jnp.sum(reference(m.layers, h, MASK) ** 2)
        return nnx.value_and_grad(loss, argnums=(0, 1))(model, h)

    for _ in range(2):
        (v, (g, gh)), (v_ref, (g_ref, gh_ref)) = ours(stack, h), stock(ref, h)
        assert max_rel((v, nnx.state(g), gh), (v_ref, nnx.state(g_ref), gh_ref)) <= 1e-6
        assert max_rel(nnx.state(stack), nnx.state(ref)) <= 1e-6
    assert float(jnp.max(jnp.abs(stack.layers.bn.mean[...]))) > 0.0
