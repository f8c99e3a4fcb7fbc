"""Tests of the benchmark harness (``python -m benchmarks.run``) and its cases."""

import json
import time

import jax
import pytest

from benchmarks import cases, harness, run

# The structured saved-residual listing (what jax.ad_checkpoint.print_saved_residuals prints);
# tracing only, nothing compiled.
from jaxmem._src.listing import saved_residuals

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
    return sum(r.bytes for r in listing)


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


# docs/design.md §1's stock figures (MB = 1e6 bytes there): the listing of every jax up to 0.11.1
# holds the first row, of every jax from 0.11.2 on (a residual that is a ys output stored once,
# one residual for tanh instead of two) the second (measured on 0.10.2, 0.11.1, 0.11.2 and
# 0.12.0.1). Every version pyproject allows is on one side or the other.
DESIGN_STOCK_BYTES = (
    ((0, 10, 2), {"rnn_ys": 16.8e6, "transposed_weights": 80.0e6}),
    ((0, 11, 2), {"rnn_ys": 12.6e6, "transposed_weights": 75.5e6}),
)


def design_figures(version: tuple) -> dict:
    """The stock figures for a jax version (the newest row from a version at most ``version``)."""
    rows = [figures for since, figures in DESIGN_STOCK_BYTES if version >= since]
    assert rows, f"jax {version} is older than every figure of docs/design.md §1"
    return rows[-1]


def test_design_figures_cover_every_version():
    assert design_figures((0, 10, 2)) is design_figures((0, 11, 1)) is DESIGN_STOCK_BYTES[0][1]
    assert design_figures((0, 11, 2)) is design_figures((0, 12, 0, 1)) is DESIGN_STOCK_BYTES[1][1]
    with pytest.raises(AssertionError):
        design_figures((0, 10, 1))


@pytest.mark.parametrize("name", ["rnn_ys", "transposed_weights"])
def test_stock_residual_bytes_match_design(name):
    figures = design_figures(tuple(jax.__version_info__))
    # The listing also holds the argument residuals (e.g. W of rnn_ys).
    assert traced_residual_bytes(name) == pytest.approx(figures[name], rel=0.05)


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


def test_one_bytes_unit_mib():
    assert harness.MIB == 2**20
    assert harness.format_mib(48 * 2**20) == "48.0 MiB"
    assert harness.format_mib(16.8e6) == "16.0 MiB"  # docs/design.md's 16.8 MB
    assert harness.format_mib(512 * 2**10) == "0.500 MiB"
    assert harness.format_mib(None) == "-"


def test_table_bytes_are_mib(capsys):
    assert run.main(["--case", "rnn"], variants={}) == 0
    printed = capsys.readouterr().out
    assert " MiB" in printed and " MB" not in printed


def test_timing_is_warm_and_interleaved():
    calls = []

    def fn(label):
        def f(x):
            calls.append(label)
            return x

        return f

    times = harness.time_interleaved({"a": fn("a"), "b": fn("b")}, 1.0, repeats=7)
    # One warm-up run each, then rounds in which each timed run follows a run of itself.
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 7
    assert list(times) == ["a", "b"]
    for t in times.values():
        assert len(t.samples_s) == 7 and t.output == 1.0
        assert t.min_s == min(t.samples_s) <= t.median_s <= max(t.samples_s)
    calls.clear()
    harness.time_interleaved({"a": fn("a"), "b": fn("b")}, 1.0, repeats=2, settle=0)
    assert calls == ["a", "b"] + ["a", "b"] * 2


def test_a_timed_run_does_not_pay_for_the_run_before_it():
    # One function leaves work behind it (a tail that the next run, of any function, waits
    # for); each timed run follows a run of itself, so the tail is charged to its maker.
    pending = [0.0]

    def wait_then_leave(seconds):
        def f(x):
            time.sleep(pending[0])
            pending[0] = seconds
            return x

        return f

    fns = {"tail": wait_then_leave(0.05), "quick": wait_then_leave(0.0)}
    times = harness.time_interleaved(fns, 1.0, repeats=3)
    assert max(times["quick"].samples_s) < 0.04 and min(times["tail"].samples_s) >= 0.05
    plain = harness.time_interleaved(fns, 1.0, repeats=3, settle=0)
    assert min(plain["quick"].samples_s) >= 0.05  # A B A B: quick would pay for tail's
    with pytest.raises(ValueError, match="settle"):
        harness.time_interleaved(fns, 1.0, settle=-1)
