"""A jaxmem scan lifted over a linen module's variable collections and rng streams: each
collection scanned or broadcast by its axis, the scanned ones checked to be stacked, the scan's
in and out axes moved to the front and back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict, meta
from jax.tree_util import keystr, tree_flatten_with_path

from jaxmem._src.flax import compat as _compat
from jaxmem._src.scan import api as _scan
from jaxmem._src.scan.options import ScanOptions


def _to_front(ax, xs):
    if ax is _compat.BROADCAST:
        return ()
    return jax.tree_util.tree_map(lambda x: jnp.moveaxis(x, ax, 0), xs)


def _from_front(ax, ys):
    if ax is _compat.BROADCAST:
        return ()
    return jax.tree_util.tree_map(lambda y: jnp.moveaxis(y, 0, ax), ys)


def _broadcast_outputs(body_fn, init, xs):
    """Runs one step for its loop-invariant outputs, as ``flax.core.axes_scan.scan`` does.

    Flax traces the body once, checks that the broadcast outputs (broadcast variables and
    broadcast ``ys``) do not depend on the carry or the scanned inputs, and evaluates them
    outside the loop. Here the step runs under ``jax.vmap`` over a batch of one (public API):
    an output that depends on the carry or ``xs`` is batched, which ``out_axes=None`` rejects.
    """
    batched = (
        jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 0), init),
        jax.tree_util.tree_map(lambda x: x[:1], xs),
    )
    try:
        return jax.vmap(lambda c, x: body_fn(c, x, init_mode=True), out_axes=None)(*batched)
    except ValueError as e:
        if "out_axes" not in str(e):
            raise
        raise ValueError(
            "broadcasted variable has a data dependency on the scan body. (A broadcast "
            "variable or a broadcast output of the scanned body depends on the carry or on a "
            "scanned input.)"
        ) from None


def _axes_scan(fn, in_axes, out_axes, length, reverse, check_constancy, options, on_loop):
    """``flax.core.axes_scan.scan`` with :func:`jaxmem.scan` as its loop.

    ``fn(broadcast_in, carry, *args) -> (broadcast_out, carry, ys)``; broadcast outputs are
    computed once outside the loop (when ``check_constancy``) and fed to the loop body.
    ``on_loop()`` runs between that broadcast step and the loop.
    """
    bcast = _compat.BROADCAST

    def run(broadcast_in, init, *args):
        xs = jax.tree_util.tree_map(_to_front, in_axes, args)

        def body_fn(c, xs, init_mode=False):
            xs = jax.tree_util.tree_map(
                lambda ax, arg, x: arg if ax is bcast else x, in_axes, args, xs
            )
            broadcast_out, c, ys = fn(broadcast_in, c, *xs)
            if init_mode:
                ys = jax.tree_util.tree_map(lambda ax, y: y if ax is bcast else (), out_axes, ys)
                return broadcast_out, ys
            ys = jax.tree_util.tree_map(lambda ax, y: () if ax is bcast else y, out_axes, ys)
            return c, ys

        if check_constancy:
            broadcast_in, constants_out = _broadcast_outputs(body_fn, init, xs)
        elif bcast in jax.tree_util.tree_leaves(out_axes):
            raise ValueError(
                "nn.scan run with check_constancy_invariants=False does not support broadcast "
                f"non-carry function outputs.  out_axes was given as {out_axes}"
            )
        on_loop()
        c, ys = _scan.run_with(body_fn, init, xs, length, bool(reverse), options)
        ys = jax.tree_util.tree_map(_from_front, out_axes, ys)
        if check_constancy:
            ys = jax.tree_util.tree_map(
                lambda ax, const, y: const if ax is bcast else y, out_axes, constants_out, ys
            )
        return broadcast_in, c, ys

    return run


def _scan_length(in_axes, args, length):
    """The number of steps: ``length``, or the scanned inputs' size (``lift.scan``'s rule)."""

    def find_length(axis, x):
        if axis is not _compat.BROADCAST:
            leaves = jax.tree_util.tree_leaves(x)
            if leaves:
                return leaves[0].shape[axis]
        return ()

    lengths = set(jax.tree_util.tree_leaves(jax.tree_util.tree_map(find_length, in_axes, args)))
    if len(lengths) > 1:
        raise ValueError(f"Inconsistent scan lengths: {lengths}")
    if length is None and not lengths:
        raise ValueError("length should be specified manually.")
    return length if length is not None else lengths.pop()


def _check_stacked(group: tuple[Mapping[str, Any], ...], axis: int, length: int, fname: str):
    """Checks every variable of ``group`` (one collection dict per lifted scope) is stacked."""
    for col, tree in ((c, t) for scope_vars in group for c, t in scope_vars.items()):
        for path, x in tree_flatten_with_path(meta.unbox(tree))[0]:
            shape = np.shape(x)
            ax = axis if axis >= 0 else len(shape) + axis
            if not 0 <= ax < len(shape) or shape[ax] != length:
                raise ValueError(
                    f"{fname}: variable {col}{keystr(path)} has shape {shape}, but the scan has "
                    f"length={length} along variable axis {axis}. Pass variables created by "
                    "this scan (or by the nn.scan equivalent with the same length), and list "
                    "each stacked collection in variable_axes with the axis it is stacked on."
                )


def _lift_scan(
    fn: Callable[..., Any],
    variable_axes: Mapping[Any, Any] = FrozenDict(),
    variable_broadcast: Any = False,
    variable_carry: Any = False,
    split_rngs: Mapping[Any, bool] = FrozenDict(),
    in_axes: Any = 0,
    out_axes: Any = 0,
    length: int | None = None,
    reverse: bool = False,
    unroll: int = 1,
    data_transform: Callable[..., Any] | None = None,
    metadata_params: Mapping[Any, Any] = FrozenDict(),
    check_constancy_invariants: bool = True,
    *,
    carry_only: bool,
    options: ScanOptions,
):
    """``flax.core.lift.scan`` with ``jaxmem.scan`` as its loop (same rng and variable layout),
    under ``options`` (their ``unroll`` replaced by the one lift.scan passes, checked)."""
    fname = options.fname
    options = options.with_unroll(unroll)
    variable_in_axes, variable_out_axes = _compat.split_in_out_axes(variable_axes)
    variable_in_groups, variable_in_axes = _compat.unzip2(variable_in_axes.items())
    variable_out_groups, variable_out_axes = _compat.unzip2(variable_out_axes.items())
    rng_groups, rng_splits = _compat.unzip2(split_rngs.items())
    rng_axes = tuple(0 if split else _compat.BROADCAST for split in rng_splits)

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, init, *args):
        n = _scan_length(in_axes, args, length)
        rng_groups = tuple(
            _compat.tree_map_rngs(lambda rng: jax.random.split(jax.random.clone(rng), n), group)
            if split
            else group
            for group, split in zip(rng_groups, rng_splits, strict=True)
        )
        pin = _compat.RngPin()

        def step(broadcast_vars, carry, scan_variable_groups, rng_groups, args):
            carry_vars, c = carry
            groups = (broadcast_vars, carry_vars) + scan_variable_groups
            if data_transform is not None:
                groups, rng_groups = data_transform(groups, rng_groups)
            scope = scope_fn(groups, rng_groups)

            def run():
                out = fn(scope, c, *args)
                return (out, None) if carry_only else out

            c_out, y = pin(scope, run)
            out_vars = repack_fn(scope)
            broadcast_out = out_vars[0]
            # Immutable broadcast variables go back into the broadcast output (as in flax),
            # otherwise the loop body would not see them.
            for in_group, out_group in zip(broadcast_vars, broadcast_out, strict=False):
                for col in in_group:
                    if col not in out_group:
                        out_group[col] = in_group[col]
            return broadcast_out, (out_vars[1], c_out), (y, out_vars[2:])

        loop = _axes_scan(
            step,
            in_axes=(variable_in_axes, rng_axes, in_axes),
            out_axes=(out_axes, variable_out_axes),
            length=n,
            reverse=reverse,
            check_constancy=check_constancy_invariants,
            options=options,
            on_loop=pin.start_loop,
        )

        broadcast_vars, carry_vars, *scan_vars = variable_groups
        unstacked = []
        for group, axis in zip(scan_vars, variable_in_axes, strict=True):
            _check_stacked(group, axis, n, fname)
            unstacked.append(meta.remove_axis(group, axis, metadata_params))
        broadcast_vars, (carry_vars, c), (ys, scan_vars) = loop(
            broadcast_vars, (carry_vars, init), tuple(unstacked), rng_groups, args
        )
        scan_vars = tuple(
            meta.add_axis(group, axis, metadata_params)
            for group, axis in zip(scan_vars, variable_out_axes, strict=True)
        )
        return (c if carry_only else (c, ys)), (broadcast_vars, carry_vars) + scan_vars

    return _compat.pack(
        inner,
        (variable_broadcast, variable_carry) + variable_in_groups,
        (variable_broadcast, variable_carry) + variable_out_groups,
        rng_groups,
        name="scan",
    )
