"""Tests of jaxmem.losses.linear_cross_entropy against naive references written with optax."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

from jaxmem._src.jax_compat import compile_to_measure
from jaxmem._src.listing import saved_residuals
from jaxmem._src.scan.jaxprs import iter_eqns
from jaxmem.losses import default_tiles, linear_cross_entropy

N, D, V, C = 12, 8, 50, 16  # V is not a multiple of C
RTOL = 1e-5


def _data(shape=(N,), v=V, d=D, seed=0, dtype=jnp.float32):
    """x[*shape, d], w[d, v], b[v], labels[*shape] (numpy RNG: no compilation per shape)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((*shape, d)), dtype)
    w = jnp.asarray(rng.standard_normal((d, v)) / 2, dtype)
    b = jnp.asarray(rng.standard_normal((v,)), dtype)
    labels = jnp.asarray(rng.integers(0, v, shape), jnp.int32)
    return x, w, b, labels


def _naive(
    x,
    w,
    b,
    labels,
    *,
    mask=None,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    reduction="mean",
):
    """The loss written plainly: full logits, optax cross-entropy, then reduction."""
    logits = jnp.einsum("...d,dv->...v", x, w, preferred_element_type=jnp.float32)
    if b is not None:
        logits = logits + b.astype(jnp.float32)[(None,) * (logits.ndim - 1)]
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    v = w.shape[1]
    onehot = jax.nn.one_hot(labels, v)
    targets = optax.smooth_labels(onehot, label_smoothing) if label_smoothing else onehot
    loss = optax.softmax_cross_entropy(logits, targets)
    loss = loss + z_loss * jax.nn.logsumexp(logits, axis=-1) ** 2
    if mask is None:
        mask = jnp.ones(labels.shape, bool)
    loss = jnp.where(mask, loss, 0.0)
    if reduction == "mean":
        return loss.sum() / mask.sum()
    if reduction == "sum":
        return loss.sum()
    return loss


def _assert_close(a, b, rtol=RTOL):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.abs(b[np.isfinite(b)]).max(initial=0.0)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


def _compare(ours, ref, argnums, *args, rtol=RTOL):
    """Values and gradients of ``ours`` and ``ref`` (scalar functions), in one compiled call."""

    @jax.jit
    def both(*args):
        return (
            jax.value_and_grad(ours, argnums)(*args),
            jax.value_and_grad(ref, argnums)(*args),
        )

    (v_ours, g_ours), (v_ref, g_ref) = both(*args)
    _assert_close(v_ours, v_ref, rtol)
    for go, gr in zip(g_ours, g_ref, strict=True):
        assert go.shape == gr.shape and go.dtype == gr.dtype
        _assert_close(go, gr, rtol)


def _check(kwargs, naive_kwargs, shape=(N,), with_bias=True):
    x, w, b, labels = _data(shape)
    b = b if with_bias else None

    def ours(x, w, b):
        return linear_cross_entropy(x, w, labels, bias=b, chunk_size=C, **kwargs)

    def ref(x, w, b):
        return _naive(x, w, b, labels, **naive_kwargs)

    argnums = (0, 1, 2) if with_bias else (0, 1)
    if kwargs.get("reduction") == "none":
        ours, ref = (lambda *a, f=f: jnp.sum(jnp.sin(f(*a))) for f in (ours, ref))
    _compare(ours, ref, argnums, x, w, b)


def test_matches_optax_plain():
    x, w, _, labels = _data()
    _compare(
        lambda x, w: linear_cross_entropy(x, w, labels, chunk_size=C),
        lambda x, w: optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean(),
        (0, 1),
        x,
        w,
    )


@pytest.mark.parametrize(
    "kwargs,naive_kwargs",
    [
        ({}, {}),
        ({"label_smoothing": 0.2}, {"label_smoothing": 0.2}),
        ({"z_loss": 1e-2}, {"z_loss": 1e-2}),
        ({"logit_softcap": 2.0}, {"softcap": 2.0}),
        (
            {"label_smoothing": 0.1, "z_loss": 0.1, "logit_softcap": 3.0},
            {"label_smoothing": 0.1, "z_loss": 0.1, "softcap": 3.0},
        ),
        ({"reduction": "sum"}, {"reduction": "sum"}),
        ({"reduction": "none"}, {"reduction": "none"}),
    ],
)
def test_variants_match_naive(kwargs, naive_kwargs):
    _check(kwargs, naive_kwargs)


def test_without_bias_and_chunk_larger_than_vocab():
    x, w, _, labels = _data()
    ref = jax.jit(lambda x, w: _naive(x, w, None, labels))(x, w)
    for chunk in (1, 7, V, 1000):
        f = jax.jit(functools.partial(linear_cross_entropy, chunk_size=chunk))
        _assert_close(f(x, w, labels), ref)


def test_batch_dims():
    _check({"reduction": "none"}, {"reduction": "none"}, shape=(2, 3, 2), with_bias=False)


def test_where_and_ignore_index():
    x, w, b, labels = _data((2, 6))
    where = jnp.arange(12).reshape(2, 6) % 3 != 0
    labels = labels.at[1, 1].set(-100)
    mask = where & (labels != -100)
    for reduction in ("mean", "sum", "none"):

        def ours(x, w, b, reduction=reduction):
            out = linear_cross_entropy(
                x,
                w,
                labels,
                bias=b,
                where=where,
                ignore_index=-100,
                reduction=reduction,
                chunk_size=C,
            )
            return jnp.sum(jnp.cos(out))

        def ref(x, w, b, reduction=reduction):
            safe = jnp.where(mask, labels, 0)
            out = _naive(x, w, b, safe, mask=mask, reduction=reduction)
            return jnp.sum(jnp.cos(out))

        _compare(ours, ref, (0, 1, 2), x, w, b)
    # masked tokens get zero gradient w.r.t. their own x
    dx = jax.jit(
        jax.grad(lambda x: linear_cross_entropy(x, w, labels, where=where, ignore_index=-100))
    )(x)
    assert np.all(np.asarray(dx)[~np.asarray(mask)] == 0)
    none = linear_cross_entropy(x, w, labels, where=where, ignore_index=-100, reduction="none")
    assert np.all(np.asarray(none)[~np.asarray(mask)] == 0)


def test_all_masked_mean_is_zero():
    x, w, _, labels = _data()
    out = linear_cross_entropy(x, w, labels, where=jnp.zeros(labels.shape, bool))
    assert float(out) == 0.0


def test_return_lse():
    x, w, b, labels = _data((3, 4))
    loss, lse = jax.jit(
        lambda x, w, b: linear_cross_entropy(x, w, labels, bias=b, chunk_size=C, return_lse=True)
    )(x, w, b)
    ref_lse, ref_loss = jax.jit(
        lambda x, w, b: (jax.nn.logsumexp(x @ w + b[None, None], axis=-1), _naive(x, w, b, labels))
    )(x, w, b)
    assert lse.shape == labels.shape
    _assert_close(lse, ref_lse)
    _assert_close(loss, ref_loss)

    def f(x):
        loss, lse = linear_cross_entropy(x, w, labels, chunk_size=C, return_lse=True)
        return loss + jnp.sum(jnp.sin(lse))

    def g(x):
        return _naive(x, w, None, labels) + jnp.sum(jnp.sin(jax.nn.logsumexp(x @ w, axis=-1)))

    _compare(f, g, 0, x)


def test_bf16_within_documented_tolerance():
    """Docstring: bf16 loss ~1e-5 relative to the f32-accumulated naive loss; grads ~2e-2."""
    x, w, b, labels = _data(dtype=jnp.bfloat16)
    f32 = [a.astype(jnp.float32) for a in (x, w, b)]

    @jax.jit
    def both(x, w, b, f32):
        ours = jax.value_and_grad(
            lambda x, w, b: linear_cross_entropy(x, w, labels, bias=b, chunk_size=C), (0, 1, 2)
        )(x, w, b)
        return ours, jax.grad(lambda x, w, b: _naive(x, w, b, labels), (0, 1, 2))(*f32)

    (loss, g), g_ref = both(x, w, b, f32)
    assert loss.dtype == jnp.float32
    _assert_close(loss, _naive(*f32, labels), rtol=1e-5)
    for go, gr in zip(g, g_ref, strict=True):
        assert go.dtype == jnp.bfloat16
        _assert_close(go, gr, rtol=2e-2)


def test_jit_vmap_grad():
    x, w, b, labels = _data((2, 6))
    f = functools.partial(linear_cross_entropy, chunk_size=C)
    ref = jax.vmap(lambda x, y: _naive(x, w, b, y))(x, labels)
    out = jax.jit(jax.vmap(lambda x, y: f(x, w, y, bias=b)))(x, labels)
    _assert_close(out, ref)
    g = jax.jit(jax.grad(lambda w: jnp.sum(jax.vmap(lambda x, y: f(x, w, y))(x, labels))))(w)
    g_ref = jax.jit(
        jax.grad(lambda w: jnp.sum(jax.vmap(lambda x, y: _naive(x, w, None, y))(x, labels)))
    )(w)
    _assert_close(g, g_ref)
    check_grads(
        jax.jit(lambda x, w: f(x, w, labels[0], z_loss=0.1, label_smoothing=0.1)),
        (x[0], w),
        order=1,
        modes=["rev"],
        atol=2e-2,
        rtol=2e-2,
    )


def test_out_of_range_labels_concrete_raise_naming_position():
    x, w, _, labels = _data((2, 6))
    bad = labels.at[1, 4].set(V)
    with pytest.raises(ValueError, match=r"labels\[1, 4\] = 50"):
        linear_cross_entropy(x, w, bad)
    with pytest.raises(ValueError, match=r"labels\[0, 2\] = -1"):
        linear_cross_entropy(x, w, labels.at[0, 2].set(-1))
    # ignored or masked out-of-range labels are fine
    linear_cross_entropy(x, w, bad.at[0, 0].set(-100), ignore_index=-100, where=bad != V)


def test_out_of_range_labels_under_jit_give_nan():
    x, w, _, labels = _data((2, 6))
    bad = labels.at[1, 4].set(V + 3)
    f = jax.jit(linear_cross_entropy, static_argnames="reduction")
    assert np.isnan(float(f(x, w, bad)))
    assert np.isnan(float(f(x, w, bad, reduction="sum")))
    none = np.asarray(f(x, w, bad, reduction="none"))
    assert np.isnan(none[1, 4]) and np.isfinite(np.delete(none.ravel(), 10)).all()
    # ignore_index still works under jit
    g = jax.jit(functools.partial(linear_cross_entropy, ignore_index=-100))
    assert np.isfinite(float(g(x, w, labels.at[0, 0].set(-100))))


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        (("x3", "w", "labels"), {}, ValueError, r"x must have shape \[\.\.\., D\] with D"),
        (("x", "w1", "labels"), {}, ValueError, r"w must have shape \[D, V\]"),
        (("x", "w", "labels_f"), {}, TypeError, r"labels must have an integer dtype.*float32"),
        (("x", "w", "labels_short"), {}, ValueError, r"labels must have shape x.shape\[:-1\]"),
        (("x", "w", "labels"), {"chunk_size": 0}, ValueError, "chunk_size must be a positive"),
        (("x", "w", "labels"), {"chunk_size": 2.0}, TypeError, "chunk_size must be a positive"),
        (("x", "w", "labels"), {"reduction": "avg"}, ValueError, "reduction must be one of"),
        (("x", "w", "labels"), {"bias": "bias_bad"}, ValueError, r"bias must have shape \[V\]"),
        (("x", "w", "labels"), {"where": "where_bad"}, TypeError, "where must be a boolean"),
        (("x", "w", "labels"), {"label_smoothing": 1.0}, ValueError, "label_smoothing must be"),
        (("x", "w", "labels"), {"z_loss": -1.0}, ValueError, "z_loss must be"),
        (("x", "w", "labels"), {"logit_softcap": 0.0}, ValueError, "logit_softcap must be"),
        (("xi", "w", "labels"), {}, TypeError, "x must have a floating dtype"),
    ],
)
def test_errors(args, kwargs, exc, match):
    x, w, _, labels = _data()
    env = {
        "x": x,
        "w": w,
        "labels": labels,
        "x3": jnp.ones((N, 3)),
        "w1": jnp.ones((D,)),
        "labels_f": labels.astype(jnp.float32),
        "labels_short": labels[:5],
        "bias_bad": jnp.ones((V + 1,)),
        "where_bad": jnp.ones((N,), jnp.int32),
        "xi": x.astype(jnp.int32),
    }
    kwargs = {
        k: env.get(v, v) if isinstance(v, str) and k in ("bias", "where") else v
        for k, v in kwargs.items()
    }
    with pytest.raises(exc, match=match):
        linear_cross_entropy(*(env[a] for a in args), **kwargs)


def test_memory_structural():
    """Compiled temp of the grad < 1/4 of naive's; no [N, V] residual is saved."""
    n, d, v, chunk = 256, 32, 4096, 256
    s = jax.ShapeDtypeStruct
    args = (s((n, d), jnp.float32), s((d, v), jnp.float32), s((n,), jnp.int32))

    def ours(x, w, y):
        return linear_cross_entropy(x, w, y, chunk_size=chunk)

    def naive(x, w, y):
        return optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()

    def temp(f):
        grad = jax.jit(jax.grad(f, argnums=(0, 1)))
        return compile_to_measure(grad.lower(*args)).memory_analysis().temp_size_in_bytes

    t_ours, t_naive = temp(ours), temp(naive)
    assert t_naive >= n * v * 4  # the naive one does hold [N, V] logits
    assert t_ours < t_naive / 4, (t_ours, t_naive)

    x, w, _, y = _data((n,), v=v, d=d)
    for f, expect_nv in ((ours, False), (naive, True)):
        shapes = [r.shape for r in saved_residuals(lambda x, w, f=f: f(x, w, y), x, w)]
        assert ((n, v) in shapes) == expect_nv, shapes


# ---------------------------------------------------------------------------------------------
# Token tiles: [token_chunk, chunk] blocks instead of [N, chunk].


@pytest.mark.parametrize("tokens", [1, 5, 7, 12])  # 12 = N: one tile; 5, 7 leave a remainder
def test_token_tiles_equal_naive(tokens):
    x, w, b, labels = _data((3, 4))
    mask = jnp.asarray(np.arange(12).reshape(3, 4) % 5 != 2)
    opts = {"label_smoothing": 0.1, "z_loss": 1e-2}

    def ours(x, w, b):
        loss, lse = linear_cross_entropy(
            x, w, labels, bias=b, where=mask, chunk_size=C, token_chunk_size=tokens,
            return_lse=True, **opts,
        )  # fmt: skip
        return loss + 0.1 * jnp.sum(lse)

    def naive(x, w, b):
        lse = jax.nn.logsumexp(x @ w + b[None, None], axis=-1)
        return _naive(x, w, b, labels, mask=mask, **opts) + 0.1 * jnp.sum(lse)

    got = jax.value_and_grad(ours, argnums=(0, 1, 2))(x, w, b)
    want = jax.value_and_grad(naive, argnums=(0, 1, 2))(x, w, b)
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=RTOL, atol=1e-6), got, want)


def _primitives(jaxpr) -> set:
    return {eqn.primitive.name for eqn in iter_eqns(jaxpr)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tokens", [16, 64])  # 64 = N: one tile, the untiled backward pass
def test_token_tiles_take_dx_in_place(dtype, tokens):
    """On CPU, f32 token tiles add each chunk's dx into dx's rows (a scatter-add, no [tokens, D]
    accumulator beside dx) and dw's matmul reads each tile transposed, made once per tile; a
    bf16 dx keeps its f32 accumulator, and all tokens at once transpose nothing (that copy would
    be the size of x)."""
    labels = jnp.zeros((64,), jnp.int32)

    def loss(x, w):
        return linear_cross_entropy(x, w, labels, chunk_size=16, token_chunk_size=tokens)

    s = jax.ShapeDtypeStruct
    closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(s((64, 8), dtype), s((8, 64), dtype))
    prims = _primitives(closed.jaxpr)
    in_place = tokens < 64 and dtype == jnp.float32 and jax.default_backend() == "cpu"
    assert ("scatter-add" in prims) == in_place
    assert ("transpose" in prims) == in_place


def test_token_tiles_off_cpu_keep_the_accumulator(monkeypatch):
    """Traced for another backend, the tiles keep the form measured there (an f32 accumulator
    of dx, x read in place), with the same gradients."""
    x, w, b, labels = _data((3, 4))
    f = functools.partial(linear_cross_entropy, labels=labels, chunk_size=C, token_chunk_size=5)
    want = jax.value_and_grad(f, argnums=(0, 1))(x, w)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    grad = jax.value_and_grad(f, argnums=(0, 1))
    prims = _primitives(jax.make_jaxpr(grad)(x, w).jaxpr)
    assert "scatter-add" not in prims and "transpose" not in prims
    got = grad(x, w)
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=RTOL, atol=1e-6), got, want)


def test_token_tiles_bound_the_temp_whatever_the_token_count():
    d, v, chunk, tokens = 16, 4096, 512, 64
    block = tokens * chunk * 4

    def temp(n, tile):
        s = jax.ShapeDtypeStruct
        args = (s((n, d), jnp.float32), s((d, v), jnp.float32), s((n,), jnp.int32))
        f = functools.partial(linear_cross_entropy, chunk_size=chunk, token_chunk_size=tile)
        grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        return compile_to_measure(grad.lower(*args)).memory_analysis().temp_size_in_bytes

    small, large = temp(512, tokens), temp(4096, tokens)
    # A few [tokens, chunk] blocks, plus the [N] per-token vectors: nothing of size N x chunk.
    assert large <= 4 * block + 4096 * 16, (large, block)
    assert large - small <= (4096 - 512) * 16, (small, large)
    tile, default_chunk = default_tiles(4096, d, v)
    assert temp(4096, None) == temp(4096, tile * default_chunk // chunk)  # the default block
    assert temp(4096, 4096) >= 2 * 4096 * chunk * 4  # vocabulary chunks only: [N, chunk] blocks


def test_token_tile_options_are_checked():
    x, w, _, labels = _data()
    with pytest.raises(ValueError, match="token_chunk_size must be positive"):
        linear_cross_entropy(x, w, labels, token_chunk_size=0)
    with pytest.raises(TypeError, match="token_chunk_size must be an int"):
        linear_cross_entropy(x, w, labels, token_chunk_size=2.0)
    with pytest.raises(ValueError, match="block_bytes must be positive"):
        linear_cross_entropy(x, w, labels, block_bytes=-1)


# ---------------------------------------------------------------------------------------------
# Default tiles: the rule, and the temp against the peers' (compiled only, nothing allocated).


@pytest.mark.parametrize(
    "n,d,v,dtype",
    [
        (1, 1, 1, jnp.float32),
        (12, 8, 50, jnp.float32),
        (100, 768, 50257, jnp.float32),
        (1000, 64, 32768, jnp.float32),
        (4096, 512, 32768, jnp.float32),
        (8192, 1024, 32768, jnp.float32),
        (8192, 768, 50257, jnp.bfloat16),
        (10**6, 4096, 262144, jnp.bfloat16),
    ],
)
def test_default_tiles_rule(n, d, v, dtype):
    """The largest block (<= 2**20 elements) whose estimated scratch fits x's bytes (or 4 MiB)."""
    from jaxmem._src.losses.linear_ce_config import _scratch_bytes  # noqa: PLC0415

    size = np.dtype(dtype).itemsize
    tokens, chunk = default_tiles(n, d, v, dtype)
    assert 1 <= tokens <= n and 1 <= chunk <= v and tokens * chunk <= 2**20
    budget = max(n * d * size, 4 * 2**20)
    assert _scratch_bytes(tokens, chunk, d, size) <= budget
    for t, c in ((min(n, 2 * tokens), chunk), (tokens, min(v, 2 * chunk))):  # no larger block
        if (t, c) != (tokens, chunk):
            assert t * c > 2**20 or _scratch_bytes(t, c, d, size) > budget, (t, c)


def test_explicit_tiles_and_block_bytes_still_rule():
    """chunk_size, token_chunk_size and block_bytes set the tiles as documented."""
    n, d, v = 4096, 16, 8192

    def temp(**kw):
        s = jax.ShapeDtypeStruct
        args = (s((n, d), jnp.float32), s((d, v), jnp.float32), s((n,), jnp.int32))
        f = functools.partial(linear_cross_entropy, **kw)
        grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        return compile_to_measure(grad.lower(*args)).memory_analysis().temp_size_in_bytes

    t, c = default_tiles(n, d, v)
    assert temp() == temp(chunk_size=c, token_chunk_size=t)
    assert default_tiles(n, d, v, block_bytes=16 * 2**20) == (2048, 2048)
    assert temp(block_bytes=16 * 2**20) == temp(chunk_size=2048, token_chunk_size=2048)
    assert temp(chunk_size=1024) == temp(chunk_size=1024, token_chunk_size=t * c // 1024)


@pytest.mark.parametrize("block_bytes", [None, 512 * 512 * 4], ids=["default", "block_1MiB"])
def test_default_tiles_equal_naive(block_bytes):
    """Default tiles: 3 token tiles, the last overlapping (whole vocabulary chunks); with 1 MiB
    blocks also 3 chunks, the last overlapping."""
    x, w, b, labels = _data((1100,), v=1500, d=8, seed=3)
    want = (512, 1500) if block_bytes is None else (512, 512)
    assert default_tiles(1100, 8, 1500, block_bytes=block_bytes) == want
    kw = {"label_smoothing": 0.1, "block_bytes": block_bytes}
    _compare(
        lambda x, w, b: linear_cross_entropy(x, w, labels, bias=b, **kw),
        lambda x, w, b: _naive(x, w, b, labels, label_smoothing=0.1),
        (0, 1, 2),
        x,
        w,
        b,
    )


# The acceptance shape of the defaults: big enough that no peer's fixed overhead decides.
PEER_N, PEER_D, PEER_V = 4096, 512, 32768


def _peer_temp(loss, w_shape=(PEER_D, PEER_V)):
    s = jax.ShapeDtypeStruct
    args = (s((PEER_N, PEER_D), jnp.float32), s(w_shape, jnp.float32), s((PEER_N,), jnp.int32))
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return compile_to_measure(grad.lower(*args)).memory_analysis().temp_size_in_bytes


def test_default_temp_at_most_tokamax_chunked_xla_defaults():
    tokamax = pytest.importorskip("tokamax")

    def peer(x, w, y):
        return tokamax.linear_softmax_cross_entropy_loss(
            x, y, w, reduction="mean", implementation="chunked_xla"
        )

    try:
        theirs = _peer_temp(peer)
    except ValueError as e:  # tokamax < 0.0.17: "Unsupported implementation: chunked_xla"
        if "chunked_xla" not in str(e):
            raise
        pytest.skip(f"tokamax {tokamax.__version__} has no chunked_xla implementation")
    ours = _peer_temp(linear_cross_entropy)
    assert ours <= theirs, (ours, theirs)


def test_default_temp_at_most_jax_cce_leanest_chunk():
    jax_cce = pytest.importorskip("jax_cce")
    theirs = {  # w in jax-cce's own [V, D] layout: no transpose counted against it
        c: _peer_temp(
            functools.partial(jax_cce.linear_cross_entropy, chunk_size=c), (PEER_V, PEER_D)
        )
        for c in (16, 32, 64, 128)  # its temp falls with the chunk (the benchmark sweeps more)
    }
    ours = _peer_temp(linear_cross_entropy)
    assert ours <= min(theirs.values()), (ours, theirs)


@pytest.mark.parametrize(
    "args,kwargs,error,match",
    [
        ((-1, 8, 50), {}, ValueError, "num_tokens must be >= 0, got -1"),
        ((12, 0, 50), {}, ValueError, "dim must be >= 1, got 0"),
        ((12, 8, 0), {}, ValueError, "vocab_size must be >= 1, got 0"),
        ((12, 8, 50), {"block_bytes": 0}, ValueError, "block_bytes must be >= 1, got 0"),
        ((12.0, 8, 50), {}, TypeError, "num_tokens must be an int, got float"),
        ((12, 8, True), {}, TypeError, "vocab_size must be an int, got bool"),
        ((12, 8, 50), {"backend": 0}, TypeError, "backend must be a platform name .* got int"),
    ],
)
def test_default_tiles_rejects_bad_sizes(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        default_tiles(*args, **kwargs)


def test_default_tiles_of_no_tokens():
    """An empty batch (what linear_cross_entropy passes for zero tokens) is not an error."""
    assert default_tiles(0, 8, 50) == (0, 1)


def test_default_tiles_by_backend():
    """On a GPU the tiles are 4096 x 4096, each side at most its dimension; the CPU rule is the
    default here (a CPU machine) and for backends not measured."""
    assert default_tiles(8192, 1024, 50257, backend="gpu") == (4096, 4096)
    assert default_tiles(12, 8, 50, backend="gpu") == (12, 50)
    assert default_tiles(0, 8, 50, backend="gpu") == (0, 50)
    cpu = default_tiles(4096, 512, 32768, backend="cpu")
    assert cpu == (512, 1024) == default_tiles(4096, 512, 32768)
    assert default_tiles(4096, 512, 32768, backend="tpu") == cpu


@pytest.mark.parametrize(
    "kwargs, naive_kwargs",
    [
        ({}, {}),
        ({"label_smoothing": 0.1, "z_loss": 0.01}, {"label_smoothing": 0.1, "z_loss": 0.01}),
        ({"logit_softcap": 2.0, "reduction": "sum"}, {"softcap": 2.0, "reduction": "sum"}),
    ],
    ids=["plain", "smooth_zloss", "softcap_sum"],
)
def test_every_transformation_matches_naive(kwargs, naive_kwargs):
    """Forward mode (jvp, jacfwd, linearize), forward over reverse (hessian), reverse over
    reverse and vmap of jvp and of grad equal the naive loss's."""
    x, w, b, labels = _data()

    def ours(x, w, b):
        return linear_cross_entropy(x, w, labels, bias=b, chunk_size=C, **kwargs)

    def ref(x, w, b):
        return _naive(x, w, b, labels, **naive_kwargs)

    modes = {
        "jvp": lambda f: jax.jvp(f, (x, w, b), (x, w, b)),
        "jacfwd": lambda f: jax.jacfwd(f, argnums=(0, 2))(x, w, b),
        "linearize": lambda f: jax.linearize(f, x, w, b)[1](x, w, b),
        "hessian": lambda f: jax.hessian(f, argnums=2)(x, w, b),
        "grad_of_grad": lambda f: jax.grad(lambda w: jnp.sum(jax.grad(f, 0)(x, w, b) ** 2))(w),
        "vmap_of_jvp": lambda f: jax.vmap(lambda t: jax.jvp(f, (x, w, b), (x, t, b))[1])(
            jnp.stack([w, -w])
        ),
        "grad_of_vmap": lambda f: jax.grad(
            lambda w: jnp.sum(jax.vmap(f, in_axes=(0, None, None))(jnp.stack([x, -x]), w, b))
        )(w),
    }
    for name, mode in modes.items():
        got, want = jax.jit(lambda mode=mode: (mode(ours), mode(ref)))()
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.shape == e.shape, name
            _assert_close(a, e)
