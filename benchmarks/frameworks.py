"""Frameworks benchmark: ``jaxmem.optimize`` on models built with Levanter, MaxText and Penzai.

Each framework's own model at a tiny f32 configuration (4 layers, width 256, MLP 1024, 4 heads
of 64, vocabulary 1024, batch 4, sequence 128; ``--quick``: 2 layers, width 32), its layers
stacked with ``lax.scan`` the way the framework does it, its loss written the way its users write
it, with its defaults. Rows, as in :mod:`benchmarks.peers`: *stock* is the framework's training
gradient, ``jax.value_and_grad`` of the loss (Levanter: ``eqx.filter_value_and_grad``, as its
trainer does); *jaxmem* is the same with the loss wrapped in ``jaxmem.optimize`` before it is
differentiated. Both jitted and compiled once, then timed interleaved
(:func:`benchmarks.harness.time_interleaved`); ``grad err`` as in :mod:`benchmarks.peers`.

Cases:

1. ``maxtext <remat_policy>``: MaxText's ``llama2-7b`` decoder (NNX ``models.Transformer`` from
   ``model_creation_utils.from_config``, ``pyconfig`` of its ``base.yml``) shrunk with
   ``override_model_config``, ``scan_layers=True``, ``attention=dot_product``, f32, the loss of
   its pre-training loop (``maxtext.trainers.pre_train.train.loss_fn`` inside the
   ``diff_wrapper`` of its ``train_step``), gradient w.r.t. the ``nnx.Param`` state. MaxText
   wraps every scanned layer in ``jax.checkpoint`` (``remat_policy="none"`` still does), so
   every row has remat: one case per policy it offers that runs on one CPU (``full``, its
   default, first); ``custom`` with every named tensor on device is the closest it has to none.
2. ``levanter <model> gc=<bool>``: Levanter's ``LlamaLMHeadModel`` and ``Gpt2LMHeadModel``
   (``scan_layers=True``, its default), ``gradient_checkpointing=True`` (its default, full remat
   per layer) and ``False``, the loss of its ``train_lm``
   (``model.compute_next_token_loss(example)``, fused next-token loss) on
   ``LmExample.causal`` examples vmapped over a batch axis, gradient w.r.t. the model's arrays.
3. ``penzai <remat>``: Penzai's llama-like transformer (``build_llamalike_transformer``,
   ``use_layer_stack=True``: a ``pz.nn.LayerStack`` run by ``lax.scan``), no remat and with every
   ``TransformerBlock`` wrapped in ``gradient_checkpointing.Checkpointed``; loss the named-axis
   next-token cross-entropy of its tutorials (``pz.nx.nmap(optax.softmax_cross_entropy_with_
   integer_labels)``), gradient w.r.t. the parameters (``pz.unbind_params``, frozen).

Each framework pins its own JAX (Levanter jax 0.11.2), so each has a venv of its own:
``make bench-frameworks`` creates ``.venv-maxtext``, ``.venv-levanter`` and ``.venv-penzai`` and
runs this module in each. A framework that is not installed is skipped with a line saying so;
:mod:`benchmarks.peers` gains these cases where the framework imports.

Beyond the peers table: ``peak`` (``temp + arguments + outputs - aliased`` of the compiled
``memory_analysis()``), and what ``jaxmem.optimize(loss).explain(...)`` claims (the bytes the
scans' gradients keep, ``lax.scan``'s and jaxmem's, summed over the scans) against the compiled
temp saving.

``--budget``: the budget study instead (compiled figures only, nothing timed), as
:mod:`benchmarks.budget` for the plain-JAX GPT: the framework's *train step* written the way its
users write it (Levanter's Llama: ``eqx.filter_value_and_grad`` of its loss, as its trainer;
MaxText's llama2: ``jax.value_and_grad`` w.r.t. ``nnx.Param``), then an SGD-momentum update,
one jitted step ``(params, momentum, ...) -> (loss, params, momentum)``. Each of the framework's
own remat choices (Levanter: each of :data:`LEVANTER_GC`, True its default; MaxText: each of
:data:`MAXTEXT_POLICIES`, ``full`` its default) compiled: peak and FLOPs
(:func:`benchmarks.budget.compiled_figures`). Then ``jaxmem.optimize(default step, budget=B)``
at four budgets from the leanest own choice's peak to the largest own peak: the setting chosen,
the peak of ``jax.jit`` of it compiled in full (a failure where above ``B``), its FLOPs over the
fewest FLOPs among the own choices that fit ``B``, the planning time (``budget_plan``; cold,
jaxmem's cache of measured settings emptied, and a second plan's, a cache hit), and the
largest output error against the default step (:func:`benchmarks.budget.largest_error`; a
failure above 1e-5). ``jaxmem.optimize(default step)`` without a budget: its compiled temp
against the same step written around ``jaxmem.optimize(loss)`` (a failure above 1.02x + 16
KiB) and its outputs' error. Unless ``--no-time``: ``objective="time"`` at twice the default's peak,
its step time against the fastest own choice that fits (``--repeats`` paired rounds, 21 by
default).

Usage: ``python -m benchmarks.frameworks [--quick] [--no-time] [--repeats N] [--json PATH]
[--budget]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import pathlib
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import jaxmem
from benchmarks import harness, peers
from benchmarks.harness import format_mib
from benchmarks.peers import JAXMEM, STOCK, Case, Impl

FRAMEWORKS = {"maxtext": "maxtext", "levanter": "marin-levanter", "penzai": "penzai"}
"""Import name -> distribution (``make bench-frameworks`` installs each in a venv of its own)."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A tiny decoder: layers, width, MLP width, heads x head width, vocabulary, batch, sequence."""

    layers: int
    emb: int
    mlp: int
    heads: int
    head_dim: int
    vocab: int
    batch: int
    seq: int

    def __str__(self) -> str:
        return (
            f"L={self.layers} emb={self.emb} mlp={self.mlp} heads={self.heads}x{self.head_dim} "
            f"V={self.vocab} B={self.batch} S={self.seq}"
        )


FULL = Sizes(layers=4, emb=256, mlp=1024, heads=4, head_dim=64, vocab=1024, batch=4, seq=128)
QUICK = Sizes(layers=2, emb=32, mlp=64, heads=2, head_dim=16, vocab=128, batch=2, seq=16)

MAXTEXT_POLICIES = (
    "full",  # MaxText's default
    "none",  # the scanned layer still runs under jax.checkpoint
    "minimal",
    "minimal_with_context",
    "save_dot_with_context_except_mlp",
    "save_dot_except_mlpwi",
    "save_dot_except_mlp",
    "save_qkv_proj",
    "save_out_proj",
    "custom",  # every named tensor on device
)
"""MaxText's ``remat_policy`` values that run on one CPU (the ``*_offloaded`` ones move
tensors to ``pinned_host``)."""

MAXTEXT_NAMED_TENSORS = (
    "context",
    "mlpwi",
    "mlpwi_0",
    "mlpwi_1",
    "mlpwo",
    "query_proj",
    "key_proj",
    "value_proj",
    "qkv_proj",
    "out_proj",
)
"""The tensors ``remat_policy=custom`` is told to keep on device (its ``base.yml`` names)."""


@dataclasses.dataclass(frozen=True)
class FrameworkCase:
    """A :class:`benchmarks.peers.Case` and what ``jaxmem.optimize(loss).explain`` says of it.

    Attributes:
      case: the rows (stock, jaxmem) and their arguments.
      explain: returns the :class:`jaxmem.Explanation` of the case's loss (None: skipped).
      context: a context manager the case is measured in (MaxText's mesh), or None.
    """

    case: Case
    explain: Callable[[], Any] | None = None
    context: Callable[[], Any] | None = None


def installed() -> dict[str, bool]:
    """Import name -> whether the framework is installed."""
    return {m: importlib.util.find_spec(m) is not None for m in FRAMEWORKS}


def status_line() -> str:
    """One line: each framework's version, or that it is not installed (its rows skipped)."""
    parts = []
    for dist in FRAMEWORKS.values():
        version = peers._version(dist)
        if version is None:
            parts.append(f"{dist} not installed (rows skipped; make bench-frameworks)")
        else:
            parts.append(f"{dist} {version}")
    return "frameworks: " + ", ".join(parts)


def _grad_rows(loss: Callable, grad: Callable = jax.value_and_grad) -> tuple[Impl, Impl]:
    """The stock and jaxmem rows of a loss of the case's arguments."""
    return (
        Impl(f"{grad.__module__.split('.')[0]}.{grad.__name__}(loss)", STOCK, grad(loss)),
        Impl("jaxmem.optimize(loss)", JAXMEM, grad(jaxmem.optimize(loss))),
    )


# ----------------------------------------------------------------------------------------------
# MaxText.


def _maxtext_parts(s: Sizes, policy: str, compile_cache: bool = True):
    """MaxText's llama2 decoder at ``remat_policy=policy``: ``(loss, (params, rest, data), mesh,
    description)``, ``loss(params, rest, data)`` its pre-training loss (case 1).
    ``compile_cache=False``: without the persistent compilation cache its ``base.yml`` turns on
    (``jax_cache_dir: ~/jax_cache``), for the planning times of ``--budget``."""
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # no Google Cloud dependencies
    import maxtext.configs  # noqa: PLC0415 - optional
    from flax import nnx  # noqa: PLC0415
    from maxtext.configs import pyconfig  # noqa: PLC0415
    from maxtext.trainers.pre_train import train  # noqa: PLC0415
    from maxtext.utils import maxtext_utils, model_creation_utils  # noqa: PLC0415

    base = os.path.join(os.path.dirname(maxtext.configs.__file__), "base.yml")
    argv = [
        "maxtext",
        base,
        "model_name=llama2-7b",
        "override_model_config=True",
        f"base_num_decoder_layers={s.layers}",
        f"base_emb_dim={s.emb}",
        f"base_mlp_dim={s.mlp}",
        f"base_num_query_heads={s.heads}",
        f"base_num_kv_heads={s.heads}",
        f"head_dim={s.head_dim}",
        f"vocab_size={s.vocab}",
        f"max_target_length={s.seq}",
        f"per_device_batch_size={s.batch}",
        "scan_layers=True",
        "dtype=float32",
        "weight_dtype=float32",
        "attention=dot_product",
        f"remat_policy={policy}",
        "enable_checkpointing=False",
        "skip_jax_distributed_system=True",
        "dataset_type=synthetic",
        "run_name=jaxmem-bench",
        "base_output_directory=/tmp/jaxmem-bench-maxtext",
    ]
    if policy == "custom":
        argv += [f"{name}=device" for name in MAXTEXT_NAMED_TENSORS]
    if not compile_cache:
        argv.append("jax_cache_dir=")
    config = pyconfig.initialize(argv)
    mesh = maxtext_utils.get_mesh_from_config(config)
    model = model_creation_utils.from_config(
        config, mesh=mesh, rngs=nnx.Rngs(params=0, dropout=1, aqt=2)
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    b, t = s.batch, s.seq
    tokens = jax.random.randint(jax.random.key(1), (b, t + 1), 0, s.vocab)
    ones = jnp.ones((b, t), jnp.int32)
    data = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "inputs_position": jnp.broadcast_to(jnp.arange(t), (b, t)),
        "inputs_segmentation": ones,
        "targets_segmentation": ones,
    }

    def loss(params, rest, data, graphdef=graphdef, config=config):
        """train_step's diff_wrapper: the model merged from its state, then loss_fn."""
        model = nnx.merge(graphdef, params, rest, copy=True)
        value, _aux = train.loss_fn(model, config, dict(data), None, None, is_train=True)
        return value

    custom = " (every named tensor on device)" if policy == "custom" else ""
    description = f"MaxText llama2 decoder (NNX), {s}, scan_layers, f32, remat_policy={policy}"
    return loss, (params, rest, data), mesh, description + custom


def maxtext_cases(s: Sizes, repeats: int) -> list[FrameworkCase]:
    """MaxText's llama2 decoder, one case per remat policy (case 1)."""
    out = []
    for policy in MAXTEXT_POLICIES:
        loss, args, mesh, description = _maxtext_parts(s, policy)
        description += "; train loss_fn, grad w.r.t. nnx.Param"
        out.append(
            FrameworkCase(
                Case(f"maxtext {policy}", description, _grad_rows(loss), args, repeats),
                lambda loss=loss, args=args: jaxmem.optimize(loss).explain(*args),
                lambda mesh=mesh: jax.set_mesh(mesh),
            )
        )
    return out


# ----------------------------------------------------------------------------------------------
# Levanter.


@dataclasses.dataclass(frozen=True)
class LevanterParts:
    """A Levanter LM at one setting: its arrays and the rest (``eqx.partition``), a batch of
    token ids, the batch axis, the loss of its ``train_lm`` and the model's config."""

    params: Any
    static: Any
    tokens: Any
    batch: Any
    loss: Callable
    config: Any


def _levanter_parts(s: Sizes, kind: str, gc: Any) -> LevanterParts:
    """Levanter's ``kind`` (``"llama"``, ``"gpt2"``) LMHeadModel, ``gradient_checkpointing=gc``."""
    import equinox as eqx  # noqa: PLC0415 - optional, Levanter's
    import haliax as hax  # noqa: PLC0415
    from levanter.models.gpt2 import Gpt2Config, Gpt2LMHeadModel  # noqa: PLC0415
    from levanter.models.llama import LlamaConfig, LlamaLMHeadModel  # noqa: PLC0415

    vocab, batch = hax.Axis("vocab", s.vocab), hax.Axis("batch", s.batch)
    shared = dict(
        max_seq_len=s.seq,
        hidden_dim=s.emb,
        num_layers=s.layers,
        num_heads=s.heads,
        gradient_checkpointing=gc,
    )
    if kind == "llama":
        llama = dict(intermediate_dim=s.mlp, num_kv_heads=s.heads, head_dim=s.head_dim)
        config, lm = LlamaConfig(**shared, **llama), LlamaLMHeadModel
    else:
        config, lm = Gpt2Config(**shared), Gpt2LMHeadModel
    model = lm.init(vocab, config, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    tokens = hax.random.randint(jax.random.key(1), (batch, config.max_Pos), 0, s.vocab)

    def loss_function(model, example, *, key=None):
        """train_lm's loss (the trainer's loss_fn returns it as a scalar)."""
        return model.compute_next_token_loss(example, key=key).scalar()

    return LevanterParts(params, static, tokens, batch, loss_function, config)


def levanter_cases(s: Sizes, repeats: int) -> list[FrameworkCase]:
    """Levanter's Llama and GPT-2, gradient checkpointing on (default) and off (case 2)."""
    import equinox as eqx  # noqa: PLC0415 - optional, Levanter's
    import haliax as hax  # noqa: PLC0415
    from levanter.models.lm_model import LmExample  # noqa: PLC0415

    out = []
    for kind in ("llama", "gpt2"):
        for gc in (True, False):
            parts = _levanter_parts(s, kind, gc)
            params, static, tokens, batch = parts.params, parts.static, parts.tokens, parts.batch
            loss_function = parts.loss

            def step(loss, static=static, batch=batch):
                def value_and_grad(arrays, token_ids):
                    model = eqx.combine(arrays, static)
                    example = hax.vmap(LmExample.causal, batch)(token_ids)
                    return eqx.filter_value_and_grad(loss)(model, example)

                return value_and_grad

            def explain(
                params=params, static=static, tokens=tokens, loss=loss_function, batch=batch
            ):
                example = hax.vmap(LmExample.causal, batch)(tokens)
                return jaxmem.optimize(loss).explain(eqx.combine(params, static), example)

            mlp = f"mlp={s.mlp}" if kind == "llama" else "mlp=4x"
            description = (
                f"Levanter {kind} LMHeadModel, L={s.layers} emb={s.emb} {mlp} heads={s.heads}, "
                f"V={s.vocab} B={s.batch} S={s.seq}, scan_layers, f32, "
                f"gradient_checkpointing={gc}; compute_next_token_loss, grad w.r.t. the arrays"
            )
            impls = (
                Impl("eqx.filter_value_and_grad(loss)", STOCK, step(loss_function)),
                Impl("jaxmem.optimize(loss)", JAXMEM, step(jaxmem.optimize(loss_function))),
            )
            name = f"levanter {kind} gc={gc}"
            out.append(
                FrameworkCase(Case(name, description, impls, (params, tokens), repeats), explain)
            )
    return out


# ----------------------------------------------------------------------------------------------
# Penzai.


def penzai_cases(s: Sizes, repeats: int) -> list[FrameworkCase]:
    """Penzai's llama-like transformer in a LayerStack, no remat and Checkpointed (case 3)."""
    import optax  # noqa: PLC0415 - Penzai's dependency
    from penzai import pz  # noqa: PLC0415 - optional
    from penzai.models.transformer import model_parts  # noqa: PLC0415
    from penzai.models.transformer.variants import llamalike_common  # noqa: PLC0415
    from penzai.toolshed import gradient_checkpointing  # noqa: PLC0415

    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=s.heads,
        query_head_multiplier=1,
        embedding_dim=s.emb,
        projection_dim=s.head_dim,
        mlp_hidden_dim=s.mlp,
        num_decoder_blocks=s.layers,
        vocab_size=s.vocab,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
        use_layer_stack=True,
    )
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))
    checkpointed = (
        pz.select(model)
        .at_instances_of(model_parts.TransformerBlock)
        .apply(gradient_checkpointing.Checkpointed)
    )
    raw = jax.random.randint(jax.random.key(1), (s.batch, s.seq), 0, s.vocab)
    tokens = pz.nx.wrap(raw).tag("batch", "seq")
    out = []
    for remat, m in (("no remat", model), ("Checkpointed blocks", checkpointed)):
        unbound, params = pz.unbind_params(m)
        params = pz.freeze_params(params)

        def loss(params, tokens, unbound=unbound):
            logits = pz.bind_variables(unbound, params)(tokens)
            losses = pz.nx.nmap(optax.softmax_cross_entropy_with_integer_labels)(
                logits[{"seq": pz.slice[:-1]}].untag("vocabulary"),
                tokens[{"seq": pz.slice[1:]}],
            )
            return losses.untag("batch", "seq").unwrap().mean()

        description = (
            f"Penzai llamalike transformer (swiglu), {s}, use_layer_stack, f32, {remat}; "
            "next-token cross-entropy, grad w.r.t. the parameters"
        )
        args = (params, tokens)
        out.append(
            FrameworkCase(
                Case(f"penzai {remat}", description, _grad_rows(loss), args, repeats),
                lambda loss=loss, args=args: jaxmem.optimize(loss).explain(*args),
            )
        )
    return out


BUILDERS = {"maxtext": maxtext_cases, "levanter": levanter_cases, "penzai": penzai_cases}


def framework_cases(quick: bool = False, repeats: int = harness.MIN_REPEATS) -> list[FrameworkCase]:
    """The cases of every installed framework (none of the others)."""
    s = QUICK if quick else FULL
    return [c for m, ok in installed().items() if ok for c in BUILDERS[m](s, repeats)]


def cases(quick: bool = False, repeats: int = harness.MIN_REPEATS) -> list[Case]:
    """The :mod:`benchmarks.peers` cases of every installed framework."""
    return [c.case for c in framework_cases(quick, repeats)]


# ----------------------------------------------------------------------------------------------
# Measuring.


@dataclasses.dataclass
class Claim:
    """What ``explain`` says: scans rewritten, the bytes their gradients keep (each loop compiled
    alone), and what the loss's gradient saves by them (each compiled in the loss), summed."""

    scans: int = 0
    rewritten: int = 0
    stock_kept_bytes: int | None = None
    kept_bytes: int | None = None
    saved_bytes: int | None = None
    error: str | None = None

    @property
    def saving(self) -> int | None:
        """The claimed saving: in the loss where explain measured it, else the kept bytes'."""
        if self.saved_bytes is not None:
            return self.saved_bytes
        if self.kept_bytes is None:
            return None
        return self.stock_kept_bytes - self.kept_bytes


def claim(explain: Callable[[], Any]) -> Claim:
    """Runs ``explain`` and sums its scans' kept bytes (None where a scan has no figure)."""
    try:
        explanation = explain()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return Claim(error=peers._error_text(e))
    scans = [r for r in explanation.scans if r.rewritten]
    out = Claim(len(explanation.scans), len(scans))
    if scans and all(r.stock_bytes is not None and r.kept_bytes is not None for r in scans):
        out.stock_kept_bytes = sum(r.stock_bytes for r in scans)
        out.kept_bytes = sum(r.kept_bytes for r in scans)
    if scans and all(r.saved_bytes is not None for r in scans):
        out.saved_bytes = sum(r.saved_bytes for r in scans)
    return out


def measure(fc: FrameworkCase, *, timed: bool) -> tuple[peers.Result, Claim | None]:
    """The case's rows (:func:`benchmarks.peers.measure`) and what ``explain`` claims."""
    ctx = fc.context() if fc.context is not None else _null()
    with ctx:
        result = peers.measure(fc.case, timed=timed)
        return result, (claim(fc.explain) if fc.explain is not None else None)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run(quick: bool, *, timed: bool, repeats: int, progress: bool = False):
    """Builds and measures every installed framework's cases; a failing build is a failed row."""
    s = QUICK if quick else FULL
    out = []
    for module, ok in installed().items():
        if not ok:
            continue
        try:
            built = BUILDERS[module](s, repeats)
        except Exception as e:  # noqa: BLE001 - a framework that fails to build is reported
            row = peers.Row(f"{module} model", STOCK, error=peers._error_text(e))
            out.append((peers.Result(module, "building the model failed", [row], 0), None))
            continue
        for fc in built:
            if progress:
                print(f"  measuring {fc.case.name} ...", file=sys.stderr, flush=True)
            out.append(measure(fc, timed=timed))
    return out


# ----------------------------------------------------------------------------------------------
# Output.


def format_table(results: Sequence[tuple[peers.Result, Claim | None]]) -> str:
    """One line per case: stock temp and peak, jaxmem's ratios, grad err, explain's claim.

    ``claimed kept``: explain's bytes kept for the gradient by the scans (each loop compiled
    alone), ``lax.scan`` -> jaxmem; ``claimed saving``: what explain says the loss's gradient
    saves (:attr:`Claim.saving`); ``compiled saving``: the stock row's temp minus the jaxmem
    row's.
    """
    head = [
        "case",
        "stock temp",
        "peak",
        "jaxmem temp",
        "x stock",
        "peak x",
        "time x",
        "grad err",
        "claimed kept",
        "claimed saving",
        "compiled saving",
    ]
    rows, notes = [], []
    for r, c in results:
        stock, ours = r.stock, next((x for x in r.rows if x.role == JAXMEM), None)
        for row in r.rows:
            if row.error or row.skipped:
                notes.append(f"  {r.name} / {row.label}: {row.error or row.skipped}")
        if c is not None and c.error:
            notes.append(f"  {r.name} / explain: {c.error}")
        if stock is None or ours is None or stock.temp_bytes is None or ours.temp_bytes is None:
            rows.append([r.name, "error"])
            continue
        claimed = saving = "-"
        if c is not None and c.kept_bytes is not None:
            claimed = f"{format_mib(c.stock_kept_bytes)} -> {format_mib(c.kept_bytes)}"
        if c is not None and c.saving is not None:
            saving = format_mib(c.saving)
        rows.append(
            [
                r.name,
                format_mib(stock.temp_bytes),
                format_mib(stock.peak_bytes),
                format_mib(ours.temp_bytes),
                peers._x(r.temp_ratio(ours, stock)),
                peers._x(ours.peak_bytes / stock.peak_bytes if stock.peak_bytes else None),
                peers._x(r.time_ratio(ours, stock)),
                "-" if ours.grad_rel_err is None else f"{ours.grad_rel_err:.1e}",
                claimed,
                saving,
                format_mib(stock.temp_bytes - ours.temp_bytes),
            ]
        )
    lines = [harness.table(head, rows)]
    lines += ["", "cases:"] + [f"  {r.name}: {r.description}" for r, _ in results]
    if notes:
        lines += ["", "skipped or failed:", *notes]
    return "\n".join(lines)


def to_dict(results: Sequence[tuple[peers.Result, Claim | None]], quick: bool) -> dict[str, Any]:
    """Every figure, JSON-ready, with the environment and the frameworks' versions."""
    out: dict[str, Any] = {
        **harness.environment(),
        "frameworks": {d: peers._version(d) for d in FRAMEWORKS.values()},
        "sizes": dataclasses.asdict(QUICK if quick else FULL),
        "cases": {},
    }
    for r, c in results:
        rows = []
        for row in r.rows:
            d = dataclasses.asdict(row)
            d["time_median_s"] = row.time_median_s
            d["temp_over_stock"] = r.temp_ratio(row, r.stock)
            d["time_over_stock"] = r.time_ratio(row, r.stock)
            rows.append(d)
        out["cases"][r.name] = {
            "description": r.description,
            "repeats": r.repeats,
            "rows": rows,
            "explain": None if c is None else dataclasses.asdict(c),
        }
    return out


# ----------------------------------------------------------------------------------------------
# Budget study: jaxmem.optimize(train_step, budget=B) against the framework's own remat choices.

LEVANTER_GC = (True, False, "nested")
"""Levanter's ``gradient_checkpointing`` values measured by ``--budget`` (True, its default,
first: each scanned layer under ``eqx.filter_checkpoint``; False: none; ``"nested"``: the
stack scanned as sqrt-sized blocks of layers, each block's carries recomputed). Its others:
``"recompute"``/``"full"`` build the same checkpoint as True, ``"save_all"`` keeps what False
does, ``"offload"`` moves to ``pinned_host`` (not on one CPU)."""

BUDGET_FRACTIONS = (0.0, 1 / 3, 2 / 3, 1.0)
"""The budgets of ``--budget``: from the leanest own choice's peak to the largest own peak."""

BUDGET_ERROR_BAR = 1e-5
"""The largest output error (:func:`benchmarks.budget.largest_error`) a plan may have."""

BUDGET_FLOPS_BAR = 1.01
"""A plan's FLOPs over the fewest among the own choices that fit, above which a note is made
(not a failure: an own choice jaxmem's settings cannot express may beat it)."""


@dataclasses.dataclass(frozen=True)
class BudgetStudy:
    """One framework model's train steps, one per own remat choice (the default first).

    Attributes:
      name: the model, e.g. ``"levanter llama"``.
      description: the model, its loss and its train step.
      steps: own choice's label -> the train step ``(*args) -> (loss, params, momentum)``.
      args: the step's arguments.
      context: a context manager the study is measured in (MaxText's mesh), or None.
      written_lean: the default step written around ``jaxmem.optimize(loss)`` (what
        ``jaxmem.optimize(step)`` without a budget is measured against), or None.
    """

    name: str
    description: str
    steps: dict[str, Callable]
    args: tuple
    context: Callable[[], Any] | None = None
    written_lean: Callable | None = None

    @property
    def default(self) -> str:
        """The label of the framework's default choice (the first)."""
        return next(iter(self.steps))


def _sgd_momentum(params, momentum, grads, lr: float = 1e-2, beta: float = 0.9):
    """An SGD-momentum update (as :func:`benchmarks.budget.make_step`): new params, momentum."""
    momentum = jax.tree.map(lambda m, g: beta * m + g, momentum, grads)
    params = jax.tree.map(lambda p, m: p - lr * m, params, momentum)
    return params, momentum


def _retree(tree, to):
    """``tree``'s leaves in the tree structure ``to``."""
    return jax.tree.unflatten(to, jax.tree.leaves(tree))


def levanter_budget_studies(s: Sizes) -> list[BudgetStudy]:
    """Levanter's Llama, a train step per ``gradient_checkpointing`` (True, its default, first):
    ``eqx.filter_value_and_grad`` of its ``train_lm`` loss, as its trainer, then SGD-momentum."""
    import equinox as eqx  # noqa: PLC0415 - optional, Levanter's
    import haliax as hax  # noqa: PLC0415
    from levanter.models.lm_model import LmExample  # noqa: PLC0415

    steps, args, tree, lean = {}, None, None, None
    for gc in LEVANTER_GC:
        parts = _levanter_parts(s, "llama", gc)

        def train_step(arrays, momentum, token_ids, parts=parts, wrap=lambda f: f):
            model = eqx.combine(arrays, parts.static)
            example = hax.vmap(LmExample.causal, parts.batch)(token_ids)
            value, grads = eqx.filter_value_and_grad(wrap(parts.loss))(model, example)
            grads = eqx.filter(grads, eqx.is_array)
            arrays, momentum = _sgd_momentum(arrays, momentum, grads)
            return value, arrays, momentum

        if args is None:  # the default's arrays (the same key and shapes for every choice)
            momentum = jax.tree.map(jnp.zeros_like, parts.params)
            args, tree = (parts.params, momentum, parts.tokens), jax.tree.structure(parts.params)
            lean = functools.partial(train_step, wrap=jaxmem.optimize)
        else:  # its tree holds its config (gradient_checkpointing): the default's arrays in it
            own = jax.tree.structure(parts.params)
            shapes = [(x.shape, x.dtype) for x in jax.tree.leaves(parts.params)]
            assert shapes == [(x.shape, x.dtype) for x in jax.tree.leaves(args[0])], gc

            def train_step(arrays, momentum, token_ids, step=train_step, own=own, tree=tree):
                out = step(_retree(arrays, own), _retree(momentum, own), token_ids)
                return out[0], _retree(out[1], tree), _retree(out[2], tree)

        steps[f"gradient_checkpointing={gc}"] = train_step
    description = (
        f"Levanter llama LMHeadModel, L={s.layers} emb={s.emb} mlp={s.mlp} heads={s.heads}, "
        f"V={s.vocab} B={s.batch} S={s.seq}, scan_layers, f32; compute_next_token_loss, "
        "eqx.filter_value_and_grad, SGD-momentum update, one jitted step"
    )
    return [BudgetStudy("levanter llama", description, steps, args, written_lean=lean)]


def maxtext_budget_studies(s: Sizes) -> list[BudgetStudy]:
    """MaxText's llama2 decoder, a train step per ``remat_policy`` (``full``, its default,
    first): ``jax.value_and_grad`` of its pre-training loss w.r.t. ``nnx.Param``, then
    SGD-momentum."""
    steps, args, mesh, lean = {}, None, None, None
    for policy in MAXTEXT_POLICIES:
        loss, (params, rest, data), mesh_p, _ = _maxtext_parts(s, policy, compile_cache=False)

        def train_step(params, momentum, rest, data, loss=loss, wrap=lambda f: f):
            value, grads = jax.value_and_grad(wrap(loss))(params, rest, data)
            params, momentum = _sgd_momentum(params, momentum, grads)
            return value, params, momentum

        steps[f"remat_policy={policy}"] = train_step
        if args is None:
            momentum = jax.tree.map(jnp.zeros_like, params)
            args, mesh = (params, momentum, rest, data), mesh_p
            lean = functools.partial(train_step, wrap=jaxmem.optimize)
    description = (
        f"MaxText llama2 decoder (NNX), {s}, scan_layers, f32; train loss_fn, "
        "jax.value_and_grad w.r.t. nnx.Param, SGD-momentum update, one jitted step"
    )
    context = lambda: jax.set_mesh(mesh)
    return [BudgetStudy("maxtext llama2", description, steps, args, context, written_lean=lean)]


BUDGET_BUILDERS = {"maxtext": maxtext_budget_studies, "levanter": levanter_budget_studies}


def _budgets(peaks: Sequence[int]) -> list[int]:
    """:data:`BUDGET_FRACTIONS` of the way from the least to the largest of ``peaks``."""
    lo, hi = min(peaks), max(peaks)
    return sorted({int(lo + (hi - lo) * f) for f in BUDGET_FRACTIONS})


def budget_study(
    study: BudgetStudy, progress: bool = False, rounds: int | None = None
) -> dict[str, Any]:
    """The study's own choices (compiled peak and FLOPs) and ``optimize(default, budget=B)`` at
    each of :func:`_budgets`: the chosen setting, the peak and FLOPs of ``jax.jit`` of it
    compiled in full, the fewest FLOPs among the own choices that fit ``B``, the planning time
    (``budget_plan``) and the largest output error against the default step's. With ``rounds``:
    :func:`_time_study` too. A failure is recorded in ``failures`` (with its traceback), never
    raised."""
    import traceback  # noqa: PLC0415

    from benchmarks.budget import compiled_figures, largest_error  # noqa: PLC0415

    def say(text: str) -> None:
        if progress:
            print(f"  {study.name}: {text}", file=sys.stderr, flush=True)

    args = study.args
    out: dict[str, Any] = {
        "name": study.name,
        "description": study.description,
        "default": study.default,
        "policies": {},
        "plans": [],
        "failures": [],
        "notes": [],
    }
    ctx = study.context() if study.context is not None else _null()
    with ctx:
        programs = {}
        for label, fn in study.steps.items():
            say(f"compiling {label}")
            try:
                peak, flops, comp = compiled_figures(fn, args)
            except Exception:  # noqa: BLE001 - recorded
                tb = traceback.format_exc()
                out["policies"][label] = {"error": tb}
                out["failures"].append(f"own choice {label}: compile failed\n{tb}")
                continue
            programs[label] = comp
            out["policies"][label] = {"peak": peak, "flops": flops}
        if study.default not in programs:
            out["failures"].append("the default step did not compile: no budgets")
            return out
        want = programs[study.default](*args)
        out["policy_spread"] = max(largest_error(p(*args), want) for p in programs.values())
        own = {k: p for k, p in out["policies"].items() if "peak" in p}
        if study.written_lean is not None:
            say("optimize(step) without a budget, and the step around optimize(loss)")
            try:
                out["no_budget"] = row = _no_budget_study(study, want)
            except Exception:  # noqa: BLE001 - recorded
                out["failures"].append(f"optimize(step): exception\n{traceback.format_exc()}")
            else:
                if row["temp"] > NO_BUDGET_RATIO * row["loss_form_temp"] + NO_BUDGET_BYTES:
                    out["failures"].append(f"optimize(step): temp above the loss form's: {row}")
                if row["error"] > BUDGET_ERROR_BAR:
                    out["failures"].append(f"optimize(step): output error {row['error']:.3e}")
        for b in _budgets([p["peak"] for p in own.values()]):
            fit = [p["flops"] for p in own.values() if p["peak"] <= b]
            row: dict[str, Any] = {"budget": b, "least_policy_flops": min(fit) if fit else None}
            out["plans"].append(row)
            say(f"planning at budget {format_mib(b)}")
            try:
                # Cold: jaxmem shares the measured settings between optimize(fn, budget=...) of
                # one function (budget._MEASURED), so that another budget's plan is a cache hit;
                # planning_s is with the cache emptied, planning_cached_s a second plan's.
                jaxmem.clear_caches()
                opt = jaxmem.optimize(study.steps[study.default], budget=b)
                plan, row["planning_s"] = harness.wall_seconds(opt.budget_plan, *args)
                again = lambda step, b: jaxmem.optimize(step, budget=b).budget_plan(*args)
                _, row["planning_cached_s"] = harness.wall_seconds(
                    again, study.steps[study.default], b
                )
                row["chosen"] = plan.chosen.key
                row["planned_peak"] = plan.chosen.peak_bytes
                row["planned_flops"] = plan.chosen.flops
                row["trials"] = [
                    {"key": x.key, "peak": x.peak_bytes, "flops": x.flops, "error": x.error}
                    for x in plan.trials
                ]
                say(f"chose {plan.chosen.key}; compiling it in full")
                peak, flops, comp = compiled_figures(opt, args)
                row["peak"], row["flops"] = peak, flops
                row["error"] = largest_error(comp(*args), want)
            except Exception:  # noqa: BLE001 - recorded, not fixed
                tb = traceback.format_exc()
                row["exception"] = tb
                out["failures"].append(f"budget {b} ({format_mib(b)}): exception\n{tb}")
                continue
            if row["peak"] > b:
                out["failures"].append(
                    f"budget {b} ({format_mib(b)}): {row['chosen']} compiled peak {row['peak']} "
                    f"({format_mib(row['peak'])}) > budget (planned {row['planned_peak']})"
                )
            least = row["least_policy_flops"]
            if least and row["flops"] > BUDGET_FLOPS_BAR * least:
                better = min(
                    (k for k, p in own.items() if p["peak"] <= b), key=lambda k: own[k]["flops"]
                )
                out["notes"].append(
                    f"budget {b} ({format_mib(b)}): {row['chosen']} {row['flops'] / least:.4f}x "
                    f"the FLOPs of own choice {better} (peak {own[better]['peak']}), which fits"
                )
            if row["error"] > BUDGET_ERROR_BAR:
                out["failures"].append(
                    f"budget {b} ({format_mib(b)}): {row['chosen']} output error "
                    f"{row['error']:.3e} > {BUDGET_ERROR_BAR:.0e}"
                )
        if rounds:
            say("objective='time' at twice the default's peak")
            try:
                out["time"] = _time_study(study, programs, own, rounds)
            except Exception:  # noqa: BLE001 - recorded
                out["failures"].append(f"objective='time': exception\n{traceback.format_exc()}")
    return out


# jaxmem.optimize(step) without a budget: its temp within this of the same step written around
# jaxmem.optimize(loss) (what catching the step's own differentiation must reach).
NO_BUDGET_RATIO, NO_BUDGET_BYTES = 1.02, 16 * 1024


def _no_budget_study(study: BudgetStudy, want) -> dict[str, Any]:
    """``jaxmem.optimize(default step)``: its compiled temp against the default step written
    around ``jaxmem.optimize(loss)`` and against the step as written, and its outputs' largest
    error against the step's."""
    from benchmarks.budget import largest_error  # noqa: PLC0415

    temp = lambda c: c.memory_analysis().temp_size_in_bytes
    compiled = {
        k: jax.jit(f).lower(*study.args).compile()
        for k, f in (
            ("ours", jaxmem.optimize(study.steps[study.default])),
            ("loss_form", study.written_lean),
            ("stock", study.steps[study.default]),
        )
    }
    ours, loss_form, stock = (temp(compiled[k]) for k in ("ours", "loss_form", "stock"))
    return dict(
        temp=ours, loss_form_temp=loss_form, stock_temp=stock, ratio=ours / loss_form,
        error=largest_error(compiled["ours"](*study.args), want),
    )  # fmt: skip


def _time_study(study: BudgetStudy, programs: dict, own: dict, rounds: int) -> dict[str, Any]:
    """``optimize(default, budget=2 x the default's peak, objective="time")``: its step time
    against the fastest own choice that fits (the least median of 3 interleaved rounds), over
    ``rounds`` paired rounds A A B B (:func:`harness.time_interleaved`)."""
    from benchmarks.budget import compiled_figures  # noqa: PLC0415

    args, b = study.args, 2 * own[study.default]["peak"]
    opt = jaxmem.optimize(study.steps[study.default], budget=b, objective="time")
    chosen = opt.budget_plan(*args).chosen.key
    peak, _, comp = compiled_figures(opt, args)
    fits = [k for k, p in own.items() if p["peak"] <= b]
    single = harness.time_interleaved({k: programs[k] for k in fits}, *args, repeats=3)
    fastest = min(single, key=lambda k: single[k].median_s)
    paired = harness.time_interleaved(
        {"ours": comp, "own": programs[fastest]}, *args, repeats=rounds
    )
    ours, theirs = paired["ours"].median_s, paired["own"].median_s
    return dict(
        budget=b, chosen=chosen, peak=peak, seconds=ours, fastest_own=fastest,
        fastest_seconds=theirs, ratio=ours / theirs, rounds=rounds,
    )  # fmt: skip


def budget_rows(
    quick: bool, progress: bool = False, rounds: int | None = None
) -> list[dict[str, Any]]:
    """:func:`budget_study` of each installed framework's models (Levanter's Llama, MaxText's
    llama2); a model that fails to build is a study with only its failure."""
    import traceback  # noqa: PLC0415

    s = QUICK if quick else FULL
    out = []
    for module, ok in installed().items():
        if not ok or module not in BUDGET_BUILDERS:
            continue
        try:
            studies = BUDGET_BUILDERS[module](s)
        except Exception:  # noqa: BLE001 - reported
            failure = f"building the model failed\n{traceback.format_exc()}"
            out.append({"name": module, "policies": {}, "plans": [], "failures": [failure]})
            continue
        out += [budget_study(st, progress, rounds) for st in studies]
    return out


def format_budget_table(studies: Sequence[dict[str, Any]]) -> str:
    """Per study: each own choice's peak and GFLOPs; each budget's chosen setting, its compiled
    peak, its FLOPs over the fewest of the own choices that fit, planning seconds and error."""
    lines = []
    indent = lambda text: textwrap.indent(text, "    ")
    for st in studies:
        lines += [f"{st['name']}: {st.get('description', '')}", "  framework's own choices:"]
        own = []
        for label, p in st["policies"].items():
            if "peak" not in p:
                own.append([label, "-", "-", "failed to compile"])
                continue
            mark = "(default)" if label == st.get("default") else ""
            own.append([label, format_mib(p["peak"]), f"{p['flops'] / 1e9:.4f}", mark])
        if own:
            lines.append(indent(harness.table(["choice", "peak", "GFLOPs", ""], own, align="lrrl")))
        if "policy_spread" in st:
            lines.append(f"    (outputs differ from the default's by {st['policy_spread']:.1e})")
        if st["plans"]:
            lines.append(f"  jaxmem.optimize({st.get('default', 'step')} step, budget=B):")
        plans = []
        for p in st["plans"]:
            if "exception" in p:
                plans.append([format_mib(p["budget"]), "exception (see failures)"])
                continue
            least = p["least_policy_flops"]
            plans.append(
                [
                    format_mib(p["budget"]),
                    p["chosen"],
                    format_mib(p["peak"]),
                    "<= B" if p["peak"] <= p["budget"] else "> B !",
                    f"{p['flops'] / 1e9:.4f}",
                    f"{p['flops'] / least:.4f}x" if least else "n/a (no own choice fits)",
                    f"{p['planning_s']:.1f} s",
                    f"{p['planning_cached_s']:.1f} s",
                    f"{p['error']:.1e}",
                ]
            )
        if plans:
            head = ["B", "chosen", "peak", "fits", "GFLOPs", "/ least-FLOPs own choice that fits"]
            head += ["plan", "plan cached", "err"]
            lines.append(indent(harness.table(head, plans, align="rlrl")))
        if "no_budget" in st:
            n = st["no_budget"]
            lines.append(
                f"  optimize(step), no budget: temp {format_mib(n['temp'])}, {n['ratio']:.4f}x "
                f"the step around optimize(loss) ({format_mib(n['loss_form_temp'])}), "
                f"{n['temp'] / n['stock_temp']:.3f}x stock's; err {n['error']:.1e}"
            )
        if "time" in st:
            t = st["time"]
            lines.append(
                f'  objective="time", B {format_mib(t["budget"])}: {t["chosen"]}, peak '
                f"{format_mib(t['peak'])}, {t['seconds'] * 1e3:.2f} ms vs {t['fastest_own']} "
                f"{t['fastest_seconds'] * 1e3:.2f} ms: {t['ratio']:.3f}x ({t['rounds']} paired "
                "rounds)"
            )
        if st.get("notes"):
            lines += ["  notes:"] + [f"    {n}" for n in st["notes"]]
        if st["failures"]:
            lines += ["  failures:"] + [f"    {f}" for f in st["failures"]]
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv: Sequence[str] | None = None) -> int:
    """Runs every installed framework's cases and prints the table.

    Returns:
      1 if a row failed to measure, else 0 (frameworks not installed are skipped, not failed).
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.frameworks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2-layer width-32 models, 3 rounds")
    parser.add_argument("--no-time", action="store_true", help="compile and run each row once")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7)")
    parser.add_argument("--json", type=pathlib.Path, help="write every figure to this file")
    parser.add_argument(
        "--budget",
        action="store_true",
        help="the budget study instead: optimize(train_step, budget=B) against the framework's "
        "own remat choices (compiled figures; objective='time' at twice the default's peak "
        "timed over --repeats paired rounds, default 21, none with --no-time)",
    )
    args = parser.parse_args(argv)
    if args.budget:
        return _budget_main(args)
    repeats = args.repeats or (3 if args.quick else harness.MIN_REPEATS)
    env = harness.environment()
    print(
        f"frameworks benchmark | jax {env['jax_version']} | backend {env['backend']} "
        f"({env['device_kind']}) | python {env['python']} | {env['date']}\n{status_line()}",
        flush=True,
    )
    results = run(args.quick, timed=not args.no_time, repeats=repeats, progress=not args.quick)
    if results:
        print(format_table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = to_dict(results, args.quick)
        args.json.write_text(json.dumps(data, indent=2, default=harness.json_default) + "\n")
        print(f"wrote {args.json}")
    return 1 if any(row.error for r, _ in results for row in r.rows) else 0


def _budget_main(args) -> int:
    """``--budget``: prints :func:`format_budget_table`; 1 if a study recorded a failure."""
    env = harness.environment()
    print(
        f"frameworks budget study | jax {env['jax_version']} | backend {env['backend']} "
        f"({env['device_kind']}) | python {env['python']} | {env['date']}\n{status_line()}\n"
        f"sizes: {QUICK if args.quick else FULL}",
        flush=True,
    )
    rounds = None if args.no_time else (args.repeats or (3 if args.quick else 21))
    studies = budget_rows(args.quick, progress=True, rounds=rounds)
    if studies:
        print(format_budget_table(studies))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {
            **env,
            "frameworks": {d: peers._version(d) for d in FRAMEWORKS.values()},
            "sizes": dataclasses.asdict(QUICK if args.quick else FULL),
            "studies": studies,
        }
        args.json.write_text(json.dumps(data, indent=2, default=harness.json_default) + "\n")
        print(f"wrote {args.json}")
    return 1 if any(st["failures"] for st in studies) else 0


if __name__ == "__main__":
    sys.exit(main())
