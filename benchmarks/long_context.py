"""Long context (issue 51): how the gradient's memory grows with the sequence length.

Two Llama-like decoders as their users write them, with the same sizes (2 layers scanned,
D=256, 4 heads, SwiGLU width 4D, vocabulary 2048, f32, RMSNorm, RoPE, causal attention through
``jax.nn.dot_product_attention``): :mod:`benchmarks.models.llama_long` (plain JAX, a params
dict, ``jax.lax.scan`` over stacked weights) and :mod:`benchmarks.models.llama_long_nnx` (Flax
NNX, ``nnx.vmap`` + ``nnx.scan``). For each, three columns:

- ``stock``: the loss as written, no remat;
- ``stock full remat``: each layer under ``jax.checkpoint(policy=nothing_saveable)``, stock
  JAX's leanest policy;
- ``jaxmem``: ``jaxmem.optimize(loss, chunk_tokens=True)`` of the loss as written (where the
  installed jaxmem lacks that API the column reads ``n/a`` with the error's type, and the
  criteria that read it FAIL).

Figures (docs/design.md §3): the compiled temp bytes of ``jax.jit(jax.value_and_grad(loss))``
with respect to the parameters at B=1 and S in 1024 .. 16384 (compiled on abstract arguments,
never run); the growth temp(8192) / temp(2048) per column; jaxmem's temp at 8192 over full
remat's; the longest power-of-two S (up to 65536) whose jaxmem temp fits in stock's temp at
S=2048; the step time of the value and gradient at S=2048, jaxmem against stock, in interleaved
rounds (:func:`benchmarks.harness.time_interleaved`, the median over rounds of the per-round
ratio); the gradients of jaxmem against stock at S=1024 (max |diff| / max |g|, over all
parameters).

Criteria of the issue, per model, printed as PASS or FAIL (exit status 1 if any fails):
growth <= 4.5; temp at 8192 <= 0.05x full remat's; longest fitting S >= 32768; time ratio
<= 1.00; gradients within 1e-5 of the largest.

jax 0.12.1 runs ``jax.nn.softmax`` through its custom JVP by default (``jax_softmax_custom_jvp``
True; False on 0.10.2), which keeps one ``[N, S, S]`` residual per layer where the other rule
keeps two: stock's temp without remat is 17% (S=1024) to 26% (S=8192) lower than with the flag
off, full remat's is the same. The issue's table (jax 0.12.0.1) matches the plain model on
0.10.2 within 2%. The flag is printed with the jax version. The models take about 4 minutes on
2 CPU cores (jax 0.12.1), the attention section 2 more, ``--spread`` about 13.

``jaxmem.attention`` alone against ``jax.nn.dot_product_attention`` (its XLA path), at B=1,
N=4, H=64, f32, T=S=4096, for five variants: causal; GQA (K=2 of N=4), causal; a random boolean
mask ``[B,N,T,S]`` (not causal); a random bias ``[1,N,T,S]``; causal with a mask and a bias
``[B,1,T,S]``. Figures: max |diff| / max |ref| of the output and of the gradients of q, k, v (and
the bias where given) pulled back from a random cotangent; the compiled temp of
``jax.jit(jax.grad(lambda q, k, v: sum(f(q, k, v) * ct)))`` (compiled only), jaxmem over
jax.nn; the paired step time (output and gradients) of the causal variant, reported without a
criterion. Criteria: values and gradients within 1e-5, gradient temp <= 0.1x jax.nn's. About 2
minutes (jax 0.12.1, 2 CPU cores). It runs with the models, or alone with ``--attention``.

``--spread`` (instead of the models and the attention section; with ``--attention``, both): the
three memory criteria (growth 2048 -> 8192, ratio to full remat at 8192, longest fitting S up
to 65536), compiled only, at other shapes than the default one: B=1 and B=4, D=512 with 8
heads, GQA (K=2 of N=4), 4 layers, V=32000, bf16 on the plain model, and B=4, D=512, bf16 on
the NNX one; at B=4 and D=512 (plain) also the step time at S=2048 and the gradients at 1024 and
their criteria. One row per shape; every criterion counts in the exit status.

``--quick`` (for tests) runs D=32, 2 heads, V=64 at S in 64 .. 1024 with every criterion's
length scaled by 1/16 and 3 rounds, and the attention at T=S=256, H=16, blocks of 64 (the spread:
B=2 on each model); its criteria say nothing about the issue's sizes.

Usage: ``python -m benchmarks.long_context [--quick] [--json PATH] [--plot PATH]
[--model {plain,nnx}] [--repeats N] [--attention] [--spread]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import pathlib
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxmem
from benchmarks import harness
from benchmarks.harness import format_mib
from benchmarks.lm1b import FAST_COMPILE
from benchmarks.long_rnn import FAIL, PASS, Check, format_checks, passed
from benchmarks.models import llama_long, llama_long_nnx
from benchmarks.models.llama_long import LlamaConfig

STOCK = "stock"
REMAT = "stock full remat"
JAXMEM = "jaxmem"
COLUMNS = (STOCK, REMAT, JAXMEM)

MAX_GROWTH = 4.5
"""Criterion: jaxmem's temp at the long length over its temp at the short one, at most."""

MAX_VS_REMAT = 0.05
"""Criterion: jaxmem's temp over stock full remat's at the long length, at most."""

MAX_TIME_RATIO = 1.0
"""Criterion: jaxmem's step time over stock's (median of the per-round ratios), at most."""

MAX_GRAD_ERR = 1e-5
"""Criterion: max |g_jaxmem - g_stock| / max |g_stock| over all parameters, at most."""


def chunk_tokens_available() -> bool:
    """Whether the installed ``jaxmem.optimize`` takes ``chunk_tokens`` (the jaxmem column)."""
    return "chunk_tokens" in inspect.signature(jaxmem.optimize).parameters


# ----------------------------------------------------------------------------------------------
# Configuration and models.


@dataclasses.dataclass(frozen=True)
class Config:
    """The sizes of one run.

    Attributes:
      model: the decoder's sizes.
      lengths: sequence lengths of the main table (B=1).
      growth: ``(short, long)``: the growth is temp(long) / temp(short); long is also where
        jaxmem is compared with full remat.
      fit_budget_length: stock's temp (no remat) at this length is the budget of the longest
        fitting S.
      fit_min_length: criterion: the longest S whose jaxmem temp fits is at least this.
      fit_max_length: the longest S tried (powers of two from ``fit_budget_length``).
      time_length: S of the timed step.
      grad_length: S of the gradient comparison.
      repeats: interleaved rounds of the timed step.
      batch: B.
      quick: compile without LLVM optimization even for the timed step (tests).
    """

    model: LlamaConfig = llama_long.DEFAULT
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    growth: tuple[int, int] = (2048, 8192)
    fit_budget_length: int = 2048
    fit_min_length: int = 32768
    fit_max_length: int = 65536
    time_length: int = 2048
    grad_length: int = 1024
    repeats: int = 11
    batch: int = 1
    quick: bool = False


FULL = Config()
QUICK = Config(
    model=LlamaConfig(d_model=32, num_heads=2, vocab_size=64),
    lengths=(64, 128, 256, 512, 1024),
    growth=(128, 512),
    fit_budget_length=128,
    fit_min_length=2048,
    fit_max_length=4096,
    time_length=128,
    grad_length=64,
    repeats=3,
    quick=True,
)


@dataclasses.dataclass(frozen=True)
class Model:
    """One decoder as the benchmark runs it.

    Attributes:
      name: its label.
      loss: ``(cfg, remat) -> (loss, abstract parameters)``: the loss as a function of
        ``(parameters, tokens)`` and its parameters' shapes.
      params: ``cfg -> concrete parameters`` of that loss (seeded).
    """

    name: str
    loss: Callable[[LlamaConfig, bool], tuple[Callable, Any]]
    params: Callable[[LlamaConfig], Any]


def _plain_loss(cfg: LlamaConfig, remat: bool) -> tuple[Callable, Any]:
    return llama_long.make_loss(cfg, remat=remat), llama_long.abstract_params(cfg)


def _nnx_params(cfg: LlamaConfig) -> Any:
    return llama_long_nnx.pure_loss(llama_long_nnx.Llama(cfg, rngs=nnx.Rngs(0)))[1]


MODELS = {
    "plain": Model(
        "plain JAX (llama_long)",
        _plain_loss,
        lambda cfg: llama_long.init(jax.random.key(0), cfg),
    ),
    "nnx": Model(
        "Flax NNX (llama_long_nnx)",
        lambda cfg, remat: llama_long_nnx.abstract_state(cfg, remat=remat),
        _nnx_params,
    ),
}


def column_loss(model: Model, cfg: LlamaConfig, label: str) -> tuple[Callable, Any]:
    """The loss of a column and its abstract parameters (``optimize`` raises where the installed
    jaxmem lacks ``chunk_tokens``: a TypeError)."""
    loss, params = model.loss(cfg, label == REMAT)
    return (jaxmem_loss(loss) if label == JAXMEM else loss), params


def jaxmem_loss(loss: Callable) -> Callable:
    """The jaxmem column's loss: ``jaxmem.optimize(loss, chunk_tokens=True)``."""
    return jaxmem.optimize(loss, chunk_tokens=True)


def _tokens(cfg: LlamaConfig, batch: int, length: int, concrete: bool = False) -> Any:
    if not concrete:
        return jax.ShapeDtypeStruct((batch, length), jnp.int32)
    return jax.random.randint(jax.random.key(1), (batch, length), 0, cfg.vocab_size, jnp.int32)


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]


# ----------------------------------------------------------------------------------------------
# Measuring.


@dataclasses.dataclass
class Result:
    """The figures of one model.

    Attributes:
      model: the model's label.
      temps: column -> S -> compiled temp bytes of the value-and-gradient (None: not measured).
      errors: column -> the first error that stopped it (its later figures are None).
      fit_budget: stock's temp at ``fit_budget_length``.
      time: the timed step (``stock_median_s``, ``jaxmem_median_s``, ``ratio``: median of the
        per-round ratios, ``samples``), or None.
      grad_err: max |g_jaxmem - g_stock| / max |g_stock| at ``grad_length``, or None.
      value_err: |loss_jaxmem - loss_stock| / |loss_stock| there, or None.
      skipped: why the time and the gradients were not measured, or None.
    """

    model: str
    temps: dict[str, dict[int, int | None]]
    errors: dict[str, str]
    fit_budget: int | None = None
    time: dict[str, Any] | None = None
    grad_err: float | None = None
    value_err: float | None = None
    skipped: str | None = None

    def temp(self, label: str, length: int) -> int | None:
        """A column's temp bytes at S=length, or None."""
        return self.temps.get(label, {}).get(length)

    def ratio(self, label: str, length: int, ref: str) -> float | None:
        """``temp(label) / temp(ref)`` at S=length, or None."""
        num, den = self.temp(label, length), self.temp(ref, length)
        return None if num is None or not den else num / den

    def growth(self, label: str, short: int, long: int) -> float | None:
        """A column's temp at ``long`` over its temp at ``short``, or None."""
        num, den = self.temp(label, long), self.temp(label, short)
        return None if num is None or not den else num / den

    def longest_fit(self, label: str, start: int) -> int | None:
        """The longest S from ``start`` on (powers of two, consecutive) whose temp fits in
        :attr:`fit_budget`, or None (none measured, or the first already too big)."""
        best, length = None, start
        while (t := self.temp(label, length)) is not None and self.fit_budget is not None:
            if t > self.fit_budget:
                break
            best, length = length, 2 * length
        return best


def _compile_temp(loss: Callable, params: Any, tokens: Any) -> int:
    """Compiled temp bytes; on CPU without LLVM optimization (:data:`FAST_COMPILE`: buffer
    assignment runs before code generation, the temp bytes are the same)."""
    lowered = jax.jit(jax.value_and_grad(loss)).lower(params, tokens)
    fast = jax.default_backend() == "cpu"
    compiled = lowered.compile(FAST_COMPILE) if fast else lowered.compile()
    return compiled.memory_analysis().temp_size_in_bytes


def measure_temp(model: Model, config: Config, label: str, length: int) -> int:
    """Compiled temp bytes of one column's value-and-gradient at S=length (compiled, not run)."""
    loss, params = column_loss(model, config.model, label)
    tokens = _tokens(config.model, config.batch, length)
    return _compile_temp(loss, params, tokens)


def _temps(
    model: Model,
    config: Config,
    result: Result,
    plan: dict[str, tuple[int, ...]] | None = None,
) -> None:
    """Each column's temp at ``config.lengths`` (``plan``: column -> its lengths instead)."""
    for label in COLUMNS:
        temps = result.temps.setdefault(label, {})
        lengths = config.lengths if plan is None else plan[label]
        for length in lengths:
            try:
                temps[length] = measure_temp(model, config, label, length)
            except Exception as e:  # noqa: BLE001 - a failing column is reported, not fatal.
                result.errors[label] = _error_text(e)
                for n in lengths:
                    temps.setdefault(n, None)
                break
    result.fit_budget = result.temp(STOCK, config.fit_budget_length)


def _fit(model: Model, config: Config, result: Result) -> None:
    """jaxmem's temp at the lengths past the table's, while it fits the budget."""
    length = max(config.lengths) * 2
    if result.errors.get(JAXMEM) or result.fit_budget is None:
        return
    if result.longest_fit(JAXMEM, config.fit_budget_length) != max(config.lengths):
        return  # already too big within the table
    while length <= config.fit_max_length:
        try:
            t = measure_temp(model, config, JAXMEM, length)
        except Exception as e:  # noqa: BLE001
            result.errors[JAXMEM] = _error_text(e)
            return
        result.temps[JAXMEM][length] = t
        if t > result.fit_budget:
            return
        length *= 2


def _runnable(model: Model, config: Config, label: str, length: int) -> Callable:
    loss, params = column_loss(model, config.model, label)
    lowered = jax.jit(jax.value_and_grad(loss)).lower(
        params, _tokens(config.model, config.batch, length)
    )
    return lowered.compile(FAST_COMPILE if config.quick else None)


def grad_error(got: Any, want: Any) -> float:
    """``max |got - want| / max |want|``, each maximum over every leaf."""
    pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs)
    scale = max(float(np.max(np.abs(np.asarray(b)))) for _, b in pairs)
    return diff / (scale or 1.0)


def _time_and_grads(model: Model, config: Config, result: Result) -> None:
    """The timed step at ``time_length`` and the gradients at ``grad_length``: jaxmem against
    stock (no remat), on the same seeded parameters and tokens."""
    if result.errors.get(JAXMEM) or result.errors.get(STOCK):
        failed = JAXMEM if result.errors.get(JAXMEM) else STOCK
        result.skipped = f"{failed} n/a ({result.errors[failed].split(':')[0]})"
        return
    params = model.params(config.model)
    cfg, batch = config.model, config.batch
    compiled: dict[tuple[str, int], Callable] = {}  # one compile where the lengths are one

    def runnable(label: str, length: int) -> Callable:
        if (label, length) not in compiled:
            compiled[label, length] = _runnable(model, config, label, length)
        return compiled[label, length]

    tokens = _tokens(cfg, batch, config.grad_length, concrete=True)
    (v_stock, g_stock), (v_ours, g_ours) = (
        runnable(label, config.grad_length)(params, tokens) for label in (STOCK, JAXMEM)
    )
    result.grad_err = grad_error(g_ours, g_stock)
    result.value_err = abs(float(v_ours) - float(v_stock)) / abs(float(v_stock))
    tokens = _tokens(cfg, batch, config.time_length, concrete=True)
    fns = {label: runnable(label, config.time_length) for label in (STOCK, JAXMEM)}
    times, result.time = paired_time(fns, (params, tokens), config.repeats)
    result.time |= {
        "length": config.time_length,
        "grad_err": grad_error(times[JAXMEM].output, times[STOCK].output),
    }


def paired_time(
    fns: dict[str, Callable], args: tuple, repeats: int
) -> tuple[dict[str, harness.Timing], dict[str, Any]]:
    """``fns`` (``stock`` and ``jaxmem``) timed in interleaved rounds on ``args``: the timings,
    and ``repeats``, both medians, ``ratio`` (jaxmem over stock: the median of the per-round
    ratios) and ``samples_s``."""
    times = harness.time_interleaved(fns, *args, repeats=repeats)
    pairs = zip(times[JAXMEM].samples_s, times[STOCK].samples_s, strict=True)
    return times, {
        "repeats": repeats,
        "stock_median_s": times[STOCK].median_s,
        "jaxmem_median_s": times[JAXMEM].median_s,
        "ratio": statistics.median(a / b for a, b in pairs),
        "samples_s": {label: list(t.samples_s) for label, t in times.items()},
    }


def measure(model: Model, config: Config, *, timed: bool = True) -> Result:
    """Every figure of one model: the temp table, the longest fitting S, and (``timed``) the
    step time and the gradient comparison."""
    result = Result(model.name, {}, {})
    _temps(model, config, result)
    _fit(model, config, result)
    if timed:
        _time_and_grads(model, config, result)
    return result


# ----------------------------------------------------------------------------------------------
# Criteria.


def _bound(name: str, value: float | None, bound: float, missing: str, digits: int) -> Check:
    if value is None:
        return Check(name, FAIL, missing)
    shown = f"{value:.{digits}e}" if value and abs(value) < 1e-3 else f"{value:.{digits}f}"
    return Check(name, PASS if value <= bound else FAIL, f"{shown} (bound {bound:g})")


def check(result: Result, config: Config) -> list[Check]:
    """The issue's criteria on one model's figures (a figure that was not measured FAILs)."""
    short, long = config.growth
    error = result.errors.get(JAXMEM)
    missing = f"{JAXMEM} n/a ({error.split(':')[0]})" if error else result.skipped or "n/a"
    fit = result.longest_fit(JAXMEM, config.fit_budget_length)
    time = None if result.time is None else result.time["ratio"]
    checks = [
        _bound(
            f"jaxmem temp({long}) / temp({short}) <= {MAX_GROWTH:g}",
            result.growth(JAXMEM, short, long),
            MAX_GROWTH,
            missing,
            2,
        ),
        _bound(
            f"jaxmem temp({long}) <= {MAX_VS_REMAT:g}x {REMAT}",
            result.ratio(JAXMEM, long, REMAT),
            MAX_VS_REMAT,
            missing,
            4,
        ),
    ]
    name = f"longest S with jaxmem temp <= stock temp({config.fit_budget_length}) >= "
    name += str(config.fit_min_length)
    if fit is None:
        checks.append(Check(name, FAIL, missing))
    else:
        verdict = PASS if fit >= config.fit_min_length else FAIL
        over = result.temp(JAXMEM, 2 * fit)
        detail = f"S={fit}" + (
            f" (S={2 * fit}: {format_mib(over)} > {format_mib(result.fit_budget)})"
            if over is not None
            else f" (longest tried: {config.fit_max_length})"
        )
        checks.append(Check(name, verdict, detail))
    checks += [
        _bound(
            f"step time at S={config.time_length}: jaxmem / stock <= {MAX_TIME_RATIO:.2f}",
            time,
            MAX_TIME_RATIO,
            missing,
            3,
        ),
        _bound(
            f"gradients at S={config.grad_length}: max|diff| / max|g| <= {MAX_GRAD_ERR:g}",
            result.grad_err,
            MAX_GRAD_ERR,
            missing,
            1,
        ),
    ]
    return checks


# ----------------------------------------------------------------------------------------------
# jaxmem.attention alone.

ATTN_MAX_ERR = 1e-5
"""Criterion: max |jaxmem - jax.nn| / max |jax.nn| of the values and of each gradient, at most."""

ATTN_MAX_TEMP_RATIO = 0.1
"""Criterion: jaxmem.attention's gradient temp over jax.nn.dot_product_attention's, at most."""


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The sizes of the attention section (``q [B, T, N, H]``, ``k, v [B, S, K, H]``, T = S).

    Attributes:
      length: T = S of the gradient temp and of the timed step.
      equal_length: T = S of the values and gradients compared.
      batch: B.
      num_heads: N.
      head_dim: H.
      gqa_kv_heads: K of the grouped-query variant.
      block: ``block_q`` = ``block_k`` of jaxmem.attention (None: its default).
      repeats: interleaved rounds of the timed step.
      quick: compile without LLVM optimization even where the functions run (tests).
    """

    length: int = 4096
    equal_length: int = 4096
    batch: int = 1
    num_heads: int = 4
    head_dim: int = 64
    gqa_kv_heads: int = 2
    block: int | None = None
    repeats: int = 11
    quick: bool = False


ATTENTION = AttentionConfig()
QUICK_ATTENTION = AttentionConfig(length=256, equal_length=256, head_dim=16, block=64, repeats=3,
                                  quick=True)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of calling the attention.

    Attributes:
      name: its label.
      is_causal: ``is_causal=True``.
      gqa: key and value with :attr:`AttentionConfig.gqa_kv_heads` heads (else N).
      mask: the boolean mask's shape in letters of ``"BNTS1"`` (random, 3 in 4 kept), or None.
      bias: the bias's shape likewise (random normal, differentiated), or None.
    """

    name: str
    is_causal: bool = False
    gqa: bool = False
    mask: str | None = None
    bias: str | None = None


VARIANTS = (
    Variant("causal", is_causal=True),
    Variant("GQA, causal", is_causal=True, gqa=True),
    Variant("bool mask [B,N,T,S]", mask="BNTS"),
    Variant("bias [1,N,T,S]", bias="1NTS"),
    Variant("causal + mask + bias [B,1,T,S]", is_causal=True, mask="B1TS", bias="B1TS"),
)
"""The variants of the issue's criterion; the timed step is the first's."""

IMPLS = (STOCK, JAXMEM)
"""The attention's two implementations: jax.nn.dot_product_attention (its XLA path) and
jaxmem.attention."""


def attention_inputs(
    variant: Variant, config: AttentionConfig, length: int, concrete: bool = False
) -> dict[str, Any]:
    """``q, k, v, bias, mask, ct`` (the output's cotangent) of a variant at T = S = length:
    seeded arrays, or (``concrete=False``) their shapes; bias and mask None where not used."""
    b, n, h = config.batch, config.num_heads, config.head_dim
    kh = config.gqa_kv_heads if variant.gqa else n
    dims = {"B": b, "N": n, "T": length, "S": length, "1": 1}
    shapes = {
        "q": ((b, length, n, h), jnp.float32),
        "k": ((b, length, kh, h), jnp.float32),
        "v": ((b, length, kh, h), jnp.float32),
        "bias": None
        if variant.bias is None
        else (tuple(dims[c] for c in variant.bias), jnp.float32),
        "mask": None if variant.mask is None else (tuple(dims[c] for c in variant.mask), jnp.bool_),
        "ct": ((b, length, n, h), jnp.float32),
    }
    keys = dict(zip(shapes, jax.random.split(jax.random.key(2), len(shapes)), strict=True))
    out: dict[str, Any] = {}
    for name, spec in shapes.items():
        if spec is None or not concrete:
            out[name] = None if spec is None else jax.ShapeDtypeStruct(*spec)
        elif spec[1] == jnp.bool_:
            out[name] = jax.random.bernoulli(keys[name], 0.75, spec[0])
        else:
            out[name] = jax.random.normal(keys[name], spec[0], spec[1])
    return out


def attention_fn(impl: str, variant: Variant, config: AttentionConfig) -> Callable:
    """``(q, k, v, bias, mask) -> out`` of one implementation for a variant."""
    kw: dict[str, Any] = {"is_causal": variant.is_causal}
    if impl == JAXMEM and config.block is not None:
        kw |= {"block_q": config.block, "block_k": config.block}
    att = jaxmem.attention if impl == JAXMEM else jax.nn.dot_product_attention

    def f(q, k, v, bias, mask):
        return att(q, k, v, bias=bias, mask=mask, **kw)

    return f


def _vjp_fn(f: Callable, with_bias: bool) -> Callable:
    """``(q, k, v, bias, mask, ct) -> (out, grads)``: the gradients of q, k, v (and bias where
    ``with_bias``) pulled back from ``ct``."""

    def g(q, k, v, bias, mask, ct):
        if with_bias:
            out, pull = jax.vjp(lambda q, k, v, bias: f(q, k, v, bias, mask), q, k, v, bias)
        else:
            out, pull = jax.vjp(lambda q, k, v: f(q, k, v, bias, mask), q, k, v)
        return out, pull(ct)

    return g


def _grad_qkv(f: Callable) -> Callable:
    """The issue's figure: ``jax.grad`` of ``sum(f(q, k, v) * ct)`` with respect to q, k, v."""
    return jax.grad(lambda q, k, v, bias, mask, ct: jnp.sum(f(q, k, v, bias, mask) * ct), (0, 1, 2))


def _args(inputs: dict[str, Any]) -> tuple:
    return tuple(inputs[name] for name in ("q", "k", "v", "bias", "mask", "ct"))


def attention_temp(impl: str, variant: Variant, config: AttentionConfig, length: int) -> int:
    """Compiled temp bytes of ``jax.jit(jax.grad(sum(f(q, k, v) * ct)))`` (compiled, not run)."""
    lowered = jax.jit(_grad_qkv(attention_fn(impl, variant, config))).lower(
        *_args(attention_inputs(variant, config, length))
    )
    fast = jax.default_backend() == "cpu"
    compiled = lowered.compile(FAST_COMPILE) if fast else lowered.compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _compiled_vjp(impl: str, variant: Variant, config: AttentionConfig, inputs: dict) -> Any:
    fn = _vjp_fn(attention_fn(impl, variant, config), variant.bias is not None)
    return jax.jit(fn).lower(*_args(inputs)).compile(FAST_COMPILE if config.quick else None)


def _rel(got: Any, want: Any) -> float:
    scale = float(np.max(np.abs(np.asarray(want))))
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want)))) / (scale or 1.0)


@dataclasses.dataclass
class AttentionRow:
    """The figures of one variant.

    Attributes:
      variant: its label.
      value_err: max |out - out_ref| / max |out_ref| at ``equal_length`` (ref: jax.nn).
      grad_errs: argument (``q``, ``k``, ``v``, ``bias``) -> the same for its gradient.
      temps: implementation -> gradient temp bytes at ``length`` (None: not measured).
      errors: what failed, by the step it failed in.
    """

    variant: str
    value_err: float | None = None
    grad_errs: dict[str, float] = dataclasses.field(default_factory=dict)
    temps: dict[str, int | None] = dataclasses.field(default_factory=dict)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def temp_ratio(self) -> float | None:
        """jaxmem's gradient temp over jax.nn's, or None."""
        num, den = self.temps.get(JAXMEM), self.temps.get(STOCK)
        return None if num is None or not den else num / den

    @property
    def max_err(self) -> float | None:
        """The largest of the value's and the gradients' errors, or None."""
        errs = [self.value_err, *self.grad_errs.values()]
        return None if self.value_err is None else max(e for e in errs if e is not None)


@dataclasses.dataclass
class AttentionResult:
    """The attention section's figures: one row per variant and the timed step (as
    :attr:`Result.time`, of the first variant's ``(out, grads)`` at ``length``)."""

    rows: list[AttentionRow]
    time: dict[str, Any] | None = None
    time_error: str | None = None


def measure_attention(
    config: AttentionConfig, variants: Sequence[Variant] = VARIANTS
) -> AttentionResult:
    """Values, gradients and gradient temps of every variant, and the first one's step time."""
    compiled: dict[tuple[str, str, int], Any] = {}  # one compile where the lengths are one

    def vjp(impl: str, variant: Variant, length: int, inputs: dict) -> Any:
        if (impl, variant.name, length) not in compiled:
            compiled[impl, variant.name, length] = _compiled_vjp(impl, variant, config, inputs)
        return compiled[impl, variant.name, length]

    rows = []
    for variant in variants:
        row = AttentionRow(variant.name)
        rows.append(row)
        try:
            inputs = attention_inputs(variant, config, config.equal_length, concrete=True)
            (out_ref, g_ref), (out, g) = (
                vjp(impl, variant, config.equal_length, inputs)(*_args(inputs)) for impl in IMPLS
            )
            row.value_err = _rel(out, out_ref)
            names = ("q", "k", "v", "bias")[: len(g)]
            row.grad_errs = {n: _rel(a, b) for n, a, b in zip(names, g, g_ref, strict=True)}
        except Exception as e:  # noqa: BLE001 - a failing variant is reported, not fatal.
            row.errors["values"] = _error_text(e)
        for impl in IMPLS:
            try:
                row.temps[impl] = attention_temp(impl, variant, config, config.length)
            except Exception as e:  # noqa: BLE001
                row.temps[impl] = None
                row.errors[f"temp {impl}"] = _error_text(e)
    result = AttentionResult(rows)
    variant = variants[0]
    try:
        inputs = attention_inputs(variant, config, config.length, concrete=True)
        fns = {impl: vjp(impl, variant, config.length, inputs) for impl in IMPLS}
        _, time = paired_time(fns, _args(inputs), config.repeats)
    except Exception as e:  # noqa: BLE001
        result.time_error = _error_text(e)
        return result
    result.time = {"variant": variant.name, "length": config.length} | time
    return result


def check_attention(result: AttentionResult, config: AttentionConfig) -> list[Check]:
    """The issue's criteria on jaxmem.attention alone: per variant, values and gradients equal
    to jax.nn's, and the gradient temp at most 0.1x jax.nn's (a figure not measured FAILs)."""
    checks = []
    for row in result.rows:
        missing = next(iter(row.errors.values()), "n/a").split(":")[0]
        checks.append(
            _bound(
                f"{row.variant}: values and gradients at T=S={config.equal_length}, "
                f"max|diff| / max|ref| <= {ATTN_MAX_ERR:g}",
                row.max_err,
                ATTN_MAX_ERR,
                f"n/a ({missing})",
                1,
            )
        )
        checks.append(
            _bound(
                f"{row.variant}: gradient temp at T=S={config.length} <= "
                f"{ATTN_MAX_TEMP_RATIO:g}x jax.nn's",
                row.temp_ratio,
                ATTN_MAX_TEMP_RATIO,
                f"n/a ({missing})",
                4,
            )
        )
    return checks


def format_attention(result: AttentionResult, config: AttentionConfig) -> str:
    """The attention section's table, its timed step and its errors."""
    c = config
    header = ["variant", "out", "dq", "dk", "dv", "dbias", "jax.nn temp", "jaxmem temp", "ratio"]
    e = lambda x: "-" if x is None else f"{x:.1e}"
    rows = [
        [
            row.variant,
            e(row.value_err),
            *(e(row.grad_errs.get(name)) for name in ("q", "k", "v", "bias")),
            format_mib(row.temps.get(STOCK)),
            format_mib(row.temps.get(JAXMEM)),
            _x(row.temp_ratio, 4),
        ]
        for row in result.rows
    ]
    lines = [
        f"jaxmem.attention against jax.nn.dot_product_attention: B={c.batch}, N={c.num_heads}, "
        f"H={c.head_dim}, GQA K={c.gqa_kv_heads}, f32, jaxmem blocks "
        + ("default" if c.block is None else f"{c.block}x{c.block}"),
        f"out, dq, dk, dv, dbias: max|diff| / max|ref| at T=S={c.equal_length}; temp: "
        f"jax.jit(jax.grad(sum(f(q, k, v) * ct), (q, k, v))) at T=S={c.length}, compiled only",
    ]
    if c.equal_length != c.length:
        lines.append(
            f"(values and gradients compared at T=S={c.equal_length}, not {c.length}: "
            "running both at the longer length takes too long here)"
        )
    lines.append(harness.table(header, rows))
    if result.time is not None:
        t = result.time
        lines.append(
            f"step time ({t['variant']}: out and the gradients of q, k, v) at T=S={t['length']}: "
            f"jax.nn {t['stock_median_s'] * 1e3:.1f} ms, jaxmem {t['jaxmem_median_s'] * 1e3:.1f} "
            f"ms (medians); jaxmem / jax.nn x{t['ratio']:.3f} (median of {t['repeats']} paired "
            "rounds; reported, no criterion)"
        )
    if result.time_error:
        lines.append(f"step time not measured: {result.time_error}")
    errors = [(row.variant, k, v) for row in result.rows for k, v in row.errors.items()]
    if errors:
        lines += ["errors:"] + [f"  {name} ({step}): {msg}" for name, step, msg in errors]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The shape spread (--spread).


@dataclasses.dataclass(frozen=True)
class Shape:
    """One shape of the spread.

    Attributes:
      label: how it differs from the default model.
      model: a key of :data:`MODELS`.
      config: its run's configuration (the model's sizes, B, the lengths).
      timed: also the step time at ``time_length`` and the gradients at ``grad_length``.
    """

    label: str
    model: str
    config: Config
    timed: bool = False


def spread_shapes(base: Config, quick: bool = False) -> tuple[Shape, ...]:
    """The spread's shapes around ``base``: B=4, D=512 with 8 heads, GQA (K=2 of N=4), 4
    layers, V=32000, bf16, each on the plain model, and three on the NNX one; B=4 and D=512
    timed (``quick``: B=2, on each model, the plain one timed)."""
    short, long = base.growth
    lengths = (short, 2 * short, long) if long == 4 * short else (short, long)
    base = dataclasses.replace(base, lengths=lengths)
    at = lambda model, batch=1: dataclasses.replace(base, model=model, batch=batch)
    if quick:
        return (
            Shape("B=2", "plain", at(base.model, 2), timed=True),
            Shape("B=2", "nnx", at(base.model, 2)),
        )
    default = llama_long.DEFAULT
    plain = [
        Shape("default (B=1)", "plain", at(default)),
        Shape("B=4", "plain", at(default, 4), timed=True),
        Shape("D=512, 8 heads", "plain", at(LlamaConfig(d_model=512, num_heads=8)), timed=True),
        Shape("GQA N=4, K=2", "plain", at(LlamaConfig(num_kv_heads=2))),
        Shape("4 layers", "plain", at(LlamaConfig(num_layers=4))),
        Shape("V=32000", "plain", at(LlamaConfig(vocab_size=32000))),
        Shape("bf16", "plain", at(LlamaConfig(dtype=jnp.bfloat16))),
    ]
    nnx_shapes = [
        Shape("B=4", "nnx", at(default, 4)),
        Shape("D=512, 8 heads", "nnx", at(LlamaConfig(d_model=512, num_heads=8))),
        Shape("bf16", "nnx", at(LlamaConfig(dtype=jnp.bfloat16))),
    ]
    return (*plain, *nnx_shapes)


def memory_plan(config: Config) -> dict[str, tuple[int, ...]]:
    """The lengths of each column that the memory criteria read: stock at the fit budget's,
    full remat at the growth's long one, jaxmem at every length of the table."""
    return {
        STOCK: (config.fit_budget_length,),
        REMAT: (config.growth[1],),
        JAXMEM: config.lengths,
    }


def measure_shape(shape: Shape) -> Result:
    """The memory criteria's figures at one shape (compiled only), and the step time and the
    gradients where the shape is timed."""
    model = MODELS[shape.model]
    result = Result(f"{model.name}, {shape.label}", {}, {})
    _temps(model, shape.config, result, memory_plan(shape.config))
    _fit(model, shape.config, result)
    if shape.timed:
        _time_and_grads(model, shape.config, result)
    return result


def check_shape(result: Result, shape: Shape) -> list[Check]:
    """The issue's criteria at one shape: the three memory ones, and where timed the step time
    and the gradients."""
    checks = check(result, shape.config)
    return checks if shape.timed else checks[:3]


def format_spread(
    shapes: Sequence[Shape], results: Sequence[Result], checks: Sequence[list[Check]]
) -> str:
    """One row per shape: the memory figures, the timed step where measured, and the verdict."""
    short, long = shapes[0].config.growth
    budget = shapes[0].config.fit_budget_length
    header = [
        "model",
        "shape",
        f"stock({budget})",
        f"jaxmem({long})",
        f"growth {long}/{short}",
        f"vs remat({long})",
        "longest fit S",
        f"time({shapes[0].config.time_length})",
        "grad err",
        "verdict",
    ]
    rows = []
    for shape, result, cs in zip(shapes, results, checks, strict=True):
        failed = [i for i, c in enumerate(cs) if c.verdict == FAIL]
        names = ("growth", "vs remat", "fit", "time", "grads")
        rows.append(
            [
                shape.model,
                f"{shape.label}",
                format_mib(result.fit_budget),
                format_mib(result.temp(JAXMEM, long)),
                _x(result.growth(JAXMEM, short, long), 2),
                _x(result.ratio(JAXMEM, long, REMAT), 4),
                str(result.longest_fit(JAXMEM, budget) or "-"),
                "-" if result.time is None else _x(result.time["ratio"], 3),
                "-" if result.grad_err is None else f"{result.grad_err:.1e}",
                PASS if not failed else FAIL + " (" + ", ".join(names[i] for i in failed) + ")",
            ]
        )
    c = shapes[0].config
    lines = [
        f"shape spread: bars growth <= {MAX_GROWTH:g}, vs remat <= {MAX_VS_REMAT:g}, longest S "
        f"with jaxmem temp <= stock temp({budget}) >= {c.fit_min_length} (tried up to "
        f"{c.fit_max_length}); timed rows: step time at S={c.time_length} <= "
        f"{MAX_TIME_RATIO:.2f} (median of {c.repeats} paired rounds), gradients at "
        f"S={c.grad_length} <= {MAX_GRAD_ERR:g}",
        harness.table(header, rows),
    ]
    for shape, result, cs in zip(shapes, results, checks, strict=True):
        bad = [c for c in cs if c.verdict == FAIL]
        if bad or result.errors:
            lines.append(f"{shape.model}, {shape.label}:")
            lines += [f"  FAIL {c.name}: {c.detail}" for c in bad]
            lines += [f"  error ({label}): {e}" for label, e in result.errors.items()]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Output.


def _x(r: float | None, digits: int = 3) -> str:
    return "-" if r is None else f"x{r:.{digits}f}"


def _cell(result: Result, label: str, length: int) -> str:
    t = result.temp(label, length)
    if t is None and label in result.errors:
        return f"n/a ({result.errors[label].split(':')[0]})"
    return format_mib(t)


def format_result(result: Result, config: Config) -> str:
    """The temp table of one model, its summary figures and its errors."""
    lengths = sorted({n for temps in result.temps.values() for n in temps})
    header = ["S", *COLUMNS, "jaxmem/stock", "jaxmem/remat"]
    rows = [
        [
            str(n),
            *(_cell(result, label, n) for label in COLUMNS),
            _x(result.ratio(JAXMEM, n, STOCK), 4),
            _x(result.ratio(JAXMEM, n, REMAT), 4),
        ]
        for n in lengths
    ]
    short, long = config.growth
    budget = config.fit_budget_length
    summary = [
        [f"growth temp({long}) / temp({short})"]
        + [_x(result.growth(label, short, long), 2) for label in COLUMNS],
        [f"longest S within stock temp({budget}) = {format_mib(result.fit_budget)}"]
        + [str(result.longest_fit(label, budget) or "-") for label in COLUMNS],
    ]
    lines = [
        f"{result.model}: temp of jax.jit(jax.value_and_grad(loss)), B={config.batch}",
        harness.table(header, rows),
        "",
        harness.table(["", *COLUMNS], summary),
    ]
    if result.time is not None:
        t = result.time
        lines.append(
            f"step time at S={t['length']}: stock {t['stock_median_s'] * 1e3:.1f} ms, jaxmem "
            f"{t['jaxmem_median_s'] * 1e3:.1f} ms (medians); jaxmem / stock x{t['ratio']:.3f} "
            f"(median of {t['repeats']} paired rounds)"
        )
    if result.grad_err is not None:
        lines.append(
            f"gradients at S={config.grad_length}: max|diff| / max|g| {result.grad_err:.1e}, "
            f"loss rel. diff {result.value_err:.1e}"
        )
    if result.skipped:
        lines.append(f"time and gradients not measured: {result.skipped}")
    if result.errors:
        lines += ["errors:"] + [f"  {label}: {e}" for label, e in result.errors.items()]
    return "\n".join(lines)


def plot(results: Sequence[Result], config: Config, path: pathlib.Path) -> bool:
    """Temp against S, one panel per model, to ``path``; False where matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError:
        return False
    fig = Figure(figsize=(6 * len(results), 4.5), dpi=110)
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    for ax, result in zip(axes, results, strict=True):
        for label in COLUMNS:
            points = sorted((n, t) for n, t in result.temps.get(label, {}).items() if t)
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, [y / harness.MIB for y in ys], marker="o", label=label)
        if result.fit_budget:
            ax.axhline(result.fit_budget / harness.MIB, color="gray", ls=":", lw=0.8,
                       label=f"stock temp at S={config.fit_budget_length}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S (B=1)")
        ax.set_ylabel("gradient temp (MiB)")
        ax.set_title(result.model, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"value_and_grad temp vs length, jax {jax.__version__} ({jax.default_backend()})")
    fig.tight_layout()
    fig.savefig(path)
    return True


def _result_dict(result: Result, checks: list[Check]) -> dict:
    d = dataclasses.asdict(result)
    d["temps"] = {label: {str(n): t for n, t in ts.items()} for label, ts in result.temps.items()}
    d["checks"] = [dataclasses.asdict(c) for c in checks]
    return d


def to_dict(
    results: Sequence[Result],
    checks: dict[str, list[Check]],
    config: Config,
    *,
    attention: tuple[AttentionResult, list[Check], AttentionConfig] | None = None,
    spread: tuple[Sequence[Shape], Sequence[Result], Sequence[list[Check]]] | None = None,
) -> dict:
    """Every figure of a run, JSON-ready, with the run's environment and configuration (the
    attention section and the spread where they ran)."""
    out: dict[str, Any] = {**harness.environment(), "benchmark": "long_context"}
    out["jax_softmax_custom_jvp"] = bool(jax.config.jax_softmax_custom_jvp)
    out["chunk_tokens_available"] = chunk_tokens_available()
    out["config"] = dataclasses.asdict(config) | {"model": str(config.model)}
    out["models"] = {r.model: _result_dict(r, checks[r.model]) for r in results}
    every = list(checks.values())
    if attention is not None:
        result, attention_checks, attention_config = attention
        out["attention"] = {
            "config": dataclasses.asdict(attention_config),
            "rows": [dataclasses.asdict(row) for row in result.rows],
            "time": result.time,
            "time_error": result.time_error,
            "checks": [dataclasses.asdict(c) for c in attention_checks],
        }
        every.append(attention_checks)
    if spread is not None:
        out["spread"] = [
            {
                "model": shape.model,
                "shape": shape.label,
                "config": dataclasses.asdict(shape.config) | {"model": str(shape.config.model)},
                "timed": shape.timed,
                **_result_dict(result, cs),
            }
            for shape, result, cs in zip(*spread, strict=True)
        ]
        every += list(spread[2])
    out["passed"] = all(passed(c) for c in every)
    return out


# ----------------------------------------------------------------------------------------------
# Command line.


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints its tables and the criteria.

    Returns:
      The exit status: 0, or 1 if a criterion fails.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_context", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write every figure")
    parser.add_argument("--plot", type=pathlib.Path, metavar="PATH", help="temp vs S, to a file")
    parser.add_argument("--model", choices=sorted(MODELS), action="append", help="default both")
    parser.add_argument("--repeats", type=int, help="paired rounds of the timed steps (>= 11)")
    parser.add_argument(
        "--attention", action="store_true", help="the attention section alone (no models)"
    )
    parser.add_argument(
        "--spread", action="store_true", help="the shape spread alone (with --attention: both)"
    )
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    attention_config = QUICK_ATTENTION if args.quick else ATTENTION
    if args.repeats is not None:
        if args.repeats < 11 and not args.quick:
            parser.error("--repeats must be >= 11")
        config = dataclasses.replace(config, repeats=args.repeats)
        attention_config = dataclasses.replace(attention_config, repeats=args.repeats)
    run_models = not (args.attention or args.spread)
    env = harness.environment()
    print(
        f"jax {env['jax_version']} (jax_softmax_custom_jvp={jax.config.jax_softmax_custom_jvp}) "
        f"| backend {env['backend']} ({env['device_kind']}) | {env['date']}\n"
        f"model: {config.model}\n"
        f"jaxmem column: jaxmem.optimize(loss, chunk_tokens=True)"
        + ("" if chunk_tokens_available() else " (not in the installed jaxmem)"),
        flush=True,
    )
    results, checks = [], {}
    for key in (args.model or sorted(MODELS, reverse=True)) if run_models else ():
        result = measure(MODELS[key], config)
        checks[result.model] = check(result, config)
        results.append(result)
        print()
        print(format_result(result, config))
        print(format_checks(checks[result.model]), flush=True)
    attention = spread = None
    if run_models or args.attention:
        attention_result = measure_attention(attention_config, VARIANTS)
        attention = (attention_result, check_attention(attention_result, attention_config))
        attention += (attention_config,)
        print()
        print(format_attention(attention_result, attention_config))
        print(format_checks(attention[1]), flush=True)
    if args.spread:
        shapes = spread_shapes(config, quick=args.quick)
        shapes = tuple(s for s in shapes if s.model in (args.model or MODELS))
        spread_results, spread_checks = [], []
        for shape in shapes:
            spread_results.append(measure_shape(shape))
            spread_checks.append(check_shape(spread_results[-1], shape))
            print(f"measured {shape.model}, {shape.label}", flush=True)
        spread = (shapes, spread_results, spread_checks)
        print()
        print(format_spread(*spread))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = to_dict(results, checks, config, attention=attention, spread=spread)
        args.json.write_text(json.dumps(data, indent=2, default=harness.json_default) + "\n")
        print(f"wrote {args.json}")
    if args.plot and results:
        print(f"wrote {args.plot}" if plot(results, config, args.plot) else "no matplotlib")
    every = (
        [*checks.values()]
        + ([attention[1]] if attention else [])
        + list(spread[2] if spread else [])
    )
    return 0 if all(passed(c) for c in every) else 1


if __name__ == "__main__":
    sys.exit(main())
