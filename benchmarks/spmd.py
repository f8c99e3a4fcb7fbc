"""SPMD benchmark: ``jaxmem.scan`` against ``jax.lax.scan`` on 1, 2, 4 and 8 devices.

The model is :mod:`benchmarks.cases`' ``prelm_block`` stack (causal pre-LN transformer blocks,
parameters stacked on a leading layer axis and scanned, loss ``mean(x_L**2)``), the same
computation with the heads as an axis of the attention weights (``qkv[L, D, 3, H, Dh]``,
``o[L, H, Dh, D]``) so that a tensor-parallel split falls on head boundaries. Two layouts, each
on a mesh ``('data', 'model')`` over the first ``n`` devices:

- ``fsdp``: every weight matrix sharded over ``'data'`` along ``D``, the batch over ``'data'``
  (mesh ``(n, 1)``);
- ``tp``: Megatron tensor parallelism, ``qkv`` and ``w1`` column-sharded (by heads, by ``F``)
  over ``'model'``, ``o`` and ``w2`` row-sharded, the batch replicated (mesh ``(1, n)``).

The inputs are placed with :func:`jax.device_put` and ``jax.jit(jax.grad(loss))`` is compiled with
their shardings (the gradients keep the parameters' shardings). Figures per device, as
docs/design.md §3 asks: ``memory_analysis()`` of the compiled SPMD program describes one device's
partition (at ``n = 2`` FSDP the argument bytes halve), so ``temp`` is the per-device temp bytes
and ``args`` the per-device argument bytes; step time is timed same process, warm, interleaved
stock / jaxmem (:func:`benchmarks.harness.time_interleaved`); gradients of jaxmem are checked
against stock.

Two criteria are checked and printed as PASS/FAIL: (1) per-device temp falls with the device
count, for stock and for jaxmem, in both layouts; (2) jaxmem's temp ratio to stock at the most
devices (8) is within 0.1 of its ratio on 1 device.

Usage: ``python -m benchmarks.spmd [--quick] [--json PATH] [--mesh {auto,explicit}]
[--policy {none,dots}] [--variant NAME] [--layout NAME ...] [--devices N ...] [--repeats N]
[--fast-compile] [--no-check]``.

Run as a module it asks XLA for 8 host (CPU) devices (unless ``XLA_FLAGS`` already says how
many). Under ``--mesh explicit`` the model is written for sharding in types: FSDP gathers each
layer's weights inside the loop (:func:`jax.sharding.reshard`), TP names the output sharding of
its row-parallel contractions.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    # Before jax is imported: 8 host devices, unless the caller chose a count.
    _flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Mapping, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks import cases, harness  # noqa: E402
from benchmarks.cases import ScanImpl  # noqa: E402
from benchmarks.harness import STOCK, Column, format_mib  # noqa: E402

DEVICE_COUNTS = (1, 2, 4, 8)
"""Device counts measured by default."""

RATIO_TOLERANCE = 0.1
"""Criterion (2): |ratio at the most devices - ratio on the fewest| must not exceed this."""

POLICIES: dict[str, Callable | None] = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_saveable,
}
"""Remat policies applied to the scanned block (``jax.checkpoint(body, policy=...)``), by name."""

FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""Compiler options of ``--fast-compile``: no LLVM optimisation; buffer assignment (hence the
memory figures) is unchanged, step times are not representative."""


# ----------------------------------------------------------------------------------------------
# The model.


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Sizes of the layer stack.

    Attributes:
      layers: L, scanned layers.
      batch: B (divisible by the largest device count, for FSDP).
      seq: S, sequence length.
      d_model: D.
      heads: H (divisible by the largest device count, for TP).
      d_ff: F, MLP hidden size.
    """

    layers: int
    batch: int
    seq: int
    d_model: int
    heads: int
    d_ff: int

    def __str__(self) -> str:
        return (
            f"L={self.layers} B={self.batch} S={self.seq} D={self.d_model} H={self.heads} "
            f"F={self.d_ff}, f32"
        )


DEFAULT = Shapes(layers=4, batch=8, seq=128, d_model=256, heads=8, d_ff=1024)
"""``cases.prelm_block``'s sizes, with 8 heads (instead of 4) so that 8-way TP splits heads."""

QUICK = Shapes(layers=2, batch=8, seq=16, d_model=64, heads=8, d_ff=128)
"""Small sizes for tests (``--quick``)."""


@functools.cache
@functools.partial(jax.jit, static_argnums=0)
def make_args(shapes: Shapes) -> tuple[dict[str, jax.Array], jax.Array]:
    """Returns ``(params, x)``: ``cases.prelm_block``'s initialisation at ``shapes``, heads layout.

    The values are those of :func:`benchmarks.cases._prelm_args` (same PRNG key and scales; equal
    at its sizes), then :func:`heads_layout`. One jitted program (one compile), cached.
    """
    keys = jax.random.split(jax.random.key(2), 5)
    n, d, f = shapes.layers, shapes.d_model, shapes.d_ff
    normal = cases._normal
    params = {
        "ln1": jnp.ones((n, d), jnp.float32),
        "ln2": jnp.ones((n, d), jnp.float32),
        "qkv": normal(keys[0], (n, d, 3 * d), 1.0 / math.sqrt(d)),
        "o": normal(keys[1], (n, d, d), 1.0 / math.sqrt(d)),
        "w1": normal(keys[2], (n, d, f), 1.0 / math.sqrt(d)),
        "w2": normal(keys[3], (n, f, d), 1.0 / math.sqrt(f)),
    }
    x = normal(keys[4], (shapes.batch, shapes.seq, d))
    return heads_layout(params, shapes.heads), x


def heads_layout(params: dict[str, jax.Array], heads: int) -> dict[str, jax.Array]:
    """Reshapes ``cases.prelm_block``'s ``qkv[L, D, 3D]`` and ``o[L, D, D]`` to head axes.

    ``qkv`` becomes ``[L, D, 3, H, Dh]`` and ``o`` becomes ``[L, H, Dh, D]``: the order in which
    ``cases._attention`` splits them, so the values and the computation do not change.
    """
    n, d, _ = params["o"].shape
    dh = d // heads
    return {
        **params,
        "qkv": params["qkv"].reshape(n, d, 3, heads, dh),
        "o": params["o"].reshape(n, heads, dh, d),
    }


def _attention(x: jax.Array, w_qkv: jax.Array, w_o: jax.Array, out_sharding: Any) -> jax.Array:
    """``cases._attention`` on head-layout weights ``w_qkv[D, 3, H, Dh]``, ``w_o[H, Dh, D]``."""
    s, dh = x.shape[1], w_qkv.shape[-1]
    qkv = jnp.einsum("bsd,dthe->bsthe", x, w_qkv)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, S, H, Dh]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
    causal = jnp.tril(jnp.ones((s, s), jnp.bool_))[None, None]
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return jnp.einsum("bqhe,hed->bqd", out, w_o, out_sharding=out_sharding)


def block(x: jax.Array, p: dict[str, jax.Array], *, out_sharding: Any = None) -> jax.Array:
    """``cases._prelm_block`` on head-layout weights (:func:`heads_layout`).

    Args:
      x: activations ``[B, S, D]``.
      p: one layer's parameters.
      out_sharding: the sharding of the row-parallel contractions' outputs (attention output
        projection, second MLP matrix), required under an Explicit mesh where their contracting
        axes are sharded; None leaves it to JAX.

    Returns:
      The block's output ``[B, S, D]``.
    """
    h = x + _attention(cases._layer_norm(x, p["ln1"]), p["qkv"], p["o"], out_sharding)
    hidden = jax.nn.gelu(cases._layer_norm(h, p["ln2"]) @ p["w1"])
    return h + jnp.matmul(hidden, p["w2"], out_sharding=out_sharding)


def make_loss(
    scan: ScanImpl,
    *,
    policy: Callable | None = None,
    gather_weights: bool = False,
    out_sharding: Any = None,
) -> Callable[..., jax.Array]:
    """Returns ``loss(params, x) = mean(x_L**2)`` of the block stack scanned with ``scan``.

    Args:
      scan: the scan under test (``jax.lax.scan`` for stock).
      policy: a remat policy for the block (``jax.checkpoint(body, policy=policy)``), or None.
      gather_weights: replicate each layer's weights inside the loop before use (FSDP written
        for an Explicit mesh).
      out_sharding: see :func:`block`.
    """

    def body(x, p):
        if gather_weights:
            p = jax.tree.map(lambda w: jax.sharding.reshard(w, P()), p)
        return block(x, p, out_sharding=out_sharding), None

    if policy is not None:
        body = jax.checkpoint(body, policy=policy)

    def loss(params, x):
        x_l, _ = scan(body, x, params)
        return jnp.mean(x_l**2)

    return loss


# ----------------------------------------------------------------------------------------------
# Layouts and meshes.


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the parameters and the batch are sharded over a ``('data', 'model')`` mesh.

    Attributes:
      name: ``"fsdp"`` or ``"tp"``.
      axis: the mesh axis that gets the devices (the other has size 1).
      params: parameter name -> partition spec.
      batch: partition spec of ``x[B, S, D]``.
      description: one line, for the report.
    """

    name: str
    axis: str
    params: Mapping[str, P]
    batch: P
    description: str

    def mesh_shape(self, n: int) -> tuple[int, int]:
        """``(n, 1)`` for a ``'data'`` layout, ``(1, n)`` for a ``'model'`` one."""
        return (n, 1) if self.axis == "data" else (1, n)


FSDP = Layout(
    "fsdp",
    "data",
    {
        "ln1": P(),
        "ln2": P(),
        "qkv": P(None, "data"),
        "o": P(None, None, None, "data"),
        "w1": P(None, "data"),
        "w2": P(None, None, "data"),
    },
    P("data"),
    "weights sharded over 'data' along D, batch over 'data'",
)

TP = Layout(
    "tp",
    "model",
    {
        "ln1": P(),
        "ln2": P(),
        "qkv": P(None, None, None, "model"),
        "o": P(None, "model"),
        "w1": P(None, None, "model"),
        "w2": P(None, "model"),
    },
    P(),
    "Megatron: qkv (by heads) and w1 column-, o and w2 row-sharded over 'model'; batch replicated",
)

LAYOUTS = {layout.name: layout for layout in (FSDP, TP)}
"""The layouts, by name."""


def make_mesh(n: int, layout: Layout, axis_type: str = "auto") -> jax.sharding.Mesh:
    """A ``('data', 'model')`` mesh over the first ``n`` devices, shaped for ``layout``.

    Args:
      n: device count.
      layout: decides which axis gets the ``n`` devices.
      axis_type: ``"auto"`` or ``"explicit"`` (``jax.sharding.AxisType``), for both axes.
    """
    kind = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
    devices = np.array(jax.devices()[:n]).reshape(layout.mesh_shape(n))
    return jax.sharding.Mesh(devices, ("data", "model"), axis_types=(kind[axis_type],) * 2)


# ----------------------------------------------------------------------------------------------
# Measuring.


@dataclasses.dataclass
class Point:
    """One layout on one device count: a column per scan implementation.

    Attributes:
      layout: layout name.
      devices: device count.
      columns: ``"stock"`` then the variant's label -> figures (per device).
    """

    layout: str
    devices: int
    columns: dict[str, Column]

    def ratio(self, label: str, field: str) -> float | None:
        """``columns[label].<field> / columns["stock"].<field>``, or None if unavailable."""
        num, den = getattr(self.columns[label], field), getattr(self.columns[STOCK], field)
        if num is None or den is None or den == 0:
            return None
        return num / den


@dataclasses.dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
      shapes: model sizes.
      devices: device counts, ascending.
      layouts: layout names.
      axis_type: ``"auto"`` or ``"explicit"`` mesh axes.
      policy: name in :data:`POLICIES`.
      repeats: timed runs per column, interleaved.
      fast_compile: compile with XLA's backend optimisation level 0 (:data:`FAST_COMPILE`):
        about twice as fast to compile, the same memory figures, slower code (for tests).
    """

    shapes: Shapes = DEFAULT
    devices: tuple[int, ...] = DEVICE_COUNTS
    layouts: tuple[str, ...] = ("fsdp", "tp")
    axis_type: str = "auto"
    policy: str = "none"
    repeats: int = harness.MIN_REPEATS
    fast_compile: bool = False


def _loss_for(scan: ScanImpl, layout: Layout, config: Config) -> Callable[..., jax.Array]:
    explicit = config.axis_type == "explicit"
    return make_loss(
        scan,
        policy=POLICIES[config.policy],
        gather_weights=explicit and layout is FSDP,
        out_sharding=layout.batch if explicit else None,
    )


def measure_point(layout: Layout, n: int, impls: Mapping[str, ScanImpl], config: Config) -> Point:
    """Compiles and times the sharded gradient of every scan implementation on ``n`` devices.

    Args:
      layout: the sharding layout.
      n: device count (the first ``n`` devices).
      impls: label -> scan implementation, ``"stock"`` first.
      config: sizes, mesh axis type, policy, repeats.

    Returns:
      The point; a column that fails to compile or run holds the error text, not figures.
    """
    mesh = make_mesh(n, layout, config.axis_type)
    shard = lambda spec: NamedSharding(mesh, spec)
    param_shardings = {k: shard(spec) for k, spec in layout.params.items()}
    shardings = (param_shardings, shard(layout.batch))
    params, x = make_args(config.shapes)
    args = jax.device_put((params, x), shardings)
    context = jax.set_mesh(mesh) if config.axis_type == "explicit" else contextlib.nullcontext()
    point = Point(layout.name, n, {})
    compiled = {}
    with context:
        for label, impl in impls.items():
            col = point.columns[label] = Column(label)
            grad = jax.grad(_loss_for(impl, layout, config), argnums=(0, 1))
            try:
                fn = jax.jit(grad, in_shardings=shardings, out_shardings=shardings)
                options = FAST_COMPILE if config.fast_compile else None
                compiled[label] = fn.lower(*args).compile(options)
            except Exception as e:  # noqa: BLE001 - a failing column is reported, not fatal.
                col.error = harness._error_text(e)
                continue
            mem = compiled[label].memory_analysis()
            col.temp_bytes = mem.temp_size_in_bytes
            col.argument_bytes = mem.argument_size_in_bytes
            col.output_bytes = mem.output_size_in_bytes
            col.peak_bytes = getattr(mem, "peak_memory_in_bytes", None)
        if STOCK in compiled:
            _time(point, compiled, args, config.repeats)
    return point


def _time(point: Point, compiled: Mapping[str, Any], args: tuple, repeats: int) -> None:
    try:
        times = harness.time_interleaved(compiled, *args, repeats=repeats)
    except Exception as e:  # noqa: BLE001
        for label in compiled:
            point.columns[label].error = harness._error_text(e)
        return
    for label, t in times.items():
        col = point.columns[label]
        col.time_min_s, col.time_median_s = t.min_s, t.median_s
        if label != STOCK:
            col.grad_rel_err = rel_err(t.output, times[STOCK].output)


def rel_err(grads: Any, reference: Any) -> float:
    """max |grads - reference| / max |reference| over all leaves, on the host (numpy).

    Examples:
      >>> rel_err({"a": np.ones(2)}, {"a": np.array([1.0, 2.0])})
      0.5
    """
    got = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
    ref = [np.asarray(r, np.float64) for r in jax.tree.leaves(reference)]
    diff = max(float(np.max(np.abs(g - r), initial=0.0)) for g, r in zip(got, ref, strict=True))
    scale = max(float(np.max(np.abs(r), initial=0.0)) for r in ref)
    return diff / (scale or 1.0)


def run(variant: tuple[str, ScanImpl], config: Config) -> list[Point]:
    """Measures every layout on every device count: stock and ``variant = (label, scan)``."""
    label, impl = variant
    if label == STOCK:
        raise ValueError(f"variant label {STOCK!r} is reserved for jax.lax.scan; rename it.")
    impls = {STOCK: jax.lax.scan, label: impl}
    points = []
    for name in config.layouts:
        for n in config.devices:
            points.append(measure_point(LAYOUTS[name], n, impls, config))
            print(f"  measured {name} on {n} device(s)", file=sys.stderr, flush=True)
    return points


# ----------------------------------------------------------------------------------------------
# Criteria.


@dataclasses.dataclass(frozen=True)
class Check:
    """One criterion on one layout.

    Attributes:
      name: what is checked.
      layout: layout name.
      passed: whether it holds.
      detail: the figures it was decided on.
    """

    name: str
    layout: str
    passed: bool
    detail: str


def check(points: Sequence[Point], variant: str) -> list[Check]:
    """Checks the two criteria on each layout (see the module docstring).

    A column that failed to measure fails both criteria of its layout; so does a layout measured
    on fewer than two device counts.
    """
    out = []
    for name in dict.fromkeys(p.layout for p in points):
        pts = sorted((p for p in points if p.layout == name), key=lambda p: p.devices)
        out += [_check_falls(name, pts, variant), _check_steady_ratio(name, pts, variant)]
    return out


def _check_falls(layout: str, pts: Sequence[Point], variant: str) -> Check:
    passed = len(pts) > 1
    details = []
    for label in (STOCK, variant):
        temps = [p.columns[label].temp_bytes for p in pts]
        passed = passed and None not in temps
        passed = passed and all(a > b for a, b in zip(temps, temps[1:], strict=False))
        details.append(f"{label} " + " > ".join(format_mib(t) for t in temps))
    counts = [p.devices for p in pts]
    name = f"per-device temp falls with the device count ({counts})"
    return Check(name, layout, passed, "; ".join(details))


def _check_steady_ratio(layout: str, pts: Sequence[Point], variant: str) -> Check:
    first, last = pts[0], pts[-1]
    lo, hi = first.ratio(variant, "temp_bytes"), last.ratio(variant, "temp_bytes")
    diff = None if lo is None or hi is None else abs(hi - lo)
    passed = len(pts) > 1 and diff is not None and diff <= RATIO_TOLERANCE
    name = (
        f"{variant}/stock temp ratio @{last.devices} within {RATIO_TOLERANCE} of @{first.devices}"
    )
    detail = f"{_x(hi)} vs {_x(lo)}, |diff| {'-' if diff is None else f'{diff:.3f}'}"
    return Check(name, layout, passed, detail)


# ----------------------------------------------------------------------------------------------
# Output.


def _x(r: float | None) -> str:
    return "-" if r is None else f"x{r:.3f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def format_table(points: Sequence[Point], variant: str) -> str:
    """One row per (layout, devices): per-device temp and args, ratios, step time, grad error.

    ``temp``/``args``: per-device compiled temp/argument bytes of the jitted gradient (MiB).
    ``ratio``: variant temp / stock temp. ``time``: stock's fastest step; ``t min``/``t med``:
    variant / stock step time, min and median of the interleaved runs. ``grad err``:
    max |g - g_stock| / max |g_stock|.
    """
    header = [
        "layout",
        "devices",
        "stock temp",
        f"{variant} temp",
        "ratio",
        "stock args",
        f"{variant} args",
        "stock time",
        "t min",
        "t med",
        "grad err",
    ]
    rows, errors = [], []
    for p in points:
        s, v = p.columns[STOCK], p.columns[variant]
        rows.append(
            [
                p.layout,
                str(p.devices),
                format_mib(s.temp_bytes),
                format_mib(v.temp_bytes),
                _x(p.ratio(variant, "temp_bytes")),
                format_mib(s.argument_bytes),
                format_mib(v.argument_bytes),
                _ms(s.time_min_s),
                _x(p.ratio(variant, "time_min_s")),
                _x(p.ratio(variant, "time_median_s")),
                "-" if v.grad_rel_err is None else f"{v.grad_rel_err:.1e}",
            ]
        )
        errors += [
            f"{p.layout} / {p.devices} / {c.label}: {c.error}"
            for c in p.columns.values()
            if c.error
        ]
    lines = [harness.table(header, rows)]
    if errors:
        lines += ["", "errors:", *(f"  {e}" for e in errors)]
    return "\n".join(lines)


def format_checks(checks: Sequence[Check]) -> str:
    """One ``PASS``/``FAIL`` line per criterion and layout, then the overall verdict."""
    lines = [f"{'PASS' if c.passed else 'FAIL'}  {c.layout}: {c.name}: {c.detail}" for c in checks]
    lines.append("PASS" if all(c.passed for c in checks) else "FAIL")
    return "\n".join(lines)


def to_dict(
    points: Sequence[Point], checks: Sequence[Check], variant: str, config: Config
) -> dict[str, Any]:
    """Every figure of a run, JSON-ready, with the run's environment and configuration."""
    out: dict[str, Any] = {**harness.environment(), "variant": variant}
    out["config"] = dataclasses.asdict(config)
    out["layouts"] = {
        name: {
            "description": layout.description,
            "batch": str(layout.batch),
            "params": {k: str(v) for k, v in layout.params.items()},
        }
        for name, layout in LAYOUTS.items()
        if name in config.layouts
    }
    out["points"] = []
    for p in points:
        columns = {label: dataclasses.asdict(c) for label, c in p.columns.items()}
        columns[variant]["ratios"] = {
            f: p.ratio(variant, f)
            for f in ("temp_bytes", "argument_bytes", "time_min_s", "time_median_s")
        }
        out["points"].append({"layout": p.layout, "devices": p.devices, "columns": columns})
    out["checks"] = [dataclasses.asdict(c) for c in checks]
    out["passed"] = all(c.passed for c in checks)
    return out


# ----------------------------------------------------------------------------------------------
# Command line.


def build_parser() -> argparse.ArgumentParser:
    """Returns the command-line parser."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.spmd",
        description=(
            "Per-device temp bytes and step time of the sharded gradient of a transformer layer "
            "stack, jax.lax.scan (stock) vs a jaxmem scan, under FSDP and tensor parallelism on "
            "1, 2, 4 and 8 devices."
        ),
    )
    p.add_argument("--quick", action="store_true", help=f"small shapes ({QUICK}), for tests")
    p.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write every figure here")
    p.add_argument(
        "--mesh",
        choices=("auto", "explicit"),
        default="auto",
        help="mesh axis types (default auto)",
    )
    p.add_argument(
        "--policy",
        choices=list(POLICIES),
        default="none",
        help="remat policy of the scanned block, for stock and the variant alike (default none)",
    )
    p.add_argument(
        "--variant", default="jaxmem", help="registered variant to compare (default jaxmem)"
    )
    p.add_argument(
        "--layout", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS), help="layouts"
    )
    p.add_argument(
        "--devices",
        nargs="+",
        type=int,
        default=list(DEVICE_COUNTS),
        metavar="N",
        help="device counts (default 1 2 4 8)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=harness.MIN_REPEATS,
        metavar="N",
        help=f"timed runs per column, interleaved (default and minimum {harness.MIN_REPEATS})",
    )
    p.add_argument(
        "--fast-compile",
        action="store_true",
        help="XLA backend optimisation level 0: same memory figures, faster compiles, "
        "unrepresentative step times (for tests)",
    )
    p.add_argument("--no-check", action="store_true", help="exit 0 even when a criterion fails")
    return p


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < harness.MIN_REPEATS:
        parser.error(f"--repeats must be >= {harness.MIN_REPEATS} (docs/design.md §3)")
    shapes = QUICK if args.quick else DEFAULT
    devices = tuple(sorted(set(args.devices)))
    available = jax.device_count()
    if devices[0] < 1 or devices[-1] > available:
        parser.error(
            f"--devices {' '.join(map(str, devices))}: this process has {available} "
            f"{jax.default_backend()} device(s); run as `python -m benchmarks.spmd` (8 host "
            "devices) or set XLA_FLAGS=--xla_force_host_platform_device_count=8 and "
            "JAX_PLATFORMS=cpu before jax starts."
        )
    sizes = {"batch": shapes.batch, "heads": shapes.heads, "D": shapes.d_model, "F": shapes.d_ff}
    for n in devices:
        if any(size % n for size in sizes.values()):
            parser.error(f"{n} devices must divide the sharded sizes {sizes}")
    config = Config(
        shapes,
        devices,
        tuple(args.layout),
        args.mesh,
        args.policy,
        args.repeats,
        args.fast_compile,
    )
    return args, config


def main(
    argv: Sequence[str] | None = None, *, variants: Mapping[str, ScanImpl] | None = None
) -> int:
    """Runs the benchmark, prints the table and the criteria.

    Args:
      argv: command-line arguments (default ``sys.argv[1:]``).
      variants: label -> scan implementation to choose ``--variant`` from; default the
        registered variants available in this install (:func:`benchmarks.cases.variants`).

    Returns:
      The exit status: 0, or 1 if a criterion fails (a column that failed to measure fails its
      criteria) and ``--no-check`` is not given.
    """
    args, config = _parse(argv)
    variants = cases.variants() if variants is None else dict(variants)
    if args.variant not in variants:
        build_parser().error(f"--variant {args.variant!r}: not one of {sorted(variants)}")
    env = harness.environment()
    print(
        f"jax {env['jax_version']} | backend {env['backend']} ({env['device_kind']}, "
        f"{env['device_count']} devices) | {env['date']}\n"
        f"model: prelm_block stack {config.shapes} | mesh axes {config.axis_type} | "
        f"remat policy {config.policy} | stock vs {args.variant} | per-device figures"
        + (" | fast compile: step times not representative" if config.fast_compile else ""),
        flush=True,
    )
    for name in config.layouts:
        print(f"  {name}: {LAYOUTS[name].description}")
    points = run((args.variant, variants[args.variant]), config)
    checks = check(points, args.variant)
    print(format_table(points, args.variant))
    print()
    print(format_checks(checks))
    if args.json is not None:
        data = to_dict(points, checks, args.variant, config)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2, default=harness.json_default) + "\n")
        print(f"wrote {args.json}")
    passed = all(c.passed for c in checks)
    return 0 if passed or args.no_check else 1


if __name__ == "__main__":
    sys.exit(main())
