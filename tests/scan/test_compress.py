"""``jaxmem.scan(compress=...)``: the kept float values stored in fewer bits (docs/compress.md).

Checked against :func:`jax.lax.scan` and ``compress=None``: the option's validation, forward
values bit-identical (eager, under ``jit`` and under ``value_and_grad``), gradient errors within
each format's bound, per-row scales (rows from 1e-4 to 1e4 in one array each keep their own
bound), masks, integer carries and the final carry untouched, values that feed ``exp`` stored
as bf16, short rows kept as they are, and the compiled program: the loop stacks hold the
encoded bits (``u16``/``u8``/``s8`` and ``f32`` scales) and the compiled temp drops.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src.scan import compress as _compress
from jaxmem._src.scan import residuals as _res
from tests.compress_checks import check_encoded_stack
from tests.helpers import JAX_VERSION

FORMATS = ("bf16", "fp8", "int8")
# Global relative gradient error allowed per format on the MLP stack below (measured: about
# 1e-3 for bf16, 1e-2 for fp8 and int8).
GRAD_BOUND = {"bf16": 5e-3, "fp8": 4e-2, "int8": 4e-2}

B, D, F, T = 8, 64, 128, 6


def _mlp_args(seed=0):
    rng = np.random.default_rng(seed)
    w1 = jnp.asarray(rng.normal(size=(T, D, F)) / math.sqrt(D), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(T, F, D)) / math.sqrt(F), jnp.float32)
    h0 = jnp.asarray(rng.normal(size=(B, D)), jnp.float32)
    return w1, w2, h0


def _mlp_step(h, w):
    w1, w2 = w
    u = jax.nn.gelu(_norm(h) @ w1)
    return h + u @ w2, jnp.sum(h, axis=-1)


def _norm(h):
    mu = jnp.mean(h, axis=-1, keepdims=True)
    return (h - mu) * jax.lax.rsqrt(jnp.mean((h - mu) ** 2, axis=-1, keepdims=True) + 1e-6)


def _mlp_loss(compress=None, scan=None):
    def loss(w1, w2, h0):
        run = scan or (lambda *a: jaxmem.scan(*a, compress=compress))
        h, ys = run(_mlp_step, h0, (w1, w2))
        return jnp.mean(h**2) + jnp.mean(ys)

    return loss


def _rel(got, ref) -> float:
    num = sum(float(jnp.sum((g - r) ** 2)) for g, r in zip(got, ref, strict=True))
    den = sum(float(jnp.sum(r**2)) for r in ref)
    return math.sqrt(num / den)


# ----------------------------------------------------------------------------------------------
# The option


@pytest.mark.parametrize("bad", ["fp16", "FP8", 8, True])
def test_bad_compress_raises_naming_the_choices(bad):
    w1, w2, h0 = _mlp_args()
    msg = r"jaxmem.scan got compress=.*; expected None or one of 'bf16', 'fp8', 'int8'\."
    with pytest.raises(ValueError, match=msg):
        jaxmem.scan(_mlp_step, h0, (w1, w2), compress=bad)
    with pytest.raises(ValueError, match=msg.replace("jaxmem.scan", "jaxmem.scan_residuals")):
        jaxmem.scan_residuals(_mlp_step, h0, (w1, w2), compress=bad)


def test_compress_with_checkpoints_raises():
    w1, w2, h0 = _mlp_args()
    with pytest.raises(ValueError, match="compress='bf16' with checkpoints=2"):
        jaxmem.scan(_mlp_step, h0, (w1, w2), compress="bf16", checkpoints=2)


# ----------------------------------------------------------------------------------------------
# Values and gradients


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_is_bit_identical(fmt):
    args = _mlp_args()
    ref = _mlp_loss(None)(*args)
    np.testing.assert_array_equal(_mlp_loss(fmt)(*args), ref)
    ref_jit = jax.jit(_mlp_loss(None))(*args)
    np.testing.assert_array_equal(jax.jit(_mlp_loss(fmt))(*args), ref_jit)
    vg_ref = jax.jit(jax.value_and_grad(_mlp_loss(None)))(*args)[0]
    np.testing.assert_array_equal(jax.jit(jax.value_and_grad(_mlp_loss(fmt)))(*args)[0], vg_ref)
    # The scan's outputs themselves, final carry and ys.
    out = jaxmem.scan(_mlp_step, args[2], args[:2], compress=fmt)
    ref_out = jaxmem.scan(_mlp_step, args[2], args[:2])
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref_out), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gradient_error_is_within_the_format_bound(fmt):
    args = _mlp_args()
    argnums = (0, 1, 2)
    stock = jax.grad(_mlp_loss(scan=jax.lax.scan), argnums=argnums)(*args)
    exact = jax.jit(jax.grad(_mlp_loss(None), argnums=argnums))(*args)
    got = jax.jit(jax.grad(_mlp_loss(fmt), argnums=argnums))(*args)
    assert _rel(exact, stock) < 1e-5
    err = _rel(got, exact)
    assert err <= GRAD_BOUND[fmt], (fmt, err)
    assert err > 0, "a lossy format that changes nothing did not encode anything"


def test_formats_order_by_error():
    args = _mlp_args(1)
    exact = jax.grad(_mlp_loss(None), argnums=(0, 1))(*args)
    errs = {f: _rel(jax.grad(_mlp_loss(f), argnums=(0, 1))(*args), exact) for f in FORMATS}
    assert errs["bf16"] < errs["int8"] and errs["bf16"] < errs["fp8"], errs


def test_grad_under_vmap_matches_unbatched():
    w1, w2, h0 = _mlp_args()
    hs = jnp.stack([h0, 2 * h0])
    grad = jax.grad(_mlp_loss("fp8"), argnums=2)
    batched = jax.vmap(grad, in_axes=(None, None, 0))(w1, w2, hs)
    for i in range(2):
        np.testing.assert_allclose(batched[i], grad(w1, w2, hs[i]), rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# The codec


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_of_very_different_scales_keep_their_own_bound(fmt):
    """One array with rows from 1e-4 to 1e4: each row's error is bounded by its own range
    (one scale per row), not the array's."""
    rng = np.random.default_rng(0)
    scales = 10.0 ** np.arange(-4, 5)
    x = jnp.asarray(rng.normal(size=(len(scales), 64)) * scales[:, None], jnp.float32)
    enc = _compress.choose(x, fmt)
    assert enc.format == fmt
    stored = _compress.encode(x, enc)
    got = np.asarray(_compress.decode(stored, enc))
    x = np.asarray(x)
    absmax = np.max(np.abs(x), axis=-1, keepdims=True)
    err = np.abs(got - x)
    if fmt == "bf16":
        assert np.all(err <= np.abs(x) * 2.0**-8)
    elif fmt == "fp8":  # 3 mantissa bits: 1/16 of the element; subnormals below 2**-6 * scale
        assert np.all(err <= np.abs(x) * 2.0**-4 + absmax / 448 * 2.0**-9)
    else:  # half an int8 step of the row's own range
        assert np.all(err <= absmax / 254 * (1 + 1e-6))
    per_row = np.max(err / absmax, axis=-1)
    assert np.all(per_row > 0) and np.all(per_row < 2.0**-3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_rows_and_exact_values_decode_exactly(fmt):
    x = jnp.zeros((3, 32), jnp.float32).at[1].set(1.0)
    enc = _compress.choose(x, fmt)
    np.testing.assert_array_equal(_compress.decode(_compress.encode(x, enc), enc), x)


def test_encoded_dtypes_are_raw_bits():
    x = jnp.ones((4, 32), jnp.float32)
    dtypes = {f: [a.dtype for a in _compress.encode(x, _compress.choose(x, f))] for f in FORMATS}
    assert dtypes == {
        "bf16": [jnp.uint16],
        "fp8": [jnp.uint8, jnp.float32],
        "int8": [jnp.int8, jnp.float32],
    }


def test_short_rows_integers_and_narrow_floats_are_kept_as_they_are():
    s = jax.ShapeDtypeStruct
    assert _compress.choose(s((64, 8), jnp.float32), "fp8").format is None
    assert _compress.choose(s((64, 8), jnp.float32), "int8").format is None
    assert _compress.choose(s((64, 8), jnp.float32), "bf16").format == "bf16"
    assert _compress.choose(s((), jnp.float32), "int8").format is None
    assert _compress.choose(s((4, 64), jnp.int32), "int8").format is None
    assert _compress.choose(s((4, 64), jnp.bfloat16), "bf16").format is None
    assert _compress.choose(s((4, 64), jnp.complex64), "bf16").format is None
    assert _compress.choose(s((4, 64), jnp.float32), None).format is None


# ----------------------------------------------------------------------------------------------
# What is kept


def _kept(plan):
    return sorted((r.kind, r.shape, r.encoding or "", r.bytes) for r in plan.stacked)


@pytest.mark.parametrize("fmt", FORMATS)
def test_scan_residuals_shows_the_encoded_sizes(fmt):
    w1, w2, h0 = _mlp_args()
    plan = jaxmem.scan_residuals(_mlp_step, h0, (w1, w2))
    small = jaxmem.scan_residuals(_mlp_step, h0, (w1, w2), compress=fmt)
    # The same large values (the cut may pick another of two equal-sized norm statistics).
    big = lambda p: [(k, s) for k, s, _, _ in _kept(p) if len(s) > 1 and s[-1] > 1]
    assert big(plan) == big(small)
    for kind, shape, enc, nbytes in _kept(small):
        full = 4 * int(np.prod(shape))
        if kind == "ys" or len(shape) < 2 or shape[-1] == 1:
            # Read back as it is, or a norm's statistics (one value per row), kept exact.
            assert (enc, nbytes) == ("", full)
            continue
        assert enc == fmt
        rows = int(np.prod(shape[:-1]))
        assert nbytes == (full // 2 if fmt == "bf16" else full // 4 + 4 * rows)
    assert f"stacked:{fmt}" in str(small)
    assert small.stacked_bytes < plan.stacked_bytes


def _where_step(carry, w):
    """A dropout-like mask (kept as bits: its key is folded with the carried counter, so it is
    drawn in the step) and an int counter in the carry."""
    h, n = carry
    w1, key = w
    u = jnp.tanh(h @ w1)
    keep = jax.random.bernoulli(jax.random.fold_in(key, n), 0.8, u.shape)
    return (h + jnp.where(keep, u, 0.0) * 0.5, n + 1), None


@pytest.mark.parametrize("fmt", FORMATS)
def test_masks_and_int_carries_pass_through(fmt):
    rng = np.random.default_rng(0)
    w1 = jnp.asarray(rng.normal(size=(T, D, D)) / math.sqrt(D), jnp.float32)
    keys = jax.random.split(jax.random.key(0), T)
    init = (jnp.asarray(rng.normal(size=(B, D)), jnp.float32), jnp.int32(3))
    plan = jaxmem.scan_residuals(_where_step, init, (w1, keys), compress=fmt)
    masks = [r for r in plan.stacked if r.dtype == "bool"]
    assert masks and all(r.encoding is None and r.bytes == B * D // 8 for r in masks)
    assert all(r.encoding is None for r in plan.stacked if "int" in r.dtype)

    def loss(compress):
        def f(w1, h):
            (h, n), _ = jaxmem.scan(_where_step, (h, init[1]), (w1, keys), compress=compress)
            return jnp.sum(h**2), n

        return f

    (v, n), g = jax.value_and_grad(loss(fmt), argnums=(0, 1), has_aux=True)(w1, init[0])
    (v0, n0), g0 = jax.value_and_grad(loss(None), argnums=(0, 1), has_aux=True)(w1, init[0])
    assert int(n) == int(n0) == 3 + T
    np.testing.assert_array_equal(v, v0)
    # A recurrence compounds the error step by step: fp8 measured 4.8e-2 here.
    assert 0 < _rel(g, g0) <= 2 * GRAD_BOUND[fmt]


def _attention_step(x, w):
    """Pre-LN causal softmax attention: the kept scores feed exp (softmax is recomputed from
    them)."""
    h = _norm(x)
    s = h @ w @ h.T / math.sqrt(x.shape[-1])
    mask = jnp.tril(jnp.ones(s.shape, jnp.bool_))
    p = jax.nn.softmax(jnp.where(mask, s, jnp.finfo(s.dtype).min), axis=-1)
    return x + p @ h, None


def _attention_args(n=32, d=48):
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.normal(size=(4, d, d)) / math.sqrt(d), jnp.float32)
    x0 = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    return ws, x0


def _masked_softmax(s):
    mask = jnp.tril(jnp.ones(s.shape, jnp.bool_))
    return jax.nn.softmax(jnp.where(mask, s, jnp.finfo(s.dtype).min), axis=-1)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_values_feeding_exp_are_encoded_as_bf16(fmt):
    jaxpr = jax.make_jaxpr(_masked_softmax)(jnp.ones((32, 32), jnp.float32)).jaxpr
    encoding = _compress.encoder(jaxpr, fmt)
    # The exp, or from jax 0.12.1 the custom_jvp_call of softmax whose body computes it.
    (exp,) = [e for e in jaxpr.eqns if e.primitive.name in ("exp", "custom_jvp_call")]
    assert exp.primitive.name == ("custom_jvp_call" if JAX_VERSION >= (0, 12, 1) else "exp")
    assert encoding(jaxpr.invars[0]).format == "bf16"  # the scores, through where and max
    assert encoding(exp.invars[0]).format == "bf16"
    assert encoding(exp.outvars[0]).format == fmt  # the exponentials do not feed exp
    assert _compress.encoder(jaxpr, "bf16")(jaxpr.invars[0]).format == "bf16"


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_the_cut_keeps_softmax_exponentials_in_the_format(fmt):
    # Priced at their encoded sizes, the exponentials (1 byte an element) undercut the scores
    # they are recomputed from (2: the scores feed exp): the cut keeps the former.
    ws, x0 = _attention_args()
    n, d = x0.shape
    plan = jaxmem.scan_residuals(_attention_step, x0, ws, compress=fmt)
    assert {r.encoding for r in plan.stacked if r.shape == (n, n)} == {fmt}, _kept(plan)
    assert {r.encoding for r in plan.stacked if r.shape == (n, d)} == {fmt}, _kept(plan)
    assert "bf16" not in {r.encoding for r in plan.stacked}, _kept(plan)

    def loss(compress):
        return lambda ws, x0: jnp.sum(
            jaxmem.scan(_attention_step, x0, ws, compress=compress)[0] ** 2
        )

    exact = jax.grad(loss(None), argnums=(0, 1))(ws, x0)
    # A sharp softmax (unscaled scores of normalized rows): fp8's exponentials carry up to one
    # fp8 rounding (2**-4) each, and the gradient's error stays below that (measured 4.4e-2).
    bound = 2.0**-4 if fmt == "fp8" else GRAD_BOUND[fmt]
    assert _rel(jax.grad(loss(fmt), argnums=(0, 1))(ws, x0), exact) <= bound


def _transposed_step(h, w):
    return jnp.tanh(h @ w.T), None


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "step, args",
    [
        (_mlp_step, lambda: (_mlp_args()[2], _mlp_args()[:2])),
        (_attention_step, lambda: _attention_args()[::-1]),
        # A transpose of an xs slice is recomputed, never kept (it was, encoded, when the
        # budget of recompute="auto" credited a recompute with the encoded bytes it saves).
        (_transposed_step, lambda: (_mlp_args()[2], _mlp_args()[0][..., :D] / 2)),
    ],
    ids=["mlp", "attention", "transposed"],
)
def test_compress_never_keeps_more_values_than_none(step, args, fmt):
    init, xs = args()
    plan = jaxmem.scan_residuals(step, init, xs)
    small = jaxmem.scan_residuals(step, init, xs, compress=fmt)
    assert len(small.stacked) <= len(plan.stacked), (_kept(plan), _kept(small))
    if any(r.encoding for r in small.stacked):
        assert small.stacked_bytes < plan.stacked_bytes
    else:  # the transposed step at these shapes: compress saves nothing compiled, runs without
        assert step is _transposed_step and small.stacked_bytes == plan.stacked_bytes


# ----------------------------------------------------------------------------------------------
# The compiled program


def _compiled(compress):
    args = _mlp_args()
    grad = jax.jit(jax.grad(_mlp_loss(compress), argnums=(0, 1, 2)))
    return grad.lower(*args).compile()


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_loop_stacks_hold_the_encoded_bits(fmt):
    # The MLP's pre-activation, [T, B, F]; the stacks shrink by (4 - bytes per value) * T * B *
    # (F + D): at least half that much less temp (the scales, one step's decoded values).
    per_value = {"bf16": 2, "fp8": 1, "int8": 1}[fmt]
    saved = (4 - per_value) * T * B * (F + D)
    check_encoded_stack(_compiled(None), _compiled(fmt), fmt, f"{T},{B},{F}", f"{T},{B}", saved)


# ----------------------------------------------------------------------------------------------
# Other entry points


def test_optimize_passes_compress_to_every_scan():
    args = _mlp_args()
    loss = _mlp_loss(scan=jax.lax.scan)
    with pytest.raises(ValueError, match="jaxmem.optimize got compress='fp4'"):
        jaxmem.optimize(loss, compress="fp4")
    fast = jaxmem.optimize(loss, compress="bf16")
    np.testing.assert_array_equal(fast(*args), jaxmem.optimize(loss)(*args))
    exact = jax.grad(jaxmem.optimize(loss), argnums=(0, 1, 2))(*args)
    got = jax.grad(fast, argnums=(0, 1, 2))(*args)
    direct = jax.grad(_mlp_loss("bf16"), argnums=(0, 1, 2))(*args)
    assert _rel(got, direct) < 1e-5  # the same encoded scan as jaxmem.scan(compress="bf16")
    assert 0 < _rel(got, exact) <= GRAD_BOUND["bf16"]
    kept = [s.kept_bytes for s in jaxmem.optimize(loss).explain(*args).scans]
    small = [s.kept_bytes for s in fast.explain(*args).scans]
    assert small[0] < kept[0]


def test_profile_shows_the_encoded_sizes():
    args = _mlp_args()
    plans = {fmt: jaxmem.profile(_mlp_loss(fmt), *args).scan_plans for fmt in (None, "int8")}
    (exact,), (small,) = plans[None], plans["int8"]
    assert "int8" in {r.encoding for r in small.stacked}
    assert small.stacked_bytes < exact.stacked_bytes / 2


def test_scanned_takes_compress():
    w1, w2, h0 = _mlp_args()
    with pytest.raises(ValueError, match="jaxmem.scanned got compress='fp4'"):
        jaxmem.scanned(_mlp_step, compress="fp4")
    run = jaxmem.scanned(_mlp_step, compress="int8")
    exact = jax.grad(lambda h: jnp.sum(jaxmem.scan(_mlp_step, h, (w1, w2))[0] ** 2))(h0)
    got = jax.grad(lambda h: jnp.sum(run(h, (w1, w2))[0] ** 2))(h0)
    assert 0 < _rel([got], [exact]) <= GRAD_BOUND["int8"]


def test_higher_order_derivatives_raise():
    """Grad of grad would differentiate through the kept integer bits (no derivative flows
    there): it raises rather than return a wrong Hessian."""
    w = jnp.asarray(np.random.default_rng(0).normal(size=(16, 16)) * 0.1, jnp.float32)
    xs = jnp.ones((3, 4, 16))

    def loss(w, compress):
        step = lambda h, x: (jnp.sin(h @ w + x), jnp.cos(h))  # noqa: E731
        h, ys = jaxmem.scan(step, jnp.ones((4, 16)), xs, compress=compress)
        return jnp.sum(ys**2) + jnp.sum(h**2)

    for hessian in (jax.jacrev, jax.jacfwd):
        # Jitted: one program each, not a compile per primitive (it raises while tracing).
        second = jax.jit(hessian(jax.grad(loss)), static_argnums=1)
        with pytest.raises(NotImplementedError, match="compress='bf16' under higher-order"):
            second(w, "bf16")
        second(w, None)  # without compress: fine
    # First order, under jit and vmap: fine, and lossy.
    grad = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)), static_argnums=1)
    ws = jnp.stack([w, 2 * w])
    assert _rel([grad(ws, "bf16")], [grad(ws, None)]) > 0


@pytest.mark.parametrize("fmt", (None, *FORMATS))
def test_a_prng_key_is_kept_as_it_is(fmt):
    # A typed key (an extended dtype: nnx.Rngs carries one through a scan, and its sequence can
    # be the kept carry) is no float: every format keeps it, at its own size.
    key = jax.eval_shape(lambda: jax.random.key(0))
    enc = _compress.choose(key, fmt)
    assert enc.format is None and enc.nbytes == jax.random.key_data(jax.random.key(0)).nbytes


def _cast_step(h, w):
    y = h.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
    return jnp.tanh(y.astype(jnp.float32)), None


def _stack_temp(step, layers: int, batch: int, d: int, compress) -> int:
    """Compiled temp of the gradient (w.r.t. the weights and h0) of ``sum(h_L**2)`` for
    ``jaxmem.scan(step, h0, ws, compress=compress)`` over [layers, d, d] weights, h0 [batch, d]."""
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.normal(size=(layers, d, d)) / math.sqrt(d), jnp.float32)
    h0 = jnp.asarray(rng.normal(size=(batch, d)), jnp.float32)

    def loss(ws, h0):
        return jnp.sum(jaxmem.scan(step, h0, ws, compress=compress)[0] ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return grad.lower(ws, h0).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_body_that_casts_to_bf16_compiles_smaller(fmt):
    # Decoding bf16 by a convert let XLA fold convert(convert(bf16 -> f32) -> bf16) in such a
    # body, and jax 0.10.2's XLA:CPU then left the weight gradient's dot unfused: 1.2x the
    # temp of compress=None. The decode widens by integer ops instead.
    assert _stack_temp(_cast_step, 8, 32, 512, fmt) < _stack_temp(_cast_step, 8, 32, 512, None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_compress_is_not_above_none_where_the_weights_dominate(fmt):
    """compress= compiled above compress=None where the kept stack is small beside the weights
    (benchmarks.compress's transposed_weights: 1.200x bf16, 1.086x fp8 and int8): the loop now
    runs without it there, says so, and reports what runs."""
    # h = tanh(h @ w.T) over [8, 128, 128] weights, batch 16: the kept h is 8 KiB a step.
    with pytest.warns(jaxmem.LintWarning, match=f"option_noop: compress='{fmt}' saves nothing"):
        ours = _stack_temp(_transposed_step, 8, 16, 128, fmt)
    assert ours == _stack_temp(_transposed_step, 8, 16, 128, None)
    plan = jaxmem.scan_residuals(
        _transposed_step, jnp.ones((16, 128)), jnp.ones((8, 128, 128)), compress=fmt
    )
    assert [r.encoding for r in plan.stacked] == [None] * len(plan.stacked), plan


def test_a_dropped_compress_differentiates_to_any_order():
    """Where compress= is dropped (it saves nothing, above), every kept value is exact, so
    grad of grad is compress=None's, not refused."""
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.normal(size=(8, 128, 128)) / math.sqrt(128), jnp.float32)
    h0, v = (jnp.asarray(rng.normal(size=(16, 128)), jnp.float32) for _ in range(2))

    def loss(h0, compress):
        return jnp.sum(jaxmem.scan(_transposed_step, h0, ws, compress=compress)[0] ** 2)

    def hvp(h0, compress):  # forward over reverse
        return jax.jvp(lambda h: jax.grad(loss)(h, compress), (h0,), (v,))[1]

    def reverse_over_reverse(h0, compress):
        return jax.grad(lambda h: jnp.vdot(jax.grad(loss)(h, compress), v))(h0)

    for second in (hvp, reverse_over_reverse):
        second = jax.jit(second, static_argnums=1)
        with pytest.warns(jaxmem.LintWarning, match="option_noop: compress='bf16' saves nothing"):
            got = second(h0, "bf16")
        np.testing.assert_array_equal(got, second(h0, None))


@pytest.mark.parametrize("dropped", [False, True])
def test_the_compress_choice_plans_each_setting_once(monkeypatch, dropped):
    """Choosing compress= (two compiles of the loop alone, at its first differentiated trace)
    plans the step once per setting, the loop's own plan reusing the probes'."""
    calls = []
    plan_step = _res.plan_step
    monkeypatch.setattr(_res, "plan_step", lambda *a: calls.append(a[-1]) or plan_step(*a))
    # Shapes no other test traces (the choice is cached per loop signature).
    if dropped:  # the weights dominate (as above): compress is dropped
        step, h0, ws = _transposed_step, jnp.ones((16, 112)), (7, 112, 112)
    else:
        step, h0, ws = _cast_step, jnp.ones((48, 224)), (6, 224, 224)
    ws = jnp.full(ws, 0.01)

    def loss(h0, ws):
        return jnp.sum(jaxmem.scan(step, h0, ws, compress="bf16")[0] ** 2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jaxmem.LintWarning)
        jax.jit(jax.grad(loss)).lower(h0, ws)
    assert any("saves nothing" in str(w.message) for w in caught) == dropped
    assert sorted(map(str, calls)) == ["None", "bf16"], calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_values_stay_non_finite(fmt):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32)), jnp.float32)
    x = x.at[1, 3].set(jnp.inf).at[2, 5].set(jnp.nan).at[3, 7].set(-jnp.inf)
    enc = _compress.choose(x, fmt)
    got = np.asarray(_compress.decode(_compress.encode(x, enc), enc))
    assert np.all(np.isfinite(got[0]))  # a finite row keeps its bound
    assert np.all(np.abs(got[0] - np.asarray(x[0])) <= np.max(np.abs(np.asarray(x[0]))) / 16)
    for row, col in ((1, 3), (2, 5), (3, 7)):  # never clipped to a finite value
        assert not np.isfinite(got[row, col]), (row, got[row])
    # Through a scan: a non-finite activation gives a non-finite gradient, as without compress.
    step = lambda h, w: (jnp.tanh(h @ w) * jnp.sqrt(jnp.sum(w)), None)  # noqa: E731
    ws = jnp.asarray(np.random.default_rng(1).normal(size=(3, 32, 32)), jnp.float32)

    def loss(ws, compress):
        return jnp.sum(jaxmem.scan(step, jnp.ones((4, 32)), ws, compress=compress)[0] ** 2)

    ws = ws.at[1].set(-1.0)  # sqrt of a negative sum: NaN from layer 1 on
    for compress in (None, fmt):
        assert not np.all(np.isfinite(np.asarray(jax.grad(loss)(ws, compress))))
