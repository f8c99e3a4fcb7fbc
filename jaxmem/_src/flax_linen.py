"""Flax linen integration: layer stacks scanned by :func:`jaxmem.scan`, and remat with policies.

:func:`scan_layers` is ``nn.scan`` for a stack of identical layers whose loop is
:func:`jaxmem.scan`: the same lifting (``flax.core.lift.pack``), the same variable layout (one
leading layer axis per collection in ``variable_axes``) and the same per-layer RNG splitting
(``jax.random.split(jax.random.clone(rng), length)`` per split stream), so parameters are
interchangeable with the ``nn.scan`` equivalent and dropout masks match; only the gradient is
computed by jaxmem's lean custom VJP, which stacks partial activations only.

Examples:
  A 3-layer MLP stack (see :func:`scan_layers` for dropout, masks and policies):

  >>> import jax, jax.numpy as jnp
  >>> import flax.linen as nn
  >>> from jaxmem.flax import linen as jl
  >>> class Layer(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, h):
  ...     return h + jnp.tanh(nn.Dense(4)(h))
  >>> Stack = jl.scan_layers(Layer, 3)
  >>> x = jnp.ones((2, 4))
  >>> params = Stack().init(jax.random.key(0), x)["params"]
  >>> params["Dense_0"]["kernel"].shape
  (3, 4, 4)
  >>> jax.grad(lambda p: Stack().apply({"params": p}, x).sum())(params)["Dense_0"]["bias"].shape
  (3, 4)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import axes_scan, lift, meta
from flax.core.scope import Scope
from jax.tree_util import keystr, tree_flatten_with_path

from jaxmem._src import policies as _policies
from jaxmem._src import scan as _scan

broadcast = nn.broadcast

_DEFAULT_VARIABLE_AXES = {"params": 0}
_DEFAULT_SPLIT_RNGS = {"params": True, "dropout": True}


# ------------------------------------------------------------------------------------------
# Argument checks shared by the linen and NNX faces.


def _resolve_policy(policy: Any, fname: str) -> Callable | None:
    """``None``, a policy, or a preset name (:func:`jaxmem.policies.by_name`) -> policy."""
    if policy is None or callable(policy):
        return policy
    if isinstance(policy, str):
        try:
            return _policies.by_name(policy)
        except ValueError as e:
            raise ValueError(f"{fname}: {e}") from None
    raise TypeError(
        f"{fname} got policy={policy!r} ({type(policy).__name__}); expected None, a remat "
        "policy (jaxmem.policies.* or jax.checkpoint_policies.*) or a preset name such as "
        "'dots' or 'selective'."
    )


def _check_length(length: Any, fname: str) -> int:
    if isinstance(length, bool) or not isinstance(length, int | np.integer):
        raise TypeError(
            f"{fname} got length={length!r} ({type(length).__name__}); expected the number of "
            "layers, an int >= 1."
        )
    if length < 1:
        raise ValueError(f"{fname} got length={length}; a layer stack needs length >= 1.")
    return int(length)


def _check_scan_options(policy, offload, recompute, unroll, fname: str):
    policy = _resolve_policy(policy, fname)
    _scan._check_offload(offload, fname)
    _scan._check_recompute(recompute, fname)
    _scan._check_unroll(unroll, fname)
    return policy


# ------------------------------------------------------------------------------------------
# The lifted scan: flax.core.lift.scan with jaxmem.scan as the loop.


def _axes_scan(fn, in_axes, out_axes, length, reverse, unroll, scan_kwargs):
    """``flax.core.axes_scan.scan`` (without broadcast outputs) running :func:`jaxmem.scan`."""

    def to_front(ax, xs):
        if ax is axes_scan.broadcast:
            return ()
        return jax.tree_util.tree_map(lambda x: jnp.moveaxis(x, ax, 0), xs)

    def from_front(ax, ys):
        if ax is axes_scan.broadcast:
            return ()
        return jax.tree_util.tree_map(lambda y: jnp.moveaxis(y, 0, ax), ys)

    def run(broadcast_in, init, *args):
        xs = jax.tree_util.tree_map(to_front, in_axes, args)

        def body(c, xs):
            xs = jax.tree_util.tree_map(
                lambda ax, arg, x: arg if ax is axes_scan.broadcast else x, in_axes, args, xs
            )
            _, c, ys = fn(broadcast_in, c, *xs)
            return c, ys

        c, ys = _scan.scan(
            body, init, xs, length=length, reverse=reverse, unroll=unroll, **scan_kwargs
        )
        return broadcast_in, c, jax.tree_util.tree_map(from_front, out_axes, ys)

    return run


def _scopes(scope_tree: Any) -> list[Scope]:
    return jax.tree_util.tree_leaves(scope_tree, is_leaf=lambda x: isinstance(x, Scope))


def _set_counters(live: list[dict], values: list[dict]):
    for d, v in zip(live, values, strict=True):
        d.clear()
        d.update(v)


def _dry_trace(step, broadcast_vars, carry, scan_groups, rng_groups, args, in_axes):
    """Traces one step abstractly, as ``flax.core.axes_scan.scan``'s constancy check does."""
    full = (scan_groups, rng_groups, args)
    bcast = axes_scan.broadcast
    sliced = jax.tree_util.tree_map(
        lambda ax, x: (
            () if ax is bcast else jax.tree_util.tree_map(lambda a: jnp.take(a, 0, axis=ax), x)
        ),
        in_axes,
        full,
    )

    def one(carry, sliced):
        xs = jax.tree_util.tree_map(lambda ax, x, s: x if ax is bcast else s, in_axes, full, sliced)
        _, carry, _ = step(broadcast_vars, carry, *xs)
        return carry

    jax.eval_shape(one, carry, sliced)


def _check_stacked(group: tuple[Mapping[str, Any], ...], axis: int, length: int, fname: str):
    """Checks every variable of ``group`` (one collection dict per lifted scope) is stacked."""
    for col, tree in ((c, t) for scope_vars in group for c, t in scope_vars.items()):
        for path, x in tree_flatten_with_path(meta.unbox(tree))[0]:
            shape = np.shape(x)
            ax = axis if axis >= 0 else len(shape) + axis
            if not 0 <= ax < len(shape) or shape[ax] != length:
                raise ValueError(
                    f"{fname}: variable {col}{keystr(path)} has shape {shape}, but the stack has "
                    f"length={length} along variable axis {axis}. Pass variables created by "
                    "this stack (or by the nn.scan equivalent with the same length), and list "
                    "each stacked collection in variable_axes with the axis it is stacked on."
                )


def scan(  # named "scan" so that the lifted class is called Scan<Block>, as with nn.scan
    fn: Callable[..., Any],
    variable_axes: Mapping[Any, int],
    split_rngs: Mapping[Any, bool],
    in_axes: Any,
    out_axes: Any,
    length: int,
    reverse: bool,
    unroll: int,
    metadata_params: Mapping[Any, Any],
    carry_only: bool,
    fname: str,
    scan_kwargs: Mapping[str, Any],
):
    """``flax.core.lift.scan`` with ``jaxmem.scan`` as its loop (same rng and variable layout)."""
    variable_in_axes, variable_out_axes = lift._split_in_out_axes(variable_axes)
    variable_in_groups, variable_in_axes = lift._unzip2(variable_in_axes.items())
    variable_out_groups, variable_out_axes = lift._unzip2(variable_out_axes.items())
    rng_groups, rng_splits = lift._unzip2(split_rngs.items())
    rng_axes = tuple(0 if split else axes_scan.broadcast for split in rng_splits)

    def split_fn(rng):
        return jax.random.split(jax.random.clone(rng), length)

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, init, *args):
        rng_groups = tuple(
            lift.tree_map_rngs(split_fn, group) if split else group
            for group, split in zip(rng_groups, rng_splits, strict=True)
        )

        # Each trace of the body advances the scopes' RNG counters (``make_rng``). nn.scan
        # traces its body twice (a constancy check, then lax.scan); jaxmem.scan traces it a
        # varying number of times. So: one dry trace like nn.scan's, then every trace of the
        # loop body starts from the counters the dry trace left, and retraces leave them alone.
        counters: dict[str, Any] = {}

        def step(broadcast_vars, carry, scan_variable_groups, rng_groups, args):
            carry_vars, c = carry
            scope = scope_fn((broadcast_vars, carry_vars) + scan_variable_groups, rng_groups)
            live = [s.rng_counters for s in _scopes(scope)]
            restore = None
            if "start" not in counters:
                counters["start"] = [dict(d) for d in live]
            else:
                restore = [dict(d) for d in live]
                _set_counters(live, counters["start"])
            out = fn(scope, c, *args)
            c, y = (out, None) if carry_only else out
            out_vars = repack_fn(scope)
            if restore is not None and counters.get("dry_done"):
                _set_counters(live, restore)
            return out_vars[0], (out_vars[1], c), (y, out_vars[2:])

        loop = _axes_scan(
            step,
            in_axes=(variable_in_axes, rng_axes, in_axes),
            out_axes=(out_axes, variable_out_axes),
            length=length,
            reverse=reverse,
            unroll=unroll,
            scan_kwargs=scan_kwargs,
        )
        broadcast_vars, carry_vars, *scan_vars = variable_groups
        unstacked = []
        for group, axis in zip(scan_vars, variable_in_axes, strict=True):
            _check_stacked(group, axis, length, fname)
            unstacked.append(meta.remove_axis(group, axis, metadata_params))
        _dry_trace(
            step,
            broadcast_vars,
            (carry_vars, init),
            tuple(unstacked),
            rng_groups,
            args,
            (variable_in_axes, rng_axes, in_axes),
        )
        counters.clear()
        counters["dry_done"] = True
        broadcast_vars, (carry_vars, c), (ys, scan_vars) = loop(
            broadcast_vars, (carry_vars, init), tuple(unstacked), rng_groups, args
        )
        scan_vars = tuple(
            meta.add_axis(group, axis, metadata_params)
            for group, axis in zip(scan_vars, variable_out_axes, strict=True)
        )
        return (c if carry_only else (c, ys)), (broadcast_vars, carry_vars) + scan_vars

    return lift.pack(
        inner,
        (False, False) + variable_in_groups,
        (False, False) + variable_out_groups,
        rng_groups,
        name="scan",
    )


def _check_module_class(target: Any, fname: str, what: str = "block_cls"):
    if isinstance(target, functools.partial):
        target = target.func
    if isinstance(target, nn.Module):
        raise TypeError(
            f"{fname} got a Module instance ({type(target).__name__}(...)) as {what}; pass the "
            f"class itself (or functools.partial(cls, **attrs)), e.g. {fname}"
            f"({type(target).__name__}, ...), then instantiate the result."
        )
    if getattr(target, "__self__", None) is not None and callable(target):
        raise TypeError(
            f"{fname} got a bound method ({getattr(target, '__qualname__', target)}) as {what}; "
            "pass the linen Module class (or functools.partial(cls, **attrs)). To transform a "
            "method, decorate it in the class body with flax.linen's transforms instead."
        )
    if not (isinstance(target, type) and issubclass(target, nn.Module)):
        raise TypeError(
            f"{fname} expects {what} to be a flax.linen.Module subclass (or "
            f"functools.partial of one), got {target!r} ({type(target).__name__})."
        )


def scan_layers(
    block_cls: type[nn.Module] | functools.partial,
    length: int,
    *,
    policy: Callable | str | None = None,
    offload: str | tuple[str, ...] | None = None,
    recompute: str = "cheap",
    in_axes: Any = broadcast,
    out_axes: Any = 0,
    variable_axes: Mapping[Any, int] = _DEFAULT_VARIABLE_AXES,
    split_rngs: Mapping[Any, bool] = _DEFAULT_SPLIT_RNGS,
    carry_only: bool = True,
    reverse: bool = False,
    unroll: int = 1,
    metadata_params: Mapping[Any, Any] | None = None,
) -> type[nn.Module]:
    """Stacks ``length`` copies of a linen block, scanned by :func:`jaxmem.scan`.

    The result is a Module class (named ``Scan<Block>``, taking ``block_cls``'s attributes) that
    behaves like ``nn.scan(block_cls, variable_axes=..., split_rngs=..., in_axes=...,
    length=length)``: every collection in ``variable_axes`` gets a leading layer axis (the same
    layout, so variables are interchangeable with the ``nn.scan`` equivalent), and each RNG
    stream in ``split_rngs`` that maps to True is split per layer exactly as ``nn.scan`` splits
    it (dropout masks match). Only the loop differs: :func:`jaxmem.scan`, whose VJP stacks just
    the partial activations.

    The block is called as ``block(carry, *args)`` and returns the new carry (the usual
    residual layer); with ``carry_only=False`` it returns ``(carry, y)`` as under ``nn.scan``,
    and the ``y`` are stacked along ``out_axes``. Positional ``args`` follow ``in_axes``: the
    default :data:`flax.linen.broadcast` feeds them to every layer (masks, ``deterministic``
    flags); ``0`` scans them along their leading axis. Keyword arguments are not supported
    (as with ``nn.scan``). Forward-mode AD does not pass through the stack (see
    :func:`jaxmem.scan`).

    Args:
      block_cls: the layer, a ``flax.linen.Module`` subclass (or ``functools.partial`` of one).
      length: the number of layers, >= 1.
      policy: remat policy applied to each layer (``jax.checkpoint(step, policy=...)``): a
        :mod:`jaxmem.policies` policy, one of ``jax.checkpoint_policies``, or a preset name
        (``"nothing"``, ``"dots"``, ``"selective"``, ...). None (default): no remat.
      offload: as in :func:`jaxmem.scan` (host offload of stacked residuals).
      recompute: as in :func:`jaxmem.scan` (``"cheap"`` or ``"none"``).
      in_axes: prefix tree over the positional args after the carry; ints scan, and
        :data:`flax.linen.broadcast` broadcasts.
      out_axes: stacking axis of the ``y`` outputs (only with ``carry_only=False``).
      variable_axes: collection -> stacking axis, e.g. ``{"params": 0, "batch_stats": 0,
        "intermediates": 0}``.
      split_rngs: RNG stream -> whether each layer gets its own key (as in ``nn.scan``).
      carry_only: whether the block returns only the carry (default) or ``(carry, y)``.
      reverse: run the layers from last to first.
      unroll: loop unrolling, passed to :func:`jaxmem.scan`.
      metadata_params: passed to ``nn.Partitioned``-style variable metadata (``add_axis``).

    Returns:
      A linen Module class; instances take ``block_cls``'s attributes.

    Raises:
      TypeError: ``block_cls`` is not a linen Module class (an instance, a bound method, a
        function), ``length`` not an int, or a bad ``policy``.
      ValueError: ``length < 1``, an unknown policy name, bad ``offload``/``recompute``, or
        (when applied) stacked variables whose size along their variable axis is not
        ``length``.

    Examples:
      Quickstart: a GPT-style stack with dropout and a broadcast ``deterministic`` flag,
      trained with the ``"selective"`` policy.

      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> from jaxmem.flax import linen as jl
      >>> class Block(nn.Module):
      ...   d_ff: int
      ...   @nn.compact
      ...   def __call__(self, h, deterministic):
      ...     x = nn.Dense(self.d_ff)(nn.LayerNorm()(h))
      ...     x = nn.Dropout(0.1)(jax.nn.gelu(x), deterministic=deterministic)
      ...     return h + nn.Dense(h.shape[-1])(x)
      >>> Stack = jl.scan_layers(Block, 4, policy="selective")
      >>> model = Stack(d_ff=32)
      >>> h = jnp.ones((2, 8, 16))
      >>> params = model.init(jax.random.key(0), h, True)["params"]
      >>> params["Dense_0"]["kernel"].shape
      (4, 16, 32)
      >>> def loss(p):
      ...   out = model.apply({"params": p}, h, False, rngs={"dropout": jax.random.key(1)})
      ...   return jnp.mean(out**2)
      >>> grads = jax.grad(loss)(params)
      >>> grads["Dense_1"]["kernel"].shape
      (4, 32, 16)
    """
    fname = "jaxmem.flax.linen.scan_layers"
    _check_module_class(block_cls, fname)
    length = _check_length(length, fname)
    policy = _check_scan_options(policy, offload, recompute, unroll, fname)
    if not isinstance(variable_axes, Mapping) or not all(
        isinstance(ax, int) and not isinstance(ax, bool) for ax in variable_axes.values()
    ):
        raise TypeError(
            f"{fname} got variable_axes={variable_axes!r}; expected a mapping collection -> int "
            "layer axis, e.g. {'params': 0, 'batch_stats': 0}. Broadcast (shared) variables are "
            "not supported: keep them outside the stack."
        )
    if not isinstance(split_rngs, Mapping):
        raise TypeError(
            f"{fname} got split_rngs={split_rngs!r}; expected a mapping rng stream -> bool, e.g. "
            "{'params': True, 'dropout': True}."
        )
    scan_kwargs = {"policy": policy, "offload": offload, "recompute": recompute}
    return nn.transforms.lift_transform(
        scan,
        block_cls,
        variable_axes=dict(variable_axes),
        split_rngs=dict(split_rngs),
        in_axes=in_axes,
        out_axes=out_axes,
        length=length,
        reverse=bool(reverse),
        unroll=unroll,
        metadata_params=dict(metadata_params or {}),
        carry_only=bool(carry_only),
        fname=fname,
        scan_kwargs=scan_kwargs,
    )


def remat(
    module_cls: type[nn.Module] | Callable | None = None,
    *,
    policy: Callable | str | None = None,
    prevent_cse: bool = True,
    static_argnums: int | tuple[int, ...] = (),
    **kwargs: Any,
):
    """``flax.linen.remat`` that also takes jaxmem policies and their names.

    Usable as ``remat(Block, policy="dots")``, ``@remat`` / ``@remat(policy=...)`` on a Module
    class, and on a method inside a class body (as ``nn.remat``). Combine with
    :func:`scan_layers` by passing ``policy=`` there instead, or stack ``remat(Block)`` with
    ``nn.scan``.

    Args:
      module_cls: a linen Module class or an unbound method; None returns a decorator.
      policy: a :mod:`jaxmem.policies` policy, a ``jax.checkpoint_policies`` policy, a preset
        name (``"nothing"``, ``"dots"``, ``"selective"``, ...) or None (save nothing).
      prevent_cse: as in ``nn.remat``.
      static_argnums: as in ``nn.remat``.
      **kwargs: other ``nn.remat`` arguments (``variables``, ``rngs``, ``concrete``,
        ``methods``).

    Returns:
      The rematerialized Module class (or method), or a decorator.

    Raises:
      TypeError: a Module instance or a bound method instead of a class; a bad policy.
      ValueError: an unknown policy name.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> from jaxmem.flax import linen as jl
      >>> @jl.remat(policy="dots")
      ... class MLP(nn.Module):
      ...   @nn.compact
      ...   def __call__(self, x):
      ...     return nn.Dense(4)(jnp.tanh(nn.Dense(8)(x)))
      >>> x = jnp.ones((2, 4))
      >>> params = MLP().init(jax.random.key(0), x)
      >>> MLP().apply(params, x).shape
      (2, 4)
      >>> jl.remat(policy="full")
      Traceback (most recent call last):
        ...
      ValueError: jaxmem.flax.linen.remat: jaxmem.policies.by_name: unknown policy 'full'; ...
    """
    fname = "jaxmem.flax.linen.remat"
    policy = _resolve_policy(policy, fname)
    opts = dict(policy=policy, prevent_cse=prevent_cse, static_argnums=static_argnums, **kwargs)
    if module_cls is None:
        return functools.partial(_remat, fname=fname, **opts)
    return _remat(module_cls, fname=fname, **opts)


def _remat(module_cls, *, fname, **opts):
    target = module_cls.func if isinstance(module_cls, functools.partial) else module_cls
    if isinstance(target, type) or isinstance(target, nn.Module) or hasattr(target, "__self__"):
        _check_module_class(module_cls, fname, what="module_cls")
    elif not callable(target):
        raise TypeError(
            f"{fname} expects a linen Module class or a method in a class body, got "
            f"{module_cls!r} ({type(module_cls).__name__})."
        )
    return nn.remat(module_cls, **opts)
