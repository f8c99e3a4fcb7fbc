"""Tests of ``python -m jaxmem demo`` (:mod:`jaxmem.demo`) and the GPT model it profiles."""

import dataclasses
import functools
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem import __main__ as cli
from jaxmem.demo import cli as demo
from jaxmem.demo import models, plots

# A script's test: it runs on the newest set-up only (CI time; conftest.py).
pytestmark = pytest.mark.newest

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--d-ff", "64", "--vocab", "128"]
TINY += ["--seq", "16", "--batch", "2"]


def test_demo_prints_every_configuration_and_writes_a_png(tmp_path, capsys):
    out = tmp_path / "memory.png"
    assert cli.main(["demo", *TINY, "--no-time", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    for label in demo.configurations():
        assert label in printed
        # After the table: each configuration's peak and its top contributors (source lines).
        (peak,) = [line for line in printed.splitlines() if line.startswith(f"  {label}: peak ")]
        assert "(live ranges)" in peak or "(backend)" in peak
        assert re.search(r"\w+\.py:\d+ \(\S+\)", peak), peak  # file:line (function)
    assert "temp" in printed and "residual" in printed
    assert "(backward)" in printed  # the loss's backward pass holds part of some peak
    assert "step time" not in printed  # not with --no-time
    (last,) = [line for line in printed.splitlines() if line.startswith("conclusion: ")]
    assert last.startswith("conclusion: jaxmem.scan, code unchanged: ") and " at " not in last
    width, height = _png_size(out)
    n = len(demo.configurations())
    assert (width, height) == tuple(round(100 * s) for s in plots.figure_size(n, timed=False))
    assert width <= 1800 and height <= 100 * (2 + 0.45 * n)


def test_demo_times_by_default_and_concludes_from_its_table(tmp_path, capsys, monkeypatch):
    # Three configurations and one timed round keep the timed run (full optimization) quick.
    every = demo.configurations()
    configs = {k: every[k] for k in ("no remat", "checkpoint dots_saveable", "jaxmem.scan")}
    monkeypatch.setattr(demo, "configurations", lambda: configs)
    out = tmp_path / "timed.png"
    assert demo.main([*TINY, "--repeats", "1", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step time = median of 1 runs" in printed
    lines = printed.splitlines()
    header = lines.index("ratios (x) to 'no remat'") + 2
    assert lines[header].split() == ["configuration", "temp", "peak", "residual", "step", "time"]
    rows = {}
    for line in lines[header + 2 : header + 5]:
        label, cells = re.match(r"(\S.*?)\s{2,}(\d.*)", line).groups()
        rows[label] = re.findall(r"\(x(\d+\.\d\d)\)", cells)
        assert re.search(r" ms \(x\d+\.\d\d\)$", line), line
    assert list(rows) == list(configs) and rows["no remat"] == ["1.00"] * 4
    assert (
        lines[header + 5].startswith("argument ") and "in every configuration" in lines[header + 5]
    )
    # The conclusion quotes the table's ratios: temp (column 1) and step time (column 4).
    temp, _, _, time_ = rows["jaxmem.scan"]
    dots_temp, _, _, dots_time = rows["checkpoint dots_saveable"]
    (last,) = [line for line in lines if line.startswith("conclusion: ")]
    want = (
        f"conclusion: jaxmem.scan, code unchanged: {temp}x no remat's temp at {time_}x its step "
        f"time; checkpoint dots_saveable {dots_temp}x at {dots_time}x"
    )
    assert last.startswith(want)
    width, height = _png_size(out)
    assert (width, height) == tuple(round(100 * s) for s in plots.figure_size(3, timed=True))
    assert width <= 1800


def test_conclusion_states_the_measured_ratios():
    ratios = {
        "no remat": (1.0, 1.0),
        "checkpoint nothing": (0.28, 1.06),
        "checkpoint dots": (0.51, 0.84),
        "jaxmem.scan": (0.5123, 0.866),
        "jaxmem.scan + selective": (0.47, 0.87),
        "jaxmem.scan + linear CE": (0.34, 0.95),
    }
    stock, lean = ["checkpoint nothing", "checkpoint dots"], list(ratios)[3:]
    assert demo.conclusion(ratios, "no remat", "jaxmem.scan", stock, lean) == (
        "conclusion: jaxmem.scan, code unchanged: 0.51x no remat's temp at 0.87x its step time; "
        "checkpoint nothing 0.28x at 1.06x; checkpoint dots 0.51x at 0.84x"
    )  # nothing jaxmem runs beats either policy: none is as lean and faster
    ratios["jaxmem.scan + selective"] = (0.47, 0.80)
    ratios["jaxmem.scan + linear CE"] = (0.25, 1.0)
    assert demo.conclusion(ratios, "no remat", "jaxmem.scan", stock, lean) == (
        "conclusion: jaxmem.scan, code unchanged: 0.51x no remat's temp at 0.87x its step time; "
        "checkpoint nothing 0.28x at 1.06x; checkpoint dots 0.51x at 0.84x; "
        "jaxmem.scan + linear CE beats checkpoint nothing: 0.25x temp at 1.00x time; "
        "jaxmem.scan + selective beats checkpoint dots: 0.47x temp at 0.80x time"
    )
    ratios["jaxmem.scan + selective"] = (0.47, 0.83)  # within 2% of 0.84: the timing's noise
    assert "beats checkpoint dots" not in demo.conclusion(ratios, "no remat", None, stock, lean)
    untimed = {k: (t, None) for k, (t, _) in ratios.items()}
    assert demo.conclusion(untimed, "no remat", None, stock, lean) == (
        "conclusion: checkpoint nothing 0.28x; checkpoint dots 0.51x"
    )


def test_configurations_are_told_apart_as_stock_or_jaxmem():
    configs = demo.configurations()
    stock = [k for k, c in configs.items() if demo._is_stock(c)]
    assert stock == ["no remat", "checkpoint nothing_saveable", "checkpoint dots_saveable"]


def test_table_rows_and_ratios():
    base = jaxmem.profile(lambda x: jnp.sum(jnp.sin(x)), jax.ShapeDtypeStruct((8,), jnp.float32))
    mib = 2**20

    def report(temp, peak, residual):
        saved = (jaxmem.Residual((residual,), "uint8", residual, "other", "", "", ""),)
        return dataclasses.replace(base, temp_bytes=temp, peak_bytes=peak, residuals=saved)

    comparison = jaxmem.Comparison(
        {"stock": report(4 * mib, 8 * mib, 2 * mib), "lean": report(mib, 6 * mib, mib // 2)}
    )
    assert demo.table(comparison, {"stock": 0.2, "lean": 0.25}).splitlines() == [
        "configuration              temp              peak          residual         step time",
        "-------------  ----------------  ----------------  ----------------  ----------------",
        "stock          4.00 MiB (x1.00)  8.00 MiB (x1.00)  2.00 MiB (x1.00)  200.0 ms (x1.00)",
        "lean           1.00 MiB (x0.25)  6.00 MiB (x0.75)  0.50 MiB (x0.25)  250.0 ms (x1.25)",
        "argument 0.00 MiB, output 0.00 MiB in every configuration",
    ]
    untimed = demo.table(comparison).splitlines()
    assert untimed[0].split() == ["configuration", "temp", "peak", "residual"]


def test_demo_figure_splits_temp_into_saved_residuals_and_other_temp():
    w, x = jax.ShapeDtypeStruct((3, 4), jnp.float32), jax.ShapeDtypeStruct((2, 3), jnp.float32)
    report = jaxmem.profile(lambda w, x: jnp.sum(jnp.sin(x @ w)), w, x)
    # The gradient saves w and x (arguments, alive anyway: not counted) and cos(x @ w).
    assert report.residual_bytes_by_origin["argument"] == 4 * (12 + 6)
    assert plots.saved_residual_bytes(report) == 4 * 8


def _png_size(path: pathlib.Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    # IHDR, the first chunk: width and height, big-endian, at bytes 16-24.
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_python_m_jaxmem_demo_has_the_same_command_line(capsys):
    # The full run is test_demo_prints_every_configuration_and_writes_a_png (same run()).
    result = subprocess.run(
        [sys.executable, "-m", "jaxmem.demo", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert "python -m jaxmem.demo" in result.stdout
    for option in ("--layers", "--d-model", "--heads", "--batch", "--output", "--time"):
        assert option in result.stdout
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--d-model", "32", "--heads", "3"])
    assert exit_info.value.code == 2
    assert "num_heads=3 must divide d_model=32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--batch", "0"])
    assert "--batch must be a positive int" in capsys.readouterr().err


def test_the_library_never_imports_the_demo():
    # STYLE.md 13: the demo lives outside the core; importing jaxmem (and its public
    # namespaces) must not load jaxmem.demo. A fresh interpreter: this one has loaded it.
    code = (
        "import sys, jaxmem, jaxmem.policies, jaxmem.offload, jaxmem.losses, jaxmem.flax.linen, "
        "jaxmem.flax.nnx; print(sorted(m for m in sys.modules if m.startswith('jaxmem.demo')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert result.stdout.strip() == "[]"
    src = pathlib.Path(jaxmem.__file__).parent / "_src"
    for path in [src.parent / "__init__.py", *sorted(src.rglob("*.py"))]:
        assert "jaxmem.demo" not in path.read_text(), f"{path} mentions jaxmem.demo"


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "demo" in printed
    if argv[0] == "demo":
        for option in ("--layers", "--d-model", "--heads", "--d-ff", "--vocab", "--seq"):
            assert option in printed
        assert "--batch" in printed and "demo_memory.png" in printed


def test_bad_sizes_say_how_to_fix(capsys):
    with pytest.raises(ValueError, match="num_heads=3 must divide d_model=32"):
        models.GPTConfig(d_model=32, num_heads=3)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--d-model", "32", "--heads", "3"])
    assert exit_info.value.code == 2
    assert "num_heads=3 must divide d_model=32" in capsys.readouterr().err


def test_configurations_compute_the_same_loss_and_gradient():
    # Scan implementation and remat policy change memory, never values: check against no remat.
    cfg = models.GPTConfig(vocab_size=64, seq_len=8, num_layers=2, d_model=16, num_heads=2, d_ff=32)
    rng = np.random.default_rng(0)  # numpy: initialising with jax would compile more than the test
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
    params = jax.tree.map(
        lambda p: jnp.asarray(0.3 * rng.standard_normal(p.shape), p.dtype),
        models.abstract_params(cfg),
    )
    jit = functools.partial(jax.jit, compiler_options=demo.FAST_COMPILE)  # tiny; compile time rules
    results = {}
    # One remat policy and the last configuration (jaxmem.scan where present) keep this quick.
    configs = demo.configurations()
    for label in dict.fromkeys(["no remat", "checkpoint dots_saveable", list(configs)[-1]]):
        c = configs[label]
        loss = models.next_token_loss(models.GPT(cfg, c.scan_impl, c.policy))
        results[label] = jit(jax.value_and_grad(loss))(params, tokens)
    ref_loss, ref_grads = results.pop("no remat")
    for label, (loss, grads) in results.items():
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=label)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6, err_msg=label)


def test_untied_model_has_a_head():
    cfg = models.GPTConfig(
        vocab_size=64,
        seq_len=8,
        num_layers=1,
        d_model=16,
        num_heads=2,
        d_ff=32,
        tie_embeddings=False,
    )
    params = models.abstract_params(cfg)
    assert params["head"]["kernel"].shape == (16, 64)
    assert params["blocks"]["qkv"]["kernel"].shape[0] == 1
    assert jnp.issubdtype(params["embed"]["embedding"].dtype, jnp.floating)


@pytest.mark.parametrize("tied", [True, False])
def test_linear_ce_loss_equals_the_logits_loss(tied):
    cfg = models.GPTConfig(
        vocab_size=50,
        seq_len=8,
        num_layers=2,
        d_model=16,
        num_heads=2,
        d_ff=32,
        tie_embeddings=tied,
    )
    rng = np.random.default_rng(3)  # numpy, and one compile per loss: op by op is slower
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
    params = jax.tree.map(
        lambda p: jnp.asarray(0.3 * rng.standard_normal(p.shape), p.dtype),
        models.abstract_params(cfg),
    )
    jit = functools.partial(jax.jit, compiler_options=demo.FAST_COMPILE)
    ref = jit(jax.value_and_grad(models.next_token_loss(models.GPT(cfg))))(params, tokens)
    got = jit(jax.value_and_grad(models.linear_ce_next_token_loss(models.GPT(cfg))))(params, tokens)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(a))))
