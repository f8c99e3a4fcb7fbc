"""Flax NNX integration: ``nnx.scan`` run by :func:`jaxmem.scan`, layer stacks, and remat.

:func:`scan` is ``flax.nnx.scan`` with :func:`jaxmem.scan` as its loop: flax's own pipeline
(in/out axes with ``nnx.Carry``, ``nnx.StateAxes``, the split of graph nodes into carried,
scanned and broadcast state around the loop, the write-back of updated state,
``transform_metadata``) runs unchanged, and only the ``jax.lax.scan`` call is replaced.

:class:`ScanLayers` builds ``length`` copies of a block the NNX way (``nnx.split_rngs`` +
``nnx.vmap``, so every variable gets a leading layer axis and each layer its own RNG streams)
and applies them with :func:`scan` (``in_axes=(0, nnx.Carry), out_axes=nnx.Carry``), so updated
layer state (BatchNorm statistics, RNG counters) is written back as ``nnx.scan`` writes it.

Examples:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxmem.flax import nnx as jn
  >>> stack = jn.scan_layers(lambda rngs: nnx.Linear(4, 4, rngs=rngs), 3, rngs=nnx.Rngs(0))
  >>> stack.layers.kernel.shape
  (3, 4, 4)
  >>> stack(jnp.ones((2, 4))).shape
  (2, 4)
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import FrozenDict
from flax.typing import Missing
from jax.tree_util import tree_flatten, tree_flatten_with_path, tree_unflatten

from jaxmem._src import jax_compat as _jc
from jaxmem._src.flax import compat as _compat
from jaxmem._src.flax.linen import (
    _check_length,
)
from jaxmem._src.remat import auto as _auto
from jaxmem._src.remat import presets as _presets
from jaxmem._src.scan import api as _scan
from jaxmem._src.scan.options import ScanOptions, infer_length


def _check_stack(layers: Any, length: int, fname: str):
    """Every array in the stack's state has ``length`` along its leading (layer) axis."""
    state = nnx.state(layers)
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        shape = getattr(x, "shape", ())
        if not shape or shape[0] != length:
            keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
            where = ".".join(keys[:-1] if keys[-1:] == ["value"] else keys)
            raise ValueError(
                f"{fname}: variable layers.{where} has shape {tuple(shape)}, but the stack has "
                f"length={length} along its leading layer axis. Create the layers through "
                "ScanLayers/scan_layers (nnx.split_rngs + nnx.vmap), and do not replace the "
                "stacked layers with unstacked ones."
            )


# ------------------------------------------------------------------------------------------
# nnx.scan with jaxmem.scan as the loop (flax's own pipeline, rebuilt in compat.py).


@dataclasses.dataclass(frozen=True)
class _Traced:
    """One trace of a loop body: its jaxpr (carry leaves then x leaves in, carry then y out)."""

    jaxpr: Any
    carry_tree: Any
    y_tree: Any
    carry_out_avals: tuple


# Traces of loop bodies, per body object (flax builds one ScanFn/SimpleScanFn per decorated
# function) and per input types: as jax.lax.scan caches its body's trace, so a body is traced
# once, not once per call. Only traces without traced constants (of an outer jit/grad) are kept.
# One cache for the process (a trace is valid in any thread: the key holds what it depends
# on), behind a lock: the planner traces candidates in threads.
_TRACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TRACES_LOCK = threading.Lock()


def _trace_key(carry_tree, x_tree, carry_avals, x_avals):
    # The plan of policy="auto" stacks nested in the body (jaxmem.use_plan) is traced into it.
    context = (jax.config.jax_enable_x64, jax.sharding.get_abstract_mesh(), _auto.current())
    return (carry_tree, x_tree, tuple(carry_avals), tuple(x_avals), context)


def _trace(f, carry_tree, x_tree, carry_avals, x_avals) -> _Traced:
    """Traces ``f(carry, x)`` for these input types, or returns the cached trace."""
    try:
        with _TRACES_LOCK:
            cache = _TRACES.setdefault(f, {})
    except TypeError:  # not weak-referenceable: no cache
        cache = {}
    key = _trace_key(carry_tree, x_tree, carry_avals, x_avals)
    try:
        hit = cache.get(key)
    except TypeError:  # an unhashable part of a tree: no cache
        hit, cache = None, {}
    if hit is not None:
        return hit
    trees = []

    def flat(carry_leaves, x_leaves):
        out = f(tree_unflatten(carry_tree, carry_leaves), tree_unflatten(x_tree, x_leaves))
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"jaxmem.flax.nnx.scan: the loop body returned {out!r}, not a pair.")
        carry_leaves, carry_tree_out = tree_flatten(out[0])
        y_leaves, y_tree = tree_flatten(out[1])
        if carry_tree_out != carry_tree:
            raise TypeError(
                "jaxmem.flax.nnx.scan: the loop body changed the carry's tree structure: the "
                f"input carry is {carry_tree} but the body returned {carry_tree_out}. Return a "
                "carry with the same structure (same Variables, same pytree nodes)."
            )
        trees.append((carry_tree_out, y_tree))
        return carry_leaves, y_leaves

    structs = [[_jc.struct(a) for a in avals] for avals in (carry_avals, x_avals)]
    closed, (carry_shapes, _) = jax.make_jaxpr(flat, return_shape=True)(*structs)
    traced = _Traced(closed, *trees[-1], tuple(jax.typeof(s) for s in carry_shapes))
    if not any(isinstance(c, _jc.Tracer) for c in _jc.jaxpr_consts(closed)):
        try:
            with _TRACES_LOCK:
                cache[key] = traced
        except TypeError:
            pass
    return traced


def _loop(f, init, xs, length=None, reverse=False, unroll=1, _split_transpose=False, *, options):
    """``jax.lax.scan`` as flax's scan calls it, run by :func:`jaxmem.scan`.

    The body is traced once per input types (and cached as ``lax.scan`` caches it); the traced
    jaxpr is what :func:`jaxmem.scan` runs. ``_split_transpose`` (a ``lax.scan`` layout option of
    its transpose) has no counterpart in jaxmem's backward loop and is ignored.
    """
    fname = options.fname
    carry_leaves, carry_tree = tree_flatten(init)
    x_leaves, x_tree = tree_flatten(xs)
    as_array = lambda x: x if isinstance(x, _jc.Tracer) else jnp.asarray(x)
    carry_leaves = [as_array(x) for x in carry_leaves]
    x_leaves = [as_array(x) for x in x_leaves]
    x_paths = [p for p, _ in tree_flatten_with_path(xs)[0]]
    length = infer_length(x_paths, x_leaves, length, fname)
    x_avals = [_jc.unstacked(jax.typeof(x), length) for x in x_leaves]
    traced = _trace(f, carry_tree, x_tree, [jax.typeof(x) for x in carry_leaves], x_avals)
    # A weak-typed carry leaf the body changes the dtype of is promoted (as lax.scan does).
    promoted = [
        jax.lax.convert_element_type(x, jax.dtypes.result_type(x, out))
        if jax.typeof(x).weak_type and not _jc.typematch(jax.typeof(x), out)
        else x
        for x, out in zip(carry_leaves, traced.carry_out_avals, strict=True)
    ]
    if any(p is not x for p, x in zip(promoted, carry_leaves, strict=True)):
        carry_leaves = promoted
        traced = _trace(f, carry_tree, x_tree, [jax.typeof(x) for x in carry_leaves], x_avals)
    run = _jc.jaxpr_as_fun(traced.jaxpr)
    n_carry = len(carry_leaves)

    def step(carry, x):
        outs = run(*carry, *x)
        return list(outs[:n_carry]), list(outs[n_carry:])

    options = options.with_unroll(unroll)  # Flax passes the layer's unroll on
    final, ys = _scan.run_with(step, carry_leaves, x_leaves, length, bool(reverse), options)
    return tree_unflatten(traced.carry_tree, final), tree_unflatten(traced.y_tree, ys)


def scan(
    f: Callable | None = None,
    *,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    _split_transpose: bool = False,
    in_axes: Any = (nnx.Carry, 0),
    out_axes: Any = (nnx.Carry, 0),
    transform_metadata: Mapping[str, Any] = FrozenDict({}),
    graph: bool | None = None,
    graph_updates: bool | None = None,
    policy: Callable | str | None = None,
    offload: str | tuple[str, ...] | None = None,
    recompute: str = "auto",
    checkpoints: int | str | None = None,
    compress: str | None = None,
) -> Callable:
    """``flax.nnx.scan`` run by :func:`jaxmem.scan`: same arguments and semantics, lean VJP.

    A drop-in for ``nnx.scan``: function transform (``scan(f, in_axes=...)``) and decorator
    (``@scan(in_axes=...)``, on functions and on methods in a class body); ``in_axes`` /
    ``out_axes`` with ``nnx.Carry``, integer axes (moved to the front and back) and ``None``
    (broadcast); ``nnx.StateAxes`` and ``nnx.prefix`` for module state; ``nnx.split_rngs`` /
    ``nnx.with_rngs`` around it for per-step RNG streams; ``length``, ``reverse``, ``unroll``;
    ``transform_metadata`` (``{nnx.PARTITION_NAME: axis}``); ``graph`` / ``graph_updates``.
    All of this is flax's own code (``flax.nnx.transforms.iteration``); only the loop is
    :func:`jaxmem.scan`, so the gradient stacks partial activations only, with jaxmem's
    ``policy``, ``offload`` and ``recompute``. The body is traced once per input types, as
    under ``nnx.scan``.

    Args:
      f: the function to scan, or None for a decorator.
      length: the number of steps (needed when nothing is scanned over).
      reverse: run from the last step to the first.
      unroll: loop unrolling (forward and backward loops).
      _split_transpose: accepted for ``nnx.scan`` compatibility; ignored.
      in_axes: as ``nnx.scan``: per argument an int (scanned axis), ``None`` (broadcast),
        ``nnx.Carry`` (the carry), ``nnx.StateAxes`` or a prefix tree of these.
      out_axes: as ``nnx.scan`` (``nnx.Carry`` and ints; outputs cannot be broadcast).
      transform_metadata: as ``nnx.scan`` (e.g. ``{nnx.PARTITION_NAME: 'layers'}``).
      graph: as ``nnx.scan`` (None: the current ``nnx.set_graph_mode``).
      graph_updates: as ``nnx.scan`` (None: the current ``nnx.set_graph_updates``).
      policy: remat policy per step: a :mod:`jaxmem.policies` policy, a
        ``jax.checkpoint_policies`` policy, a preset name (``"dots"``, ...) or None.
      offload: as in :func:`jaxmem.scan`.
      recompute: as in :func:`jaxmem.scan` (``"auto"``, ``"cheap"`` or ``"none"``).
      checkpoints: as in :func:`jaxmem.scan` (binomial checkpointing of the loop: at most
        ``k`` carries stored, ``"sqrt"`` for ``ceil(sqrt(length))``; None: the lean VJP).
        State updates and values are ``nnx.scan``'s either way.
      compress: as in :func:`jaxmem.scan` (the kept float values in fewer bits: ``"bf16"``,
        ``"fp8"``, ``"int8"``; lossy, docs/compress.md).

    Returns:
      The scanned function (or, with ``f=None``, a decorator making one).

    Raises:
      ValueError: what ``nnx.scan`` raises (a nested or unmatched ``nnx.Carry``, broadcast
        outputs, a bound method, inconsistent aliasing, carry identity changes), with its
        messages; an unknown policy name, a bad ``offload``/``recompute``, ``checkpoints`` not
        positive or a string other than ``"sqrt"`` (or with an ``offload`` other than
        ``"carries"``/``"all"``).
      TypeError: a bad ``policy``, ``unroll``, a non-int ``checkpoints``; ``f`` not callable.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxmem.flax import nnx as jn
      >>> @nnx.split_rngs(splits=3)
      ... @nnx.vmap(in_axes=0, out_axes=0)
      ... def create(rngs):
      ...   return nnx.Linear(4, 4, rngs=rngs)
      >>> layers = create(nnx.Rngs(0))
      >>> @jn.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, policy="dots")
      ... def forward(layer, x):
      ...   return jnp.tanh(layer(x))
      >>> x = jnp.ones((2, 4))
      >>> forward(layers, x).shape
      (2, 4)
      >>> stock = nnx.scan(forward.__wrapped__, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
      >>> loss = lambda fwd: lambda m: jnp.sum(fwd(m, x) ** 2)
      >>> g, g_ref = nnx.grad(loss(forward))(layers), nnx.grad(loss(stock))(layers)
      >>> bool(jnp.allclose(g.kernel[...], g_ref.kernel[...], rtol=1e-5))
      True
    """
    fname = "jaxmem.flax.nnx.scan"
    options = ScanOptions.create(
        fname,
        policy=policy,
        offload=offload,
        recompute=recompute,
        unroll=unroll,
        checkpoints=checkpoints,
        compress=compress,
    )
    opts = dict(
        length=length,
        reverse=reverse,
        unroll=unroll,
        _split_transpose=_split_transpose,
        in_axes=in_axes,
        out_axes=out_axes,
        transform_metadata=transform_metadata,
        graph=graph,
        graph_updates=graph_updates,
    )
    if f is None or f is Missing:
        return functools.partial(_scan_f, options=options, **opts)
    return _scan_f(f, options=options, **opts)


def _scan_f(f, *, options: ScanOptions, **opts):
    if not callable(f):
        raise TypeError(f"jaxmem.flax.nnx.scan expects a function, got {f!r} ({type(f).__name__}).")
    return _flax_scan(options)(f, **opts)


def _flax_scan(options: ScanOptions) -> Callable:
    """``flax.nnx.scan`` with :func:`_loop` under ``options`` as its loop, rebuilt once per
    distinct options (every ScanLayers call of a model shares one)."""
    try:
        return _flax_scan_cached(options)
    except TypeError:  # an unhashable option (a policy object without __hash__)
        return _compat.nnx_scan_with(functools.partial(_loop, options=options))


@functools.lru_cache(maxsize=64)
def _flax_scan_cached(options: ScanOptions) -> Callable:
    return _compat.nnx_scan_with(functools.partial(_loop, options=options))


class ScanLayers(nnx.Module):
    """``length`` copies of an NNX block with stacked state, applied by :func:`scan`.

    The stacked block lives in ``self.layers`` (the ``nnx.vmap``-created stack, run as
    ``scan(lambda layer, x: layer(x), in_axes=(0, nnx.Carry), out_axes=nnx.Carry)``). Calling
    ``stack(x, *args, **kwargs)`` runs ``x = layer(x, *args, **kwargs)`` for each layer, with
    ``args``/``kwargs`` broadcast to every layer (masks, ``deterministic`` flags); the block must
    return the new carry (same shape and dtype). Updated layer state (BatchNorm statistics, RNG
    stream counters) is written back as ``nnx.scan`` writes it. Forward-mode AD does not pass
    through the stack (see :func:`jaxmem.scan`).

    Args:
      make_block: ``make_block(rngs) -> nnx.Module``, building one layer.
      length: the number of layers, >= 1.
      rngs: the ``nnx.Rngs`` split over the layers (``nnx.split_rngs(splits=length)``).
      policy: remat policy per layer: a :mod:`jaxmem.policies` policy, a
        ``jax.checkpoint_policies`` policy, a preset name (``"dots"``, ``"selective"``, ...),
        or None (no remat).
      offload: as in :func:`jaxmem.scan`.
      recompute: as in :func:`jaxmem.scan` (``"auto"``, ``"cheap"`` or ``"none"``).
      checkpoints: as in :func:`jaxmem.scan` (binomial checkpointing of the layer loop: at most
        ``k`` carries stored, ``"sqrt"`` for ``ceil(sqrt(length))``; None: the lean VJP).
      reverse: run the layers from last to first.
      unroll: loop unrolling, passed to :func:`jaxmem.scan`.
      compress: as in :func:`jaxmem.scan` (the kept float values in fewer bits, lossy).
      transform_metadata: as ``nnx.vmap``'s and ``nnx.scan``'s: with
        ``{nnx.PARTITION_NAME: axis}`` the layer axis is added to (at creation) and removed from
        (in each step) the variables' sharding metadata, so annotated layers are sharded as
        under ``nnx.scan`` (``None``: the layer axis is not sharded).

    Raises:
      TypeError: ``make_block`` not callable or not returning an ``nnx.Module``; a bad policy;
        a non-int ``checkpoints``.
      ValueError: ``length < 1``; an unknown policy name; ``checkpoints`` not positive or a
        string other than ``"sqrt"`` (or with an ``offload`` other than ``"carries"``/``"all"``);
        (when called) stacked state whose leading axis is not ``length``.

    Examples:
      NNX quickstart: a stack of pre-LN MLP blocks with dropout, trained with the ``"dots"``
      policy.

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxmem.flax import nnx as jn
      >>> class Block(nnx.Module):
      ...   def __init__(self, d, f, *, rngs):
      ...     self.ln = nnx.LayerNorm(d, rngs=rngs)
      ...     self.up = nnx.Linear(d, f, rngs=rngs)
      ...     self.down = nnx.Linear(f, d, rngs=rngs)
      ...     self.drop = nnx.Dropout(0.1, rngs=rngs)
      ...   def __call__(self, h, deterministic=False):
      ...     x = jax.nn.gelu(self.up(self.ln(h)))
      ...     return h + self.down(self.drop(x, deterministic=deterministic))
      >>> stack = jn.ScanLayers(lambda rngs: Block(16, 32, rngs=rngs), 4,
      ...                       rngs=nnx.Rngs(0, dropout=1), policy="dots")
      >>> stack.layers.up.kernel.shape
      (4, 16, 32)
      >>> h = jnp.ones((2, 8, 16))
      >>> grads = nnx.grad(lambda m: jnp.mean(m(h) ** 2))(stack)
      >>> grads.layers.down.kernel.shape
      (4, 32, 16)
      >>> stack(h, deterministic=True).shape
      (2, 8, 16)
    """

    def __init__(
        self,
        make_block: Callable[[nnx.Rngs], nnx.Module],
        length: int,
        *,
        rngs: nnx.Rngs,
        policy: Callable | str | None = None,
        offload: str | tuple[str, ...] | None = None,
        recompute: str = "auto",
        checkpoints: int | str | None = None,
        reverse: bool = False,
        unroll: int = 1,
        transform_metadata: Mapping[str, Any] = FrozenDict({}),
        compress: str | None = None,
    ):
        fname = "jaxmem.flax.nnx.ScanLayers"
        _check_make_block(make_block, fname)
        self.length = _check_length(length, fname)
        # The loop's options, checked once and passed whole to every call's loop.
        self.options = ScanOptions.create(
            fname,
            policy=policy,
            offload=offload,
            recompute=recompute,
            unroll=unroll,
            checkpoints=checkpoints,
            compress=compress,
        )
        self.reverse = bool(reverse)
        self.transform_metadata = _check_transform_metadata(transform_metadata, fname)

        def make(r):
            block = make_block(r)
            if not isinstance(block, nnx.Module):
                raise TypeError(
                    f"{fname}: make_block(rngs) must return an nnx.Module, got "
                    f"{type(block).__name__}. Pass a function building one layer, e.g. "
                    "lambda rngs: Block(..., rngs=rngs)."
                )
            return block

        @nnx.split_rngs(splits=self.length)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=self.transform_metadata)
        def create(r: nnx.Rngs):
            return make(r)

        self.layers = create(rngs)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs ``x = layer(x, *args, **kwargs)`` through the layers; returns the final ``x``."""
        fname = "jaxmem.flax.nnx.ScanLayers"
        _check_stack(self.layers, self.length, fname)

        def step(layer, carry):
            return layer(carry, *args, **kwargs)

        forward = _scan_f(
            step,
            options=self.options,
            in_axes=(0, nnx.Carry),
            out_axes=nnx.Carry,
            reverse=self.reverse,
            unroll=self.options.unroll,
            transform_metadata=self.transform_metadata,
        )
        return forward(self.layers, x)


def _check_transform_metadata(meta: Any, fname: str) -> FrozenDict:
    if not isinstance(meta, Mapping):
        raise TypeError(
            f"{fname}: transform_metadata must be a mapping (as nnx.scan's, e.g. "
            f"{{nnx.PARTITION_NAME: 'layers'}}), got {type(meta).__name__} ({meta!r})."
        )
    return FrozenDict(meta)


def _check_make_block(make_block: Any, fname: str):
    if isinstance(make_block, nnx.Module):
        raise TypeError(
            f"{fname} got a Module instance ({type(make_block).__name__}) as make_block; pass a "
            "function that builds one layer from rngs, e.g. lambda rngs: Block(..., rngs=rngs)."
        )
    if not callable(make_block):
        raise TypeError(
            f"{fname} expects make_block to be callable (rngs -> nnx.Module), got "
            f"{make_block!r} ({type(make_block).__name__})."
        )


def scan_layers(
    make_block: Callable[[nnx.Rngs], nnx.Module],
    length: int,
    *,
    rngs: nnx.Rngs,
    policy: Callable | str | None = None,
    offload: str | tuple[str, ...] | None = None,
    recompute: str = "auto",
    checkpoints: int | str | None = None,
    reverse: bool = False,
    unroll: int = 1,
    transform_metadata: Mapping[str, Any] = FrozenDict({}),
    compress: str | None = None,
) -> ScanLayers:
    """Builds a :class:`ScanLayers` stack: ``length`` NNX blocks applied by :func:`jaxmem.scan`.

    Same as ``ScanLayers(make_block, length, rngs=rngs, ...)``; see :class:`ScanLayers`.

    Args:
      make_block: ``make_block(rngs) -> nnx.Module``.
      length: the number of layers, >= 1.
      rngs: the ``nnx.Rngs`` split over the layers.
      policy: remat policy per layer (a policy or preset name), or None.
      offload: as in :func:`jaxmem.scan`.
      recompute: as in :func:`jaxmem.scan`.
      checkpoints: as in :func:`jaxmem.scan` (binomial checkpointing of the layer loop: at most
        ``k`` carries stored).
      reverse: run the layers from last to first.
      unroll: loop unrolling.
      transform_metadata: as :class:`ScanLayers` (``{nnx.PARTITION_NAME: axis}`` for sharded
        layers).
      compress: as in :func:`jaxmem.scan` (the kept float values in fewer bits, lossy).

    Returns:
      The :class:`ScanLayers` module.

    Raises:
      TypeError, ValueError: as :class:`ScanLayers`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxmem.flax import nnx as jn
      >>> stack = jn.scan_layers(lambda rngs: nnx.Linear(3, 3, rngs=rngs), 2,
      ...                        rngs=nnx.Rngs(0), policy="nothing")
      >>> stack(jnp.ones((1, 3))).shape
      (1, 3)
      >>> jn.scan_layers(lambda rngs: nnx.Linear(3, 3, rngs=rngs), 0, rngs=nnx.Rngs(0))
      Traceback (most recent call last):
        ...
      ValueError: jaxmem.flax.nnx.ScanLayers got length=0; a layer stack needs length >= 1.
    """
    return ScanLayers(
        make_block,
        length,
        rngs=rngs,
        policy=policy,
        offload=offload,
        recompute=recompute,
        checkpoints=checkpoints,
        reverse=reverse,
        unroll=unroll,
        transform_metadata=transform_metadata,
        compress=compress,
    )


def remat(
    f: Callable | None = None,
    *,
    policy: Callable | str | None = None,
    prevent_cse: bool = True,
    static_argnums: int | tuple[int, ...] = (),
):
    """``flax.nnx.remat`` that also takes jaxmem policies and their names.

    Works both ways: ``@remat`` and ``@remat(policy="dots")``, on functions of NNX modules and
    on methods in a class body (``def __call__(self, x)``).

    Args:
      f: the function (or unbound method) to rematerialize; None returns a decorator.
      policy: a :mod:`jaxmem.policies` policy, a ``jax.checkpoint_policies`` policy, a preset
        name (``"nothing"``, ``"dots"``, ``"selective"``, ...) or None (save nothing).
      prevent_cse: as in ``nnx.remat``.
      static_argnums: as in ``nnx.remat``.

    Returns:
      The rematerialized function, or a decorator.

    Raises:
      TypeError: ``f`` is a bound method (``model.__call__``), a Module class or instance, or
        not callable; a bad policy.
      ValueError: an unknown policy name.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxmem.flax import nnx as jn
      >>> class MLP(nnx.Module):
      ...   def __init__(self, rngs):
      ...     self.up, self.down = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)
      ...   @jn.remat(policy="dots")
      ...   def __call__(self, x):
      ...     return self.down(jnp.tanh(self.up(x)))
      >>> model = MLP(nnx.Rngs(0))
      >>> nnx.grad(lambda m: m(jnp.ones((2, 4))).sum())(model).up.kernel.shape
      (4, 8)
      >>> @jn.remat
      ... def apply(m, x):
      ...   return m(x)
      >>> apply(model, jnp.ones((2, 4))).shape
      (2, 4)
      >>> jn.remat(model.__call__)
      Traceback (most recent call last):
        ...
      TypeError: jaxmem.flax.nnx.remat got the bound method MLP.__call__ ...
    """
    fname = "jaxmem.flax.nnx.remat"
    policy = _presets.resolve(policy, fname)
    opts = dict(policy=policy, prevent_cse=prevent_cse, static_argnums=static_argnums)
    if f is None:
        return functools.partial(_remat, fname=fname, **opts)
    return _remat(f, fname=fname, **opts)


def _remat(f, *, fname, **opts):
    owner = getattr(f, "__self__", None)
    if owner is not None and not isinstance(owner, type) and callable(f):
        name = getattr(f, "__name__", "method")
        cls = type(owner).__name__
        raise TypeError(
            f"{fname} got the bound method {cls}.{name} (already bound to an instance); "
            "nnx.remat must see the module as an argument so its state is lifted. Decorate the "
            f"method in the class body (@remat(...) above `def {name}(self, ...)`), or wrap a "
            f"function of the module: remat(lambda m, *a: m.{name}(*a))(module, ...)."
        )
    if isinstance(f, nnx.Module) or (isinstance(f, type) and issubclass(f, nnx.Module)):
        what = f.__name__ if isinstance(f, type) else type(f).__name__
        raise TypeError(
            f"{fname} got the Module {what}; it rematerializes functions. Decorate the "
            "module's __call__ in its class body, or wrap a function of the module: "
            "remat(lambda m, x: m(x))(module, x)."
        )
    if not callable(f):
        raise TypeError(f"{fname} expects a function, got {f!r} ({type(f).__name__}).")
    return nnx.remat(f, **opts)
