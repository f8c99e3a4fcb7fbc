"""Chunked linear cross-entropy: ``softmax_cross_entropy(x @ w + b, labels)`` without [N, V] logits.

The loss of a language-model head is ``cross_entropy(x @ w, labels)`` with ``x[N, D]`` the final
hidden states and ``w[D, V]`` the unembedding. Written plainly, ``jax.grad`` keeps the full
``[N, V]`` logits (and XLA several more buffers of that size: softmax, its cotangent), which for a
large vocabulary dominates the memory of a training step. :func:`linear_cross_entropy` instead
walks over the vocabulary in chunks of ``chunk_size`` columns, keeping an online log-sum-exp in
f32, and a custom backward pass recomputes each chunk's logits to form ``dx``,
``dw`` and ``dbias``: the residuals it saves are its inputs plus one f32 number per token.

With ``w`` sharded over V on a mesh axis (``vocab_axis``), each shard runs the same chunked core
on its own slice of the vocabulary, and the shards combine their per-token log-sum-exp pieces and
label logits with a ``pmax`` and a ``psum`` (Megatron-LM's vocab-parallel cross-entropy), under a
``jax.shard_map`` of the current mesh or inside the user's own.

References:
  Wijmans, Huval, Hertzberg, Koltun, Krähenbühl, 2024. "Cut Your Losses in Large-Vocabulary
  Language Models" (Apple Cut Cross-Entropy), arXiv:2411.09009.
  Hsu et al., 2024. "Liger Kernel: Efficient Triton Kernels for LLM Training" (fused linear
  cross-entropy), arXiv:2410.10989.
  Shoeybi et al., 2019. "Megatron-LM: Training Multi-Billion Parameter Language Models Using
  Model Parallelism" (vocab-parallel cross-entropy), arXiv:1909.08053.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import PartitionSpec as P

from jaxmem._src import jax_compat as _jc
from jaxmem._src import vjp_primitive as _vjp_primitive
from jaxmem._src.losses.linear_ce_config import (
    _CALLER,
    _check_ignore_index,
    _check_inputs,
    _check_loss_options,
    _check_tile_options,
    _Config,
    _shares_tiles,
    default_tiles,
)
from jaxmem._src.losses.linear_ce_kernels import _backward, _forward
from jaxmem._src.losses.vocab_split import (
    _explicit_axes,
    _resolve_vocab_split,
    _ShardProgram,
    _splits_by_sharding,
    _type_spec,
    _VocabSplit,
)


def _per_token(cfg: _Config, split: _VocabSplit | None, x, w, b, labels, mask):
    """Per-token loss and lse [N], f32: one call of the core, or one per vocabulary shard."""
    if split is None:
        return _lce_core(cfg, x, w, b, labels, mask)
    cfg = cfg._replace(axis_name=split.axis)
    if split.manual:
        return _lce_core(cfg, x, w, b, labels, mask)
    # Manual over the vocabulary axis, and over the Explicit axes the tokens are sharded over
    # (read from labels' type), so that per-token residuals stay sharded; Auto axes stay auto.
    ax = split.axis
    tok_axes = _type_spec(labels)[0]
    tok = None if not tok_axes else tok_axes[0] if len(tok_axes) == 1 else tok_axes
    args = [x, w, labels, mask]
    specs = [P(tok, None), P(None, ax), P(tok), P(tok)]
    if b is not None:
        if ax in _explicit_axes(jax.sharding.get_abstract_mesh()) and _type_spec(b) != ((ax,),):
            b = jax.sharding.reshard(b, P(ax))  # a [V] vector: slicing it costs nothing
        args.append(b)
        specs.append(P(ax))

    def shard(x, w, labels, mask, b=None):
        return _lce_core(cfg, x, w, b, labels, mask)

    return jax.shard_map(
        shard,
        in_specs=tuple(specs),
        out_specs=(P(tok), P(tok)),
        axis_names=frozenset({ax, *tok_axes}),
    )(*args)


def _is_concrete(a: Any) -> bool:
    return a is None or not isinstance(a, jax.core.Tracer)


def _check_labels_concretely(labels, valid, v):
    """Raises ValueError naming out-of-range labels that are not ignored (concrete inputs only)."""
    bad = valid & ((labels < 0) | (labels >= v))
    if bad.any():
        positions = np.argwhere(bad)
        shown = ", ".join(
            f"labels[{', '.join(map(str, p))}] = {labels[tuple(p)]}" for p in positions[:5]
        )
        more = f" (and {len(positions) - 5} more)" if len(positions) > 5 else ""
        raise ValueError(
            f"{_CALLER}: labels must lie in [0, V) = [0, {v}) where not ignored; got "
            f"{shown}{more}. Mark such tokens with ignore_index or where=False."
        )


def _lce_core(cfg: _Config, x, w, b, labels, mask):
    """Per-token loss [N] (0 where ``mask`` is False) and lse [N], both f32: one primitive with
    the chunked backward pass as its VJP, and every other transformation (forward mode: the JVP
    of the chunked forward pass)."""
    core = _vjp_primitive.custom_vjp(
        functools.partial(_run_forward, cfg),
        fwd=functools.partial(_lce_fwd, cfg),
        bwd=functools.partial(_lce_bwd, cfg),
        name="linear_cross_entropy",
    )
    return core(x, w, b, labels, mask)


def _lce_fwd(cfg, x, w, b, labels, mask):
    loss, lse = _run_forward(cfg, x, w, b, labels, mask)
    return (loss, lse), (x, w, b, labels, mask, lse)


def _lce_bwd(cfg, res, cts):
    x, w, b, labels, mask, lse = res
    args = (x, w, labels, mask, lse, *cts, b)
    if cfg.by_sharding:
        dx, dw, db = _by_sharding(1, _backward, cfg, *args)
    else:
        dx, dw, db = _backward(cfg, *args)
    return dx, dw, db, None, None


def _run_forward(cfg: _Config, x, w, b, labels, mask):
    if cfg.by_sharding:
        return _by_sharding(0, _forward_ops_order, cfg, x, w, labels, mask, b)
    return _forward(cfg, x, w, b, labels, mask)


def _forward_ops_order(cfg: _Config, x, w, labels, mask, b):
    """:func:`_forward` with its arguments in the order of the custom-partitioned ops."""
    return _forward(cfg, x, w, b, labels, mask)


# --- the split read from the operands' shardings (Auto mesh or none, no vocab_axis) -------------
#
# Under an Auto mesh, or with no mesh in context, the shardings are not in the types: inside jit
# nothing tells the traced function how w is laid out. XLA's partitioner knows;
# jax.experimental.custom_partitioning hands the operands' shardings (with their mesh) to a
# callback when the program is partitioned, and the callback returns the per-shard program
# (vocab_split._ShardProgram reads it). The core's forward and backward passes are two such ops
# (the custom VJP stays around them): each shard runs the chunked core on its tokens and its
# slice of the vocabulary, as the vocab_axis path does.


def _forward_partition(cfg, mesh, arg_shapes, result_shape):
    del result_shape
    x, w, _, _, b = arg_shapes
    plan = _ShardProgram.read(mesh, x, w)

    def shard(x, w, labels, mask, b):
        with _jc.without_source_traceback():  # jax 0.10.2: see there
            return _forward(plan.local(cfg, w.shape[1]), x, w, b, labels, mask)

    tok = plan.sharding("t")
    args = (plan.sharding("t", ""), plan.sharding("", "v"), tok, tok)
    args += (None if b is None else plan.sharding("v"),)
    return mesh, shard, (tok, tok), args


def _forward_infer(cfg, mesh, arg_shapes, result_shape):
    del cfg, result_shape
    tok = _ShardProgram.read(mesh, *arg_shapes[:2]).sharding("t")
    return tok, tok


def _forward_rule(cfg, mesh, operands, results):
    del cfg, mesh, results
    bias = ", v" if len(operands) == 5 else ""
    return f"n d, e v, n, n{bias} -> n, n", {"reduction_factors": ("d", "e", "v")}


def _backward_partition(cfg, mesh, arg_shapes, result_shape):
    del result_shape
    x, w, *_, b = arg_shapes
    plan = _ShardProgram.read(mesh, x, w)

    def shard(x, w, labels, mask, lse, g_loss, g_lse, b):
        # dx is summed over the vocabulary shards tile by tile (once per row); dw and db over
        # the token shards once, at the end (chunk by chunk would repeat it for every tile).
        local = plan.local(cfg, w.shape[1])
        with _jc.without_source_traceback():  # jax 0.10.2: see there
            dx, dw, db = _backward(local, x, w, labels, mask, lse, g_loss, g_lse, b)
            if plan.tokens:
                dw, db = lax.psum((dw, db), plan.tokens)
        return dx, dw, db

    tok = plan.sharding("t")
    results = (plan.sharding("t", ""), plan.sharding("", "v"))
    results += (None if b is None else plan.sharding("v"),)
    args = (*results[:2], tok, tok, tok, tok, tok, results[2])
    return mesh, shard, results, args


def _backward_infer(cfg, mesh, arg_shapes, result_shape):
    del cfg, result_shape
    x, w, *_, b = arg_shapes
    plan = _ShardProgram.read(mesh, x, w)
    return plan.sharding("t", ""), plan.sharding("", "v"), b and plan.sharding("v")


def _backward_rule(cfg, mesh, operands, results):
    del cfg, mesh, results
    bias = ", v" if len(operands) == 8 else ""
    return f"n d, e v, n, n, n, n, n{bias} -> n d, e v{bias}"


def _define_op(cfg: _Config, call, partition, infer, rule):
    bind = functools.partial
    op = custom_partitioning(bind(call, cfg))
    op.def_partition(
        partition=bind(partition, cfg),
        infer_sharding_from_operands=bind(infer, cfg),
        sharding_rule=bind(rule, cfg),
    )
    return op


@functools.lru_cache(maxsize=256)
def _partitioned_ops(cfg: _Config) -> tuple:
    """The core's forward and backward passes with ``cfg``, as custom-partitioned ops.

    ``cfg`` is bound in, not a static argument: with one, jax 0.12's ``custom_partitioning``
    keeps the traced arguments in a closure that ``jax.check_tracer_leaks`` reports as leaked.
    """
    return (
        _define_op(cfg, _forward_ops_order, _forward_partition, _forward_infer, _forward_rule),
        _define_op(cfg, _backward, _backward_partition, _backward_infer, _backward_rule),
    )


def _by_sharding(which: int, plain, cfg: _Config, *args):
    """Op ``which`` of :func:`_partitioned_ops` (0 forward, 1 backward) on ``args``, partitioned
    by their shardings; ``plain(cfg, *args)`` under ``jax.vmap``.

    ``custom_partitioning`` has no batching rule: a batched call runs the core unpartitioned.
    """
    try:
        return _partitioned_ops(cfg)[which](*args)
    except NotImplementedError as e:
        if "custom_partitioning" not in str(e):
            raise
    return plain(cfg, *args)


def _token_mask(labels1, where, ignore_index):
    """The tokens that count, [N] bool: ``where`` (all True if None) less the ignored labels."""
    # All True, typed like labels (jnp.ones_like drops the sharding of a concrete array in jit).
    mask = labels1 == labels1 if where is None else jnp.reshape(where, labels1.shape)
    if ignore_index is not None:
        mask = mask & (labels1 != ignore_index)
    return mask


def _check_labels_if_concrete(labels, where, ignore_index, v):
    """:func:`_check_labels_concretely` where ``labels`` and ``where`` are concrete (not traced)."""
    if not (_is_concrete(labels) and _is_concrete(where)):
        return
    np_labels = np.asarray(labels)
    np_valid = np.ones(tuple(labels.shape), bool) if where is None else np.asarray(where)
    if ignore_index is not None:
        np_valid = np_valid & (np_labels != ignore_index)
    _check_labels_concretely(np_labels, np_valid, v)


def _token_tile(split, chunk, chunk_size, token_chunk_size, default_t, default_c):
    """Tokens per tile: the given count, else from the default tiles; None under a vocab split."""
    if split is not None:
        if token_chunk_size is not None:
            raise ValueError(
                f"{_CALLER}: token_chunk_size does not combine with a vocabulary split "
                f"(vocab_axis={split.axis!r}): each shard's block is [tokens, chunk_size / shards]"
            )
        return None
    if token_chunk_size is not None:
        return int(token_chunk_size)
    if chunk_size is None:
        return default_t
    # A given chunk: as many tokens as make a block of the default tiles' size.
    return max(1, default_t * default_c // chunk)


def _core_config(options, split, dims, dtype, chunk_size, token_chunk_size, block_bytes):
    """The core's :class:`_Config`: the loss ``options``, and tiles given or by default_tiles.

    ``dims``: ``(N, D, V)``, V of this device's slice under a vocabulary split.
    """
    n, d, v_local = dims
    default_t, default_c = default_tiles(n, d, v_local, dtype, block_bytes)
    chunk = min(default_c if chunk_size is None else int(chunk_size), v_local)
    tokens = _token_tile(split, chunk, chunk_size, token_chunk_size, default_t, default_c)
    by_sharding = split is None and _splits_by_sharding(jax.sharding.get_abstract_mesh())
    shared = by_sharding and _shares_tiles(block_bytes)  # devices share the memory rule's tiles
    return _Config(
        chunk,
        *options,
        token_chunk=tokens,
        by_sharding=by_sharding,
        cpu_tiles=jax.default_backend() == "cpu",
        shared_chunk=shared and chunk_size is None,
        shared_block=default_t * default_c if shared and token_chunk_size is None else None,
    )


def _reduce(loss, mask, reduction, shape):
    """The per-token losses reduced: mean over the counted tokens, sum, or ``shape`` (none)."""
    if reduction == "mean":
        count = jnp.sum(mask).astype(jnp.float32)
        return jnp.sum(loss) / jnp.maximum(count, 1.0)
    if reduction == "sum":
        return jnp.sum(loss)
    return jnp.reshape(loss, shape)


def linear_cross_entropy(
    x: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    chunk_size: int | None = None,
    ignore_index: int | None = None,
    where: jax.Array | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcap: float | None = None,
    reduction: str = "mean",
    return_lse: bool = False,
    vocab_axis: str | None = None,
    token_chunk_size: int | None = None,
    block_bytes: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Softmax cross-entropy of ``x @ w (+ bias)`` without materializing the [N, V] logits.

    Equal (up to float rounding) to
    ``optax.softmax_cross_entropy_with_integer_labels(x @ w + bias, labels)`` followed by the
    reduction, but computed chunk by chunk over the vocabulary with an online log-sum-exp in f32,
    under a :func:`jax.custom_vjp` whose backward pass recomputes each chunk's logits. Tokens
    run in tiles of ``token_chunk_size``, each tile walking the vocabulary in chunks of
    ``chunk_size`` columns; by default :func:`default_tiles` chooses both (the largest block of
    at most 2**20 f32 logits whose estimated scratch fits in the bytes of ``x``; on a GPU,
    4096 x 4096 tiles, where smaller ones cost time in per-step overhead). The saved
    residuals are ``x``, ``w``, ``bias``, ``labels``, the token mask and one f32 log-sum-exp per
    token; the largest temporaries are a few ``[token_chunk_size, chunk_size]`` f32 blocks and the
    ``[token_chunk_size, D]`` and ``[D, chunk_size]`` slices of the inputs and gradients.

    Per token (``z`` = logits after the optional softcap, ``y`` = label, ``a`` = label_smoothing)::

        lse  = logsumexp(z)
        loss = lse - (1 - a) * z[y] - (a / V) * sum(z) + z_loss * lse**2

    which is optax's cross-entropy against the smoothed one-hot ``(1 - a) * onehot(y) + a / V``
    (``optax.smooth_labels``), plus the z-loss of PaLM.

    Masked tokens (``labels == ignore_index``, or ``where`` False) contribute nothing to the loss
    or the gradients. ``reduction="mean"`` divides the sum by the number of the other tokens (by 1
    when there are none, giving 0.0); ``"sum"`` sums; ``"none"`` returns the per-token losses, 0.0
    at masked tokens.

    Out-of-range labels (``< 0`` or ``>= V``) at tokens that are not masked: when ``labels`` (and
    ``where``) are concrete, a ValueError names the positions and values. Under :func:`jax.jit`
    (traced labels) no check can raise; such tokens get a NaN loss instead, so a "mean" or "sum"
    is NaN rather than a silently plausible number, and their gradient contribution is zero.

    The loss and lse are f32 whatever the input dtypes; gradients have the dtypes of ``x``, ``w``
    and ``bias``. With bf16 ``x`` and ``w`` the logits are accumulated in f32 (products of bf16
    values, as ``jnp.dot(x, w, preferred_element_type=f32)``), so the loss agrees with the naive
    f32-accumulated loss of the same bf16 inputs to about 1e-5 relative, and the bf16 gradients
    agree with the f32 gradients of the same values to about 2e-2 relative (bf16 rounding of the
    result and of the per-chunk logit cotangents).

    Vocabulary-parallel (``vocab_axis``): with ``w`` (and ``bias``) sharded over V on a mesh axis,
    each shard walks over its own ``[D, V / shards]`` slice of ``w`` and the shards combine their
    per-token log-sum-exp pieces and label logits with one ``pmax`` and one ``psum`` of ``[N]``
    vectors, as Megatron-LM's vocab-parallel cross-entropy: no device ever holds all of ``w`` or
    all logits of a token. ``dw`` (and ``dbias``) come back sharded like ``w``, ``dx`` like ``x``
    (summed over the vocabulary shards); ``labels`` are global vocabulary ids. Three settings:

    - Explicit mesh (``jax.set_mesh`` of a mesh with ``AxisType.Explicit`` axes): ``vocab_axis``
      is read from ``jax.typeof(w).sharding`` when not given. ``x`` must not be sharded over D nor
      its tokens over the vocabulary axis; ``labels`` and ``where`` must be sharded like ``x``'s
      token dimensions (a ValueError says how to reshard otherwise).
    - Auto mesh (``jax.set_mesh`` of a mesh whose axes are all ``AxisType.Auto``), or no mesh in
      context with arrays placed on several devices (``jax.device_put(w, NamedSharding(mesh,
      P(None, "model")))``, or ``jit``'s ``in_shardings``): shardings are not in the types, so
      without ``vocab_axis`` the split is read from the shardings XLA gives the operands when
      it partitions the program (the core's forward and backward passes are
      :func:`jax.experimental.custom_partitioning` ops): each device walks the tokens and the
      slice of the vocabulary it holds (a ``w`` not sharded over V, e.g. over D, is gathered
      first; ``dx`` and ``dw`` come back sharded like ``x`` and ``w``), in its share of the
      default tiles of the whole problem (:func:`default_tiles`' memory rule; V split over
      ``k`` devices and tokens over ``m``: ``chunk / k`` columns, a block of ``1 / (k m)`` the
      elements), so that its scratch is its share of a one-device call's. Under
      :func:`jax.vmap` the core runs unpartitioned (``custom_partitioning`` has no batching
      rule): pass ``vocab_axis`` there (it needs a mesh in context). With ``vocab_axis`` given,
      tokens keep whatever sharding the compiler gives them over the other axes.
    - Inside ``jax.shard_map`` over ``vocab_axis`` (``check_vma=True``, the default): ``w`` and
      ``bias`` are this shard's slices; ``x``, ``labels`` and ``where`` must be the same on every
      shard of ``vocab_axis``. ``"mean"`` and ``"sum"`` reduce this shard's tokens only: combine
      them over the token axes yourself (e.g. ``reduction="sum"``, then ``jax.lax.psum``).

    With ``vocab_axis`` (given, or read from an Explicit ``w``'s type), the function runs a
    ``jax.shard_map`` over the vocabulary axis (and the Explicit axes the tokens are sharded
    over), every shard running the chunked core on its slice. V must be divisible by the size
    of the axis.

    Every JAX transformation applies (forward mode: the JVP of the chunked forward pass).
    Not supported: gradients with respect to ``labels`` or ``where`` (they are
    integer/boolean).

    Args:
      x: Hidden states ``[..., D]``, floating.
      w: Output projection ``[D, V]``, floating.
      labels: Integer class indices of shape ``x.shape[:-1]``.
      bias: Optional ``[V]`` bias added to the logits.
      chunk_size: Vocabulary columns per chunk (positive int), or None (default): chosen by
        :func:`default_tiles`; clipped to V. Larger chunks mean fewer, larger matmuls and more
        memory. V need not be a multiple: the last chunk overlaps the one before it and its
        repeated columns are masked out.
      ignore_index: Label value whose tokens are ignored (e.g. ``-100``), or None.
      where: Optional boolean mask of shape ``labels.shape``; False tokens are ignored.
      label_smoothing: Smoothing ``a`` in ``[0, 1)`` (optax semantics, above). Static float.
      z_loss: Coefficient ``>= 0`` of ``lse**2`` added per token. Static float.
      logit_softcap: If given (``> 0``), logits become ``cap * tanh(logits / cap)`` before the
        softmax (Gemma 2). Static float.
      reduction: ``"mean"``, ``"sum"`` or ``"none"``.
      return_lse: Also return the per-token log-sum-exp (shape ``labels.shape``, f32, computed for
        every token, masked or not); it is differentiable too.
      vocab_axis: Name of the mesh axis ``w``'s V dimension is sharded over, for the
        vocabulary-parallel loss (above), or None: inferred from ``w``'s type under an Explicit
        mesh, from the operands' shardings when XLA partitions the program under an Auto mesh
        or with no mesh in context, else no vocabulary split.
      token_chunk_size: Tokens per tile (positive int), or None (default): as many as fit one
        f32 ``[token_chunk_size, chunk_size]`` block of :func:`default_tiles`' size (or of
        ``block_bytes``), at least 1. Fewer tokens than that run as one tile. Not with
        ``vocab_axis`` (each shard then runs all its tokens at once).
      block_bytes: The f32 bytes of one ``[token_chunk_size, chunk_size]`` block, for the tiles
        that are not given, or None (default): :func:`default_tiles`' rule.

    Returns:
      The loss (a scalar, or ``labels.shape`` for ``"none"``), f32; with ``return_lse``, the pair
      ``(loss, lse)``.

    Raises:
      TypeError: an argument has the wrong type or dtype (non-floating x/w/bias, non-integer
        labels, non-boolean where, non-int chunk_size, traced static floats).
      ValueError: shapes disagree, ``chunk_size <= 0``, an unknown reduction, an option out of
        range, or concrete labels out of ``[0, V)`` at unmasked tokens; with ``vocab_axis``:
        no mesh, an axis not in the mesh, V not divisible by its size, or (Explicit axes, or
        inside ``shard_map``) inputs sharded in a way the vocabulary split cannot use.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from jaxmem.losses import linear_cross_entropy
      >>> kx, kw, kl = jax.random.split(jax.random.key(0), 3)
      >>> x = jax.random.normal(kx, (2, 6, 8))          # [B, T, D]
      >>> w = jax.random.normal(kw, (8, 50)) / 3         # [D, V], V = 50
      >>> labels = jax.random.randint(kl, (2, 6), 0, 50)
      >>> loss = linear_cross_entropy(x, w, labels, chunk_size=16)
      >>> naive = optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()
      >>> bool(jnp.allclose(loss, naive, rtol=1e-5))
      True
      >>> dx, dw = jax.grad(linear_cross_entropy, argnums=(0, 1))(x, w, labels, chunk_size=16)
      >>> dx.shape, dw.shape
      ((2, 6, 8), (8, 50))

      Ignored tokens, and what an out-of-range label does:

      >>> labels = labels.at[0, 0].set(-100)
      >>> loss = linear_cross_entropy(x, w, labels, ignore_index=-100)
      >>> linear_cross_entropy(x, w, labels.at[1, 2].set(50))
      Traceback (most recent call last):
        ...
      ValueError: linear_cross_entropy: labels must lie in [0, V) = [0, 50) where not ignored; \
got labels[0, 0] = -100, labels[1, 2] = 50. Mark such tokens with ignore_index or where=False.
      >>> jax.jit(linear_cross_entropy)(x, w, labels)  # traced: NaN, not a plausible number
      Array(nan, dtype=float32)

      Vocabulary-parallel on 8 devices, tokens over "data", w's V over "model", under an
      Explicit mesh (``vocab_axis="model"`` is read from ``w``'s type; under an Auto mesh, from
      the arrays' shardings when XLA partitions the program):

      >>> from jax.sharding import AxisType, PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
      >>> w = jax.random.normal(kw, (8, 64)) / 3         # V = 64, 16 per shard
      >>> labels = jax.random.randint(kl, (2, 6), 0, 64)
      >>> with jax.set_mesh(mesh):
      ...     xs = jax.sharding.reshard(x, P("data"))
      ...     ws = jax.sharding.reshard(w, P(None, "model"))
      ...     ys = jax.sharding.reshard(labels, P("data"))
      ...     grad = jax.jit(jax.value_and_grad(linear_cross_entropy, argnums=(0, 1)))
      ...     loss, (dx, dw) = grad(xs, ws, ys)
      >>> jax.typeof(dw).sharding.spec, jax.typeof(dx).sharding.spec
      (P(None, 'model'), P('data', None, None))
      >>> naive = optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()
      >>> bool(jnp.allclose(loss, naive, rtol=1e-5))
      True
      >>> auto = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
      >>> with jax.set_mesh(auto):  # no vocab_axis: read from the shardings
      ...     xs, ys = jax.device_put(x, P("data")), jax.device_put(labels, P("data"))
      ...     loss, (dx, dw) = grad(xs, jax.device_put(w, P(None, "model")), ys)
      >>> dw.sharding.spec == P(None, "model"), bool(jnp.allclose(loss, naive, rtol=1e-5))
      (True, True)
      >>> from jax.sharding import NamedSharding  # no mesh in context: the arrays' shardings
      >>> xs = jax.device_put(x, NamedSharding(auto, P("data")))
      >>> ys = jax.device_put(labels, NamedSharding(auto, P("data")))
      >>> ws = jax.device_put(w, NamedSharding(auto, P(None, "model")))
      >>> loss, (dx, dw) = grad(xs, ws, ys)
      >>> dw.sharding.spec == P(None, "model"), bool(jnp.allclose(loss, naive, rtol=1e-5))
      (True, True)

    References:
      Wijmans et al., 2024. "Cut Your Losses in Large-Vocabulary Language Models" (Apple Cut
      Cross-Entropy), arXiv:2411.09009.
      Hsu et al., 2024. "Liger Kernel: Efficient Triton Kernels for LLM Training" (fused linear
      cross-entropy), arXiv:2410.10989.
      Shoeybi et al., 2019. "Megatron-LM: Training Multi-Billion Parameter Language Models Using
      Model Parallelism" (vocab-parallel cross-entropy), arXiv:1909.08053.
    """
    v = _check_inputs(x, w, labels, bias, where, chunk_size, reduction)
    options = _check_loss_options(label_smoothing, z_loss, logit_softcap)
    _check_ignore_index(ignore_index)

    split = _resolve_vocab_split(x, w, labels, where, vocab_axis)
    v_local, v = (v, v) if split is None else split.vocab_sizes(v)  # labels are global ids

    shape = tuple(labels.shape)
    n = math.prod(shape)
    d = w.shape[0]
    x2 = jnp.reshape(x, (n, d))
    labels1 = jnp.reshape(labels, (n,))
    mask = _token_mask(labels1, where, ignore_index)
    _check_labels_if_concrete(labels, where, ignore_index, v)

    _check_tile_options(token_chunk_size, block_bytes)
    dtype = jnp.result_type(x.dtype, w.dtype)
    tiles = (chunk_size, token_chunk_size, block_bytes)
    cfg = _core_config(options, split, (n, d, v_local), dtype, *tiles)
    loss, lse = _per_token(cfg, split, x2, w, bias, labels1, mask)
    # Traced labels cannot be checked: an out-of-range one gets a NaN loss, so that a mean or a
    # sum is NaN rather than a plausible number.
    out_of_range = mask & ((labels1 < 0) | (labels1 >= v))
    loss = jnp.where(out_of_range, jnp.nan, loss)

    out = _reduce(loss, mask, reduction, shape)
    if return_lse:
        return out, jnp.reshape(lse, shape)
    return out
