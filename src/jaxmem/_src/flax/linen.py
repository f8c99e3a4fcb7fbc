"""Flax linen integration: ``nn.scan`` on :func:`jaxmem.scan`, layer stacks, remat with policies.

:func:`scan` is ``flax.linen.scan`` (same signature: broadcast, carried and scanned
collections, function and Module-class forms, ``methods``, ...) whose loop is
:func:`jaxmem.scan`; :func:`scan_layers` is its form for a stack of identical layers. Both have
the same lifting (``flax.core.lift.pack``), the same variable layout (one
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
import numpy as np
from flax.core import FrozenDict

from jaxmem._src.flax import compat as _compat
from jaxmem._src.flax.linen_lift import _lift_scan
from jaxmem._src.remat import presets as _presets
from jaxmem._src.scan.options import ScanOptions

broadcast = nn.broadcast

_DEFAULT_VARIABLE_AXES = {"params": 0}
_DEFAULT_SPLIT_RNGS = {"params": True, "dropout": True}


# ------------------------------------------------------------------------------------------
# Argument checks shared by the linen and NNX faces.


def _check_length(length: Any, fname: str) -> int:
    if isinstance(length, bool) or not isinstance(length, int | np.integer):
        raise TypeError(
            f"{fname} got length={length!r} ({type(length).__name__}); expected the number of "
            "layers, an int >= 1."
        )
    if length < 1:
        raise ValueError(f"{fname} got length={length}; a layer stack needs length >= 1.")
    return int(length)


# ------------------------------------------------------------------------------------------
# The lifted scan: flax.core.lift.scan with jaxmem.scan as the loop.

_NN_SCAN_WAY_OUT = "Use flax.linen.scan (nn.scan) for this module instead."


def _lift_transform(carry_only: bool, options: ScanOptions):
    """``lift.scan``'s signature with jaxmem's options bound (``methods`` dicts give per-method
    ``lift.scan`` keywords only)."""
    fname = options.fname

    def scan(fn, *args, **kwargs):  # "scan": the lifted class is Scan<Block>, as with nn.scan
        if kwargs.pop("_split_transpose", False):
            raise NotImplementedError(_split_transpose_message(fname))
        return _lift_scan(fn, *args, carry_only=carry_only, options=options, **kwargs)

    return scan


def _split_transpose_message(fname: str) -> str:
    return (
        f"{fname} does not support _split_transpose=True: that experimental lax.scan feature "
        "splits the transpose of lax.scan's own VJP, and jaxmem.scan has a custom VJP instead. "
        + _NN_SCAN_WAY_OUT
    )


def _linen_scan(
    target,
    *,
    variable_axes,
    variable_broadcast,
    variable_carry,
    split_rngs,
    in_axes,
    out_axes,
    length,
    reverse,
    unroll,
    data_transform,
    metadata_params,
    methods,
    split_transpose,
    check_constancy_invariants,
    options: ScanOptions,
    carry_only,
):
    """The one implementation behind :func:`scan` and :func:`scan_layers`: checks, then lifts
    (``options``, checked already, name the caller's API)."""
    fname = options.fname
    if split_transpose:
        raise NotImplementedError(_split_transpose_message(fname))
    if length is not None:
        length = _check_length(length, fname)
    if not isinstance(variable_axes, Mapping):
        raise TypeError(
            f"{fname} got variable_axes={variable_axes!r}; expected a mapping collection -> "
            "int axis, e.g. {'params': 0, 'batch_stats': 0}."
        )
    if not isinstance(split_rngs, Mapping):
        raise TypeError(
            f"{fname} got split_rngs={split_rngs!r}; expected a mapping rng stream -> bool, e.g. "
            "{'params': True, 'dropout': True}."
        )
    return _compat.lift_transform(
        _lift_transform(carry_only, options),
        target,
        variable_axes=variable_axes,
        variable_broadcast=variable_broadcast,
        variable_carry=variable_carry,
        split_rngs=split_rngs,
        in_axes=in_axes,
        out_axes=out_axes,
        length=length,
        reverse=bool(reverse),
        unroll=unroll,
        data_transform=data_transform,
        metadata_params=metadata_params,
        check_constancy_invariants=bool(check_constancy_invariants),
        methods=methods,
    )


def scan(
    target: Any,
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
    methods: Any = None,
    _split_transpose: bool = False,
    check_constancy_invariants: bool = True,
    *,
    policy: Callable | str | None = None,
    offload: str | tuple[str, ...] | None = None,
    recompute: str = "auto",
    checkpoints: int | str | None = None,
    compress: str | None = None,
) -> Any:
    """``flax.linen.scan`` with :func:`jaxmem.scan` as its loop: same signature, lean VJP.

    A drop-in for ``nn.scan``: the same lifting (``flax.core.lift.pack``), the same variable
    layout (scanned collections stacked along their ``variable_axes`` axis; broadcast
    collections computed once outside the loop, with the same data-dependency check; carried
    collections threaded through the loop) and the same RNG streams (split streams are
    ``jax.random.split(jax.random.clone(rng), length)``, and the loop body sees the RNG
    counters ``nn.scan``'s ``lax.scan`` body sees), so variables are interchangeable with the
    ``nn.scan`` equivalent and dropout masks match. Only the loop differs: :func:`jaxmem.scan`,
    whose custom VJP stacks just the partial activations.

    ``target`` is a Module class (scanning its ``__call__``, or ``methods``) or a function
    ``fn(module, carry, *xs) -> (carry, ys)``. For a stack of identical residual layers see
    :func:`scan_layers`.

    Args:
      target: a ``flax.linen.Module`` subclass or a function taking a Module first.
      variable_axes: collection filter -> axis the collection is stacked along.
      variable_broadcast: collections shared by all iterations (computed once, outside).
      variable_carry: collections carried through the loop.
      split_rngs: RNG stream filter -> whether each iteration gets its own key.
      in_axes: prefix tree over ``xs``; ints scan along that axis,
        :data:`flax.linen.broadcast` feeds the whole value to every iteration.
      out_axes: prefix tree over ``ys``; ints stack along that axis, broadcast outputs must be
        loop invariants (as in ``nn.scan``).
      length: the number of iterations; inferred from the scanned inputs when None.
      reverse: scan from end to start.
      unroll: loop unrolling, passed to :func:`jaxmem.scan`.
      data_transform: ``(variable_groups, rng_groups) -> (variable_groups, rng_groups)``
        applied inside the body (inline SPMD annotations), as in ``nn.scan``.
      metadata_params: passed to ``AxisMetadata`` (e.g. ``nn.Partitioned``) ``add_axis``.
      methods: the methods to scan when ``target`` is a Module class.
      _split_transpose: must be False (see Raises).
      check_constancy_invariants: as in ``nn.scan``: True traces the body once more to compute
        broadcast variables and broadcast outputs outside the loop; False skips that trace and
        rejects broadcast outputs.
      policy: remat policy for each iteration (as in :func:`jaxmem.scan`): a
        :mod:`jaxmem.policies` policy, one of ``jax.checkpoint_policies``, or a preset name.
      offload: as in :func:`jaxmem.scan`.
      recompute: as in :func:`jaxmem.scan`.
      checkpoints: as in :func:`jaxmem.scan` (binomial checkpointing of the loop: at most
        ``k`` carries stored, ``"sqrt"`` for ``ceil(sqrt(length))``; None: the lean VJP).
        Variables, RNG streams and values are ``nn.scan``'s either way.

    Returns:
      The scanned Module class, or the scanned function ``(module, carry, *xs) -> (carry,
      ys)``.

    Raises:
      NotImplementedError: ``_split_transpose=True``: it splits ``lax.scan``'s own transpose,
        and jaxmem's loop has a custom VJP; use ``nn.scan``.
      TypeError: a bad ``policy``, ``unroll``, ``variable_axes`` or ``split_rngs``.
      ValueError: inconsistent scan lengths, no length and nothing scanned, a broadcast
        variable or output that depends on the loop (as ``nn.scan``), an unknown policy name,
        bad ``offload``/``recompute``/``checkpoints`` (``checkpoints`` not positive or a string
        other than ``"sqrt"``, or with an ``offload`` other than ``"carries"``/``"all"``; a
        ``TypeError`` for a non-int), or stacked variables whose size along their axis is not
        the scan length.

    Examples:
      nn.scan's LSTM example, with jaxmem's loop:

      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> from jaxmem.flax import linen as jl
      >>> class LSTM(nn.Module):
      ...   features: int
      ...   @nn.compact
      ...   def __call__(self, x):
      ...     ScanLSTM = jl.scan(
      ...       nn.LSTMCell, variable_broadcast="params",
      ...       split_rngs={"params": False}, in_axes=1, out_axes=1)
      ...     lstm = ScanLSTM(self.features)
      ...     carry = lstm.initialize_carry(jax.random.key(0), x[:, 0].shape)
      ...     carry, x = lstm(carry, x)
      ...     return x
      >>> x = jnp.ones((4, 12, 7))
      >>> y, variables = LSTM(features=32).init_with_output(jax.random.key(0), x)
      >>> y.shape
      (4, 12, 32)
      >>> g = jax.grad(lambda v: LSTM(32).apply(v, x).sum())(variables)

      The function form, with a remat policy per iteration:

      >>> class Stack(nn.Module):
      ...   @nn.compact
      ...   def __call__(self, x):
      ...     def body(mdl, c, _):
      ...       return c + jnp.tanh(mdl(c)), None
      ...     f = jl.scan(body, variable_axes={"params": 0}, split_rngs={"params": True},
      ...                 length=3, policy="dots")
      ...     return f(nn.Dense(4), x, None)[0]
      >>> Stack().init(jax.random.key(0), jnp.ones((2, 4)))["params"]["Dense_0"]["kernel"].shape
      (3, 4, 4)
    """
    return _linen_scan(
        target,
        variable_axes=variable_axes,
        variable_broadcast=variable_broadcast,
        variable_carry=variable_carry,
        split_rngs=split_rngs,
        in_axes=in_axes,
        out_axes=out_axes,
        length=length,
        reverse=reverse,
        unroll=unroll,
        data_transform=data_transform,
        metadata_params=metadata_params,
        methods=methods,
        split_transpose=_split_transpose,
        check_constancy_invariants=check_constancy_invariants,
        options=ScanOptions.create(
            "jaxmem.flax.linen.scan",
            policy=policy,
            offload=offload,
            recompute=recompute,
            unroll=unroll,
            checkpoints=checkpoints,
            compress=compress,
        ),
        carry_only=False,
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
    recompute: str = "auto",
    checkpoints: int | str | None = None,
    compress: str | None = None,
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
      recompute: as in :func:`jaxmem.scan` (``"auto"``, ``"cheap"`` or ``"none"``).
      checkpoints: as in :func:`jaxmem.scan` (binomial checkpointing of the layer loop: at most
        ``k`` carries stored, ``"sqrt"`` for ``ceil(sqrt(length))``; None: the lean VJP).
      compress: as in :func:`jaxmem.scan` (the kept float values in fewer bits: ``"bf16"``,
        ``"fp8"``, ``"int8"``; lossy, docs/compress.md).
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
        function), ``length`` not an int, a bad ``policy``, or a non-int ``checkpoints``.
      ValueError: ``length < 1``, an unknown policy name, bad ``offload``/``recompute``,
        ``checkpoints`` not positive (or a string other than ``"sqrt"``, or with an ``offload``
        other than ``"carries"``/``"all"``), or
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
    if not isinstance(variable_axes, Mapping) or not all(
        isinstance(ax, int) and not isinstance(ax, bool) for ax in variable_axes.values()
    ):
        raise TypeError(
            f"{fname} got variable_axes={variable_axes!r}; expected a mapping collection -> int "
            "layer axis, e.g. {'params': 0, 'batch_stats': 0}. Broadcast (shared) variables are "
            "not supported here: keep them outside the stack, or use jaxmem.flax.linen.scan "
            "with variable_broadcast=..."
        )
    options = ScanOptions.create(
        fname,
        policy=policy,
        offload=offload,
        recompute=recompute,
        unroll=unroll,
        checkpoints=checkpoints,
        compress=compress,
    )
    return _linen_scan(
        block_cls,
        variable_axes=dict(variable_axes),
        variable_broadcast=False,
        variable_carry=False,
        split_rngs=split_rngs,
        in_axes=in_axes,
        out_axes=out_axes,
        length=length,
        reverse=reverse,
        unroll=unroll,
        data_transform=None,
        metadata_params=dict(metadata_params or {}),
        methods=None,
        split_transpose=False,
        check_constancy_invariants=True,
        options=options,
        carry_only=bool(carry_only),
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
    policy = _presets.resolve(policy, fname)
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
