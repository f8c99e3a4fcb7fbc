"""Tests of the SPMD benchmark (``python -m benchmarks.spmd``): model, criteria, quick run."""

import json

import jax
import numpy as np
import pytest

from benchmarks import cases, spmd
from benchmarks.harness import STOCK, Column

# A script's test: it runs on the newest set-up only (CI time; conftest.py).
pytestmark = pytest.mark.newest


def test_model_is_cases_prelm_block():
    # At cases.prelm_block's sizes the parameters are its own, in the heads layout ...
    params, x = spmd.make_args(spmd.DEFAULT)
    ref_params, ref_x = cases._prelm_args()
    np.testing.assert_array_equal(x, ref_x)
    for k, v in spmd.heads_layout(ref_params, spmd.DEFAULT.heads).items():
        np.testing.assert_array_equal(params[k], v, err_msg=k)
    # ... and the block computes cases._prelm_block (which has cases._LM_H heads).
    params, x = spmd.make_args(spmd.QUICK)
    flat = {**params, "qkv": params["qkv"].reshape(*params["qkv"].shape[:2], -1)}
    flat["o"] = params["o"].reshape(params["o"].shape[0], -1, params["o"].shape[-1])
    p = jax.tree.map(lambda a: a[0], flat)
    got = spmd.block(x, jax.tree.map(lambda a: a[0], spmd.heads_layout(flat, cases._LM_H)))
    np.testing.assert_allclose(got, cases._prelm_block(x, p), rtol=1e-5, atol=1e-5)


def _point(layout, n, stock, variant):
    return spmd.Point(layout, n, {STOCK: Column(STOCK, stock), "v": Column("v", variant)})


def test_criteria():
    points = [_point("fsdp", 1, 100, 50), _point("fsdp", 8, 20, 11)]  # ratio 0.5 -> 0.55
    points += [_point("tp", 1, 100, 50), _point("tp", 8, 100, 70)]  # flat; ratio 0.5 -> 0.7
    points += [_point("bad", 1, 100, 50), _point("bad", 8, 20, None)]  # a failed column
    checks = {(c.layout, c.name.split()[0]): c.passed for c in spmd.check(points, "v")}
    assert checks == {
        ("fsdp", "per-device"): True,
        ("fsdp", "v/stock"): True,
        ("tp", "per-device"): False,
        ("tp", "v/stock"): False,
        ("bad", "per-device"): False,
        ("bad", "v/stock"): False,
    }
    assert spmd.format_checks(spmd.check(points[:2], "v")).splitlines()[-1] == "PASS"


def test_quick_run(tmp_path, capsys):
    out = tmp_path / "spmd.json"
    # --fast-compile: the same memory figures (buffer assignment), compiles about twice as fast.
    argv = ["--quick", "--fast-compile", "--devices", "1", "8", "--json", str(out), "--no-check"]
    assert spmd.main(argv) == 0
    printed = capsys.readouterr().out
    for word in ("fsdp", "tp", "stock temp", "jaxmem temp", "ratio", "grad err", "PASS"):
        assert word in printed
    data = json.loads(out.read_text())
    assert data["jax_version"] == jax.__version__ and data["variant"] == "jaxmem"
    assert data["config"]["devices"] == [1, 8]
    assert [(p["layout"], p["devices"]) for p in data["points"]] == [
        ("fsdp", 1),
        ("fsdp", 8),
        ("tp", 1),
        ("tp", 8),
    ]
    for p in data["points"]:
        stock, ours = p["columns"]["stock"], p["columns"]["jaxmem"]
        for col in (stock, ours):
            assert col["error"] is None
            assert col["temp_bytes"] > 0 and col["time_min_s"] > 0
        assert ours["grad_rel_err"] < 1e-5  # jaxmem's gradients are stock's
        assert ours["ratios"]["temp_bytes"] == ours["temp_bytes"] / stock["temp_bytes"]
    assert len(data["checks"]) == 4 and data["passed"] in (True, False)
    # The figures are per device: FSDP shards every weight matrix and the batch 8 ways.
    fsdp1, fsdp8 = (p["columns"]["stock"] for p in data["points"][:2])
    assert fsdp8["argument_bytes"] < fsdp1["argument_bytes"] / 6


def test_failing_variant_is_reported_not_fatal(capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("broken on purpose")

    argv = ["--quick", "--fast-compile", "--devices", "2", "--layout", "tp", "--variant", "broken"]
    assert spmd.main(argv, variants={"broken": broken}) == 1
    printed = capsys.readouterr().out
    assert "broken on purpose" in printed and "FAIL" in printed


def test_bad_arguments_are_rejected(capsys):
    with pytest.raises(SystemExit):
        spmd.main(["--quick", "--devices", "3"])
    assert "must divide" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        spmd.main(["--quick", "--devices", str(jax.device_count() * 2)])
    assert "device(s)" in capsys.readouterr().err
