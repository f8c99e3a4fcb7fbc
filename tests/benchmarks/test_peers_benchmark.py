"""benchmarks.peers: the quick run prints every case with finite figures, every row's value and
gradients equal to its stock row's, skipping only what is not installed; the cases are what they
say (the Equinox stack is the plain loop of its MLPs); the bars read the right rows."""

import contextlib
import importlib.util
import io
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import peers
from benchmarks.peers import FAIL, PASS, PEER, SKIPPED, STOCK, Result, Row

# A script's test: it runs on the newest set-up only (CI time; conftest.py).
pytestmark = pytest.mark.newest


def _installed(module):
    return importlib.util.find_spec(module) is not None


def _tokamax_has_chunked_xla():
    return _installed("tokamax") and peers._tokamax_chunked_xla(peers._optional("tokamax"))[0]


def _expected_skip(row_label):
    """Why a row may be skipped on this machine, or None when it must be measured."""
    if row_label.startswith("jax-cce") and not _installed("jax_cce"):
        return "jax-cce"
    if row_label == peers.TOKAMAX and not _tokamax_has_chunked_xla():
        return "tokamax"
    return None


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers") / "peers.json"
    capture = {}
    buf = io.StringIO()
    # Flax's Gemma example is written for JAX's default rank promotion (its RMSNorm multiplies
    # [B, T, D] by [D]); the suite's conftest raises on it.
    with jax.numpy_rank_promotion("allow"), contextlib.redirect_stdout(buf):
        capture["status"] = peers.main(["--quick", "--json", str(out)])
    capture["text"] = buf.getvalue()
    capture["json"] = json.loads(out.read_text())
    return capture


def test_quick_run_prints_every_case(quick):
    assert quick["status"] == 0, quick["text"]
    text = quick["text"]
    assert f"jax {jax.__version__}" in text.splitlines()[0]
    for name in quick["json"]["cases"]:
        assert f"\n{name}: " in text, name
    assert "bars (issue 24):" in text
    expected = {f"eqx-mlp {a}" for a in peers.ACTIVATIONS}
    expected |= {"gemma no remat", "gemma nothing", "gemma dots", "cross-entropy"}
    assert expected <= set(quick["json"]["cases"])
    assert any(name.startswith("lm1b no remat") for name in quick["json"]["cases"])


def test_quick_figures_finite_and_gradients_equal_stock(quick):
    data = quick["json"]
    assert data["jax_version"] == jax.__version__
    for name, case in data["cases"].items():
        library = "equinox" if name.startswith("eqx") else "flax"
        if case["skipped"]:
            assert not _installed(library) and library in case["skipped"], (name, case)
            continue
        rows = case["rows"]
        assert rows[0]["role"] == STOCK and rows[0]["temp_over_stock"] == 1.0
        for row in rows:
            where = (name, row["label"])
            if row["skipped"]:
                assert _expected_skip(row["label"]) is not None, where
                continue
            assert row["error"] is None, where
            assert row["temp_bytes"] > 0, where
            assert len(row["samples_s"]) == case["repeats"], where
            assert all(math.isfinite(t) and t > 0 for t in row["samples_s"]), where
            assert math.isfinite(row["temp_over_stock"]) and math.isfinite(row["time_over_stock"])
            if row is not rows[0]:
                assert row["grad_rel_err"] < peers.GRAD_TOL, where
        measured_peers = [r for r in rows if r["role"] == PEER and not r["skipped"]]
        if measured_peers:
            lean = min(measured_peers, key=lambda r: r["temp_bytes"])
            assert case["best_peer_temp"] == lean["label"]


def test_quick_skips_only_what_is_missing(quick):
    ce = quick["json"]["cases"]["cross-entropy"]
    for row in ce["rows"]:
        assert bool(row["skipped"]) == (_expected_skip(row["label"]) is not None), row
    if _installed("jax_cce"):  # its leanest and fastest chunk are marked, once each
        marks = [m for r in ce["rows"] for m in r["marks"]]
        assert sorted(marks) == ["fastest", "leanest"]
    for c in quick["json"]["bars"]:
        assert c["verdict"] in (PASS, FAIL, SKIPPED), c
        # A bar is SKIPPED only where a figure it reads was not measured.
        assert c["verdict"] != SKIPPED or c["detail"] == "not measured", c


def test_equinox_case_is_the_plain_loop_of_its_mlps():
    eqx = pytest.importorskip("equinox")
    case = peers.equinox_case(peers.QUICK, "exact gelu")
    params, x = case.args
    layers, tokens, d, width = peers.QUICK.eqx
    assert x.shape == (tokens, d)
    stock = next(i for i in case.impls if i.role == STOCK)
    value, grads = jax.jit(stock.fn)(params, x)
    # The same stack by hand: layer i is the i-th slice of the vmapped MLPs.
    mlps = eqx.filter_vmap(
        lambda k: eqx.nn.MLP(
            d, d, width, 2, activation=lambda z: jax.nn.gelu(z, approximate=False), key=k
        )
    )(jax.random.split(jax.random.key(0), layers))
    h = x
    for i in range(layers):
        layer = jax.tree.map(lambda a, i=i: a[i] if eqx.is_array(a) else a, mlps)
        shapes = [(lin.weight.shape, lin.bias.shape) for lin in layer.layers]
        assert shapes == [((width, d), (width,)), ((width, width), (width,)), ((d, width), (d,))]
        z = x_i = h
        for j, lin in enumerate(layer.layers):
            z = z @ lin.weight.T + lin.bias[None]
            if j < 2:
                z = jax.nn.gelu(z, approximate=False)
        h = x_i + z
    np.testing.assert_allclose(value, jnp.mean(h**2), rtol=1e-5)
    assert jax.tree.structure(grads[0]) == jax.tree.structure(params)


def _result(name, **temps):
    rows = [Row(label, role, temp_bytes=t) for label, (role, t) in temps.items()]
    return Result(name, "", rows, repeats=0)


def test_bars_read_the_named_rows():
    sizes = peers.QUICK
    auto = peers.autochunk_label(sizes)
    ce = _result(
        "cross-entropy",
        naive=(STOCK, 100),
        **{peers.LCE: ("jaxmem", 10), auto: ("jaxmem", 11), peers.TOKAMAX: (PEER, 12)},
    )
    checks = {c.name: c for c in peers.check([ce], sizes)}
    lce_vs_tokamax = f"cross-entropy: {peers.LCE} temp <= 1x {peers.TOKAMAX}"
    assert checks[lce_vs_tokamax].verdict == PASS
    assert checks[f"cross-entropy: {auto} temp <= 1.1x {peers.LCE}"].verdict == PASS
    # No jax-cce row (not installed): its bar is SKIPPED, not PASS; the time bar is not timed.
    assert checks[f"cross-entropy: {peers.LCE} temp <= 1x leanest jax-cce"].verdict == SKIPPED
    assert checks[f"cross-entropy: {peers.LCE} time <= 1.1x stock"].verdict == SKIPPED
    ce.row(peers.TOKAMAX).temp_bytes = 9
    assert {c.name: c for c in peers.check([ce], sizes)}[lce_vs_tokamax].verdict == FAIL
    # Cases absent from the run are SKIPPED.
    assert all(c.verdict == SKIPPED for c in peers.check([], sizes))


def test_cross_entropy_time_bar_reads_its_own_pair():
    """The cross-entropy's time bar is the pair timed alone (naive and linear_cross_entropy),
    not the ratio among every row, where the memory-bound naive loss runs slower."""
    sizes = peers.QUICK
    ce = _result("cross-entropy", naive=(STOCK, 100), **{peers.LCE: ("jaxmem", 10)})
    ce.stock.samples_s = [2.0] * 3  # among every row: x0.700
    ce.row(peers.LCE).samples_s = [1.4] * 3
    bar = f"cross-entropy: {peers.LCE} time <= 1.1x stock"
    check = {c.name: c for c in peers.check([ce], sizes)}[bar]
    assert (check.verdict, check.detail) == (PASS, "x0.700")
    ce.paired_time[peers.LCE], ce.paired_repeats = 1.108, 21
    check = {c.name: c for c in peers.check([ce], sizes)}[bar]
    assert check.verdict == FAIL and check.detail.startswith("x1.108 (21 rounds, paired")


def test_quick_cross_entropy_time_bar_is_paired(quick):
    ce = quick["json"]["cases"]["cross-entropy"]
    assert ce["paired_repeats"] == peers.QUICK.eqx_repeats
    assert list(ce["paired_time_over_stock"]) == [peers.LCE]
    assert math.isfinite(ce["paired_time_over_stock"][peers.LCE])
    bar = next(c for c in quick["json"]["bars"] if c["name"].endswith("time <= 1.1x stock"))
    assert "paired alone with stock" in bar["detail"]
