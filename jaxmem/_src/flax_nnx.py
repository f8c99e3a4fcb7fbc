"""Flax NNX integration: layer stacks run by :func:`jaxmem.scan`, and remat with jaxmem policies.

:class:`ScanLayers` builds ``length`` copies of a block the NNX way (``nnx.split_rngs`` +
``nnx.vmap``, so every variable gets a leading layer axis and each layer its own RNG streams)
and applies them with :func:`jaxmem.scan`: the stack is split (``nnx.split``), each step merges
one layer's state slice, calls it and returns the layer's updated state (BatchNorm statistics,
RNG counters) as its output, and the stacked updates are written back with ``nnx.update``, as
``nnx.scan`` does.

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

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx
from flax.core import FrozenDict

from jaxmem._src import scan as _scan
from jaxmem._src.flax_linen import _check_length, _check_scan_options, _resolve_policy


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


class ScanLayers(nnx.Module):
    """``length`` copies of an NNX block with stacked state, applied by :func:`jaxmem.scan`.

    The stacked block lives in ``self.layers`` (its state is that of the ``nnx.vmap``-created
    stack that ``nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)`` would run). Calling
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
      recompute: as in :func:`jaxmem.scan` (``"cheap"`` or ``"none"``).
      reverse: run the layers from last to first.
      unroll: loop unrolling, passed to :func:`jaxmem.scan`.
      transform_metadata: as ``nnx.vmap``'s and ``nnx.scan``'s: with
        ``{nnx.PARTITION_NAME: axis}`` the layer axis is added to (at creation) and removed from
        (in each step) the variables' sharding metadata, so annotated layers are sharded as
        under ``nnx.scan`` (``None``: the layer axis is not sharded).

    Raises:
      TypeError: ``make_block`` not callable or not returning an ``nnx.Module``; a bad policy.
      ValueError: ``length < 1``; an unknown policy name; (when called) stacked state whose
        leading axis is not ``length``.

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
        recompute: str = "cheap",
        reverse: bool = False,
        unroll: int = 1,
        transform_metadata: Mapping[str, Any] = FrozenDict({}),
    ):
        fname = "jaxmem.flax.nnx.ScanLayers"
        _check_make_block(make_block, fname)
        self.length = _check_length(length, fname)
        self.policy = _check_scan_options(policy, offload, recompute, unroll, fname)
        self.offload = offload
        self.recompute = recompute
        self.reverse = bool(reverse)
        self.unroll = unroll
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
        graphdef, state = nnx.split(self.layers)
        meta = self.transform_metadata
        partitioned = nnx.PARTITION_NAME in meta

        def step(carry, layer_state):
            if partitioned:  # One layer's variables: the layer axis leaves their metadata.
                layer_state = nnx.spmd.remove_axis(layer_state, 0, meta)
            layer = nnx.merge(graphdef, layer_state)
            carry = layer(carry, *args, **kwargs)
            new_state = nnx.state(layer)
            if partitioned:
                new_state = nnx.spmd.add_axis(new_state, 0, meta)
            return carry, new_state

        out, new_state = _scan.scan(
            step,
            x,
            state,
            reverse=self.reverse,
            unroll=self.unroll,
            policy=self.policy,
            offload=self.offload,
            recompute=self.recompute,
        )
        nnx.update(self.layers, new_state)
        return out


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
    recompute: str = "cheap",
    reverse: bool = False,
    unroll: int = 1,
    transform_metadata: Mapping[str, Any] = FrozenDict({}),
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
      reverse: run the layers from last to first.
      unroll: loop unrolling.
      transform_metadata: as :class:`ScanLayers` (``{nnx.PARTITION_NAME: axis}`` for sharded
        layers).

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
        reverse=reverse,
        unroll=unroll,
        transform_metadata=transform_metadata,
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
    policy = _resolve_policy(policy, fname)
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
