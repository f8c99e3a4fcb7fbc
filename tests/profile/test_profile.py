"""Tests for jaxmem.profile / jaxmem.compare (src/jaxmem/_src/profile/report.py)."""

import collections
import dataclasses
import inspect
import io
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src.profile.report import ProfileError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def mlp_loss(w1, w2, x):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2))


def scan_loss(w, xs):
    def body(h, x):
        return jnp.tanh(h @ w + x), None

    h, _ = jax.lax.scan(body, jnp.zeros((2, 4)), xs)  # <scan-call>
    return jnp.sum(h)


W1, W2, X = jnp.ones((3, 4)), jnp.ones((4, 6)), jnp.ones((2, 3))

# What tanh's VJP saves: its output and 1 - output before jax 0.11.2, one value
# (one_minus_square of the output) since. The output itself is saved anyway where it feeds a
# matmul whose weight gets a gradient.
OLD_TANH = jax.__version_info__ < (0, 11, 2)
MLP_RESIDUAL_BYTES = 328 if OLD_TANH else 280
W, XS = jnp.ones((4, 4)), jnp.ones((6, 2, 4))

FIELDS = [
    "temp",
    "argument",
    "output",
    "alias",
    "generated_code",
    "host_temp",
    "host_argument",
    "host_output",
    "host_alias",
    "host_generated_code",
]


@pytest.fixture(scope="module")
def mlp_report():
    return jaxmem.profile(mlp_loss, W1, W2, X)


@pytest.fixture(scope="module")
def scan_report():
    return jaxmem.profile(scan_loss, W, XS)


def test_figures_equal_memory_analysis(scan_report):
    stats = jax.jit(scan_loss).lower(W, XS).compile().memory_analysis()
    for f in FIELDS:
        assert getattr(scan_report, f"{f}_bytes") == getattr(stats, f"{f}_size_in_bytes"), f
    # The backend's peak where it counts the temp; XLA:CPU's counts arguments, outputs and
    # constants only, so the report shows the live-range peak of XLA's buffer assignment.
    backend = stats.peak_memory_in_bytes
    if backend >= scan_report.buffers.peak_bytes:
        assert (scan_report.peak_bytes, scan_report.peak_source) == (backend, "backend")
    else:
        assert scan_report.peak_bytes == scan_report.buffers.peak_bytes
        assert scan_report.peak_source == "live ranges"
    assert scan_report.peak_bytes >= scan_report.temp_bytes // 2
    assert scan_report.temp_bytes > 0
    assert scan_report.name == "scan_loss"


def test_mlp_residuals_hand_checked(mlp_report):
    # Derived by hand, confirmed with jax.ad_checkpoint.print_saved_residuals:
    #   x, w1, w2 are kept as arguments (x for dw1, w1 for dx, w2 for dh);
    #   each tanh saves its output `ans` (also the input of the next matmul) and `1 - ans`
    #   (the JVP is g * (1 + ans) * (1 - ans)); since jax 0.11.2 one value, 1 - ans**2, plus
    #   `ans` where the next matmul needs it (h = tanh(x @ w1), for dw2).
    expected = [
        ((3, 4), "float32", 48, "argument"),  # w1
        ((4, 6), "float32", 96, "argument"),  # w2
        ((2, 3), "float32", 24, "argument"),  # x
        ((2, 4), "float32", 32, "other"),  # tanh(x @ w1)
        ((2, 4), "float32", 32, "other"),  # 1 - tanh(x @ w1) (old), 1 - tanh(x @ w1)**2 (new)
        ((2, 6), "float32", 48, "other"),  # 1 - tanh(h @ w2) (old), 1 - tanh(h @ w2)**2 (new)
    ] + [((2, 6), "float32", 48, "other")] * OLD_TANH  # tanh(h @ w2) (old)
    got = [(r.shape, r.dtype, r.bytes, r.origin) for r in mlp_report.residuals]
    assert collections.Counter(got) == collections.Counter(expected)
    sizes = [r.bytes for r in mlp_report.residuals]
    assert sizes == sorted(sizes, reverse=True)
    assert mlp_report.residual_bytes == MLP_RESIDUAL_BYTES
    assert mlp_report.residual_bytes_by_origin == {
        "argument": 168,
        "constant": 0,
        "loop-stacked": 0,
        "other": MLP_RESIDUAL_BYTES - 168,
    }
    for r in mlp_report.residuals:
        if r.origin == "other":
            assert r.function == "mlp_loss"
            assert r.source.startswith(__file__ + ":")
        else:
            assert (r.source, r.function) == ("", "")
            assert r.description.startswith("from the argument")


def test_jitted_fn_same_residuals(mlp_report):
    report = jaxmem.profile(jax.jit(mlp_loss), W1, W2, X)
    assert report.residuals == mlp_report.residuals
    assert report.temp_bytes == mlp_report.temp_bytes


def test_scan_residuals_loop_stacked(scan_report):
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if "# <scan-call>" in text)
    stacked = [r for r in scan_report.residuals if r.origin == "loop-stacked"]
    # carry-in h (for dw), tanh output and 1 - output (1 - output**2 alone since jax 0.11.2),
    # each stacked over T=6 steps
    n_stacks = 3 if OLD_TANH else 2
    assert [(r.shape, r.bytes) for r in stacked] == [((6, 2, 4), 192)] * n_stacks
    for r in stacked:
        assert r.source == f"{__file__}:{line}"
        assert r.function == "scan_loss"
        assert r.description.startswith("output of scan from ")
    assert scan_report.residual_bytes_by_origin["loop-stacked"] == 192 * n_stacks


def test_non_scalar_fn_has_no_residuals():
    report = jaxmem.profile(lambda x: jnp.tanh(x), jnp.ones(4))
    assert report.residuals is None
    assert report.residual_bytes is None
    assert report.residual_bytes_by_origin == {}
    assert "Residuals: not listed, as the function does not return a scalar loss" in str(report)


def test_gradient_report_says_where_the_residuals_are():
    grad = jax.grad(mlp_loss)
    report = jaxmem.profile(grad, W1, W2, X)
    assert report.residuals is None
    stats = jax.jit(grad).lower(W1, W2, X).compile().memory_analysis()
    assert report.temp_bytes == stats.temp_size_in_bytes  # the whole step's figures
    says = (
        "Residuals: not listed, as the function does not return a scalar loss: profile the loss\n"
        "  itself, jaxmem.profile(loss, ...), to list what its gradient saves. The figures above "
        "are\n  this function's whole compiled program (for jax.grad(loss) or a train step: the "
        "forward\n  and the backward pass together)."
    )
    assert says in str(report) and says in report.to_markdown()
    assert "Residuals saved" not in str(report)


def test_integer_scalar_fn_has_no_residuals():
    assert jaxmem.profile(lambda x: jnp.sum(x), jnp.ones(4, jnp.int32)).residuals is None


def test_shape_dtype_struct_args(mlp_report):
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (W1, W2, X)]
    report = jaxmem.profile(mlp_loss, *specs)
    assert report.argument_bytes == mlp_report.argument_bytes == 168
    assert report.residuals == mlp_report.residuals


def test_bf16_kwargs_and_python_scalar():
    def loss(x, *, scale):
        return jnp.sum(jnp.sin(x) * scale)

    report = jaxmem.profile(loss, jax.ShapeDtypeStruct((8,), jnp.bfloat16), scale=2.0)
    assert report.residuals is not None
    # sin(x) (for d scale), cos(x) (for dx), and scale as a bf16 scalar (for dx)
    got = sorted((r.shape, r.dtype, r.bytes) for r in report.residuals)
    assert got == [((), "bfloat16", 2), ((8,), "bfloat16", 16), ((8,), "bfloat16", 16)]


def test_compare_ratios_and_tables():
    cmp = jaxmem.compare({"stock": scan_loss, "remat": jax.checkpoint(scan_loss)}, W, XS)
    assert list(cmp.reports) == ["stock", "remat"]
    assert cmp.baseline == "stock"
    stock, remat = cmp.reports["stock"], cmp.reports["remat"]
    assert (stock.name, remat.name) == ("stock", "remat")
    for field in ["temp_bytes", "argument_bytes", "output_bytes", "peak_bytes", "residual_bytes"]:
        assert cmp.ratio("stock", field) == 1.0
        assert cmp.ratio("remat", field) == getattr(remat, field) / getattr(stock, field)
    assert cmp.ratio("remat", "residual_bytes") < 1.0
    assert cmp.ratio("remat") == remat.temp_bytes / stock.temp_bytes
    assert math.isnan(cmp.ratio("remat", "alias_bytes"))  # 0 / 0
    for text in (str(cmp), cmp.to_markdown()):
        assert "stock" in text and "remat" in text and "×1.00" in text
    d = json.loads(cmp.to_json())
    assert d["ratios"]["remat"]["residual_bytes"] == cmp.ratio("remat", "residual_bytes")
    assert d["ratios"]["remat"]["alias_bytes"] is None
    assert d["reports"]["remat"]["temp_bytes"] == remat.temp_bytes
    with pytest.raises(KeyError, match="nope"):
        cmp.ratio("nope")
    with pytest.raises(ValueError, match="temp"):
        cmp.ratio("stock", "tmp_bytes")


def test_compare_zero_baseline_is_inf():
    fns = {"double": lambda x: x * 2, "cumsum": lambda x: jnp.sum(jnp.cumsum(jnp.sin(x)))}
    cmp = jaxmem.compare(fns, jnp.ones(256))
    assert cmp.reports["double"].temp_bytes == 0 < cmp.reports["cumsum"].temp_bytes
    assert cmp.ratio("cumsum") == math.inf
    assert math.isnan(cmp.ratio("cumsum", "residual_bytes"))  # baseline has no listing
    assert "×inf" in str(cmp)


def test_to_dict_json_roundtrip(mlp_report):
    d = json.loads(mlp_report.to_json())
    assert d == mlp_report.to_dict()
    for f in FIELDS:
        assert d[f"{f}_bytes"] == getattr(mlp_report, f"{f}_bytes")
    assert d["peak_bytes"] == mlp_report.peak_bytes
    assert d["residual_bytes"] == MLP_RESIDUAL_BYTES
    assert d["residual_bytes_by_origin"] == mlp_report.residual_bytes_by_origin
    rebuilt = [jaxmem.Residual(**{**r, "shape": tuple(r["shape"])}) for r in d["residuals"]]
    assert tuple(rebuilt) == mlp_report.residuals


def test_str_and_markdown(mlp_report):
    text = str(mlp_report)
    assert text.startswith("MemoryReport: mlp_loss")
    for f in FIELDS:  # the host_* fields are all zero on CPU: left out, with one line
        assert (f"{f}_bytes" in text) == (not f.startswith("host_")), f
    assert "host_*_bytes: 0 in every field (nothing placed in host memory); rows left out." in text
    assert "peak_bytes" in text
    for r in mlp_report.residuals:
        row = re.escape(str(r.shape)) + r"\s+" + r.dtype + r"\s+" + f"{r.bytes:,}"
        assert re.search(row + r"\s+\S+ B\s+" + r.origin, text), row
    assert re.search(rf"total\s+{MLP_RESIDUAL_BYTES}", text)
    assert "test_profile.py:" in text  # source column
    md = mlp_report.to_markdown()
    assert "| temp_bytes |" in md and "| (4, 6) | float32 | 96 |" in md


def _table_rows(text: str, first: str) -> list[list[str]]:
    """The rows (cells split on 2+ spaces) of the text table under the line ``first``."""
    lines = text.splitlines()
    start = lines.index(first) + 3  # the title, the header, the rule
    rows = []
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_memory_rows_hide_host_fields_only_when_all_zero(mlp_report):
    def fields(report, markdown=False):
        if markdown:
            lines = report.to_markdown().splitlines()
            return [line.split(" | ")[0].lstrip("| ") for line in lines[4:] if "_bytes |" in line]
        return [row[0] for row in _table_rows(str(report), f"MemoryReport: {report.name}")]

    shown = [f"{f}_bytes" for f in FIELDS if not f.startswith("host_")] + ["peak_bytes"]
    assert all(getattr(mlp_report, f"{f}_bytes") == 0 for f in FIELDS if f.startswith("host_"))
    assert fields(mlp_report) == fields(mlp_report, markdown=True) == shown
    note = "host_*_bytes: 0 in every field (nothing placed in host memory); rows left out."
    assert note in str(mlp_report) and note in mlp_report.to_markdown()
    d = mlp_report.to_dict()  # the data keeps every field
    assert {f"{f}_bytes" for f in FIELDS} <= set(d) and d["host_temp_bytes"] == 0
    # One host field not zero (offload on a GPU or TPU): every host row shows, the note does not.
    offloaded = dataclasses.replace(mlp_report, host_output_bytes=4096)
    every = [f"{f}_bytes" for f in FIELDS] + ["peak_bytes"]
    assert fields(offloaded) == fields(offloaded, markdown=True) == every
    assert note not in str(offloaded) and note not in offloaded.to_markdown()
    assert re.search(r"host_output_bytes\s+4,096\s+4.00 KiB", str(offloaded))


def test_plot_bars_hide_zero_host_rows(monkeypatch, mlp_report):
    from jaxmem._src import plots

    drawn, draw = [], plots.bytes_bars

    def capture(labels, values, colors, title, feature):
        drawn.append(dict(zip(labels, values, strict=True)))
        return draw(labels, values, colors, title, feature)

    monkeypatch.setattr(plots, "bytes_bars", capture)
    mlp_report.plot(io.BytesIO())
    dataclasses.replace(mlp_report, host_temp_bytes=512).plot(io.BytesIO())
    stock, offloaded = drawn
    # Zero host, alias and generated-code bars are left out; a non-zero host bar shows.
    assert [k for k in stock if not k.startswith("residual")] == ["temp", "argument", "output"]
    assert offloaded["host temp"] == 512 and "host output" not in offloaded
    assert stock["residual: other"] == MLP_RESIDUAL_BYTES - 168


def _many_residuals(*xs):
    return sum(jnp.sum(jnp.sin(x)) for x in xs)  # each sin saves cos(x): 4 * (i + 1) bytes


def test_long_residual_listings_show_the_largest_and_count_the_rest():
    report = jaxmem.profile(_many_residuals, *[jnp.ones(i + 1) for i in range(13)])
    sizes = [r.bytes for r in report.residuals]
    assert sizes == [4 * n for n in range(13, 0, -1)] and report.residual_bytes == 364
    title = "Residuals saved for the gradient (13, largest first; the 10 largest shown):"
    rows = _table_rows(str(report), title)
    assert [row[:4] for row in rows[:-1]] == [
        [f"({n},)", "float32", f"{4 * n}", f"{4 * n} B"] for n in range(13, 3, -1)
    ]
    assert rows[-1] == ["... 3 more", "24", "24 B"]  # (3,), (2,), (1,): 12 + 8 + 4 bytes
    assert sum(int(row[2]) for row in rows[:-1]) + int(rows[-1][1]) == report.residual_bytes
    md = report.to_markdown()
    assert title in md and "| ... 3 more |  | 24 | 24 B |  |  |  |" in md
    assert md.count("| float32 |") == 10
    # Ten or fewer: every residual, no count line.
    short = jaxmem.profile(_many_residuals, *[jnp.ones(i + 1) for i in range(10)])
    full = "Residuals saved for the gradient (10, largest first):"
    assert len(_table_rows(str(short), full)) == 10 and "more" not in str(short)


def test_human_units():
    report = jaxmem.profile(lambda x: x + 1, jax.ShapeDtypeStruct((3, 2**20), jnp.float32))
    assert report.argument_bytes == 12 * 2**20
    assert "12.00 MiB" in str(report) and f"{12 * 2**20:,}" in str(report)


def test_plot_png(tmp_path, scan_report):
    out = scan_report.plot(tmp_path / "report.png")
    assert out == tmp_path / "report.png"
    assert out.read_bytes()[:8] == PNG_MAGIC
    cmp = jaxmem.compare({"a": scan_loss, "b": jax.checkpoint(scan_loss)}, W, XS)
    out = cmp.plot(str(tmp_path / "cmp.png"))
    data = (tmp_path / "cmp.png").read_bytes()
    assert out == str(tmp_path / "cmp.png") and data[:8] == PNG_MAGIC and len(data) > 1000


def test_plot_without_residuals(tmp_path):
    report = jaxmem.profile(lambda x: x * 2, jnp.ones(4))
    assert report.plot(tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC


# ---- bad input ------------------------------------------------------------------------------


def test_fn_not_callable():
    with pytest.raises(TypeError, match=r"profile: fn must be callable.*got int \(3\)"):
        jaxmem.profile(3, jnp.ones(2))


@pytest.mark.parametrize(
    "args, kwargs, path, what",
    [
        ((jnp.ones(2), {"w": "abc"}), {}, "args[1]['w']", "str ('abc')"),
        ((), {"cfg": [1.0, object()]}, "kwargs['cfg'][1]", "object"),
        ((np.array(["a", "b"]),), {}, "args[0]", "numpy value of dtype <U1"),
    ],
)
def test_untraceable_argument(args, kwargs, path, what):
    called = []

    def fn(*a, **k):
        called.append(1)
        return 0.0

    with pytest.raises(TypeError, match=re.escape(f"argument {path} is a {what}")) as e:
        jaxmem.profile(fn, *args, **kwargs)
    assert "only arrays, scalars and jax.ShapeDtypeStruct can be traced" in str(e.value)
    assert called == []  # checked before tracing


def test_trace_failure_is_chained():
    def broken_loss(x):
        return jnp.sum(x @ x)  # (2, 3) @ (2, 3)

    with pytest.raises(ProfileError, match="'broken_loss'") as e:
        jaxmem.profile(broken_loss, jnp.ones((2, 3)))
    assert isinstance(e.value, RuntimeError)
    assert isinstance(e.value.__cause__, TypeError)


def test_compare_bad_input():
    with pytest.raises(ValueError, match="empty"):
        jaxmem.compare({}, jnp.ones(2))
    with pytest.raises(TypeError, match=r"fns\['fast'\] must be callable.*str"):
        jaxmem.compare({"ok": jnp.sin, "fast": "jnp.cos"}, jnp.ones(2))
    with pytest.raises(TypeError, match="mapping"):
        jaxmem.compare([jnp.sin], jnp.ones(2))
    with pytest.raises(TypeError, match=r"compare: argument args\[0\] is a str"):
        jaxmem.compare({"ok": jnp.sin}, "x")


def test_compare_failure_names_label():
    def broken(x):
        return x @ x

    with pytest.raises(ProfileError, match=r"'lean' \(function 'broken'\)") as e:
        jaxmem.compare({"ok": jnp.sin, "lean": broken}, jnp.ones((2, 3)))
    assert e.value.__cause__ is not None


def test_profile_shows_the_plan_of_each_jaxmem_scan():
    w = jnp.eye(4) * 0.5
    xs, h0 = jnp.ones((6, 2, 4)), jnp.zeros((2, 4))

    def loss(w, xs, h0):
        def step(h, x):
            h = jnp.tanh(h @ w + x)
            return h, h

        _, ys = jaxmem.scan(step, h0, xs, recompute="cheap")
        inner, _ = jaxmem.scan(lambda c, x: (jnp.sin(c) * x, None), h0, xs, recompute="cheap")
        return jnp.sum(ys**2) + jnp.sum(inner)

    report = jaxmem.profile(loss, w, xs, h0)
    assert len(report.scan_plans) == 2
    first, second = report.scan_plans
    alone = jaxmem.scan_residuals(
        lambda h, x: (jnp.tanh(h @ w + x),) * 2, h0, xs, recompute="cheap"
    )

    def kinds(plan):
        return [(r.kind, r.shape, r.bytes) for r in plan.residuals + plan.stacked]

    assert kinds(first) == kinds(alone) and first.stacked_bytes == alone.stacked_bytes
    assert first.stacked_bytes == 6 * 2 * 4 * 4  # the ys, read back; nothing else stacked
    assert second.stacked_bytes == 6 * 2 * 4 * 4  # the carry sequence
    assert first.stacked_bytes < first.stock_stacked_bytes
    assert "jaxmem.scan #1" in str(report)
    assert report.to_dict()["scan_plans"][0]["stacked_bytes"] == first.stacked_bytes
    # No gradient listing (non-scalar output), no plans.
    assert (
        jaxmem.profile(lambda xs: jaxmem.scan(lambda c, x: (c + x, c), h0, xs), xs).scan_plans == ()
    )


# ------------------------------------------------------------------------------------------
# The buffer-level view (XLA's buffer assignment): known answers.


def _marked_line(fn, marker: str) -> str:
    """``file:line`` of the line of ``fn``'s source holding ``marker``."""
    lines, first = inspect.getsourcelines(fn)
    (offset,) = [i for i, text in enumerate(lines) if marker in text]
    return f"{inspect.getsourcefile(fn)}:{first + offset}"


def stacked_loss(w, xs):
    def step(h, x):
        h = jnp.tanh(h @ w + x)  # STACKED: its result is stacked by lax.scan for the gradient
        return h, None

    h, _ = jax.lax.scan(step, xs[0], xs)  # SCAN: lax.scan stacks the carry sequence h, made in step
    return jnp.sum(h)


def outer_loss(w, a, b):
    big = jnp.sin(a[:, None] * b[None, :])  # BIG: f32[256, 1024], kept for dL/dw = big.T @ g
    return jnp.sum(jnp.tanh(big @ w))


def test_peak_buffer_points_at_the_line_that_made_it():
    args = (jnp.ones((1024, 4)), jnp.linspace(0, 1, 256), jnp.linspace(0, 1, 1024))
    report = jaxmem.profile(jax.grad(outer_loss), *args)
    top = report.peak_buffers[0]
    assert top.bytes == 256 * 1024 * 4 and top.kind == "temp"
    assert top.source.startswith(_marked_line(outer_loss, "# BIG") + " ")
    assert report.top_contributors(1)[0].key.startswith(_marked_line(outer_loss, "# BIG"))


@pytest.mark.parametrize("scan", ["lax.scan", "jaxmem.optimize"])
def test_stacked_residuals_point_at_the_line_in_the_step_that_made_them(scan):
    # tanh's residual and the carry sequence (stacked by the loop itself) were both made by the
    # step's line, not by the line that calls the scan, nor by jaxmem's loop.
    w, xs = jnp.eye(64) * 0.5, jnp.ones((256, 32, 64))
    loss = stacked_loss if scan == "lax.scan" else jaxmem.optimize(stacked_loss)
    report = jaxmem.profile(jax.grad(loss), w, xs)
    stacks = [b for b in report.peak_buffers if b.loop_state and b.shape == (256, 32, 64)]
    assert stacks
    assert {b.source.split(" ")[0] for b in stacks} == {_marked_line(stacked_loss, "# STACKED")}
    for b in stacks:  # the call chain: the step, then the loss that runs the scan
        functions = [c.rsplit("(", 1)[-1].rstrip(")") for c in b.chain]
        assert functions[:2] == ["stacked_loss.<locals>.step", "stacked_loss"], b.chain
    assert report.peak_buffers[0].bytes == 256 * 32 * 64 * 4
    assert sum(g.bytes for g in report.top_contributors(100)) == report.buffers.peak_bytes
    # The live bytes at the peak, next to XLA's totals (arguments and the output live throughout
    # here; the rest of the peak is in the temp allocation, whose unused slices make the gap).
    b = report.buffers
    assert b.argument_bytes == report.argument_bytes
    assert b.temp_allocation_bytes == report.temp_bytes
    total = report.argument_bytes + report.output_bytes + report.temp_bytes
    assert report.peak_buffers[0].bytes <= b.peak_bytes <= total
    assert b.peak_bytes >= report.argument_bytes + 0.9 * report.temp_bytes


def test_jaxmem_scan_changes_the_peak():
    """lax.scan stacks tanh's result (and its input); jaxmem.scan keeps the carry sequence
    once: the peak's loop-state bytes fall."""
    w, xs = jnp.eye(64) * 0.5, jnp.ones((256, 32, 64))

    def lean_loss(w, xs):
        h, _ = jaxmem.scan(lambda h, x: (jnp.tanh(h @ w + x), None), xs[0], xs)
        return jnp.sum(h)

    stock = jaxmem.profile(jax.grad(stacked_loss), w, xs)
    lean = jaxmem.profile(jax.grad(lean_loss), w, xs)
    big = 256 * 32 * 64 * 4

    def stacked(report):
        return sum(b.bytes for b in report.peak_buffers if b.bytes >= big)

    assert stacked(lean) < stacked(stock)
    assert lean.peak_bytes < stock.peak_bytes
    text = str(
        jaxmem.compare(
            {"lax.scan": jax.grad(stacked_loss), "jaxmem.scan": jax.grad(lean_loss)}, w, xs
        )
    )
    assert "Peak and its top three contributors:" in text
    assert "lax.scan: peak" in text and "jaxmem.scan: peak" in text


def test_backward_buffers_are_marked():
    w, xs = jnp.eye(16) * 0.5, jnp.ones((8, 4, 16))
    report = jaxmem.profile(jax.grad(stacked_loss), w, xs)
    kinds = {g.backward for g in report.buffers.by_op_name(2)}
    assert kinds == {False, True}


def test_timeline_plot_and_json(tmp_path):
    w, xs = jnp.eye(16) * 0.5, jnp.ones((8, 4, 16))
    report = jaxmem.profile(jax.grad(stacked_loss), w, xs)
    assert max(report.timeline) == report.buffers.peak_bytes
    assert len(report.timeline) == len(report.buffers.program) + 1
    out = report.plot_timeline(tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG" and out == tmp_path / "t.png"
    d = json.loads(report.to_json())
    assert d["buffers"]["peak_bytes"] == report.buffers.peak_bytes
    assert d["buffers"]["peak_buffers"][0]["bytes"] == report.peak_buffers[0].bytes
    assert "Live at the peak:" in str(report)


def test_sharded_buffers_are_per_device():
    if jax.device_count() < 8:
        pytest.skip("needs 8 (CPU) devices")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))
    xs = jax.device_put(jnp.ones((16, 64, 32)), sharding)
    report = jaxmem.profile(jax.grad(stacked_loss), jnp.eye(32) * 0.5, xs)
    assert report.num_devices == 8
    assert all(b.shape[1:2] != (64,) for b in report.peak_buffers if len(b.shape) == 3)
    assert report.buffers.temp_allocation_bytes == report.temp_bytes


def test_unreadable_dump_is_reported_not_hidden(monkeypatch):
    from jaxmem._src.profile import buffers as buffers
    from jaxmem._src.profile import report as profile

    def broken(lowered):
        return lowered.compile(), buffers.BufferDumpError("could not read x.txt (jax 0)")

    monkeypatch.setattr(profile, "compile_with_buffers", broken)
    report = jaxmem.profile(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(8))
    assert report.buffers is None and "x.txt" in report.buffer_error
    assert report.peak_source == "backend"
    with pytest.raises(jaxmem.ProfileError, match="x.txt"):
        _ = report.peak_buffers
    assert "Live at the peak: n/a (could not read x.txt" in str(report)
