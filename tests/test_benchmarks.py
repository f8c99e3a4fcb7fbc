"""Tests of the benchmark harness (``python -m benchmarks.run``) and its cases."""

import json
import math

import jax
import numpy as np
import pytest

# The listing behind jax.ad_checkpoint.print_saved_residuals; tracing only, nothing compiled.
from jax._src.ad_checkpoint import saved_residuals

from benchmarks import cases, harness, run

DESIGN_CASES = (
    "rnn_ys",
    "rnn",
    "cast_weights",
    "transposed_weights",
    "prelm_block",
    "prelm_block_dots",
)


def traced_residual_bytes(name: str) -> int:
    """Total bytes of the stock loss's saved-residual listing, from shapes alone."""
    case = cases.CASES[name]
    listing = saved_residuals(case.make_loss(jax.lax.scan), *case.abstract_args())
    return sum(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize for aval, _ in listing)


def test_registry_has_the_design_cases():
    assert set(DESIGN_CASES) <= set(cases.CASES)
    for name in DESIGN_CASES:
        case = cases.CASES[name]
        assert case.name == name
        assert case.description
        assert callable(case.make_loss(jax.lax.scan))


def test_registering_a_name_twice_fails():
    with pytest.raises(ValueError, match="already registered"):
        cases.case(cases._rnn_args, name="rnn_ys")(lambda scan: None)


@pytest.mark.parametrize(
    "name, expected",
    [("rnn_ys", 16.8e6), ("transposed_weights", 80.0e6)],
)
def test_stock_residual_bytes_match_design(name, expected):
    # DESIGN.md section 1; the listing also holds the argument residuals (e.g. W of rnn_ys).
    assert traced_residual_bytes(name) == pytest.approx(expected, rel=0.05)


def test_losses_are_scalars_with_gradients_for_every_argument():
    case = cases.CASES["rnn"]
    args = case.make_args()
    loss = case.make_loss(jax.lax.scan)
    assert loss(*args).shape == ()
    grads = jax.grad(loss, argnums=case.argnums())(*args)
    assert len(grads) == len(args)


def test_json_has_the_figures(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert run.main(["--case", "rnn_ys", "--json", str(out)], variants={}) == 0
    data = json.loads(out.read_text())
    for key in ("jax_version", "backend", "date", "cases"):
        assert data[key]
    assert data["jax_version"] == jax.__version__
    assert list(data["cases"]) == ["rnn_ys"]
    stock = data["cases"]["rnn_ys"]["columns"]["stock"]
    assert list(data["cases"]["rnn_ys"]["columns"]) == ["stock"]
    assert stock["temp_bytes"] > 0
    assert stock["residual_bytes"] == traced_residual_bytes("rnn_ys")
    w_bytes = 256 * 256 * 4  # W is listed as an argument residual
    assert stock["residual_bytes_by_origin"]["argument"] == w_bytes
    assert stock["residual_bytes_non_argument"] == stock["residual_bytes"] - w_bytes
    printed = capsys.readouterr().out
    assert "rnn_ys" in printed and "stock" in printed and str(out) in printed


def test_variant_column_appears_with_ratios_and_times(tmp_path, capsys):
    out = tmp_path / "out.json"
    argv = ["--case", "rnn", "--time", "--repeats", "7", "--json", str(out)]
    assert run.main(argv, variants={"dummy": jax.lax.scan}) == 0
    printed = capsys.readouterr().out
    assert "dummy" in printed
    columns = json.loads(out.read_text())["cases"]["rnn"]["columns"]
    assert list(columns) == ["stock", "dummy"]
    dummy = columns["dummy"]
    assert dummy["temp_bytes"] == columns["stock"]["temp_bytes"]
    assert dummy["ratios"]["temp_bytes"] == 1.0
    assert dummy["ratios"]["residual_bytes"] == 1.0
    assert dummy["time_min_s"] > 0 and dummy["ratios"]["time_median_s"] > 0
    assert dummy["grad_rel_err"] == 0.0


def test_failing_variant_is_reported_not_fatal(capsys):
    def broken_scan(*args, **kwargs):
        raise RuntimeError("broken on purpose")

    assert run.main(["--case", "rnn"], variants={"broken": broken_scan}) == 1
    assert "broken on purpose" in capsys.readouterr().out


def test_stock_label_is_reserved():
    with pytest.raises(ValueError, match="reserved"):
        harness.run_case(cases.CASES["rnn"], {"stock": jax.lax.scan})


def test_too_few_repeats_are_rejected(capsys):
    with pytest.raises(SystemExit):
        run.main(["--case", "rnn", "--time", "--repeats", "3"], variants={})
    assert ">= 7" in capsys.readouterr().err


def test_default_variants_follow_jaxmem():
    import jaxmem

    assert ("jaxmem" in cases.variants()) == hasattr(jaxmem, "scan")
