"""The vocabulary split of a linear cross-entropy on a mesh: which mesh axes shard the weight's
vocabulary (inferred from the shardings, or given), checked against the inputs; the per-shard
plan of the core partitioned by the shardings XLA gives its operands; and the collectives that
combine per-shard partial results.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxmem._src import jax_compat as _jc
from jaxmem._src.losses.linear_ce_config import (
    _CALLER,
    _Config,
    _describe,
    _shared_tiles,
)


@dataclasses.dataclass(frozen=True)
class _VocabSplit:
    """How ``w``'s columns are split: over mesh axis ``axis``, in ``size`` equal slices.

    ``manual``: already inside a ``jax.shard_map`` over ``axis`` (``w`` is this shard's slice);
    otherwise :func:`linear_cross_entropy` runs its own ``shard_map`` over the current mesh.
    """

    axis: str
    size: int
    manual: bool

    def vocab_sizes(self, cols: int) -> tuple[int, int]:
        """(columns per shard, global V), given the number of columns of ``w`` seen here."""
        return (cols, cols * self.size) if self.manual else (cols // self.size, cols)


def _explicit_axes(mesh) -> frozenset:
    return frozenset(
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == AxisType.Explicit
    )


def _dim_axes(entry) -> tuple:
    """Mesh axes of one PartitionSpec entry, as a tuple (``()`` when unsharded)."""
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _type_spec(a) -> tuple:
    """``a``'s sharding in its type (Explicit axes only), one tuple of axes per dimension."""
    spec = tuple(jax.typeof(a).sharding.spec)
    return tuple(map(_dim_axes, spec + (None,) * (a.ndim - len(spec))))


def _show_spec(dims: tuple) -> str:
    entries = (None if not d else d[0] if len(d) == 1 else d for d in dims)
    return repr(P(*entries))


def _inferred_vocab_axis(mesh, w) -> str | None:
    """The Explicit mesh axis ``w``'s V dimension is sharded over (in its type), if any."""
    if mesh.empty or not _explicit_axes(mesh):
        return None
    v_axes = _type_spec(w)[1]
    if len(v_axes) > 1:
        raise ValueError(
            f"{_CALLER}: w's V dimension is sharded over several mesh axes {v_axes} "
            f"(jax.typeof(w).sharding.spec = {_show_spec(_type_spec(w))}); vocabulary-parallel "
            "needs one: reshard w with jax.sharding.reshard(w, P(None, axis))"
        )
    return v_axes[0] if v_axes else None


def _check_manual_split(axis: str, x, w, labels, where):
    """Inside shard_map over ``axis``: w is the local slice; x and labels are whole tokens."""
    if axis not in _jc.varying_axes(w):
        raise ValueError(
            f"{_CALLER}: inside shard_map over vocab_axis={axis!r}, w must be this shard's slice "
            f"of the vocabulary, varying over {axis!r} (in_specs P(None, {axis!r})), and "
            "shard_map must check varying axes (check_vma=True, the default); got w with "
            f"{_describe(w)} invariant over {axis!r}"
        )
    for name, a in (("x", x), ("labels", labels), ("where", where)):
        if a is not None and axis in _jc.varying_axes(a):
            raise ValueError(
                f"{_CALLER}: inside shard_map over vocab_axis={axis!r}, {name} must hold the same "
                f"tokens on every shard of {axis!r} (invariant over it), got {name} with "
                f"{_describe(a)} varying over {axis!r}; gather it first (jax.lax.all_gather)"
            )


def _check_explicit_shardings(axis: str, mesh, x, w, labels, where):
    """Under Explicit axes: w over V only, x's tokens not over ``axis``, labels/where like x."""
    explicit = _explicit_axes(mesh)
    if not explicit:
        return
    w_spec, x_spec = _type_spec(w), _type_spec(x)
    want_w = ((), (axis,) if axis in explicit else ())
    if w_spec != want_w:
        raise ValueError(
            f"{_CALLER}: with vocab_axis={axis!r}, w must be sharded over V only, as "
            f"{_show_spec(want_w)}; got jax.typeof(w).sharding.spec = {_show_spec(w_spec)}. "
            f"Reshard it: jax.sharding.reshard(w, {_show_spec(want_w)})"
        )
    if x_spec[-1] or any(axis in d for d in x_spec[:-1]):
        want_x = tuple(tuple(n for n in d if n != axis) for d in x_spec[:-1]) + ((),)
        raise ValueError(
            f"{_CALLER}: with vocab_axis={axis!r}, x's D dimension must not be sharded and its "
            f"token dimensions not over {axis!r}; got jax.typeof(x).sharding.spec = "
            f"{_show_spec(x_spec)}. Reshard it: jax.sharding.reshard(x, {_show_spec(want_x)})"
        )
    for name, a in (("labels", labels), ("where", where)):
        if a is not None and _type_spec(a) != x_spec[:-1]:
            raise ValueError(
                f"{_CALLER}: {name} must be sharded like x's token dimensions, "
                f"{_show_spec(x_spec[:-1])}; got jax.typeof({name}).sharding.spec = "
                f"{_show_spec(_type_spec(a))}. Reshard it: "
                f"jax.sharding.reshard({name}, {_show_spec(x_spec[:-1])})"
            )


def _resolve_vocab_split(x, w, labels, where, vocab_axis) -> _VocabSplit | None:
    """Checks ``vocab_axis`` against the current mesh and the inputs' shardings; None: no split.

    ``vocab_axis=None`` is inferred from ``w``'s type under an Explicit mesh; under Auto axes
    (shardings not in the types) it must be given.
    """
    if vocab_axis is not None and not isinstance(vocab_axis, str):
        raise TypeError(
            f"{_CALLER}: vocab_axis must be a mesh axis name (str) or None, got "
            f"{type(vocab_axis).__name__} ({vocab_axis!r})"
        )
    mesh = jax.sharding.get_abstract_mesh()
    if vocab_axis is None:
        vocab_axis = _inferred_vocab_axis(mesh, w)
        if vocab_axis is None:
            return None
    if vocab_axis in mesh.manual_axes:
        _check_manual_split(vocab_axis, x, w, labels, where)
        return _VocabSplit(vocab_axis, lax.axis_size(vocab_axis), manual=True)
    if mesh.empty:
        raise ValueError(
            f"{_CALLER}: vocab_axis={vocab_axis!r} needs a mesh: call it under "
            "`with jax.set_mesh(mesh):`, or inside jax.shard_map over that axis"
        )
    if vocab_axis not in mesh.axis_names:
        raise ValueError(
            f"{_CALLER}: vocab_axis={vocab_axis!r} is not an axis of the current mesh, whose "
            f"axes are {tuple(mesh.axis_names)}"
        )
    size = mesh.shape[vocab_axis]
    if w.shape[1] % size:
        raise ValueError(
            f"{_CALLER}: w's V = {w.shape[1]} must be divisible by the size {size} of "
            f"vocab_axis={vocab_axis!r}, got w with {_describe(w)}; pad the vocabulary"
        )
    _check_explicit_shardings(vocab_axis, mesh, x, w, labels, where)
    return _VocabSplit(vocab_axis, size, manual=False)


# --- the split read from the operands' shardings (Auto mesh or none, no vocab_axis) -------------
#
# The shardings are not in the types there: inside jit nothing tells the traced function how w
# is laid out. XLA's partitioner knows; linear_ce's custom-partitioned core reads the split with
# these when the program is partitioned.


def _splits_by_sharding(mesh) -> bool:
    """Read the split from the shardings: under an Auto mesh of several devices (outside
    ``shard_map``), or with no mesh in context where there are several devices.

    With no mesh in context the program's shardings come from its arguments (arrays placed with
    a ``NamedSharding``, or ``jit``'s ``in_shardings``), which the trace never sees; XLA hands
    them to the op when it partitions the program, with their mesh. A program of one device
    runs the op's plain function.
    """
    if mesh.empty:
        return jax.device_count() > 1
    return math.prod(mesh.shape.values()) > 1 and all(
        kind == AxisType.Auto for kind in mesh.axis_types
    )


def _sharding_dims(s, ndim: int) -> tuple:
    """The mesh axes of each dimension of a partition-time operand (none if not a NamedSharding)."""
    sharding = getattr(s, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return ((),) * ndim
    spec = tuple(sharding.spec)
    return tuple(map(_dim_axes, spec + (None,) * (ndim - len(spec))))


@dataclasses.dataclass(frozen=True)
class _ShardProgram:
    """The per-shard program of the partitioned core, read from the shardings of x and w.

    ``vocab``: the mesh axes w's V dimension is split over (each shard walks its slice);
    ``tokens``: the axes x's tokens are split over, less those. Axes that do not divide the
    dimension are dropped (that operand is then gathered, as XLA would without this op).
    """

    mesh: Any
    vocab: tuple[str, ...]
    tokens: tuple[str, ...]

    @classmethod
    def read(cls, mesh, x, w) -> _ShardProgram:
        def fitting(axes, size):
            return axes if size % math.prod(mesh.shape[a] for a in axes) == 0 else ()

        vocab = fitting(_sharding_dims(w, 2)[1], w.shape[1])
        tokens = tuple(a for a in _sharding_dims(x, 2)[0] if a not in vocab)
        return cls(mesh, vocab, fitting(tokens, x.shape[0]))

    def sharding(self, *dims: str):
        """NamedSharding of dimensions each ``"t"`` (tokens), ``"v"`` (vocabulary) or ``""``."""
        axes = {"t": self.tokens, "v": self.vocab, "": ()}
        entries = (
            None if not axes[d] else axes[d] if len(axes[d]) > 1 else axes[d][0] for d in dims
        )
        return jax.sharding.NamedSharding(self.mesh, P(*entries))

    def local(self, cfg: _Config, v_local: int) -> _Config:
        """The configuration of one shard's core (its slice of V, the vocabulary axes named, its
        share of the default tiles)."""
        axis = None if not self.vocab else self.vocab[0] if len(self.vocab) == 1 else self.vocab
        vocab_shards = math.prod(self.mesh.shape[a] for a in self.vocab)
        shards = vocab_shards * math.prod(self.mesh.shape[a] for a in self.tokens)
        chunk, tokens = _shared_tiles(cfg, v_local, vocab_shards, shards)
        return cfg._replace(
            chunk_size=chunk,
            token_chunk=tokens,
            axis_name=axis,
            by_sharding=False,
            sum_dx=bool(self.vocab),
        )


def _vocab_offset(cfg: _Config, v: int):
    """Global id of this shard's first column of ``w``, and the global vocabulary size."""
    if cfg.axis_name is None:
        return 0, v
    return lax.axis_index(cfg.axis_name) * v, v * lax.axis_size(cfg.axis_name)


def _explicit_sharding(a):
    """``a``'s sharding when the current mesh has Explicit axes (for ops that cannot infer it)."""
    return jax.typeof(a).sharding if jax.sharding.get_abstract_mesh().explicit_axes else None


def _manual_axes(*arrays) -> tuple:
    """The manual mesh axes (inside ``jax.shard_map``) any of ``arrays`` varies over, in mesh order.

    Empty outside ``shard_map``.
    """
    varying = frozenset().union(*(_jc.varying_axes(a) for a in arrays if a is not None))
    return tuple(n for n in jax.sharding.get_abstract_mesh().axis_names if n in varying)


def _vary(a, axes: tuple):
    """``a`` cast to vary over ``axes`` too (a loop carry must have the type of its update)."""
    missing = tuple(n for n in axes if n not in _jc.varying_axes(a))
    return lax.pcast(a, missing, to="varying") if missing else a


def _psum_to(a, like):
    """Sums ``a`` over the manual axes ``like`` does not vary over: a cotangent for ``like``.

    Inside ``shard_map(check_vma=True)`` a custom VJP must return each cotangent varying over
    exactly the axes its input does: ``dx`` is summed over the vocabulary axis, ``dw`` over the
    token axes (what JAX's own transposes of the implicit casts would do).
    """
    extra = tuple(n for n in _manual_axes(a) if n not in _jc.varying_axes(like))
    return lax.psum(a, extra) if extra else a


def _combine_shards(cfg: _Config, m, s, zy, zsum):
    """Vocabulary-parallel log-sum-exp: the global max, then sums of the shards' rescaled sums.

    As Megatron-LM's vocab-parallel cross-entropy: one ``pmax`` and one ``psum`` over the
    vocabulary axis, on ``[N]`` vectors (never the logits). The max only shifts the sums for
    range (the log-sum-exp does not depend on it): it passes no derivative, so forward mode never
    meets ``pmax`` (which has no JVP rule).
    """
    m_all = lax.pmax(lax.stop_gradient(m), cfg.axis_name)
    parts = (s * jnp.exp(m - m_all), zy) + ((zsum,) if cfg.label_smoothing else ())
    parts = lax.psum(parts, cfg.axis_name)
    return (m_all, *parts[:2], parts[2] if cfg.label_smoothing else zsum)
