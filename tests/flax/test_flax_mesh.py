"""jaxmem.flax stacks on a device mesh, against nn.scan / nnx.scan in the same program.

Linen: a tensor-parallel block annotated with ``nn.with_logical_partitioning`` and logical axis
rules, stacked with ``metadata_params={nn.PARTITION_NAME: "layers"}`` (the layer axis gets the
logical name "layers"); initialized under jit with the shardings the annotations give. NNX: the
same block with ``nnx.with_partitioning`` under ``jax.set_mesh`` (NNX shards at creation),
stacked with ``transform_metadata={nnx.PARTITION_NAME: None}``, Auto and Explicit meshes. Each
compares: the parameter shardings, the loss and gradients (f32 rtol 2e-5), the gradients'
shardings, and the per-device temp of the compiled gradient (jaxmem's <= stock's). Linen also
runs under an Explicit mesh (parameters placed with ``device_put``: linen's partitioning boxes
are unboxed with ``with_sharding_constraint``, an assertion under Explicit axes, for ``nn.scan``
too). Both stacks also run inside ``shard_map`` (check_vma on; parameters replicated, the batch
split).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem.flax import linen as jl
from jaxmem.flax import nnx as jn

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")

L, B, D, F = 3, 16, 32, 64
RULES = (("layers", None), ("batch", "data"), ("embed", None), ("mlp", "model"))
POLICIES = [None, "dots"]


def assert_close(actual, expected, rtol=2e-5):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=rtol * 1e-2)


def specs(tree):
    """Normalized partition specs of every leaf's sharding (trailing Nones added)."""

    def spec(x):
        s = x.sharding
        assert isinstance(s, NamedSharding), s
        return tuple(s.spec) + (None,) * (x.ndim - len(s.spec))

    return [spec(x) for x in jax.tree.leaves(tree)]


def output_specs(compiled, grads):
    shardings = jax.tree.leaves(compiled.output_shardings[1])
    return [
        tuple(s.spec) + (None,) * (g.ndim - len(s.spec))
        for s, g in zip(shardings, jax.tree.leaves(grads), strict=True)
    ]


# --- linen ----------------------------------------------------------------------------------


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        init = nn.initializers.lecun_normal()
        up = nn.Dense(F, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))
        down = nn.Dense(D, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))
        u = nn.with_logical_constraint(jax.nn.gelu(up(nn.LayerNorm()(h))), ("batch", "mlp"))
        h = nn.with_logical_constraint(h + down(u), ("batch", "embed"))
        return h, None


def linen_model(kind, policy):
    meta = {nn.PARTITION_NAME: "layers"}
    if kind == "stock":
        block = (
            LinenBlock
            if policy is None
            else nn.remat(LinenBlock, policy=jax.checkpoint_policies.dots_saveable)
        )
        stack = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=L,
            metadata_params=meta,
        )
    else:
        stack = jl.scan_layers(LinenBlock, L, carry_only=False, metadata_params=meta, policy=policy)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h, _ = stack()(x, None)
            return h

    return Model()


@pytest.mark.parametrize("policy", POLICIES)
def test_linen_stack_on_an_auto_mesh_equals_nn_scan(policy):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    x = jax.random.normal(jax.random.key(1), (B, D))
    results = {}
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        x = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        for kind in ("stock", "jaxmem"):
            model = linen_model(kind, policy)
            abstract = jax.eval_shape(model.init, jax.random.key(0), x)
            shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
            params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
            init_specs = specs(nn.unbox(params))
            if kind == "jaxmem":  # Same values as stock's (nn.remat renames the module, and
                # the module path seeds the initializers); the same layout is checked above.
                stock_leaves = jax.tree.leaves(results["stock"]["boxed"])
                params = jax.tree.unflatten(jax.tree.structure(params), stock_leaves)
            fn = jax.jit(jax.value_and_grad(lambda p, x, m=model: jnp.mean(m.apply(p, x) ** 2)))
            compiled = fn.lower(params, x).compile()
            value, grads = fn(params, x)
            results[kind] = dict(
                boxed=params,
                init_specs=init_specs,
                # Leaves only: nn.remat renames the stacked module (ScanCheckpointLinenBlock).
                params=jax.tree.leaves(nn.unbox(params)),
                out=(value, jax.tree.leaves(nn.unbox(grads))),
                grad_specs=output_specs(compiled, grads),
                temp=compiled.memory_analysis().temp_size_in_bytes,
            )
    stock, lean = results["stock"], results["jaxmem"]
    # The layer axis is unsharded ("layers" -> None), the kernels tensor parallel over 'model'.
    assert (None, None, "model") in stock["init_specs"]
    assert lean["init_specs"] == stock["init_specs"]
    assert_close(lean["out"], stock["out"])
    assert lean["grad_specs"] == stock["grad_specs"]
    assert lean["temp"] <= stock["temp"], (lean["temp"], stock["temp"])


# --- NNX ------------------------------------------------------------------------------------


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            D, F, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs
        )
        self.down = nnx.Linear(
            F, D, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs
        )

    def __call__(self, h):
        u = jax.nn.gelu(self.up(h))
        if AxisType.Explicit in tuple(jax.sharding.get_abstract_mesh().axis_types):
            # Row parallel: the contraction over 'model' needs its output sharding.
            out = jnp.matmul(u, self.down.kernel[...], out_sharding=P("data", None))
            return h + out + self.down.bias[...][None]
        return h + self.down(u)


def nnx_stock_layers(policy):
    meta = {nnx.PARTITION_NAME: None}

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=meta)
    def create(rngs):
        return NNXBlock(rngs)

    layers = create(nnx.Rngs(0))

    def loss(layers, x):
        call = lambda blk, h: blk(h)
        if policy is not None:
            call = nnx.remat(call, policy=jax.checkpoint_policies.dots_saveable)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=meta)
        def forward(h, blk):
            return call(blk, h)

        return jnp.mean(forward(x, layers) ** 2)

    return layers, loss


def nnx_jaxmem_layers(policy):
    stack = jn.ScanLayers(
        NNXBlock, L, rngs=nnx.Rngs(0), policy=policy, transform_metadata={nnx.PARTITION_NAME: None}
    )
    return stack, lambda stack, x: jnp.mean(stack(x) ** 2)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_nnx_stack_on_a_mesh_equals_nnx_scan(axis_type, policy):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    results = {}
    with jax.set_mesh(mesh):
        x = jax.device_put(jax.random.normal(jax.random.key(1), (B, D)), P("data", None))
        for kind, build in (("stock", nnx_stock_layers), ("jaxmem", nnx_jaxmem_layers)):
            module, loss = build(policy)
            graphdef, state = nnx.split(module)

            def pure(state, x, graphdef=graphdef, loss=loss):
                return loss(nnx.merge(graphdef, state), x)

            fn = jax.jit(jax.value_and_grad(pure))
            compiled = fn.lower(state, x).compile()
            value, grads = fn(state, x)
            results[kind] = dict(
                params=jax.tree.leaves(state),
                out=(value, jax.tree.leaves(grads)),
                grad_specs=output_specs(compiled, grads),
                temp=compiled.memory_analysis().temp_size_in_bytes,
            )
    stock, lean = results["stock"], results["jaxmem"]
    assert (None, None, "model") in specs(stock["params"])
    assert specs(lean["params"]) == specs(stock["params"])
    assert_close(lean["params"], stock["params"])
    assert_close(lean["out"], stock["out"])
    assert lean["grad_specs"] == stock["grad_specs"]
    if axis_type == AxisType.Explicit:  # Sharding in types: the gradients are typed like params.
        assert specs(lean["out"][1]) == specs(lean["params"])
    assert lean["temp"] <= stock["temp"], (lean["temp"], stock["temp"])


def _stream_loss(y):
    return jnp.mean(y[0] ** 2) + jnp.mean(y[1] ** 2)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_nnx_reversible_stack_on_a_mesh_equals_nnx_scan(axis_type):
    """The reversible stack's blocks sharded like ScanLayers' (the layer axis named in the
    metadata, taken out of each layer's slice); against the same coupling under nnx.scan."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    meta = {nnx.PARTITION_NAME: None}

    def stock(stack, x):
        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry, transform_metadata=meta)
        def forward(c, f, g):
            y1 = c[0] + f(c[1])
            return y1, c[1] + g(y1)

        return _stream_loss(forward((x, x), stack.f, stack.g))

    def lean(stack, x):
        return _stream_loss(stack((x, x)))

    results = {}
    with jax.set_mesh(mesh):
        x = jax.device_put(jax.random.normal(jax.random.key(1), (B, D)), P("data", None))
        stack = jn.ReversibleLayers(
            NNXBlock, NNXBlock, L, rngs=nnx.Rngs(0), transform_metadata=meta
        )
        graphdef, state = nnx.split(stack)
        for kind, loss in (("stock", stock), ("jaxmem", lean)):

            def pure(state, x, loss=loss):
                return loss(nnx.merge(graphdef, state), x)

            fn = jax.jit(jax.value_and_grad(pure))
            compiled = fn.lower(state, x).compile()
            value, grads = fn(state, x)
            results[kind] = dict(
                out=(value, jax.tree.leaves(grads)),
                grad_specs=output_specs(compiled, grads),
                temp=compiled.memory_analysis().temp_size_in_bytes,
            )
    kernel_spec = nnx.get_partition_spec(nnx.state(stack))["f"]["up"]["kernel"]
    if isinstance(kernel_spec, nnx.Variable):  # a Variable holding the spec on some versions
        kernel_spec = kernel_spec.get_value()
    assert tuple(kernel_spec) == (None, None, "model"), kernel_spec
    assert (None, None, "model") in specs(jax.tree.leaves(state))
    stock_r, lean_r = results["stock"], results["jaxmem"]
    # Reconstruction rounds (these blocks carry their own residual: gain above one): compared
    # at each leaf's scale.
    for a, e in zip(jax.tree.leaves(lean_r["out"]), jax.tree.leaves(stock_r["out"]), strict=True):
        assert float(jnp.linalg.norm(a - e)) <= 1e-5 * float(jnp.linalg.norm(e))
    assert lean_r["grad_specs"] == stock_r["grad_specs"]
    assert lean_r["temp"] <= stock_r["temp"], (lean_r["temp"], stock_r["temp"])


def test_nnx_transform_metadata_must_be_a_mapping():
    with pytest.raises(TypeError, match="transform_metadata must be a mapping"):
        jn.ScanLayers(NNXBlock, L, rngs=nnx.Rngs(0), transform_metadata="layers")


# --- inside shard_map -----------------------------------------------------------------------


def _shard_map_grads(loss, params, x):
    """Gradient of ``loss(params, x_local)`` summed over 'data' in shard_map (check_vma on),
    params replicated, the batch split over 8 devices."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    local = lambda p, x: jax.lax.psum(loss(p, x), "data")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    return jax.jit(jax.value_and_grad(sharded))(params, x)


@pytest.mark.parametrize("policy", POLICIES)
def test_linen_stack_inside_shard_map_equals_nn_scan(policy):
    x = jax.random.normal(jax.random.key(1), (B, D))
    out = {}
    with nn.logical_axis_rules(()):  # no mesh axes inside shard_map: annotations are no-ops
        for kind in ("stock", "jaxmem"):
            model = linen_model(kind, policy)
            params = nn.unbox(model.init(jax.random.key(0), x))
            if kind == "jaxmem":  # stock's values in jaxmem's tree (the names differ with remat)
                params = jax.tree.unflatten(jax.tree.structure(params), out["stock"][0])
            loss = lambda p, x, m=model: jnp.sum(m.apply(p, x) ** 2) / (B * D)
            value, grads = _shard_map_grads(loss, params, x)
            out[kind] = (jax.tree.leaves(params), value, jax.tree.leaves(grads))
    assert_close(out["jaxmem"][1:], out["stock"][1:])


@pytest.mark.parametrize("policy", POLICIES)
def test_nnx_stack_inside_shard_map_equals_nnx_scan(policy):
    x = jax.random.normal(jax.random.key(1), (B, D))
    out = {}
    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    for kind, build in (("stock", nnx_stock_layers), ("jaxmem", nnx_jaxmem_layers)):
        with jax.set_mesh(auto):  # annotated variables are created under a mesh
            module, loss = build(policy)
        graphdef, state = nnx.split(module)

        def pure(state, x, graphdef=graphdef, loss=loss):
            return loss(nnx.merge(graphdef, state), x) * (x.shape[0] / B)

        value, grads = _shard_map_grads(pure, state, x)
        out[kind] = (value, jax.tree.leaves(grads))
    assert_close(out["jaxmem"], out["stock"])


class ExplicitLinenBlock(nn.Module):
    """A Megatron block for an Explicit mesh: the row-parallel matmul names its output sharding.

    Its parameters carry no ``nn.with_partitioning`` boxes: linen unboxes them with
    ``with_sharding_constraint``, which is an assertion under Explicit axes (for ``nn.scan`` as
    for jaxmem), so the parameters are placed with ``jax.device_put`` after init instead.
    """

    @nn.compact
    def __call__(self, h, _):
        init = nn.initializers.lecun_normal()
        up = self.param("up", init, (D, F))
        down = self.param("down", init, (F, D))
        u = jax.nn.gelu(h @ up)
        return h + jnp.matmul(u, down, out_sharding=P("data", None)), None


class _Stacked(nn.Module):
    stack: Any

    @nn.compact
    def __call__(self, x):
        return self.stack()(x, None)[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_linen_stack_on_an_explicit_mesh_equals_nn_scan(policy):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    specs_of = {"up": P(None, None, "model"), "down": P(None, "model", None)}
    results = {}
    with jax.set_mesh(mesh):
        x = jax.device_put(jax.random.normal(jax.random.key(1), (B, D)), P("data", None))
        for kind in ("stock", "jaxmem"):
            if kind == "stock":
                block = ExplicitLinenBlock
                if policy is not None:
                    block = nn.remat(block, policy=jax.checkpoint_policies.dots_saveable)
                stack = nn.scan(
                    block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L
                )
            else:
                stack = jl.scan_layers(ExplicitLinenBlock, L, carry_only=False, policy=policy)
            model = _Stacked(stack)
            params = jax.jit(model.init)(jax.random.key(0), x)
            if kind == "jaxmem":  # stock's values (nn.remat renames the module)
                params = jax.tree.unflatten(jax.tree.structure(params), results["stock"][0])
            params = jax.tree_util.tree_map_with_path(
                lambda path, a: jax.device_put(a, specs_of[path[-1].key]), params
            )
            fn = jax.jit(jax.value_and_grad(lambda p, x, m=model: jnp.mean(m.apply(p, x) ** 2)))
            compiled = fn.lower(params, x).compile()
            value, grads = fn(params, x)
            results[kind] = (
                jax.tree.leaves(params),
                (value, jax.tree.leaves(grads)),
                [jax.typeof(g).sharding.spec for g in jax.tree.leaves(grads)],
                compiled.memory_analysis().temp_size_in_bytes,
            )
    (_, lean, lean_specs, lean_temp), (params, ref, ref_specs, ref_temp) = (
        results["jaxmem"],
        results["stock"],
    )
    assert_close(lean, ref)
    assert lean_specs == ref_specs == [jax.typeof(p).sharding.spec for p in params]
    assert lean_temp <= ref_temp, (lean_temp, ref_temp)
