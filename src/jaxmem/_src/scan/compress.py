"""Compressed residuals: the float values a lean scan keeps for its backward pass, stored in
fewer bits (``jaxmem.scan(compress=...)``, docs/compress.md).

A kept value is *encoded* in the forward step and *decoded* in the backward step; nothing is
recomputed, so the gradient's FLOPs are those of ``compress=None`` plus the (elementwise) codec.
The encoded payload is stored as raw bits (``uint16`` for bf16, ``uint8`` for fp8, ``int8``):
XLA:CPU does not reliably keep narrow float dtypes at their width in a loop's stacks (jax 0.12
kept float8 at 2 bytes a value, 0.10.2 kept bfloat16 in f32), an integer stack it does.

Formats (a *format* is chosen per kept value by :func:`choose`):

- ``"bf16"``: rounded to bfloat16 (relative error at most 2**-9), no scale.
- ``"fp8"``: float8_e4m3fn times one f32 scale per row of the last axis (the row's absolute
  maximum over 448): relative error at most 2**-4 of each element, within its row's range.
- ``"int8"``: round-to-nearest int8 times one f32 scale per row (absmax over 127): absolute
  error at most half a step, ``absmax(row) / 254``.

Under fp8 and int8 a row holding an inf or a NaN decodes as non-finite (its scale is its
non-finite absmax), never as clipped finite values; bf16 keeps infs and NaNs as they are.

Rules (:func:`choose`): only real floating-point values wider than the format are encoded
(booleans are packed to bits elsewhere; integers, complex values and narrower floats are kept as
they are). fp8 and int8 need rows of at least :data:`MIN_ROW` elements (a shorter row costs more
in its 4-byte scale than it saves; such a value is kept uncompressed). Under ``"fp8"`` and
``"int8"``, a value that feeds ``exp`` in the step (attention scores, from which softmax is
recomputed) is stored as bf16: ``exp`` turns an absolute error into a relative one (fp8's 1/16
relative error of a large score made a small GPT's training diverge, final loss 2.7x the
lossless run's), and a row scale is useless for a masked row (``where(mask, s, finfo.min)``: its
absolute maximum is the mask's fill, and every real score would encode to 0; measured on the
transformer stack, a gradient error of 2e2 under int8). The cut prices each value at its encoded
size (:func:`jaxmem._src.scan.residuals.kept_size`), so it keeps such a value only where nothing
cheaper serves: in softmax attention it keeps the exponentials ``exp(s - max)`` (in (0, 1], do
not feed exp, 1 byte an element) rather than the scores (2 bytes). A *row statistic* (a value
computed from a reduction by elementwise steps: a norm's mean and inverse deviation, softmax's
maximum and sum, :func:`is_statistic`) is kept as it is under every format: it costs one value per
row, and its error would scale its whole row alike (fp8 norm statistics measured a gradient error
of 1e-1 on a small attention stack, against 1e-2 kept exact).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._src import jax_compat as jc
from jaxmem._src.scan import jaxprs as _jaxprs

FORMATS = ("bf16", "fp8", "int8")

# Rows shorter than this keep their value uncompressed under the scaled formats (fp8, int8).
MIN_ROW = 16

_FP8 = jnp.float8_e4m3fn
_FP8_MAX = float(jnp.finfo(_FP8).max)  # 448
_INT8_MAX = 127.0


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How one kept value is stored: its format (None: as it is) and its type."""

    format: str | None
    shape: tuple[int, ...]
    dtype: Any  # the value's own dtype (a NumPy dtype, or JAX's extended ones: PRNG keys)

    @property
    def nbytes(self) -> int:
        """Bytes one step's value takes encoded (payload and scales)."""
        n = int(np.prod(self.shape, dtype=np.int64))
        if self.format is None:
            return jc.nbytes(jax.ShapeDtypeStruct(self.shape, self.dtype))
        if self.format == "bf16":
            return 2 * n
        rows = int(np.prod(self.shape[:-1], dtype=np.int64))
        return n + 4 * rows


def _is_real_float(dtype) -> bool:
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and jnp.issubdtype(
        dtype, jnp.floating
    )


def check_first_order(compress: str | None, values: Any, caller: str, kept: str) -> None:
    """Refuse ``compress=`` under higher-order differentiation, where its result would be wrong.

    What a compressed backward keeps (``kept``: its values, a reversible stack's anchors) is
    integer bits, through which no derivative flows: a grad of grad would silently miss the
    terms that pass through them.

    Raises:
      NotImplementedError: ``compress`` is set and a leaf of ``values`` is being differentiated.
    """
    if compress is not None and any(jc.is_differentiated(v) for v in jax.tree.leaves(values)):
        raise NotImplementedError(
            f"{caller} got compress={compress!r} under higher-order differentiation "
            f"(jax.hessian, grad of grad): {kept} it keeps are integer bits, through which no "
            "derivative flows, so the result would be wrong. Use compress=None for higher-order "
            "derivatives."
        )


def choose(
    aval, compress: str | None, feeds_exp: bool = False, statistic: bool = False
) -> Encoding:
    """The encoding of a kept value of type ``aval`` under ``compress`` (rules in the module
    docstring).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> choose(jax.ShapeDtypeStruct((4, 64), jnp.float32), "fp8").format
      'fp8'
      >>> choose(jax.ShapeDtypeStruct((4, 8), jnp.float32), "fp8").format is None  # short rows
      True
      >>> choose(jax.ShapeDtypeStruct((4, 64), jnp.float32), "int8", feeds_exp=True).format
      'bf16'
      >>> choose(jax.ShapeDtypeStruct((4, 64), jnp.int32), "int8").format is None
      True
      >>> choose(jax.ShapeDtypeStruct((4, 64), jnp.float32), "bf16", statistic=True).format is None
      True
    """
    shape, dtype = tuple(aval.shape), aval.dtype
    keep = Encoding(None, shape, dtype)
    if compress is None or statistic or not _is_real_float(dtype):
        return keep  # (a PRNG key's extended dtype is not a float: kept as it is)
    fmt = "bf16" if feeds_exp else compress
    if fmt != "bf16" and (not shape or shape[-1] < MIN_ROW):
        return keep
    enc = Encoding(fmt, shape, dtype)
    return enc if enc.nbytes < keep.nbytes else keep


def encode(x, enc: Encoding):
    """``x`` as stored: itself (format None), or a tuple of arrays (bits, and scales per row)."""
    if enc.format is None:
        return x
    if enc.format == "bf16":
        return (jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16),)
    xf = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(xf), axis=-1)
    top = _FP8_MAX if enc.format == "fp8" else _INT8_MAX
    # A zero row gets scale 1: its zeros encode exactly. A row holding an inf or a NaN keeps
    # its non-finite absmax as its scale, so it decodes non-finite (NaN, or inf) and the
    # gradient shows it, as without compress: clipped, it would be silently finite.
    finite = jnp.isfinite(absmax)
    scale = jnp.where(finite & (absmax > 0), absmax / top, jnp.where(finite, 1.0, absmax))
    q = xf / scale[..., None]
    if enc.format == "fp8":
        bits = jax.lax.bitcast_convert_type(jnp.clip(q, -top, top).astype(_FP8), jnp.uint8)
    else:
        bits = jnp.clip(jnp.round(q), -top, top).astype(jnp.int8)
    return (bits, scale)


def decode(stored, enc: Encoding):
    """The value :func:`encode` stored, back in its own dtype."""
    if enc.format is None:
        return stored
    if enc.format == "bf16":
        (bits,) = stored
        # bf16's bits are the high half of the f32 of the same value. Widened by integer ops,
        # not by a convert: XLA would fold convert(convert(bf16 -> f32) -> bf16) in a body that
        # casts the value back to bf16, and jax 0.10.2's XLA:CPU then kept the weight
        # gradient's dot unfused (two f32 [D, D] buffers instead of one).
        wide = jax.lax.shift_left(bits.astype(jnp.uint32), jnp.uint32(16))
        return jax.lax.bitcast_convert_type(wide, jnp.float32).astype(enc.dtype)
    bits, scale = stored
    q = jax.lax.bitcast_convert_type(bits, _FP8) if enc.format == "fp8" else bits
    return (q.astype(jnp.float32) * scale[..., None]).astype(enc.dtype)


_REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "reduce_and"}
)
_ELEMENTWISE_DEPTH = 8


def is_statistic(jaxpr, var, eqn_of=None) -> bool:
    """Whether ``var`` of ``jaxpr`` is a reduction's output, or one taken through at most
    :data:`_ELEMENTWISE_DEPTH` equations that keep its size (``rsqrt(mean(x**2) + eps)``, with
    or without ``keepdims``).
    ``eqn_of`` maps each variable to the equation that computes it (built when None)."""
    if eqn_of is None:
        eqn_of = {v: e for e in jaxpr.eqns for v in e.outvars}
    frontier = [var]
    for _ in range(_ELEMENTWISE_DEPTH):
        nxt = []
        for v in frontier:
            eqn = eqn_of.get(v) if jc.is_var(v) else None
            if eqn is None:
                continue
            if eqn.primitive.name in _REDUCTIONS:
                return True
            # Inputs of as many elements: elementwise steps, and reshapes or broadcasts that
            # add or drop unit axes (a mean taken with keepdims).
            size = int(np.prod(v.aval.shape, dtype=np.int64))
            nxt += [
                u
                for u in eqn.invars
                if jc.is_var(u)
                and hasattr(u.aval, "shape")
                and int(np.prod(u.aval.shape, dtype=np.int64)) == size
            ]
        if not nxt:
            return False
        frontier = list(dict.fromkeys(nxt))  # each variable once per level
    return False


# Primitives whose output is an exponential of their input: a value reaching one through the
# step (not through a matmul) "feeds exp".
_EXP_PRIMITIVES = frozenset({"exp", "exp2"})
_STOP_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})


def feeds_exp(jaxpr) -> frozenset:
    """The variables of ``jaxpr`` that reach an ``exp`` (or ``exp2``) through the step's
    equations other than matmuls (at any call depth: an equation with a sub-jaxpr that takes a
    reached value and computes an exponential counts). One pass, last equation first."""
    fed: set = set()
    for eqn in reversed(jaxpr.eqns):
        name = eqn.primitive.name
        if name in _STOP_PRIMITIVES:
            continue
        if (
            name in _EXP_PRIMITIVES
            or any(v in fed for v in eqn.outvars)
            or any(_has_exp(sub) for sub in jc.subjaxprs(eqn))
        ):
            fed.update(v for v in eqn.invars if jc.is_var(v))
    return frozenset(fed)


def encoder(jaxpr, compress: str | None):
    """The encoding of each variable of ``jaxpr`` kept under ``compress``: a function of the
    variable (:func:`choose`'s rules, with :func:`feeds_exp` and :func:`is_statistic` read from
    ``jaxpr``; a boolean mask kept as bits is not encoded)."""
    if compress is None:
        return lambda v: Encoding(None, tuple(v.aval.shape), v.aval.dtype)
    exp_fed = feeds_exp(jaxpr) if compress in ("fp8", "int8") else frozenset()
    eqn_of = {v: e for e in jaxpr.eqns for v in e.outvars}
    memo: dict = {}  # the cut asks for every value, once per cut it tries

    def encoding(v) -> Encoding:
        if v not in memo:
            if _jaxprs.packs_bits(v.aval):
                memo[v] = choose(v.aval, None)
            else:
                stat = is_statistic(jaxpr, v, eqn_of)
                memo[v] = choose(v.aval, compress, v in exp_fed, stat)
        return memo[v]

    return encoding


def _has_exp(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _EXP_PRIMITIVES:
            return True
        if any(_has_exp(sub) for sub in jc.subjaxprs(eqn)):
            return True
    return False
