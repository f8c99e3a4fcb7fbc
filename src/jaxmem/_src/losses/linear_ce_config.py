"""A linear cross-entropy's configuration, checked once: its inputs (shapes, dtypes, labels),
reduction, and default tiles of rows and vocabulary sized to a scratch budget.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_CALLER = "linear_cross_entropy"


_REDUCTIONS = ("mean", "sum", "none")


# The default tiles (default_tiles): blocks of logits of at most _MAX_BLOCK f32 elements (half
# of tokamax's chunked_xla 1024 x 2048 tile), at least _MIN_BLOCK, sides at most _MAX_SIDE; the
# estimated scratch within the bytes of x, or _MIN_SCRATCH.
_MAX_BLOCK = 2**20


_MIN_BLOCK = 2**16


_MAX_SIDE = 8192


_MIN_SCRATCH = 4 * 2**20


# The default tile sides on a GPU (default_tiles): the fastest of a measured sweep.
_GPU_SIDE = 4096


_GPU_BACKENDS = ("gpu", "cuda", "rocm")


class _Config(NamedTuple):
    """Static configuration of the custom-VJP core (hashable)."""

    chunk_size: int
    label_smoothing: float
    z_loss: float
    logit_softcap: float | None
    axis_name: str | tuple[str, ...] | None = None  # mesh axes w's columns are split over, if any
    token_chunk: int | None = None  # tokens per tile (None: all at once)
    by_sharding: bool = False  # split as the operands are sharded, read when XLA partitions
    sum_dx: bool = False  # psum dx over axis_name tile by tile (a shard of the partitioned core)
    cpu_tiles: bool = False  # token tiles in XLA:CPU's faster form: dx in place, x transposed
    # The partitioned core (by_sharding) only: tiles of default_tiles' memory rule for the
    # whole problem, which the devices share (_shared_tiles).
    shared_chunk: bool = False  # chunk_size is the rule's: a shard takes chunk / vocab shards
    shared_block: int | None = None  # the rule's block (tokens x chunk), None: token tile given


def _shares_tiles(block_bytes: int | None, backend: str | None = None) -> bool:
    """Whether :func:`default_tiles` sizes the tiles by memory (the CPU rule), so that devices
    splitting the problem share them; the GPU rule's tiles are sized for speed, per device."""
    backend = jax.default_backend() if backend is None else backend
    return block_bytes is None and backend not in _GPU_BACKENDS


def _shared_tiles(cfg: _Config, v_local: int, vocab_shards: int, shards: int) -> tuple:
    """(chunk, token tile or None) of one device of the partitioned core.

    ``v_local``: its columns of ``w``; ``vocab_shards``: the devices V is split over;
    ``shards``: the devices the tokens and V are split over together. Each device takes its
    share of the memory rule's tiles for the whole problem (chunk / vocab_shards columns, a
    block of 1/shards the elements), so its scratch is its share of the one-device call's; a
    given tile is kept (the chunk clipped to the shard's columns).
    """
    chunk = cfg.chunk_size // vocab_shards if cfg.shared_chunk else cfg.chunk_size
    chunk = max(1, min(chunk, v_local))
    tokens = cfg.token_chunk
    if cfg.shared_block is not None:
        tokens = max(1, cfg.shared_block // shards // chunk)
    return chunk, tokens


def _pow2_floor(k: int) -> int:
    return 1 << (max(1, k).bit_length() - 1)


def _scratch_bytes(tokens: int, chunk: int, dim: int, itemsize: int) -> int:
    """Estimated temp of the tiled loss's value and gradient (measured on XLA:CPU, f32).

    One f32 ``[tokens, chunk]`` block, the ``[dim, chunk]`` slice of ``w`` (and of ``dw``, updated
    in place), the ``[tokens, dim]`` slice of ``x`` and two f32 ``[tokens, dim]`` buffers of ``dx``.
    """
    return 4 * tokens * chunk + itemsize * chunk * dim + (8 + itemsize) * tokens * dim


def _tile_sizes(size: int) -> list[int]:
    """Candidate tile sizes along a dimension: powers of two up to ``_MAX_SIDE``, and ``size``."""
    return sorted({min(size, 1 << k) for k in range(_MAX_SIDE.bit_length())})


def default_tiles(
    num_tokens: int,
    dim: int,
    vocab_size: int,
    dtype: Any = jnp.float32,
    block_bytes: int | None = None,
    backend: str | None = None,
) -> tuple[int, int]:
    """The token tile and vocabulary chunk :func:`linear_cross_entropy` uses by default.

    The rule: the largest f32 ``[tokens, chunk]`` block of logits (tiles powers of two, or the
    whole dimension) whose estimated scratch memory (the block, the ``[D, chunk]`` slices of
    ``w`` and ``dw``, the ``[tokens, D]`` slices of ``x`` and ``dx``) fits in the bytes of ``x``
    itself (``N * D * itemsize``, at least 4 MiB), up to 2**20 elements (4 MiB, half of tokamax's
    ``chunked_xla`` 1024 x 2048 tile); among blocks of that size, the one of least scratch. The
    loss then never needs more scratch than its input takes, and its blocks are as large as that
    allows (larger blocks run faster: fewer, larger matmuls). ``block_bytes``, when given, sets
    the block's f32 bytes instead (as square as powers of two allow, up to 1024 tokens and 2048
    columns per side).

    On a GPU the rule is another: a tiled loop step costs a few kernel launches whatever its
    size, and at these small blocks they dominate (on one NVIDIA H200, jax 0.11.2, N=4096 D=512
    V=32768: 7.0x the naive loss's time at the CPU rule's 512 x 1024 tiles, 1.8x at 4096 x 4096).
    There the tiles are 4096 x 4096 (each side at most its dimension): a 64 MiB f32 block,
    0.13x the naive loss's temp at that shape. Other backends (TPU) are not measured and take
    the CPU rule. Where the loss reads a vocabulary split from the operands' shardings (an Auto
    mesh, or no mesh in context), each device takes its share of the CPU rule's tiles for the
    whole problem (:func:`linear_cross_entropy`); the GPU rule's tiles are per device.

    Args:
      num_tokens: N, the number of tokens (the product of ``labels.shape``).
      dim: D, the hidden size (rows of ``w``).
      vocab_size: V, the number of columns of ``w`` (of its slice, under a vocabulary split).
      dtype: The dtype of ``x @ w``'s operands (its item size scales the slices).
      block_bytes: The f32 bytes of one block, or None for the rule above.
      backend: ``"cpu"``, ``"gpu"``, ... (None: ``jax.default_backend()``, where the loss
        runs unless its inputs are placed elsewhere).

    Returns:
      ``(tokens, chunk)``: tokens per tile (at most ``num_tokens``) and vocabulary columns per
      chunk (at most ``vocab_size``).

    Examples:
      >>> from jaxmem.losses import default_tiles
      >>> default_tiles(4096, 512, 32768), default_tiles(8192, 1024, 32768)
      ((512, 1024), (512, 2048))
      >>> default_tiles(12, 8, 50)  # few tokens: one block
      (12, 50)
      >>> default_tiles(8192, 1024, 32768, block_bytes=16 * 2**20)
      (2048, 2048)
      >>> default_tiles(8192, 1024, 32768, backend="gpu")
      (4096, 4096)

    Raises:
      TypeError: a size that is not an int, or a ``backend`` that is not a str.
      ValueError: a negative ``num_tokens``, or ``dim``, ``vocab_size`` or ``block_bytes`` below 1.
    """
    for name, val, least in (
        ("num_tokens", num_tokens, 0),
        ("dim", dim, 1),
        ("vocab_size", vocab_size, 1),
        ("block_bytes", block_bytes, 1),
    ):
        if val is None and name == "block_bytes":
            continue
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
            raise TypeError(f"default_tiles: {name} must be an int, got {type(val).__name__}")
        if val < least:
            raise ValueError(f"default_tiles: {name} must be >= {least}, got {val}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(
            f"default_tiles: backend must be a platform name such as 'cpu' or 'gpu', or None, "
            f"got {type(backend).__name__}"
        )
    if backend is None:
        backend = jax.default_backend()
    if block_bytes is None and backend in _GPU_BACKENDS:
        return min(num_tokens, _GPU_SIDE), min(vocab_size, _GPU_SIDE)
    if block_bytes is not None:
        elems = max(1, block_bytes // 4)
        square = 1 << ((elems.bit_length() - 1) // 2)  # 2 ** floor(log2(elems) / 2)
        rows = min(num_tokens, square, 1024)
        chunk = min(2048, _pow2_floor(elems // max(1, rows)), vocab_size)
        return min(num_tokens, max(1, elems // chunk)), chunk
    itemsize = np.dtype(dtype).itemsize
    budget = max(num_tokens * dim * itemsize, _MIN_SCRATCH)
    smallest = min(_MIN_BLOCK, num_tokens * vocab_size)

    def key(tc):
        est = _scratch_bytes(*tc, dim, itemsize)
        fits = est <= budget
        # Fits: the largest block, then the least scratch. None fits: the least scratch.
        return (fits, tc[0] * tc[1] if fits else 0, -est, tc[0])

    tiles = [
        (t, c)
        for t in _tile_sizes(num_tokens)
        for c in _tile_sizes(vocab_size)
        if smallest <= t * c <= _MAX_BLOCK
    ]
    return max(tiles, key=key)


def _describe(a: Any) -> str:
    return f"shape {tuple(np.shape(a))} and dtype {jnp.result_type(a)}"


def _check_float(value: Any, argname: str, lo: float, hi: float | None = None) -> float:
    if isinstance(value, jax.core.Tracer) or not isinstance(value, (int, float, np.number)):
        raise TypeError(
            f"{_CALLER}: {argname} must be a Python float (static), got {type(value).__name__} "
            f"({value!r})"
        )
    value = float(value)
    upper = "" if hi is None else f" and < {hi}"
    if not (value >= lo and (hi is None or value < hi)):
        raise ValueError(f"{_CALLER}: {argname} must be >= {lo}{upper}, got {value}")
    return value


def _check_float_array(a: Any, name: str) -> None:
    """Raises TypeError unless ``a`` (``x`` or ``w``) is an array of a floating dtype."""
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{_CALLER}: {name} must be an array, got {type(a).__name__}")
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(
            f"{_CALLER}: {name} must have a floating dtype, got {name} with {_describe(a)}"
        )


def _check_projection(x: Any, w: Any) -> int:
    """Checks that ``x`` is ``[..., D]`` and ``w`` is ``[D, V]`` with V >= 1; returns V."""
    if x.ndim < 1:
        raise ValueError(f"{_CALLER}: x must have shape [..., D], got x with {_describe(x)}")
    if w.ndim != 2:
        raise ValueError(f"{_CALLER}: w must have shape [D, V], got w with {_describe(w)}")
    d, v = w.shape
    if x.shape[-1] != d:
        raise ValueError(
            f"{_CALLER}: x must have shape [..., D] with D = w.shape[0] = {d}, got x with "
            f"{_describe(x)} and w with {_describe(w)}"
        )
    if v < 1:
        raise ValueError(f"{_CALLER}: w must have at least one column (V >= 1), got {w.shape}")
    return v


def _check_labels(labels: Any, x: Any) -> None:
    """Raises unless ``labels`` is an integer array of shape ``x.shape[:-1]``."""
    if not hasattr(labels, "shape") or not hasattr(labels, "dtype"):
        raise TypeError(f"{_CALLER}: labels must be an integer array, got {type(labels).__name__}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"{_CALLER}: labels must have an integer dtype, got labels with {_describe(labels)}"
        )
    if tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"{_CALLER}: labels must have shape x.shape[:-1] = {tuple(x.shape[:-1])}, got labels "
            f"with {_describe(labels)}"
        )


def _check_bias(bias: Any, v: int) -> None:
    """Raises unless ``bias`` is None or a floating array of shape ``[V]``."""
    if bias is None:
        return
    if not hasattr(bias, "shape") or not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"{_CALLER}: bias must be a floating array of shape [V] = ({v},)")
    if tuple(bias.shape) != (v,):
        raise ValueError(
            f"{_CALLER}: bias must have shape [V] = ({v},), got bias with {_describe(bias)}"
        )


def _check_where(where: Any, labels: Any) -> None:
    """Raises unless ``where`` is None or a boolean array of the shape of ``labels``."""
    if where is None:
        return
    if not hasattr(where, "shape") or jnp.result_type(where) != jnp.bool_:
        raise TypeError(
            f"{_CALLER}: where must be a boolean array of shape {tuple(labels.shape)}, got "
            f"{type(where).__name__}"
            + (f" with {_describe(where)}" if hasattr(where, "shape") else "")
        )
    if tuple(where.shape) != tuple(labels.shape):
        raise ValueError(
            f"{_CALLER}: where must have the shape of labels {tuple(labels.shape)}, got where "
            f"with {_describe(where)}"
        )


def _check_chunk_size(chunk_size: Any) -> None:
    """Raises unless ``chunk_size`` is None or a positive int."""
    if chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(
            f"{_CALLER}: chunk_size must be a positive Python int or None, got "
            f"{type(chunk_size).__name__} ({chunk_size!r})"
        )
    if chunk_size <= 0:
        raise ValueError(f"{_CALLER}: chunk_size must be a positive int, got {chunk_size}")


def _check_inputs(x, w, labels, bias, where, chunk_size, reduction):
    """Checks shapes, dtypes and static options; returns the vocabulary size V."""
    # The order is part of the behaviour: where several things are wrong, the first check's
    # error is the one raised.
    _check_float_array(x, "x")
    _check_float_array(w, "w")
    v = _check_projection(x, w)
    _check_labels(labels, x)
    _check_bias(bias, v)
    _check_where(where, labels)
    _check_chunk_size(chunk_size)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{_CALLER}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    return v


def _check_loss_options(
    label_smoothing: Any, z_loss: Any, logit_softcap: Any
) -> tuple[float, float, float | None]:
    """Checks the static floats of the loss; returns them as floats (the softcap or None)."""
    alpha = _check_float(label_smoothing, "label_smoothing", 0.0, 1.0)
    zc = _check_float(z_loss, "z_loss", 0.0)
    cap = None if logit_softcap is None else _check_float(logit_softcap, "logit_softcap", 0.0)
    if cap == 0.0:
        raise ValueError(f"{_CALLER}: logit_softcap must be > 0 or None, got {logit_softcap}")
    return alpha, zc, cap


def _check_ignore_index(ignore_index: Any) -> None:
    """Raises TypeError unless ``ignore_index`` is None or an int (not a bool)."""
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer))
    ):
        raise TypeError(
            f"{_CALLER}: ignore_index must be a Python int or None, got "
            f"{type(ignore_index).__name__} ({ignore_index!r})"
        )


def _check_tile_options(token_chunk_size: Any, block_bytes: Any) -> None:
    """Raises unless ``token_chunk_size`` and ``block_bytes`` are each None or a positive int."""
    for name, val in (("token_chunk_size", token_chunk_size), ("block_bytes", block_bytes)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, (int, np.integer))):
            raise TypeError(f"{_CALLER}: {name} must be an int, got {type(val).__name__}")
        if val is not None and val <= 0:
            raise ValueError(f"{_CALLER}: {name} must be positive, got {val}")
