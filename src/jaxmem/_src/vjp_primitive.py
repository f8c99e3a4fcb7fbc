"""A function with jaxmem's own reverse-mode rule that keeps every other transformation.

``jax.custom_vjp`` gives a function a memory-lean backward pass and takes forward mode away:
``jax.jvp``, ``jax.jacfwd`` and ``jax.linearize`` raise. :func:`custom_vjp` here takes the same
three functions (``fun``, ``fwd``, ``bwd``) and binds them as one hijax primitive
(:data:`jaxmem._src.jax_compat.HiPrimitive`) whose rules are:

- evaluation and lowering: ``fun``;
- reverse mode: ``fwd`` then ``bwd`` (the residuals ``fwd`` chooses, as with ``jax.custom_vjp``);
- forward mode: the JVP of ``fun`` (what ``jax.jvp`` of the plain function computes);
- batching: the same primitive over ``jax.vmap`` of the three functions, the residuals' batch
  axes inferred (an unbatched residual, a shared weight say, stays unbatched).

Used by the losses (:func:`jaxmem.linear_cross_entropy`, :func:`jaxmem.chunked`,
:func:`jaxmem.autochunk`) and the reversible stacks.

Examples:
  >>> import jax, jax.numpy as jnp
  >>> f = custom_vjp(
  ...     jnp.sin,
  ...     fwd=lambda x: (jnp.sin(x), jnp.cos(x)),
  ...     bwd=lambda cos, ct: (cos * ct,),
  ...     name="sin",
  ... )
  >>> x = jnp.float32(0.5)
  >>> bool(jnp.allclose(jax.grad(f)(x), jnp.cos(x)))
  True
  >>> bool(jnp.allclose(jax.jvp(f, (x,), (x,))[1], x * jnp.cos(x)))  # forward mode too
  True
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxmem._src import jax_compat as _jc


def custom_vjp(
    fun: Callable, *, fwd: Callable, bwd: Callable, name: str, nonzeros: bool = False
) -> Callable:
    """``fun`` with the reverse-mode rule ``fwd``/``bwd`` (``jax.custom_vjp``'s contract, without
    ``nondiff_argnums``: close over static values) and every other transformation.

    ``fwd(*args) -> (out, residuals)``; ``bwd(residuals, out_cotangent) -> a tuple of one
    cotangent per argument`` (None, or a tree of None, for an argument without one). Zero output
    cotangents reach ``bwd`` as arrays of zeros. With ``nonzeros=True``, ``fwd`` also gets
    ``nonzeros=``: per argument, whether its cotangent is wanted (a bool, or a tree of bools;
    all True where JAX does not say), so that ``bwd`` need not compute the others.
    """
    if nonzeros:
        wanted = lambda *args: fwd(*args, nonzeros=[True] * len(args))
    else:
        wanted = fwd

    @functools.wraps(fun)
    def call(*args):
        if not _jc.hiprim_usable():  # jax 0.10.2 checking leaks: reverse mode only
            return _jax_custom_vjp(fun, wanted, bwd)(*args)
        return _named(name)(fun, wanted, bwd, name, args, fwd if nonzeros else None)(*args)

    return call


def _jax_custom_vjp(fun, fwd, bwd):
    """``jax.custom_vjp`` of the three (zero cotangents instantiated, as the primitive's)."""
    f = jax.custom_vjp(fun)
    f.defvjp(fwd, lambda res, ct: tuple(bwd(res, ct)))
    return f


class _VJPPrimitive(_jc.HiPrimitive):
    def __init__(self, fun, fwd, bwd, name, args, fwd_nonzeros=None):
        self.in_avals = jax.tree.map(jax.typeof, tuple(args))
        closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
        out_avals = [v.aval for v in _jc.open_jaxpr(closed).outvars]
        self.out_aval = jax.tree.unflatten(jax.tree.structure(out_shape), out_avals)
        self.params = dict(name=name, _fun=fun, _fwd=fwd, _bwd=bwd, _fwd_nz=fwd_nonzeros)
        super().__init__()

    def expand(self, *args):
        return self._fun(*args)

    def vjp_fwd(self, nzs_in, *args):
        if self._fwd_nz is not None:
            return self._fwd_nz(*args, nonzeros=_any_nonzero(nzs_in))
        return self._fwd(*args)

    def vjp_bwd_retval(self, res, ct):
        ct = jax.tree.map(
            lambda a, c: _jc.zero_tangent_value(a) if _jc.is_symbolic_zero(c) else c,
            self.out_aval,
            ct,
            is_leaf=_jc.is_symbolic_zero,
        )
        return tuple(self._bwd(res, ct))

    def jvp(self, primals, tangents):
        # The primal outputs and residuals by ``fwd``; the tangents by a linear primitive that
        # forward mode evaluates as the JVP of ``fun`` and reverse mode transposes by ``bwd``
        # (inside ``jax.checkpoint``, or a loop's step, JAX differentiates by JVP and
        # transposes the tangent part: ``fun``'s own JVP may not transpose, its loops' dynamic
        # bounds say, and would keep every iteration's values if it did).
        tangents = jax.tree.map(
            _jc.instantiate_tangent, primals, tangents, is_leaf=_jc.is_symbolic_zero
        )
        out, res = self._fwd(*primals)
        tangent = _Tangent(self, tuple(primals), res, tuple(tangents))
        return out, tangent(tuple(primals), res, tuple(tangents))

    lin, linearized = _jc.LINEARIZE_FROM_JVP

    def batch(self, axis_data, args, dims):
        params = _jc.vmap_axis_params(axis_data)

        def inferred(f, out_axes):
            """The batch axes ``jax.vmap(f)`` gives its outputs (one abstract trace)."""
            found = []

            def g(*a):
                out, axes = jax.vmap(f, in_axes=dims, out_axes=out_axes, **params)(*a)
                found.append(axes)
                return out

            jax.eval_shape(g, *args)
            return found[0]

        out_dims = inferred(self._fun, _jc.BATCH_INFER)
        _, res_dims = inferred(self._fwd, (out_dims, _jc.BATCH_INFER))
        # Cotangents of unbatched inputs are summed over the batch.
        in_dims = jax.tree.map(
            lambda d: _jc.BATCH_SUM if d is None else d, dims, is_leaf=lambda d: d is None
        )
        batched = type(self)(
            jax.vmap(self._fun, in_axes=dims, out_axes=out_dims, **params),
            jax.vmap(self._fwd, in_axes=dims, out_axes=(out_dims, res_dims), **params),
            jax.vmap(
                self._bwd, in_axes=(res_dims, out_dims), out_axes=in_dims, sum_match=True,
                **params,
            ),
            self.name,
            args,
        )  # fmt: skip
        return batched(*args), out_dims


def _any_nonzero(nzs_in) -> list[bool]:
    """Per argument: whether any of its leaves has a nonzero tangent (JAX's ``nzs_in``)."""
    return [any(jax.tree.leaves(nz)) for nz in nzs_in]


class _Tangent(_jc.HiPrimitive):
    """The tangent map of a :class:`_VJPPrimitive` at its primals: evaluated as the JVP of its
    function, transposed by its ``bwd`` on the residuals ``fwd`` gave."""

    def __init__(self, owner, primals, res, tangents):
        self.in_avals = jax.tree.map(jax.typeof, (primals, res, tangents))
        self.out_aval = owner.out_aval
        self.params = dict(name=f"{owner.name}_tangent", _owner=owner)
        super().__init__()

    def expand(self, primals, res, tangents):
        return jax.jvp(self._owner._fun, primals, tangents)[1]

    def transpose(self, out_ct, primals, res, tangents):
        del primals
        _accumulate(tangents, self._owner.vjp_bwd_retval(res, out_ct))

    def batch(self, axis_data, args, dims):
        # Forward mode over a batch of tangents (jax.jacfwd): the JVP, vmapped.
        params = _jc.vmap_axis_params(axis_data)
        out = jax.vmap(self.expand, in_axes=dims, out_axes=0, **params)(*args)
        return out, jax.tree.map(lambda _: 0, out)


def _accumulate(accums, cts) -> None:
    """In a hijax primitive's ``transpose`` rule: each cotangent of ``cts`` (one tree per
    argument, or None) added to the accumulator JAX gives at its place in ``accums`` (an object
    with ``accum``, for an input that is linear; the others are values), None skipped."""
    is_acc = lambda x: hasattr(x, "accum")
    for acc_tree, ct_tree in zip(accums, cts, strict=True):  # per argument
        if ct_tree is None:
            continue
        flat_cts = jax.tree.leaves(ct_tree, is_leaf=lambda x: x is None)
        for acc, ct in zip(jax.tree.leaves(acc_tree, is_leaf=is_acc), flat_cts, strict=True):
            if is_acc(acc) and ct is not None:
                acc.accum(ct)


@functools.cache
def _named(name: str) -> type:
    """The primitive's class for one ``name``: jax 0.12 prints a hijax primitive by its class's
    name, so a jaxpr reads ``linear_cross_entropy[...]``, not ``_VJPPrimitive[...]``."""
    return type(name, (_VJPPrimitive,), {"__qualname__": name, "__module__": __name__})


def zeros_sharded_like(shape, dtype, like, dims):
    """Zeros of ``shape`` for a loop to write into, typed as the loop's updates will be
    (``dynamic_update_slice`` and a loop's carry need equal types): under an Explicit mesh,
    dimension ``i`` sharded as dimension ``dims[i]`` of ``like`` (a value or its type; None: not
    sharded); inside ``shard_map``, varying over the manual axes ``like`` varies over. On jax
    0.12 ``jnp.zeros(..., out_sharding=)`` and ``zeros_like`` of a sharded value give an
    unsharded type; an explicit ``reshard`` does not.
    """
    zeros = jnp.zeros(shape, dtype)
    like = like if isinstance(like, jax.core.ShapedArray) else jax.typeof(like)
    varying = getattr(getattr(like, "manual_axis_type", None), "varying", None) or ()
    if varying:
        names = jax.sharding.get_abstract_mesh().axis_names
        zeros = jax.lax.pcast(zeros, tuple(n for n in names if n in varying), to="varying")
    sharding = getattr(like, "sharding", None)
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    if not spec or all(p is None for p in spec) or AxisType.Explicit not in tuple(types):
        return zeros
    spec = tuple(spec) + (None,) * (len(like.shape) - len(spec))
    new = PartitionSpec(*(None if d is None else spec[d] for d in dims))
    return jax.sharding.reshard(zeros, NamedSharding(mesh, new))
