"""Tests of ``python -m jaxmem demo`` (:mod:`jaxmem.demo`) and the GPT model it profiles."""

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

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--d-ff", "64", "--vocab", "128"]
TINY += ["--seq", "16", "--batch", "2"]


def test_demo_prints_every_configuration_and_writes_a_png(tmp_path, capsys):
    out = tmp_path / "memory.png"
    assert cli.main(["demo", *TINY, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    for label in demo.configurations():
        assert label in printed
        # After the table: each configuration's peak and its top contributors (source lines).
        (peak,) = [line for line in printed.splitlines() if line.startswith(f"  {label}: peak ")]
        assert "(live ranges)" in peak or "(backend)" in peak
        assert re.search(r"\w+\.py:\d+ \(\S+\)", peak), peak  # file:line (function)
    assert "temp" in printed and "residual" in printed
    assert "(backward)" in printed  # the loss's backward pass holds part of some peak
    assert "step time" not in printed  # only with --time
    width, height = _png_size(out)
    n = len(demo.configurations())
    assert (width, height) == tuple(round(100 * s) for s in plots.figure_size(n, timed=False))
    assert width <= 1800 and height <= 100 * (2 + 0.45 * n)


def test_demo_time_adds_step_times_and_a_second_panel(tmp_path, capsys, monkeypatch):
    # Two configurations keep the timed run (compiled with full optimization) quick.
    configs = dict(list(demo.configurations().items())[:2])
    monkeypatch.setattr(demo, "configurations", lambda: configs)
    monkeypatch.setattr(demo, "TIME_REPEATS", 2)
    out = tmp_path / "timed.png"
    assert demo.main([*TINY, "--time", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step time (median of" in printed
    lines = printed.splitlines()
    for label in configs:
        assert any(line.startswith(f"  {label}: ") and " ms (x" in line for line in lines)
    width, height = _png_size(out)
    assert (width, height) == tuple(round(100 * s) for s in plots.figure_size(2, timed=True))
    assert width <= 1800


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
