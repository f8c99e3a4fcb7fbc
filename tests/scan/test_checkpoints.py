"""Checkpointed scans: ``jaxmem.scan(..., checkpoints=k | "sqrt")``.

The schedule (``jaxmem._src.scan.schedule``) is checked against a brute-force dynamic programme of
the optimal number of forward steps and by simulating its tables; the scan against ``jax.lax.scan``
(values and gradients, every case of the corpus of ``test_scan.py``, and longer loops with
reverse, unroll, pytrees, ``xs=None``, policies, nesting, jit, vmap, meshes); the forward steps
that run against the schedule's count (:func:`jaxmem.step_counter`); the memory structurally
(what the custom VJP saves, compiled temp against ``lax.scan`` and the lean scan); the input
checks.
"""

from __future__ import annotations

import functools
import math
import threading

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmem
from jaxmem._src.jax_compat import compile_to_measure
from jaxmem._src.listing import saved_residuals
from jaxmem._src.scan import schedule as schedule
from jaxmem._src.scan.hooks import collect_plans
from tests.helpers import (
    F32_RTOL,
    Rand,
    assert_trees_close,
    lower_text,
    placements,
    values_and_grads_fn,
)
from tests.scan.corpus import CASES

# The module runs every count of checkpoints, those at least the length (clamped) included,
# where a small loop keeps no more without them: each such loop warns option_noop, as a
# user's would.
pytestmark = pytest.mark.filterwarnings("ignore:option_noop. checkpoints=:jaxmem.LintWarning")

# ------------------------------------------------------------------------------------------
# The schedule.


@functools.cache
def optimal_advances(length: int, slots: int) -> int:
    """The fewest advances reversing ``length`` steps with ``slots`` stored carries (the first
    one holding the initial carry), by exhaustive search over the first snapshot position."""
    if length <= 1:
        return 0
    if slots == 1:
        return length * (length - 1) // 2
    return min(
        m + optimal_advances(length - m, slots - 1) + optimal_advances(m, slots)
        for m in range(1, length)
    )


def simulate(tables: schedule.Tables, length: int, slots: int) -> int:
    """Runs the tables on positions instead of carries; returns the advances taken. Fails if a
    step restores a slot that does not hold the carry the table says, or uses a slot >= slots."""
    held = {0: 0}
    advances = 0
    evaluations = [1] * length  # each step is taped once
    for i in range(length - 1, -1, -1):
        slot, pos = int(tables.restore_slot[i]), int(tables.restore_pos[i])
        assert 0 <= slot < slots and held.get(slot) == pos, (length, slots, i, slot, pos, held)
        for j in range(pos, i):
            if tables.snap_when[j] == i:
                assert 0 <= tables.snap_slot[j] < slots
                held[int(tables.snap_slot[j])] = j
            advances += 1
            evaluations[j] += 1
    # Revolve's bound: no step evaluated more than r + 1 times (r advances, one taping).
    assert max(evaluations) <= schedule.repetitions(length, min(slots, length)) + 1
    return advances


@pytest.mark.parametrize("slots", range(1, 7))
def test_revolve_is_optimal_and_runs(slots):
    for length in range(1, 48):
        t = schedule.revolve(length, slots)
        want = optimal_advances(length, min(slots, length))
        assert schedule.revolve_advances(length, min(slots, length)) == want, (length, slots)
        assert t.advances == want, (length, slots)
        assert simulate(t, length, slots) == want
        assert t.max_slots <= slots


@pytest.mark.parametrize(("length", "slots"), [(2048, 64), (8192, 91), (1000, 3), (300, 2)])
def test_revolve_large(length, slots):
    t = schedule.revolve(length, slots)
    assert t.advances == schedule.revolve_advances(length, slots)
    assert simulate(t, length, slots) == t.advances
    assert t.max_slots == slots


def test_revolve_formula_by_hand():
    # r = 2 at T = 2048, k = 64 (C(66, 2) = 2145 >= 2048 > C(65, 1) = 65):
    # 2 * 2048 - C(66, 1) = 4030 advances.
    assert schedule.repetitions(2048, 64) == 2
    assert schedule.revolve_advances(2048, 64) == 2 * 2048 - 66
    assert schedule.revolve_advances(10, 1) == 45
    assert schedule.revolve_advances(10, 10) == 9


@pytest.mark.parametrize(
    ("length", "want"), [(1, 1), (2, 2), (4, 2), (5, 3), (9, 3), (10, 4), (2048, 46), (8192, 91)]
)
def test_sqrt_is_ceil_sqrt(length, want):
    assert schedule.check_checkpoints("sqrt", length, "f") == want == math.ceil(math.sqrt(length))


# ------------------------------------------------------------------------------------------
# Values and gradients against lax.scan.

CHECKPOINTS = (1, 2, 3, "sqrt", 10**6)  # 10**6: clamped to the length, every carry stored


def distinct_checkpoints(run, args) -> list:
    """The values of CHECKPOINTS that give distinct programs for the scans of ``run`` (most
    corpus scans have 3 steps, where "sqrt" is 2 and the length is 3)."""
    loss = lambda *a: jax.tree.leaves(run(jaxmem.scan, *a))
    with jaxmem._src.scan.hooks.collect_plans() as plans:
        jax.eval_shape(lambda *a: jax.vjp(loss, *a)[1](loss(*a)), *args)
    lengths = sorted({p.length for p in plans})
    distinct = {}
    for k in CHECKPOINTS:
        distinct.setdefault(tuple(schedule.check_checkpoints(k, n, "f") for n in lengths), k)
    return list(distinct.values())


@functools.cache
def corpus_results(name: str):
    run, args = CASES[name].build()
    fns = {"lax": values_and_grads_fn(run, jax.lax.scan)}
    for k in distinct_checkpoints(run, args):
        fns[str(k)] = values_and_grads_fn(run, functools.partial(jaxmem.scan, checkpoints=k))
    return jax.jit(lambda *a: {kind: f(*a) for kind, f in fns.items()})(*args)


@pytest.mark.sampled
@pytest.mark.parametrize("name", list(CASES))
def test_corpus_matches_lax_scan(name):
    results = corpus_results(name)
    rtol = CASES[name].rtol
    ref_out, ref_grads = results.pop("lax")
    assert "1" in results
    for k, (out, grads) in results.items():
        assert_trees_close(out, ref_out, rtol, f"{name} checkpoints={k} values: out")
        assert_trees_close(grads, ref_grads, rtol, f"{name} checkpoints={k} grads: grads")


T, B, D = 13, 3, 4


def rnn_problem(seed=0, t=T):
    r = Rand(f"ck{seed}")
    return r.normal((D, D), 0.5), r.normal((t, B, D)), r.normal((B, D))


def rnn_loss(scan, **kw):
    def loss(w, xs, h0):
        def step(h, x):
            h = jnp.tanh(h @ w + x)
            return h, jnp.sum(h * h, axis=-1)

        h, ys = scan(step, h0, xs, **kw)
        weights = jnp.arange(1, ys.shape[0] + 1, dtype=jnp.float32)[:, None]
        return jnp.sum(h**3) + jnp.sum(ys * weights)

    return loss


@pytest.mark.parametrize(("reverse", "unroll"), [(False, 1), (True, 1), (False, 2), (True, 3)])
def test_rnn_gradients(reverse, unroll):
    """13 steps: checkpoints 1, 2, 3, "sqrt" (4) and the length, in one program."""
    args = rnn_problem()
    ref_grad = jax.grad(rnn_loss(jax.lax.scan, reverse=reverse), (0, 1, 2))
    ks = (1, 2, 3, "sqrt", T)
    grads = [
        jax.grad(rnn_loss(jaxmem.scan, reverse=reverse, unroll=unroll, checkpoints=k), (0, 1, 2))
        for k in ks
    ]
    ref, got = jax.jit(lambda *a: (ref_grad(*a), [g(*a) for g in grads]))(*args)
    for k, g in zip(ks, got, strict=True):
        assert_trees_close(g, ref, 1e-5, f"k={k} reverse={reverse} unroll={unroll}")


def test_pytree_carry_with_int_leaf_and_no_xs():
    r = Rand("pytree")
    w, c0 = r.normal((D, D), 0.5), r.normal((B, D))

    def loss(scan, w, c0, **kw):
        def step(c, _):
            h, n, acc = c
            h = jnp.sin(h @ w) + 0.1 * n.astype(jnp.float32)
            return (h, n + 1, acc + jnp.sum(h)), {"h": h, "n": n}

        (h, n, acc), ys = scan(step, (c0, jnp.int32(0), jnp.float32(0)), None, length=9, **kw)
        return jnp.sum(h**2) + acc + jnp.sum(ys["h"][::2]) + n.astype(jnp.float32)

    ref_fn = jax.value_and_grad(functools.partial(loss, jax.lax.scan), (0, 1))
    ks = (1, 4, 9)
    fns = [
        jax.value_and_grad(functools.partial(loss, jaxmem.scan, checkpoints=k), (0, 1)) for k in ks
    ]
    ref, out = jax.jit(lambda *a: (ref_fn(*a), [f(*a) for f in fns]))(w, c0)
    for k, got in zip(ks, out, strict=True):
        assert_trees_close(got, ref, 1e-5, f"k={k}")


def test_gradient_of_ys_only_and_of_final_carry_only():
    args = rnn_problem(1)

    def loss(scan, which, **kw):
        def f(w, xs, h0):
            h, ys = scan(lambda h, x: (jnp.tanh(h @ w + x),) * 2, h0, xs, **kw)
            return jnp.sum(ys**2) if which == "ys" else jnp.sum(h**2)

        return f

    fns = {
        (scan, which): jax.grad(loss(scan, which, **kw), (0, 1, 2))
        for scan, kw in ((jax.lax.scan, {}), (jaxmem.scan, {"checkpoints": 3}))
        for which in ("ys", "final")
    }
    out = jax.jit(lambda *a: [f(*a) for f in fns.values()])(*args)
    results = dict(zip(fns, out, strict=True))
    for which in ("ys", "final"):
        assert_trees_close(results[jaxmem.scan, which], results[jax.lax.scan, which], 1e-5, which)


@pytest.mark.parametrize("policy", ["dots", "nothing"])
def test_policy(policy):
    args = rnn_problem(2)
    pol = jaxmem.policies.by_name(policy)
    got, ref = jax.jit(
        lambda *a: [
            jax.grad(rnn_loss(scan, **kw), (0, 1, 2))(*a)
            for scan, kw in ((jaxmem.scan, {"policy": pol, "checkpoints": 4}), (jax.lax.scan, {}))
        ]
    )(*args)
    assert_trees_close(got, ref, 1e-5, policy)


def test_nested_scans():
    """A checkpointed scan over a body that runs a lean jaxmem.scan, and the other way round."""
    r = Rand("nested")
    w, xs, h0 = r.normal((D, D), 0.5), r.normal((6, 4, B, D)), r.normal((B, D))

    def loss(outer, inner):
        def f(w, xs, h0):
            def step(h, x):
                h, ys = inner(lambda c, xi: (jnp.tanh(c @ w + xi), c), h, x)
                return h, jnp.sum(ys)

            h, ys = outer(step, h0, xs)
            return jnp.sum(h**2) + jnp.sum(ys)

        return f

    ck = functools.partial(jaxmem.scan, checkpoints=2)
    pairs = ((jax.lax.scan, jax.lax.scan), (ck, jaxmem.scan), (jaxmem.scan, ck), (ck, ck))
    ref, *got = jax.jit(
        lambda *a: [jax.grad(loss(outer, inner), (0, 1, 2))(*a) for outer, inner in pairs]
    )(w, xs, h0)
    for g, (outer, inner) in zip(got, pairs[1:], strict=True):
        assert_trees_close(g, ref, 1e-5, f"outer {outer}, inner {inner}")


def test_vmap_of_grad_and_grad_under_vmap():
    w, xs, h0 = rnn_problem(3)
    xs_b = jnp.stack([xs, xs * 0.5, -xs])
    h0_b = jnp.stack([h0, 2 * h0])

    def batched(scan, **kw):
        return lambda w, h0_b: jnp.sum(jax.vmap(rnn_loss(scan, **kw), (None, None, 0))(w, xs, h0_b))

    def both(w, xs_b, h0, h0_b):
        return [
            # vmap of grad (checkpoints=3 against lax.scan)
            jax.vmap(jax.grad(rnn_loss(scan, **kw)), (None, 0, None))(w, xs_b, h0)
            for scan, kw in ((jaxmem.scan, {"checkpoints": 3}), (jax.lax.scan, {}))
        ] + [
            # grad of a vmapped loss (the batch inside the custom VJP; checkpoints="sqrt")
            jax.grad(batched(scan, **kw), (0, 1))(w, h0_b)
            for scan, kw in ((jaxmem.scan, {"checkpoints": "sqrt"}), (jax.lax.scan, {}))
        ]

    got, ref, got_b, ref_b = jax.jit(both)(w, xs_b, h0, h0_b)
    assert_trees_close(got, ref, 1e-5, "vmap of grad")
    assert_trees_close(got_b, ref_b, 1e-5, "grad under vmap")


def test_eager_and_primal():
    args = rnn_problem(4)
    loss = rnn_loss(jaxmem.scan, checkpoints=2)
    assert_trees_close(loss(*args), rnn_loss(jax.lax.scan)(*args), F32_RTOL)
    ref = jax.grad(rnn_loss(jax.lax.scan), (0, 1, 2))(*args)
    assert_trees_close(jax.grad(loss, (0, 1, 2))(*args), ref, 1e-5, "eager")


def test_hessian_and_grad_of_grad():
    """Forward over reverse (Hessian-vector products, ``jax.hessian``) and reverse over reverse
    (the backward pass's recomputation loops, of a dynamic trip count, differentiated as loops
    of the schedule's longest advance) equal lax.scan's."""
    w, xs, h0 = rnn_problem(5, t=5)

    def loss(scan, **kw):
        return lambda w: rnn_loss(scan, **kw)(w, xs, h0)

    def hvp(f, w, v):  # a Hessian-vector product: jvp of grad
        return jax.jvp(jax.grad(f), (w,), (v,))

    def gg(f, w):
        return jax.grad(lambda w: jnp.sum(jax.grad(f)(w) ** 2))(w)

    ks = (2, 3, 5)  # advances of 2, 1 and 0 steps at most

    def all_of_them(w, v):
        ref = hvp(loss(jax.lax.scan), w, v), gg(loss(jax.lax.scan), w)
        return (
            ref,
            hvp(loss(jaxmem.scan, checkpoints=2), w, v),
            [gg(loss(jaxmem.scan, checkpoints=k), w) for k in ks],
        )

    (ref_hvp, ref_gg), got_hvp, got_gg = jax.jit(all_of_them)(w, jnp.ones_like(w) / 4)
    assert_trees_close(got_hvp, ref_hvp, 1e-5, "hvp")
    for k, got in zip(ks, got_gg, strict=True):
        assert_trees_close(got, ref_gg, 1e-5, f"grad of grad, checkpoints={k}")


def test_length_one_and_zero():
    w, xs, h0 = rnn_problem(6, t=1)
    grads = [
        jax.grad(rnn_loss(scan, **kw), (0, 1, 2))
        for scan, kw in ((jaxmem.scan, {"checkpoints": 1}), (jax.lax.scan, {}))
    ]
    lengths = (1, 0)
    out = jax.jit(lambda w, h0: [[g(w, xs[:t], h0) for g in grads] for t in lengths])(w, h0)
    for t, (got, ref) in zip(lengths, out, strict=True):
        assert_trees_close(got, ref, 1e-5, f"T={t}")


# ------------------------------------------------------------------------------------------
# Forward steps that run, against the schedule.


@pytest.mark.parametrize("length", [1, 2, 5, 13])
def test_forward_steps_equal_the_schedule(length):
    args = rnn_problem(7, t=length)
    counts = {}
    for k in sorted({1, 2, 3, schedule.check_checkpoints("sqrt", length, "f"), length}):
        fn = jax.jit(jax.grad(rnn_loss(jaxmem.scan, checkpoints=k), (0, 1, 2)))
        with jaxmem.step_counter() as counter:
            jax.block_until_ready(fn(*args))
        plan = jaxmem.scan_residuals(
            lambda h, x: (jnp.tanh(h @ args[0] + x), jnp.sum(h)), args[2], args[1], checkpoints=k
        )
        slots = min(k, length)
        want = length + schedule.revolve_advances(length, slots)
        assert counter.forward_steps == plan.schedule.forward_steps == want, (length, k)
        counts[k] = counter.forward_steps
    # Fewer checkpoints never evaluate fewer steps; all of them evaluate 2T - 1 at most... with
    # every carry stored: the sweep and one taped evaluation per step.
    assert counts[length] == 2 * length - 1
    assert counts[1] == length + length * (length - 1) // 2
    assert all(
        counts[a] >= counts[b] for a, b in zip(sorted(counts), sorted(counts)[1:], strict=False)
    )


def test_forward_steps_of_the_lean_scan_and_of_the_primal():
    args = rnn_problem(8)
    with jaxmem.step_counter() as counter:
        jax.block_until_ready(jax.grad(rnn_loss(jaxmem.scan))(*args))
    assert counter.forward_steps == T  # partial activations: nothing recomputed
    with jaxmem.step_counter() as counter:
        jax.block_until_ready(rnn_loss(jaxmem.scan, checkpoints=2)(*args))
    assert counter.forward_steps == T  # no gradient: the plain loop
    with jaxmem.step_counter() as outer, jaxmem.step_counter() as inner:
        jax.block_until_ready(jax.grad(rnn_loss(jaxmem.scan, checkpoints=2))(*args))
    assert outer.forward_steps == inner.forward_steps == T + schedule.revolve_advances(T, 2)


def test_step_counter_counts_nothing_outside_its_block():
    args = rnn_problem(9)
    fn = jax.jit(jax.grad(rnn_loss(jaxmem.scan, checkpoints=2)))
    jax.block_until_ready(fn(*args))  # traced outside: no callbacks
    with jaxmem.step_counter() as counter:
        jax.block_until_ready(fn(*args))
    assert counter.forward_steps == 0


# ------------------------------------------------------------------------------------------
# Memory, structurally.


def long_rnn(length, scan, **kw):
    r = Rand("long")
    w, u = r.normal((32, 32), 0.2), r.normal((8, 32), 0.3)
    xs, h0 = r.normal((length, 4, 8)), r.normal((4, 32))

    def loss(w, u, h0, xs):
        h, _ = scan(lambda h, x: (jnp.tanh(h @ w + x @ u), None), h0, xs, **kw)
        return jnp.sum(h**2)

    return loss, (w, u, h0, xs)


def test_saved_residuals_are_the_checkpoints():
    """Between the passes the scan keeps its inputs, the k checkpoints and the last step's
    residuals: no stack over the steps but the xs argument."""
    length, k = 64, 5
    loss, args = long_rnn(length, jaxmem.scan, checkpoints=k)
    saved = saved_residuals(loss, *args)
    shapes = [tuple(r.shape) for r in saved if not r.argument]
    assert (k, 4, 32) in shapes  # the checkpoints
    assert all(s[:1] != (length,) for s in shapes), shapes
    checkpoint_bytes = k * 4 * 32 * 4
    one_step = sum(math.prod(s) * 4 for s in shapes if s != (k, 4, 32))
    assert one_step <= 4 * 4 * 32 * 4 + 32 * 32 * 4 + 8 * 32 * 4  # a few [B, H], w, u at most
    plan = jaxmem.scan_residuals(*_plan_args(length), checkpoints=k)
    assert plan.stacked_bytes == checkpoint_bytes == plan.schedule.kept_bytes
    assert [r.kind for r in plan.stacked] == ["checkpoint"]


def _plan_args(length):
    loss, (w, u, h0, xs) = long_rnn(length, jaxmem.scan)
    return (lambda h, x: (jnp.tanh(h @ w + x @ u), None), h0, xs)


def temp_bytes(fn, args):
    return compile_to_measure(jax.jit(fn).lower(*args)).memory_analysis().temp_size_in_bytes


def test_compiled_temp_is_below_stock_and_lean_and_grows_with_k():
    length = 512
    temps = {}
    for label, scan, kw in (
        ("lax", jax.lax.scan, {}),
        ("lean", jaxmem.scan, {}),
        ("k8", jaxmem.scan, {"checkpoints": 8}),
        ("k64", jaxmem.scan, {"checkpoints": 64}),
        ("sqrt", jaxmem.scan, {"checkpoints": "sqrt"}),
    ):
        loss, args = long_rnn(length, scan, **kw)
        temps[label] = temp_bytes(jax.grad(loss, (0, 1, 2)), args)
    carry = 4 * 32 * 4
    assert temps["lean"] >= length * carry  # the carry sequence
    assert temps["k8"] < temps["lean"] / 8
    assert temps["k8"] < temps["k64"] < temps["lean"] < temps["lax"]
    # 56 more checkpoints cost 56 carries (up to XLA's alignment and fusion slack).
    assert abs((temps["k64"] - temps["k8"]) - 56 * carry) <= 8 * carry
    assert temps["sqrt"] < temps["k64"]


def test_sqrt_temp_grows_like_sqrt_length():
    temps = {}
    for length in (64, 1024):
        loss, args = long_rnn(length, jaxmem.scan, checkpoints="sqrt")
        temps[length] = temp_bytes(jax.grad(loss, (0, 1, 2)), args)
    assert temps[1024] <= 6 * temps[64]  # lax.scan's grows 16x


# ------------------------------------------------------------------------------------------
# Offload of the checkpoints, meshes.


# Offload on CPU is the identity: the loop warns offload_noop, as a user's would.
@pytest.mark.filterwarnings("ignore:offload_noop:jaxmem.LintWarning")
def test_offloaded_checkpoints():
    loss, args = long_rnn(16, jaxmem.scan, checkpoints=4, offload="carries")
    ref_loss, _ = long_rnn(16, jaxmem.scan, checkpoints=4)
    g = jax.jit(jax.grad(loss, (0, 1, 2)))(*args)
    assert_trees_close(g, jax.jit(jax.grad(ref_loss, (0, 1, 2)))(*args), 0.0)  # CPU: identity
    for mode in ("carries", "all"):
        loss, _ = long_rnn(16, jaxmem.scan, checkpoints=4, offload=mode)
        text = lower_text(jax.grad(loss, (0, 1, 2)), args, "cuda")
        assert placements(text) == (1, 1), mode  # out after the sweep, back before the reversal
    text = lower_text(jax.grad(ref_loss, (0, 1, 2)), args, "cuda")
    assert placements(text) == (0, 0)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_batch_sharded_rnn_on_a_mesh(axis_type):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    r = Rand("mesh")
    w, xs, h0 = r.normal((D, D), 0.5), r.normal((9, 16, D)), r.normal((16, D))
    with jax.set_mesh(mesh):
        xs = jax.device_put(xs, NamedSharding(mesh, P(None, "data")))
        h0 = jax.device_put(h0, NamedSharding(mesh, P("data")))
        w = jax.device_put(w, NamedSharding(mesh, P()))
        ref_fn = jax.jit(jax.grad(rnn_loss(jax.lax.scan), (0, 1, 2)))
        fn = jax.jit(jax.grad(rnn_loss(jaxmem.scan, checkpoints=3), (0, 1, 2)))
        assert_trees_close(fn(w, xs, h0), ref_fn(w, xs, h0), 2e-5)
        got = fn.lower(w, xs, h0).compile().output_shardings
        want = ref_fn.lower(w, xs, h0).compile().output_shardings
        assert [s.spec for s in got] == [s.spec for s in want]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")
def test_inside_shard_map():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    r = Rand("shmap")
    w, xs, h0 = r.normal((D, D), 0.5), r.normal((9, 16, D)), r.normal((16, D))

    def loss(scan, **kw):
        @functools.partial(
            jax.shard_map, mesh=mesh, in_specs=(P(), P(None, "data"), P("data")), out_specs=P()
        )
        def f(w, xs, h0):
            return jax.lax.psum(rnn_loss(scan, **kw)(w, xs, h0), "data")

        return f

    with jax.set_mesh(mesh):
        xs = jax.device_put(xs, NamedSharding(mesh, P(None, "data")))
        h0 = jax.device_put(h0, NamedSharding(mesh, P("data")))
        w = jax.device_put(w, NamedSharding(mesh, P()))
        ref = jax.jit(jax.grad(loss(jax.lax.scan), (0, 1, 2)))(w, xs, h0)
        got = jax.jit(jax.grad(loss(jaxmem.scan, checkpoints=2), (0, 1, 2)))(w, xs, h0)
    assert_trees_close(got, ref, 2e-5)


# ------------------------------------------------------------------------------------------
# Input checks.


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (0, ValueError, r"checkpoints=0; expected None, a positive int"),
        (-3, ValueError, r"checkpoints=-3"),
        ("log", ValueError, r"checkpoints='log'; expected None, a positive int, or 'sqrt'"),
        (2.5, TypeError, r"checkpoints=2.5 \(float\)"),
        (True, TypeError, r"checkpoints=True \(bool\)"),
    ],
)
def test_bad_checkpoints_raise(bad, error, match):
    with pytest.raises(error, match=match):
        jaxmem.scan(lambda c, x: (c + x, None), 0.0, jnp.ones(4), checkpoints=bad)
    with pytest.raises(error, match=match):
        jaxmem.scan_residuals(lambda c, x: (c + x, None), 0.0, jnp.ones(4), checkpoints=bad)


@pytest.mark.parametrize("offload", ["residuals", ("h",)])
def test_checkpoints_with_activation_offload_raise(offload):
    with pytest.raises(ValueError, match=r"offload=.* with checkpoints=2.*offload='carries'"):
        jaxmem.scan(lambda c, x: (c + x, None), 0.0, jnp.ones(4), checkpoints=2, offload=offload)


def test_checkpoints_above_the_length_are_clamped():
    plan = jaxmem.scan_residuals(lambda c, x: (c * x, None), 1.0, jnp.ones(5), checkpoints=99)
    assert plan.schedule.checkpoints == 5
    assert plan.schedule.forward_steps == 2 * 5 - 1


def test_plan_reports_the_schedule():
    plan = jaxmem.scan_residuals(*_plan_args(2048), checkpoints=64)
    s = plan.schedule
    assert (s.length, s.checkpoints, s.repetitions) == (2048, 64, 2)
    assert s.forward_steps == 2048 + 4030 and s.recomputed_steps == 4030
    assert s.carry_bytes == 4 * 32 * 4 and s.kept_bytes == 64 * 4 * 32 * 4
    assert plan.ratio < 0.05
    text = str(plan)
    assert "checkpoints: 64 carries" in text and "6078 forward steps" in text
    assert plan.to_dict()["schedule"]["forward_steps"] == 6078
    assert jaxmem.scan_residuals(*_plan_args(16)).schedule is None


def test_step_counters_and_plan_collectors_belong_to_their_thread():
    # The planner compiles in threads: a block in one thread must not see another's scans.
    def loss(w):
        return jnp.sum(jaxmem.scan(lambda c, x: (jnp.sin(c * w + x), None), 1.0, jnp.ones(5))[0])

    seen = {}

    def other_thread():
        with collect_plans() as plans, jaxmem.step_counter() as counter:
            jax.block_until_ready(jax.grad(loss)(0.5))
        seen["plans"], seen["steps"] = len(plans), counter.forward_steps

    with collect_plans() as plans, jaxmem.step_counter() as counter:
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert (len(plans), counter.forward_steps) == (0, 0)  # nothing of the other thread's
        jax.block_until_ready(jax.grad(lambda w: loss(w) * 2.0)(0.25))
    assert len(plans) == 1 and counter.forward_steps > 0
    assert seen["plans"] == 1 and seen["steps"] > 0
