"""Reversible layer stacks for Flax linen (and the checks the NNX form shares).

Each layer is the RevNet coupling ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)`` with ``F`` and ``G``
Flax blocks, and the stack runs through :func:`jaxmem.reversible_scan`, so its gradient keeps
no per-layer activations (memory independent of depth). The blocks' parameters are stacked
along a leading layer axis, as a scanned stack's are (``{"f": ..., "g": ...}``), and every
layer gets its own keys for the split RNG streams (``"params"`` and ``"dropout"`` by default),
handed to the layers as per-layer inputs, so the backward reconstruction replays the forward
pass's dropout masks exactly.

A reversible stack cannot carry mutable state (BatchNorm statistics, caches): its backward
pass re-runs each layer, and updates made there would be applied twice. Blocks that create
variables outside ``params`` (linen) or state other than ``nnx.Param`` and RNG streams (NNX)
are rejected with an error.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta
from jax.tree_util import keystr, tree_flatten_with_path, tree_structure

from jaxmem._src import checks
from jaxmem._src.flax.linen import (
    _DEFAULT_SPLIT_RNGS,
    _check_length,
    _check_module_class,
)
from jaxmem._src.format import format_type
from jaxmem._src.reversible import stack as _rev
from jaxmem._src.scan.options import ScanOptions

# ------------------------------------------------------------------------------------------
# Checks shared by the linen and NNX forms.


def _check_split_rngs(split_rngs: Any, fname: str) -> dict[str, bool]:
    if not isinstance(split_rngs, Mapping) or not all(
        isinstance(k, str) and isinstance(v, bool) for k, v in split_rngs.items()
    ):
        raise TypeError(
            f"{fname} got split_rngs={split_rngs!r}; expected a mapping rng stream name -> bool "
            "(whether each layer gets its own key), e.g. {'params': True, 'dropout': True}."
        )
    return dict(split_rngs)


def _check_streams(streams: Any, fname: str) -> tuple[Any, Any]:
    if not isinstance(streams, tuple | list) or len(streams) != 2:
        raise TypeError(
            f"{fname}: the stack is called with the pair of streams (x1, x2) first, e.g. "
            f"stack((x, x), ...), and returns (y1, y2); got {checks.describe(streams)}"
        )
    return streams[0], streams[1]


def _check_block_output(out: Any, want: Any, label: str, stream: str, fname: str, lead: int):
    """The block output ``out`` (``lead`` leading layer axes) must be like stream ``want``."""
    if tree_structure(out) != tree_structure(want):
        raise TypeError(
            f"{fname}: {label} must return the structure of stream {stream} "
            f"({_rev.tree_str(want)}), since its result is added to that stream; it returned "
            f"{tree_structure(out)}"
        )
    for (path, got), exp in zip(tree_flatten_with_path(out)[0], jax.tree.leaves(want), strict=True):
        got_aval = format_type(got.shape[lead:], jnp.dtype(got.dtype).name)
        exp_aval = format_type(jnp.shape(exp), jnp.result_type(exp).name)
        if got_aval != exp_aval:
            raise TypeError(
                f"{fname}: {label} returned {got_aval}, but its result is added to stream "
                f"{stream}{keystr(path)} ({exp_aval}): a reversible layer cannot change "
                "shapes or dtypes. Make the block return arrays like its stream (e.g. project "
                "back to the stream's width)."
            )


def _check_options(policy, anchor_every, unroll, length, fname, compress=None):
    """The stack's policy (a preset name resolved), after checking every option."""
    opts = ScanOptions.create(fname, policy=policy, unroll=unroll, compress=compress)
    _rev.check_anchor(anchor_every, length, fname)
    return opts.policy


def _run(f, g, streams, params, *, length, anchor_every, policy, unroll, compress, fname):
    """:func:`jaxmem.reversible_scan`, its argument errors prefixed with ``fname``."""
    try:
        return _rev.reversible_scan(
            f,
            g,
            streams,
            params,
            length=length,
            anchor_every=anchor_every,
            policy=policy,
            unroll=unroll,
            compress=compress,
        )
    except (TypeError, ValueError) as e:
        if type(e) not in (TypeError, ValueError):
            raise
        raise type(e)(f"{fname}: {e}") from e


# ------------------------------------------------------------------------------------------
# linen.


@dataclasses.dataclass(frozen=True)
class _LinenSpec:
    """What :func:`reversible_layers` fixes for the Module class it returns."""

    f_block: Any
    g_block: Any
    length: int
    policy: Callable | str | None
    anchor_every: int | None
    split_rngs: Mapping[str, bool]
    unroll: int | bool
    metadata_params: Mapping[Any, Any]
    compress: str | None = None


class _LinenReversible(nn.Module):
    """Base of the classes :func:`reversible_layers` returns (their ``_spec`` says the rest)."""

    _spec: ClassVar[_LinenSpec]

    @nn.compact
    def __call__(self, streams: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Runs the layers on ``streams = (x1, x2)``; returns ``(y1, y2)``.

        ``args`` and ``kwargs`` are passed to both blocks of every layer.
        """
        spec = self._spec
        fname = "jaxmem.flax.linen.reversible_layers"
        x1, x2 = _check_streams(streams, fname)
        f_mod, g_mod = spec.f_block(parent=None), spec.g_block(parent=None)
        params = {
            "f": self._stacked_params("f", f_mod, x2, x1, "x1", args, kwargs),
            "g": self._stacked_params("g", g_mod, x1, x2, "x2", args, kwargs),
        }
        params["rngs"] = {"f": self._layer_rngs(), "g": self._layer_rngs()}

        def f(p, x2):
            return f_mod.apply({"params": p["f"]}, x2, *args, rngs=p["rngs"]["f"], **kwargs)

        def g(p, y1):
            return g_mod.apply({"params": p["g"]}, y1, *args, rngs=p["rngs"]["g"], **kwargs)

        return _run(
            f,
            g,
            (x1, x2),
            params,
            length=spec.length,
            anchor_every=spec.anchor_every,
            policy=spec.policy,
            unroll=spec.unroll,
            compress=spec.compress,
            fname=fname,
        )

    def _stacked_params(self, name, mod, inp, out_like, stream, args, kwargs):
        """The block's stacked params ``params[name]``, created (and checked) at init.

        Created with ``put_variable``, not ``param``: flax's ``param`` traces the initializer
        at apply too (a shape check), which would draw from the RNG streams.
        """
        fname = "jaxmem.flax.linen.reversible_layers"
        what = f"{name}_block"
        if not self.has_variable("params", name):
            if not self.is_mutable_collection("params"):
                raise ValueError(
                    f"{fname}: params has no entry {name!r} ({what}'s stacked params) at "
                    f"{'/'.join(self.scope.path) or 'the top level'}; pass the variables "
                    "init returned, laid out as {'f': ..., 'g': ...}."
                )
            label = f"{what} ({type(mod).__name__})"
            rng = self.make_rng("params")
            value = self._init_block(mod, rng, inp, out_like, args, kwargs, label, stream)
            self.put_variable("params", name, value)
        return meta.unbox(self.get_variable("params", name))

    def _layer_keys(self, stream: str) -> jax.Array:
        """``length`` keys of ``stream``: split per layer, or one key repeated (broadcast)."""
        n = self._spec.length
        key = self.make_rng(stream)
        if self._spec.split_rngs.get(stream, False):
            return jax.random.split(key, n)
        return jnp.broadcast_to(key, (n,) + key.shape)

    def _layer_rngs(self, skip: tuple[str, ...] = ("params",)) -> dict[str, jax.Array]:
        return {s: self._layer_keys(s) for s in sorted(self.scope.rngs) if s not in skip}

    def _init_block(self, mod, rng, inp, out_like, args, kwargs, label, stream):
        spec = self._spec
        fname = "jaxmem.flax.linen.reversible_layers"
        rngs = self._layer_rngs()
        rngs["params"] = (
            jax.random.split(rng, spec.length)
            if spec.split_rngs.get("params", False)
            else jnp.broadcast_to(rng, (spec.length,) + rng.shape)
        )

        def one(r):
            return mod.init_with_output(r, inp, *args, **kwargs)

        out, variables = jax.vmap(one)(rngs)
        others = sorted(c for c in variables if c != "params")
        if others:
            raise ValueError(
                f"{fname}: {label} creates variables in {others}; a reversible stack supports "
                "params only, since its backward pass re-runs every layer (mutable state such "
                "as BatchNorm statistics would be updated twice). Use LayerNorm/RMSNorm, or "
                "jaxmem.flax.linen.scan_layers for blocks with state."
            )
        _check_block_output(out, out_like, label, stream, fname, lead=1)
        return meta.add_axis(variables.get("params", {}), 0, dict(spec.metadata_params))


def reversible_layers(
    f_block: type[nn.Module] | functools.partial,
    g_block: type[nn.Module] | functools.partial,
    length: int,
    *,
    policy: Callable | str | None = None,
    anchor_every: int | None = None,
    split_rngs: Mapping[str, bool] = _DEFAULT_SPLIT_RNGS,
    unroll: int | bool = 1,
    metadata_params: Mapping[Any, Any] | None = None,
    compress: str | None = None,
) -> type[nn.Module]:
    """A reversible stack of ``length`` linen layers ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)``.

    The result is a Module class (``Reversible<F><G>``, no attributes of its own; configure the
    blocks with ``functools.partial(Block, **attrs)``). An instance is called as
    ``stack((x1, x2), *args, **kwargs)`` and returns ``(y1, y2)`` after the ``length`` layers;
    ``args`` and ``kwargs`` go to both blocks of every layer (masks, ``deterministic`` flags),
    as :func:`scan_layers` broadcasts its arguments. ``F`` must return arrays like ``x1`` and
    ``G`` like ``x2``. The layers run through :func:`jaxmem.reversible_scan`: the gradient keeps
    only the final streams and reconstructs each layer's inputs on the way back, so activation
    memory does not grow with depth (at the cost of one more forward pass, as full remat).

    Variables: ``{"params": {"f": <F's params>, "g": <G's params>}}`` under the stack's name,
    every leaf with a leading layer axis of size ``length`` (the layout of :func:`scan_layers`
    / ``nn.scan`` with ``variable_axes={"params": 0}``, per block). RNG streams: for every
    stream given to ``init``/``apply``, each block draws a key ``make_rng(stream)`` and gives
    layer ``l`` the key ``jax.random.split(key, length)[l]`` when ``split_rngs[stream]``
    (default: ``"params"`` and ``"dropout"``), the same key for every layer otherwise, so every
    layer is initialized differently and draws its own dropout masks, and the backward pass
    replays them. Blocks may hold params only (see Raises).

    Args:
      f_block: the ``F`` block, a ``flax.linen.Module`` subclass (or ``functools.partial`` of
        one), called as ``F(x2, *args, **kwargs)``.
      g_block: the ``G`` block, called as ``G(y1, *args, **kwargs)``.
      length: the number of layers, >= 1.
      policy: remat policy inside ``F`` and ``G`` during the backward pass (bounds one layer's
        memory there): a :mod:`jaxmem.policies` policy, one of ``jax.checkpoint_policies``, or
        a preset name (``"nothing"``, ``"dots"``, ``"selective"``, ...). None: no remat.
      anchor_every: as in :func:`jaxmem.reversible_scan`: also keep the streams every ``k``
        layers, bounding the floating-point drift of the reconstruction to ``k`` layers.
      split_rngs: rng stream -> whether each layer gets its own key (as in
        :func:`scan_layers`); streams not listed get the same key in every layer.
      unroll: loop unrolling, passed to :func:`jaxmem.reversible_scan`.
      metadata_params: passed to ``nn.Partitioned``-style variable metadata (``add_axis``), as
        in :func:`scan_layers`.
      compress: as in :func:`jaxmem.reversible_scan`: None (default) keeps the anchors exact;
        ``"bf16"``, ``"fp8"`` or ``"int8"`` stores them in that format (docs/compress.md), a
        lossy gradient for less memory. Without ``anchor_every`` it changes nothing.

    Returns:
      A linen Module class.

    Raises:
      TypeError: a block that is not a linen Module class; ``length`` not an int; a bad
        ``policy``, ``anchor_every``, ``split_rngs`` or ``unroll``; (when called) streams that
        are not a pair, or a block whose output differs from its stream in structure, shape or
        dtype.
      ValueError: ``length < 1``, ``anchor_every < 1``, an unknown policy name or ``compress``
        format; (when initialized) a block creating variables outside ``params`` (BatchNorm
        statistics and other mutable state cannot be carried by a reversible stack); (when
        applied) params whose leading axis is not ``length``.

    Examples:
      A RevNet-style stack of MLP blocks with dropout, both streams starting from ``x``:

      >>> import functools
      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> from jaxmem.flax import linen as jl
      >>> class MLP(nn.Module):
      ...   d_ff: int
      ...   @nn.compact
      ...   def __call__(self, h, deterministic):
      ...     x = jax.nn.gelu(nn.Dense(self.d_ff)(nn.LayerNorm()(h)))
      ...     x = nn.Dropout(0.1)(x, deterministic=deterministic)
      ...     return nn.Dense(h.shape[-1])(x)
      >>> Block = functools.partial(MLP, d_ff=32)
      >>> Stack = jl.reversible_layers(Block, Block, 6, policy="dots")
      >>> x = jnp.ones((2, 16))
      >>> params = Stack().init(jax.random.key(0), (x, x), True)["params"]
      >>> params["f"]["Dense_0"]["kernel"].shape, params["g"]["Dense_1"]["bias"].shape
      ((6, 16, 32), (6, 16))
      >>> def loss(p):
      ...   y1, y2 = Stack().apply({"params": p}, (x, x), False,
      ...                          rngs={"dropout": jax.random.key(1)})
      ...   return jnp.mean((y1 + y2) ** 2)
      >>> jax.grad(loss)(params)["g"]["Dense_0"]["kernel"].shape
      (6, 16, 32)
    """
    fname = "jaxmem.flax.linen.reversible_layers"
    _check_module_class(f_block, fname, "f_block")
    _check_module_class(g_block, fname, "g_block")
    length = _check_length(length, fname)
    spec = _LinenSpec(
        f_block=f_block,
        g_block=g_block,
        length=length,
        policy=_check_options(policy, anchor_every, unroll, length, fname, compress),
        anchor_every=anchor_every,
        split_rngs=_check_split_rngs(split_rngs, fname),
        unroll=unroll,
        metadata_params=dict(metadata_params or {}),
        compress=compress,
    )
    names = [getattr(getattr(b, "func", b), "__name__", "Block") for b in (f_block, g_block)]
    name = f"Reversible{names[0]}{names[1]}"
    doc = (
        f"{length} reversible layers y1 = x1 + {names[0]}(x2), y2 = x2 + {names[1]}(y1), made by "
        "jaxmem.flax.linen.reversible_layers: call as stack((x1, x2), *args, **kwargs)."
    )
    attrs = {"_spec": spec, "__module__": __name__, "__qualname__": name, "__doc__": doc}
    return type(name, (_LinenReversible,), attrs)
