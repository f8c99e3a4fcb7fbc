"""Benchmark cases: scanned losses, each written once against a pluggable scan implementation.

Every case is a factory ``make_loss(scan_impl) -> loss(*args) -> scalar`` plus
``make_args() -> tuple`` (pytrees of arrays, fixed PRNG seeds). The stock column of a benchmark is
``make_loss(jax.lax.scan)``; a variant column is ``make_loss(variant)`` for a scan implementation
with the signature of :func:`jax.lax.scan` (e.g. ``jaxmem.scan``). All losses are differentiated
with respect to every array argument.

Cases register themselves here, in one place, with the :func:`case` decorator; the definitions of
the first six follow docs/design.md §4 exactly. Variants register with :func:`register_variant`.

Examples:
  >>> import jax
  >>> from benchmarks import cases
  >>> c = cases.CASES["rnn_ys"]
  >>> [a.shape for a in c.abstract_args()]
  [(256, 256), (128, 32, 256), (32, 256)]
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

ScanImpl = Callable[..., Any]
"""A scan implementation with the signature of :func:`jax.lax.scan`."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case.

    Attributes:
      name: Registry key, e.g. ``"rnn_ys"``.
      make_loss: ``make_loss(scan_impl) -> loss(*args) -> scalar``.
      make_args: ``make_args() -> tuple`` of pytrees of arrays, deterministic (fixed seeds).
      description: One line, shown in reports.
    """

    name: str
    make_loss: Callable[[ScanImpl], Callable[..., jax.Array]]
    make_args: Callable[[], tuple[Any, ...]]
    description: str

    def abstract_args(self) -> tuple[Any, ...]:
        """Returns the arguments as ``jax.ShapeDtypeStruct`` pytrees, without computing them."""
        return jax.eval_shape(self.make_args)

    def argnums(self) -> tuple[int, ...]:
        """Returns the positions of all arguments (every one is differentiated)."""
        return tuple(range(len(self.abstract_args())))


CASES: dict[str, Case] = {}
"""The case registry, in registration order."""


def case(
    make_args: Callable[[], tuple[Any, ...]], *, name: str | None = None
) -> Callable[[Callable[[ScanImpl], Callable[..., jax.Array]]], Callable]:
    """Registers a loss factory as a benchmark case.

    Args:
      make_args: Returns the loss's arguments (fixed PRNG seeds).
      name: Registry key; defaults to the factory's ``__name__``.

    Returns:
      A decorator that registers ``make_loss`` and returns it unchanged. The case's description
      is the first line of the factory's docstring.

    Raises:
      ValueError: If a case of that name is already registered.
    """

    def register(make_loss: Callable[[ScanImpl], Callable[..., jax.Array]]) -> Callable:
        key = name or make_loss.__name__
        if key in CASES:
            raise ValueError(f"benchmark case {key!r} is already registered; pick another name.")
        doc = (make_loss.__doc__ or "").strip().splitlines()
        CASES[key] = Case(key, make_loss, make_args, doc[0] if doc else key)
        return make_loss

    return register


# Variants: scan implementations compared against jax.lax.scan. A factory returns the
# implementation, or None where it is not available (yet), so the column is simply left out.
_VARIANT_FACTORIES: dict[str, Callable[[], ScanImpl | None]] = {}


def register_variant(name: str, factory: Callable[[], ScanImpl | None]) -> None:
    """Registers a scan implementation to compare against ``jax.lax.scan``.

    Args:
      name: Column label, e.g. ``"jaxmem"``.
      factory: Returns the scan implementation, or None if it is unavailable in this install.
    """
    _VARIANT_FACTORIES[name] = factory


def variants() -> dict[str, ScanImpl]:
    """Returns the available variants, label -> scan implementation, in registration order."""
    out = {}
    for label, factory in _VARIANT_FACTORIES.items():
        impl = factory()
        if impl is not None:
            out[label] = impl
    return out


def _jaxmem_scan(**options: Any) -> ScanImpl | None:
    """Returns ``jaxmem.scan`` with ``options`` bound, or None if jaxmem has no such scan."""
    import jaxmem

    scan = getattr(jaxmem, "scan", None)
    if scan is None or not options:
        return scan
    if not set(options) <= set(inspect.signature(scan).parameters):
        return None
    return functools.partial(scan, **options)


register_variant("jaxmem", _jaxmem_scan)
register_variant("jaxmem-norecompute", functools.partial(_jaxmem_scan, recompute="none"))
# Host offload of everything stacked: the identity on CPU (same device figures), host-placed
# stacks on GPU/TPU.
register_variant("jaxmem-offload", functools.partial(_jaxmem_scan, offload="all"))


# ----------------------------------------------------------------------------------------------
# Shared initialisation.


def _normal(key: jax.Array, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(key, shape, jnp.float32)


# ----------------------------------------------------------------------------------------------
# RNN: W[D, D], xs[T, B, D], h0[B, D]; T=128, B=32, D=256, f32.

_RNN_T, _RNN_B, _RNN_D = 128, 32, 256


def _rnn_args() -> tuple[jax.Array, jax.Array, jax.Array]:
    kw, kx, kh = jax.random.split(jax.random.key(0), 3)
    d = _RNN_D
    w = _normal(kw, (d, d), 1.0 / math.sqrt(d))
    xs = _normal(kx, (_RNN_T, _RNN_B, d))
    h0 = _normal(kh, (_RNN_B, d))
    return w, xs, h0


@case(_rnn_args)
def rnn_ys(scan: ScanImpl) -> Callable[..., jax.Array]:
    """RNN h = tanh(h @ W + x) emitting ys = h; loss sum(ys**2)."""

    def loss(w, xs, h0):
        def body(h, x):
            h = jnp.tanh(h @ w + x)
            return h, h

        _, ys = scan(body, h0, xs)
        return jnp.sum(ys**2)

    return loss


@case(_rnn_args)
def rnn(scan: ScanImpl) -> Callable[..., jax.Array]:
    """RNN h = tanh(h @ W + x), no ys; loss sum(h_T**2)."""

    def loss(w, xs, h0):
        def body(h, x):
            return jnp.tanh(h @ w + x), None

        h_t, _ = scan(body, h0, xs)
        return jnp.sum(h_t**2)

    return loss


# ----------------------------------------------------------------------------------------------
# Weight stacks as xs: Ws[L, D, D] f32, h0[B, D]; L=16, B=64, D=1024.

_WS_L, _WS_B, _WS_D = 16, 64, 1024


def _weight_stack_args() -> tuple[jax.Array, jax.Array]:
    kw, kh = jax.random.split(jax.random.key(1))
    d = _WS_D
    ws = _normal(kw, (_WS_L, d, d), 1.0 / math.sqrt(d))
    h0 = _normal(kh, (_WS_B, d))
    return ws, h0


@case(_weight_stack_args)
def cast_weights(scan: ScanImpl) -> Callable[..., jax.Array]:
    """Layer stack h = tanh(f32(bf16(h) @ bf16(w))); loss sum(h_L**2).

    As docs/design.md §4 writes it (tanh in f32), the stock listing is 42.2 MiB (44.3 MB of
    1e6 bytes): the bf16 weight copy, bf16 h, and tanh's two f32 residuals. The 40.1 MB
    (38.2 MiB) of section 1 is what the same loop lists with tanh taken in bf16,
    ``tanh(bf16(h) @ bf16(w)).astype(f32)``.
    """

    def loss(ws, h0):
        def body(h, w):
            y = h.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
            return jnp.tanh(y.astype(jnp.float32)), None

        h_l, _ = scan(body, h0, ws)
        return jnp.sum(h_l**2)

    return loss


@case(_weight_stack_args)
def transposed_weights(scan: ScanImpl) -> Callable[..., jax.Array]:
    """Layer stack h = tanh(h @ w.T); loss sum(h_L**2)."""

    def loss(ws, h0):
        def body(h, w):
            return jnp.tanh(h @ w.T), None

        h_l, _ = scan(body, h0, ws)
        return jnp.sum(h_l**2)

    return loss


# ----------------------------------------------------------------------------------------------
# Pre-LN transformer block stack: L=4, B=8, S=128, D=256, H=4, F=1024, f32.

_LM_L, _LM_B, _LM_S, _LM_D, _LM_H, _LM_F = 4, 8, 128, 256, 4, 1024
_LN_EPS = 1e-6


def _prelm_args() -> tuple[dict[str, jax.Array], jax.Array]:
    keys = jax.random.split(jax.random.key(2), 5)
    n, d, f = _LM_L, _LM_D, _LM_F
    params = {
        "ln1": jnp.ones((n, d), jnp.float32),
        "ln2": jnp.ones((n, d), jnp.float32),
        "qkv": _normal(keys[0], (n, d, 3 * d), 1.0 / math.sqrt(d)),
        "o": _normal(keys[1], (n, d, d), 1.0 / math.sqrt(d)),
        "w1": _normal(keys[2], (n, d, f), 1.0 / math.sqrt(d)),
        "w2": _normal(keys[3], (n, f, d), 1.0 / math.sqrt(f)),
    }
    x = _normal(keys[4], (_LM_B, _LM_S, d))
    return params, x


def _layer_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """LayerNorm over the last axis with a learned scale (no bias)."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + _LN_EPS) * scale[None, None, :]


def _attention(x: jax.Array, w_qkv: jax.Array, w_o: jax.Array, num_heads: int) -> jax.Array:
    """Causal multi-head softmax self-attention with fused qkv and output projections."""
    b, s, d = x.shape
    dh = d // num_heads
    qkv = (x @ w_qkv).reshape(b, s, 3, num_heads, dh)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, S, H, Dh]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
    causal = jnp.tril(jnp.ones((s, s), jnp.bool_))[None, None]
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
    return out @ w_o


def _prelm_block(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """Pre-LN block: x + attn(LN(x)); then h + mlp(LN(h)) with a GELU MLP."""
    h = x + _attention(_layer_norm(x, p["ln1"]), p["qkv"], p["o"], _LM_H)
    return h + jax.nn.gelu(_layer_norm(h, p["ln2"]) @ p["w1"]) @ p["w2"]


def _prelm_loss(scan: ScanImpl, policy: Callable | None) -> Callable[..., jax.Array]:
    def body(x, p):
        return _prelm_block(x, p), None

    if policy is not None:
        body = jax.checkpoint(body, policy=policy)

    def loss(params, x):
        x_l, _ = scan(body, x, params)
        return jnp.mean(x_l**2)

    return loss


@case(_prelm_args)
def prelm_block(scan: ScanImpl) -> Callable[..., jax.Array]:
    """Causal pre-LN transformer blocks (params stacked as xs), no remat; loss mean(x_L**2).

    The attention is causal (a language-model block): with the mask, the loop-stacked residuals
    reproduce docs/design.md §1 (163.7 MiB = 171.6 MB without the argument residuals;
    161.2 MiB = 169.0 MB unmasked).
    """
    return _prelm_loss(scan, None)


@case(_prelm_args)
def prelm_block_dots(scan: ScanImpl) -> Callable[..., jax.Array]:
    """prelm_block with jax.checkpoint(body, policy=dots_saveable)."""
    return _prelm_loss(scan, jax.checkpoint_policies.dots_saveable)
