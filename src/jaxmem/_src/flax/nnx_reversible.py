"""Reversible layer stacks for Flax NNX: :func:`jaxmem.reversible_scan` over stacked blocks.

The NNX form of :func:`jaxmem.flax.linen.reversible_layers` (same layer, same reason to reject
mutable state): :class:`ReversibleLayers` creates ``length`` ``F`` and ``G`` blocks with
stacked state, as :class:`jaxmem.flax.nnx.ScanLayers` creates its layers, and runs each layer's
blocks as ``nnx.merge`` of their graph definition with the layer's slice of the state inside the
pure functions given to :func:`jaxmem.reversible_scan`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import FrozenDict
from flax.nnx import spmd
from jax.tree_util import tree_flatten_with_path

from jaxmem._src.flax.linen import _check_length
from jaxmem._src.flax.linen_reversible import (
    _check_block_output,
    _check_options,
    _check_streams,
    _run,
)
from jaxmem._src.flax.nnx import _check_transform_metadata


def _check_make(make: Any, what: str, fname: str):
    if isinstance(make, nnx.Module):
        raise TypeError(
            f"{fname} got a Module instance ({type(make).__name__}) as {what}; pass a function "
            "that builds one layer's block from rngs, e.g. lambda rngs: Block(..., rngs=rngs)."
        )
    if not callable(make):
        raise TypeError(
            f"{fname} expects {what} to be callable (rngs -> nnx.Module), got {make!r} "
            f"({type(make).__name__})."
        )


def _create_stack(
    make: Callable, length: int, rngs: nnx.Rngs, what: str, fname: str, meta: FrozenDict
):
    """``length`` blocks with stacked state, each from its own split of ``rngs`` (as
    :class:`ScanLayers` creates its layers; ``meta`` names the layer axis in sharding
    metadata)."""

    @nnx.split_rngs(splits=length)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=meta)
    def create(r: nnx.Rngs):
        block = make(r)
        if not isinstance(block, nnx.Module):
            raise TypeError(
                f"{fname}: {what}(rngs) must return an nnx.Module, got {type(block).__name__}. "
                "Pass a function building one layer's block, e.g. lambda rngs: Block(..., "
                "rngs=rngs)."
            )
        return block

    return create(rngs)


def _path_str(path) -> str:
    keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    return ".".join(keys[:-1] if keys[-1:] == ["value"] else keys)


def _split_stack(stack: nnx.Module, name: str, length: int, fname: str):
    """``(graphdef, params, rng_state)`` of a stacked block; rejects any other state and
    arrays without the leading layer axis ``length``."""
    graphdef, params, rng_state, rest = nnx.split(stack, nnx.Param, nnx.RngState, ...)
    is_var = lambda x: isinstance(x, nnx.Variable)
    for path, var in tree_flatten_with_path(rest, is_leaf=is_var)[0]:
        raise ValueError(
            f"{fname}: {name}.{_path_str(path)} is {type(var).__name__} state; a reversible "
            "stack supports nnx.Param and RNG streams only, since its backward pass re-runs "
            "every layer (mutable state such as BatchNorm statistics would be updated twice). "
            "Use LayerNorm/RMSNorm, or jaxmem.flax.nnx.ScanLayers for blocks with state."
        )
    for path, x in tree_flatten_with_path((params, rng_state))[0]:
        shape = getattr(x, "shape", ())
        if not shape or shape[0] != length:
            raise ValueError(
                f"{fname}: variable {name}.{_path_str(path[1:])} has shape {tuple(shape)}, but "
                f"the stack has length={length} along its leading layer axis. Do not replace "
                "the stacked blocks with unstacked ones."
            )
    return graphdef, params, rng_state


class ReversibleLayers(nnx.Module):
    """A reversible stack of ``length`` NNX layers ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)``.

    The ``F`` blocks live in ``self.f`` and the ``G`` blocks in ``self.g``, each created
    ``length`` times with stacked state (``nnx.split_rngs`` + ``nnx.vmap``, as
    :class:`ScanLayers` creates its layers: every variable has a leading layer axis, and every
    layer is initialized from its own split of ``rngs`` and holds its own RNG streams, e.g.
    its ``nnx.Dropout`` keys). Calling ``stack((x1, x2), *args, **kwargs)`` returns ``(y1, y2)``
    after the ``length`` layers; ``args`` and ``kwargs`` go to both blocks of every layer
    (masks, ``deterministic`` flags), as :class:`ScanLayers` broadcasts them. ``F`` must return
    arrays like ``x1`` and ``G`` like ``x2``.

    The layers run through :func:`jaxmem.reversible_scan`: each layer's ``F`` and ``G`` are
    ``nnx.merge`` of the blocks' graph definition with the layer's slice of their state
    (``nnx.split``), so the gradient keeps only the final streams and reconstructs each
    layer's inputs on the way back (activation memory independent of depth). The layers' RNG
    state is a per-layer input, so the reconstruction replays the forward pass's dropout
    masks; after the call the RNG counters are advanced as the layers' own calls advance
    them (as ``nnx.scan`` writes them back), so the next call draws new masks. Blocks may hold
    ``nnx.Param`` and RNG streams only (see Raises).

    Args:
      make_f: ``make_f(rngs) -> nnx.Module``, building one layer's ``F`` block, called as
        ``F(x2, *args, **kwargs)``.
      make_g: ``make_g(rngs) -> nnx.Module``, building one layer's ``G`` block, called as
        ``G(y1, *args, **kwargs)``.
      length: the number of layers, >= 1.
      rngs: the ``nnx.Rngs`` split over the layers (``F`` blocks first, then ``G``).
      policy: remat policy inside ``F`` and ``G`` during the backward pass: a
        :mod:`jaxmem.policies` policy, a ``jax.checkpoint_policies`` policy, a preset name
        (``"dots"``, ``"selective"``, ...), or None (no remat).
      anchor_every: as in :func:`jaxmem.reversible_scan`: also keep the streams every ``k``
        layers, bounding the floating-point drift of the reconstruction to ``k`` layers.
      unroll: loop unrolling, passed to :func:`jaxmem.reversible_scan`.
      transform_metadata: as :class:`ScanLayers`' (``{nnx.PARTITION_NAME: axis}``): the name of
        the layer axis in the stacked variables' sharding metadata (``None``: not sharded),
        removed from each layer's slice before its blocks run.
      compress: as in :func:`jaxmem.reversible_scan`: None (default) keeps the anchors exact;
        ``"bf16"``, ``"fp8"`` or ``"int8"`` stores them in that format (docs/compress.md), a
        lossy gradient for less memory. Without ``anchor_every`` it changes nothing.

    Raises:
      TypeError: ``make_f``/``make_g`` not callable or not returning an ``nnx.Module``; a bad
        ``policy``, ``anchor_every``, ``unroll`` or ``transform_metadata``; (when called)
        streams that are not a pair, or a block whose output differs from its stream in
        structure, shape or dtype.
      ValueError: ``length < 1``, ``anchor_every < 1``, an unknown policy name or ``compress``
        format; a block holding state other than ``nnx.Param`` and RNG streams (BatchNorm
        statistics and other mutable state cannot be carried by a reversible stack); (when
        called) stacked state whose leading axis is not ``length``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxmem.flax import nnx as jn
      >>> class MLP(nnx.Module):
      ...   def __init__(self, d, f, *, rngs):
      ...     self.ln = nnx.LayerNorm(d, rngs=rngs)
      ...     self.up = nnx.Linear(d, f, rngs=rngs)
      ...     self.down = nnx.Linear(f, d, rngs=rngs)
      ...     self.drop = nnx.Dropout(0.1, rngs=rngs)
      ...   def __call__(self, h, deterministic=False):
      ...     x = jax.nn.gelu(self.up(self.ln(h)))
      ...     return self.down(self.drop(x, deterministic=deterministic))
      >>> make = lambda rngs: MLP(16, 32, rngs=rngs)
      >>> stack = jn.ReversibleLayers(make, make, 6, rngs=nnx.Rngs(0, dropout=1), policy="dots")
      >>> stack.f.up.kernel.shape, stack.g.down.bias.shape
      ((6, 16, 32), (6, 16))
      >>> x = jnp.ones((2, 16))
      >>> def loss(m):
      ...   y1, y2 = m((x, x))
      ...   return jnp.mean((y1 + y2) ** 2)
      >>> grads = nnx.grad(loss)(stack)
      >>> grads.g.up.kernel.shape
      (6, 16, 32)
      >>> [y.shape for y in stack((x, x), deterministic=True)]
      [(2, 16), (2, 16)]
    """

    def __init__(
        self,
        make_f: Callable[[nnx.Rngs], nnx.Module],
        make_g: Callable[[nnx.Rngs], nnx.Module],
        length: int,
        *,
        rngs: nnx.Rngs,
        policy: Callable | str | None = None,
        anchor_every: int | None = None,
        unroll: int | bool = 1,
        transform_metadata: Mapping[str, Any] = FrozenDict({}),
        compress: str | None = None,
    ):
        fname = "jaxmem.flax.nnx.ReversibleLayers"
        _check_make(make_f, "make_f", fname)
        _check_make(make_g, "make_g", fname)
        self.length = _check_length(length, fname)
        self.policy = _check_options(policy, anchor_every, unroll, self.length, fname, compress)
        self.anchor_every = anchor_every
        self.unroll = unroll
        self.compress = compress
        self.transform_metadata = _check_transform_metadata(transform_metadata, fname)
        meta = self.transform_metadata
        self.f = _create_stack(make_f, self.length, rngs, "make_f", fname, meta)
        self.g = _create_stack(make_g, self.length, rngs, "make_g", fname, meta)
        _split_stack(self.f, "f", self.length, fname)
        _split_stack(self.g, "g", self.length, fname)

    def __call__(self, streams: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Runs the layers on ``streams = (x1, x2)``; returns ``(y1, y2)``."""
        fname = "jaxmem.flax.nnx.ReversibleLayers"
        x1, x2 = _check_streams(streams, fname)
        x1, x2 = jax.tree.map(jnp.asarray, x1), jax.tree.map(jnp.asarray, x2)
        gf, pf, rf = _split_stack(self.f, "f", self.length, fname)
        gg, pg, rg = _split_stack(self.g, "g", self.length, fname)

        meta = self.transform_metadata

        def f(p, x2):
            return nnx.merge(gf, *_layer_state(p["f"], meta))(x2, *args, **kwargs)

        def g(p, y1):
            return nnx.merge(gg, *_layer_state(p["g"], meta))(y1, *args, **kwargs)

        params = {"f": (pf, rf), "g": (pg, rg)}
        p0 = jax.tree.map(lambda a: a[0], params)
        for fn, inp, out_like, name, stream in ((f, x2, x1, "f", "x1"), (g, x1, x2, "g", "x2")):
            out = jax.eval_shape(fn, p0, inp)
            label = f"the {name} block ({type(getattr(self, name)).__name__})"
            _check_block_output(out, out_like, label, stream, fname, lead=0)
        y = _run(
            f,
            g,
            (x1, x2),
            params,
            length=self.length,
            anchor_every=self.anchor_every,
            policy=self.policy,
            unroll=self.unroll,
            compress=self.compress,
            fname=fname,
        )
        # The RNG counters move on as the layers' own calls move them (values are not needed:
        # under jit the blocks' computations in this loop are dead code).
        for block, gdef, p, r, inp in ((self.f, gf, pf, rf, x2), (self.g, gg, pg, rg, x1)):
            if jax.tree.leaves(r):
                nnx.update(block, _advanced_rngs(gdef, p, r, inp, args, kwargs, meta))
        return y


def _layer_state(state: Any, meta: FrozenDict) -> Any:
    """One layer's slice of stacked state, the layer axis taken out of its metadata."""
    return spmd.remove_axis(state, 0, meta) if meta else state


def _advanced_rngs(gdef, params, rng_state, inp, args, kwargs, meta):
    """Every layer's RNG state after one call of its block (on a stand-in input)."""
    params, inp = jax.lax.stop_gradient((params, inp))

    def one(pr):
        block = nnx.merge(gdef, *_layer_state(pr, meta))
        block(inp, *args, **kwargs)
        state = nnx.state(block, nnx.RngState)
        return spmd.add_axis(state, 0, meta) if meta else state

    return jax.lax.map(one, (params, rng_state))


def reversible_layers(
    make_f: Callable[[nnx.Rngs], nnx.Module],
    make_g: Callable[[nnx.Rngs], nnx.Module],
    length: int,
    *,
    rngs: nnx.Rngs,
    policy: Callable | str | None = None,
    anchor_every: int | None = None,
    unroll: int | bool = 1,
    transform_metadata: Mapping[str, Any] = FrozenDict({}),
    compress: str | None = None,
) -> ReversibleLayers:
    """Builds a :class:`ReversibleLayers` stack: ``length`` RevNet layers of NNX blocks.

    Same as ``ReversibleLayers(make_f, make_g, length, rngs=rngs, ...)``; see
    :class:`ReversibleLayers`.

    Args:
      make_f: ``make_f(rngs) -> nnx.Module``, one layer's ``F`` block (``y1 = x1 + F(x2)``).
      make_g: ``make_g(rngs) -> nnx.Module``, one layer's ``G`` block (``y2 = x2 + G(y1)``).
      length: the number of layers, >= 1.
      rngs: the ``nnx.Rngs`` split over the layers.
      policy: remat policy inside ``F`` and ``G`` (a policy or preset name), or None.
      anchor_every: as in :func:`jaxmem.reversible_scan`.
      unroll: loop unrolling.
      transform_metadata: the layer axis's name in sharding metadata, as :class:`ScanLayers`'.
      compress: the format of the anchors (None, ``"bf16"``, ``"fp8"``, ``"int8"``), as in
        :func:`jaxmem.reversible_scan`.

    Returns:
      The :class:`ReversibleLayers` module.

    Raises:
      TypeError, ValueError: as :class:`ReversibleLayers`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxmem.flax import nnx as jn
      >>> make = lambda rngs: nnx.Linear(3, 3, rngs=rngs)
      >>> stack = jn.reversible_layers(make, make, 4, rngs=nnx.Rngs(0), policy="nothing")
      >>> stack.f.kernel.shape
      (4, 3, 3)
      >>> [y.shape for y in stack((jnp.ones((1, 3)), jnp.zeros((1, 3))))]
      [(1, 3), (1, 3)]
      >>> wide = lambda rngs: nnx.Linear(3, 5, rngs=rngs)
      >>> jn.reversible_layers(wide, make, 2, rngs=nnx.Rngs(0))((jnp.ones((1, 3)),) * 2)
      Traceback (most recent call last):
        ...
      TypeError: jaxmem.flax.nnx.ReversibleLayers: the f block (Linear) returned float32[1,5], ...
    """
    return ReversibleLayers(
        make_f,
        make_g,
        length,
        rngs=rngs,
        policy=policy,
        anchor_every=anchor_every,
        unroll=unroll,
        transform_metadata=transform_metadata,
        compress=compress,
    )
