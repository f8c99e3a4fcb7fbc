"""jaxmem.scan on a device mesh: Auto and Explicit axis types, and inside ``shard_map``.

Every case runs stock ``jax.lax.scan`` (its step under ``jax.checkpoint`` with the same policy
for the policy variant) and :func:`jaxmem.scan` on the same sharded inputs in the same program
and compares: values and gradients (f32 rtol 2e-5), the shardings of the gradients
(the compiled executable's output shardings; under an Explicit mesh also the types), and the
per-device temp of the compiled gradient (jaxmem's <= stock's). The 8 CPU devices come from the
root conftest (``--xla_force_host_platform_device_count=8``, set before jax is imported).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmem

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")

L, B, D, F, T = 3, 16, 32, 64, 6
VARIANTS = {
    "plain": {},
    "policy": {"policy": jaxmem.policies.by_name("dots")},
    "offload": {"offload": "residuals"},
}


def stock_scan(variant):
    """Stock's equivalent of a variant: ``lax.scan``, its step under ``jax.checkpoint`` with the
    same policy for the policy variant (offload is a no-op on CPU)."""
    policy = VARIANTS[variant].get("policy")
    if policy is None:
        return jax.lax.scan

    def scan(f, init, xs):
        return jax.lax.scan(jax.checkpoint(f, policy=policy, prevent_cse=False), init, xs)

    return scan


def _normal(seed, shape, scale=1.0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale


# --- the models: each maps a scan implementation to a loss, with its inputs and their specs ---


def fsdp_step(h, wb):
    w, b = (jax.sharding.reshard(v, P()) for v in wb)
    return jax.nn.gelu(h @ w + b[None]), None


def fsdp(scan):
    """An MLP stack, each layer's weight sharded over 'data' (FSDP), the batch over 'data'. The
    step gathers its layer's weight (``reshard`` to replicated: FSDP's all-gather, written as
    an Explicit mesh requires and a no-op hint under Auto)."""

    def loss(ws, bs, x):
        h, _ = scan(fsdp_step, x, (ws, bs))
        return jnp.mean(h**2)

    args = (_normal(0, (L, D, D), D**-0.5), _normal(1, (L, D), 0.1), _normal(2, (B, D)))
    return loss, args, (P(None, "data", None), P(None, "data"), P("data", None))


def _row_parallel(a, b):
    """``a @ b`` contracting a 'model'-sharded dimension: under an Explicit mesh the output
    sharding is given (the partial sums are all-reduced); under Auto the partitioner picks it."""
    mesh = jax.sharding.get_abstract_mesh()
    if AxisType.Explicit in tuple(mesh.axis_types):
        return jnp.matmul(a, b, out_sharding=P("data", None))
    return a @ b


def megatron(scan):
    """A residual MLP stack, tensor parallel: the first weight column-, the second row-sharded
    over 'model' (Megatron), the batch over 'data'."""

    def loss(w1, w2, x):
        def step(h, w):
            a, b = w
            u = jax.nn.gelu(h @ a)
            return h + _row_parallel(jnp.tanh(u), b), None

        h, _ = scan(step, x, (w1, w2))
        return jnp.mean(h**2)

    args = (_normal(0, (L, D, F), D**-0.5), _normal(1, (L, F, D), F**-0.5), _normal(2, (B, D)))
    return loss, args, (P(None, None, "model"), P(None, "model", None), P("data", None))


def sequence(scan):
    """An RNN over a sequence whose batch is sharded over 'data'; the ys are read by the loss."""

    def loss(w, u, xs, h0):
        def step(h, x):
            h = jnp.tanh(h @ w + x @ u)
            return h, jnp.sin(h)

        h, ys = scan(step, h0, xs)
        return jnp.mean(h**2) + jnp.mean(ys**3)

    args = (_normal(0, (D, D), D**-0.5), _normal(1, (D, D), D**-0.5), _normal(2, (T, B, D)))
    args = (*args, _normal(3, (B, D)))
    return loss, args, (P(), P(), P(None, "data", None), P("data", None))


def dropout(scan):
    """An MLP stack with dropout (its keep mask is kept by jaxmem as bits), batch over 'data'."""

    def loss(ws, x):
        keys = jax.random.split(jax.random.key(7), L)

        def step(h, wk):
            w, key = wk
            u = jnp.tanh(h @ w)
            keep = jax.random.bernoulli(key, 0.8, u.shape)
            return h + jnp.where(keep, u / 0.8, 0.0), None

        h, _ = scan(step, x, (ws, keys))
        return jnp.mean(h**2)

    return loss, (_normal(0, (L, D, D), D**-0.5), _normal(2, (B, D))), (P(), P("data", None))


MODELS = {"fsdp": fsdp, "megatron": megatron, "sequence": sequence, "dropout": dropout}


# --- comparisons ----------------------------------------------------------------------------


def assert_close(actual, expected, rtol=2e-5):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=rtol * 1e-2)


def specs(shardings, avals):
    """The normalized partition specs of shardings (``P('a')`` and ``P('a', None)`` equal)."""
    out = []
    for s, a in zip(shardings, avals, strict=True):
        spec = tuple(s.spec) if isinstance(s, NamedSharding) else ("<other>",)
        out.append(tuple(spec) + (None,) * (a.ndim - len(spec)))
    return out


def compiled_grad(loss, args):
    fn = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))
    return fn, fn.lower(*args).compile()


def compare(make_model, variant, mesh, axis_type, optimize=False):
    """Stock vs jaxmem on ``mesh``: values, gradients, gradient shardings, per-device temp.
    With ``optimize``, jaxmem's side is ``jaxmem.optimize`` of the stock loss."""
    results = {}
    for name, scan in (
        ("stock", stock_scan(variant)),
        ("jaxmem", functools.partial(jaxmem.scan, **VARIANTS[variant])),
    ):
        if optimize and name == "jaxmem":
            loss, args, arg_specs = make_model(stock_scan(variant))
            loss = jaxmem.optimize(loss)
        else:
            loss, args, arg_specs = make_model(scan)
        args = tuple(
            jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, arg_specs, strict=True)
        )
        fn, compiled = compiled_grad(loss, args)
        value, grads = fn(*args)
        out_shardings = jax.tree.leaves(compiled.output_shardings[1])
        types = [jax.typeof(g) for g in grads] if axis_type == AxisType.Explicit else None
        results[name] = dict(
            value=value,
            grads=grads,
            specs=specs(out_shardings, grads),
            types=types,
            temp=compiled.memory_analysis().temp_size_in_bytes,
            args=args,
        )
    stock, lean = results["stock"], results["jaxmem"]
    assert_close((lean["value"], lean["grads"]), (stock["value"], stock["grads"]))
    assert lean["specs"] == stock["specs"]
    if axis_type == AxisType.Explicit:
        assert [t.sharding.spec for t in lean["types"]] == [t.sharding.spec for t in stock["types"]]
        # The gradients are sharded like the parameters (FSDP, Megatron), not replicated.
        assert [t.sharding.spec for t in lean["types"]] == [
            jax.typeof(a).sharding.spec for a in lean["args"]
        ]
    assert lean["temp"] <= stock["temp"], (lean["temp"], stock["temp"])
    return results


# Offload on CPU is the identity: its cases warn offload_noop, as a user's would.
@pytest.mark.filterwarnings("ignore:offload_noop:jaxmem.LintWarning")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_scan_on_a_mesh_equals_stock(model, variant, axis_type):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    with jax.set_mesh(mesh):
        compare(MODELS[model], variant, mesh, axis_type)


@pytest.mark.parametrize("variant", ["plain", "policy"])
@pytest.mark.parametrize("model", ["fsdp", "megatron"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_optimize_on_a_mesh_equals_stock(model, variant, axis_type):
    """jaxmem.optimize of the unmodified stock loss: the same values, gradients and gradient
    shardings as stock, per-device temp no higher."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    with jax.set_mesh(mesh):
        results = compare(MODELS[model], variant, mesh, axis_type, optimize=True)
    assert results["jaxmem"]["temp"] < results["stock"]["temp"] or variant == "policy"


# --- inside shard_map -----------------------------------------------------------------------


def shard_map_fsdp(scan):
    """FSDP written by hand in shard_map: each device holds a 1/8 slice of every layer's weight
    and all-gathers it in the step (whose transpose reduce-scatters the gradient); the batch is
    split over 'data'. The loss is psum-ed, so every manual value carries its varying axes."""

    def local(ws, bs, x):
        def step(h, wb):
            w, b = wb
            w = jax.lax.all_gather(w, "data", axis=0, tiled=True)
            return jax.nn.gelu(h @ w + b[None]), jnp.sum(h, axis=0)

        h, ys = scan(step, x, (ws, bs))
        return jax.lax.psum(jnp.sum(h**2) + jnp.sum(ys), "data") / (B * D)

    args = (_normal(0, (L, D, D), D**-0.5), _normal(1, (L, D), 0.1), _normal(2, (B, D)))
    return local, args, (P(None, "data", None), P(), P("data", None))


# Offload on CPU is the identity: its cases warn offload_noop, as a user's would.
@pytest.mark.filterwarnings("ignore:offload_noop:jaxmem.LintWarning")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_scan_inside_shard_map_equals_stock(variant):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    results = {}
    for name, scan in (
        ("stock", stock_scan(variant)),
        ("jaxmem", functools.partial(jaxmem.scan, **VARIANTS[variant])),
    ):
        local, args, arg_specs = shard_map_fsdp(scan)
        args = tuple(
            jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, arg_specs, strict=True)
        )
        loss = jax.shard_map(local, mesh=mesh, in_specs=arg_specs, out_specs=P())
        fn, compiled = compiled_grad(loss, args)
        value, grads = fn(*args)
        results[name] = (
            (value, grads),
            specs(jax.tree.leaves(compiled.output_shardings[1]), grads),
            compiled.memory_analysis().temp_size_in_bytes,
        )
    (lean, lean_specs, lean_temp), (ref, ref_specs, ref_temp) = results["jaxmem"], results["stock"]
    assert_close(lean, ref)
    assert lean_specs == ref_specs
    assert lean_temp <= ref_temp, (lean_temp, ref_temp)


# --- host offload on a mesh -----------------------------------------------------------------


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (loop bodies, calls)."""
    from jaxmem._src import jax_compat

    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax_compat.subjaxprs(eqn):
            yield from _eqns(sub)


def _fsdp_offloaded(mesh):
    """The FSDP loss with ``offload="all"``, its inputs' structs, and how many values the plan
    moves to the host (its partial activations and kept carry sequences, from scan_residuals
    under the same mesh)."""
    loss, args, arg_specs = fsdp(functools.partial(jaxmem.scan, offload="all"))
    ws, bs, x = structs = tuple(
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
        for a, s in zip(args, arg_specs, strict=True)
    )
    kinds = [r.kind for r in jaxmem.scan_residuals(fsdp_step, x, (ws, bs)).stacked]
    return loss, structs, kinds.count("stacked") + kinds.count("carry")


# Offload on CPU is the identity: its cases warn offload_noop, as a user's would.
@pytest.mark.filterwarnings("ignore:offload_noop:jaxmem.LintWarning")
def test_offload_keeps_sharding_in_pinned_host_explicit():
    """Under an Explicit mesh the placements are in the types: every value moved to the host
    keeps the sharding of the value it moves (the batch-sharded carry stays split over 'data')."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        loss, structs, n_moved = _fsdp_offloaded(mesh)
        closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*structs)
    moves = [
        (eqn.invars[0].aval, eqn.outvars[0].aval)
        for eqn in _eqns(closed.jaxpr)
        if eqn.primitive.name == "device_put"
    ]
    to_host = [(a, b) for a, b in moves if b.memory_space == jax.memory.Space.Host]
    to_device = [(a, b) for a, b in moves if a.memory_space == jax.memory.Space.Host]
    assert len(to_host) == len(to_device) == n_moved >= 2
    for src, dst in to_host + to_device:
        assert (dst.shape, dst.sharding.spec) == (src.shape, src.sharding.spec)
    assert ("data", None) in [tuple(b.sharding.spec) for _, b in to_host]


# Offload on CPU is the identity: its cases warn offload_noop, as a user's would.
@pytest.mark.filterwarnings("ignore:offload_noop:jaxmem.LintWarning")
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_offload_sharded_step_exports_host_placements_for_cuda(axis_type):
    """The sharded training step lowered for cuda (no GPU needed) carries the host placements:
    one to pinned_host per offloaded value in the forward loop, one back in the backward loop."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    with jax.set_mesh(mesh):
        loss, structs, n_moved = _fsdp_offloaded(mesh)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        text = jax.export.export(grad, platforms=["cuda"])(*structs).mlir_module()
    assert n_moved >= 2
    assert text.count('_xla_buffer_placement = "pinned_host"') == n_moved
    assert text.count('_xla_buffer_placement = "device"') >= n_moved
    # Sharded: the module is partitioned over the 8 devices with the inputs' shardings.
    assert "mhlo.num_partitions = 8" in text


def test_offload_helpers_keep_sharding_explicit():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        tree = {
            "w": jax.device_put(jnp.arange(64.0).reshape(8, 8), P("data", "model")),
            "b": jax.device_put(jnp.arange(8.0), P("model")),
        }
        seen = {}

        @jax.jit
        def roundtrip(tree):
            host = jaxmem.offload.to_host(tree)
            seen["host"] = jax.tree.map(jax.typeof, host)
            return jaxmem.offload.to_device(host)

        back = roundtrip(tree)
        eager = jaxmem.offload.to_host(tree)
    for k, x in tree.items():
        spec = jax.typeof(x).sharding.spec
        assert seen["host"][k].memory_space == jax.memory.Space.Host
        assert seen["host"][k].sharding.spec == spec
        assert jax.typeof(back[k]).sharding.spec == spec
        assert eager[k].sharding.memory_kind == "pinned_host"
        assert eager[k].sharding.spec == x.sharding.spec
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(x))


# --- per-device figures ---------------------------------------------------------------------


def test_profile_says_figures_are_per_device():
    mesh = jax.make_mesh((8,), ("data",))
    w = jnp.ones((32, 32))
    x = jnp.ones((64, 32))
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
    single = jaxmem.profile(loss, w, x)
    sharded = jaxmem.profile(loss, w, jax.device_put(x, NamedSharding(mesh, P("data"))))
    assert (single.num_devices, sharded.num_devices) == (1, 8)
    assert single.per_device_note == ""
    assert "per device, sharded over 8 devices" in str(sharded).splitlines()[0]
    assert "per device, sharded over 8 devices" in sharded.to_markdown().splitlines()[0]
    # One device holds an eighth of x: the argument bytes are w plus x / 8.
    assert sharded.argument_bytes == w.nbytes + x.nbytes // 8
    assert single.argument_bytes == w.nbytes + x.nbytes
    # The listing is global: the same residuals, the same bytes, on one device or eight.
    assert sharded.residual_bytes == single.residual_bytes
    cmp = jaxmem.compare({"plain": loss, "remat": jax.checkpoint(loss)}, w, x)
    assert "per device" not in str(cmp)
    cmp = jaxmem.compare(
        {"plain": loss, "remat": jax.checkpoint(loss)},
        w,
        jax.device_put(x, NamedSharding(mesh, P("data"))),
    )
    assert "per device, 8 devices" in str(cmp).splitlines()[0]
    assert sharded.to_dict()["num_devices"] == 8


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_fsdp_gathered_weights_are_regathered_not_stacked(axis_type):
    """A layer's gathered weight (``reshard`` to replicated: FSDP's all-gather) is recomputed in
    the backward pass from the sharded xs slice, as FSDP gathers parameters again there; its
    full [D, D] copy is not stacked per layer (lax.scan stacks it under an Explicit mesh)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    _, args, arg_specs = fsdp(jaxmem.scan)
    with jax.set_mesh(mesh):
        ws, bs, x = (
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
            for a, s in zip(args, arg_specs, strict=True)
        )
        plan = jaxmem.scan_residuals(fsdp_step, x, (ws, bs))
    gathered = [r for r in plan.residuals if r.shape == (D, D)]
    assert gathered and {r.kind for r in gathered} <= {"xs", "recomputed"}
    assert (D, D) not in [r.shape for r in plan.stacked]
