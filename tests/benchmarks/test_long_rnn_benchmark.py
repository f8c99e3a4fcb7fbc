"""Tests of the long-scan benchmark (``python -m benchmarks.long_rnn``): case, criteria, quick run.

Structure only (every column present, gradients right, ratios finite), not timing targets.
Equinox is optional: its columns are checked where it imports.
"""

import importlib.util
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import long_rnn
from benchmarks.long_rnn import LAX, LEAN, SQRT, Check, Column, Point

# A script's test: it runs on the newest set-up only (CI time; conftest.py).
pytestmark = pytest.mark.newest

HAS_EQUINOX = importlib.util.find_spec("equinox") is not None


def test_case_is_the_issues_rnn():
    W, U, h0, xs = long_rnn.make_args(long_rnn.DEFAULT.sizes, 3)
    assert (W.shape, U.shape, h0.shape, xs.shape) == ((256, 256), (64, 256), (16, 256), (3, 16, 64))
    h = h0
    for x in xs:
        h = jnp.tanh(h @ W + x @ U)
    loss = long_rnn.make_loss(jax.lax.scan)(W, U, h0, xs)
    np.testing.assert_allclose(loss, jnp.sum(h**2), rtol=1e-5)
    assert len(long_rnn.grad_fn(jax.lax.scan)(W, U, h0, xs)) == 3  # (W, U, h0), not xs


def _point(length, **temps):
    cols = {label: Column(label, temp_bytes=t, time_median_s=1.0) for label, t in temps.items()}
    return Point(length, None, cols)


def test_criteria_pass_fail_and_skip():
    config = long_rnn.DEFAULT
    ours, eqx = long_rnn.checkpointed_label(64), long_rnn.equinox_label(64)
    good = [
        _point(512, **{SQRT: 100}),
        _point(2048, **{LAX: 1000, LEAN: 500, ours: 50, eqx: 50}),
        _point(8192, **{SQRT: 500}),
    ]
    assert [c.verdict for c in long_rnn.check(good, config)] == ["PASS"] * 4
    good[1].columns[eqx].time_median_s = 0.5  # ours is slower than Equinox
    bad = [*good[:2], _point(8192, **{SQRT: 700})]  # sqrt grows 7x
    assert [c.verdict for c in long_rnn.check(bad, config)] == ["PASS", "PASS", "FAIL", "FAIL"]
    # No Equinox column: its criteria are SKIPPED, not PASS; a failed column FAILs.
    del good[1].columns[eqx]
    good[0].columns[SQRT] = Column(SQRT, error="RuntimeError: broken")
    verdicts = [c.verdict for c in long_rnn.check(good, config)]
    assert verdicts == ["PASS", "SKIPPED", "SKIPPED", "FAIL"]
    # A length not measured: SKIPPED.
    assert {c.verdict for c in long_rnn.check(good[1:2], config)} == {"PASS", "SKIPPED"}
    assert long_rnn.passed([Check("a", "PASS", ""), Check("b", "SKIPPED", "")])
    assert (
        long_rnn.format_checks([Check("a", "SKIPPED", "")]).splitlines()[-1] == "PASS (1 skipped)"
    )


def test_tables_name_every_column():
    ours, eqx = long_rnn.checkpointed_label(64), long_rnn.equinox_label(64)
    points = [_point(2048, **{LAX: 1000, LEAN: 500, ours: 50, SQRT: 60, eqx: 50})]
    table = long_rnn.format_main(points, long_rnn.DEFAULT)
    for label in (LAX, LEAN, ours, SQRT, eqx, "temp", "/jaxmem", "t/eqx", "grad err"):
        assert label in table
    sweep = [Point(2048, 64, {LAX: points[0].columns[LAX], ours: points[0].columns[ours]})]
    assert "0.000 MiB" in long_rnn.format_sweep(sweep)  # Equinox absent: "-" in its cells


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_rnn") / "long_rnn.json"
    status = long_rnn.main(["--quick", "--json", str(out), "--no-check"])
    return status, json.loads(out.read_text())


def test_quick_run_has_every_column(quick_run):
    status, data = quick_run
    assert status == 0
    assert data["jax_version"] == jax.__version__ and data["case"] == "long_rnn"
    assert (data["equinox_version"] is not None) == HAS_EQUINOX
    k = long_rnn.QUICK.checkpoints
    expected = [LAX, LEAN, long_rnn.checkpointed_label(k), SQRT]
    expected += [long_rnn.equinox_label(k)] if HAS_EQUINOX else []
    assert [p["length"] for p in data["points"]] == list(long_rnn.QUICK.lengths)
    for p in data["points"]:
        assert list(p["columns"]) == expected
        for label, col in p["columns"].items():
            assert col["error"] is None, (p["length"], label, col["error"])
            assert col["temp_bytes"] > 0 and col["time_median_s"] > 0
            assert col["grad_rel_err"] < 1e-5, (p["length"], label)
            for name in ("temp_bytes_vs_lax", "temp_bytes_vs_jaxmem", "time_median_vs_lax"):
                assert math.isfinite(col["ratios"][name]), (label, name)
            if HAS_EQUINOX:
                assert math.isfinite(col["ratios"]["time_median_vs_equinox"])


def test_quick_run_sweep(quick_run):
    _, data = quick_run
    assert [p["checkpoints"] for p in data["sweep"]] == list(long_rnn.QUICK.sweep)
    for p in data["sweep"]:
        k = p["checkpoints"]
        ours = p["columns"][long_rnn.checkpointed_label(k)]
        assert ours["error"] is None and ours["temp_bytes"] > 0 and ours["time_median_s"] > 0
        assert ours["grad_rel_err"] < 1e-5
        if HAS_EQUINOX:
            eqx = p["columns"][long_rnn.equinox_label(k)]
            assert eqx["error"] is None and eqx["grad_rel_err"] < 1e-5
            assert math.isfinite(ours["ratios"]["temp_bytes_vs_equinox"])


def test_quick_run_checks(quick_run):
    _, data = quick_run
    verdicts = [c["verdict"] for c in data["checks"]]
    assert len(verdicts) == 4 and set(verdicts) <= {"PASS", "FAIL", "SKIPPED"}
    assert ("SKIPPED" in verdicts[1:3]) == (not HAS_EQUINOX)  # Equinox's criteria
    assert verdicts[3] != "SKIPPED"  # both sqrt lengths are measured


def test_too_few_repeats_are_rejected(capsys):
    with pytest.raises(SystemExit):
        long_rnn.main(["--repeats", "3"])
    assert "--repeats must be >=" in capsys.readouterr().err
